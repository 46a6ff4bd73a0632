"""The fast tree walk: predict_proba of the estimator `foreshock train` builds, computed as
scikit-learn computes it, for the model registry (registry.LoadedModel.fast_predictor) and for
training and evaluation (fast_probability).

The estimator is `[PriorShift(] CalibratedClassifierCV(sigmoid, FrozenEstimator(Pipeline(FeatureGuard,
[TrendRatios,] HistGradientBoostingClassifier))) [)]`, any tree count; TrendRatios, a pure row function,
is applied first. The trees are flattened into node arrays that a compiled kernel walks
(predictor/kernels.py, numba: raw thresholds and missing-value directions as scikit-learn's own
predictor decides, the trend ratios computed inside the kernel, rows walked in blocks and in an order
that groups similar rows, split over threads); with `kernel=False`, or without numba, the columns the
trees split on are binned with the model's own bin thresholds (x <= threshold <=> bin <= bin
threshold) into a column-major uint8 matrix that scikit-learn's binned walker reads. Then the same
baseline-plus-trees sum, sigmoid and prior shift as scikit-learn, in the same order, so the
probabilities are the estimator's own. The linear member (model.make_logistic, calibrated) runs as one
folded dot product over signed logs (`LinearFast`, kernels.signed_log_dot). A blend
(`[PriorShift(] LogitBlend(members) [)]`: the trees averaged with the linear member, or a user's model
stacked with a base model) runs each member through its own fast path and then the blend's arithmetic
(`BlendedFast`).

This module and the compiled walk it builds (kernels.CompiledTrees) are the only code that reads
scikit-learn's private attributes (the fitted trees' node arrays, the bin mapper, the baseline
prediction): a scikit-learn that changes them makes FastPredictor.build refuse (the reason logged)
or disagree with predict_proba on its probe matrix at load, and the model then runs the estimator's
own predict_proba, the written reference (tests/test_predictor_speedpaths.py compares the two).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from foreshock.predictor import features as ft

log = logging.getLogger(__name__)


class _BinnedTrees:
    """One fitted binary HistGradientBoostingClassifier (numeric splits only) as binned trees.

    Only the columns some tree splits on are binned (`columns`), and the trees' feature indices are
    renumbered to them: the binned matrix is [n, len(columns)] uint8, column-major, so each tree's
    pass over the rows reads a few contiguous columns.
    """

    def __init__(self, hgb):
        from sklearn.ensemble._hist_gradient_boosting.predictor import TreePredictor

        if getattr(hgb, "n_trees_per_iteration_", None) != 1 or getattr(hgb, "_preprocessor", None) is not None:
            raise TypeError("not a binary, numeric-only HistGradientBoostingClassifier")
        trees = [it[0] for it in hgb._predictors]
        split = [t.nodes[t.nodes["is_leaf"] == 0] for t in trees]
        if any(s["is_categorical"].any() for s in split):
            raise TypeError("categorical splits")
        self.columns = np.unique(np.concatenate([s["feature_idx"] for s in split] + [np.zeros(0, np.intp)]))
        renumber = np.zeros(max(int(self.columns.max()) + 1 if len(self.columns) else 1, 1), dtype=np.intp)
        renumber[self.columns] = np.arange(len(self.columns))
        self.trees = []
        for t in trees:
            nodes = t.nodes.copy()
            inner = nodes["is_leaf"] == 0
            nodes["feature_idx"][inner] = renumber[nodes["feature_idx"][inner]]
            nodes["feature_idx"][~inner] = 0
            self.trees.append(TreePredictor(nodes, t.binned_left_cat_bitsets, t.raw_left_cat_bitsets))
        mapper = hgb._bin_mapper
        self.thresholds = [np.asarray(mapper.bin_thresholds_[f], dtype=np.float64) for f in self.columns]
        self.missing_bin = np.uint8(mapper.missing_values_bin_idx_)
        self.baseline = np.asarray(hgb._baseline_prediction)
        if self.baseline.shape != (1, 1):
            raise TypeError("not a single-output model")

    def binned(self, X: np.ndarray) -> np.ndarray:
        """X [n, F] -> [n, len(columns)] uint8 bins (as the model's bin mapper bins; NaN = missing bin)."""
        cols = np.asfortranarray(X.take(self.columns, axis=1), dtype=np.float64)
        out = np.empty(cols.shape, dtype=np.uint8, order="F")
        for j, thr in enumerate(self.thresholds):
            c = cols[:, j]
            b = np.searchsorted(thr, c, side="left")
            b[np.isnan(c)] = self.missing_bin
            out[:, j] = b
        return out

    def decision(self, X: np.ndarray) -> np.ndarray:
        """The raw score: the baseline plus each tree's leaf value, added in the model's order."""
        B = self.binned(X)
        raw = np.zeros(len(X), dtype=self.baseline.dtype)
        raw += self.baseline[0, 0]
        for t in self.trees:
            raw += t.predict_binned(B, self.missing_bin, 1)
        return raw


def _without_prior_shift(estimator) -> tuple[Any, float | None]:
    """(the estimator inside a model.PriorShift, its scale), or (estimator, None)."""
    from foreshock.predictor import model as mdl

    if type(estimator) is mdl.PriorShift:
        return estimator.estimator, float(estimator.scale)
    return estimator, None


def _prior_shifted(p1: np.ndarray, scale: float) -> np.ndarray:
    """model.PriorShift's arithmetic, in its order: [n, 2] probabilities with the odds divided by scale."""
    p = np.clip(p1, 0.0, 1.0)
    q = p / (p + (1.0 - p) * scale)
    return np.column_stack([1.0 - q, q])


def _sigmoid_calibrated(estimator) -> list[tuple[Any, Any, Any]]:
    """(the fitted estimator, a, b) of each calibrated classifier of a binary, sigmoid-calibrated
    CalibratedClassifierCV (a FrozenEstimator unwrapped). Raises TypeError for any other estimator."""
    from sklearn.calibration import CalibratedClassifierCV, _SigmoidCalibration

    if type(estimator) is not CalibratedClassifierCV or len(estimator.classes_) != 2:
        raise TypeError(f"not a binary CalibratedClassifierCV: {type(estimator).__name__}")
    out = []
    for cc in estimator.calibrated_classifiers_:
        inner = cc.estimator
        inner = getattr(inner, "estimator", inner) if type(inner).__name__ == "FrozenEstimator" else inner
        if cc.method != "sigmoid" or len(cc.calibrators) != 1 or type(cc.calibrators[0]) is not _SigmoidCalibration:
            raise TypeError("not a sigmoid calibration")
        if list(cc.classes) != list(estimator.classes_):
            raise TypeError("classes differ")
        out.append((inner, cc.calibrators[0].a_, cc.calibrators[0].b_))
    if not out:
        raise TypeError("no calibrated classifiers")
    return out


class FastPredictor:
    """predict_proba of [PriorShift(] CalibratedClassifierCV(sigmoid, [FrozenEstimator(] Pipeline(
    FeatureGuard, [TrendRatios,] HistGradientBoostingClassifier) [)]) [)], computed like scikit-learn does it."""

    PROBE_ROWS = 256

    def __init__(self, estimator, *, kernel: bool = True):
        from sklearn.ensemble import HistGradientBoostingClassifier
        from sklearn.pipeline import Pipeline

        from foreshock.predictor import model as mdl

        self.estimator = estimator
        self.kernel = bool(kernel)
        estimator, self.prior_scale = _without_prior_shift(estimator)
        self.members = []   # (compiled trees, a, b) per calibrated classifier
        self.trends = None  # the pipeline's TrendRatios step (applied before the trees), if any
        self._trend_key = None
        compiled = {}
        for inner, a, b in _sigmoid_calibrated(estimator):
            if type(inner) is not Pipeline or len(inner.steps) not in (2, 3):
                raise TypeError("not a Pipeline(FeatureGuard, [TrendRatios,] HistGradientBoostingClassifier)")
            guard, hgb = inner.steps[0][1], inner.steps[-1][1]
            trends = inner.steps[1][1] if len(inner.steps) == 3 else None
            if type(guard) is not mdl.FeatureGuard or type(hgb) is not HistGradientBoostingClassifier or (
                    trends is not None and type(trends) is not mdl.TrendRatios):
                raise TypeError("not a Pipeline(FeatureGuard, [TrendRatios,] HistGradientBoostingClassifier)")
            trend_key = None if trends is None else (tuple(trends.numerator_), tuple(trends.denominator_))
            if self.members and trend_key != self._trend_key:
                raise TypeError("calibrated members with different trend ratios")
            self.trends, self._trend_key = trends, trend_key
            if list(hgb.classes_) != list(estimator.classes_):
                raise TypeError("classes differ")
            if id(hgb) not in compiled:
                compiled[id(hgb)] = self._compile(hgb, trends)
            self.members.append((compiled[id(hgb)], a, b))
        self._pool = None

    def _compile(self, hgb, trends):
        """The compiled walk (kernels.CompiledTrees: trend ratios fused, raw thresholds) when asked for
        (`kernel`) and numba is there, else scikit-learn's binned walker over _BinnedTrees."""
        from foreshock.predictor import kernels

        if self.kernel and kernels.AVAILABLE:
            try:
                return kernels.CompiledTrees(hgb, trends)
            except TypeError as exc:
                log.info("model: no compiled tree walk (%s); using the binned walker", exc)
        return _BinnedTrees(hgb)

    @property
    def compiled(self) -> bool:
        """Whether the trees run in the compiled kernel (else scikit-learn's binned walker)."""
        return type(self.members[0][0]).__name__ == "CompiledTrees"

    def input_columns(self) -> np.ndarray:
        """The input columns the trees read (those a trend ratio they split on is made from included)."""
        cols = np.unique(np.concatenate([m[0].columns for m in self.members]))
        return self.trends.source_columns(cols) if self.trends is not None else cols.astype(np.intp)

    @classmethod
    def build(cls, estimator, n_features: int, *, kernel: bool = True) -> "FastPart | None":
        """The fast path, or None (with the reason logged) when the estimator is of another kind or
        the fast path does not reproduce predict_proba on a probe matrix."""
        try:
            fast = fast_part(estimator, kernel=kernel)
        except (TypeError, AttributeError, ValueError, IndexError) as exc:
            log.info("model: no fast prediction path (%s); using predict_proba", exc)
            return None
        from threadpoolctl import threadpool_limits

        probe = fast.probe(n_features)
        with threadpool_limits(1, user_api="openmp"):   # a few rows: OpenMP start-up would dominate
            want = np.asarray(estimator.predict_proba(probe))
        got = fast.predict_proba(probe)
        if got.shape != want.shape or not np.allclose(got, want, rtol=1e-9, atol=1e-12):
            log.warning("model: the fast prediction path disagrees with predict_proba (max %.3g); using "
                        "predict_proba", float(np.max(np.abs(got - want))) if got.shape == want.shape else np.inf)
            return None
        return fast

    def probe(self, n_features: int) -> np.ndarray:
        """Rows that take every side of the splits: each column at, just around, or off its thresholds, or NaN."""
        rng = np.random.default_rng(0)
        X = rng.standard_normal((self.PROBE_ROWS, n_features)).astype(np.float32)
        trees = self.members[0][0]
        for j, f in enumerate(trees.columns):
            thr = trees.thresholds[j]
            if len(thr) == 0 or f >= n_features:   # a TrendRatios column: probed through its inputs
                continue
            pick = thr[rng.integers(0, len(thr), self.PROBE_ROWS)]
            jitter = rng.choice([-1.0, 0.0, 1.0], self.PROBE_ROWS) * np.maximum(np.abs(pick), 1.0) * 1e-3
            X[:, f] = (pick + jitter).astype(np.float32)
            X[rng.random(self.PROBE_ROWS) < 0.1, f] = np.nan
        return X

    def _p1(self, X: np.ndarray, threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
        from scipy.special import expit

        n = len(X)
        if self.compiled:
            Xt = X   # the kernel computes the trend ratios it reads
        else:
            Xt = self.trends.transform(X) if self.trends is not None else X
        mean = np.zeros((n, 2))
        decisions = {}
        for trees, a, b in self.members:
            d = decisions.get(id(trees))
            if d is None:
                d = decisions[id(trees)] = (trees.decision(Xt, threads=threads) if self.compiled
                                            else trees.decision(Xt))
            p1 = expit(-(a * d + b))
            mean[:, 1] += p1
            mean[:, 0] += 1.0 - p1
        mean /= len(self.members)
        return mean[:, 0], mean[:, 1]

    def predict_proba(self, X: np.ndarray, threads: int = 1) -> np.ndarray:
        X = np.asarray(X, dtype=np.float32)
        if self.compiled:
            return self._proba(X, threads)
        if threads > 1 and len(X) >= 2048:
            from concurrent.futures import ThreadPoolExecutor

            if self._pool is None or self._pool._max_workers != threads:
                self._pool = ThreadPoolExecutor(threads, thread_name_prefix="foreshock-predict")
            # the tree walk releases the GIL: row blocks run side by side
            parts = np.array_split(X, threads)
            return np.concatenate(list(self._pool.map(self._proba, parts)))
        return self._proba(X)

    def _proba(self, X: np.ndarray, threads: int = 1) -> np.ndarray:
        p0, p1 = self._p1(X, threads)
        if self.prior_scale is None:
            return np.column_stack([p0, p1])
        return _prior_shifted(p1, self.prior_scale)


class LinearFast:
    """predict_proba of [PriorShift(] CalibratedClassifierCV(sigmoid, [FrozenEstimator(] Pipeline(
    FeatureGuard, SimpleImputer(constant 0), FunctionTransformer(model._signed_log1p), StandardScaler,
    LogisticRegression) [)]) [)] (model.make_logistic, calibrated as train.py does): the scaling folded
    into the coefficients, one pass over the columns with a nonzero coefficient (kernels.signed_log_dot),
    a zero or missing value costing a compare. It agrees with predict_proba to rounding (the pipeline
    runs in float64 from the log on)."""

    PROBE_ROWS = 256

    def __init__(self, estimator, *, kernel: bool = True):
        from sklearn.impute import SimpleImputer
        from sklearn.linear_model import LogisticRegression
        from sklearn.pipeline import Pipeline
        from sklearn.preprocessing import FunctionTransformer, StandardScaler

        from foreshock.predictor import kernels
        from foreshock.predictor import model as mdl

        self.estimator = estimator
        estimator, self.prior_scale = _without_prior_shift(estimator)
        members = _sigmoid_calibrated(estimator)
        pipe = members[0][0]
        if any(inner is not pipe for inner, _, _ in members):
            raise TypeError("calibrated members with different logistic regressions")
        self.calibrators = [(float(a), float(b)) for _, a, b in members]
        kinds = (mdl.FeatureGuard, SimpleImputer, FunctionTransformer, StandardScaler, LogisticRegression)
        if (type(pipe) is not Pipeline or len(pipe.steps) != len(kinds)
                or any(type(step) is not k for (_, step), k in zip(pipe.steps, kinds))):
            raise TypeError("not a Pipeline(FeatureGuard, SimpleImputer, FunctionTransformer, StandardScaler, "
                            "LogisticRegression)")
        _, imputer, log_step, scaler, logreg = (step for _, step in pipe.steps)
        if (imputer.strategy != "constant" or imputer.fill_value != 0.0 or not imputer.keep_empty_features
                or log_step.func is not mdl._signed_log1p or log_step.inverse_func is not None
                or log_step.kw_args or getattr(log_step, "validate", False)):
            raise TypeError("not the zero imputation and signed log of model.make_logistic")
        if list(logreg.classes_) != list(estimator.classes_) or logreg.coef_.shape[0] != 1:
            raise TypeError("not a binary logistic regression")
        coef = np.asarray(logreg.coef_[0], dtype=np.float64)
        mean = np.zeros_like(coef) if scaler.mean_ is None else np.asarray(scaler.mean_, dtype=np.float64)
        scale = np.ones_like(coef) if scaler.scale_ is None else np.asarray(scaler.scale_, dtype=np.float64)
        w = coef / scale
        self.const = float(logreg.intercept_[0]) - float(np.dot(mean, w))
        self.columns = np.flatnonzero(w != 0.0).astype(np.int64)
        self.weights = np.ascontiguousarray(w[self.columns])
        self.n_inputs = len(coef)
        self.compiled = bool(kernel) and kernels.AVAILABLE
        self._trend_key = None   # BlendedFast's check: no trend ratios here

    def input_columns(self) -> np.ndarray:
        return self.columns.astype(np.intp)

    def probe(self, n_features: int) -> np.ndarray:
        """Rows with zeros, missing values, negatives and values over several orders of magnitude."""
        rng = np.random.default_rng(0)
        X = (rng.standard_normal((self.PROBE_ROWS, n_features)) * 10.0 ** rng.integers(-3, 6, (self.PROBE_ROWS, 1)))
        X[rng.random(X.shape) < 0.3] = 0.0
        X[rng.random(X.shape) < 0.1] = np.nan
        return X.astype(np.float32)

    def decision(self, X: np.ndarray, threads: int = 1) -> np.ndarray:
        """The logistic regression's decision function for X [n, F] (the pipeline's input), float64."""
        from foreshock.predictor import kernels

        X = np.ascontiguousarray(X, dtype=np.float32)
        if X.shape[1] != self.n_inputs:
            raise ValueError(f"X has {X.shape[1]} features; the model expects {self.n_inputs}")
        if not self.compiled:
            return kernels.signed_log_dot_numpy(X, self.columns, self.weights, self.const)
        out = np.empty(len(X), dtype=np.float64)
        kernels.run_rows(kernels.signed_log_dot, len(X), threads, (X, self.columns, self.weights, self.const, out))
        return out

    def predict_proba(self, X: np.ndarray, threads: int = 1) -> np.ndarray:
        from scipy.special import expit

        d = self.decision(X, threads)
        p1 = np.zeros(len(d))
        for a, b in self.calibrators:
            p1 += expit(-(a * d + b))
        p1 /= len(self.calibrators)
        if self.prior_scale is None:
            return np.column_stack([1.0 - p1, p1])
        return _prior_shifted(p1, self.prior_scale)


class BlendedFast:
    """predict_proba of [PriorShift(] LogitBlend(members) [)], each member through its own fast path
    (fast_part: trees, a linear member, another blend) and the blend's own arithmetic
    (model.LogitBlend), so the probabilities are the estimator's."""

    @staticmethod
    def handles(estimator) -> bool:
        from foreshock.predictor import model as mdl

        return type(_without_prior_shift(estimator)[0]) is mdl.LogitBlend

    def __init__(self, estimator, *, kernel: bool = True):
        self.estimator = estimator
        estimator, self.prior_scale = _without_prior_shift(estimator)
        self.parts = [fast_part(member, kernel=kernel) for member in estimator.estimators]
        if len({p._trend_key for p in self.parts if p._trend_key is not None}) > 1:
            raise TypeError("blended members with different trend ratios")
        self.coef = np.asarray(estimator.coef_, dtype=np.float64)
        self.intercept = float(estimator.intercept_)
        self._trend_key = next((p._trend_key for p in self.parts if p._trend_key is not None), None)

    @property
    def compiled(self) -> bool:
        return all(p.compiled for p in self.parts)

    def input_columns(self) -> np.ndarray:
        return np.unique(np.concatenate([p.input_columns() for p in self.parts]))

    def probe(self, n_features: int) -> np.ndarray:
        return np.concatenate([p.probe(n_features) for p in self.parts])

    def predict_proba(self, X: np.ndarray, threads: int = 1) -> np.ndarray:
        from scipy.special import expit

        X = np.asarray(X, dtype=np.float32)
        z = np.full(len(X), 0.0)
        for part, w in zip(self.parts, self.coef):
            p = np.clip(part.predict_proba(X, threads)[:, 1], 1e-9, 1.0 - 1e-9)
            z += (np.log(p) - np.log1p(-p)) * w
        q = expit(z + self.intercept)
        if self.prior_scale is None:
            return np.column_stack([1.0 - q, q])
        return _prior_shifted(q, self.prior_scale)


# what FastPredictor.build returns: one of the fast paths above
FastPart = FastPredictor | LinearFast | BlendedFast


def fast_part(estimator, *, kernel: bool = True):
    """The fast path of one estimator: a blend (BlendedFast), a calibrated logistic regression
    (LinearFast) or calibrated trees (FastPredictor). Raises TypeError (or the error its structure
    check meets) for any other estimator: FastPredictor.build then falls back to predict_proba."""
    if BlendedFast.handles(estimator):
        return BlendedFast(estimator, kernel=kernel)
    try:
        return LinearFast(estimator, kernel=kernel)
    except TypeError:
        return FastPredictor(estimator, kernel=kernel)


def fast_probability(estimator, n_features: int = ft.N_MODEL, threads: int | None = None):
    """X -> [n] probability of class 1, through the fast path when the estimator has the known
    structure (else its predict_proba): for training and evaluation, which score millions of rows."""
    fast = FastPredictor.build(estimator, n_features)
    th = ft.kernel_threads() if threads is None else int(threads)
    if fast is None:
        return lambda X: estimator.predict_proba(X)[:, 1]
    return lambda X: fast.predict_proba(np.asarray(X, dtype=np.float32), threads=th)[:, 1] if len(X) else np.zeros(0)
