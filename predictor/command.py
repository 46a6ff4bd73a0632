"""`foreshock train` and `foreshock evaluate`: the offline loop a reliability engineer runs.

    foreshock train --data DIR_OR_URI --out MODEL_DIR [--horizon-minutes 30] [--budget 2] [--val-fraction 0.3]
                    [--base shipped|MODEL_DIR|''] [--compare-with shipped|MODEL_DIR|''] [--no-novelty]
                    [--no-hard-evidence]
                    [--threshold-prior-node-days N]
                    [--linear-member] [--executor local|ray] [--ray-address HOST:PORT]
    foreshock evaluate --data DIR --model MODEL_DIR [--json FILE] [--html FILE] [--budget F]
                       [--executor local|ray] [--ray-address HOST:PORT]
    foreshock evaluate --leave-one-out family|signature|node_type --train-data TRAIN_DIR --data DIR
                       [--only NAME[,NAME]] [--max-iter N] [--json FILE] [--html FILE]
    foreshock thresholds --data DIR --out MODEL_DIR [--model MODEL_DIR] [--prior-node-days N]

Settings come from the [train] / [evaluate] tables of the config file, FORESHOCK_TRAIN_* /
FORESHOCK_EVALUATE_* environment variables, then flags (foreshock/config.py). Long steps show rich
progress bars on a terminal and plain progress lines on stderr elsewhere; leave-one-out prints a line
per training run on stderr, terminal or not.
`train` stacks the model it fits with the shipped model by default (train.train's `base`): a user's
history seldom holds enough incidents to learn from alone.
--data is a directory or a URI pyarrow.fs takes (s3://, gs://, file://; dataset.open_dataset_root); the
model, the reports and the feature cache are written locally.
When the evaluated data overlaps the model's training data (evaluate.overlap), or its nodes were sampled less
often than once per feature step (offline.telemetry_interval_warning), a warning goes to stderr.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

from foreshock import config

TRAIN_DEFAULTS = {"data": "", "out": "", "horizon_minutes": 30.0, "budget": 2.0, "val_fraction": 0.3,
                  "neg_rate": 0.01, "hard_neg_rate": 0.04, "max_iter": 150, "seed": 0,
                  "prior_scale": 1.0, "label_gap_hours": 12.0, "max_negatives": 250_000,
                  # labels.TRAINING_LABEL_HORIZON_S (0 here, None there: the horizon) and EARLY_LABEL_WEIGHT
                  # (a test holds them equal; this module does not import the predictor, so the CLI starts fast)
                  "label_horizon_minutes": 0.0, "early_label_weight": 0.3,
                  "compare_with": "shipped", "base": "shipped", "executor": "local", "ray_address": "",
                  "on_corrupt": "stop", "novelty": True, "linear_member": False,
                  "absolute_counts": False, "steadiness_columns": 0, "step_time_columns": False,
                  "context_columns": False, "incident_weights": False, "hard_evidence": True,
                  # comma-separated names of model.HARD_EVIDENCE_CONDITIONS ("": all of model.HARD_EVIDENCE);
                  # train.train refuses an unknown one, naming it, before it reads anything
                  "hard_evidence_conditions": "",
                  # calibration.DEFAULT_PRIOR_NODE_DAYS, as THRESHOLDS_DEFAULTS' (a test holds them equal)
                  "threshold_prior_node_days": 1000.0}
THRESHOLDS_DEFAULTS = {"data": "", "model": "", "out": "", "prior_node_days": TRAIN_DEFAULTS["threshold_prior_node_days"]}
EVALUATE_DEFAULTS = {"data": "", "model": "", "json": "", "html": "", "budget": -1.0, "leave_one_out": "",
                     "train_data": "", "only": [], "max_iter": TRAIN_DEFAULTS["max_iter"],
                     "label_horizon_minutes": TRAIN_DEFAULTS["label_horizon_minutes"], "executor": "local",
                     "ray_address": "", "on_corrupt": "stop", "novelty": True}
EXECUTOR_CHECKS = {"executor": config.Check(lambda v: v in ("local", "ray"), "must be local or ray"),
                   "on_corrupt": config.Check(lambda v: v in ("stop", "skip"), "must be stop or skip")}
# train.train checks the label horizon against the horizon and the label gap, which can come from flags too
LABEL_HORIZON_CHECK = {"label_horizon_minutes": config.Check(lambda v: v == 0 or 1.0 <= v <= 36 * 60.0,
                                                             "must be 0 (the horizon) or between 1 and 2160")}
EVALUATE_CHECKS = {**EXECUTOR_CHECKS, **LABEL_HORIZON_CHECK}
TRAIN_CHECKS = {**EXECUTOR_CHECKS, **LABEL_HORIZON_CHECK,
                "early_label_weight": config.Check(lambda v: 0.0 < v <= 1.0, "must be in (0, 1]"),
                "hard_evidence_conditions": config.Check(
                    lambda v: v == "" or all(n.strip().isidentifier() for n in v.split(",")),
                    "must be comma-separated condition names (docs/predictor.md, Hard evidence)"),
                # the upper bound (how many STEADINESS columns there are) is model.estimator_feature_names'
                "steadiness_columns": config.Check(lambda v: v >= 0, "must be 0 or more"),
                # calibration.PRIOR_NODE_DAYS_RANGE, or 0 for none
                "threshold_prior_node_days": config.Check(lambda v: v == 0 or 1.0 <= v <= 1e7,
                                                          "must be 0 (the validation slice alone) or between 1 and 1e7")}


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="train a failure predictor on a schema-v1 dataset",
                              description=__doc__.splitlines()[0])
    p.add_argument("--data", help="dataset directory (foreshock collect / simulate output)")
    p.add_argument("--out", help="model directory to write")
    p.add_argument("--horizon-minutes", type=float, dest="horizon_minutes")
    p.add_argument("--budget", type=float, help="false evacuations per 1,000 node-days for the recommended threshold")
    p.add_argument("--val-fraction", type=float, dest="val_fraction")
    p.add_argument("--neg-rate", type=float, dest="neg_rate")
    p.add_argument("--hard-neg-rate", type=float, dest="hard_neg_rate")
    p.add_argument("--max-iter", type=int, dest="max_iter")
    p.add_argument("--label-gap-hours", type=float, dest="label_gap_hours",
                   help="leave out of training the healthy-labelled steps this long before an incident (default 12)")
    p.add_argument("--label-horizon-minutes", type=float, dest="label_horizon_minutes",
                   help="train on 'fails within this long' (default 0: the horizon; the shipped model 360, "
                        "docs/predictor.md, Labels); probabilities and thresholds stay those of --horizon-minutes")
    p.add_argument("--early-label-weight", type=float, dest="early_label_weight",
                   help="weight of the training positives between the horizon and the label horizon "
                        f"(default {TRAIN_DEFAULTS['early_label_weight']:g})")
    p.add_argument("--max-negatives", type=int, dest="max_negatives",
                   help="at most this many sampled negative training rows (default 250000)")
    p.add_argument("--seed", type=int)
    p.add_argument("--prior-scale", type=float, dest="prior_scale",
                   help="the training data's incident rate over the deployment's (simulate --rate-scale): "
                        "probabilities are moved to the deployment's base rate")
    p.add_argument("--compare-with", dest="compare_with", metavar="MODEL_DIR",
                   help="score this model on the same validation slice, beside the new one (default "
                        "'shipped': the shipped default model; '' for none)")
    p.add_argument("--base", metavar="MODEL_DIR",
                   help="stack the new model with this one, the weights of the two fitted on the validation slice, "
                        "so that a history with few incidents leans on a model trained on more (default "
                        "'shipped': the shipped default model; '' to train from this history alone)")
    p.add_argument("--threshold-prior-node-days", type=float, dest="threshold_prior_node_days", metavar="N",
                   help="with a base, choose each budget's threshold on the validation slice with the base's "
                        "validation curve as a prior worth N node-days (default "
                        f"{TRAIN_DEFAULTS['threshold_prior_node_days']:g}, as foreshock thresholds; docs/predictor.md, "
                        "Stacked with the shipped model); 0: the validation slice alone")
    p.add_argument("--no-hard-evidence", dest="hard_evidence", action="store_const", const=False,
                   help="no hard evidence: the states that alarm whatever the score (an NVLink link down, a "
                        "failing cable, a node its job waits for, ...: docs/predictor.md, Hard evidence) alarm only "
                        "through the model's score")
    p.add_argument("--hard-evidence", dest="hard_evidence_conditions", metavar="NAMES",
                   help="only these hard-evidence conditions, comma-separated (default: all; an unknown name is "
                        "refused with the list): leave out one that alarms on this fleet's healthy nodes (train "
                        "prints what each spends on the validation slice)")
    p.add_argument("--no-novelty", dest="novelty", action="store_const", const=False,
                   help="no novelty alarm beside the model (docs/predictor.md, Novelty alarm): the model alone "
                        "sets the risk and the thresholds")
    p.add_argument("--linear-member", dest="linear_member", action="store_const", const=True,
                   help="average the trees with the logistic regression fitted beside them, on the logit scale "
                        "(docs/predictor.md, The linear member: past the training worlds' ranges it raised "
                        "false evacuations six-fold; not the default)")
    p.add_argument("--absolute-counts", dest="absolute_counts", action="store_const", const=True,
                   help="let the trees split on the absolute window counts of error signals that have a node "
                        "baseline too (by default they read such a signal only against the node's own baseline "
                        "and as trend ratios: docs/predictor.md, Relative counts)")
    p.add_argument("--steadiness-columns", type=int, dest="steadiness_columns", metavar="N",
                   help="the trees also read the first N steadiness columns (how steady a signal's errors have "
                        "been over 2 hours: corrected ECC, corrected row remaps, ...; docs/predictor.md, "
                        "Steadiness inside the trees: judged, not kept; default 0)")
    p.add_argument("--step-time-columns", dest="step_time_columns", action="store_const", const=True,
                   help="the trees also read the job step-time columns (a node's ranks against their job's: "
                        "docs/predictor.md, Job step times; not the default: judged twice, not shipped; train where only "
                        "some jobs report step times, as in a fleet)")
    p.add_argument("--context-columns", dest="context_columns", action="store_const", const=True,
                   help="the trees also read how loud the other nodes under a node's leaf switch usually are, "
                        "per error family (docs/predictor.md, Context; not the default)")
    p.add_argument("--incident-weights", dest="incident_weights", action="store_const", const=True,
                   help="each failing node's training rows weigh 1 / the nodes its failure took down, so a leaf "
                        "switch's nodes weigh as one failure (docs/predictor.md, Results; not the default)")
    _executor_flags(p)
    p.set_defaults(run=run_train)
    e = subparsers.add_parser("evaluate", help="evaluate a model (and its baselines) on a dataset")
    e.add_argument("--data", help="dataset directory (held out: later weeks, another cluster)")
    e.add_argument("--model", help="model directory (default: the shipped default model)")
    e.add_argument("--json", help="write the report as JSON here")
    e.add_argument("--html", help="write the report as HTML (with plots) here")
    e.add_argument("--budget", type=float, help="false evacuations per 1,000 node-days (default: the model's)")
    e.add_argument("--leave-one-out", dest="leave_one_out", metavar="KIND",
                   help="family, signature or node_type: train on --train-data without each one, evaluate on --data")
    e.add_argument("--train-data", dest="train_data", help="the dataset leave-one-out trains on")
    e.add_argument("--only", help="leave-one-out: hold out only these (comma-separated; each is a training run)")
    e.add_argument("--max-iter", type=int, dest="max_iter", help="leave-one-out: boosting iterations of each "
                   f"training run (default {TRAIN_DEFAULTS['max_iter']}, as foreshock train)")
    e.add_argument("--label-horizon-minutes", type=float, dest="label_horizon_minutes",
                   help="leave-one-out: each training run's label horizon, as foreshock train's (default 0: the horizon)")
    e.add_argument("--no-novelty", dest="novelty", action="store_const", const=False,
                   help="leave-one-out: train each model without the novelty alarm, as foreshock train --no-novelty")
    _executor_flags(e)
    e.set_defaults(run=run_evaluate)
    t = subparsers.add_parser("thresholds", help="re-choose a model's thresholds on a fleet's own history "
                                                 "(its false evacuations), without retraining",
                              description="Write a copy of a model whose thresholds for each false-evacuation "
                                          "budget are fitted on DIR, the fleet's own history, pooled with the "
                                          "model's validation curve (docs/predictor.md, Fleet calibration).")
    t.add_argument("--data", help="the fleet's history (schema v1, with its incidents), later than the model's "
                                  "training data")
    t.add_argument("--model", help="model directory (default: the shipped default model)")
    t.add_argument("--out", help="directory to write the calibrated model to (not the model's own)")
    t.add_argument("--prior-node-days", type=float, dest="prior_node_days",
                   help="weight of the model's validation curve, in node-days (default 1000)")
    t.set_defaults(run=run_thresholds)
    pl = subparsers.add_parser("pool", help="pool several `foreshock evaluate --json` reports of one model into "
                                            "one figure per budget",
                               description="Sum the failures, those caught, the false evacuations and the "
                                           "node-days of several evaluations of one model (held-out periods, "
                                           "clusters, seeds) at its thresholds, and print the pooled recall and "
                                           "false-evacuation rate with their intervals (docs/predictor.md, "
                                           "Pooling evaluations).")
    pl.add_argument("reports", nargs="+", metavar="REPORT", help="a JSON report of `foreshock evaluate --json`")
    pl.add_argument("--json", help="write the pooled figures as JSON here")
    pl.set_defaults(run=run_pool)


def _executor_flags(p) -> None:
    p.add_argument("--executor", choices=("local", "ray"),
                   help="where the per-node feature work runs: local (a process pool, the default) or ray")
    p.add_argument("--ray-address", dest="ray_address", metavar="HOST:PORT",
                   help="with --executor ray: the Ray head to join (default: a local Ray instance of one CPU "
                        "per core, started and stopped by the command)")
    p.add_argument("--on-corrupt", dest="on_corrupt", choices=("stop", "skip"),
                   help="a node partition whose files cannot be read: stop, naming the file (the default), or "
                        "leave that node out, name it and go on with the rest")


class _Progress:
    """rich progress bars on a terminal, one task per phase; elsewhere (systemd, CI, a log file) a plain
    line per phase every 10 % or LINE_SECONDS, whichever comes first, and at its end."""

    LINE_SECONDS = 30.0

    def __init__(self):
        self._bar = None
        self._tasks = {}
        self._lines: dict[str, tuple[float, int]] = {}   # phase -> (monotonic time, tenth) last printed
        self._t0 = time.monotonic()
        if sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
            self._bar = Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), transient=False)

    def __enter__(self):
        if self._bar:
            self._bar.start()
        return self

    def __exit__(self, *exc):
        if self._bar:
            self._bar.stop()

    def __call__(self, phase: str, done: int, total: int):
        if not self._bar:
            now = time.monotonic()
            tenth = 10 * done // max(total, 1)
            last_t, last_tenth = self._lines.get(phase, (-math.inf, -1))
            if done >= total or tenth > last_tenth or now - last_t >= self.LINE_SECONDS:
                self._lines[phase] = (now, tenth)
                print(f"{phase}: {done}/{total} ({100 * done / max(total, 1):.0f} %), {now - self._t0:.0f} s",
                      file=sys.stderr, flush=True)
            return
        if phase not in self._tasks:
            self._tasks[phase] = self._bar.add_task(phase, total=total)
        self._bar.update(self._tasks[phase], completed=done, total=total)


def _flags(args, keys):
    return {k: getattr(args, k, None) for k in keys}


def run_train(args, file_data) -> int:
    from foreshock.predictor import evaluate, executors, offline, train

    cfg = config.resolve("train", TRAIN_DEFAULTS, file_data=file_data, flags=_flags(args, TRAIN_DEFAULTS),
                         checks=TRAIN_CHECKS)
    if not cfg["data"] or not cfg["out"]:
        print("foreshock train: --data DIR and --out MODEL_DIR are required", file=sys.stderr)
        return 2
    data = _dataset("train", cfg["data"])
    if data is None:
        return 2
    command = "foreshock train " + " ".join(a for a in sys.argv[2:]) if sys.argv[1:2] == ["train"] else None
    try:
        with _Progress() as progress:
            manifest = train.train(data, cfg["out"], horizon_s=int(cfg["horizon_minutes"] * 60),
                                   budget=cfg["budget"], val_fraction=cfg["val_fraction"], neg_rate=cfg["neg_rate"],
                                   hard_neg_rate=cfg["hard_neg_rate"], max_iter=cfg["max_iter"], seed=cfg["seed"],
                                   prior_scale=cfg["prior_scale"], label_gap_hours=cfg["label_gap_hours"],
                                   max_negatives=cfg["max_negatives"],
                                   label_horizon_s=int(cfg["label_horizon_minutes"] * 60) or None,
                                   early_label_weight=cfg["early_label_weight"], progress=progress, command=command,
                                   compare_with=_compare_with(cfg["compare_with"]),
                                   base=_compare_with(cfg["base"]), executor=cfg["executor"],
                                   ray_address=cfg["ray_address"] or None, on_error=cfg["on_corrupt"],
                                   novelty=cfg["novelty"], linear_member=cfg["linear_member"],
                                   absolute_counts=cfg["absolute_counts"],
                                   steadiness_columns=cfg["steadiness_columns"],
                                   step_time_columns=cfg["step_time_columns"],
                                   context_columns=cfg["context_columns"],
                                   incident_weights=cfg["incident_weights"],
                                   **_hard_evidence_argument(cfg),
                                   threshold_prior_node_days=cfg["threshold_prior_node_days"] or None)
    except executors.ExecutorError as exc:
        print(f"foreshock train: {exc}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as exc:
        print(f"foreshock train: {exc}", file=sys.stderr)
        return 1
    for node, why in manifest["training"].get("skipped_partitions", {}).items():
        _err(f"WARNING: node {node} left out (--on-corrupt skip): {why}")
    sparse = offline.telemetry_interval_warning(manifest["training"].get("telemetry_interval"))
    if sparse:
        _err(sparse)
    v = manifest["metrics"]["validation"]["model"]
    tr = manifest["training"]
    print(f"model {manifest['version']} -> {cfg['out']}: {tr['nodes']} nodes, {tr['incidents']} incidents, "
          f"{tr['train_rows_sampled']} training rows, {tr['seconds']['total']} s, max RSS {tr['max_rss_mb']} MB")
    print(f"validation slice at threshold {manifest['recommended_threshold']:.4g} "
          f"(budget {manifest['budget']}/1,000 node-days): recall (precursor) "
          f"{_pct(v['incident_recall_precursor'])}{_interval(v.get('incident_recall_precursor_interval'), _pct)}, "
          f"median lead {_lead(v['median_lead_minutes'])} min, {v['false_evacuations_per_1000_node_days']:.2f}"
          f"{_interval(v.get('false_evacuations_per_1000_node_days_interval'), _rate)} false evacuations/1,000 "
          f"node-days, PR-AUC {v['pr_auc']:.3f} ([low-high]: {evaluate.INTERVAL_LEVEL:.0%} interval)")
    parts = manifest["metrics"].get("validation_parts")
    if parts:
        _print_parts(parts, " on the validation slice")
    over = hard_evidence_over_budget(manifest)
    if over:
        _err(over)
    allowed = manifest["budget"] * v["node_days"] / 1000.0
    pool = manifest.get("threshold_pooling")
    pooled = bool(pool) and "skipped" not in pool
    if pool and not pooled:
        print(f"thresholds chosen on the slice alone, not pooled with the base model's curve: {pool['skipped']}")
    elif pooled:
        print(f"thresholds chosen on the slice ({pool['slice_node_days']:,.0f} node-days) with the base model's "
              f"validation curve as a prior worth {pool['prior_node_days']:,.0f} node-days; the slice alone would have "
              f"given {pool['recommended_threshold_slice_alone']:.4g} at budget {manifest['budget']:g} "
              f"(--threshold-prior-node-days 0)")
    if allowed < train.MIN_BUDGET_EPISODES:
        setby = ("the slice's few highest healthy episodes and the base model's curve" if pooled else
                 "the slice's few highest healthy episodes")
        _err(f"WARNING: the thresholds rest on a validation slice of {v['node_days']:,.0f} node-days: at budget "
             f"{manifest['budget']:g} that is {allowed:.1f} false evacuations, so each threshold is set by "
             f"{setby}, and on a later period or another fleet the false evacuations "
             f"at it can be several times fewer or more. Re-fit them on a month or more of the fleet's later "
             f"history (`foreshock thresholds`), or keep serving the model compared with.")
    nov = manifest.get("novelty")
    if nov:
        w = nov["validation_without"]
        print(f"novelty alarm beside it: scales from {nov['healthy_rows']:,} healthy training rows; the model alone "
              f"on the same slice: recall (precursor) {_pct(w['incident_recall_precursor'])}, "
              f"{w['false_evacuations_per_1000_node_days']:.2f} false evacuations/1,000 node-days (--no-novelty "
              f"trains without it)")
    elif tr.get("novelty_skipped"):
        print(f"no novelty alarm: {tr['novelty_skipped']}")
    lin = manifest["estimator"].get("linear_member")
    if lin:
        t = lin["validation_trees_alone"]
        print(f"the trees averaged with a logistic regression (logit weights {lin['weights']['trees']:g} and "
              f"{lin['weights']['linear']:g}); the trees alone on the same slice, their threshold chosen there: "
              f"recall (precursor) {_pct(t['incident_recall_precursor'])}, "
              f"{t['false_evacuations_per_1000_node_days']:.2f} false evacuations/1,000 node-days, PR-AUC "
              f"{t['pr_auc']:.3f}")
    b = manifest["estimator"].get("stacked_with_base")
    if b and "skipped" in b:
        print(f"not stacked with {b['path']}: {b['skipped']}")
    elif b:
        print(f"stacked with {b['path']} (model {b['model_version']}): logit weights {b['weights']['base']:.2f} "
              f"for it and {b['weights']['this_history']:.2f} for the model of this history (--base '' trains "
              f"from this history alone)")
    c = manifest["metrics"].get("validation_compared")
    if c and "skipped" in c:
        print(f"not compared with {c['path']}: {c['skipped']}")
    elif c:
        print(f"{c['path']} (model {c['model_version']}) on the same slice, its threshold chosen there for the same "
              f"budget: recall (precursor) {_pct(c['incident_recall_precursor'])}, median lead "
              f"{_lead(c['median_lead_minutes'])} min, {c['false_evacuations_per_1000_node_days']:.2f} false "
              f"evacuations/1,000 node-days, PR-AUC {c['pr_auc']:.3f}")
        if _better(c, v):
            _err(f"WARNING: on this dataset's own validation slice the model compared with catches more "
                 f"({_pct(c['incident_recall_precursor'])} against {_pct(v['incident_recall_precursor'])} at the "
                 f"same budget): {v['incidents_precursor']} precursor incidents there, and fewer before it, may be "
                 f"too few to learn from. Keep serving the model compared with until the history holds more.")
    return 0


def _hard_evidence_argument(cfg: dict) -> dict:
    """train.train's `hard_evidence` from [train] hard_evidence and hard_evidence_conditions ({}: its default)."""
    if not cfg["hard_evidence"]:
        return {"hard_evidence": ()}
    names = [n.strip() for n in cfg["hard_evidence_conditions"].split(",") if n.strip()]
    return {"hard_evidence": tuple(names)} if names else {}


