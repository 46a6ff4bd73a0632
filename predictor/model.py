"""The estimators: the gradient-boosted model, and the two baselines every evaluation compares it with.

* `make_model()`: a scikit-learn Pipeline (FeatureGuard -> TrendRatios -> HistGradientBoostingClassifier).
  TrendRatios appends ratios of the windowed features (is an error rate rising, has it lasted hours or
  just minutes), which trees cannot form from the separate windows on their own. Training
  (train.py) wraps the fitted pipeline in CalibratedClassifierCV(FrozenEstimator(...), sigmoid),
  fitted on a later, held-out time slice, so probabilities are calibrated to the true base rate.
* `RuleBaseline`: DCGM-health-style thresholds (any fatal Xid, uncorrected ECC, a row-remap failure,
  a link down, a GPU lost, PCIe width degraded, thermal slowdown, early-warning Xids): its score is the
  share of conditions met in the last 5 minutes, so it too has a precision-recall curve.
* `HardEvidence`: states of the hardware, or of a node its job waits for (HARD_EVIDENCE_CONDITIONS), that
  alarm whatever the model's score: the manifest's `hard_evidence` names them for a model
  (registry.LoadedModel.hard_evidence).
* `make_logistic()`: logistic regression on log1p-scaled features (missing values as 0).
* `LogitBlend`: fitted models stacked on their logits. `foreshock train` stacks the model of a user's
  history with the shipped model (weights fitted), so a small history leans on what the shipped model
  learnt; with `--linear-member` it averages the trees with the logistic regression (declared equal
  weights, one scale and offset fitted; off by default, docs/predictor.md, "The linear member").

Inputs are feature matrices in the estimator's column order: features.MODEL_FEATURE_NAMES, or a longer
prefix of features.FEATURE_NAMES that also reads the first STEADINESS columns, or the STEP_TIMES columns
after them (`estimator_feature_names`).
"""

from __future__ import annotations

import numpy as np
from sklearn.base import BaseEstimator, ClassifierMixin, TransformerMixin
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.impute import SimpleImputer
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import FunctionTransformer, StandardScaler

from foreshock.predictor import features as ft


class FeatureGuard(TransformerMixin, BaseEstimator):
    """Checks that X has the model's feature columns (by count, and by name for a DataFrame)."""

    def __init__(self, feature_names=ft.MODEL_FEATURE_NAMES):
        self.feature_names = feature_names

    def fit(self, X, y=None):
        self.feature_names_in_ = np.asarray(list(self.feature_names), dtype=object)
        self.n_features_in_ = len(self.feature_names_in_)
        self._check(X)
        return self

    def _check(self, X):
        cols = getattr(X, "columns", None)
        if cols is not None and list(cols) != list(self.feature_names_in_):
            missing = sorted(set(self.feature_names_in_) - set(cols))
            raise ValueError(f"feature columns do not match the model's (missing {missing[:5]}...)")
        if X.shape[1] != len(self.feature_names_in_):
            raise ValueError(f"X has {X.shape[1]} features; the model expects {len(self.feature_names_in_)}")

    def transform(self, X):
        self._check(X)
        return np.asarray(X, dtype=np.float32)

    def get_feature_names_out(self, input_features=None):
        return self.feature_names_in_.copy()


# Error signals whose trend (rising? sustained?) tells a degrading device from a benign burst.
TREND_SIGNALS = ("ecc_sbe", "remap_correctable", "pcie_replay", "nvl_replay", "nvl_recovery", "nvl_crc",
                 "ib_symbol_error", "ib_link_error_recovery", "ib_rcv_errors", "ib_link_integrity",
                 "ib_ack_timeout", "ib_retrans", "ib_xmit_discards", "tcp_retrans",
                 "nic_error_events", "eth_errors", "ib_link_downed")


