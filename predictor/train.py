"""Offline training on a logged (or simulated) schema-v1 dataset: the model, its baselines, its manifest.

Reads a dataset (foreshock/dataset.py layout; a directory or a URI pyarrow.fs takes) through offline.FeatureBuilder and the
incidents table (labels.py), and writes a model directory (registry.py).

Split by time, never by row: the first (1 - val_fraction) of the dataset's time span trains the
estimators (minus one label horizon before the boundary, so that no training label looks into the
validation slice); the rest calibrates the probabilities (Platt sigmoid, CalibratedClassifierCV over the
frozen pipeline) and chooses the thresholds for each false-evacuation budget. Healthy training steps
are subsampled (all positives kept; quiet negatives at `neg_rate`, negatives with any error signal at
`hard_neg_rate`, at most `max_negatives` in all); calibration runs on the validation slice at its true
base rate (its negatives are subsampled too, weighted by 1/rate), so probabilities mean what they say.
Training leaves out the negatives of the `label_gap_hours` before an incident of their node (outside
the horizon): a precursor building for hours already shows there, and calling those steps healthy
would teach the model that early signs are benign (labels.before_horizon).

`holdout` (groups.HoldOut, for leave-one-out evaluation, leave_one_out.py) leaves its steps out of the
whole run: neither positive nor negative, in neither the fit, the calibration nor the thresholds'
validation slice. The manifest's `training` section counts what it left out, and the sampled training
rows by node type and the positive ones by incident family, so what a run learned from can be checked.
"""

from __future__ import annotations

import datetime as dt
import logging
import warnings
import platform
import resource
import time
from pathlib import Path

import numpy as np
from sklearn.calibration import CalibratedClassifierCV
from sklearn.frozen import FrozenEstimator

import foreshock
from foreshock import dataset as ds
from foreshock import risk
from foreshock import schema as sch
from foreshock.predictor import calibration
from foreshock.predictor import evaluate as ev
from foreshock.predictor import features as ft
from foreshock.predictor import fleetlevel
from foreshock.predictor import groups
from foreshock.predictor import labels as lb
from foreshock.predictor import model as mdl
from foreshock.predictor import offline, registry, treewalk
from foreshock.predictor.novelty import HealthySteadiness, NoveltyAlarm

log = logging.getLogger(__name__)

BUDGETS = (0.5, 1.0, 2.0, 5.0, 10.0)
# False evacuations the budget allows on the validation slice below which its threshold is set by that
# slice's few highest healthy episodes, and does not carry to a later period or another fleet
# (benchmarks/results/predictor-shift-2026-12-05.md, section 4): `foreshock train` warns.
MIN_BUDGET_EPISODES = 5.0
# features whose nonzero value makes a negative step "hard" (kept at the higher rate)
HARD_FEATURES = [ft.FEATURE_NAMES.index(n) for n in ft.FEATURE_NAMES
                 if n.endswith("_30m") and not n.startswith(("leaf_", "site_", "traffic_", "link_err_vs"))]


def _hard(X: np.ndarray) -> np.ndarray:
    return np.nan_to_num(X[:, HARD_FEATURES]).max(axis=1) > 0


