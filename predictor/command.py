"""`foreshock train` and `foreshock evaluate`: the offline loop a reliability engineer runs.

    foreshock train --data DIR --out MODEL_DIR [--horizon-minutes 30] [--budget 2] [--val-fraction 0.3]
    foreshock evaluate --data DIR --model MODEL_DIR [--json FILE] [--html FILE] [--budget F]

Settings come from the [train] / [evaluate] tables of the config file, FORESHOCK_TRAIN_* /
FORESHOCK_EVALUATE_* environment variables, then flags (foreshock/config.py). Long steps show rich
progress bars on a terminal.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from foreshock import config

TRAIN_DEFAULTS = {"data": "", "out": "", "horizon_minutes": 30.0, "budget": 2.0, "val_fraction": 0.3,
                  "neg_rate": 0.01, "hard_neg_rate": 0.04, "max_iter": 150, "seed": 0,
                  "prior_scale": 1.0, "label_gap_hours": 12.0, "max_negatives": 250_000}
EVALUATE_DEFAULTS = {"data": "", "model": "", "json": "", "html": "", "budget": -1.0}


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
    p.add_argument("--max-negatives", type=int, dest="max_negatives",
                   help="at most this many sampled negative training rows (default 250000)")
    p.add_argument("--seed", type=int)
    p.add_argument("--prior-scale", type=float, dest="prior_scale",
                   help="the training data's incident rate over the deployment's (simulate --rate-scale): "
                        "probabilities are moved to the deployment's base rate")
    p.set_defaults(run=run_train)
    e = subparsers.add_parser("evaluate", help="evaluate a model (and its baselines) on a dataset")
    e.add_argument("--data", help="dataset directory (held out: later weeks, another cluster)")
    e.add_argument("--model", help="model directory (default: the shipped default model)")
    e.add_argument("--json", help="write the report as JSON here")
    e.add_argument("--html", help="write the report as HTML (with plots) here")
    e.add_argument("--budget", type=float, help="false evacuations per 1,000 node-days (default: the model's)")
    e.set_defaults(run=run_evaluate)


class _Progress:
    """rich progress bars, one task per phase; silent when stderr is not a terminal."""

    def __init__(self):
        self._bar = None
        self._tasks = {}
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
            return
        if phase not in self._tasks:
            self._tasks[phase] = self._bar.add_task(phase, total=total)
        self._bar.update(self._tasks[phase], completed=done, total=total)


def _flags(args, keys):
    return {k: getattr(args, k, None) for k in keys}


def run_train(args, file_data) -> int:
    from foreshock.predictor import train

    cfg = config.resolve("train", TRAIN_DEFAULTS, file_data=file_data, flags=_flags(args, TRAIN_DEFAULTS))
    if not cfg["data"] or not cfg["out"]:
        print("foreshock train: --data DIR and --out MODEL_DIR are required", file=sys.stderr)
        return 2
    if not Path(cfg["data"]).is_dir():
        print(f"foreshock train: dataset directory {cfg['data']} does not exist", file=sys.stderr)
        return 2
    command = "foreshock train " + " ".join(a for a in sys.argv[2:]) if sys.argv[1:2] == ["train"] else None
    try:
        with _Progress() as progress:
            manifest = train.train(cfg["data"], cfg["out"], horizon_s=int(cfg["horizon_minutes"] * 60),
                                   budget=cfg["budget"], val_fraction=cfg["val_fraction"], neg_rate=cfg["neg_rate"],
                                   hard_neg_rate=cfg["hard_neg_rate"], max_iter=cfg["max_iter"], seed=cfg["seed"],
                                   prior_scale=cfg["prior_scale"], label_gap_hours=cfg["label_gap_hours"],
                                   max_negatives=cfg["max_negatives"], progress=progress, command=command)
    except (ValueError, FileNotFoundError) as exc:
        print(f"foreshock train: {exc}", file=sys.stderr)
        return 1
    v = manifest["metrics"]["validation"]["model"]
    tr = manifest["training"]
    print(f"model {manifest['version']} -> {cfg['out']}: {tr['nodes']} nodes, {tr['incidents']} incidents, "
          f"{tr['train_rows_sampled']} training rows, {tr['seconds']['total']} s, max RSS {tr['max_rss_mb']} MB")
    print(f"validation slice at threshold {manifest['recommended_threshold']:.4g} "
          f"(budget {manifest['budget']}/1,000 node-days): recall (precursor) "
          f"{_pct(v['incident_recall_precursor'])}, median lead {v['median_lead_minutes']:.1f} min, "
          f"{v['false_evacuations_per_1000_node_days']:.2f} false evacuations/1,000 node-days, PR-AUC {v['pr_auc']:.3f}")
    return 0


def _pct(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.0f}%"


def run_evaluate(args, file_data) -> int:
    from foreshock.predictor import evaluate, registry, report

    cfg = config.resolve("evaluate", EVALUATE_DEFAULTS, file_data=file_data, flags=_flags(args, EVALUATE_DEFAULTS))
    if not cfg["data"]:
        print("foreshock evaluate: --data DIR is required", file=sys.stderr)
        return 2
    if not Path(cfg["data"]).is_dir():
        print(f"foreshock evaluate: dataset directory {cfg['data']} does not exist", file=sys.stderr)
        return 2
    try:
        with _Progress() as progress:
            rep = evaluate.evaluate_dataset(cfg["data"], cfg["model"] or None,
                                            budget=None if cfg["budget"] < 0 else cfg["budget"], progress=progress)
    except registry.ModelError as exc:
        print(f"foreshock evaluate: {exc}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as exc:
        print(f"foreshock evaluate: {exc}", file=sys.stderr)
        return 1
    if cfg["json"]:
        Path(cfg["json"]).write_text(json.dumps(rep, indent=2, sort_keys=True, default=float) + "\n")
    if cfg["html"]:
        Path(cfg["html"]).write_text(report.to_html(rep))
    print(f"{rep['nodes']} nodes, {rep['node_days']:.1f} node-days, {rep['model']['incidents']} incidents "
          f"({rep['model']['incidents_precursor']} with precursors); budget {rep['budget']} false evacuations/1,000 node-days")
    print(f"{'':10} {'PR-AUC':>7} {'ROC-AUC':>7} {'Brier':>8} {'recall(p)':>9} {'recall(all)':>11} {'lead':>6} {'FE/1k':>6}")
    for name in evaluate.MODEL_NAMES:
        m = rep.get(name)
        if not m:
            continue
        print(f"{name:10} {m['pr_auc']:7.3f} {m['roc_auc']:7.3f} {m['brier']:8.5f} {_pct(m['incident_recall_precursor']):>9} "
              f"{_pct(m['incident_recall_all']):>11} {m['median_lead_minutes']:6.1f} {m['false_evacuations_per_1000_node_days']:6.2f}")
    return 0
