"""The job-relative step-time signal: per node and feature step, how slow its ranks are against their job.

Reads `step_times` rows (schema v1, foreshock/schema.py: one rank's step of one job, its whole duration,
its compute part, when it ended), as the simulator writes them and as the service's archive keeps the
samples the Jobs API accepted (service/steptimes.py). Per job (and placement generation) and training
step, the ranks' times are judged against the job's median by foreshock/stepcompare.py, the comparison
the service's fail-slow rule makes, with its default thresholds: the compute part where every rank
of the step measured it, else the whole step. The job's rank count there is the number of its ranks
that reported within the same feature step (the rows carry no registration).

A row belongs to the feature step (signals.STEP_SECONDS) its step ended in. The ranks of one training
step that ended in different feature steps are judged apart, each part on its own, so a feature step's
signal depends on that step's rows only: offline (all rows of a date at once, offline.py) and online
(the rows of one step as it closes, online.py) agree bit for bit. Per node and feature step:

- `steptime_vs_job`: its slowest rank's ratio, a rank's ratio being the median of its judged steps'
  ratios (time over the job's median) in the step; 1.0: as fast as its peers. NaN: no step of a rank
  on the node was judged (it ran no job that reported, or its job has fewer than MIN_RANKS reporting).
- `steptime_slow`, `steptime_judged`: of the judged steps of its slowest rank (the one whose ratio is
  `steptime_vs_job`), how many were slow, and how many were judged (0 where none). A node's one slow GPU
  of eight counts as its own share of slow steps, not an eighth of it.

Step times come in after their steps end (the migrator reports every few seconds, batched): online, a
step's rows are taken until the step OPEN_STEPS after it closes, and rows that come later still are
dropped and counted (late), as late telemetry rows are. The signal of feature step s is that of step
s - LAG_STEPS, offline and online alike, one step more than OPEN_STEPS: online, a step's rows, complete
once the step after it has closed, are judged between that close and the next, on the scorer's judging
thread from its next ingest on, and the scoring round only takes the result. A minute of a 10,000-node
cluster's step times is half a million rows, and judging them takes longer than the whole round may
(benchmarks/results/predictor-steptimes-2026-12-06.md).

Rows that cannot be judged are skipped and counted by reason (`SKIP_REASONS`), never an error: no node,
no job, a duration not finite or not positive, a compute part negative, not finite or longer than the
step, a rank's repeat of a step within a feature step (the first by time, then by value, is kept).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from foreshock import stepcompare
from foreshock.predictor import signals as sg

OPEN_STEPS = 1   # a step's rows are taken online until this many steps after it have closed
LAG_STEPS = 2    # the feature step that reads them: judged in between, off the scoring round
COLUMNS = ("ts", "node", "job", "generation", "rank", "step", "step_seconds", "compute_seconds")
SIGNALS: tuple[sg.BaseSignal, ...] = (
    sg.BaseSignal("steptime_vs_job", "step", "step time against its job's other ranks (its slowest rank)", "x"),
    sg.BaseSignal("steptime_slow", "step", "its slowest rank's steps judged slow against their job", "steps"),
    sg.BaseSignal("steptime_judged", "step", "its slowest rank's steps judged against their job", "steps"),
)
NAMES = tuple(s.name for s in SIGNALS)
SKIP_REASONS = ("no_node", "no_job", "no_time", "bad_step_seconds", "bad_compute_seconds", "repeated")
CHUNK_CELLS = 1 << 22   # (training step, rank) cells judged at a time: bounded memory for a huge job


@dataclass
class NodeMinutes:
    """The signal where it is known: per (node, feature step) row, SIGNALS' values."""
    node: np.ndarray     # [M] node names (object)
    step: np.ndarray     # [M] feature step the rows ended in (ts // STEP_NS), before the lag
    values: np.ndarray   # [M, len(SIGNALS)] float64

    def __len__(self) -> int:
        return len(self.step)

    @classmethod
    def empty(cls) -> "NodeMinutes":
        return cls(np.zeros(0, dtype=object), np.zeros(0, dtype=np.int64), np.zeros((0, len(SIGNALS))))

    @classmethod
    def concat(cls, parts: list["NodeMinutes"]) -> "NodeMinutes":
        parts = [p for p in parts if len(p)]
        if not parts:
            return cls.empty()
        return cls(np.concatenate([p.node for p in parts]), np.concatenate([p.step for p in parts]),
                   np.concatenate([p.values for p in parts]))