def train(data_dir, out_dir, *, horizon_s: int = lb.DEFAULT_HORIZON_S, budget: float = 2.0,
          val_fraction: float = 0.3, neg_rate: float = 0.01, hard_neg_rate: float = 0.04,
          cal_neg_rate: float = 0.05, max_iter: int = 150, seed: int = 0, prior_scale: float = 1.0,
          label_gap_hours: float = 12.0, max_negatives: int = 250_000,
          label_horizon_s: int | None = lb.TRAINING_LABEL_HORIZON_S, early_label_weight: float = lb.EARLY_LABEL_WEIGHT,
          progress=None,
          command: str | None = None, holdout: groups.HoldOut | None = None,
          compare_with: str | Path | None = None, base: str | Path | None = None, executor: str = "local",
          ray_address: str | None = None, on_error: str = "stop", novelty: bool = True,
          linear_member: bool = False, absolute_counts: bool = False, steadiness_columns: int = 0,
          step_time_columns: bool = False, context_columns: bool = False, incident_weights: bool = False,
          hard_evidence: tuple[str, ...] = mdl.HARD_EVIDENCE,
          threshold_prior_node_days: float | None = calibration.DEFAULT_PRIOR_NODE_DAYS) -> dict:
    """Train on data_dir, write the model to out_dir, return its manifest.

    absolute_counts: False (the default): the trees never split on the absolute window counts of an
    error signal that has a node baseline (model.baselined_counts); they see it against the node's own
    baseline and as trend ratios only, so a healthy device's chronic rate, which differs from fleet to
    fleet, is not read as a failing one's. True: they split on the counts too.

    linear_member: the model is the trees averaged with the logistic regression fitted on the same
    rows (model.LogitBlend, LINEAR_MEMBER_WEIGHTS fixed; only a common scale and offset fitted on the
    validation slice's calibration sample); the manifest's estimator.linear_member then has the trees
    alone on the same validation slice. False (the default): the trees alone. Judged against the trees
    alone on worlds past the catalogue, the average had six times their false evacuations at budget 2,
    its inputs clipped to their training range or not (docs/predictor.md, "The linear member").

    steadiness_columns: the estimators also read the first this many STEADINESS columns (how steady
    a signal's errors have been over 2 hours, model.estimator_feature_names), risk constrained not to
    fall as they grow; 0 (the default): the model columns alone. Raises ValueError outside
    [0, len(features.STEADINESS)].

    step_time_columns: the estimators also read the STEP_TIMES columns (a node's ranks against their
    job's, predictor/steptimes.py), risk constrained not to fall as they grow; the steadiness columns
    before them past the first `steadiness_columns` are held constant for the trees (the logistic
    regression reads them). False (the default): not.

    context_columns: the estimators also read the CONTEXT columns (per error family, how loud the other
    nodes under the node's leaf switch usually are: features.CONTEXT), risk free to move either way
    with them; the step-time (unless `step_time_columns`) and fabric columns before them are held
    constant for the trees. False (the default): not.

    incident_weights: each positive training row weighs 1 / the number of nodes its failure took down
    (labels.incident_weights), so a leaf switch's nodes weigh as one failure, as evaluation counts it;
    False (the default): every failing node's rows weigh alike (docs/predictor.md, Results: judged).

    novelty: fit the novelty alarm beside the model (novelty.py: each signal's steadiness scale from
    the healthy training rows) and choose the thresholds on the two fused; False: the model alone.

    hard_evidence: the states of the hardware or a job (model.HARD_EVIDENCE_CONDITIONS) that alarm the model
    whatever its score (model.HardEvidence; the manifest's `hard_evidence`); the thresholds are chosen with
    their alarms counted on the validation slice, and the manifest's metrics.validation_parts says what
    each part spends there (evaluate.policy_parts). Empty: the score alone.

    compare_with: a model directory (the shipped model, for `foreshock train`) scored on the same
    validation slice at a threshold chosen there for the same budget; the manifest's
    metrics.validation_compared has its figures beside this model's, so a user whose own history holds
    too few incidents to learn from sees that the model it would replace does better.

    base: a model directory (the shipped model, for `foreshock train`) to stack the new model with
    (model.LogitBlend): the weights of the two are fitted on the validation slice's calibration
    sample, so a history with few incidents leans on the base model and one with many on its own.
    A base of another feature version is skipped, and the manifest says why.

    threshold_prior_node_days: with a base, each budget's threshold is chosen on the validation slice
    with the base's validation curve as the prior worth this many node-days (calibration.pooled_with_base;
    the default is fleet calibration's weight of a manifest's curve against a fleet's own data); the
    manifest's threshold_pooling has the thresholds of the slice alone beside. None or 0: the slice
    alone. Range-checked as calibration.check_prior_node_days.

    label_horizon_s: the training label's horizon (None: the horizon; labels.TRAINING_LABEL_HORIZON_S). A positive training step is
    one whose node fails within it; the steps between the horizon and it weigh `early_label_weight`.
    Calibration and thresholds always use the horizon's labels, so the model's probability keeps its
    meaning (P(failure within the horizon)); only what the trees learn to rank high changes. Raises
    ValueError outside [horizon, horizon + label gap]: the label gap (and leave-one-out's hold-out
    window, groups.incident_holdout) must cover it."""
    if threshold_prior_node_days:
        calibration.check_prior_node_days(threshold_prior_node_days)
    label_horizon_s = horizon_s if label_horizon_s is None else int(label_horizon_s)
    if not horizon_s <= label_horizon_s <= horizon_s + label_gap_hours * 3600:
        raise ValueError(f"label horizon {label_horizon_s / 60:g} min: must be between the horizon "
                         f"({horizon_s / 60:g} min) and the horizon plus the label gap "
                         f"({horizon_s / 60 + label_gap_hours * 60:g} min)")
    if not 0.0 < early_label_weight <= 1.0:
        raise ValueError(f"early label weight {early_label_weight:g}: must be in (0, 1]")
    evidence = mdl.HardEvidence(hard_evidence, "train: hard evidence") if hard_evidence else None
    columns = mdl.estimator_feature_names(steadiness_columns, step_time_columns, context_columns)
    n_cols = len(columns)
    t_start = time.perf_counter()
    compared = _comparable(compare_with)
    # by default both are the shipped model: loaded (and its fast path built and checked) once
    same = compare_with is not None and base is not None and Path(base).resolve() == Path(compare_with).resolve()
    base_model = compared if same else _comparable(base)
    if isinstance(base_model, registry.LoadedModel) and base_model.n_model_features != n_cols:
        # the blend feeds both members the same columns
        base_model = {"model_version": base_model.version, "path": str(base_model.path),
                      "skipped": f"it reads {base_model.n_model_features} feature columns, this model {n_cols}"}
    # the dataset: a path or a URI, read through its filesystem (dataset.DatasetRoot); out_dir is local
    data_dir, out_dir = ds.open_dataset_root(data_dir), Path(out_dir)
    rng = np.random.default_rng(seed)
    incidents = lb.Incidents.from_table(ds.read_table(data_dir, "incidents"))
    h_ns = horizon_s * 1_000_000_000
    label_h_ns = label_horizon_s * 1_000_000_000
    types = groups.node_types(ds.read_table(data_dir, "inventory"))
    rows_by_type: dict[str, int] = {}
    positives_by_family: dict[str, int] = {}
    held_steps = held_positive = 0
    with offline.FeatureBuilder(data_dir, progress=progress, executor=executor, ray_address=ray_address,
                                on_error=on_error) as fb:
        fb.pass1()
        skipped = fb.skipped      # filled by both passes
        first, last = fb.step_range
        span = (last + 1 - first) * offline.STEP_NS
        boundary = (first * offline.STEP_NS) + int(span * (1.0 - val_fraction))
        train_X, train_y, train_w, val_nodes, cal_X, cal_y, cal_w, healthy, val_paths = [], [], [], [], [], [], [], [], []
        steady_healthy = HealthySteadiness()
        n_train_steps = n_val_steps = n_early = 0
        for nf in fb:
            node_inc = incidents.of_node(nf.node)
            y, excluded = lb.node_labels(nf.step_end_ns, node_inc, horizon_s)
            y_label = lb.node_labels(nf.step_end_ns, node_inc, label_horizon_s)[0] if label_horizon_s > horizon_s else y
            usable = nf.scoreable & ~excluded
            e = nf.step_end_ns
            if holdout is not None:
                held = usable & holdout.mask(nf.node, e)
                held_steps += int(held.sum())
                held_positive += int((held & (y == 1)).sum())
                usable &= ~held
            # only negatives: a step in the gap of one incident can be in the horizon of another
            early = lb.before_horizon(e, node_inc, horizon_s, label_gap_hours * 3600.0) & (y_label == 0)
            tr = usable & (e < boundary - label_h_ns)
            n_early += int((tr & early).sum())
            tr &= ~early
            va = usable & (e >= boundary)
            n_train_steps += int(tr.sum())
            n_val_steps += int(va.sum())
            X = nf.X                      # full width: the estimators read Xm, the novelty alarm the rest
            Xm = X[:, :n_cols]
            hard = _hard(X)
            r = rng.random(len(X))
            keep = tr & ((y_label == 1) | (hard & (r < hard_neg_rate)) | (~hard & (r < neg_rate)))
            train_X.append(Xm[keep])
            train_y.append(y_label[keep])
            w = np.where((y_label[keep] == 1) & (y[keep] == 0), early_label_weight, 1.0)
            if incident_weights:
                w = w * lb.incident_weights(e, node_inc, label_horizon_s, incidents.nodes_per_incident)[keep]
            train_w.append(w)
            node_type = types.get(nf.node, groups.UNKNOWN_TYPE)
            rows_by_type[node_type] = rows_by_type.get(node_type, 0) + int(keep.sum())
            for ts, category in zip(node_inc["ts"].to_numpy(np.int64), node_inc["category"]):
                in_horizon = keep & (y_label == 1) & (e >= ts - label_h_ns) & (e < ts)
                positives_by_family[category] = positives_by_family.get(category, 0) + int(in_horizon.sum())
            quiet = tr & (y == 0) & ~hard & (r < 0.002)
            if novelty:   # the healthy training rows: the label gap before incidents is already out of tr
                steady_healthy.add(X[tr & (y_label == 0), ft.STEADY_COLS])
            healthy.append(X[quiet])
            # calibration sample of the validation slice, weighted back to its true base rate
            ck = va & ((y == 1) | (r < cal_neg_rate))
            cal_X.append(Xm[ck])
            cal_y.append(y[ck])
            cal_w.append(np.where(y[ck] == 1, 1.0, 1.0 / cal_neg_rate))
            # the validation slice's features wait on disk (bounded memory) until the model is fitted
            vs, scores = validation_slice(nf.node, e, y, usable, boundary)
            val_path = fb.cache / f"val-{len(val_nodes):06d}.npy"
            np.save(val_path, X[vs])
            val_nodes.append(scores)
            val_paths.append(val_path)
        Xtr, ytr, wtr = np.concatenate(train_X), np.concatenate(train_y), np.concatenate(train_w)
        negatives = np.flatnonzero(ytr == 0)
        neg_kept_share = 1.0
        if len(negatives) > max_negatives:
            # a bigger dataset gives more of the same negatives: fit time stays bounded
            neg_kept_share = max_negatives / len(negatives)
            drop = rng.choice(negatives, len(negatives) - max_negatives, replace=False)
            keep_rows = np.ones(len(ytr), dtype=bool)
            keep_rows[drop] = False
            Xtr, ytr, wtr = Xtr[keep_rows], ytr[keep_rows], wtr[keep_rows]
        del train_X, train_y, train_w
        if ytr.sum() == 0:
            raise ValueError(f"{data_dir}: no positive training steps (no incidents in the first "
                             f"{1 - val_fraction:.0%} of the time span); simulate more days or a higher --rate-scale")
        # A feature no node of this dataset reports (no path_probe table, say) is all NaN, which
        # HistGradientBoosting's binning cannot take, and it bins on a 200,000-row subsample, which can
        # miss the few known values of a feature almost nobody reports: such columns become constant 0.
        sparse = (~np.isnan(Xtr)).sum(axis=0) < 1000
        if sparse.any():
            Xtr[:, sparse] = np.nan_to_num(Xtr[:, sparse], nan=0.0)
        t_feat = time.perf_counter() - t_start
        if progress:
            progress("fitting", 0, 1)
        blind = [] if absolute_counts else mdl.baselined_counts(columns)
        blind += mdl.steadiness_held(columns, steadiness_columns)
        blind += mdl.context_held(columns, step_time_columns)
        gbdt = mdl.fit_model(mdl.make_model(max_iter=max_iter, random_state=seed, feature_names=columns), Xtr, ytr,
                             wtr, constant_columns=blind)
        logit = mdl.make_logistic(columns).fit(Xtr, ytr, logreg__sample_weight=wtr)
        rule = mdl.RuleBaseline().fit()
        Xc, yc, wc = np.concatenate(cal_X), np.concatenate(cal_y), np.concatenate(cal_w)
        # the weights are meant for the calibrator only (the frozen estimator is already fitted)
        warnings.filterwarnings("ignore", message="Since FrozenEstimator does not appear to accept sample_weight")
        if yc.sum() == 0:
            raise ValueError(f"{data_dir}: no incidents in the validation slice (the last {val_fraction:.0%}); "
                             "cannot calibrate: simulate more days or a higher --rate-scale")
        model = CalibratedClassifierCV(FrozenEstimator(gbdt), method="sigmoid").fit(Xc, yc, sample_weight=wc)
        logistic = CalibratedClassifierCV(FrozenEstimator(logit), method="sigmoid").fit(Xc, yc, sample_weight=wc)
        trees = model
        if linear_member:
            model = mdl.LogitBlend([trees, logistic], weights=LINEAR_MEMBER_WEIGHTS).fit(Xc, yc, sample_weight=wc)
        own = model    # this history's model, before any stacking with a base
        stacked = base_model if isinstance(base_model, dict) else None
        if isinstance(base_model, registry.LoadedModel):
            blend = mdl.LogitBlend([base_model.estimator, model]).fit(Xc, yc, sample_weight=wc)
            stacked = {"model_version": base_model.version, "path": str(base_model.path),
                       "weights": {"base": float(blend.coef_[0]), "this_history": float(blend.coef_[1])},
                       "intercept": blend.intercept_,
                       "training": {k: base_model.manifest.get("training", {}).get(k) for k in
                                    ("data", "data_hash", "nodes", "node_names_sha256", "first_step_end",
                                     "last_step_end")}}
            model = blend
        if prior_scale != 1.0:
            model = mdl.PriorShift(model, prior_scale).fit()
            logistic = mdl.PriorShift(logistic, prior_scale).fit()
            trees = mdl.PriorShift(trees, prior_scale).fit()
        t_fit = time.perf_counter() - t_start - t_feat
        if progress:
            progress("fitting", 1, 1)
        alarm, novelty_note = None, None if novelty else "not asked for (--no-novelty)"
        if novelty:
            try:
                alarm = NoveltyAlarm().fit(steady_healthy)
            except ValueError as exc:
                novelty_note = str(exc)
        fast_model = treewalk.fast_probability(model, n_cols)
        # full-width rows in, each estimator reads its columns (the compared model: LoadedModel does)
        predictors = {"model": lambda X: fast_model(X[:, :n_cols]),
                      "rule": lambda X: rule.predict_proba(X[:, :n_cols])[:, 1],
                      "logistic": lambda X: logistic.predict_proba(X[:, :n_cols])[:, 1]}
        if isinstance(compared, registry.LoadedModel):
            predictors[COMPARED] = compared.probability
        base_name = None
        if stacked is not None and isinstance(base_model, registry.LoadedModel) and threshold_prior_node_days:
            base_name = COMPARED if same else BASE
            predictors.setdefault(base_name, base_model.probability)
        if linear_member:
            fast_trees = treewalk.fast_probability(trees, n_cols)
            predictors[TREES] = lambda X: fast_trees(X[:, :n_cols])
        levels = []
        for vn, path in zip(val_nodes, val_paths):
            Xv = np.load(path)
            for name, fn in predictors.items():
                vn.scores[name] = (fn(Xv) if len(Xv) else np.zeros(0)).astype(np.float32)
            # the model's thresholds are chosen with its hard evidence's alarms counted: they spend the budget too
            vn.evidence = evidence.met_each(Xv) if evidence is not None else None
            vn.forced = vn.evidence.any(axis=1) if evidence is not None else None
            levels.append(alarm.level(Xv) if alarm is not None else None)
        keep_val = [i for i, vn in enumerate(val_nodes) if len(vn.y)]
        val_nodes, levels = [val_nodes[i] for i in keep_val], [levels[i] for i in keep_val]
        val_inc = _incidents_within(incidents, boundary, (last + 1) * offline.STEP_NS + h_ns)
        names = list(predictors)
        if alarm is not None:
            # the novelty reaches the probability the model alone evacuates at for this budget; the
            # thresholds are then chosen on the two fused, so the alarm spends the same budget
            alarm.calibrate(risk.pick_threshold(ev.threshold_curve(val_nodes, "model", val_inc, horizon_s), budget))
            for vn, lv in zip(val_nodes, levels):
                vn.scores[SUPERVISED] = vn.scores["model"]
                vn.scores["model"] = alarm.fuse_level(vn.scores["model"], lv).astype(np.float32)
            names.append(SUPERVISED)
        curves = {name: ev.threshold_curve(val_nodes, name, val_inc, horizon_s) for name in names}
        thresholds = {name: {str(b): risk.pick_threshold(curves[name], b) for b in BUDGETS} for name in ev.MODEL_NAMES}
        pooling = None
        if base_name is not None:
            try:
                base_curve = (base_model.manifest.get("threshold_curves") or {}).get("model")
                if not base_curve:
                    raise ValueError("the base's manifest has no threshold curve")
                pooled = calibration.pooled_with_base(val_nodes, "model", base_name, base_curve, val_inc, horizon_s,
                                                      BUDGETS, prior_node_days=threshold_prior_node_days)
            except ValueError as exc:
                # a prior that cannot be read costs the prior, not the training run
                pooling = {"base_model_version": base_model.version, "skipped": str(exc)}
            else:
                pooling = {"base_model_version": base_model.version, "rule": POOLING_RULE,
                           "prior_node_days": pooled["prior_node_days"], "slice_node_days": pooled["slice_node_days"],
                           "thresholds_slice_alone": thresholds["model"], "curve_slice_alone": curves["model"],
                           "recommended_threshold_slice_alone": risk.pick_threshold(curves["model"], budget),
                           "carried_base_curve": pooled["carried"],
                           "slice_false_evacuations_at_carried": pooled["slice_false_evacuations"]}
                thresholds["model"] = {str(b): pooled["thresholds"][float(b)] for b in BUDGETS}
                curves["model"] = pooled["curve"]
        chosen = {name: risk.pick_threshold(curves[name], budget) for name in names}
        validation = ev.evaluate_all(val_nodes, val_inc, chosen, horizon_s)
        # which part spends the slice's budget: where the hard evidence alone spends more than a budget, that
        # budget leaves the risk nothing and its threshold goes to the top of its scores
        parts = (None if evidence is None else
                 {"budget": budget, **ev.policy_parts(val_nodes, val_inc, chosen["model"], evidence.names, horizon_s)})
        # the healthy level the thresholds were chosen at, so a fleet that scores higher raises them
        score_reference = fleetlevel.reference_level(val_nodes, "model")
        for m in validation.values():
            m.pop("pr_curve", None)
        novelty_section = None
        if alarm is not None:
            curves.pop(SUPERVISED)
            novelty_section = {**alarm.to_manifest(), "validation_without": validation.pop(SUPERVISED)}
        if BASE in predictors:
            curves.pop(BASE)
            validation.pop(BASE)
        if COMPARED in predictors:   # reported beside this model's figures, never among its thresholds
            curves.pop(COMPARED)
            compared = {"model_version": compared.version, "path": str(compared.path), **validation.pop(COMPARED)}
        linear_section = None
        if linear_member:
            curves.pop(TREES)
            linear_section = {"weights": {"trees": LINEAR_MEMBER_WEIGHTS[0], "linear": LINEAR_MEMBER_WEIGHTS[1]},
                              "logit_scale": float(own.coef_.sum()), "intercept": float(own.intercept_),
                              "validation_trees_alone": validation.pop(TREES)}
        reference = np.nanmedian(np.concatenate(healthy), axis=0) if sum(len(h) for h in healthy) else np.zeros(ft.N_FEATURES)
        reference = np.nan_to_num(reference, nan=0.0)
    gb = gbdt.named_steps["gbdt"]
    imp_names = list(columns)
    manifest = {
        "version": f"{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%SZ}-{offline.dataset_hash(data_dir)[:8]}",
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "foreshock_version": foreshock.__version__,
        "schema_version": sch.SCHEMA_VERSION,
        "feature_version": ft.FEATURE_VERSION,
        "feature_names": imp_names,
        "step_seconds": ft.STEP_SECONDS,
        "horizon_seconds": int(horizon_s),
        "budget": float(budget),
        "budget_unit": "false evacuations per 1,000 node-days",
        "thresholds": thresholds["model"],
        "baseline_thresholds": {"rule": thresholds["rule"], "logistic": thresholds["logistic"]},
        "recommended_threshold": chosen["model"],
        "threshold_curves": curves,
        **({"threshold_pooling": pooling} if pooling is not None else {}),
        **({"score_level": {"reference": score_reference, "rule": fleetlevel.RULE,
                            "chosen_on": "the validation slice"}} if score_reference is not None else {}),
        "reference_features": reference.tolist(),
        **({"novelty": novelty_section} if novelty_section is not None else {}),
        **({"hard_evidence": list(evidence.names)} if evidence is not None else {}),
        "prior_scale": float(prior_scale),
        "estimator": {"pipeline": [type(s).__name__ for _, s in gbdt.steps], "calibration": "sigmoid",
                      "trend_features": list(gbdt.named_steps["trends"].ratio_names_) if "trends" in gbdt.named_steps else [],
                      "n_iter": int(gb.n_iter_), "params": {k: v for k, v in gb.get_params().items()
                                                             if isinstance(v, (int, float, str, bool, type(None)))},
                      "linear_member": linear_section,
                      "blind_to": [imp_names[i] for i in blind],
                      **({"stacked_with_base": stacked} if stacked is not None else {})},
        "training": {
            **ev.data_identity(data_dir, fb.nodes, first, last), "validation_from": ev.iso_time(boundary),
            "train_steps": n_train_steps, "validation_steps": n_val_steps,
            "train_rows_sampled": int(len(ytr)), "train_positive_rows": int(ytr.sum()),
            "label_horizon_seconds": int(label_horizon_s), "early_label_weight": float(early_label_weight),
            "incident_weights": bool(incident_weights),
            # before the max_negatives cap; positive rows in the label horizon of an incident, by its category
            "train_rows_sampled_by_node_type": rows_by_type, "train_positive_rows_by_family": positives_by_family,
            # the base model's own training data is in this model too (evaluate's overlap rule reads it)
            **({"base": stacked["training"]} if stacked is not None and "training" in stacked else {}),
            # node partitions left out because their data could not be read (--on-corrupt skip)
            "skipped_partitions": skipped,
            "telemetry_interval": fb.telemetry_interval.summary(),
            **({"novelty_skipped": novelty_note} if novelty_note else {}),
            "held_out": None if holdout is None else {
                "kind": holdout.kind, "name": holdout.name, "nodes": len(holdout.windows),
                "steps_left_out": held_steps, "positive_steps_left_out": held_positive},
            "sampling": {"neg_rate": neg_rate * neg_kept_share, "hard_neg_rate": hard_neg_rate * neg_kept_share,
                         "cal_neg_rate": cal_neg_rate, "max_negatives": max_negatives,
                         "label_gap_hours": label_gap_hours, "train_steps_left_out_before_incidents": n_early,
                         "note": "positives all kept; negatives of the label gap before an incident left out of "
                                 "training; calibration on the validation slice weighted to its true base rate"},
            "incidents": int(len(incidents.by_incident)),
            "incidents_by_category": incidents.by_incident["category"].value_counts().to_dict(),
            "seconds": {"features": round(t_feat, 1), "fit": round(t_fit, 1),
                        "total": round(time.perf_counter() - t_start, 1)},
            "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "machine": f"{platform.machine()}, {__import__('os').cpu_count()} CPUs",
            "command": command,
        },
        "metrics": {"validation": validation,
                    **({"validation_parts": parts} if parts is not None else {}),
                    **({"validation_compared": compared} if compared is not None else {})},
    }
    registry.save_model(out_dir, model, manifest, baselines={"rule": rule, "logistic": logistic})
    return manifest