def _trend_specs(names) -> list[tuple[str, int, float, int, float]]:
    """(output name, numerator column, its scale, denominator column, its scale): the ratio is
    (num * scale + eps) / (den * scale + eps), each side a per-minute rate."""
    idx = {n: i for i, n in enumerate(names)}
    out = []
    for n in TREND_SIGNALS:
        w = {k: idx.get(f"{n}_{k}") for k in ("1m", "5m", "30m")}
        if None in w.values():
            continue
        out.append((f"{n}_rising_5m_vs_30m", w["5m"], 1 / 5, w["30m"], 1 / 30))
        out.append((f"{n}_rising_1m_vs_5m", w["1m"], 1.0, w["5m"], 1 / 5))
    for n in names:
        if n.endswith("_30m_vs_baseline"):
            base = n[: -len("_30m_vs_baseline")]
            if f"{base}_2h_vs_baseline" in idx:
                # both are relative to the same 3-day baseline, so the ratio is the 30-min rate over the
                # 2-hour rate: about 1 for a precursor building over hours, >> 1 for a burst of minutes
                out.append((f"{base}_30m_vs_2h", idx[n], 1.0, idx[f"{base}_2h_vs_baseline"], 1.0))
    return out


class TrendRatios(TransformerMixin, BaseEstimator):
    """Appends trend ratios of the windowed features (features.py) to X: for each error signal of
    TREND_SIGNALS, its 5-min rate over its 30-min rate and its 1-min over its 5-min rate (> 1: rising),
    and for each baselined signal its 30-min rate over its 2-hour rate (a precursor lasts, a burst
    does not). A pure function of one row, so the online and the offline paths cannot disagree."""

    def __init__(self, feature_names=ft.MODEL_FEATURE_NAMES, eps: float = 1e-3):
        self.feature_names = feature_names
        self.eps = eps

    def fit(self, X=None, y=None):
        names = list(self.feature_names)
        specs = _trend_specs(names)
        self.feature_names_in_ = np.asarray(names, dtype=object)
        self.n_features_in_ = len(names)
        self.ratio_names_ = np.asarray([s[0] for s in specs], dtype=object)
        self.numerator_ = np.array([s[1] for s in specs], dtype=np.intp)
        self.numerator_scale_ = np.array([s[2] for s in specs], dtype=np.float32)
        self.denominator_ = np.array([s[3] for s in specs], dtype=np.intp)
        self.denominator_scale_ = np.array([s[4] for s in specs], dtype=np.float32)
        return self

    def transform(self, X):
        X = np.asarray(X, dtype=np.float32)
        if X.shape[1] != self.n_features_in_:
            raise ValueError(f"X has {X.shape[1]} features; TrendRatios expects {self.n_features_in_}")
        eps = np.float32(self.eps)
        with np.errstate(invalid="ignore", divide="ignore"):
            num = X[:, self.numerator_] * self.numerator_scale_ + eps
            den = X[:, self.denominator_] * self.denominator_scale_ + eps
            ratios = num / den
        return np.concatenate([X, ratios.astype(np.float32)], axis=1)

    def get_feature_names_out(self, input_features=None):
        return np.concatenate([self.feature_names_in_, self.ratio_names_])

    def source_columns(self, columns: np.ndarray) -> np.ndarray:
        """The input columns that output `columns` are computed from."""
        columns = np.asarray(columns, dtype=np.intp)
        n = self.n_features_in_
        derived = columns[columns >= n] - n
        return np.unique(np.concatenate([columns[columns < n], self.numerator_[derived], self.denominator_[derived]]))


# Risk may only rise with these (never fall as errors grow): error counts and their ratios to the
# node's baseline, hard-fault gauges, the anomaly scores. On data unlike the training data a tree
# ensemble otherwise extrapolates arbitrarily (a rate above any seen in training can land in a leaf
# learnt from a benign burst); the constraint keeps "more errors, more risk" true everywhere. Trend
# ratios, temperatures, clocks, traffic and times since events stay free: their shape is learnt. Errors
# that keep coming minute after minute (a steadiness column) never lower the risk either, nor do a
# node's ranks falling behind their job's (the step-time columns).
NOT_RISING = {"xid_application"}
RISING_GAUGES = {"remap_pending", "remap_failure", "pcie_width_deficit", "nvl_links_down", "ib_port_down_frac",
                 "eth_down_frac", "gpu_lost", "thermal_throttle_frac", "remap_rows_total"}
RISING_PEERS = {"gpu_err_vs_job", "link_err_vs_leaf"}