def _codes(col: pa.ChunkedArray) -> tuple[np.ndarray, list]:
    """Dictionary codes of a string column (-1: null or empty) and the dictionary."""
    enc = pc.dictionary_encode(col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col)
    words = enc.dictionary.to_pylist()
    codes = enc.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    empty = np.array([not w for w in words] + [True], dtype=bool)   # the last: code -1
    codes[empty[codes]] = -1
    return codes, words


def _order(major: list[np.ndarray], minor: list[np.ndarray]) -> np.ndarray:
    """The permutation np.lexsort gives for the keys major + minor, the first the most significant
    (stable: equal rows keep their order). The integer `major` keys are packed into one int64, each
    offset by its minimum, when the product of their ranges fits, so one sort does the work of
    len(major); the `minor` keys are sorted on only where the packed key repeats. A minute of a
    10,000-node cluster's step times is half a million rows, judged every minute."""
    n = len(major[0])
    spans = [int(k.max()) - int(k.min()) + 1 if n else 1 for k in major]
    if n == 0 or np.prod([float(r) for r in spans]) >= 2.0 ** 62:
        return np.lexsort(tuple(reversed(list(major) + list(minor))))
    packed = np.zeros(n, dtype=np.int64)
    for k, r in zip(major, spans):
        packed *= r
        packed += k.astype(np.int64) - int(k.min())
    order = np.argsort(packed, kind="stable")
    if minor:
        p = packed[order]
        if (p[1:] == p[:-1]).any():
            return np.lexsort(tuple(reversed([packed] + list(minor))))
    return order


def _float(col) -> np.ndarray:
    return col.cast(pa.float64()).to_numpy(zero_copy_only=False).astype(np.float64)


