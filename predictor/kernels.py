"""Compiled kernels (numba) for the online scorer's hot path: the tree walk, the linear member's
signed-log dot product, and the one-step features.

The tree walk and the features reproduce, bit for bit, arithmetic that is also written in numpy
(treewalk._BinnedTrees and scikit-learn's predict_proba for the trees, features._compute_step_numpy
for the features): the same IEEE operations on the same float64/float32 operands in the same order,
no fast-math, no fused multiply-add, and anything transcendental (the EWMA bias correction's power)
computed by numpy outside the kernel. The signed-log dot agrees with its numpy reference and with
scikit-learn's pipeline to rounding only (libm's log1p and the order of a sum: ~1e-15 relative), which
its one consumer, a logistic regression's decision, cannot tell apart.
tests/test_predictor_speedpaths.py and tests/test_predictor_skew.py compare them.

The kernels are `nogil`: callers split rows into blocks and run them on a thread pool (numba's own
parallel layers are not safe to enter from several Python threads at once). Compiled once and cached
on disk beside this file (numba's cache); `AVAILABLE` is False when numba cannot be imported, and
the callers then use their numpy paths (slower, identical results), as they do when built with
`kernel=False` (features.compute, online.OnlineScorer, treewalk.FastPredictor): those paths are the
written reference.
"""

from __future__ import annotations

import logging
import math

import numpy as np

log = logging.getLogger(__name__)

try:  # pragma: no cover - exercised by whichever environment runs the tests
    import numba
    AVAILABLE = True
except Exception as exc:  # noqa: BLE001 - any import failure means: use the numpy paths
    numba = None
    AVAILABLE = False
    log.info("numba unavailable (%s): the predictor uses its numpy paths", exc)


def _njit(fn):
    if numba is None:
        return fn
    return numba.njit(nogil=True, cache=True)(fn)


def _njit_inline(fn):
    # small helpers, inlined into the kernels that call them: a call costs several times their work
    if numba is None:
        return fn
    return numba.njit(nogil=True, cache=True, inline="always")(fn)


def _njit_ieee(fn):
    # a division by zero gives numpy's inf or NaN instead of raising ZeroDivisionError
    if numba is None:
        return fn
    return numba.njit(nogil=True, cache=True, error_model="numpy")(fn)


_POOL = None


def run_rows(fn, n: int, threads: int, args: tuple, min_rows: int = 2048) -> None:
    """fn(*args, lo, hi) over rows 0..n, split into `threads` contiguous blocks run side by side (the
    kernels release the GIL): the first on this thread, the others on the pool; one call on this
    thread when n is small or threads is 1."""
    global _POOL
    if threads <= 1 or n < min_rows:
        fn(*args, 0, n)
        return
    from concurrent.futures import ThreadPoolExecutor

    if _POOL is None or _POOL._max_workers < threads - 1:
        _POOL = ThreadPoolExecutor(threads - 1, thread_name_prefix="foreshock-kernel")
    bounds = np.linspace(0, n, threads + 1).astype(np.int64)
    # this thread takes a block instead of waiting: handing every block to the pool cost the round
    # 5-8 ms of wake-ups
    futures = [_POOL.submit(fn, *args, int(bounds[k]), int(bounds[k + 1])) for k in range(1, threads)]
    try:
        fn(*args, int(bounds[0]), int(bounds[1]))
    finally:
        for f in futures:
            f.result()


# -- trees -------------------------------------------------------------------------------------------
ROW_BLOCK = 64   # rows walked together: their used columns (64 x ~100 float32) stay in L1 with one tree


