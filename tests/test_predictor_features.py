"""Base signals and features on hand-built schema-v1 rows: counter wraps and resets, windows, labels."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pandas as pd
import pytest

from foreshock import schema as sch
from foreshock.predictor import features as ft
from foreshock.predictor import labels as lb
from foreshock.predictor import online
from foreshock.predictor import signals as sg

T0 = 1_780_000_040  # seconds; 20 s into a step
STEP = sg.STEP_SECONDS


def _ts(s):
    return dt.datetime.fromtimestamp(s, dt.timezone.utc)


def test_counter_delta_wrap_reset_and_unknown():
    prev = np.array([10.0, 65530.0, 500.0, np.nan, 7.0])
    cur = np.array([15.0, 4.0, 3.0, 9.0, np.nan])
    d = sg.counter_delta(cur, prev, 16)
    # normal; wrap at 2^16 (65530 -> 4 is 10 counts); reset (500 -> 3 counted 3 since the reset);
    # first sample (no previous) counts nothing; unsupported stays unknown
    np.testing.assert_array_equal(d[:4], [5.0, 10.0, 3.0, 0.0])
    assert np.isnan(d[4])


def test_rdma_rows_to_base_signals_with_a_wrap_and_a_saturated_counter():
    rows = []
    values = [(100, 2**32 - 10, 3), (130, 5, 3), (130, 50, 65535), (131, 60, 65535)]
    for i, (sym, wait, rcv) in enumerate(values):
        rows.append({"ts": _ts(T0 + i * STEP), "node": "n1", "device": "mlx5_0", "port": 1, "state": 4,
                     "phys_state": 5 if i < 3 else 3, "symbol_error": sym, "port_xmit_wait": wait,
                     "port_rcv_errors": rcv})
    base = sg.node_base_signals({"rdma_port": sch.to_table("rdma_port", rows)})
    assert len(base) == 4
    np.testing.assert_array_equal(base["ib_symbol_error"], [0, 30, 0, 1])
    np.testing.assert_array_equal(base["ib_xmit_wait"], [0, 15, 45, 10])  # wrapped at 2^32
    np.testing.assert_array_equal(base["ib_counter_saturated"], [0, 0, 1, 1])
    np.testing.assert_array_equal(base["ib_port_down_frac"], [0, 0, 0, 1])
    # columns the rows did not carry stay unknown, never 0
    assert np.isnan(base["ecc_sbe"]).all() and np.isnan(base["ib_ack_timeout"]).all()


def test_a_cleared_pma_error_counter_counts_from_zero_not_as_a_wrap():
    """IB PMA error counters saturate and are cleared (fabric manager, perfquery -x), never wrapped:
    a symbol_error cleared at 60,000 then counting 3 is 3 errors, not 65,536 - 60,000 + 3."""
    rows = [{"ts": _ts(T0 + i * STEP), "node": "n1", "device": "mlx5_0", "port": 1, "state": 4, "phys_state": 5,
             "symbol_error": sym} for i, sym in enumerate((59_990, 60_000, 3, 4))]
    base = sg.node_base_signals({"rdma_port": sch.to_table("rdma_port", rows)})
    np.testing.assert_array_equal(base["ib_symbol_error"], [0, 10, 3, 1])


def test_a_delta_across_a_gap_is_scaled_to_one_step():
    """A missed sample or a collector outage: the errors of the whole gap are spread over it, so the
    first step after the gap is not a burst. Ten steps without samples, then 100 errors: 10 a step."""
    rows = [{"ts": _ts(T0 + k * STEP), "node": "n1", "gpu": 0, "gpu_lost": False, "ecc_corrected_volatile": v}
            for k, v in ((0, 0), (1, 2), (11, 102), (12, 103))]
    base = sg.node_base_signals({"gpu": sch.to_table("gpu", rows)})
    np.testing.assert_array_equal(base["ecc_sbe"], [0, 2, 10, 1])


def _coarse_rows(interval_s, minutes=40, missed=()):
    """One GPU sampled every `interval_s`, its corrected ECC growing 6 a minute, its temperature rising
    a degree a sample; `missed` names sample indexes that are not written."""
    out = []
    for i, t in enumerate(range(0, minutes * 60, interval_s)):
        if i not in missed:
            out.append({"ts": _ts(T0 + t), "node": "n1", "gpu": 0, "gpu_lost": False,
                        "ecc_corrected_volatile": 6 * (t // 60), "temperature_c": 40.0 + i})
    return out


def test_a_collector_sampling_every_few_steps_has_each_delta_spread_over_the_steps_it_covers():
    """Every 2 or 5 minutes: from the entity's fourth gap in a row, each sample's errors are shared out
    over its own step and the steps after it that its span covers, its gauges held there, so every step
    reads the rate (6 a step) a once-a-minute collector shows, and no step goes without a value. The
    first three gaps are scaled to one step's worth, as a missed sample's are."""
    for every in (2, 5):
        base = sg.node_base_signals({"gpu": sch.to_table("gpu", _coarse_rows(every * STEP))})
        steps = base.step - base.step[0]
        ecc = base["ecc_sbe"]
        spread_from = sg.SPREAD_AFTER_GAPS * every
        np.testing.assert_array_equal(steps[steps >= spread_from], np.arange(spread_from, steps[-1] + 1))
        np.testing.assert_array_equal(ecc[steps >= spread_from], 6.0)
        np.testing.assert_array_equal(ecc[(steps > 0) & (steps < spread_from)], 6.0)   # scaled, one a sample
        assert len(ecc[(steps > 0) & (steps < spread_from)]) == sg.SPREAD_AFTER_GAPS - 1
        temp = base["temp_max"][steps >= spread_from]
        np.testing.assert_array_equal(temp, 40.0 + sg.SPREAD_AFTER_GAPS + np.arange(len(temp)) // every)


def test_missed_samples_and_outages_are_scaled_not_spread():
    """A once-a-minute collector missing samples here and there (three gaps in a row at most, one fewer
    than spreading needs) and an entity silent for longer than an outage's span: each such delta is
    scaled to one step's worth, the unsampled steps stay without a value, as before spreading existed."""
    assert sg.SPREAD_AFTER_GAPS == 4
    missed = {3, 5, 7, 10, 11, 12}   # gaps of 2, 2, 2 (in a row), a sample a step later, a gap of 4
    base = sg.node_base_signals({"gpu": sch.to_table("gpu", _coarse_rows(STEP, 20, missed))})
    steps = list(base.step - base.step[0])
    assert steps == [k for k in range(20) if k not in missed]
    np.testing.assert_array_equal(base["ecc_sbe"][1:], 6.0)
    outage = sg.node_base_signals({"gpu": sch.to_table("gpu", _coarse_rows(12 * STEP, 120))})
    assert len(outage) == 10 and np.all(outage["ecc_sbe"][1:] == 6.0)