COMPARED = "compared"
BASE = "base"               # the base stacked with, when it is not the model compared with
POOLING_RULE = ("each budget's threshold is the lowest of the base model's validation curve, carried to this model's "
                "scale by alarm volume on this validation slice (calibration.carried_curve), whose false-evacuation "
                "rate, that curve (worth prior_node_days) pooled with the slice's own false evacuations over its "
                "node-days, is within the budget")
SUPERVISED = "supervised"   # the model without the novelty alarm, on the validation slice
TREES = "trees"             # the trees without the linear member, on the validation slice
# The trees' and the linear member's weights on the logit scale (`linear_member`): the plain average,
# declared, not fitted (fitted on the validation slice, the weights favour whichever member fits the
# training world best, which is not the point of a second member; docs/predictor.md, "The linear member").
LINEAR_MEMBER_WEIGHTS = (0.5, 0.5)



def _comparable(path) -> "registry.LoadedModel | dict | None":
    """The model to compare or stack with, loaded; a dict saying why not when it reads other features."""
    if path is None:
        return None
    # the manifest first: load_model refuses a model of another feature version, which is no reason
    # to refuse the training run
    manifest = registry.read_manifest(path)
    if str(manifest.get("feature_version")) not in ft.READABLE_VERSIONS:
        return {"model_version": manifest.get("version"), "path": str(path),
                "skipped": f"it reads feature version {manifest.get('feature_version')}, this one "
                           f"{ft.FEATURE_VERSION}"}
    return registry.load_model(path)


def validation_slice(node: str, step_end_ns: np.ndarray, y: np.ndarray, usable: np.ndarray,
                     boundary_ns: int) -> tuple[np.ndarray, ev.NodeScores]:
    """(the mask of the node's steps in the validation slice, their NodeScores with no scores yet).

    Every step from the boundary on is kept and the unusable ones (a repair, a gap) are masked, as
    `evaluate` scores a dataset: its alarm episodes are runs of steps, so alarms either side of a
    repair are two episodes, and the thresholds chosen here are those evaluate then judges."""
    keep = step_end_ns >= boundary_ns
    return keep, ev.NodeScores(node, step_end_ns[keep], y[keep], usable[keep])


def _incidents_within(incidents: lb.Incidents, lo_ns: int, hi_ns: int) -> lb.Incidents:
    f = incidents.frame
    keep = (f["ts"] >= lo_ns) & (f["ts"] <= hi_ns)
    frame = f[keep]
    by = incidents.by_incident[incidents.by_incident["incident_id"].isin(set(frame["incident_id"]))]
    return lb.Incidents(frame, by.reset_index(drop=True))