def hard_evidence_over_budget(manifest: dict) -> str | None:
    """A warning when a model's hard evidence alone spent more than its budget on the validation slice
    (manifest metrics.validation_parts): the thresholds count its alarms, so that budget leaves the risk
    none and its threshold sits at the top of its scores. Names what each condition spent. None otherwise."""
    parts = manifest.get("metrics", {}).get("validation_parts")
    if not parts:
        return None
    rate = parts["hard_evidence_alone"]["false_evacuations_per_1000_node_days"]
    over = sorted(float(b) for b in manifest.get("thresholds", {}) if float(b) < rate)
    if not over or manifest["budget"] not in over:
        return None
    spent = ", ".join(f"{m['condition']} {m['false_evacuations_per_1000_node_days']:.2f}"
                      for m in sorted(parts["conditions"], key=lambda m: -m["false_evacuations_per_1000_node_days"]))
    return (f"WARNING: on the validation slice the hard evidence alone spent {rate:.2f} false evacuations/1,000 "
            f"node-days, over the budgets {', '.join(f'{b:g}' for b in over)}: the thresholds count its alarms, so "
            f"at those the model's risk has no budget left and its threshold sits at the top of its scores. Each "
            f"condition alone: {spent}. Leave out one that alarms on this fleet's healthy nodes (--hard-evidence "
            f"with the others), or train with --no-hard-evidence.")