def test_spreading_gives_the_same_values_in_one_batch_or_a_row_at_a_time_across_a_restart():
    """The online path: rows one at a time, the stage saved and restored halfway (OnlineScorer's state
    carries each entity's run of gaps), the same per-step values as the offline batch."""
    rows = _coarse_rows(2 * STEP, 60)
    offline_ = sg.reduce_steps("gpu", sg.SampleStage().samples("gpu", sch.to_table("gpu", rows)))
    stage, parts = sg.SampleStage(), []
    for i, r in enumerate(rows):
        if i == 6:   # inside the run of gaps that spreads
            stage = sg.SampleStage.from_state(*stage.state())
        parts.append(stage.samples("gpu", sch.to_table("gpu", [r])))
    online_ = sg.reduce_steps("gpu", sg.Samples.concat(parts))
    np.testing.assert_array_equal(online_.keys, offline_.keys)
    np.testing.assert_array_equal(online_.values, offline_.values)
    assert stage.stats.spread["gpu"] > 20


def test_error_counters_reduce_to_the_worst_device_so_node_sizes_compare():
    """Four quiet GPUs or eight: the same worst-GPU count; the failing GPU shows as itself."""
    def node(gpus, noisy):
        rows = []
        for k in range(2):
            for g in range(gpus):
                rows.append({"ts": _ts(T0 + k * STEP), "node": f"n{gpus}", "gpu": g, "gpu_lost": False,
                             "ecc_corrected_volatile": k * (7 if g == noisy else 1)})
        return sg.node_base_signals({"gpu": sch.to_table("gpu", rows)}).row(1)["ecc_sbe"]

    assert node(4, 2) == node(8, 5) == 7