def estimator_feature_names(steadiness_columns: int = 0, step_times: bool = False,
                            context: bool = False) -> tuple[str, ...]:
    """The columns an estimator reads: features.MODEL_FEATURE_NAMES and the first `steadiness_columns`
    STEADINESS columns after them (how steady a signal's errors have been over 2 hours; features.STEADY
    lists corrected ECC and corrected row remaps first); with `step_times`, through the STEP_TIMES
    columns (the node's ranks against their job's), the STEADINESS columns past the first
    `steadiness_columns` in the names but held constant (`steadiness_held`); with `context`, through
    the CONTEXT columns (how loud the node's leaf switch's other nodes usually are), the columns
    between that are not asked for held constant too (`context_held`). Always a prefix of
    features.FEATURE_NAMES, which is what the registry loads. Raises ValueError outside
    [0, len(features.STEADINESS)]."""
    k = int(steadiness_columns)
    if not 0 <= k <= len(ft.STEADINESS):
        raise ValueError(f"steadiness columns {steadiness_columns}: must be between 0 and {len(ft.STEADINESS)}")
    if context:
        return ft.FEATURE_NAMES[:ft.CONTEXT_COLS.stop]
    return ft.FEATURE_NAMES[:ft.STEP_TIME_COLS.stop if step_times else ft.N_MODEL + k]


def context_held(feature_names, step_times: bool = False) -> list[int]:
    """The STEP_TIMES (unless `step_times`) and FABRIC columns of `feature_names`: there only because
    the CONTEXT columns after them are read (estimator_feature_names), held constant while the trees
    are fitted."""
    names = list(feature_names)
    if ft.FEATURE_NAMES[ft.CONTEXT_COLS.start] not in names:
        return []
    held = ([] if step_times else list(ft.STEP_TIMES)) + list(ft.FABRIC)
    return [names.index(f.name) for f in held if f.name in names]


def steadiness_held(feature_names, steadiness_columns: int = 0) -> list[int]:
    """The STEADINESS columns of `feature_names` past the first `steadiness_columns`: there only because
    a later column is read (estimator_feature_names), held constant while the trees are fitted."""
    names = list(feature_names)
    return [names.index(f.name) for f in ft.STEADINESS[int(steadiness_columns):] if f.name in names]


def monotonic_constraints(feature_names=ft.MODEL_FEATURE_NAMES, trend_ratios: bool = True) -> list[int]:
    """HistGradientBoosting's monotonic_cst for the model's input columns (features, then the trend
    ratios TrendRatios appends): 1 = the risk does not fall as the value grows, 0 = free."""
    spec = {f.name: f for f in ft.FEATURES}
    out = []
    for name in feature_names:
        f = spec.get(name)
        rising = f is not None and (
            (f.op in ("sum1", "sum5", "sum30", "vs_baseline", "recent_vs_baseline", "decayed")
             and f.signal not in NOT_RISING)
            or (f.op in ("now", "max30") and f.signal in RISING_GAUGES)
            or (f.op in ("mean5", "mean30") and f.signal in RISING_PEERS)
            or f.signal == "anomaly" or f.op == "steady" or f.signal == "steptime_vs_job")
        out.append(1 if rising else 0)
    if trend_ratios:
        out += [0] * len(_trend_specs(list(feature_names)))
    return out


def make_model(*, max_iter: int = 150, learning_rate: float = 0.08, max_leaf_nodes: int = 31,
               l2_regularization: float = 1.0, random_state: int = 0, trend_ratios: bool = True,
               feature_names=ft.MODEL_FEATURE_NAMES) -> Pipeline:
    return Pipeline([
        ("features", FeatureGuard(feature_names)),
        *([("trends", TrendRatios(feature_names))] if trend_ratios else []),
        ("gbdt", HistGradientBoostingClassifier(
            max_iter=max_iter, learning_rate=learning_rate, max_leaf_nodes=max_leaf_nodes,
            min_samples_leaf=40, l2_regularization=l2_regularization,
            monotonic_cst=monotonic_constraints(feature_names, trend_ratios=trend_ratios),
            # no internal early stopping: its random hold-out can leave a rarely-reported feature with
            # no known value in the binned part (sklearn 1.9 then fails); the time split is ours
            early_stopping=False, random_state=random_state)),
    ])