def _compare_with(value: str):
    from foreshock.predictor import registry
    return registry.default_model_path() if value == "shipped" else (value or None)


def _better(c: dict, v: dict) -> bool:
    """The compared model catches more precursor incidents than the new one on the same slice."""
    a, b = c.get("incident_recall_precursor"), v.get("incident_recall_precursor")
    return a is not None and b is not None and not math.isnan(a) and (math.isnan(b) or a > b)


def _pct(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.0f}%"


def _err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _rate(rate: float) -> str:
    return f"{rate:.2f}"


def _interval(bounds, fmt) -> str:
    """" [low-high]" of a figure's interval (evaluate.INTERVAL_LEVEL), or nothing for a report without one."""
    if not bounds or any(b is None or math.isnan(b) for b in bounds):
        return ""
    return f" [{fmt(bounds[0])}-{fmt(bounds[1])}]"


def _figures(m: dict) -> str:
    if m.get("threshold") is None:
        return m.get("missing", "no threshold")
    return _judged(m)


def _lead(minutes, width: int = 0) -> str:
    """A median lead in minutes, or "-" where nothing was caught (no lead: None or NaN)."""
    return "-".rjust(width) if minutes is None or math.isnan(minutes) else f"{minutes:{width}.1f}"


def _judged(m: dict) -> str:
    """Recall of precursor failures, median lead and false evacuations of an at_budget-like row."""
    recall = _interval(m.get("incident_recall_precursor_interval"), _pct)
    rate = _interval(m.get("false_evacuations_per_1000_node_days_interval"), _rate)
    return (f"recall(p) {_pct(m['incident_recall_precursor']):>4}{recall}, "
            f"lead {_lead(m['median_lead_minutes'], 6)} min, "
            f"FE/1k {m['false_evacuations_per_1000_node_days']:6.2f}{rate}")