def test_traffic_is_per_device_so_a_four_port_node_reads_like_an_eight_port_one():
    """The same bytes per port (and per GPU) on 4 ports or 8, sampled twice a step: the same traffic,
    so traffic_vs_job does not single out a smaller node type in a mixed job."""
    def node(ports):
        rows, links = [], []
        for k in range(3):
            for half in (0, 30):
                for p in range(ports):
                    rows.append({"ts": _ts(T0 + k * STEP + half), "node": f"n{ports}", "device": f"mlx5_{p}",
                                 "port": 1, "state": 4, "phys_state": 5,
                                 "port_xmit_bytes": (2 * k + half // 30) * 1000, "port_rcv_bytes": 0})
                    links.append({"ts": _ts(T0 + k * STEP + half), "node": f"n{ports}", "gpu": p,
                                  "tx_kib": (2 * k + half // 30) * 64, "rx_kib": 0})
        base = sg.node_base_signals({"rdma_port": sch.to_table("rdma_port", rows),
                                     "nvlink": sch.to_table("nvlink", links)})
        return base.row(2)["ib_traffic"], base.row(2)["nvl_traffic"]

    assert node(4) == node(8) == (2000, 128)


def test_gpu_rows_many_samples_per_step_reduce_per_gpu_then_across():
    rows = []
    for k in range(6):  # 6 samples at 10 s: one step
        for g in range(2):
            rows.append({"ts": _ts(T0 - 20 + k * 10), "node": "n1", "gpu": g, "temperature_c": 50.0 + g * 10 + k,
                         "ecc_corrected_volatile": (k * 3 if g == 1 else 0), "gpu_lost": False,
                         "clock_event_reasons": 0x40 if (g == 1 and k >= 3) else 0})
    base = sg.node_base_signals({"gpu": sch.to_table("gpu", rows)})
    assert len(base) == 1
    r = base.row(0)
    assert r["ecc_sbe"] == 15   # the worst GPU's count: GPU 1 counted 15, GPU 0 none
    # the gap between the GPUs' own peaks (65 and 55), not the hottest sample minus the coolest (50)
    assert r["temp_max"] == 65 and r["temp_spread"] == 10
    assert r["thermal_throttle_frac"] == pytest.approx(3 / 12)


def test_the_temperature_gap_does_not_depend_on_the_sampling_interval():
    """Two GPUs 10 degC apart whose load swings together: the gap is 10 whether a step holds one
    sample of each or twelve, and whether the rows arrive in one batch or one row at a time (online)."""
    def rows(samples):
        out = []
        for k in range(samples):
            swing = 20.0 * (k % 2)   # the job's load moves every GPU at once
            for g in range(2):
                out.append({"ts": _ts(T0 - 20 + k * 60 // samples), "node": "n1", "gpu": g,
                            "temperature_c": 50.0 + 10 * g + swing, "gpu_lost": False})
        return out
    for samples in (1, 12):
        base = sg.node_base_signals({"gpu": sch.to_table("gpu", rows(samples))})
        assert len(base) == 1 and base.row(0)["temp_spread"] == 10, samples
    stage = sg.SampleStage()
    acc = online._StepAccumulator("gpu", 1)
    for r in rows(12):
        part = stage.samples("gpu", sch.to_table("gpu", [r]))
        acc.merge(sg.reduce_steps("gpu", part), part)
    step = int(part.step[0])
    frame = sg.finish([acc.frame(step, 1)])
    assert frame.values[0, sg.BASE_INDEX["temp_spread"]] == 10


def test_hbm_warming_apart_from_its_die_is_the_gpu_furthest_above_the_nodes_other_gpus():
    """Per node and step, the largest HBM-over-die gap of its GPUs less their mean: the load moving every
    GPU's die and HBM at once leaves it as it is; one GPU's HBM heating on its own moves it; a GPU
    without an HBM temperature is left out, and a node with none has none."""
    def rows(load, hbm_extra, missing=()):
        out = []
        for g in range(4):
            die = 40.0 + 30.0 * load + 2.0 * g          # each GPU's own place in the airflow
            out.append({"ts": _ts(T0), "node": "n1", "gpu": g, "temperature_c": die, "gpu_lost": False,
                        "hbm_temperature_c": None if g in missing else die + 5.0 + hbm_extra.get(g, 0.0)})
        return out

    def excess(r):
        return sg.node_base_signals({"gpu": sch.to_table("gpu", r)}).row(0)["hbm_gap_excess"]

    assert excess(rows(0.1, {})) == 0.0 and excess(rows(0.9, {})) == 0.0
    # GPU 2's HBM 6 degC warmer than its die than the others: 6 less the mean of (0, 0, 6, 0)
    assert excess(rows(0.5, {2: 6.0})) == 4.5
    assert excess(rows(0.5, {2: 6.0}, missing=(0,))) == 4.0
    assert np.isnan(excess(rows(0.5, {}, missing=(0, 1, 2, 3))))


def _warming_signals(t, gap, remap_at=None, die=None):
    x = np.full((1, t, len(ft.ALL_NAMES)), np.nan)
    x[0, :, ft.IDX["hbm_gap_excess"]] = gap
    x[0, :, ft.IDX["temp_spread"]] = 3.0 if die is None else die
    x[0, :, ft.IDX["remap_correctable"]] = 0.0
    if remap_at is not None:
        x[0, remap_at, ft.IDX["remap_correctable"]] = 1.0
    return x


def test_the_warming_columns_read_the_gap_against_its_usual_and_the_remaps_and_dies_beside_it():
    t, rise_at = 600, 500
    gap = np.where(np.arange(t) < rise_at, 1.0, 4.0) + 0.25 * (np.arange(t) % 2)
    gap[550] = np.nan
    cols = [ft.FEATURE_NAMES.index(n) for n in ("hbm_gap_excess_vs_usual", "temp_spread_vs_usual",
                                                 "hbm_gap_excess_remapping")]
    for remap_at in (None, 480):
        X, _ = ft.compute(_warming_signals(t, gap, remap_at), np.arange(t), ft.FeatureState.empty(1))
        vs_usual, die, remapping = X[0, :, cols[0]], X[0, :, cols[1]], X[0, :, cols[2]]
        # no usual in the first 6 hours; then a chronic gap reads about 0 whatever its size
        assert np.isnan(vs_usual[:359]).all() and abs(vs_usual[499]) < 0.2 and abs(die[540]) < 1e-6
        assert vs_usual[540] > 2.0 and np.isnan(vs_usual[550]) and np.isnan(remapping[550])
        if remap_at is None:
            assert (remapping[360:550] == 0.0).all()
        else:
            assert remapping[470] == 0.0 and remapping[540] == vs_usual[540]
    # a GPU whose die heats (a cooling fault) warms its HBM too: the dies' spread rises as much, not apart
    hot = np.where(np.arange(t) < rise_at, 3.0, 9.0)
    X, _ = ft.compute(_warming_signals(t, gap, 480, die=hot), np.arange(t), ft.FeatureState.empty(1))
    assert X[0, 540, cols[0]] > 2.0 and X[0, 540, cols[1]] > 4.0 and X[0, 540, cols[2]] == 0.0
    # any split of the steps into blocks gives the same values, the compiled and numpy one-step paths too
    x = _warming_signals(t, gap, 480, die=np.where(np.arange(t) % 7 == 0, np.nan, hot))
    whole, _ = ft.compute(x, np.arange(t), ft.FeatureState.empty(1))
    for block, kernel in ((1, True), (1, False), (7, True), (33, True)):
        state, parts = ft.FeatureState.empty(1), []
        for a in range(0, t, block):
            got, state = ft.compute(x[:, a:a + block], np.arange(a, min(a + block, t)), state, kernel=kernel)
            parts.append(got)
        np.testing.assert_array_equal(np.concatenate(parts, axis=1)[0, :, cols], whole[0, :, cols])


def test_events_are_counted_by_class():
    rows = [{"ts": _ts(T0), "node": "n1", "kind": "xid", "source": "kmsg", "severity": s, "xid": x}
            for s, x in (("fatal", 79), ("precursor", 92), ("application", 13), ("fatal", 74))]
    rows.append({"ts": _ts(T0 + 1), "node": "n1", "kind": "link_state", "source": "sysfs"})
    base = sg.node_base_signals({"events": sch.to_table("events", rows)})
    r = base.row(0)
    assert (r["xid_fatal"], r["xid_precursor"], r["xid_application"], r["xid_nvlink"], r["link_state_events"]) == (2, 1, 1, 1, 1)


def test_windows_and_since_match_a_brute_force_computation():
    rng = np.random.default_rng(0)
    t = 200
    x = np.full((1, t, len(ft.ALL_NAMES)), np.nan)
    i_ecc, i_temp, i_fatal = ft.IDX["ecc_sbe"], ft.IDX["temp_max"], ft.IDX["xid_fatal"]
    x[0, :, i_ecc] = rng.poisson(2, t)
    x[0, :, i_temp] = 60 + rng.standard_normal(t)
    x[0, :, i_fatal] = 0
    x[0, 120, i_fatal] = 1
    x[0, 150:160, i_ecc] = np.nan  # a gap in one signal
    X, _ = ft.compute(x, np.arange(t), ft.FeatureState.empty(1))
    F = {n: X[0, :, j] for j, n in enumerate(ft.FEATURE_NAMES)}
    for s in (40, 155, 199):
        assert F["ecc_sbe_30m"][s] == pytest.approx(np.nansum(x[0, s - 29:s + 1, i_ecc]))
        if s != 155:
            assert F["ecc_sbe_5m"][s] == pytest.approx(np.nansum(x[0, s - 4:s + 1, i_ecc]))
        assert F["temp_max_max30m"][s] == pytest.approx(np.nanmax(x[0, s - 29:s + 1, i_temp]))
        rise = x[0, s - 4:s + 1, i_temp].mean() - x[0, s - 29:s - 24, i_temp].mean()
        assert F["temp_max_rise30m"][s] == pytest.approx(rise, rel=1e-5)
    assert np.isnan(F["ecc_sbe_1m"][155]) and np.isnan(F["ecc_sbe_5m"][155])  # nothing known: NaN, not 0
    assert F["minutes_since_xid_fatal"][119] == ft.SINCE_CAP_MINUTES
    assert F["minutes_since_xid_fatal"][130] == 10
    # the baseline ratio: a sudden tenfold rate shows as roughly tenfold
    y = np.zeros((1, 3000, len(ft.ALL_NAMES)))
    y[0, :, i_ecc] = 1.0
    y[0, -30:, i_ecc] = 10.0
    Y, _ = ft.compute(y, np.arange(3000), ft.FeatureState.empty(1))
    assert 8 < Y[0, -1, ft.FEATURE_NAMES.index("ecc_sbe_30m_vs_baseline")] < 11


def test_peer_signals_tell_a_switch_fault_from_a_node_fault():
    # 4 nodes under one leaf; node 0 alone with link errors (its cable), then all four (the switch)
    # inputs: link errors, traffic, TCP retransmissions, GPU errors, hottest GPU, lowest SM clock, then
    # corrected ECC, rows remapped, PCIe replays and link error recoveries (the context's)
    own = np.array([[50.0, 1e9, 0, 0, 60, 1980, 0, 0, 0, 4], [0, 1e9, 0, 0, 60, 1980, 0, 0, 0, 0],
                    [0, 1e9, 0, 0, 60, 1980, 0, 0, 0, 0], [0, 5e8, 0, 30, 75, 1800, 30, 0, 0, 0]])
    present = np.ones(4, dtype=bool)
    codes = {"leaf_switch": np.zeros(4, np.int64), "job": np.zeros(4, np.int64), "site": np.zeros(4, np.int64)}

    def totals(o):
        t = (np.full(4, 4.0), np.tile(o.sum(axis=0), (4, 1)), np.tile((o > 0).sum(axis=0).astype(float), (4, 1)))
        return {g: t for g in ft.PEER_GROUPS}

    p = ft.peer_signals(own, present, codes, totals(own))
    assert p[0, 0] == 0 and p[0, 1] == pytest.approx(51.0)      # node fault: no peer has errors
    assert p[3, 2] == pytest.approx(5e8 / 1e9)                     # a straggler vs its job
    # the straggler's GPUs against its job's: errors, heat and clock (the job may slow as a whole)
    names = [s_.name for s_ in ft.PEER_SIGNALS]
    assert p[3, names.index("gpu_err_vs_job")] == pytest.approx(31.0)
    assert p[3, names.index("temp_vs_job")] == pytest.approx(15.0)
    assert p[3, names.index("sm_clock_vs_job")] == pytest.approx(1800 / 1980)
    assert p[0, names.index("temp_vs_job")] == pytest.approx(60 - 65)
    # a node that reports no GPU readings has no GPU comparison, and does not drag its peers' mean
    own3 = own.copy()
    own3[1, 4:] = 0
    p3 = ft.peer_signals(own3, present, codes, totals(own3))
    assert np.isnan(p3[1, names.index("temp_vs_job")])
    assert p3[3, names.index("temp_vs_job")] == pytest.approx(15.0)
    own2 = own.copy()
    own2[:, 0] = 50.0
    p2 = ft.peer_signals(own2, present, codes, totals(own2))
    assert p2[0, 0] == 1.0 and p2[0, 1] == pytest.approx(1.0)     # switch fault: all peers too


def test_context_is_the_other_nodes_under_the_leaf_whether_or_not_the_node_reported():
    # 4 nodes under one leaf; node 3's HBM is loud; node 0's links recover now and then
    own = np.zeros((4, len(ft.PEER_INPUTS)))
    ecc, rec = ft.PEER_INPUTS.index("ecc_sbe"), ft.PEER_INPUTS.index("ib_link_error_recovery")
    own[3, ecc], own[0, rec] = 30.0, 6.0
    present = np.array([True, True, True, False])
    codes = {g: np.zeros(4, np.int64) for g in ft.PEER_GROUPS}
    codes["leaf_switch"] = np.array([0, 0, 0, -1])
    counted = own * present[:, None]
    cnt = np.full(4, float(present.sum()))
    t = (cnt, np.tile(counted.sum(axis=0), (4, 1)), np.tile((counted > 0).sum(axis=0).astype(float), (4, 1)))
    p = ft.peer_signals(own, present, codes, {g: t for g in ft.PEER_GROUPS})
    ctx = {s_.name: p[:, len(ft.PEER_SIGNALS) + i] for i, s_ in enumerate(ft.CONTEXT_SIGNALS)}
    # node 0's own recoveries are not its neighbourhood's; its two reporting peers' mean is
    assert ctx["leaf_peers_link_recovery"][0] == 0.0
    assert ctx["leaf_peers_link_recovery"][1] == pytest.approx(3.0)
    # node 3 is in no leaf group: no neighbourhood; its ECC (not reported this step) is in no total
    assert np.isnan(ctx["leaf_peers_ecc"][3]) and ctx["leaf_peers_ecc"][0] == 0.0
    # a node absent this step still has its neighbourhood (its own comparisons are NaN)
    present2 = np.array([False, True, True, False])
    counted2 = own * present2[:, None]
    t2 = (np.full(4, 2.0), np.tile(counted2.sum(axis=0), (4, 1)),
          np.tile((counted2 > 0).sum(axis=0).astype(float), (4, 1)))
    p2 = ft.peer_signals(own, present2, codes, {g: t2 for g in ft.PEER_GROUPS})
    assert np.isnan(p2[0, :len(ft.PEER_SIGNALS)]).all()
    assert p2[0, len(ft.PEER_SIGNALS):].tolist() == [0.0] * len(ft.CONTEXT_SIGNALS)


def test_explanations_say_a_neighbourhoods_usual_with_its_unit_and_never_name_a_quiet_one():
    from foreshock.predictor import explain as ex

    row = np.full(ft.N_FEATURES, np.nan, dtype=np.float32)
    col = ft.FEATURE_NAMES.index("leaf_peers_link_recovery_3d")
    k = ex.GROUP_NAMES.index("leaf_peers_link_recovery")
    row[col] = 0.0
    assert not ex.unusual(row[None], np.zeros(ft.N_FEATURES))[0, k]
    row[col] = 0.25
    assert ex.unusual(row[None], np.zeros(ft.N_FEATURES))[0, k]
    assert ex.describe("leaf_peers_link_recovery", row) == (
        "IB link error recoveries per minute of the other nodes under this leaf switch: "
        "0.25 recoveries on average over the last 3 days")


def test_labels_horizon_blast_radius_and_exclusion():
    step_ns = STEP * 10**9
    ends = (np.arange(200) + 1) * step_ns
    ts = int(ends[100] + 30 * 10**9)     # the incident, 30 s after step 100 ends
    inc = sch.to_table("incidents", [{
        "ts": pd.Timestamp(ts, tz="UTC"), "node": "leaf-3", "incident_id": "i1", "scope": "switch",
        "affected_nodes": ["n1", "n2"], "category": "network_switch_cable", "has_precursor": True,
        "repaired_at": pd.Timestamp(ts + 40 * step_ns, tz="UTC")}])
    incidents = lb.Incidents.from_table(inc)
    assert set(incidents.frame["node"]) == {"n1", "n2"}
    y, excl = lb.node_labels(ends, incidents.of_node("n2"), horizon_s=30 * 60)
    assert y.sum() == 30 and y[71:101].all() and not y[70] and not y[101]
    assert excl[101:141].all() and not excl[100] and not excl[142]
    y3, _ = lb.node_labels(ends, incidents.of_node("n3"), 1800)
    assert y3.sum() == 0


def test_prior_shift_moves_probabilities_to_the_deployment_base_rate():
    from foreshock.predictor.model import PriorShift

    class Fixed:
        def predict_proba(self, X):
            p = np.asarray(X, dtype=float)[:, 0]
            return np.column_stack([1 - p, p])

    q = PriorShift(Fixed(), 10.0).fit().predict_proba(np.array([[0.5], [0.0], [1.0]]))[:, 1]
    # odds 1 -> 0.1: p = 1/11; 0 and 1 stay where they are
    np.testing.assert_allclose(q, [1 / 11, 0.0, 1.0])


def test_samples_do_not_depend_on_how_rows_are_batched():
    """The sample stage carries each entity's last sample across batches (updated in place, re-sorted
    only when new entities appear): a node at a time, a sweep at a time or all at once give the same
    samples, with a node and a port that appear midway, a 32-bit wrap and a re-sent sweep."""
    sweeps = []
    for k in range(6):
        rows = []
        for n in range(3):
            if n == 2 and k < 3:
                continue                                      # n2 starts reporting at sweep 3
            for dev in ("mlx5_0", "mlx5_1") if (n == 1 and k >= 4) else ("mlx5_0",):
                wait = (2**32 - 40 + 25 * k) % 2**32 if n == 0 else 1000 * k + n   # n0 wraps at sweep 2
                rows.append({"ts": _ts(T0 + k * STEP + n), "node": f"n{n}", "device": dev, "port": 1,
                             "state": 4, "phys_state": 5, "symbol_error": 3 * k + n, "port_xmit_wait": wait,
                             "port_rcv_errors": k * k})
        sweeps.append(rows)
    resent = sweeps[2]                                        # a collector re-sends an old sweep at the end

    def run(batches):
        stage = sg.SampleStage()
        out = [stage.samples("rdma_port", sch.to_table("rdma_port", b)) for b in batches]
        out = [s for s in out if len(s)]
        key = np.concatenate([s.key for s in out])
        step = np.concatenate([s.step for s in out])
        order = np.lexsort((step, key))
        cols = {c: np.concatenate([s.cols[c] for s in out])[order] for c in out[0].cols}
        return key[order], step[order], cols, stage.stats.dropped_late["rdma_port"]

    whole = run([sum(sweeps, []) + resent])
    per_sweep = run(sweeps + [resent])
    per_node = run([[r] for rows in sweeps for r in rows] + [resent])
    for got in (per_sweep, per_node):
        np.testing.assert_array_equal(got[0], whole[0])
        np.testing.assert_array_equal(got[1], whole[1])
        assert got[3] == whole[3] == len(resent)
        for c, v in whole[2].items():
            np.testing.assert_array_equal(got[2][c], v, err_msg=c)
    key, step, cols, _ = whole
    assert len(key) == 3 * 6 - 3 + 2                          # every row once, the re-sent ones dropped
    wait = cols["ib_xmit_wait"]
    n0 = key // sg.NODE_SHIFT == key.min() // sg.NODE_SHIFT
    np.testing.assert_array_equal(wait[n0], [0, 25, 25, 25, 25, 25])   # across the wrap too


def test_explanations_never_name_a_zero_count_and_say_what_is_unusual():
    """A signal that counted nothing is no reason an operator can act on, whatever the model makes of
    its ratios; one that counted is named with its baseline and its peers."""
    from foreshock.predictor import explain as ex

    idx = {n: i for i, n in enumerate(ft.FEATURE_NAMES)}
    ref = np.zeros(ft.N_FEATURES, dtype=np.float32)
    ref[idx["ib_ack_timeout_30m_vs_baseline"]] = 1.0
    row = ref.copy()
    row[idx["ib_ack_timeout_30m_vs_baseline"]] = 5.0          # a ratio, but no timeout counted
    for w in ("1m", "5m", "30m"):
        row[idx[f"nvl_crc_{w}"]] = {"1m": 40, "5m": 200, "30m": 1200}[w]
    row[idx["nvl_crc_30m_vs_baseline"]] = 60.0
    row[idx["gpu_err_vs_job_30m"]] = 300.0
    X = row[None, :]

    def proba(rows):   # the model likes both the ratio and the CRC count
        rows = np.atleast_2d(rows)
        return 0.01 * rows[:, idx["ib_ack_timeout_30m_vs_baseline"]] + 1e-4 * rows[:, idx["nvl_crc_30m"]]

    sigs = ex.explain(proba, X, proba(X), ref, top=3)[0]
    names = [s.name for s in sigs]
    assert "ib_ack_timeout" not in names and "nvl_crc" in names
    text = sigs[names.index("nvl_crc")].description
    assert "1,200 in the last 30 min" in text and "60x its 3-day baseline" in text and "300x its job's other nodes" in text

    # nor one whose only trace is below what describe says: a faint steadiness, a fraction of a day's count
    row[idx["ib_ack_timeout_steadiness_2h"]] = 0.05
    row[idx["pcie_replay_decayed_12h"]] = 0.4
    row[idx["pcie_replay_30m_vs_baseline"]] = 3.0
    X = row[None, :]

    def likes_replays(rows):
        return proba(rows) + 0.01 * np.atleast_2d(rows)[:, idx["pcie_replay_30m_vs_baseline"]]

    assert {"ib_ack_timeout", "pcie_replay"}.isdisjoint(s.name for s in ex.explain(likes_replays, X, likes_replays(X), ref)[0])
    row[idx["ib_ack_timeout_steadiness_2h"]] = 0.3
    row[idx["pcie_replay_decayed_12h"]] = 2.0
    X = row[None, :]
    named = {s.name: s.description for s in ex.explain(likes_replays, X, likes_replays(X), ref)[0]}
    assert "counting in 30% more of the last 2 hours' minutes" in named["ib_ack_timeout"]
    assert "about 2 over the last day" in named["pcie_replay"]



def test_a_reason_counted_over_the_day_leads_with_the_day_not_a_quiet_half_hour():
    """HBM rows remapped hours ago and nothing since: the reason is the day's count; the empty
    30 minutes come after it, and a baseline ratio of a window that counted nothing is not said."""
    from foreshock.predictor import explain as ex

    idx = {n: i for i, n in enumerate(ft.FEATURE_NAMES)}
    row = np.zeros(ft.N_FEATURES, dtype=np.float32)
    row[idx["remap_correctable_decayed_12h"]] = 3.2
    row[idx["pcie_replay_decayed_12h"]] = 1226.0
    row[idx["pcie_replay_30m_vs_baseline"]] = 0.1
    remap = ex.describe("remap_correctable", row)
    replay = ex.describe("pcie_replay", row)
    assert remap.split(": ", 1)[1] == "about 3 over the last day, none in the last 30 min"
    assert replay.split(": ", 1)[1] == "about 1,226 over the last day, none in the last 30 min"
    assert "0 in the last" not in remap + replay and "baseline" not in replay


@pytest.mark.parametrize("values, signal, said", [
    # a count spread over a sampling gap (half of one in the window): about the whole number
    ({"ib_ack_timeout_30m": 0.5}, "ib_ack_timeout", "about 1 in the last 30 min"),
    ({"ecc_sbe_30m": 3.5}, "ecc_sbe", "about 4 in the last 30 min"),
    ({"pcie_replay_30m": 12.0}, "pcie_replay", "12 in the last 30 min"),
    # one error after three quiet days is 2x by the ratio's floor: said as what it is
    ({"ib_ack_timeout_30m": 1.0, "ib_ack_timeout_30m_vs_baseline": 2.0}, "ib_ack_timeout",
     "1 in the last 30 min, after a quiet 3 days"),
    ({"ecc_sbe_30m": 300.0, "ecc_sbe_30m_vs_baseline": 40.0}, "ecc_sbe",
     "300 in the last 30 min, 40x its 3-day baseline"),
    # shares as percentages, units that agree with their number, a gauge's rise in its unit
    ({"thermal_throttle_frac_now": 0.25, "thermal_throttle_frac_max30m": 1.0}, "thermal_throttle_frac",
     "25% now, 100% at most in 30 min"),
    ({"leaf_peers_link_err_frac_30m": 0.54, "leaf_peers_link_err_frac_5m": 0.5}, "leaf_peers_link_err_frac",
     "54% over 30 min (50% over 5 min)"),
    ({"nvl_links_down_now": 1.0, "nvl_links_down_max30m": 2.0}, "nvl_links_down", "1 link now, 2 links at most in 30 min"),
    ({"temp_max_now": 60.0, "temp_max_max30m": 65.0, "temp_max_rise30m": 3.0}, "temp_max",
     "60 degC now, 65 degC at most in 30 min, +3.0 degC over 30 min"),
])
def test_a_reason_says_its_value_in_words_an_operator_reads(values, signal, said):
    from foreshock.predictor import explain as ex

    row = np.zeros(ft.N_FEATURES, dtype=np.float32)
    for name, v in values.items():
        row[ft.FEATURE_NAMES.index(name)] = v
    assert ex.describe(signal, row).split(": ", 1)[1] == said


def test_a_steady_signal_is_named_with_its_steadiness_and_credited_with_the_novelty():
    """The novelty alarm's risk goes to the signal that counts steadily, said in words; a quiet
    steadiness is not said."""
    from foreshock.predictor import explain as ex

    idx = {n: i for i, n in enumerate(ft.FEATURE_NAMES)}
    ref = np.zeros(ft.N_FEATURES, dtype=np.float32)
    row = ref.copy()
    row[idx["nvl_recovery_30m"]] = 12
    row[idx["nvl_recovery_steadiness_2h"]] = 0.6
    row[idx["pcie_replay_steadiness_2h"]] = 0.05
    X = row[None, :]

    def proba(rows):   # the fused risk: the steadiness alone raises it
        return 0.02 * np.atleast_2d(rows)[:, idx["nvl_recovery_steadiness_2h"]]

    sigs = ex.explain(proba, X, proba(X), ref, top=3)[0]
    assert [s.name for s in sigs] == ["nvl_recovery"]
    assert "counting in 60% more of the last 2 hours' minutes than over its days" in sigs[0].description
    assert "2 hours" not in ex.describe("pcie_replay", row)


def test_out_of_sequence_packets_raise_no_feature_but_link_errors_do():
    """Out-of-order arrival is what adaptive routing does (and congestion): a storm of it leaves every
    feature as it was, while the same count of symbol errors does not."""
    rng = np.random.default_rng(1)
    t = 120
    x = np.zeros((1, t, len(ft.ALL_NAMES)))
    x[0, :, ft.IDX["temp_max"]] = 60 + rng.standard_normal(t)
    quiet, _ = ft.compute(x, np.arange(t), ft.FeatureState.empty(1))
    for signal, changes in (("ib_out_of_sequence", False), ("ib_symbol_error", True)):
        y = x.copy()
        y[0, 60:, ft.IDX[signal]] = 5000.0
        got, _ = ft.compute(y, np.arange(t), ft.FeatureState.empty(1))
        assert (not np.array_equal(got, quiet, equal_nan=True)) is changes, signal


def test_the_anomaly_scores_read_errors_above_the_nodes_history_and_above_its_peers():
    rows = np.full((3, ft.N_FEATURES), np.nan, dtype=np.float32)
    col = {n: i for i, n in enumerate(ft.FEATURE_NAMES)}
    rows[0, col["ecc_sbe_30m_vs_baseline"]] = 8.0          # 3 doublings above its own baseline
    rows[0, col["nvl_crc_30m_vs_baseline"]] = 4.0
    rows[1, col["gpu_err_vs_job_30m"]] = 16.0               # 4 doublings above its job's nodes
    rows[2, col["ecc_sbe_30m_vs_baseline"]] = 0.5           # quieter than usual: not unusual
    ft.anomaly_scores(rows)
    own, count, peers = (rows[:, col[n]] for n in ("anomaly_vs_own_history", "anomaly_signals_4x_baseline",
                                                    "anomaly_vs_peers"))
    np.testing.assert_allclose(own, [3, 0, 0])
    np.testing.assert_allclose(count, [2, 0, 0])
    np.testing.assert_allclose(peers, [0, 4, 0])


def test_steadiness_reads_how_steadily_a_signal_counts_not_how_much():
    """A failing device counting a little every minute for hours is far steadier than a burst a
    thousand times stronger that lasts a quarter of an hour, and a device that always counts is its
    own baseline; unknown counts as not counted."""
    day = 3 * 1440
    t = day + 240
    x = np.zeros((3, t, len(ft.ALL_NAMES)))
    i = ft.IDX["pcie_replay"]
    rng = np.random.default_rng(3)
    x[0, day:, i] = 1.0 + rng.poisson(0.5, 240)       # a weak, steady precursor over the last 4 hours
    x[1, -60:-45, i] = 5000.0                         # one strong 15-minute burst in the last hour
    x[2, :, i] = 1.0 + rng.poisson(3.0, t)            # a chronic device: counts every minute, always
    X, _ = ft.compute(x, np.arange(t), ft.FeatureState.empty(3))
    col = ft.FEATURE_NAMES.index("pcie_replay_steadiness_2h")
    steady = X[:, -1, col]
    assert steady[0] > 0.6 and 0.0 < steady[1] < 0.15 and abs(steady[2]) < 0.01
    assert np.all(X[:, -1, ft.STEADY_COLS][:, [j for j, n in enumerate(ft.STEADY) if n != "pcie_replay"]] == 0)
    gap = x.copy()
    gap[0, day + 100:day + 130, i] = np.nan
    G, _ = ft.compute(gap, np.arange(t), ft.FeatureState.empty(3))
    assert np.isfinite(G[0, -1, col]) and G[0, -1, col] < steady[0]
