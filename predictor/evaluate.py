"""Honest evaluation: step metrics, per-incident recall at a false-evacuation budget, lead times, calibration.

Reads the scores of every step of every node (collect(): the offline features of offline.py, scored
by the model and both baselines) and the incidents table (labels.py). Definitions (docs/predictor.md):

* An *alert* is a step whose score is at or above the threshold. Alert steps closer than COOLDOWN_STEPS
  (10 min) belong to one *episode*: the node is evacuated once, at the episode's first step, and
  stays out while the alert lasts (hysteresis and cool-down, as the service's policy does).
* An incident is *detected* when one of its nodes alerted in the horizon before it ([ts - horizon, ts));
  its *lead* is from the start of that alert's episode to the incident.
* An episode is a *false evacuation* when the node does not fail after it: no incident of that node
  follows within the horizon of any of its steps, nor within JUSTIFIED_HOURS (24 h) of its start. A
  node evacuated hours before its GPU dies was failing: the move was right, whatever the label horizon
  (its later alerts still have to land in the horizon for the incident to count as detected). The
  rate is per 1,000 node-days of evaluated (present, not excluded) steps. The strict count (only the
  horizon justifies an episode) is reported too, as `false_evacuations_strict*`.
* Incidents of categories without precursors are reported apart (`incident_recall_all` includes them,
  `incident_recall_precursor` does not) and are never credited as lead time.
* Thresholds come from the model's manifest (chosen on the training run's validation slice), never
  from the data being evaluated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from sklearn.metrics import average_precision_score, brier_score_loss, precision_recall_curve, roc_auc_score

from foreshock.predictor import labels as lb
from foreshock.predictor.offline import STEP_NS

COOLDOWN_STEPS = 10
JUSTIFIED_HOURS = 24.0
MODEL_NAMES = ("model", "rule", "logistic")
RELIABILITY_EDGES = (0.0, 0.001, 0.003, 0.01, 0.03, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0000001)


@dataclass
class NodeScores:
    node: str
    step_end_ns: np.ndarray           # [T]
    y: np.ndarray                     # [T] int8
    usable: np.ndarray                # [T] present and not excluded
    scores: dict[str, np.ndarray] = field(default_factory=dict)   # name -> [T] float32


def score_node(nf, incidents: lb.Incidents, predictors: dict, horizon_s: int) -> NodeScores:
    ends = nf.step_end_ns
    y, excluded = lb.node_labels(ends, incidents.of_node(nf.node), horizon_s)
    usable = nf.present & ~excluded
    scores = {name: np.asarray(fn(nf.X), dtype=np.float32) for name, fn in predictors.items()}
    return NodeScores(nf.node, ends, y, usable, scores)


def _episodes(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if len(idx) == 0:
        return idx, idx
    breaks = np.flatnonzero(np.diff(idx) > COOLDOWN_STEPS)
    starts = np.concatenate([[idx[0]], idx[breaks + 1]])
    ends = np.concatenate([idx[breaks], [idx[-1]]])
    return starts, ends


def at_threshold(nodes: list[NodeScores], name: str, threshold: float, incidents: lb.Incidents,
                 horizon_s: int) -> dict:
    """Per-incident detection and lead, and false evacuations, at one threshold."""
    h = int(horizon_s) * 1_000_000_000
    justified = int(JUSTIFIED_HOURS * 3600) * 1_000_000_000
    lead: dict[str, float] = {}
    false_evac = strict_false = 0
    episodes = 0
    node_steps = 0
    for ns in nodes:
        node_steps += int(ns.usable.sum())
        inc = incidents.of_node(ns.node)
        inc_ts = np.sort(inc["ts"].to_numpy(np.int64)) if len(inc) else np.zeros(0, np.int64)
        alert = np.flatnonzero((ns.scores[name] >= threshold) & ns.usable)
        starts, ends = _episodes(alert)
        episodes += len(starts)
        e = ns.step_end_ns
        if len(starts):
            # true when an incident follows within the horizon of a step of the episode
            k = np.searchsorted(inc_ts, e[starts], side="right")
            nxt = inc_ts[np.minimum(k, len(inc_ts) - 1)] if len(inc_ts) else np.zeros(len(k), np.int64)
            follows = k < len(inc_ts)
            strict = follows & (nxt <= e[ends] + h)
            true = strict | (follows & (nxt <= e[starts] + justified))
            false_evac += int((~true).sum())
            strict_false += int((~strict).sum())
        if len(alert) == 0:
            continue
        ae = e[alert]
        for iid, ts in zip(inc["incident_id"], inc["ts"].to_numpy(np.int64)):
            j = np.searchsorted(ae, ts, side="left") - 1          # last alert before ts
            if j >= 0 and ae[j] >= ts - h:
                ep = np.searchsorted(ends, alert[j], side="left")
                minutes = (ts - e[starts[ep]]) / 60e9
                lead[iid] = max(lead.get(iid, 0.0), minutes)
    node_days = node_steps * STEP_NS / 86_400e9
    return {"threshold": float(threshold), "lead_minutes": lead, "false_evacuations": false_evac,
            "false_evacuations_strict": strict_false, "evacuations": episodes, "node_days": node_days,
            "false_evacuations_per_1000_node_days": 1000.0 * false_evac / node_days if node_days else float("nan"),
            "false_evacuations_strict_per_1000_node_days":
                1000.0 * strict_false / node_days if node_days else float("nan")}


def summarise(res: dict, incidents: lb.Incidents) -> dict:
    inc = incidents.by_incident
    lead = res["lead_minutes"]
    pre = inc[inc["has_precursor"]]
    det_pre = [lead[i] for i in pre["incident_id"] if i in lead]
    cats = {}
    for cat, part in inc.groupby("category"):
        d = sum(1 for i in part["incident_id"] if i in lead)
        pre_ids = part.loc[part["has_precursor"], "incident_id"]
        # a category can mix modes with and without precursors (faulty_gpu: PCIe replays vs off the bus)
        cats[cat] = {"incidents": int(len(part)), "detected": d, "recall": d / len(part),
                     "has_precursor": bool(len(pre_ids)), "incidents_precursor": int(len(pre_ids)),
                     "detected_precursor": sum(1 for i in pre_ids if i in lead)}
    return {
        "threshold": res["threshold"],
        "incidents": int(len(inc)), "incidents_precursor": int(len(pre)),
        "incident_recall_precursor": len(det_pre) / len(pre) if len(pre) else float("nan"),
        "incident_recall_all": (sum(1 for i in inc["incident_id"] if i in lead) / len(inc)) if len(inc) else float("nan"),
        "median_lead_minutes": float(np.median(det_pre)) if det_pre else float("nan"),
        "lead_minutes_precursor": sorted(float(v) for v in det_pre),
        "false_evacuations": res["false_evacuations"], "evacuations": res["evacuations"],
        "node_days": res["node_days"],
        "false_evacuations_per_1000_node_days": res["false_evacuations_per_1000_node_days"],
        "false_evacuations_strict": res["false_evacuations_strict"],
        "false_evacuations_strict_per_1000_node_days": res["false_evacuations_strict_per_1000_node_days"],
        "per_category": cats,
    }


def candidate_thresholds(nodes: list[NodeScores], name: str, n: int = 120) -> np.ndarray:
    vals = np.concatenate([ns.scores[name][ns.usable] for ns in nodes]) if nodes else np.zeros(0)
    vals = vals[vals > 0]
    if len(vals) == 0:
        return np.array([1.0])
    uniq = np.unique(vals)
    if len(uniq) <= n:
        return uniq
    qs = np.unique(np.quantile(vals, 1.0 - np.geomspace(0.5, 1e-6, n)))
    return np.unique(np.concatenate([qs, uniq[-20:]]))


def threshold_curve(nodes, name, incidents, horizon_s) -> list[tuple[float, float, float]]:
    """(threshold, false evacuations per 1,000 node-days, incident recall of precursor categories)."""
    out = []
    for th in candidate_thresholds(nodes, name):
        s = summarise(at_threshold(nodes, name, th, incidents, horizon_s), incidents)
        out.append((float(th), float(s["false_evacuations_per_1000_node_days"]),
                    float(np.nan_to_num(s["incident_recall_precursor"]))))
    return out


def pick_threshold(curve, budget: float) -> float:
    for th, fe, _ in curve:
        if fe <= budget:
            return th
    return curve[-1][0] if curve else 1.0


def step_metrics(nodes: list[NodeScores], name: str) -> dict:
    y = np.concatenate([ns.y[ns.usable] for ns in nodes]).astype(int)
    p = np.concatenate([ns.scores[name][ns.usable] for ns in nodes]).astype(np.float64)
    out = {"steps": int(len(y)), "positive_steps": int(y.sum())}
    if y.min(initial=0) == y.max(initial=0):
        out.update(pr_auc=float("nan"), roc_auc=float("nan"), brier=float(brier_score_loss(y, np.clip(p, 0, 1))) if len(y) else float("nan"))
        return out
    out["pr_auc"] = float(average_precision_score(y, p))
    out["roc_auc"] = float(roc_auc_score(y, p))
    out["brier"] = float(brier_score_loss(y, np.clip(p, 0, 1)))
    prec, rec, _ = precision_recall_curve(y, p)
    keep = np.unique(np.linspace(0, len(prec) - 1, min(len(prec), 200)).astype(int))
    out["pr_curve"] = {"precision": prec[keep].tolist(), "recall": rec[keep].tolist()}
    rel = []
    for lo, hi in zip(RELIABILITY_EDGES[:-1], RELIABILITY_EDGES[1:]):
        m = (p >= lo) & (p < hi)
        if m.sum():
            rel.append({"bin": [lo, min(hi, 1.0)], "mean_predicted": float(p[m].mean()),
                        "observed": float(y[m].mean()), "steps": int(m.sum())})
    out["reliability"] = rel
    return out


def evaluate_all(nodes: list[NodeScores], incidents: lb.Incidents, thresholds: dict[str, float],
                 horizon_s: int) -> dict:
    report = {}
    for name in thresholds:
        m = step_metrics(nodes, name)
        m.update(summarise(at_threshold(nodes, name, thresholds[name], incidents, horizon_s), incidents))
        report[name] = m
    return report


def evaluate_dataset(data_dir, model_dir=None, *, budget: float | None = None, progress=None) -> dict:
    """Score every step of a dataset with the model and both baselines; the report (JSON-able dict).

    Thresholds: the manifest's, for `budget` (default: the budget the model was trained for).
    """
    from foreshock import dataset as ds
    from foreshock.predictor import offline, registry

    model = registry.load_model(model_dir)
    man = model.manifest
    budget = float(man.get("budget", 2.0)) if budget is None else float(budget)
    horizon_s = model.horizon_seconds
    curves = man.get("threshold_curves", {})
    thresholds = {name: pick_threshold(curves[name], budget) for name in MODEL_NAMES if name in curves}
    if "model" not in thresholds:
        thresholds["model"] = float(man["recommended_threshold"])
    predictors = {"model": model.probability}
    for name in ("rule", "logistic"):
        est = model.baselines.get(name)
        if est is not None and name in thresholds:
            predictors[name] = (lambda e: (lambda X: e.predict_proba(X)[:, 1]))(est)
    thresholds = {k: v for k, v in thresholds.items() if k in predictors}
    incidents = lb.Incidents.from_table(ds.read_table(data_dir, "incidents"))
    nodes = []
    with offline.FeatureBuilder(data_dir, progress=progress) as fb:
        for nf in fb:
            nodes.append(score_node(nf, incidents, predictors, horizon_s))
    report = evaluate_all(nodes, incidents, thresholds, horizon_s)
    out = {name: report[name] for name in MODEL_NAMES if name in report}
    # the same scores at the manifest's thresholds for other budgets (no re-scoring)
    by_budget = {}
    for b in (0.5, 1.0, 2.0, 5.0, 10.0):
        row = {}
        for name in predictors:
            th = pick_threshold(curves[name], b) if name in curves else float(man["recommended_threshold"])
            s_ = summarise(at_threshold(nodes, name, th, incidents, horizon_s), incidents)
            row[name] = {k: s_[k] for k in ("threshold", "incident_recall_precursor", "incident_recall_all",
                                            "median_lead_minutes", "false_evacuations",
                                            "false_evacuations_per_1000_node_days",
                                            "false_evacuations_strict_per_1000_node_days")}
        by_budget[str(b)] = row
    out["by_budget"] = by_budget
    out["budget"] = budget
    out["budget_unit"] = "false evacuations per 1,000 node-days"
    out["horizon_minutes"] = horizon_s / 60
    out["model_version"] = model.version
    out["data"] = str(data_dir)
    out["data_hash"] = offline.dataset_hash(data_dir)
    out["nodes"] = len(nodes)
    out["node_days"] = out["model"]["node_days"]
    out["thresholds_from"] = "the model manifest (chosen on the training run's validation slice)"
    out["definitions"] = {
        "incident_recall_precursor": "share of incidents of categories with precursors with an alert in the horizon before them",
        "incident_recall_all": "the same over all incidents, including categories without precursors (not creditable)",
        "median_lead_minutes": "median time from the start of the alert episode to the incident, over detected precursor-category incidents",
        "false_evacuations_per_1000_node_days": f"alert episodes (steps within {COOLDOWN_STEPS} min merged) after which the node does not fail: no incident of the node within the horizon of the episode's last step or within {JUSTIFIED_HOURS:g} h of its start",
        "false_evacuations_strict_per_1000_node_days": "the same, justified by an incident within the horizon of the episode's last step only",
    }
    return out