def _print_parts(pp: dict, where: str = "") -> None:
    """evaluate.policy_parts (or pooling's), one line a part; a pooled part's median lead is per report."""
    def line(m: dict) -> str:
        if "median_lead_minutes" in m:
            return _judged(m)
        return (f"caught {m['detected_precursor']} of {m['incidents_precursor']}, recall(p) "
                f"{_pct(m['incident_recall_precursor'])}{_interval(m['incident_recall_precursor_interval'], _pct)}, "
                f"FE/1k {m['false_evacuations_per_1000_node_days']:.2f}"
                f"{_interval(m['false_evacuations_per_1000_node_days_interval'], _rate)}")

    print(f"model at budget {pp['budget']:g}{where}, each part alone (its hard evidence adds "
          f"{pp['added_by_hard_evidence']} precursor failures to what its risk alone catches):")
    print(f"  risk alone          {line(pp['risk_alone'])}")
    print(f"  hard evidence alone {line(pp['hard_evidence_alone'])}")
    width = max((len(m["condition"]) for m in pp["conditions"]), default=0)
    for m in pp["conditions"]:
        print(f"    {m['condition']:{width}} {line(m)}")


def run_pool(args, file_data) -> int:
    from foreshock.predictor import evaluate, pooling

    problem = _unwritable({"json": args.json}, ("json",))
    if problem:
        print(f"foreshock pool: {problem}", file=sys.stderr)
        return 2
    try:
        pooled = pooling.pool([(path, pooling.read_report(path)) for path in args.reports])
    except pooling.PoolError as exc:
        print(f"foreshock pool: {exc}", file=sys.stderr)
        return 1
    if pooled["overlaps"]:
        _err(f"WARNING: {', '.join(pooled['overlaps'])} overlap the model's training data: the pooled figures are "
             "not evidence of how the model does on new data")
    print(f"{len(pooled['reports'])} evaluations of model {pooled['model_version']}, {pooled['node_days']:,.1f} "
          f"node-days; pooled at the manifest's thresholds ([low-high]: the figure's "
          f"{evaluate.INTERVAL_LEVEL:.0%} interval):")
    for b, per in pooled["at_budgets"].items():
        for name, m in per.items():
            if m.get("threshold") is None:
                print(f"  budget {float(b):g} {name:10} {m.get('missing', 'no threshold')}")
                continue
            leads = ", ".join("-" if v is None or math.isnan(v) else f"{v:.0f}" for v in m["median_lead_minutes_per_report"])
            print(f"  budget {float(b):g} {name:10} caught {m['detected_precursor']} of {m['incidents_precursor']}: "
                  f"recall(p) {_pct(m['incident_recall_precursor'])}"
                  f"{_interval(m['incident_recall_precursor_interval'], _pct)}, FE/1k "
                  f"{m['false_evacuations_per_1000_node_days']:.2f}"
                  f"{_interval(m['false_evacuations_per_1000_node_days_interval'], _rate)}; median lead per "
                  f"report {leads} min")
    at = pooled["at_budgets"].get(str(float(pooled["budget"])), {}).get("model")
    if at and at.get("per_family"):
        print(f"model at budget {pooled['budget']:g}, caught per family: " + ", ".join(
            f"{fam} {f['detected']}/{f['incidents']}" for fam, f in at["per_family"].items()))
    pp = pooled.get("policy_parts")
    if pp:
        _print_parts(pp)
    if args.json:
        Path(args.json).write_text(json.dumps(pooled, indent=1, default=float, allow_nan=True) + "\n")
    return 0