@_njit
def walk_trees(X, src, num, num_scale, den, den_scale, eps, node, thr, value, starts, baseline, rows, out,
               lo, hi):
    """Raw scores of rows rows[lo..hi] of X: baseline + each tree's leaf value, added in tree order,
    into out[rows[...]]. The caller orders `rows` so that similar rows are walked one after another:
    they take the same branches, which the CPU then predicts (half the time on a mixed cluster).

    X [n, F] float32. The trees read U used columns: src[j] >= 0 is column src[j] of X, src[j] < 0
    the trend ratio q = -src[j] - 1, (X[num[q]] * num_scale[q] + eps) / (X[den[q]] * den_scale[q] + eps)
    in float32 (model.TrendRatios). Nodes of all trees in one array, each tree breadth-first so that
    a node's right child is its left child + 1: node (int64, -1 at a leaf, else left child << 17 |
    used-column index << 1 | 1 where a missing value goes left), thr (the float64 threshold: x <= thr
    goes left), value (a leaf's value). starts[t] is tree t's root. As scikit-learn's raw-data
    predictor decides. The three fields a split reads share one word, not three arrays, so a level
    reads one cache line fewer (benchmarks/results/predictor-round-2026-12-07.md).
    """
    U = src.shape[0]
    T = starts.shape[0]
    K = ROW_BLOCK
    ext = np.empty((K, U), dtype=np.float32)
    acc = np.empty(K, dtype=np.float64)
    for b0 in range(lo, hi, K):
        m = min(K, hi - b0)
        for k in range(m):
            r = rows[b0 + k]
            for j in range(U):
                s = src[j]
                if s >= 0:
                    ext[k, j] = X[r, s]
                else:
                    q = -s - 1
                    ext[k, j] = (X[r, num[q]] * num_scale[q] + eps) / (X[r, den[q]] * den_scale[q] + eps)
            acc[k] = 0.0
            acc[k] += baseline
        for t in range(T):
            root = starts[t]
            for k in range(m):
                nd = root
                w = node[nd]
                while w >= 0:
                    x = ext[k, (w >> 1) & 0xFFFF]
                    if x != x:
                        go_left = (w & 1) != 0
                    else:
                        go_left = x <= thr[nd]
                    c = w >> 17
                    nd = c if go_left else c + 1
                    w = node[nd]
                acc[k] += value[nd]
        for k in range(m):
            out[rows[b0 + k]] = acc[k]


SORT_KEYS = 6        # the most common root split columns, by which rows are ordered for the walk
WALK_MIN_ROWS = 256  # fewer rows are walked on one thread
SORT_MIN_ROWS = 512