def node_minutes(rows: pa.Table, skipped: Counter | None = None) -> NodeMinutes:
    """The signal of every (node, feature step) the rows tell (module docstring). `skipped` counts the
    rows left out, by reason (SKIP_REASONS)."""
    skipped = Counter() if skipped is None else skipped
    if rows is None or rows.num_rows == 0:
        return NodeMinutes.empty()
    node, node_names = _codes(rows.column("node"))
    job, _ = _codes(rows.column("job"))
    ts_col = rows.column("ts").cast(pa.int64())
    has_ts = ts_col.is_valid().to_numpy(zero_copy_only=False)
    ts = ts_col.fill_null(0).to_numpy(zero_copy_only=False)
    gen = rows.column("generation").cast(pa.int64()).fill_null(-1).to_numpy(zero_copy_only=False)
    rank = rows.column("rank").cast(pa.int64()).fill_null(-1).to_numpy(zero_copy_only=False)
    tstep = rows.column("step").cast(pa.int64()).fill_null(-1).to_numpy(zero_copy_only=False)
    total = _float(rows.column("step_seconds"))
    compute = _float(rows.column("compute_seconds"))   # null: not measured (NaN)
    compute_given = rows.column("compute_seconds").is_valid().to_numpy(zero_copy_only=False)

    keep = np.ones(len(ts), dtype=bool)
    with np.errstate(invalid="ignore"):
        checks = (
            ("no_node", node < 0),
            ("no_job", (job < 0) | (rank < 0) | (tstep < 0)),
            ("no_time", ~has_ts),
            ("bad_step_seconds", ~(np.isfinite(total) & (total > 0))),
            ("bad_compute_seconds", compute_given & ~(np.isfinite(compute) & (compute >= 0) & (compute <= total))),
        )
    for reason, bad in checks:
        bad = bad & keep
        if bad.any():
            skipped[reason] += int(bad.sum())
            keep &= ~bad
    minute = ts // sg.STEP_NS
    idx = np.flatnonzero(keep)
    if not len(idx):
        return NodeMinutes.empty()
    # one order whatever the rows' order: by job, generation, feature step, training step, rank, then
    # the row's time and values, so a repeat keeps the same row offline and online
    order = idx[_order([job[idx], gen[idx], minute[idx], tstep[idx], rank[idx]],
                       [ts[idx], total[idx], np.nan_to_num(compute[idx], nan=-1.0)])]
    key = np.stack([job[order], gen[order], minute[order], tstep[order], rank[order]], axis=1)
    first = np.ones(len(order), dtype=bool)
    first[1:] = np.any(key[1:] != key[:-1], axis=1)
    if not first.all():
        skipped["repeated"] += int((~first).sum())
        order, key = order[first], key[first]

    cells = []   # per judged (training step, rank): node, feature step, job run, rank, ratio, slow
    # a job run: one job under one placement generation
    bounds = np.flatnonzero(np.any(key[1:, :2] != key[:-1, :2], axis=1)) + 1
    for run, (a, b) in enumerate(zip(np.concatenate([[0], bounds]), np.concatenate([bounds, [len(key)]]))):
        cells.append(_judge_run(run, key[a:b], order[a:b], node, total, compute))
    cells = [c for c in cells if c is not None and len(c[0])]
    if not cells:
        return NodeMinutes.empty()
    c_node, c_min, c_run, c_rank, c_ratio, c_slow = (np.concatenate([c[k] for c in cells]) for k in range(6))

    # per (node, feature step, job run, rank): the median of the rank's ratios; per (node, feature step):
    # the largest of those, and that rank's slow and judged counts. The cells are grouped by their integer
    # keys alone, and each group's few ratios sorted apart (_group_medians): sorting every cell on the
    # ratio too is a lexsort (the packed key repeats in every group), a third of the judging's time.
    o = _order([c_node, c_min, c_run, c_rank], [])
    c_node, c_min, c_run, c_rank, c_ratio, c_slow = (a[o] for a in (c_node, c_min, c_run, c_rank, c_ratio, c_slow))
    new_group = np.ones(len(o), dtype=bool)
    new_group[1:] = (c_node[1:] != c_node[:-1]) | (c_min[1:] != c_min[:-1]) | (c_run[1:] != c_run[:-1]) \
        | (c_rank[1:] != c_rank[:-1])
    start = np.flatnonzero(new_group)
    n = np.diff(np.append(start, len(c_ratio)))
    rank_ratio = _group_medians(c_ratio, start, n)
    r_node, r_min = c_node[start], c_min[start]
    nm = np.stack([r_node, r_min], axis=1)
    nstart = np.flatnonzero(np.concatenate([[True], np.any(nm[1:] != nm[:-1], axis=1)]))
    worst = np.maximum.reduceat(rank_ratio, nstart)
    # the slow and judged counts are the slowest rank's: one slow GPU of eight is its node's fault as much
    # as eight slow ones are, where it would count 1/8 among all. Of ranks as slow, the one with the most
    # slow steps, then the most judged: ranks that tie on all three give the same values, so the choice
    # does not depend on the cells' order (job codes differ between the offline and online rows)
    member = np.repeat(np.arange(len(nstart)), np.diff(np.append(nstart, len(rank_ratio))))
    rank_slow = np.add.reduceat(c_slow.astype(np.float64), start)
    by = np.lexsort((n, rank_slow, rank_ratio, member))
    chosen = by[np.flatnonzero(np.append(member[by][1:] != member[by][:-1], True))]
    slow, judged = rank_slow[chosen], n[chosen].astype(np.float64)
    names = np.array(node_names, dtype=object)[r_node[nstart]]
    return NodeMinutes(names, r_min[nstart].astype(np.int64), np.stack([worst, slow, judged], axis=1))