def run_evaluate(args, file_data) -> int:
    from foreshock.predictor import evaluate, executors, offline, registry, report

    cfg = config.resolve("evaluate", EVALUATE_DEFAULTS, file_data=file_data, flags=_flags(args, EVALUATE_DEFAULTS),
                         checks=EVALUATE_CHECKS)
    if not cfg["data"]:
        print("foreshock evaluate: --data DIR is required", file=sys.stderr)
        return 2
    data = {key: _dataset("evaluate", cfg[key]) for key in ("data", "train_data") if cfg[key]}
    if None in data.values():
        return 2
    problem = _unwritable(cfg, ("json", "html"))
    if problem:
        print(f"foreshock evaluate: {problem}", file=sys.stderr)
        return 2
    if cfg["leave_one_out"]:
        return _run_leave_one_out(cfg, data)
    if (cfg["train_data"] or cfg["only"] or cfg["max_iter"] != EVALUATE_DEFAULTS["max_iter"]
            or cfg["label_horizon_minutes"] != EVALUATE_DEFAULTS["label_horizon_minutes"] or not cfg["novelty"]):
        print("foreshock evaluate: --train-data, --only, --max-iter, --label-horizon-minutes and --no-novelty "
              "go with --leave-one-out", file=sys.stderr)
        return 2
    try:
        with _Progress() as progress:
            rep = evaluate.evaluate_dataset(data["data"], cfg["model"] or None,
                                            budget=None if cfg["budget"] < 0 else cfg["budget"], progress=progress,
                                            executor=cfg["executor"], ray_address=cfg["ray_address"] or None,
                                            on_error=cfg["on_corrupt"])
    except (registry.ModelError, executors.ExecutorError) as exc:
        print(f"foreshock evaluate: {exc}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as exc:
        print(f"foreshock evaluate: {exc}", file=sys.stderr)
        return 1
    _write(cfg, rep, report.to_html)
    for node, why in rep.get("skipped_partitions", {}).items():
        _err(f"WARNING: node {node} left out (--on-corrupt skip): {why}")
    print(f"{rep['nodes']} nodes, {rep['node_days']:.1f} node-days, {rep['model']['incidents']} incidents "
          f"({rep['model']['incidents_precursor']} with precursors); budget {rep['budget']} false evacuations/1,000 node-days")
    print(f"{'':10} {'PR-AUC':>7} {'ROC-AUC':>7} {'Brier':>8} {'recall(p)':>9} {'recall(all)':>11} {'lead':>6} {'FE/1k':>6}")
    for name in evaluate.MODEL_NAMES:
        m = rep.get(name)
        if not m:
            continue
        print(f"{name:10} {m['pr_auc']:7.3f} {m['roc_auc']:7.3f} {m['brier']:8.5f} {_pct(m['incident_recall_precursor']):>9} "
              f"{_pct(m['incident_recall_all']):>11} {_lead(m['median_lead_minutes'], 6)} {m['false_evacuations_per_1000_node_days']:6.2f}")
    if rep.get("hard_evidence"):
        print("the model also alarms, whatever its score, where the features show " + ", ".join(rep["hard_evidence"])
              + " (its manifest's hard_evidence); its figures below count those alarms")
    print("at the manifest's thresholds for budgets " + ", ".join(f"{b:g}" for b in evaluate.AT_BUDGETS)
          + f" ([low-high]: the figure's {evaluate.INTERVAL_LEVEL:.0%} interval):")
    for b, per in rep["at_budgets"].items():
        for name, m in per.items():
            moved = m.get("threshold_in_force")
            raised = f" (raised by the fleet's score level in {moved['hours_raised']} of {moved['hours']} h, " \
                     f"up to {moved['max']:.3g})" if moved and moved["hours_raised"] else ""
            print(f"  budget {float(b):g} {name:10} {_figures(m)}{raised}")
    sl = rep.get("score_level") or {}
    if sl.get("fixed_thresholds"):
        print(f"the model at the manifest's numbers, not following the fleet's score level (reference {sl['reference']:.3g}):")
        for b, per in sl["fixed_thresholds"].items():
            print(f"  budget {float(b):g} fixed      {_figures(per['model'])}")
    fc = rep.get("fleet_calibrated") or {}
    if fc.get("at_budgets"):
        print(f"the model at thresholds re-fitted every {fc['refit_hours']:g} h on this data's decided false "
              f"evacuations (the manifest's curve worth {fc['prior_node_days']:g} node-days):")
        for b, m in fc["at_budgets"].items():
            print(f"  budget {float(b):g} fleet-calibrated {_figures({**m, 'threshold': m['manifest_threshold']})}")
    at = rep["at_budgets"].get(str(float(rep["budget"])), {}).get("model")
    if at and at.get("threshold") is not None:
        print(f"model at budget {rep['budget']:g}, recall per family: " + ", ".join(
            f"{name} {f['detected']}/{f['incidents']}" for name, f in at["per_family"].items()))
        print(f"model at budget {rep['budget']:g}, false evacuations / 1,000 node-days per node type: " + ", ".join(
            f"{name} {t['false_evacuations_per_1000_node_days']:.2f}" for name, t in at["per_node_type"].items()))
    pp = rep.get("policy_parts")
    if pp:
        _print_parts(pp)
    for warning in (evaluate.overlap_warning(rep["overlap"]),
                    offline.telemetry_interval_warning(rep.get("telemetry_interval"))):
        if warning:
            _err(warning)
    return 0


def run_thresholds(args, file_data) -> int:
    from foreshock.predictor import calibration, registry

    cfg = config.resolve("thresholds", THRESHOLDS_DEFAULTS, file_data=file_data,
                         flags=_flags(args, THRESHOLDS_DEFAULTS),
                         checks={"prior_node_days": config.between(*calibration.PRIOR_NODE_DAYS_RANGE)})
    if not cfg["data"] or not cfg["out"]:
        print("foreshock thresholds: --data DIR and --out MODEL_DIR are required", file=sys.stderr)
        return 2
    data = _dataset("thresholds", cfg["data"])
    if data is None:
        return 2
    try:
        with _Progress() as progress:
            man = calibration.calibrate_model(data, cfg["model"] or None, cfg["out"],
                                              prior_node_days=cfg["prior_node_days"],
                                              command=" ".join(["foreshock"] + sys.argv[1:]), progress=progress)
    except registry.ModelError as exc:
        print(f"foreshock thresholds: {exc}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"foreshock thresholds: {exc}", file=sys.stderr)
        return 1
    fc = man["fleet_calibration"]
    print(f"calibrated {fc['from_model']} on {fc['data']['nodes']} nodes, {fc['fleet_node_days']:.1f} node-days "
          f"(the model's validation curve worth {fc['prior_node_days']:g}) -> {cfg['out']} ({man['version']})")
    for key in sorted(man["thresholds"], key=float):
        print(f"  budget {float(key):g}: threshold {float(fc['thresholds_before'][key]):.5f} -> "
              f"{float(man['thresholds'][key]):.5f} ({fc['fleet_false_evacuations_at_thresholds'][key]} false "
              "evacuations of this history at the new one)")
    return 0


def _dataset(command: str, value: str):
    """--data (a directory, or a URI pyarrow.fs takes: s3://, gs://, file://, ...) opened, its storage
    asked within dataset.OPEN_TIMEOUT_S; None, with the reason on stderr, when it cannot be."""
    from foreshock import dataset

    try:
        return dataset.open_dataset_root(value)
    except dataset.DatasetError as exc:
        print(f"foreshock {command}: {exc}", file=sys.stderr)
        return None


def _unwritable(cfg: dict, keys: tuple[str, ...]) -> str | None:
    """Why an output path of cfg cannot be written (None: all can), checked before the minutes of work."""
    for key in keys:
        if not cfg.get(key):
            continue
        path = Path(cfg[key])
        folder = path.parent
        if path.is_dir():
            return f"--{key.replace('_', '-')} {path}: is a folder, not a file"
        if not folder.is_dir():
            return f"--{key.replace('_', '-')} {path}: folder {folder} does not exist"
        if not os.access(folder, os.W_OK):
            return f"--{key.replace('_', '-')} {path}: folder {folder} is not writable"
    return None


def _write(cfg: dict, rep: dict, to_html) -> None:
    # each report whole or not at all: a reader, or a kill, never meets half a file
    for key, text in (("json", lambda: json.dumps(rep, indent=2, sort_keys=True, default=float) + "\n"),
                      ("html", lambda: to_html(rep))):
        if cfg[key]:
            path = Path(cfg[key])
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(text())
            os.replace(tmp, path)


def _run_leave_one_out(cfg: dict, data: dict) -> int:
    from foreshock.predictor import evaluate, executors, groups, leave_one_out, report

    kind = cfg["leave_one_out"]
    if kind not in groups.KINDS:
        print(f"foreshock evaluate: --leave-one-out {kind!r}: one of {', '.join(groups.KINDS)}", file=sys.stderr)
        return 2
    if not cfg["train_data"]:
        print("foreshock evaluate: --leave-one-out needs --train-data TRAIN_DIR (the data it trains on)", file=sys.stderr)
        return 2
    if cfg["model"]:
        print("foreshock evaluate: --leave-one-out trains its own models: drop --model", file=sys.stderr)
        return 2
    if cfg["max_iter"] < 1:
        print(f"foreshock evaluate: --max-iter {cfg['max_iter']}: must be at least 1", file=sys.stderr)
        return 2
    try:
        rep = leave_one_out.leave_one_out(data["train_data"], data["data"], kind, only=cfg["only"] or None,
                                          max_iter=cfg["max_iter"], log=_err, executor=cfg["executor"],
                                          label_horizon_s=int(cfg["label_horizon_minutes"] * 60) or None,
                                          ray_address=cfg["ray_address"] or None, novelty=cfg["novelty"])
    except executors.ExecutorError as exc:
        print(f"foreshock evaluate: {exc}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as exc:
        print(f"foreshock evaluate: {exc}", file=sys.stderr)
        return 1
    _write(cfg, rep, report.leave_one_out_html)
    print(f"leave one {kind} out: trained on {rep['train_data']}, evaluated on {rep['data']} ({rep['nodes']} nodes)")
    for name, entry in rep["held_out"].items():
        print(f"{name}:")
        if "error" in entry:
            print(f"  not trained without it: {entry['error']}")
        for label, key in (("without it", "held_out_model"), ("on everything", "model_trained_on_everything")):
            for b, m in entry[key].items():
                n = f", {m['incidents_precursor']} incidents" if m.get("threshold") is not None else ""
                print(f"  {label:14} budget {float(b):g}: {_figures(m)}{n}")
    warning = evaluate.overlap_warning(rep["overlap"])
    if warning:
        _err(warning)
    return 0