class CompiledTrees:
    """One fitted binary HistGradientBoostingClassifier (numeric splits), with the TrendRatios step
    before it if any, as flat node arrays for walk_trees."""

    def __init__(self, hgb, trends=None):
        if not AVAILABLE:
            raise TypeError("numba unavailable")
        if getattr(hgb, "n_trees_per_iteration_", None) != 1 or getattr(hgb, "_preprocessor", None) is not None:
            raise TypeError("not a binary, numeric-only HistGradientBoostingClassifier")
        trees = [it[0] for it in hgb._predictors]
        if any((t.nodes["is_categorical"] & (t.nodes["is_leaf"] == 0)).any() for t in trees):
            raise TypeError("categorical splits")
        inner = [t.nodes["feature_idx"][t.nodes["is_leaf"] == 0] for t in trees]
        self.columns = np.unique(np.concatenate(inner + [np.zeros(0, np.intp)])).astype(np.int64)
        self.n_inputs = int(trends.n_features_in_) if trends is not None else None
        if trends is not None:
            n_in = self.n_inputs
            if len(self.columns) and self.columns.max() >= n_in + len(trends.numerator_):
                raise TypeError("a split on a column the trend ratios do not make")
            self.src = np.where(self.columns < n_in, self.columns, -(self.columns - n_in) - 1).astype(np.int64)
            self.trend_args = (np.asarray(trends.numerator_, dtype=np.int64),
                               np.asarray(trends.numerator_scale_, dtype=np.float32),
                               np.asarray(trends.denominator_, dtype=np.int64),
                               np.asarray(trends.denominator_scale_, dtype=np.float32),
                               np.float32(trends.eps))
        else:
            self.src = self.columns.copy()
            self.trend_args = (np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, np.int64),
                               np.zeros(0, np.float32), np.float32(0.0))
        used = np.full(int(self.columns.max()) + 1 if len(self.columns) else 1, -1, dtype=np.int64)
        used[self.columns] = np.arange(len(self.columns))
        feat, thr, mgl, child, value, starts = [], [], [], [], [], []
        offset = 0
        for t in trees:
            nodes = t.nodes
            order, pos = [0], {0: 0}
            q = 0
            while q < len(order):   # breadth-first: the two children of a node are adjacent
                o = order[q]
                q += 1
                if not nodes["is_leaf"][o]:
                    for c in (int(nodes["left"][o]), int(nodes["right"][o])):
                        pos[c] = len(order)
                        order.append(c)
            nn = nodes[np.asarray(order)]
            leaf = nn["is_leaf"].astype(bool)
            left = np.array([pos[int(v)] for v in nn["left"][~leaf]], dtype=np.int64)
            ch = np.full(len(nn), -1, dtype=np.int64)
            ch[~leaf] = left + offset
            starts.append(offset)
            feat.append(np.where(leaf, 0, used[np.where(leaf, self.columns[0] if len(self.columns) else 0,
                                                        nn["feature_idx"])]))
            thr.append(np.where(leaf, np.inf, nn["num_threshold"]))
            mgl.append(np.where(leaf, 1, nn["missing_go_to_left"]))
            child.append(ch)
            value.append(nn["value"])
            offset += len(nn)
        cat = np.concatenate
        self.feat = cat(feat).astype(np.int32)
        self.thr = cat(thr).astype(np.float64)
        self.value = cat(value).astype(np.float64)
        self.starts = np.asarray(starts, dtype=np.int32)
        if len(self.columns) > 0xFFFF:
            raise TypeError(f"{len(self.columns)} columns split on; the walk packs at most 65,535")
        left = cat(child).astype(np.int64)
        inner_nodes = left >= 0
        self.node = np.where(inner_nodes, (left << 17) | (self.feat.astype(np.int64) << 1)
                             | cat(mgl).astype(np.int64), -1)
        roots = np.bincount(self.feat[self.starts], minlength=len(self.columns))
        self.sort_columns = [int(j) for j in np.argsort(-roots, kind="stable")[:SORT_KEYS] if roots[j] > 0]
        # per used column, its split thresholds (FastPredictor.probe puts rows on and around them)
        finite = inner_nodes & np.isfinite(self.thr)
        self.thresholds = [np.unique(self.thr[finite & (self.feat == j)]) for j in range(len(self.columns))]
        base = np.asarray(hgb._baseline_prediction)
        if base.shape != (1, 1):
            raise TypeError("not a single-output model")
        self.baseline = float(base[0, 0])
        self.baseline_dtype = base.dtype
        # load both of the walk's compiled forms now (contiguous rows, and rows inside wider ones), not
        # in the first scoring round
        width = self.n_inputs if self.n_inputs is not None else int(self.src.max(initial=0)) + 1
        wide = np.zeros((2, width + 1), dtype=np.float32)
        self.decision(wide[:, :width])
        self.decision(np.ascontiguousarray(wide[:, :width]))

    def decision(self, X: np.ndarray, threads: int = 1) -> np.ndarray:
        """Raw scores of X [n, F] (the pipeline's input, before trend ratios), as float64."""
        X = np.asarray(X, dtype=np.float32)
        if X.ndim != 2 or X.strides[1] != X.itemsize:
            X = np.ascontiguousarray(X)   # rows of unit-stride columns are walked where they are (a
                                          # model's leading columns of full-width rows: no copy)
        if self.n_inputs is not None and X.shape[1] != self.n_inputs:
            raise ValueError(f"X has {X.shape[1]} features; the model expects {self.n_inputs}")
        if len(self.src) and X.shape[1] <= int(self.src[self.src >= 0].max(initial=-1)):
            raise ValueError(f"X has {X.shape[1]} features; the trees read column {int(self.src.max())}")
        out = np.empty(len(X), dtype=np.float64)
        rows = self.walk_order(X)
        # a row costs microseconds (every tree): a few hundred rows (an explanation's) are worth two threads
        run_rows(walk_trees, len(X), threads, (X, self.src, *self.trend_args, self.node, self.thr, self.value,
                                               self.starts, self.baseline, rows, out),
                 min_rows=WALK_MIN_ROWS)
        return out

    def walk_order(self, X: np.ndarray) -> np.ndarray:
        """Rows sorted by the columns most trees split on first (only the order of the walk changes,
        never a result)."""
        if len(X) < SORT_MIN_ROWS or not self.sort_columns:
            return np.arange(len(X), dtype=np.int64)
        num, num_scale, den, den_scale, eps = self.trend_args
        keys = []
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            for j in reversed(self.sort_columns):          # np.lexsort: the last key is the primary one
                s = int(self.src[j])
                if s >= 0:
                    keys.append(X[:, s])
                else:
                    q = -s - 1
                    keys.append((X[:, num[q]] * num_scale[q] + eps) / (X[:, den[q]] * den_scale[q] + eps))
        return np.lexsort([np.nan_to_num(k, nan=-np.inf) for k in keys]).astype(np.int64)


# -- a linear member --------------------------------------------------------------------------------
@_njit
def signed_log_dot(X, cols, w, c, out, lo, hi):
    """out[i] = c + sum_k w[k] * sign(x) * log1p(|x|), x = float64(X[i, cols[k]]), a NaN taken as 0, for
    rows lo..hi: model.make_logistic's decision with its scaling folded into w and c
    (treewalk.LinearFast). A zero or missing value adds nothing, so quiet counters cost one compare."""
    K = cols.shape[0]
    for i in range(lo, hi):
        s = 0.0
        for k in range(K):
            x = np.float64(X[i, cols[k]])
            if x == x and x != 0.0:
                t = np.log1p(abs(x))
                s += w[k] * (t if x > 0.0 else -t)
        out[i] = c + s


