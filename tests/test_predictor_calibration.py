"""Fleet calibration (predictor/calibration.py): thresholds pooled from a manifest's validation curve and
the fleet's own false evacuations, fitted only on episodes decided by the fit's time."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from foreshock.predictor import calibration as cal
from foreshock.predictor import evaluate as ev
from foreshock.predictor import labels as lb

DAY = 86_400 * 10**9
HORIZON_S = 1800
# a manifest curve whose validation slice saw no false evacuation above 0.2: its budget-2 threshold is 0.2
CURVE = [[0.1, 9.0, 0.9], [0.2, 1.5, 0.8], [0.3, 0.8, 0.7], [0.4, 0.4, 0.6], [0.5, 0.0, 0.5], [0.6, 0.0, 0.4]]


def _fleet(days: int = 20, nodes: int = 50, burst_every_days: float = 1.0, peak: float = 0.35):
    """`nodes` healthy nodes; every `burst_every_days` one of them (in turn) scores `peak` for 5 min:
    a false evacuation at any threshold up to `peak`, none above."""
    t = days * 1440
    ends = (np.arange(t, dtype=np.int64) + 1) * ev.STEP_NS
    out = []
    for i in range(nodes):
        s = np.full(t, 0.01, np.float32)
        out.append(ev.NodeScores(f"n{i}", ends, np.zeros(t, np.int8), np.ones(t, bool), {"model": s}))
    k = 0
    for start in np.arange(0.5, days, burst_every_days):
        step = int(start * 1440)
        out[k % nodes].scores["model"][step:step + 5] = peak
        k += 1
    return out


def test_with_no_fleet_data_the_thresholds_are_the_manifests():
    nodes = _fleet()
    episodes = cal.FleetEpisodes.from_scores(nodes, "model", lb.Incidents.from_table(None), HORIZON_S, CURVE)
    fit = cal.FleetThresholds(budgets=(1.0, 2.0, 5.0)).fit(episodes, until_ns=0)
    assert fit.fleet_node_days_ == 0
    assert fit.thresholds_ == {b: ev.pick_threshold(CURVE, b) for b in (1.0, 2.0, 5.0)}


def test_a_fleet_with_more_false_evacuations_than_the_curve_says_gets_a_higher_threshold():
    # 20 days x 50 nodes = 1,000 node-days with 20 false evacuations at 0.35: 20 per 1,000 node-days
    nodes = _fleet()
    episodes = cal.FleetEpisodes.from_scores(nodes, "model", lb.Incidents.from_table(None), HORIZON_S, CURVE)
    assert [len(d) for d in episodes.decided_ns] == [20, 20, 20, 0, 0, 0]
    fit = cal.FleetThresholds(budgets=(2.0,)).fit(episodes)
    assert fit.fleet_node_days_ == pytest.approx(1000.0)
    # pooled at 0.3: (0.8 + 20) / 2,000 node-days = 10.4 per 1,000; at 0.4: 0.2 per 1,000
    assert fit.pooled_rates_[2] == pytest.approx(1000 * (0.8 * 1.0 + 20) / 2000)
    assert fit.thresholds_[2.0] == 0.4
    # a prior worth far more than the fleet keeps the manifest's threshold
    assert cal.FleetThresholds(budgets=(2.0,), prior_node_days=1e6).fit(episodes).thresholds_[2.0] == 0.2


def test_a_quieter_fleet_gets_a_lower_threshold():
    # no burst at all: 1,000 quiet node-days pull the 0.1 candidate's rate from 9 to 4.5 per 1,000
    nodes = _fleet(burst_every_days=1e9)
    episodes = cal.FleetEpisodes.from_scores(nodes, "model", lb.Incidents.from_table(None), HORIZON_S, CURVE)
    assert cal.FleetThresholds(budgets=(5.0,)).fit(episodes).thresholds_[5.0] == 0.1
    assert ev.pick_threshold(CURVE, 5.0) == 0.2


def test_prequential_thresholds_read_no_label_from_later():
    budgets = (2.0,)
    base = _fleet()
    sched = cal.prequential(cal.FleetEpisodes.from_scores(base, "model", lb.Incidents.from_table(None),
                                                          HORIZON_S, CURVE), budgets)
    times, ths = sched[2.0]
    assert ths[0] == 0.2 and ths[-1] == 0.4          # the manifest's first, the fleet's once it has seen enough
    # episodes from day 10 on are decided 24 h after they start: the fits before then are unchanged by them
    changed = _fleet()
    for day in range(10, 20):
        changed[7].scores["model"][day * 1440 + 100: day * 1440 + 105] = 0.45
    times2, ths2 = cal.prequential(cal.FleetEpisodes.from_scores(changed, "model", lb.Incidents.from_table(None),
                                                                 HORIZON_S, CURVE), budgets)[2.0]
    assert np.array_equal(times, times2)
    before = times <= 11 * DAY
    assert np.array_equal(ths[before], ths2[before])
    assert not np.array_equal(ths, ths2)
    step = cal.in_force(times, ths)
    assert step(np.array([times[0], times[3] + 1, times[-1] + DAY])).tolist() == [ths[0], ths[3], ths[-1]]


def test_an_episode_followed_by_an_incident_is_not_counted():
    nodes = _fleet(days=4, nodes=4, burst_every_days=1.0)
    # the node of the first burst (n0, 12 h in) fails 20 min after it
    ts = pd.Timestamp(int(0.5 * DAY + 25 * 60 * 10**9), unit="ns", tz="UTC")
    table = pa.Table.from_pylist([{"incident_id": "i1", "node": "n0", "ts": ts, "repaired_at": None,
                                   "category": "gpu_hbm", "has_precursor": True, "scope": "node",
                                   "affected_nodes": None, "description": "gpu_hbm: remaps"}])
    episodes = cal.FleetEpisodes.from_scores(nodes, "model", lb.Incidents.from_table(table), HORIZON_S, CURVE)
    assert [len(d) for d in episodes.decided_ns][:3] == [3, 3, 3]


@pytest.mark.parametrize("kwargs, words", [({"prior_node_days": 0.0}, "prior_node_days 0"),
                                           ({"refit_hours": 0.5}, "refit_hours 0.5")])
def test_settings_out_of_range_are_refused_with_their_name(kwargs, words):
    episodes = cal.FleetEpisodes.from_scores(_fleet(days=2, nodes=2), "model", lb.Incidents.from_table(None),
                                             HORIZON_S, CURVE)
    with pytest.raises(ValueError, match=words):
        cal.prequential(episodes, (2.0,), **kwargs)


def test_a_base_curve_is_carried_to_another_models_scale_by_alarm_volume():
    base = np.linspace(0.0, 1.0, 101)
    own = base ** 2                                  # the same ranking on another scale
    curve = [[0.1, 9.0, 0.9], [0.5, 2.0, 0.5], [0.9, 0.5, 0.1], [1.5, 0.0, 0.0]]
    carried = cal.carried_curve(curve, base, own[::-1])     # the order of the steps does not matter
    assert [r[0] for r in carried] == pytest.approx([0.01, 0.25, 0.81])
    assert [r[1] for r in carried] == [9.0, 2.0, 0.5]   # 1.5 is reached on no step: left out
    # where several base thresholds carry to one score, the highest rate is kept
    flat = cal.carried_curve(curve, base, np.minimum(own, 0.2))
    assert flat[-1] == (0.2, 2.0, 0.0)          # base 0.5 and 0.9 both reach 0.2 here
    with pytest.raises(ValueError, match="the same steps"):
        cal.carried_curve(curve, base, own[:50])


def _bursty_slice(days: int = 20, nodes: int = 50):
    """A slice of `nodes` healthy nodes whose 20 bursts (one a day) peak at 0.12, 0.14, ... 0.50: each a
    false evacuation at thresholds up to its peak. "base" scores the same steps at half the scale."""
    out = _fleet(days=days, nodes=nodes, burst_every_days=1.0, peak=0.0)
    k = 0
    for start in np.arange(0.5, days, 1.0):
        step = int(start * 1440)
        out[k % nodes].scores["model"][step:step + 5] = 0.12 + 0.02 * k
        k += 1
    for ns in out:
        ns.scores["base"] = ns.scores["model"] / 2
    return out


def test_thresholds_of_a_stacked_model_pool_its_slice_with_the_base_curve():
    nodes = _bursty_slice()
    base_curve = [[r[0] / 2, r[1], r[2]] for r in CURVE]     # the base's own scale: budget 2 at 0.1
    none = lb.Incidents.from_table(None)
    trusting = cal.pooled_with_base(nodes, "model", "base", base_curve, none, HORIZON_S, (2.0,), prior_node_days=1e7)
    # a prior worth far more than the slice: the base's budget-2 threshold, carried (0.1 on its scale, 0.2 here)
    assert trusting["thresholds"][2.0] == pytest.approx(0.2)
    assert trusting["slice_node_days"] == pytest.approx(1000.0)
    own = cal.pooled_with_base(nodes, "model", "base", base_curve, none, HORIZON_S, (2.0,), prior_node_days=1.0)
    # the slice alone: 20 false evacuations in 1,000 node-days; budget 2 leaves the two highest bursts
    th = own["thresholds"][2.0]
    fe = ev.summarise(ev.at_threshold(nodes, "model", th, none, HORIZON_S), none)["false_evacuations"]
    assert th > 0.2 and fe <= 2
    assert ev.pick_threshold(own["curve"], 2.0) == th
    with pytest.raises(ValueError, match="prior_node_days 0"):
        cal.pooled_with_base(nodes, "model", "base", base_curve, none, HORIZON_S, (2.0,), prior_node_days=0.0)
    # a base curve whose thresholds the base reaches on no step of the slice gives no prior
    with pytest.raises(ValueError, match="reaches none of its curve's thresholds"):
        cal.pooled_with_base(nodes, "model", "base", [[0.9, 1.0, 0.1]], none, HORIZON_S, (2.0,))