# Error signals whose absolute count the trees keep even with a baseline: a failing HBM's corrected ECC
# steps up and stays, which a 3-day baseline that follows it hides.
COUNTS_KEPT = ("ecc_sbe",)


def baselined_counts(feature_names=ft.MODEL_FEATURE_NAMES) -> list[int]:
    """The columns of the absolute window counts (1, 5, 30 min) of every error signal that also has a
    count against the node's own baseline (`*_30m_vs_baseline`), but those of COUNTS_KEPT."""
    spec = {f.name: f for f in ft.FEATURES}
    names = list(feature_names)
    baselined = {spec[n].signal for n in names if n in spec and spec[n].op == "vs_baseline"} - set(COUNTS_KEPT)
    return [i for i, n in enumerate(names)
            if n in spec and spec[n].op in ("sum1", "sum5", "sum30") and spec[n].signal in baselined]


def fit_model(pipeline: Pipeline, X, y, sample_weight=None, constant_columns=()) -> Pipeline:
    """Fit make_model's pipeline with the trees blind to `constant_columns` (input columns): they are
    held at 0 while the trees are fitted, after the trend ratios have read them, so no tree splits on
    them and the fitted pipeline, unchanged in its steps, ignores them at prediction."""
    cols = np.asarray(list(constant_columns), dtype=np.intp)
    if len(cols) == 0:
        return pipeline.fit(X, y, gbdt__sample_weight=sample_weight)
    *steps, (_, trees) = pipeline.steps
    Xt = X
    for _, step in steps:
        Xt = step.fit(Xt, y).transform(Xt)
    Xt = np.array(Xt, dtype=np.float32)
    Xt[:, cols] = 0.0
    trees.fit(Xt, y, sample_weight=sample_weight)
    return pipeline


def _signed_log1p(X):
    # in float64: the fast path (treewalk.LinearFast) folds the scaling into the coefficients and
    # agrees with this pipeline to rounding only when no step rounds to float32
    X = np.array(X, dtype=np.float64)      # a copy, worked on in place: the training rows are large
    sign = np.sign(X)
    np.abs(X, out=X)
    np.log1p(X, out=X)
    X *= sign
    return X


def make_logistic(feature_names=ft.MODEL_FEATURE_NAMES) -> Pipeline:
    return Pipeline([
        ("features", FeatureGuard(feature_names)),
        ("impute", SimpleImputer(strategy="constant", fill_value=0.0, keep_empty_features=True)),
        ("log", FunctionTransformer(_signed_log1p, feature_names_out="one-to-one", check_inverse=False)),
        ("scale", StandardScaler()),
        ("logreg", LogisticRegression(C=0.1, max_iter=500)),
    ])


# (feature, threshold): the condition is met when feature > threshold
RULE_CONDITIONS: tuple[tuple[str, float], ...] = (
    ("xid_fatal_5m", 0.0),
    ("ecc_dbe_5m", 0.0),
    ("remap_failure_now", 0.0),
    ("remap_uncorrectable_5m", 0.0),
    ("gpu_lost_now", 0.0),
    ("nvl_links_down_now", 0.0),
    ("ib_port_down_frac_now", 0.0),
    ("pcie_width_deficit_now", 0.0),
    ("thermal_throttle_frac_now", 0.0),
    ("xid_precursor_5m", 0.0),
    ("xid_nvlink_5m", 0.0),
    ("ib_link_downed_5m", 0.0),
)