def signed_log_dot_numpy(X: np.ndarray, cols: np.ndarray, w: np.ndarray, c: float) -> np.ndarray:
    """signed_log_dot over all rows in numpy (the written reference; used without numba)."""
    Z = np.asarray(X, dtype=np.float32)[:, cols].astype(np.float64)
    Z[np.isnan(Z)] = 0.0
    return c + (np.sign(Z) * np.log1p(np.abs(Z))) @ w


# -- one-step features ----------------------------------------------------------------------------
@_njit
def feature_step(x, sum_idx, cnt_pos, base_pos, rise_pos, peer_pos, gauge_idx, since_idx,
                 cum, cumv, ring, ringv, head, z, zr, den_base, den_recent, hist, last_event, st,
                 ewma_alpha, recent_alpha, eps, minutes_per_step, since_cap, out, lo, hi):
    """features._compute_step_numpy for nodes lo..hi, written per node; updates the state rows of those
    nodes in place (cum, cumv, ring[head], ringv[head], z, zr, last_event). den_base/den_recent are the
    EWMA bias corrections (1 - (1 - alpha) ** seen), computed by numpy; hist the gauges' carried maximum."""
    R = ring.shape[0]
    K = sum_idx.shape[0]
    h5 = (head - 5) % R
    h25 = (head - 25) % R
    h30 = head % R
    nan = np.nan
    xs = np.empty(K)
    vs = np.empty(K)
    c = np.empty(K)
    cv = np.empty(K)
    for i in range(lo, hi):
        for j in range(K):
            v = x[i, sum_idx[j]]
            if v != v:
                xs[j] = 0.0
                vs[j] = 0.0
            else:
                xs[j] = v
                vs[j] = 1.0
            c[j] = cum[i, j] + xs[j]
            cv[j] = cumv[i, j] + vs[j]
        col = 0
        for q in range(cnt_pos.shape[0]):
            j = cnt_pos[q]
            out[i, col] = xs[j] if vs[j] != 0.0 else nan
            n5 = cv[j] - ringv[h5, i, j]
            out[i, col + 1] = (c[j] - ring[h5, i, j]) if n5 > 0 else nan
            n30 = cv[j] - ringv[h30, i, j]
            out[i, col + 2] = (c[j] - ring[h30, i, j]) if n30 > 0 else nan
            col += 3
        nb = base_pos.shape[0]
        for q in range(nb):
            j = base_pos[q]
            xb = xs[j]
            y = ewma_alpha * xb + z[i, q]
            yr = recent_alpha * xb + zr[i, q]
            baseline = y / den_base[i]
            recent = yr / den_recent[i]
            z[i, q] = (1.0 - ewma_alpha) * y
            zr[i, q] = (1.0 - recent_alpha) * yr
            nb30 = cv[j] - ringv[h30, i, j]
            b30 = c[j] - ring[h30, i, j]
            rate30 = b30 / max(nb30, 1.0) if nb30 > 0 else nan
            base_eps = baseline + eps
            out[i, col + q] = (rate30 + eps) / base_eps
            out[i, col + nb + q] = (recent + eps) / base_eps
        col += 2 * nb
        for q in range(gauge_idx.shape[0]):
            g = x[i, gauge_idx[q]]
            hv = hist[i, q]
            if hv != hv:
                gm = g
            elif g != g:
                gm = hv
            else:
                gm = g if g >= hv else hv
            out[i, col] = g
            out[i, col + 1] = gm
            col += 2
        for q in range(rise_pos.shape[0]):
            j = rise_pos[q]
            ra = c[j] - ring[h5, i, j]
            rn = cv[j] - ringv[h5, i, j]
            old_a = ring[h25, i, j] - ring[h30, i, j]
            old_n = ringv[h25, i, j] - ringv[h30, i, j]
            out[i, col] = (ra / rn - old_a / old_n) if (rn > 0 and old_n > 0) else nan
            col += 1
        for q in range(since_idx.shape[0]):
            v = x[i, since_idx[q]]
            last = last_event[i, q]
            if v > 0 and st > last:   # nan_to_num(NaN) = 0: not an event
                last = st
            last_event[i, q] = last
            out[i, col] = min((st - last) * minutes_per_step, since_cap)
            col += 1
        for q in range(peer_pos.shape[0]):
            j = peer_pos[q]
            pn5 = cv[j] - ringv[h5, i, j]
            pn30 = cv[j] - ringv[h30, i, j]
            out[i, col] = ((c[j] - ring[h5, i, j]) / max(pn5, 1.0)) if pn5 > 0 else nan
            out[i, col + 1] = ((c[j] - ring[h30, i, j]) / max(pn30, 1.0)) if pn30 > 0 else nan
            col += 2
        for j in range(K):
            cum[i, j] = c[j]
            cumv[i, j] = cv[j]
            ring[head, i, j] = c[j]
            ringv[head, i, j] = cv[j]



