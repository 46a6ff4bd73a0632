"""Leave-one-out evaluation: how the predictor does on a failure family or a node type it never saw.

For each family (incident category), signature (category and failure mode, groups.py) or node type
(inventory GPU and HCA counts) present in the training dataset (families and signatures: of its
precursor incidents), train.train runs on the training dataset with that group held out
(groups.HoldOut: the same code path as `foreshock train`, the group's steps left out of the whole
run), and the model is evaluated on the evaluation dataset at its own manifest's thresholds for the
budgets evaluate.AT_BUDGETS: for the held-out group, precursor recall and median lead, and the false
evacuation rate (of all nodes; for a node type, of that type's nodes). A model trained on everything,
with the same settings, is evaluated on the same data for comparison, for every group.

The evaluation dataset's features are built once and every model scores them in the same pass. The
report (a JSON-able dict) is defined in docs/predictor.md, "Leave one out"; report.py renders it.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from foreshock import dataset as ds
from foreshock.predictor import evaluate as ev
from foreshock.predictor import groups
from foreshock.predictor import labels as lb
from foreshock.predictor import registry, train

EVERYTHING = "(everything)"   # not a category, signature or node type


def _train_types(train_dir) -> dict[str, str]:
    from foreshock.predictor import offline

    return groups.node_types(ds.read_table(train_dir, "inventory"), offline.list_dataset_nodes(train_dir))


def present_groups(train_dir, kind: str) -> list[str]:
    """The groups of `kind` leave-one-out can hold out of this training dataset, sorted."""
    if kind == "node_type":
        return sorted(set(_train_types(train_dir).values()))
    frame = lb.Incidents.from_table(ds.read_table(train_dir, "incidents")).frame
    pre = frame[frame["has_precursor"].astype(bool)]
    return sorted(set(pre[groups.INCIDENT_GROUPS[kind]]))


def holdouts(train_dir, kind: str, names: list[str], label_gap_hours: float) -> dict[str, groups.HoldOut]:
    """The HoldOut of each named group (train.train's default horizon, the given label gap)."""
    if kind == "node_type":
        types = _train_types(train_dir)
        return {name: groups.node_type_holdout(types, name) for name in names}
    incidents = lb.Incidents.from_table(ds.read_table(train_dir, "incidents"))
    return {name: groups.incident_holdout(incidents, kind, name, lb.DEFAULT_HORIZON_S, label_gap_hours * 3600.0)
            for name in names}


def _held_out_figures(entry: dict, kind: str, name: str) -> dict:
    """From at_budget's dict: the held-out group's recall and lead, and the matching false-evacuation rate."""
    if entry.get("threshold") is None:
        return {"threshold": None, "missing": entry.get("missing")}
    group = entry[f"per_{kind}"].get(name, {"incidents": 0, "detected": 0, "recall": math.nan,
                                            "median_lead_minutes": math.nan})
    out = {"threshold": entry["threshold"], "incidents_precursor": group["incidents"], "detected": group["detected"],
           "incident_recall_precursor": group["recall"], "median_lead_minutes": group["median_lead_minutes"]}
    if kind == "node_type":
        own = entry["per_node_type"].get(name, {})
        out["node_days"] = own.get("node_days", 0.0)
        out["false_evacuations_per_1000_node_days"] = own.get("false_evacuations_per_1000_node_days", math.nan)
    else:
        out["node_days"] = entry["node_days"]
        out["false_evacuations_per_1000_node_days"] = entry["false_evacuations_per_1000_node_days"]
    return out


def _training_summary(manifest: dict) -> dict:
    """What a training run learned from: rows, positives by family, rows by node type, what it left out."""
    tr = manifest["training"]
    return {"held_out": tr.get("held_out"), **{k: tr.get(k) for k in (
        "train_rows_sampled", "train_positive_rows", "train_positive_rows_by_family", "train_rows_sampled_by_node_type")}}


def leave_one_out(train_dir, eval_dir, kind: str, *, only: list[str] | None = None, max_iter: int = 150,
                  seed: int = 0, prior_scale: float = 1.0, label_gap_hours: float = 12.0,
                  label_horizon_s: int | None = lb.TRAINING_LABEL_HORIZON_S, early_label_weight: float = lb.EARLY_LABEL_WEIGHT,
                  log: Callable[[str], None] = lambda line: None, work_dir=None, executor: str = "local",
                  ray_address: str | None = None, novelty: bool = True) -> dict:
    """Train without each group of `kind` (and once on everything), evaluate all on `eval_dir`.

    `only`: hold out these groups only (each is a training run). `log` gets one line per step.
    Models are written under `work_dir` (default: a temporary directory, removed at the end). The
    features are built on `executor` (offline.FeatureBuilder).
    """
    if kind not in groups.KINDS:
        raise ValueError(f"leave-one-out: unknown kind {kind!r} (one of {', '.join(groups.KINDS)})")
    # paths or URIs, opened once for the many training runs and the evaluation (dataset.DatasetRoot)
    train_dir, eval_dir = ds.open_dataset_root(train_dir), ds.open_dataset_root(eval_dir)
    available = present_groups(train_dir, kind)
    if only:
        unknown = [n for n in only if n not in available]
        if unknown:
            raise ValueError(f"leave-one-out: {kind} {unknown} not in {train_dir} (present: {available})")
    names = list(only) if only else available
    if not names:
        raise ValueError(f"leave-one-out: {train_dir} has no {kind} to hold out")
    settings = {"max_iter": max_iter, "seed": seed, "prior_scale": prior_scale, "label_gap_hours": label_gap_hours,
                "label_horizon_s": label_horizon_s, "early_label_weight": early_label_weight, "novelty": novelty}
    with tempfile.TemporaryDirectory(prefix="foreshock-loo-") as tmp:
        root = Path(work_dir or tmp)
        manifests: dict[str, dict] = {}
        errors: dict[str, str] = {}
        runs = [EVERYTHING, *names]
        held = holdouts(train_dir, kind, names, label_gap_hours)
        for k, run in enumerate(runs, 1):
            holdout = held.get(run)
            what = "on everything" if holdout is None else f"without {kind} {run!r}"
            log(f"leave-one-out {k}/{len(runs)}: training {what} ({train_dir})")
            t0 = time.perf_counter()
            try:
                manifests[run] = train.train(train_dir, root / f"model-{k:03d}", max_iter=max_iter, seed=seed,
                                             prior_scale=prior_scale, label_gap_hours=label_gap_hours,
                                             label_horizon_s=label_horizon_s, early_label_weight=early_label_weight,
                                             holdout=holdout, executor=executor, ray_address=ray_address,
                                             novelty=novelty)
            except ValueError as exc:
                if run == EVERYTHING:
                    raise
                errors[run] = str(exc)
                log(f"leave-one-out {k}/{len(runs)}: cannot train {what}: {exc}")
                continue
            log(f"leave-one-out {k}/{len(runs)}: trained {what} in {time.perf_counter() - t0:.0f} s")
        models = {run: registry.load_model(root / f"model-{k:03d}") for k, run in enumerate(runs, 1) if run in manifests}
        log(f"leave-one-out: scoring {eval_dir} with {len(models)} models")
        scored = ev.score_dataset(eval_dir, {run: m.probability for run, m in models.items()},
                                  manifests[EVERYTHING]["horizon_seconds"], executor=executor,
                                  ray_address=ray_address)
    horizon_s = manifests[EVERYTHING]["horizon_seconds"]
    full = manifests[EVERYTHING]
    everything = {}
    for b in ev.AT_BUDGETS:
        th = registry.manifest_threshold(full, b)
        everything[str(b)] = ev.at_budget(scored.nodes, EVERYTHING, th, scored.incidents, scored.types, horizon_s, b)
    held_out = {}
    for run in names:
        entry: dict = {"training": _training_summary(manifests[run]) if run in manifests else None}
        if run in errors:
            entry["error"] = errors[run]
        without, with_all = {}, {}
        for b in ev.AT_BUDGETS:
            if run in manifests:
                th = registry.manifest_threshold(manifests[run], b)
                without[str(b)] = _held_out_figures(
                    ev.at_budget(scored.nodes, run, th, scored.incidents, scored.types, horizon_s, b), kind, run)
            with_all[str(b)] = _held_out_figures(everything[str(b)], kind, run)
        entry["held_out_model"] = without
        entry["model_trained_on_everything"] = with_all
        held_out[run] = entry
    return {
        "leave_one_out": kind, "train_data": str(train_dir), "data": str(eval_dir), "settings": settings,
        "budgets": [str(b) for b in ev.AT_BUDGETS], "budget_unit": "false evacuations per 1,000 node-days",
        "horizon_minutes": horizon_s / 60, "nodes": len(scored.nodes), "node_types": scored.type_counts(),
        "held_out": held_out, "everything": everything,
        "everything_training": _training_summary(full),
        "overlap": ev.overlap(full["training"], scored.identity),
        "definitions": {
            "held_out_model": f"trained on {train_dir} without the {kind}'s steps (see docs/predictor.md), "
                              "evaluated at its own manifest's thresholds: recall and median lead of the group's "
                              "precursor incidents, false evacuations per 1,000 node-days "
                              + ("of the type's nodes" if kind == "node_type" else "of all nodes"),
            "model_trained_on_everything": "the same figures for a model trained with the same settings on all of "
                                           f"{train_dir}",
        },
    }
