"""The fleet's score level (predictor/fleetlevel.py): the threshold rule, the level offline and online
(the same thresholds from the same scores), and evaluate judging the model at the thresholds in force."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from foreshock.predictor import evaluate as ev
from foreshock.predictor import fleetlevel as fl
from foreshock.predictor import labels as lb

MIN = 60 * 10**9
T0 = 1_790_000_000 * 10**9


def fleet(levels_by_hour, nodes=20, seed=0):
    """NodeScores of `nodes` nodes, one step a minute for an hour per level; node i's scores in hour h are
    uniform below levels_by_hour[h] * (0.5 + i / nodes)."""
    rng = np.random.default_rng(seed)
    t = 60 * len(levels_by_hour)
    ends = T0 + MIN * np.arange(1, t + 1, dtype=np.int64)
    out = []
    for i in range(nodes):
        top = np.repeat(np.asarray(levels_by_hour, float), 60) * (0.5 + i / nodes)
        s = (top * rng.uniform(0.5, 1.0, t)).astype(np.float32)
        out.append(ev.NodeScores(f"n{i:02d}", ends, np.zeros(t, np.int8), np.ones(t, bool), {"model": s}))
    return out


def test_the_threshold_rises_with_the_level_and_never_falls_below_the_manifests():
    assert fl.governed(0.01, 0.002, 0.001) == pytest.approx(0.02)
    assert fl.governed(0.01, 0.0005, 0.001) == 0.01          # a quieter fleet keeps the manifest's
    assert fl.governed(0.01, float("nan"), 0.001) == 0.01    # no level yet
    assert fl.governed(0.01, 0.5, None) == 0.01              # no reference: fixed thresholds
    assert fl.governed(0.5, 0.9, 0.001) == 1.0               # never past a probability


def test_a_bad_reference_is_named():
    for bad in ("x", -1, 0, 2.0, None):
        with pytest.raises(ValueError, match="score_level.reference"):
            fl.reference_of({"score_level": {"reference": bad}})
    assert fl.reference_of({}) is None
    assert fl.reference_of({"score_level": {"reference": 0.002}}) == 0.002


def test_the_level_reads_the_hours_before_only():
    nodes = fleet([0.01, 0.01, 0.1, 0.1])
    times, lv = fl.levels(nodes, "model")
    assert len(times) == len(lv) == 5
    assert math.isnan(lv[0])                       # nothing before the first hour
    assert lv[1] == pytest.approx(lv[2], rel=0.3)  # hours 0 and 1 alike
    # the hour the scores rise is judged at the level before it; the next sees the rise
    assert lv[2] < 0.02 and lv[3] > 0.05
    # the 0.9 quantile over nodes of their maxima in the last day
    peaks = np.array([ns.scores["model"][:60].max() for ns in nodes], float)
    assert lv[1] == pytest.approx(np.quantile(peaks, fl.LEVEL_QUANTILE))


def test_too_few_nodes_or_steps_give_no_level():
    assert np.isnan(fl.levels(fleet([0.01] * 3, nodes=fl.MIN_NODES - 1), "model")[1]).all()
    nodes = fleet([0.01] * 3)
    for ns in nodes:
        ns.usable[:] = False
        ns.usable[::2] = True              # 30 steps an hour: the first hour does not count a node
    _, lv = fl.levels(nodes, "model")
    assert math.isnan(lv[1]) and not math.isnan(lv[2])


def test_online_and_offline_give_the_same_threshold_at_every_step():
    nodes = fleet([0.001, 0.002, 0.02, 0.005, 0.05, 0.001], nodes=24)
    for ns in nodes[:5]:
        ns.usable[100:130] = False         # some nodes miss some steps
    reference = 0.002
    at, _times, ths = fl.schedule(fl.levels(nodes, "model"), 0.01, reference)
    online = fl.FleetLevel(reference)
    ends = nodes[0].step_end_ns
    got, want = [], []
    for k, e in enumerate(ends):
        present = [ns for ns in nodes if ns.usable[k]]
        online.observe(int(e), [ns.node for ns in present], np.array([ns.scores["model"][k] for ns in present]))
        got.append(online.threshold(0.01))
        want.append(float(at(np.array([e]))[0]))
    assert got == want
    assert max(got) > 0.01 and min(got) == 0.01


def test_evaluate_judges_the_model_at_the_thresholds_in_force():
    """A fleet whose healthy nodes score ten times the reference world's, in hours apart: at the
    manifest's number every node alarms each time; following the level, only the first time (the
    hours before it were quiet), after which the threshold has risen."""
    quiet = fleet([0.001] * 3, seed=1)
    reference = fl.reference_level(quiet, "model")
    assert reference is not None and 0.0005 < reference < 0.002
    noisy = fleet([0.001, 0.001, 0.01, 0.001, 0.01, 0.001, 0.01], seed=2)
    incidents = lb.Incidents.from_table(None)     # a healthy fleet: every alarm is false
    manifest = {"thresholds": {"1.0": 0.004, "2.0": 0.003, "5.0": 0.002}, "score_level": {"reference": reference}}
    follow = ev.at_budgets(noisy, incidents, manifest, ["model"], {}, 1800)
    fixed = ev.at_budgets(noisy, incidents, manifest, ["model"], {}, 1800, fixed=True)
    for b in ("1.0", "2.0", "5.0"):
        f, x = follow[b]["model"], fixed[b]["model"]
        assert x["false_evacuations"] == 3 * len(noisy) and f["false_evacuations"] == len(noisy)
        assert f["threshold"] == x["threshold"]      # the manifest's number, beside what was in force
        moved = f["threshold_in_force"]
        assert moved["hours_raised"] >= 4 and moved["max"] > 5 * f["threshold"]
        assert "threshold_in_force" not in x
    # a manifest without a reference: the manifest's numbers, as before
    plain = ev.at_budgets(noisy, incidents, {"thresholds": manifest["thresholds"]}, ["model"], {}, 1800)
    assert json.dumps(plain, sort_keys=True) == json.dumps(fixed, sort_keys=True)   # NaN != NaN in ==


def test_the_hours_seen_survive_a_restart_of_the_same_model_only(tmp_path):
    nodes = fleet([0.001, 0.02, 0.001], nodes=20)
    ends = nodes[0].step_end_ns
    first = fl.FleetLevel(0.002)
    for k in range(150):
        first.observe(int(ends[k]), [ns.node for ns in nodes], np.array([ns.scores["model"][k] for ns in nodes]))
    path = tmp_path / "level.npz"
    first.save(path, "m1")
    again = fl.FleetLevel(0.002)
    assert "3 hours of 20 nodes" in again.restore(path, "m1")
    assert again.level == first.level and again.threshold(0.01) == first.threshold(0.01) > 0.01
    for k in range(150, len(ends)):       # and both go on alike
        for lv in (first, again):
            lv.observe(int(ends[k]), [ns.node for ns in nodes], np.array([ns.scores["model"][k] for ns in nodes]))
        assert again.threshold(0.01) == first.threshold(0.01)
    fresh = fl.FleetLevel(0.002)
    with pytest.raises(ValueError, match="not of 'm2'"):
        fresh.restore(path, "m2")
    path.write_bytes(b"not an npz")
    with pytest.raises(ValueError, match="not a score-level state file"):
        fresh.restore(path, "m1")
    assert fresh.restore(tmp_path / "none.npz", "m1") is None and math.isnan(fresh.level)