@_njit_inline
def _nan_to_num(v):
    # np.nan_to_num's values: NaN -> 0, +-inf -> the largest finite double of its sign
    if v != v:
        return 0.0
    if v == np.inf:
        return 1.7976931348623157e308
    if v == -np.inf:
        return -1.7976931348623157e308
    return v


@_njit_inline
def _unsafe(v, limit):
    # not a whole number within +-limit (NaN, infinite, fractional, -0.0): a running sum of it may not
    # be numpy's sum
    return not (v == np.floor(v) and abs(v) <= limit) or (v == 0.0 and math.copysign(1.0, v) < 0.0)


@_njit
def feature_rest_step(x, decayed_idx, steady_idx, context_idx, step_time_idx, fabric_idx, n_flags,
                      zd, za, zar, zc, tring, thead, fring, fhead, flast, sums, unsafe, peak, limit,
                      den_base, den_recent, decayed_keep, ewma_alpha, recent_alpha, st, history,
                      minutes_per_step, since_cap, min_judged_steps, min_judged, decayed_col, steady_col,
                      step_time_col, fabric_col, context_col, out, lo, hi):
    """The one-step columns after kernels.feature_step's, for nodes lo..hi: features._decayed_step,
    _steady_step, _step_times, _fabric and _context_step (the numpy references) written per node, in
    their arithmetic and order. Updates the state rows of those nodes in place (zd, za, zar, zc,
    flast, tring[thead], fring[fhead], sums, unsafe); the caller advances thead and fhead.

    The rings' window sums come from features._RingSums: `sums` [N, 2 + 2C] (tring's count columns,
    then fring's, over the slots), exact while the node's `unsafe` count is 0; otherwise the node's
    slots are added slot 0 first, as numpy's reduction over the ring's first axis adds them. `peak`
    [N] is the maximum of tring's ratio column over its slots."""
    G = tring.shape[0]
    nc = fring.shape[2] // 2
    w = 2 + 2 * nc
    nan = np.nan
    ninf = -np.inf
    start = st - history
    tot = np.empty(w)
    cur = np.empty(w)
    old = np.empty(w)
    for i in range(lo, hi):
        for q in range(decayed_idx.shape[0]):
            v = x[i, decayed_idx[q]]
            y = (0.0 if v != v else v) + zd[i, q]
            out[i, decayed_col + q] = y
            zd[i, q] = decayed_keep * y
        for q in range(steady_idx.shape[0]):
            counted = 1.0 if x[i, steady_idx[q]] > 0 else 0.0
            y = ewma_alpha * counted + za[i, q]
            za[i, q] = (1.0 - ewma_alpha) * y
            yr = recent_alpha * counted + zar[i, q]
            zar[i, q] = (1.0 - recent_alpha) * yr
            out[i, steady_col + q] = yr / den_recent[i] - y / den_base[i]
        # the values entering the rings: step times [0] the ratio (NaN: none), [1] slow and [2] judged
        # counts (unknown: 0); per SXid class its count (unknown: 0), then whether known
        r0 = x[i, step_time_idx[0]]
        cur[0] = _nan_to_num(x[i, step_time_idx[1]])
        cur[1] = _nan_to_num(x[i, step_time_idx[2]])
        for q in range(nc):
            v = x[i, fabric_idx[n_flags + q]]
            cur[2 + q] = v if v == v else 0.0
            cur[2 + nc + q] = 1.0 if v == v else 0.0
        old[0] = tring[thead, i, 1]
        old[1] = tring[thead, i, 2]
        for q in range(2 * nc):
            old[2 + q] = fring[fhead, i, q]
        was = unsafe[i]
        if was == 0:
            for c in range(w):
                tot[c] = sums[i, c]
        else:
            for c in range(w):
                tot[c] = tring[0, i, 1 + c] if c < 2 else fring[0, i, c - 2]
            for k in range(1, G):
                for c in range(w):
                    tot[c] += tring[k, i, 1 + c] if c < 2 else fring[k, i, c - 2]
        # step times
        m5 = nan
        for k in range(1, 5):
            m5 = _fmax(m5, tring[(thead - k) % G, i, 0])
        slow = tot[0] + cur[0]
        judged = tot[1] + cur[1]
        out[i, step_time_col] = _fmax(m5, r0)
        out[i, step_time_col + 1] = _fmax(peak[i], r0)
        share = nan
        if judged >= min_judged:
            steps_judged = 1.0 if cur[1] > 0 else 0.0     # the window's steps with a judged training step
            for k in range(G):
                if tring[k, i, 2] > 0:
                    steps_judged += 1.0
            if steps_judged >= min_judged_steps:
                share = slow / judged
        out[i, step_time_col + 2] = share
        # the fabric: flags (1, 0, NaN), then SXid counts
        for q in range(n_flags):
            f = x[i, fabric_idx[q]]
            s1 = st if f > 0 else ninf
            s2 = st if f == f else ninf
            a = flast[i, q]
            b = flast[i, n_flags + q]
            a = a if a >= s1 else s1
            b = b if b >= s2 else s2
            flast[i, q] = a
            flast[i, n_flags + q] = b
            out[i, fabric_col + 2 * q] = f
            out[i, fabric_col + 2 * q + 1] = 1.0 if a > start else (0.0 if b > start else nan)
        c0 = fabric_col + 2 * n_flags
        for q in range(nc):
            v = x[i, fabric_idx[n_flags + q]]
            s3 = st if (v == v and v > 0) else ninf
            a = flast[i, 2 * n_flags + q]
            a = a if a >= s3 else s3
            flast[i, 2 * n_flags + q] = a
            total = tot[2 + q] + cur[2 + q]
            known = tot[2 + nc + q] + cur[2 + nc + q]
            out[i, c0 + 3 * q] = v
            out[i, c0 + 3 * q + 1] = total if known > 0 else nan
            out[i, c0 + 3 * q + 2] = min((st - a) * minutes_per_step, since_cap)
        for q in range(context_idx.shape[0]):
            y = ewma_alpha * _nan_to_num(x[i, context_idx[q]]) + zc[i, q]
            zc[i, q] = (1.0 - ewma_alpha) * y
            out[i, context_col + q] = y / den_base[i]
        # the rings move on: the new slots replace the oldest, in the rings and in the running sums
        # (unsafe counts the slots of either ring holding a value that is not whole)
        now = was
        if _unsafe(old[0], limit) or _unsafe(old[1], limit):
            now -= 1
        if _unsafe(cur[0], limit) or _unsafe(cur[1], limit):
            now += 1
        f_old = False
        f_cur = False
        for c in range(2, w):
            f_old = f_old or _unsafe(old[c], limit)
            f_cur = f_cur or _unsafe(cur[c], limit)
        now += (1 if f_cur else 0) - (1 if f_old else 0)
        if now == 0:
            if was == 0:
                for c in range(w):
                    sums[i, c] = (sums[i, c] - old[c]) + cur[c]
            else:   # the last values that were not whole leave: the other slots and the new ones are
                for c in range(w):
                    sums[i, c] = cur[c]
                for k in range(G):
                    if k != thead:
                        sums[i, 0] += tring[k, i, 1]
                        sums[i, 1] += tring[k, i, 2]
                    if k != fhead:
                        for c in range(2, w):
                            sums[i, c] += fring[k, i, c - 2]
        unsafe[i] = now
        tring[thead, i, 0] = r0
        tring[thead, i, 1] = cur[0]
        tring[thead, i, 2] = cur[1]
        for q in range(2 * nc):
            fring[fhead, i, q] = cur[2 + q]


