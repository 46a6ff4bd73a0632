"""Fleet calibration: a model's thresholds re-chosen on the fleet's own false evacuations.

Why: a manifest's thresholds are chosen on its training run's validation slice, one world. Across
simulated worlds one threshold gave 3-10x more false evacuations in one than in another
(benchmarks/results/predictor-worlds-2026-12-04.md), so the budget a threshold was chosen for does
not hold on a fleet unlike the training data. A fleet learns where its own false evacuations fall,
with no label from the future: an alarm episode (evaluate's definitions) is a false evacuation when
its node has no incident within the horizon of its last step nor within evaluate.JUSTIFIED_HOURS of
its start, which is known at `max(end + horizon, start + JUSTIFIED_HOURS)` (its *decision time*).

The estimate, for each threshold θ of the manifest's curve (its validation slice's false evacuations
per 1,000 node-days at θ, `r_val(θ)`): the rate pooled from that curve, worth `prior_node_days`
node-days (n0), and the fleet's own false evacuations decided by time t over its node-days decided by
t (steps that ended JUSTIFIED_HOURS or more before t):

    rate(θ) = 1000 * (r_val(θ) * n0 / 1000 + false_fleet(θ, t)) / (n0 + node_days_fleet(t))

The threshold for a budget is the lowest θ of the curve whose pooled rate is within it (the rule
train uses on its validation slice, foreshock.risk.pick_threshold). With no fleet data it is the
manifest's own; the default n0 (1,000 node-days: a week of a 128-node fleet, or two false
evacuations' worth at budget 2) lets a fleet's own episodes outweigh the training world after about
a week of 128 nodes. Only false evacuations are read, never recall: incidents say which episodes
were false, and the thresholds move only as far as the fleet's healthy episodes ask.

`FleetEpisodes` is what the estimate needs from scored data (per candidate threshold: each episode's
decision time and whether it was false; the usable steps' end times); `FleetThresholds`
(scikit-learn style) fits thresholds up to a time; `prequential` re-fits every `refit_hours` and
gives the threshold in force at each step: what a control plane re-choosing its thresholds daily
would alarm on, reported by `foreshock evaluate` as `fleet_calibrated`. `foreshock thresholds`
(calibrate_model) writes a model whose thresholds are fitted on a whole history of the fleet.
`pooled_with_base` is the same estimate at training time: `foreshock train` on a user's history chooses
the stacked model's thresholds on its validation slice with the base model's curve as the prior, carried
to the stacked model's scale by alarm volume on that slice (carried_curve).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from pathlib import Path

import numpy as np

from foreshock import risk
from foreshock.predictor import evaluate as ev
from foreshock.predictor import fleetlevel
from foreshock.predictor import registry

DEFAULT_PRIOR_NODE_DAYS = 1000.0
PRIOR_NODE_DAYS_RANGE = (1.0, 1e7)
DEFAULT_REFIT_HOURS = 24.0
REFIT_HOURS_RANGE = (1.0, 24.0 * 30)
# the curve's thresholds farther than this factor from the manifest's own for the budgets asked are
# not candidates: a fleet that needs them is one the model was not built for, and each candidate
# costs a pass over every node's scores
CANDIDATE_SPAN = 8.0
NS_PER_DAY = 86_400 * 10**9


def _in_range(name: str, value: float, bounds: tuple[float, float], unit: str) -> float:
    lo, hi = bounds
    value = float(value)
    if not lo <= value <= hi:
        raise ValueError(f"{name} {value:g} is outside [{lo:g}, {hi:g}] {unit}")
    return value


def check_prior_node_days(value: float) -> float:
    return _in_range("prior_node_days", value, PRIOR_NODE_DAYS_RANGE, "node-days")


def check_refit_hours(value: float) -> float:
    return _in_range("refit_hours", value, REFIT_HOURS_RANGE, "hours")


def candidate_curve(curve, thresholds) -> list[tuple[float, float, float]]:
    """The part of a manifest curve [(threshold, false evacuations per 1,000 node-days, recall), ...]
    within CANDIDATE_SPAN of `thresholds` (the manifest's own for the budgets asked)."""
    lo, hi = min(thresholds) / CANDIDATE_SPAN, max(thresholds) * CANDIDATE_SPAN
    return [tuple(map(float, row)) for row in curve if lo <= row[0] <= hi]


@dataclasses.dataclass
class FleetEpisodes:
    """A fleet's alarm episodes at each candidate threshold, by decision time."""
    thresholds: np.ndarray            # [K] ascending (the candidate curve's)
    prior_rates: np.ndarray           # [K] r_val: the manifest curve's false evacuations per 1,000 node-days
    decided_ns: list[np.ndarray]      # K x [episodes] sorted decision times of the false evacuations
    step_end_ns: np.ndarray           # [steps] sorted end times of the usable steps
    step_ns: int

    @classmethod
    def from_scores(cls, nodes: list[ev.NodeScores], name: str, incidents, horizon_s: int,
                    curve) -> "FleetEpisodes":
        """Episodes of `name`'s scores at every threshold of `curve` (candidate_curve's rows)."""
        if not curve:
            raise ValueError("no candidate thresholds: the manifest's curve has none near its own thresholds")
        results = [ev.at_threshold(nodes, name, th, incidents, horizon_s) for th, _rate, _recall in curve]
        return cls.from_results(nodes, results, curve, horizon_s)

    @classmethod
    def from_results(cls, nodes: list[ev.NodeScores], results: list[dict], curve, horizon_s: int) -> "FleetEpisodes":
        """The same from evaluate.at_threshold's results at each threshold of `curve`, already computed."""
        h = int(horizon_s) * 10**9
        justified = int(ev.JUSTIFIED_HOURS * 3600) * 10**9
        decided = []
        for res in results:
            eps = res["episodes"]
            when = np.maximum(eps["end_ns"] + h, eps["start_ns"] + justified)[eps["false"]]
            decided.append(np.sort(when))
        ends = np.sort(np.concatenate([ns.step_end_ns[ns.usable] for ns in nodes])) if nodes else np.zeros(0, np.int64)
        return cls(np.array([r[0] for r in curve]), np.array([r[1] for r in curve]), decided,
                   ends.astype(np.int64), ev.STEP_NS)

    def node_days(self, until_ns: int | None) -> float:
        """Node-days whose steps ended JUSTIFIED_HOURS or more before `until_ns` (None: all)."""
        if until_ns is None:
            n = len(self.step_end_ns)
        else:
            n = int(np.searchsorted(self.step_end_ns, until_ns - int(ev.JUSTIFIED_HOURS * 3600) * 10**9, "right"))
        return n * self.step_ns / NS_PER_DAY

    def false_counts(self, until_ns: int | None) -> np.ndarray:
        """[K] false evacuations decided by `until_ns` (None: all) at each candidate threshold."""
        if until_ns is None:
            return np.array([len(d) for d in self.decided_ns], dtype=float)
        return np.array([np.searchsorted(d, until_ns, "right") for d in self.decided_ns], dtype=float)


class FleetThresholds:
    """Thresholds for false-evacuation budgets, pooled from the manifest's curve and the fleet's own
    false evacuations (the module docstring has the estimate).

    Parameters: `budgets` (false evacuations per 1,000 node-days), `prior_node_days` (n0, the weight
    of the manifest's curve, range-checked). Learned: `thresholds_` {budget: threshold},
    `pooled_rates_` [K] the pooled rate at each candidate, `fleet_node_days_`, `fleet_false_` [K].
    """

    def __init__(self, budgets=(1.0, 2.0, 5.0), prior_node_days: float = DEFAULT_PRIOR_NODE_DAYS):
        self.budgets = budgets
        self.prior_node_days = prior_node_days

    def fit(self, episodes: FleetEpisodes, until_ns: int | None = None) -> "FleetThresholds":
        """Fit on the episodes decided by `until_ns` (None: all of them); returns self."""
        n0 = check_prior_node_days(self.prior_node_days)
        days = episodes.node_days(until_ns)
        false = episodes.false_counts(until_ns)
        self.fleet_node_days_ = days
        self.fleet_false_ = false
        self.pooled_rates_ = 1000.0 * (episodes.prior_rates * n0 / 1000.0 + false) / (n0 + days)
        curve = list(zip(episodes.thresholds, self.pooled_rates_, np.zeros(len(false))))
        self.thresholds_ = {float(b): float(risk.pick_threshold(curve, float(b))) for b in self.budgets}
        return self


def prequential(episodes: FleetEpisodes, budgets, *, prior_node_days: float = DEFAULT_PRIOR_NODE_DAYS,
                refit_hours: float = DEFAULT_REFIT_HOURS) -> dict[float, tuple[np.ndarray, np.ndarray]]:
    """{budget: (refit times ns [R], threshold in force from each [R])}: re-fitted every
    `refit_hours` from the first usable step on, each fit reading only episodes decided by its time."""
    step = int(check_refit_hours(refit_hours) * 3600) * 10**9
    if len(episodes.step_end_ns) == 0:
        return {float(b): (np.zeros(0, np.int64), np.zeros(0)) for b in budgets}
    t0, t1 = int(episodes.step_end_ns[0]), int(episodes.step_end_ns[-1])
    times = np.arange(t0, t1 + 1, step, dtype=np.int64)
    out = {float(b): (times, np.empty(len(times))) for b in budgets}
    for i, t in enumerate(times):
        fit = FleetThresholds(budgets, prior_node_days).fit(episodes, int(t))
        for b, th in fit.thresholds_.items():
            out[b][1][i] = th
    return out


def in_force(times: np.ndarray, thresholds: np.ndarray):
    """The step function of prequential's schedule: step end times (ns) -> the threshold in force."""
    def threshold_at(step_end_ns: np.ndarray) -> np.ndarray:
        i = np.searchsorted(times, step_end_ns, side="right") - 1
        return thresholds[np.clip(i, 0, len(thresholds) - 1)]
    return threshold_at


def fleet_calibrated(nodes, incidents, manifest: dict, types: dict, horizon_s: int, *, name: str = "model",
                     budgets=ev.AT_BUDGETS, prior_node_days: float = DEFAULT_PRIOR_NODE_DAYS,
                     refit_hours: float = DEFAULT_REFIT_HOURS) -> dict:
    """evaluate's `fleet_calibrated` section: `name`'s figures at the thresholds a fleet re-fitting them
    every `refit_hours` on its own decided false evacuations would have had in force, per budget."""
    own = [registry.manifest_threshold(manifest, b, name) for b in budgets]
    curve = (manifest.get("threshold_curves") or {}).get(name)
    if not curve or any(t is None for t in own):
        return {"missing": "the manifest lists no threshold curve or no threshold for these budgets: "
                           "not calibrated"}
    episodes = FleetEpisodes.from_scores(nodes, name, incidents, horizon_s, candidate_curve(curve, own))
    schedule = prequential(episodes, budgets, prior_node_days=prior_node_days, refit_hours=refit_hours)
    out = {"prior_node_days": float(prior_node_days), "refit_hours": float(refit_hours),
           "candidates": int(len(episodes.thresholds)), "rule": PREQUENTIAL_RULE, "at_budgets": {}}
    for b, manifest_th in zip(budgets, own):
        times, ths = schedule[float(b)]
        res = ev.at_threshold(nodes, name, in_force(times, ths), incidents, horizon_s)
        s = ev.summarise(res, incidents)
        row = {k: s[k] for k in ev.AT_BUDGET_KEYS if k != "threshold"}
        row.update(ev.by_group(res, incidents, types))
        row["manifest_threshold"] = float(manifest_th)
        row["thresholds_in_force"] = [[_iso(t), float(th)] for t, th in zip(times, ths)]
        out["at_budgets"][str(float(b))] = row
    return out


PREQUENTIAL_RULE = ("the threshold in force each day is re-fitted at its start from the manifest's curve "
                    "(worth prior_node_days) pooled with the evaluated fleet's false evacuations decided by then "
                    "(no label from later); the first day runs at the manifest's threshold")


def _iso(ns: int) -> str:
    return dt.datetime.fromtimestamp(int(ns) / 1e9, dt.timezone.utc).isoformat(timespec="seconds")


def calibrate_model(data_dir, model_dir, out_dir, *, prior_node_days: float = DEFAULT_PRIOR_NODE_DAYS,
                    command: str = "", progress=None) -> dict:
    """`foreshock thresholds`: the model of `model_dir` with its thresholds fitted on the whole history
    `data_dir` of the fleet it serves (FleetThresholds), written to `out_dir`; returns the manifest.

    The estimator and baselines are copied unchanged. The manifest's model curve becomes the pooled
    curve over the candidates (so the registry's threshold for any budget is the calibrated one);
    `fleet_calibration` records the data, the weights and the thresholds before, and
    `training.calibration` the data's identity, which evaluate's overlap rule reads (a model judged on
    the data its thresholds were fitted on is flagged). Raises ValueError on data the model trained
    on (its own training steps score low, so the thresholds would come out too low) and on an
    `out_dir` that is the model's own."""
    check_prior_node_days(prior_node_days)
    if Path(out_dir).resolve() == Path(model_dir or registry.default_model_path()).resolve():
        raise ValueError(f"--out {out_dir} is the model's own directory: write the calibrated model to a new one")
    model = registry.load_model(model_dir)
    man = model.manifest
    horizon_s = model.horizon_seconds
    scored = ev.score_dataset(data_dir, {"model": model.probability}, horizon_s, progress,
                              hard_evidence=model.hard_evidence)
    ov = ev.overlap(man.get("training") or {}, scored.identity)
    if ov["overlaps"]:
        raise ValueError(f"dataset {data_dir} overlaps the model's training data ({ov['reason']}): thresholds "
                         "fitted on the steps a model trained on come out too low; calibrate on the fleet's "
                         "later history")
    budgets = sorted(float(b) for b in man["thresholds"])
    own = [float(man["thresholds"][k]) for k in sorted(man["thresholds"], key=float)]
    curve = candidate_curve(man["threshold_curves"]["model"], own)
    episodes = FleetEpisodes.from_scores(scored.nodes, "model", scored.incidents, horizon_s, curve)
    fit = FleetThresholds(budgets, prior_node_days).fit(episodes)
    pooled = [[th, float(rate), recall] for (th, _r, recall), rate in zip(curve, fit.pooled_rates_)]
    chosen = {str(b): fit.thresholds_[b] for b in budgets}
    at_chosen = {str(b): int(fit.fleet_false_[list(episodes.thresholds).index(th)]) for b, th in fit.thresholds_.items()}
    now = dt.datetime.now(dt.timezone.utc)
    identity = scored.identity
    budget = float(man.get("budget", 2.0))
    new = {**man,
           "version": f"{now:%Y%m%dT%H%M%SZ}-{identity['data_hash'][:8]}",
           "created": now.isoformat(timespec="seconds"),
           "thresholds": chosen,
           "recommended_threshold": float(risk.pick_threshold(pooled, budget)),
           "threshold_curves": {**man["threshold_curves"], "model": pooled},
           "training": {**(man.get("training") or {}), "calibration": identity},
           "fleet_calibration": {
               "from_model": man.get("version"), "data": identity, "prior_node_days": float(prior_node_days),
               "fleet_node_days": float(fit.fleet_node_days_), "thresholds_before": man["thresholds"],
               "fleet_false_evacuations_at_thresholds": at_chosen,
               "curve_before": [list(r) for r in curve], "rule": CALIBRATION_RULE, "command": command}}
    if "score_level" in man:
        # the thresholds now fit this fleet: its own level is the one they were chosen at
        # (fleetlevel.py), or none when its history gives no level
        reference = fleetlevel.reference_level(scored.nodes, "model")
        new.pop("score_level")
        if reference is not None:
            new["score_level"] = {"reference": reference, "rule": fleetlevel.RULE,
                                  "chosen_on": "the fleet history the thresholds were fitted on"}
    new.pop("files", None)
    registry.save_model(out_dir, model.estimator, new, baselines=model.baselines or None)
    return new


CALIBRATION_RULE = ("each budget's threshold is the lowest of the candidate curve whose false-evacuation rate, "
                    "the manifest's validation curve (worth prior_node_days) pooled with this fleet's own false "
                    "evacuations over its node-days, is within the budget")


def carried_curve(base_curve, base_scores: np.ndarray, scores: np.ndarray) -> list[tuple[float, float, float]]:
    """A base model's validation curve [(threshold, false evacuations per 1,000 node-days, recall), ...]
    carried to another model's scale on the same steps: each base threshold becomes the score the other
    model reaches on as many of the steps as the base reaches that threshold on (its alarm volume), with
    the base's rate. Thresholds the base reaches on none of the steps are left out; where several
    carry to one score, the highest rate is kept (the cautious reading). Sorted by threshold."""
    base = np.sort(np.asarray(base_scores, dtype=np.float64))
    own = np.sort(np.asarray(scores, dtype=np.float64))
    if len(base) != len(own) or len(own) == 0:
        raise ValueError(f"carried_curve: {len(base)} base scores against {len(own)}: the same steps are needed")
    n = len(own)
    rows: dict[float, float] = {}
    for th, rate, _recall in base_curve:
        k = n - int(np.searchsorted(base, float(th), "left"))     # steps at or above the base threshold
        if k == 0:
            continue
        s = float(own[n - k])
        rows[s] = max(rows.get(s, -np.inf), float(rate))
    return [(s, rows[s], 0.0) for s in sorted(rows)]


def pooled_with_base(nodes, name: str, base_name: str, base_curve, incidents, horizon_s: int, budgets, *,
                     prior_node_days: float = DEFAULT_PRIOR_NODE_DAYS) -> dict:
    """Thresholds for a model stacked on a base (`foreshock train` on a user's history), chosen on its
    validation slice `nodes` with the base's validation curve as the prior, as FleetThresholds pools a
    fleet's false evacuations with a manifest's curve: the base's curve is carried to this model's scale
    (carried_curve, on the slice's usable steps, `base_name`'s scores against `name`'s) and weighs
    `prior_node_days`; the slice's own false evacuations at each carried threshold weigh its node-days.

    Why: a user's history of a few hundred nodes for a few weeks leaves a validation slice that allows a
    few false evacuations per budget, so thresholds chosen on it alone rest on its few highest healthy
    episodes; the base's curve was chosen on thousands of node-days. Returns {"thresholds": {budget:
    threshold}, "curve": the pooled curve [(threshold, rate, the slice's recall at it)], "carried": the
    carried base curve, "slice_node_days", "slice_false_evacuations": [per carried threshold],
    "prior_node_days"}. Raises ValueError when the base reaches none of its curve's thresholds on the
    slice, and on a prior_node_days out of range."""
    n0 = check_prior_node_days(prior_node_days)
    own = np.concatenate([ns.scores[name][ns.usable] for ns in nodes]) if nodes else np.zeros(0)
    base = np.concatenate([ns.scores[base_name][ns.usable] for ns in nodes]) if nodes else np.zeros(0)
    carried = carried_curve(base_curve, base, own)
    if not carried:
        raise ValueError("pooled_with_base: the base reaches none of its curve's thresholds on the slice")
    results = [ev.at_threshold(nodes, name, th, incidents, horizon_s) for th, _rate, _recall in carried]
    recall = [float(np.nan_to_num(ev.summarise(res, incidents)["incident_recall_precursor"])) for res in results]
    episodes = FleetEpisodes.from_results(nodes, results, carried, horizon_s)
    fit = FleetThresholds(tuple(budgets), n0).fit(episodes)
    return {"thresholds": {float(b): float(t) for b, t in fit.thresholds_.items()},
            "curve": [(float(t), float(r), rc) for t, r, rc in zip(episodes.thresholds, fit.pooled_rates_, recall)],
            "carried": [list(r) for r in carried], "slice_node_days": float(fit.fleet_node_days_),
            "slice_false_evacuations": fit.fleet_false_.astype(int).tolist(), "prior_node_days": n0}