def conditions_met(X, columns: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """[n, k] bool: which of k conditions (feature column > threshold, NaN meeting none) each row meets;
    the one reading of RULE_CONDITIONS and HARD_EVIDENCE_CONDITIONS, for the rule and the hard evidence."""
    return np.nan_to_num(np.asarray(X)[:, columns].astype(np.float64), nan=0.0) > thresholds


# Hard evidence (docs/predictor.md, *Hard evidence*): states of the hardware, or of a node its job waits
# for, that alarm on their own, whatever the model's score and the threshold in force, where the model
# reads rates that a noisy fleet also moves. (feature, threshold) as in RULE_CONDITIONS: met when the
# feature exceeds it. Two are the rule's own conditions; the third asks more than the rule's link-down
# does, because a healthy link goes down once on a reseat or a switch reboot, and a failing cable flaps.
_RULE = dict(RULE_CONDITIONS)
HARD_EVIDENCE_CONDITIONS: tuple[tuple[str, float], ...] = (
    ("nvl_links_down_now", _RULE["nvl_links_down_now"]),            # an NVLink link down
    ("pcie_width_deficit_now", _RULE["pcie_width_deficit_now"]),    # a PCIe link trained below its width
    ("ib_link_downed_30m", 1.0),            # the worst InfiniBand port down twice or more in 30 min
    # one GPU's HBM 1 degC or more warmer than its die, beyond the node's other GPUs and its usual, while
    # the node remaps HBM rows and its dies do not warm apart as much (features.WARMING)
    ("hbm_gap_excess_remapping", 1.0),
    # the node's slowest rank slow against its job's other ranks (the fail-slow rule's comparison,
    # stepcompare) in more than 9 of 10 of its steps judged over 30 minutes: a straggler its job waits for
    ("steptime_slow_share_30m", 0.9),
    # a GPU whose corrected ECC counted in at least 27 of the last 30 ten-minute bins, where it counted in at
    # most a fifth of its bins before (features.ONSET, predictor/onset.py): failing HBM that corrects and goes on
    ("ecc_onset_bins_now", 26.0),
)
# What `foreshock train` writes into a new model's manifest.
HARD_EVIDENCE: tuple[str, ...] = tuple(name for name, _ in HARD_EVIDENCE_CONDITIONS)


class HardEvidence:
    """Which feature rows meet any of the named HARD_EVIDENCE_CONDITIONS (`met`), and what each says (`reasons`).

    `names`: features of HARD_EVIDENCE_CONDITIONS; an unknown one raises ValueError naming it and `where`.
    Rows are full-width feature rows (features.FEATURE_NAMES, as every scoring path keeps them); rows of
    the estimator's width do for conditions on its columns. NaN meets nothing."""

    def __init__(self, names=HARD_EVIDENCE, where: str = "hard evidence"):
        known = dict(HARD_EVIDENCE_CONDITIONS)
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"{where}: {unknown} are not hard evidence "
                             f"(predictor/model.py HARD_EVIDENCE_CONDITIONS: {sorted(known)})")
        self.names = tuple(names)
        self.columns = np.array([ft.FEATURE_NAMES.index(n) for n in self.names], dtype=np.int64)
        self.thresholds = np.array([known[n] for n in self.names], dtype=np.float64)
        self.signals = tuple(ft.FEATURES[c].signal for c in self.columns)

    def met(self, X) -> np.ndarray:
        """[n] bool: the rows that meet a condition."""
        return self.met_each(X).any(axis=1)

    def met_each(self, X) -> np.ndarray:
        """[n, k] bool: which of the k conditions (in `names` order) each row meets."""
        X = np.asarray(X)
        if not len(self.names) or not len(X):
            return np.zeros((len(X), len(self.names)), dtype=bool)
        return conditions_met(X, self.columns, self.thresholds)

    def reasons(self, row, entities: dict[str, str] | None = None) -> list[str]:
        """What one feature row shows, in an operator's words (explain.describe), for each condition met;
        `entities`: the node's device per signal where the scorer knows it (explain.ENTITY_SIGNALS: the GPU
        whose corrected ECC started), named in the words."""
        from foreshock.predictor import explain as ex

        row = np.asarray(row)
        met = conditions_met(row[None, :], self.columns, self.thresholds)[0]
        return [ex.describe(signal, row, (entities or {}).get(signal)) for signal, m in zip(self.signals, met) if m]


class RuleBaseline(ClassifierMixin, BaseEstimator):
    """DCGM-health-style rule: the score is the share of the threshold conditions met."""

    def __init__(self, conditions=RULE_CONDITIONS):
        self.conditions = conditions

    def fit(self, X=None, y=None):
        names = list(ft.MODEL_FEATURE_NAMES)
        self.columns_ = np.array([names.index(f) for f, _ in self.conditions])
        self.thresholds_ = np.array([t for _, t in self.conditions], dtype=np.float64)
        self.classes_ = np.array([0, 1])
        self.n_features_in_ = len(names)
        return self

    def predict_proba(self, X):
        met = conditions_met(X, self.columns_, self.thresholds_)
        p = met.sum(axis=1) / len(self.columns_)
        return np.column_stack([1.0 - p, p])

    def predict(self, X):
        return (self.predict_proba(X)[:, 1] > 0).astype(int)