@_njit_inline
def _fmax(a, b):
    # np.fmax: the other operand where one is NaN
    if a != a:
        return b
    if b != b:
        return a
    return a if a >= b else b


@_njit_inline
def _fmin(a, b):
    # np.fmin: the other operand where one is NaN
    if a != a:
        return b
    if b != b:
        return a
    return a if a <= b else b



@_njit
def across_entities(per_entity, use_max, idx, values, j):
    """online._across_entities for the rows idx of a [node, entity] array, into values[:, j]: per row,
    np.fmax (use_max) or np.fmin over its entity columns in column order; NaN for a row past the
    array's."""
    R = per_entity.shape[0]
    C = per_entity.shape[1]
    for k in range(idx.shape[0]):
        i = idx[k]
        r = np.nan
        if i < R:
            for c in range(C):
                r = _fmax(r, per_entity[i, c]) if use_max else _fmin(r, per_entity[i, c])
        values[k, j] = r



@_njit
def scatter_columns(src, dest, values, helpers):
    """signals.finish's column copies of one table's block, row by row: column j of src into column
    dest[j] of values, or, dest[j] < 0, into column -dest[j] - 1 of helpers."""
    for i in range(src.shape[0]):
        for j in range(src.shape[1]):
            d = dest[j]
            if d >= 0:
                values[i, d] = src[i, j]
            else:
                helpers[i, -d - 1] = src[i, j]



