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
* Every recall and false-evacuation rate carries its INTERVAL_LEVEL (90 %) interval: exact
  (Clopper-Pearson) for a recall, a share of few failures, and exact (Garwood) for a rate, a Poisson
  count over node-days. A validation slice or an evaluation holds a few dozen failures and a handful of
  false evacuations; the interval says how far the next period's figure may fall from this one.
* Thresholds come from the model's manifest (chosen on the training run's validation slice), never
  from the data being evaluated. `at_budgets` reports each predictor at the thresholds the manifest
  lists for AT_BUDGETS (1, 2 and 5), overall and per family, signature and node type (groups.py); a
  budget the manifest lists no threshold for is said so, never filled in. A manifest with a
  `score_level` reference has the model's thresholds follow the fleet's score level over the evaluated
  data, hour by hour from its scores before the hour and no label (fleetlevel.py; what the control plane
  has in force): every figure of the model is at those, `threshold_in_force` says how far they rose,
  and `score_level.fixed_thresholds` gives the same figures at the manifest's numbers.
* The evaluated data *overlaps* the training data when it has OVERLAP_RULE (the manifest's
  `training` section: data hash, node names' hash, first and last step): figures on it are not
  evidence of how the model does on new data, and the report says so (`overlap`).
* `telemetry_interval` says how often the nodes were sampled (offline.TelemetryInterval); nodes sampled
  less often than once per feature step have their counts spread over the steps each sample covers (read
  up to one interval late), or, sampled too seldom for that, read low counts and few node-days; the
  report says which.
"""

from __future__ import annotations

import collections
import datetime as dt
import hashlib
from dataclasses import dataclass, field, replace

import numpy as np
from scipy import stats
from sklearn.metrics import average_precision_score, brier_score_loss, precision_recall_curve, roc_auc_score

from foreshock.predictor import fleetlevel, groups
from foreshock.predictor import labels as lb
from foreshock.predictor import offline, registry
from foreshock.predictor.offline import STEP_NS
from foreshock.risk import at_or_above, pick_threshold

COOLDOWN_STEPS = 10
JUSTIFIED_HOURS = 24.0
MODEL_NAMES = ("model", "rule", "logistic")
# budgets (false evacuations per 1,000 node-days) reported at the manifest's own thresholds (`at_budgets`)
AT_BUDGETS = (1.0, 2.0, 5.0)
AT_BUDGET_KEYS = ("threshold", "incidents_precursor", "incident_recall_precursor", "median_lead_minutes",
                  "false_evacuations", "node_days", "false_evacuations_per_1000_node_days",
                  "incident_recall_precursor_interval", "false_evacuations_per_1000_node_days_interval")
INTERVAL_LEVEL = 0.90   # two-sided: 5 % of the mass below the interval, 5 % above
OVERLAP_RULE = ("the same data hash, or an evaluated time range that intersects the training time range "
                "on the same node names; for a stacked model, the same for its base model's training data; for "
                "a model whose thresholds were calibrated on a fleet's history, the same for that history")
DEFINITIONS = {
    "incident_recall_precursor": "share of incidents of categories with precursors with an alert in the horizon before them",
    "incident_recall_all": "the same over all incidents, including categories without precursors (not creditable)",
    "median_lead_minutes": "median time from the start of the alert episode to the incident, over detected precursor-category incidents",
    "false_evacuations_per_1000_node_days": f"alert episodes (steps within {COOLDOWN_STEPS} min merged) after which the node does not fail: no incident of the node within the horizon of the episode's last step or within {JUSTIFIED_HOURS:g} h of its start",
    "false_evacuations_strict_per_1000_node_days": "the same, justified by an incident within the horizon of the episode's last step only",
    "at_budgets": "each predictor at the threshold its manifest lists for the budget (none listed: not evaluated), overall, per family (incident category), per signature (category and the failure mode its description names before ':') and per node type (GPU and HCA counts from the inventory); per-group recall counts precursor incidents only",
    "overlap": "the evaluated data overlaps the training data when it has " + OVERLAP_RULE,
    "telemetry_interval": ("how often the nodes were sampled: a node whose sampled steps mostly follow an unsampled "
                           "one is sampled less than once per feature step; of those, the nodes whose counts were "
                           "spread over the steps each sample covers (signals.py), and how many entity steps that "
                           "filled; overall (a node by its most seldom sampled table) and by table; node-days count "
                           "steps with a sample or a spread share"),
    "intervals": (f"*_interval: the {INTERVAL_LEVEL:.0%} interval of the figure, exact (Clopper-Pearson) for a "
                  "recall, exact (Garwood, Poisson) for a rate per 1,000 node-days"),
}
RELIABILITY_EDGES = (0.0, 0.001, 0.003, 0.01, 0.03, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0000001)


@dataclass
class NodeScores:
    node: str
    step_end_ns: np.ndarray           # [T]
    y: np.ndarray                     # [T] int8
    usable: np.ndarray                # [T] scoreable (NodeFeatures.scoreable) and not excluded
    scores: dict[str, np.ndarray] = field(default_factory=dict)   # name -> [T] float32
    # [T] bool: the steps the model's hard evidence alarms on whatever its score (None: it has none)
    forced: np.ndarray | None = None
    # [T, k] bool: which of the hard evidence's k conditions each step meets (forced is any of them)
    evidence: np.ndarray | None = None


def score_node(nf, incidents: lb.Incidents, predictors: dict, horizon_s: int, hard_evidence=None) -> NodeScores:
    """`hard_evidence`: the model's (model.HardEvidence), whose conditions alarm the model whatever its score."""
    ends = nf.step_end_ns
    y, excluded = lb.node_labels(ends, incidents.of_node(nf.node), horizon_s)
    usable = nf.scoreable & ~excluded
    scores = {name: np.asarray(fn(nf.X), dtype=np.float32) for name, fn in predictors.items()}
    evidence = hard_evidence.met_each(nf.X) if hard_evidence is not None else None
    forced = evidence.any(axis=1) if evidence is not None else None
    return NodeScores(nf.node, ends, y, usable, scores, forced, evidence)


def _episodes(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if len(idx) == 0:
        return idx, idx
    breaks = np.flatnonzero(np.diff(idx) > COOLDOWN_STEPS)
    starts = np.concatenate([[idx[0]], idx[breaks + 1]])
    ends = np.concatenate([idx[breaks], [idx[-1]]])
    return starts, ends


def at_threshold(nodes: list[NodeScores], name: str, threshold, incidents: lb.Incidents,
                 horizon_s: int) -> dict:
    """Per-incident detection and lead, and false evacuations, at one threshold: a number, or a
    function of the steps' end times (ns) giving each step's threshold (a threshold that moves over
    time, calibration.prequential's). The model's alarms also take the steps its hard evidence forces
    (NodeScores.forced). `episodes` lists every alarm episode: its first and last step's end (ns) and
    whether it was a false evacuation."""
    h = int(horizon_s) * 1_000_000_000
    justified = int(JUSTIFIED_HOURS * 3600) * 1_000_000_000
    lead: dict[str, float] = {}
    false_evac = strict_false = 0
    episodes = 0
    node_steps = 0
    by_node: dict[str, tuple[int, int]] = {}     # node -> (false evacuations, evaluated steps)
    ep_start, ep_end, ep_false = [], [], []
    for ns in nodes:
        node_steps += int(ns.usable.sum())
        node_false = 0
        inc = incidents.of_node(ns.node)
        inc_ts = np.sort(inc["ts"].to_numpy(np.int64)) if len(inc) else np.zeros(0, np.int64)
        th = threshold(ns.step_end_ns) if callable(threshold) else threshold
        hot = at_or_above(ns.scores[name], th)
        if name == "model" and ns.forced is not None:
            hot = hot | ns.forced
        alert = np.flatnonzero(hot & ns.usable)
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
            node_false = int((~true).sum())
            false_evac += node_false
            strict_false += int((~strict).sum())
            ep_start.append(e[starts])
            ep_end.append(e[ends])
            ep_false.append(~true)
        by_node[ns.node] = (node_false, int(ns.usable.sum()))
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
    cat = (lambda parts, dtype: np.concatenate(parts) if parts else np.zeros(0, dtype))
    return {"threshold": None if callable(threshold) else float(threshold), "lead_minutes": lead, "by_node": by_node,
            "episodes": {"start_ns": cat(ep_start, np.int64), "end_ns": cat(ep_end, np.int64),
                         "false": cat(ep_false, bool)},
            "false_evacuations": false_evac,
            "false_evacuations_strict": strict_false, "evacuations": episodes, "node_days": node_days,
            "false_evacuations_per_1000_node_days": 1000.0 * false_evac / node_days if node_days else float("nan"),
            "false_evacuations_strict_per_1000_node_days":
                1000.0 * strict_false / node_days if node_days else float("nan")}


def proportion_interval(k: int, n: int, level: float = INTERVAL_LEVEL) -> list[float]:
    """[low, high]: the exact (Clopper-Pearson) interval of a share from k of n; [nan, nan] for n = 0."""
    if n <= 0:
        return [float("nan"), float("nan")]
    tail = (1.0 - level) / 2.0
    low = float(stats.beta.ppf(tail, k, n - k + 1)) if k > 0 else 0.0
    high = float(stats.beta.ppf(1.0 - tail, k + 1, n - k)) if k < n else 1.0
    return [low, high]


def rate_interval(count: int, exposure: float, per: float = 1000.0, level: float = INTERVAL_LEVEL) -> list[float]:
    """[low, high] per `per` units of exposure: the exact (Garwood) interval of a Poisson rate from `count`
    events in `exposure` units; [nan, nan] for no exposure."""
    if not exposure > 0:
        return [float("nan"), float("nan")]
    tail = (1.0 - level) / 2.0
    low = float(stats.chi2.ppf(tail, 2 * count)) / 2.0 if count > 0 else 0.0
    high = float(stats.chi2.ppf(1.0 - tail, 2 * count + 2)) / 2.0
    return [per * low / exposure, per * high / exposure]


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
        "incident_recall_precursor_interval": proportion_interval(len(det_pre), len(pre)),
        "incident_recall_all": (sum(1 for i in inc["incident_id"] if i in lead) / len(inc)) if len(inc) else float("nan"),
        "median_lead_minutes": float(np.median(det_pre)) if det_pre else float("nan"),
        "lead_minutes_precursor": sorted(float(v) for v in det_pre),
        "false_evacuations": res["false_evacuations"], "evacuations": res["evacuations"],
        "node_days": res["node_days"],
        "false_evacuations_per_1000_node_days": res["false_evacuations_per_1000_node_days"],
        "false_evacuations_per_1000_node_days_interval": rate_interval(res["false_evacuations"], res["node_days"]),
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
    """Per predictor: step metrics and summarise at its threshold, a number or threshold_policy's schedule."""
    report = {}
    for name, th in thresholds.items():
        m = step_metrics(nodes, name)
        res, moved = at_policy(nodes, name, th, incidents, horizon_s)
        m.update(summarise(res, incidents), **moved)
        report[name] = m
    return report


def _recall(incident_ids, lead: dict) -> dict:
    ids = list(dict.fromkeys(incident_ids))
    got = [lead[i] for i in ids if i in lead]
    return {"incidents": len(ids), "detected": len(got), "recall": len(got) / len(ids) if ids else float("nan"),
            "median_lead_minutes": float(np.median(got)) if got else float("nan")}


def by_group(res: dict, incidents: lb.Incidents, types: dict[str, str]) -> dict:
    """Recall of precursor incidents and their median lead per family, signature and node type (the
    incidents that affect a node of the type); per node type also false evacuations per 1,000 of its
    node-days. `res` is at_threshold's."""
    lead = res["lead_minutes"]
    frame = incidents.frame
    pre = frame[frame["has_precursor"].astype(bool)]
    out = {f"per_{kind}": {str(name): _recall(part["incident_id"], lead) for name, part in pre.groupby(column)}
           for kind, column in groups.INCIDENT_GROUPS.items()}
    def type_of(node: str) -> str:
        return types.get(node, groups.UNKNOWN_TYPE)

    pre_type = pre["node"].map(type_of)
    per_type = {}
    for t in sorted({type_of(n) for n in res["by_node"]} | set(pre_type)):
        counts = [c for n, c in res["by_node"].items() if type_of(n) == t]
        false = sum(c[0] for c in counts)
        node_days = sum(c[1] for c in counts) * STEP_NS / 86_400e9
        per_type[t] = {**_recall(pre.loc[pre_type == t, "incident_id"], lead), "nodes": len(counts),
                       "node_days": node_days, "false_evacuations": false,
                       "false_evacuations_per_1000_node_days": 1000.0 * false / node_days if node_days else float("nan")}
    out["per_node_type"] = per_type
    return out


def model_levels(nodes: list[NodeScores], manifest: dict):
    """fleetlevel.levels of the model's scores when the manifest has a score-level reference, else None:
    taken once per evaluation, every budget's threshold reads the same levels."""
    return fleetlevel.levels(nodes, "model") if fleetlevel.reference_of(manifest) is not None else None


def threshold_policy(levels, name: str, threshold: float | None, manifest: dict):
    """What `name` is judged at for a manifest threshold: the number, or, for the model when `levels`
    (model_levels) are given, the threshold that follows the fleet's score level over these data
    (fleetlevel.schedule's threshold_at, times and thresholds, and the manifest's number: what the
    control plane has in force). None stays None."""
    if threshold is None or levels is None or name != "model":
        return threshold
    return (*fleetlevel.schedule(levels, float(threshold), fleetlevel.reference_of(manifest)), float(threshold))


def at_budget(nodes: list[NodeScores], name: str, threshold, incidents: lb.Incidents,
              types: dict[str, str], horizon_s: int, budget: float) -> dict:
    """One predictor at one manifest threshold: AT_BUDGET_KEYS overall, then by_group. No threshold
    (the manifest has none for the budget): said so, and nothing is evaluated. `threshold` may be
    threshold_policy's schedule: then the row's `threshold` is the manifest's and `threshold_in_force`
    says how far the fleet's score level raised it."""
    if threshold is None:
        return {"threshold": None, "missing": f"the manifest lists no threshold of this predictor for budget {budget:g}: "
                                              "not evaluated (no threshold is made up)"}
    res, moved = at_policy(nodes, name, threshold, incidents, horizon_s)
    s = summarise(res, incidents)
    return {**{k: s[k] for k in AT_BUDGET_KEYS}, **by_group(res, incidents, types), **moved}


def at_policy(nodes: list[NodeScores], name: str, policy, incidents: lb.Incidents, horizon_s: int) -> tuple[dict, dict]:
    """at_threshold at a number or at threshold_policy's schedule, and what the schedule adds to a row of
    figures (in_force_summary; nothing for a number)."""
    if isinstance(policy, tuple):
        return at_threshold(nodes, name, policy[0], incidents, horizon_s), in_force_summary(policy)
    return at_threshold(nodes, name, policy, incidents, horizon_s), {}


PART_KEYS = ("incidents_precursor", "incident_recall_precursor", "median_lead_minutes", "false_evacuations",
             "node_days", "false_evacuations_per_1000_node_days", "incident_recall_precursor_interval",
             "false_evacuations_per_1000_node_days_interval")


def policy_parts(nodes: list[NodeScores], incidents: lb.Incidents, policy, names, horizon_s: int) -> dict:
    """Where the model's alarms at `policy` (a threshold or threshold_policy's schedule) come from, for a
    model with hard evidence (NodeScores.evidence, one column per condition of `names`): its risk alone
    (the score at the thresholds in force, no hard evidence), its hard evidence alone (no score alarms:
    the threshold at its cap, 1, which no score reaches) and each condition alone (`conditions`, in
    `names` order, each named by `condition`), PART_KEYS each; and `added_by_hard_evidence`, the
    precursor failures the model catches that its risk alone does not. Read together they say which
    part catches and which spends the budget."""
    threshold = policy[0] if isinstance(policy, tuple) else policy

    def alone(forced_of, at):
        res = at_threshold([replace(ns, forced=forced_of(ns)) for ns in nodes], "model", at, incidents, horizon_s)
        s = summarise(res, incidents)
        return res["lead_minutes"], {k: s[k] for k in PART_KEYS}

    def condition(j):
        return lambda ns: None if ns.evidence is None else ns.evidence[:, j]

    both, _ = alone(lambda ns: ns.forced, threshold)
    risk_caught, risk = alone(lambda ns: None, threshold)
    _, hard = alone(lambda ns: ns.forced, 1.0)
    pre = incidents.by_incident
    ids = pre.loc[pre["has_precursor"], "incident_id"]
    return {"risk_alone": risk, "hard_evidence_alone": hard,
            "conditions": [{"condition": name, **alone(condition(j), 1.0)[1]} for j, name in enumerate(names)],
            "added_by_hard_evidence": sum(1 for i in ids if i in both and i not in risk_caught)}


def in_force_summary(policy: tuple) -> dict:
    """The manifest's threshold and the hours a score-level schedule raised it (threshold_policy)."""
    _at, _times, ths, base = policy
    return {"threshold": base,
            "threshold_in_force": {"median": float(np.median(ths)), "max": float(ths.max()),
                                   "hours": int(len(ths)), "hours_raised": int((ths > base).sum())}}


def at_budgets(nodes, incidents, manifest: dict, names, types, horizon_s: int, *, fixed: bool = False,
               levels=None) -> dict:
    """{budget: {predictor: at_budget}} at the manifest's own thresholds for AT_BUDGETS, the model's
    following the fleet's score level when the manifest has a reference (threshold_policy; `levels`:
    model_levels when already taken); `fixed`: the manifest's numbers as they are."""
    if not fixed and levels is None and "model" in names:
        levels = model_levels(nodes, manifest)
    out = {}
    for b in AT_BUDGETS:
        row = {}
        for name in names:
            th = registry.manifest_threshold(manifest, b, name)
            row[name] = at_budget(nodes, name, th if fixed else threshold_policy(levels, name, th, manifest),
                                  incidents, types, horizon_s, b)
        out[str(b)] = row
    return out


def iso_time(ns: int) -> str:
    return dt.datetime.fromtimestamp(ns / 1e9, dt.timezone.utc).isoformat(timespec="seconds")


def node_names_sha256(nodes) -> str:
    return hashlib.sha256("\n".join(sorted(nodes)).encode()).hexdigest()


def data_identity(data_dir, nodes: list[str], first_step: int, last_step: int) -> dict:
    """What the overlap rule compares, for training (the manifest's `training`) and evaluated data alike."""
    return {"data": str(data_dir), "data_hash": offline.dataset_hash(data_dir), "nodes": len(nodes),
            "node_names_sha256": node_names_sha256(nodes), "first_step_end": iso_time((first_step + 1) * STEP_NS),
            "last_step_end": iso_time((last_step + 1) * STEP_NS)}


def overlap(training: dict, evaluated: dict) -> dict:
    """Does the evaluated data overlap the training data (OVERLAP_RULE)? `training`: a manifest's
    `training` section (older manifests lack the node names: then only the hashes are compared)."""
    same_hash = bool(training.get("data_hash")) and training.get("data_hash") == evaluated["data_hash"]
    names = training.get("node_names_sha256")
    same_names = None if names is None else names == evaluated["node_names_sha256"]
    try:
        t0, t1, e0, e1 = (dt.datetime.fromisoformat(d[k]) for d in (training, evaluated)
                          for k in ("first_step_end", "last_step_end"))
        intersect = bool(e0 <= t1 and t0 <= e1)
    except (KeyError, TypeError, ValueError):
        intersect = None
    reasons = []
    if same_hash:
        reasons.append(f"the same data hash {evaluated['data_hash'][:12]}")
    if intersect and same_names:
        reasons.append(f"steps {evaluated['first_step_end']} to {evaluated['last_step_end']} against training's "
                       f"{training['first_step_end']} to {training['last_step_end']}, on the same "
                       f"{evaluated['nodes']} node names")
    # a model stacked with a base model (train's --base) carries what the base learnt from its data too
    base = overlap(training["base"], evaluated) if training.get("base") else None
    if base is not None and base["overlaps"]:
        reasons.append(f"the training data of the model it is stacked with: {base['reason']}")
    # thresholds fitted on a fleet's history (foreshock thresholds) were chosen on that data too
    calibration = overlap(training["calibration"], evaluated) if training.get("calibration") else None
    if calibration is not None and calibration["overlaps"]:
        reasons.append(f"the data its thresholds were calibrated on: {calibration['reason']}")
    out = {"overlaps": bool(reasons), "reason": "; ".join(reasons), "same_data_hash": same_hash,
           "time_ranges_intersect": intersect, "same_node_names": same_names, "rule": OVERLAP_RULE,
           "training": {k: training.get(k) for k in evaluated}, "evaluated": evaluated}
    for key, part in (("base", base), ("calibration", calibration)):
        if part is not None:
            out[key] = {k: part[k] for k in ("overlaps", "reason", "same_data_hash", "time_ranges_intersect",
                                             "same_node_names", "training")}
    if same_names is None:
        out["note"] = ("the model's manifest does not record its training node names (trained before they were "
                       "recorded): only the data hashes were compared")
    return out


def overlap_warning(ov: dict | None) -> str | None:
    """The words the command prints on stderr and the HTML report shows in a banner, or None."""
    if not ov or not ov.get("overlaps"):
        return None
    return (f"WARNING: the evaluated data overlaps the model's training data ({ov['reason']}): "
            "these figures are not evidence of how the model does on new data")


@dataclass
class ScoredData:
    nodes: list[NodeScores]
    incidents: lb.Incidents
    types: dict[str, str]      # node -> type (groups.node_types)
    identity: dict             # data_identity
    skipped: dict = field(default_factory=dict)   # node -> why its partition was left out (on_error="skip")
    telemetry_interval: dict = field(default_factory=dict)   # offline.TelemetryInterval.summary

    def type_counts(self) -> dict[str, int]:
        return dict(collections.Counter(self.types.get(ns.node, groups.UNKNOWN_TYPE) for ns in self.nodes))


def score_dataset(data_dir, predictors: dict, horizon_s: int, progress=None, *, executor: str = "local",
                  ray_address: str | None = None, on_error: str = "stop", hard_evidence=None) -> ScoredData:
    """Every step of every node of a dataset scored by each predictor (name -> X -> [n] scores); the
    features built on `executor` (offline.FeatureBuilder). `hard_evidence`: the model's (score_node)."""
    from foreshock import dataset as ds

    data_dir = ds.open_dataset_root(data_dir)   # a path or a URI: opened once, its filesystem read throughout
    if not ds.partition_files(data_dir, "incidents"):
        raise ValueError(f"dataset {data_dir} has no incidents table (table=incidents/): an evaluation judges "
                         "the scores against the logged incidents (docs/schema.md)")
    incidents = lb.Incidents.from_table(ds.read_table(data_dir, "incidents"))
    nodes = []
    with offline.FeatureBuilder(data_dir, progress=progress, executor=executor, ray_address=ray_address,
                                on_error=on_error) as fb:
        for nf in fb:
            nodes.append(score_node(nf, incidents, predictors, horizon_s, hard_evidence))
        first, last = fb.step_range
        names = fb.nodes
        skipped = dict(fb.skipped)
        interval = fb.telemetry_interval.summary()
    types = groups.node_types(ds.read_table(data_dir, "inventory"), names)
    return ScoredData(nodes, incidents, types, data_identity(data_dir, names, first, last), skipped, interval)


def evaluate_dataset(data_dir, model_dir=None, *, budget: float | None = None, progress=None,
                     executor: str = "local", ray_address: str | None = None, on_error: str = "stop") -> dict:
    """Score every step of a dataset with the model and both baselines; the report (JSON-able dict).

    Thresholds: the manifest's, for `budget` (default: the budget the model was trained for).
    """
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
        if name in model.baselines and name in thresholds:
            predictors[name] = model.baseline_probability(name)
    thresholds = {k: v for k, v in thresholds.items() if k in predictors}
    scored = score_dataset(data_dir, predictors, horizon_s, progress, executor=executor, ray_address=ray_address,
                           on_error=on_error, hard_evidence=model.hard_evidence)
    nodes, incidents = scored.nodes, scored.incidents
    # judging the scores (curves, budgets, groups) takes a while on a big dataset: say where it is
    judged = (lambda done: progress("judging", done, 4)) if progress else (lambda done: None)
    judged(0)
    levels = model_levels(nodes, man)
    report = evaluate_all(nodes, incidents, {name: threshold_policy(levels, name, th, man)
                                             for name, th in thresholds.items()}, horizon_s)
    judged(1)
    out = {name: report[name] for name in MODEL_NAMES if name in report}
    # the same scores at the manifest's thresholds for other budgets (no re-scoring)
    by_budget = {}
    for b in (0.5, 1.0, 2.0, 5.0, 10.0):
        row = {}
        for name in predictors:
            th = pick_threshold(curves[name], b) if name in curves else float(man["recommended_threshold"])
            res, moved = at_policy(nodes, name, threshold_policy(levels, name, th, man), incidents, horizon_s)
            s_ = summarise(res, incidents)
            row[name] = {**{k: s_[k] for k in ("threshold", "incident_recall_precursor", "incident_recall_all",
                                               "median_lead_minutes", "false_evacuations",
                                               "false_evacuations_per_1000_node_days",
                                               "false_evacuations_strict_per_1000_node_days")}, **moved}
        by_budget[str(b)] = row
    out["by_budget"] = by_budget
    judged(2)
    out["at_budgets"] = at_budgets(nodes, incidents, man, [n for n in MODEL_NAMES if n in predictors],
                                   scored.types, horizon_s, levels=levels)
    if levels is not None:
        reference = fleetlevel.reference_of(man)
        # the same model at the manifest's numbers, beside the figures at the thresholds in force
        out["score_level"] = {"reference": reference, "rule": fleetlevel.RULE,
                              "fixed_thresholds": at_budgets(nodes, incidents, man, ["model"], scored.types,
                                                             horizon_s, fixed=True)}
    if model.hard_evidence is not None:
        out["policy_parts"] = {"budget": budget, **policy_parts(
            nodes, incidents, threshold_policy(levels, "model", thresholds["model"], man),
            model.hard_evidence.names, horizon_s)}
    judged(3)
    from foreshock.predictor import calibration
    out["fleet_calibrated"] = calibration.fleet_calibrated(nodes, incidents, man, scored.types, horizon_s)
    judged(4)
    out["hard_evidence"] = list(model.hard_evidence.names) if model.hard_evidence is not None else []
    out["node_types"] = scored.type_counts()
    out["overlap"] = overlap(man.get("training") or {}, scored.identity)
    out["telemetry_interval"] = scored.telemetry_interval
    out["budget"] = budget
    out["budget_unit"] = "false evacuations per 1,000 node-days"
    out["horizon_minutes"] = horizon_s / 60
    out["model_version"] = model.version
    out["data"] = str(data_dir)
    out["data_hash"] = scored.identity["data_hash"]
    out["nodes"] = len(nodes)
    out["skipped_partitions"] = scored.skipped
    out["node_days"] = out["model"]["node_days"]
    out["thresholds_from"] = "the model manifest (chosen on the training run's validation slice)" + (
        "; the model's follow the fleet's score level (score_level)" if "score_level" in out else "") + (
        "; the model also alarms where its hard evidence is met, whatever its score (hard_evidence)"
        if out["hard_evidence"] else "")
    out["definitions"] = DEFINITIONS
    return out