class PriorShift(ClassifierMixin, BaseEstimator):
    """Calibrated probabilities moved to another base rate: the odds divided by `scale`.

    For a model trained and calibrated on data whose incident rate is `scale` times the deployment's
    (a simulator run with --rate-scale), Bayes' rule with the prior odds changed by 1/scale.
    """

    def __init__(self, estimator=None, scale: float = 1.0):
        self.estimator = estimator
        self.scale = scale

    def fit(self, X=None, y=None):
        self.classes_ = np.array([0, 1])
        return self

    def predict_proba(self, X):
        p = np.clip(self.estimator.predict_proba(X)[:, 1], 0.0, 1.0)
        q = p / (p + (1.0 - p) * float(self.scale))
        return np.column_stack([1.0 - q, q])

    def predict(self, X):
        return (self.predict_proba(X)[:, 1] >= 0.5).astype(int)


class LogitBlend(ClassifierMixin, BaseEstimator):
    """Fitted models stacked: P = sigmoid(sum_i w_i logit(p_i) + b), w and b a logistic regression on
    the members' logits.

    `foreshock train` (train.py) stacks the model it fits on a user's history with a base model
    trained on more (the shipped model), the weights fitted on the history's later validation slice:
    a history with too few incidents to learn from leans on the base model, one that has them on its
    own model. The members are fitted already and are not refitted. A member that earns a negative
    weight is dropped (weight 0) and the rest refitted: a model is never used against its sense.

    `weights` fixes the members' relative weights (w = s * weights, positive, normalised to sum 1):
    only the common scale s and the offset b are fitted, a Platt sigmoid on the weighted logit. For an
    average whose weights are declared, not learnt from the slice the members are best on.
    """

    def __init__(self, estimators=(), C: float = 1.0, weights=None):
        self.estimators = estimators
        self.C = C
        self.weights = weights

    def _logits(self, X) -> np.ndarray:
        cols = []
        for est in self.estimators:
            p = np.clip(np.asarray(est.predict_proba(X))[:, 1], 1e-9, 1.0 - 1e-9)
            cols.append(np.log(p) - np.log1p(-p))
        return np.column_stack(cols)

    def fit(self, X, y, sample_weight=None):
        Z = self._logits(X)
        if self.weights is not None:
            fixed = np.asarray(self.weights, dtype=np.float64)
            if fixed.shape != (Z.shape[1],) or not (fixed > 0).all():
                raise ValueError(f"weights {self.weights!r}: one positive weight per member "
                                 f"({Z.shape[1]})")
            fixed = fixed / fixed.sum()
            lr = LogisticRegression(C=self.C, max_iter=1000).fit((Z @ fixed)[:, None], y, sample_weight=sample_weight)
            self.coef_ = fixed * max(float(lr.coef_[0, 0]), 0.0)
            self.intercept_ = float(lr.intercept_[0])
            self.classes_ = np.array([0, 1])
            return self
        use = np.ones(Z.shape[1], dtype=bool)
        while True:
            lr = LogisticRegression(C=self.C, max_iter=1000).fit(Z[:, use], y, sample_weight=sample_weight)
            w = np.zeros(Z.shape[1])
            w[use] = lr.coef_[0]
            if (w[use] >= 0).all() or use.sum() == 1:
                break
            use &= w > 0
        self.coef_ = w
        self.intercept_ = float(lr.intercept_[0])
        self.classes_ = np.array([0, 1])
        return self

    def decision_function(self, X) -> np.ndarray:
        return self._logits(X) @ self.coef_ + self.intercept_

    def predict_proba(self, X):
        from scipy.special import expit

        q = expit(self.decision_function(X))
        return np.column_stack([1.0 - q, q])

    def predict(self, X):
        return (self.predict_proba(X)[:, 1] >= 0.5).astype(int)