@_njit_ieee
def derive_columns(values, helpers, ops):
    """signals.finish's derived signals, row by row: per ops row (kind, result column, a, b, c), the
    operands read as scatter_columns' dest; kind 0: a - b, 1: a / b, 2: floor(a * b / c) where c > 0
    (else NaN), 3: a / b where b > 0 (else NaN), 4: a - b / c where c > 0 (else NaN). Every result is
    computed from the row before any is written back, as the numpy path does."""
    k = ops.shape[0]
    got = np.empty(k)
    for i in range(values.shape[0]):
        for r in range(k):
            kind = ops[r, 0]
            # the operand reads written out: a helper function here costs 20x the loop
            w = ops[r, 2]
            a = values[i, w] if w >= 0 else helpers[i, -w - 1]
            w = ops[r, 3]
            b = values[i, w] if w >= 0 else helpers[i, -w - 1]
            if kind == 0:
                v = a - b
            elif kind == 1:
                v = a / b
            elif kind == 2:
                w = ops[r, 4]
                c = values[i, w] if w >= 0 else helpers[i, -w - 1]
                v = np.floor(a * b / c) if c > 0 else np.nan
            elif kind == 4:
                w = ops[r, 4]
                c = values[i, w] if w >= 0 else helpers[i, -w - 1]
                v = a - b / c if c > 0 else np.nan
            else:
                v = a / b if b > 0 else np.nan
            got[r] = v
        for r in range(k):
            values[i, ops[r, 1]] = got[r]



@_njit_inline
def _nansum(x, i, cols):
    # np.nansum over a row's few columns: the first value, plus the rest added from -0.0 in order
    # (numpy's reduction of a short row)
    v = x[i, cols[0]]
    first = 0.0 if v != v else v
    rest = -0.0
    for j in range(1, cols.shape[0]):
        v = x[i, cols[j]]
        rest += 0.0 if v != v else v
    return first + rest if cols.shape[0] > 1 else first


@_njit
def peer_inputs_step(x, link_cols, traffic_cols, retrans_col, gpu_cols, temp_col, clock_col, context_cols,
                     own, present):
    """features.peer_inputs of one step's signals x [N, signals.STEP_NAMES] into own [N, I], and
    whether each node reported anything (a value not NaN) into present [N]."""
    for i in range(x.shape[0]):
        own[i, 0] = _nansum(x, i, link_cols)
        own[i, 1] = _nansum(x, i, traffic_cols)
        own[i, 2] = _nan_to_num(x[i, retrans_col])
        own[i, 3] = _nansum(x, i, gpu_cols)
        own[i, 4] = _nan_to_num(x[i, temp_col])
        own[i, 5] = _nan_to_num(x[i, clock_col])
        for c in range(context_cols.shape[0]):
            own[i, 6 + c] = _nan_to_num(x[i, context_cols[c]])
        seen = False
        for j in range(x.shape[1]):
            if x[i, j] == x[i, j]:
                seen = True
                break
        present[i] = seen


@_njit_ieee
def peer_signals_step(own, present, leaf, job, site, leaf_cnt, leaf_tot, leaf_nz, job_cnt, job_tot, job_nz,
                      site_cnt, site_tot, context_inputs, n_peer, out):
    """features.peer_signals for one step, row by row: the same expressions on the same operands (its
    np.where branches taken per row), into out [N, PEER_WIDTH]. leaf/job/site: each node's group code
    (-1: none); *_cnt, *_tot, *_nz: its group's totals (self included)."""
    nan = np.nan
    for i in range(own.shape[0]):
        pres = present[i]
        p = 1.0 if pres else 0.0
        for c in range(out.shape[1]):
            out[i, c] = nan
        # leaf switch
        others = leaf_cnt[i] - p
        ok = leaf[i] >= 0 and others > 0
        own_nz = (1.0 if own[i, 0] > 0 else 0.0) * p
        if ok:
            out[i, 0] = (leaf_nz[i, 0] - own_nz) / others
            if pres:
                mean_others = (leaf_tot[i, 0] - own[i, 0] * p) / others
                out[i, 1] = (own[i, 0] + 1.0) / (mean_others + 1.0)
            for c in range(context_inputs.shape[0]):
                k = context_inputs[c]
                out[i, n_peer + c] = (leaf_tot[i, k] - own[i, k] * p) / others
        # job: traffic, GPU errors, temperature, clock
        others = job_cnt[i] - p
        ok = job[i] >= 0 and others > 0 and pres
        if ok:
            mean_others = (job_tot[i, 1] - own[i, 1] * p) / others
            if mean_others > 0:
                out[i, 2] = own[i, 1] / mean_others
            mean_others = (job_tot[i, 3] - own[i, 3] * p) / others
            out[i, 4] = (own[i, 3] + 1.0) / (mean_others + 1.0)
        for col in range(5, 7):
            k = col - 1
            own_known = own[i, k] > 0
            reporting = job_nz[i, k] - (1.0 if own_known else 0.0) * p
            if job[i] >= 0 and reporting > 0 and pres and own_known:
                mean_others = (job_tot[i, k] - own[i, k] * p) / reporting
                out[i, col] = own[i, k] / mean_others if col == 6 else own[i, k] - mean_others
        # site
        others = site_cnt[i] - p
        if site[i] >= 0 and others > 0:
            out[i, 3] = (site_tot[i, 2] - own[i, 2] * p) / others
        if not pres:
            for c in range(n_peer):
                out[i, c] = nan