def _group_medians(values: np.ndarray, start: np.ndarray, n: np.ndarray) -> np.ndarray:
    """The median of each group of `values` (the n[i] values from start[i]; every n >= 1): the middle
    value of the group sorted, the mean of the middle two of an even count. The groups of one size are
    sorted together, as the rows of one matrix, so the cost is that of the values, not of the groups."""
    out = np.empty(len(start))
    if not len(start):
        return out
    by_size = np.argsort(n, kind="stable")
    sizes = n[by_size]
    cut = np.flatnonzero(np.concatenate([[True], sizes[1:] != sizes[:-1], [True]]))
    for a, b in zip(cut[:-1].tolist(), cut[1:].tolist()):
        size, which = int(sizes[a]), by_size[a:b]
        block = np.sort(values[start[which, None] + np.arange(size)], axis=1)
        out[which] = (block[:, (size - 1) // 2] + block[:, size // 2]) / 2.0
    return out


def _judge_run(run: int, key: np.ndarray, rows: np.ndarray, node: np.ndarray, total: np.ndarray,
               compute: np.ndarray):
    """One job run's rows (key: job, generation, feature step, training step, rank; sorted) judged by
    stepcompare: its judged cells as (node, feature step, run, rank, ratio, slow) arrays."""
    ranks, col = np.unique(key[:, 4], return_inverse=True)
    width = len(ranks)
    step_key = key[:, 2:4]
    new_step = np.concatenate([[True], np.any(step_key[1:] != step_key[:-1], axis=1)])
    g = np.cumsum(new_step) - 1                      # the row's (feature step, training step) group
    n_groups = int(g[-1]) + 1
    g_minute = key[new_step, 2]
    # the job's ranks reporting in each feature step: distinct (feature step, rank) pairs
    pairs = np.unique(key[:, 2] * (width + 1) + col)
    minutes, per_minute = np.unique(pairs // (width + 1), return_counts=True)
    g_ranks = per_minute[np.searchsorted(minutes, g_minute)]
    out = []
    per_chunk = max(1, CHUNK_CELLS // width)
    for lo in range(0, n_groups, per_chunk):
        hi = min(n_groups, lo + per_chunk)
        sel = (g >= lo) & (g < hi)
        gi, ci, ri = g[sel] - lo, col[sel], rows[sel]
        t = np.full((hi - lo, width), np.nan)
        c = np.full((hi - lo, width), np.nan)
        nd = np.full((hi - lo, width), -1, dtype=np.int64)
        t[gi, ci] = total[ri]
        c[gi, ci] = compute[ri]
        nd[gi, ci] = node[ri]
        got = stepcompare.compare(t, c, g_ranks[lo:hi])
        jr = np.flatnonzero(got.judged)
        jj, rr = np.nonzero(~np.isnan(got.x))
        if not len(jj):
            continue
        out.append((nd[jr[jj], rr], g_minute[lo + jr[jj]], np.full(len(jj), run, dtype=np.int64),
                    ranks[rr], got.ratio[jj, rr], got.slow[jj, rr]))
    if not out:
        return None
    return tuple(np.concatenate([o[k] for o in out]) for k in range(6))


def lagged(minutes: NodeMinutes) -> NodeMinutes:
    """The same values at the feature steps that read them (LAG_STEPS later)."""
    return NodeMinutes(minutes.node, minutes.step + LAG_STEPS, minutes.values)


def empty_values(t: int) -> np.ndarray:
    """[t, len(SIGNALS)]: no step judged (ratio unknown, nothing counted)."""
    out = np.zeros((t, len(SIGNALS)))
    out[:, 0] = np.nan
    return out


__all__ = ["NodeMinutes", "node_minutes", "lagged", "empty_values", "SIGNALS", "NAMES", "LAG_STEPS", "OPEN_STEPS",
           "SKIP_REASONS"]