@_njit
def assemble_signals(x, peers, step_times, n_base, n_peer, out):
    """features.all_signals of one step, row by row: out [N, S] = the base signals of x, the peer
    signals, the step-time signals, the rest of x (the fabric's), the rest of peers (the context)."""
    nx = x.shape[1]
    npr = peers.shape[1]
    nt = step_times.shape[1]
    for i in range(x.shape[0]):
        c = 0
        for j in range(n_base):
            out[i, c] = x[i, j]
            c += 1
        for j in range(n_peer):
            out[i, c] = peers[i, j]
            c += 1
        for j in range(nt):
            out[i, c] = step_times[i, j]
            c += 1
        for j in range(n_base, nx):
            out[i, c] = x[i, j]
            c += 1
        for j in range(n_peer, npr):
            out[i, c] = peers[i, j]
            c += 1


@_njit
def group_totals(codes, present, own, cnt_out, tot_out, nz_out):
    """online.group_totals_lookup's numpy (bincount) arithmetic as loops: the same additions in the
    same (node) order, so the same sums. codes [N] (-1: no group), present [N], own [N, C]."""
    n, nc = own.shape
    g = 1
    for i in range(n):
        if codes[i] + 1 > g:
            g = codes[i] + 1
    cnt = np.zeros(g)
    tot = np.zeros((g, nc))
    nz = np.zeros((g, nc))
    for i in range(n):
        c = codes[i]
        if c >= 0 and present[i]:
            cnt[c] += 1.0
            for k in range(nc):
                tot[c, k] += own[i, k]
                nz[c, k] += 1.0 if own[i, k] > 0 else 0.0
    for i in range(n):
        c = codes[i] if codes[i] >= 0 else 0
        cnt_out[i] = cnt[c]
        for k in range(nc):
            tot_out[i, k] = tot[c, k]
            nz_out[i, k] = nz[c, k]


_WARM = False


def warm_up() -> None:
    """Load (or compile) the round's kernels (features, frames, join, peers) now, on one-node throwaway
    data: the service's first scoring round would otherwise pay it (numba loads its cache on first
    call, 0.3-0.6 s; a first compile takes seconds). The tree walk is loaded with the model."""
    global _WARM
    if _WARM or not AVAILABLE:
        return
    from foreshock.predictor import features as ft
    from foreshock.predictor import online

    from foreshock.predictor import signals as sg

    state = ft.FeatureState.empty(1)
    ft._compute_step(np.zeros((1, len(ft.ALL_NAMES))), np.array([0]), state)
    one = np.zeros((1, 1))
    for use_max in (True, False):
        across_entities(one, use_max, np.zeros(1, dtype=np.int64), one.copy(), 0)
    keys = np.zeros(1, dtype=np.int64)
    sg.finish([sg.StepSignals(keys, tuple(n for n, _, _ in sg.REDUCTIONS[t]), np.zeros((1, len(sg.REDUCTIONS[t]))))
               for t in ("gpu", "host_net")], kernel=True)
    x = np.zeros((1, 1, len(sg.STEP_NAMES)))
    own, present = ft.step_inputs(x, kernel=True)
    codes = {g: np.zeros(1, dtype=np.int64) for g in ft.PEER_GROUPS}
    totals = {g: online.group_totals_lookup(c, present[:, 0], own[:, 0]) for g, c in codes.items()}
    peers = ft.peer_signals(own[:, 0], present[:, 0], codes, totals, kernel=True)
    ft.all_signals(x, peers[:, None], np.zeros((1, 1, 3)), kernel=True)
    _WARM = True


__all__ = ["AVAILABLE", "CompiledTrees", "walk_trees", "signed_log_dot", "signed_log_dot_numpy", "feature_step",
           "feature_rest_step", "across_entities", "scatter_columns", "derive_columns", "peer_inputs_step",
           "peer_signals_step", "assemble_signals", "group_totals", "warm_up"]
