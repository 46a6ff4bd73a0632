"""Failure modes: the incident process matches the published figures, each precursor shows in the columns
it should, and faults without a precursor leave no trace before they happen."""

from __future__ import annotations

import collections
import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from foreshock.dataset import read_table
from foreshock.simulator.batch import SimSettings, run
from foreshock.simulator.faults import (CATEGORIES, DAY, HOUR, LLAMA3_COUNTS, MODES, NS, Episode,
                                        WIDE_MODES, FaultSettings, category_rates, schedule)
from foreshock.simulator.model import ClusterModel
from foreshock.simulator.topology import Topology

T0 = 1_767_571_200 * NS  # 2026-01-05T00:00:00Z
TOPO = Topology(nodes=4, nodes_per_leaf=2, job_nodes=2, spare_fraction=0.0, sites=2)


def _episode(mode, *, nodes=(1,), component=3, lead_h=4.0, fail_h=6.0, fails=True, peak=1.0, variant=0,
             repair_h=3.0):
    fail = T0 + int(fail_h * HOUR)
    start = fail - int(lead_h * HOUR) if MODES[mode].precursor else fail
    scope = {"leaf_switch": "leaf-000", "scale_across": "site-a"}.get(mode, "")
    return Episode(f"t-{mode}", mode, "test" if fails else None, tuple(nodes), component, start, fail, fails,
                   fail + int(repair_h * HOUR) if fails else 0, peak, scope, variant, 12345)


def _simulate(episodes, hours=12.0, interval_s=60.0, topo=TOPO):
    model = ClusterModel(topo, seed=5, episodes=episodes, start_ns=T0, interval_s=interval_s)
    ts = T0 + np.arange(0, int(hours * 3600 / interval_s)) * int(interval_s * NS)
    parts = [model.generate(np.arange(topo.nodes), chunk) for chunk in np.array_split(ts, 3)]
    return {name: pa.concat_tables([p[name] for p in parts if name in p]) for name in parts[0]}


def _series(tables, table, column, node, where=None):
    data = tables[table].filter(pc.equal(tables[table].column("node"), TOPO.names[node]))
    if where:
        for k, v in where.items():
            data = data.filter(pc.equal(data.column(k), v))
    data = data.sort_by("ts")
    return data.column("ts").cast(pa.int64()).to_numpy(), data.column(column).to_numpy(zero_copy_only=False)


def _base(baseline, ts, table, column, node, where=None):
    """The baseline's values at the sample times ts (the faulty run drops rows while a node is in repair)."""
    t0, v0 = _series(baseline, table, column, node, where)
    return v0[np.searchsorted(t0, ts)]


@pytest.fixture(scope="module")
def baseline():
    return _simulate([])


# -- the incident process ------------------------------------------------------------------------------
def test_incident_rate_and_mix_match_llama3():
    topo = Topology(nodes=4096, nodes_per_leaf=16, sites=2)
    days = 400
    eps = schedule(topo, T0, T0 + days * DAY, seed=11)
    failures = [e for e in eps if e.fails]
    expected = sum(category_rates().values()) * topo.nodes * days
    assert 3.7e-3 < sum(category_rates().values()) < 3.9e-3  # 419 / (2,048 x 54) node-days
    # overlaps with a node already in repair are dropped: a fraction of a percent
    assert abs(len(failures) - expected) < 4 * math.sqrt(expected) + 0.01 * expected, (len(failures), expected)
    counts = collections.Counter(e.category for e in failures)
    total = sum(LLAMA3_COUNTS.values())
    chi2 = 0.0
    for category, n in LLAMA3_COUNTS.items():
        exp = n / total * len(failures)
        chi2 += (counts[category] - exp) ** 2 / exp
    # 17 degrees of freedom: the 0.999 quantile is 40.8
    assert chi2 < 40.8, (chi2, counts)
    # modes within a category at their shares; precursor-less categories never get a precursor
    hbm = collections.Counter(e.mode for e in failures if e.category == "gpu_hbm")
    assert 0.78 < hbm["hbm"] / sum(hbm.values()) < 0.92
    for e in failures:
        if e.category in ("software_bug", "host_maintenance", "silent_data_corruption", "nccl_watchdog"):
            assert not e.has_precursor and e.start_ns == e.end_ns
    # rate_scale multiplies every rate
    scaled = [e for e in schedule(topo, T0, T0 + 100 * DAY, seed=3, settings=FaultSettings(rate_scale=5.0)) if e.fails]
    exp5 = expected / days * 100 * 5
    assert abs(len(scaled) - exp5) < 4 * math.sqrt(exp5) + 0.03 * exp5
    # recoveries: about recovery_ratio per precursor failure
    recov = [e for e in eps if not e.fails]
    prec = sum(1 for e in failures if e.has_precursor)
    assert abs(len(recov) - prec) < 4 * math.sqrt(prec)


def test_wide_faults_keep_their_share_where_many_nodes_are_in_repair():
    # at a training world's rate most leaves have a node in repair at any time; a switch still fails then,
    # taking down the nodes under it that are up
    topo = Topology(nodes=4096, nodes_per_leaf=16, sites=2)
    days = 28
    eps = [e for e in schedule(topo, T0, T0 + days * DAY, seed=181, settings=FaultSettings(rate_scale=20.0)) if e.fails]
    share = dict(CATEGORIES["network_switch_cable"][0])["leaf_switch"]
    expected = category_rates(20.0)["network_switch_cable"] * share * topo.nodes * days
    leaf = [e for e in eps if e.mode == "leaf_switch"]
    assert len(leaf) > 0.8 * expected - 4 * math.sqrt(expected), (len(leaf), expected)
    down_until: dict[int, int] = {}
    for e in sorted(eps, key=lambda e: e.end_ns):
        if e.mode == "leaf_switch":
            assert set(e.nodes) <= set(topo.nodes_under_leaf(int(topo.leaf_of[e.nodes[0]])))
            assert all(down_until.get(n, -1) <= e.end_ns for n in e.nodes), "a node in repair failed again"
        elif e.mode not in WIDE_MODES:
            assert down_until.get(e.nodes[0], -1) <= e.end_ns
            down_until[e.nodes[0]] = e.repair_ns


def test_schedule_is_a_function_of_the_seed():
    a = schedule(TOPO, T0, T0 + 365 * DAY, seed=1, settings=FaultSettings(rate_scale=50))
    b = schedule(TOPO, T0, T0 + 365 * DAY, seed=1, settings=FaultSettings(rate_scale=50))
    c = schedule(TOPO, T0, T0 + 365 * DAY, seed=2, settings=FaultSettings(rate_scale=50))
    assert a == b and a != c


def test_every_category_maps_to_known_modes():
    assert set(CATEGORIES) == set(LLAMA3_COUNTS)
    for modes, repair_h in CATEGORIES.values():
        assert all(m in MODES for m, _ in modes) and abs(sum(s for _, s in modes) - 1.0) < 1e-9 and repair_h > 0


# -- precursors show where they should ------------------------------------------------------------------
def _window(ts, ep):
    return (ts >= ep.start_ns) & (ts < ep.end_ns)


def test_hbm_precursor_then_uncorrectable(baseline):
    ep = _episode("hbm", variant=0)
    sim = _simulate([ep])
    ts, ce = _series(sim, "gpu", "ecc_corrected_volatile", 1, {"gpu": 3})
    ce0 = _base(baseline, ts, "gpu", "ecc_corrected_volatile", 1, {"gpu": 3})
    before = ts < ep.start_ns
    assert np.array_equal(ce[before], ce0[before])
    w = _window(ts, ep)
    gained = ce[w][-1] - ce0[w][-1]
    assert gained > 1000  # corrected errors accelerate through the precursor
    last_hour = w & (ts >= ep.end_ns - HOUR)
    first_hour = w & (ts < ep.start_ns + HOUR)
    assert np.diff(ce[last_hour]).mean() > 10 * max(np.diff(ce[first_hour]).mean(), 0.1)
    _, remap = _series(sim, "gpu", "remapped_rows_correctable", 1, {"gpu": 3})
    assert remap[w][-1] > remap[w][0]
    _, pending = _series(sim, "gpu", "remapped_rows_pending", 1, {"gpu": 3})
    assert pending[w][-1]
    ev = sim["events"].to_pandas()
    ev = ev[(ev.node == TOPO.names[1]) & (ev.gpu == 3)]
    pre = ev[ev.ts.astype("int64") < ep.end_ns]
    assert {63, 92} <= set(pre.xid) and set(pre.severity) == {"precursor"}
    fatal = ev[ev.ts.astype("int64") == ep.end_ns]
    assert list(fatal.xid) == [48] and list(fatal.severity) == ["fatal"]
    _, ue = _series(sim, "gpu", "ecc_uncorrected_volatile", 1, {"gpu": 3})
    assert ue[(ts >= ep.end_ns)][0] == 1


def test_nvlink_precursor(baseline):
    ep = _episode("nvlink", component=5)
    sim = _simulate([ep])
    for col in ("crc_flit_errors", "replay_errors", "crc_data_errors", "recovery_errors"):
        ts, v = _series(sim, "nvlink", col, 1, {"gpu": 5})
        v0 = _base(baseline, ts, "nvlink", col, 1, {"gpu": 5})
        w = _window(ts, ep)
        assert v[w][-1] - v0[w][-1] > 0, col
        assert np.array_equal(v[ts < ep.start_ns], v0[ts < ep.start_ns]), col
    ts, up = _series(sim, "nvlink", "links_up", 1, {"gpu": 5})
    assert up[ts < ep.start_ns].min() == 18 and up[_window(ts, ep)].min() == 17 and up[ts >= ep.end_ns][0] < 17
    ev = sim["events"].to_pandas()
    assert list(ev[(ev.node == TOPO.names[1]) & (ev.xid == 74)].ts.astype("int64")) == [ep.end_ns]


def test_ib_cable_precursor_saturates_and_the_port_goes_down(baseline):
    ep = _episode("ib_cable", component=2, lead_h=5.0)
    sim = _simulate([ep])
    where = {"device": "mlx5_2"}
    for col in ("symbol_error", "link_error_recovery", "local_link_integrity_errors", "port_rcv_errors",
                "local_ack_timeout_err", "out_of_sequence", "packet_seq_err", "link_downed"):
        ts, v = _series(sim, "rdma_port", col, 1, where)
        v0 = _base(baseline, ts, "rdma_port", col, 1, where)
        w = _window(ts, ep)
        assert v[w][-1] > v0[w][-1], col
    ts, sym = _series(sim, "rdma_port", "symbol_error", 1, where)
    assert sym.max() == 65535  # a 16-bit IB error counter sticks at the top, it does not wrap
    _, lli = _series(sim, "rdma_port", "local_link_integrity_errors", 1, where)
    assert lli.max() <= 15
    _, state = _series(sim, "rdma_port", "state", 1, where)
    assert set(state[_window(ts, ep)]) == {4} and state[ts >= ep.end_ns][0] == 1
    ev = sim["events"].to_pandas()
    ev = ev[(ev.node == TOPO.names[1]) & (ev.kind == "link_state")]
    assert (ev.ts.astype("int64") < ep.end_ns).any() and (ev.ts.astype("int64") == ep.end_ns).any()


def test_leaf_switch_shows_on_every_node_under_it(baseline):
    ep = _episode("leaf_switch", nodes=(0, 1), lead_h=2.0)
    sim = _simulate([ep])
    for node in (0, 1):
        for hca in ("mlx5_0", "mlx5_7"):
            ts, v = _series(sim, "rdma_port", "port_rcv_remote_physical_errors", node, {"device": hca})
            assert v[_window(ts, ep)][-1] > 100
            _, state = _series(sim, "rdma_port", "state", node, {"device": hca})
            assert state[ts >= ep.end_ns][0] == 1
    for node in (2, 3):  # the other leaf is untouched
        ts, v = _series(sim, "rdma_port", "port_rcv_remote_physical_errors", node, {"device": "mlx5_0"})
        v0 = _base(baseline, ts, "rdma_port", "port_rcv_remote_physical_errors", node, {"device": "mlx5_0"})
        assert np.array_equal(v, v0)


def test_thermal_pcie_straggler_nic_sram_and_scale_across(baseline):
    th = _episode("thermal", nodes=(0,), component=1, lead_h=3.0)
    pcie = _episode("gpu_off_bus_pcie", nodes=(1,), component=6, lead_h=3.0, variant=0)
    slow = _episode("straggler", nodes=(2,), lead_h=4.0)
    nic = _episode("nic", nodes=(3,), component=4, lead_h=3.0)
    sim = _simulate([th, pcie, slow, nic])
    ts, temp = _series(sim, "gpu", "temperature_c", 0, {"gpu": 1})
    w = _window(ts, th)
    assert temp[w][-1] - temp[ts < th.start_ns].mean() > 20
    _, reasons = _series(sim, "gpu", "clock_event_reasons", 0, {"gpu": 1})
    assert np.any(reasons[w].astype(np.uint64) & 0x40)
    _, lost = _series(sim, "gpu", "gpu_lost", 0, {"gpu": 1})
    assert not lost[ts < th.end_ns].any() and lost[ts >= th.end_ns][0]

    ts, rep = _series(sim, "gpu", "pcie_replay_counter", 1, {"gpu": 6})
    rep0 = _base(baseline, ts, "gpu", "pcie_replay_counter", 1, {"gpu": 6})
    assert rep[_window(ts, pcie)][-1] - rep0[_window(ts, pcie)][-1] > 100
    _, width = _series(sim, "gpu", "pcie_link_width", 1, {"gpu": 6})
    assert width[ts < pcie.start_ns].min() == 16 and width[_window(ts, pcie)].min() == 8

    # the straggler is slow against its job peer (node 3 shares job-001 with node 2)
    ts, util = _series(sim, "gpu", "utilization_pct", 2, {"gpu": 0})
    _, peer = _series(sim, "gpu", "utilization_pct", 3, {"gpu": 0})
    late = _window(ts, slow) & (ts >= slow.end_ns - HOUR)
    assert peer[late].mean() - util[late].mean() > 15
    assert abs(peer[ts < slow.start_ns].mean() - util[ts < slow.start_ns].mean()) < 3
    ts, tx = _series(sim, "rdma_port", "port_xmit_bytes", 2, {"device": "mlx5_0"})
    _, tx_peer = _series(sim, "rdma_port", "port_xmit_bytes", 3, {"device": "mlx5_0"})
    lw = _window(ts, slow) & (ts >= slow.end_ns - HOUR)
    assert np.diff(tx[lw]).mean() < 0.8 * np.diff(tx_peer[lw]).mean()

    ts, cqe = _series(sim, "rdma_port", "req_cqe_error", 3, {"device": "mlx5_4"})
    assert cqe[_window(ts, nic)][-1] > cqe[ts < nic.start_ns][-1]
    ev = sim["events"].to_pandas()
    assert (ev[(ev.node == TOPO.names[3]) & (ev.kind == "nic_error")].ts.astype("int64") < nic.end_ns).any()

    site = _episode("scale_across", nodes=(0, 1), lead_h=2.0)
    sim2 = _simulate([site])
    ts, rtt = _series(sim2, "path_probe", "rtt_ms", 0)
    w = _window(ts, site)
    assert rtt[w][-1] > rtt[ts < site.start_ns].mean() + 20
    _, loss = _series(sim2, "path_probe", "loss_ratio", 0)
    assert loss[ts >= site.end_ns][0] == 1.0
    ts, retr = _series(sim2, "host_net", "Tcp_RetransSegs", 0)
    retr0 = _base(baseline, ts, "host_net", "Tcp_RetransSegs", 0)
    assert retr[w][-1] - retr0[w][-1] > 1000


@pytest.mark.parametrize("mode", [m for m, spec in MODES.items() if not spec.precursor])
def test_no_precursor_leaves_no_trace_before_it_happens(baseline, mode):
    ep = _episode(mode, nodes=(1,), component=2, fail_h=7.0, variant=2)
    sim = _simulate([ep])
    for table in ("gpu", "nvlink", "rdma_port", "netdev", "host_net", "path_probe"):
        a, b = sim[table], baseline[table]
        before_a = a.filter(pc.less(a.column("ts").cast(pa.int64()), ep.end_ns))
        before_b = b.filter(pc.less(b.column("ts").cast(pa.int64()), ep.end_ns))
        assert before_a.equals(before_b), (mode, table)
    ev, ev0 = sim["events"], baseline["events"]
    assert ev.filter(pc.less(ev.column("ts").cast(pa.int64()), ep.end_ns)).equals(
        ev0.filter(pc.less(ev0.column("ts").cast(pa.int64()), ep.end_ns)))
    # after the failure the node is drained for repair: no rows until it is back
    ts, _ = _series(sim, "gpu", "power_w", 1, {"gpu": 0})
    assert not ((ts >= ep.end_ns + 15 * 60 * NS) & (ts < ep.repair_ns)).any()
    assert (ts >= ep.repair_ns).any()


def test_a_failure_stalls_its_job_until_it_restarts(baseline):
    ep = _episode("host", nodes=(2,), fail_h=5.0)  # node 3 shares job-001 with node 2
    sim = _simulate([ep])
    ts, tx = _series(sim, "rdma_port", "port_xmit_bytes", 3, {"device": "mlx5_0"})
    tx0 = _base(baseline, ts, "rdma_port", "port_xmit_bytes", 3, {"device": "mlx5_0"})
    step = np.diff(tx, prepend=tx[0])
    stalled = (ts > ep.end_ns) & (ts < ep.end_ns + 20 * 60 * NS)
    assert stalled.any() and step[stalled].max() < 0.05 * np.diff(tx0, prepend=tx0[0])[stalled].min()
    resumed = ts > ep.end_ns + 25 * 60 * NS
    assert step[resumed].min() > 0.5 * np.diff(tx0, prepend=tx0[0])[resumed].min()
    _, util = _series(sim, "gpu", "utilization_pct", 3, {"gpu": 0})
    assert util[stalled].max() < 10
    ts0, other = _series(sim, "rdma_port", "port_xmit_bytes", 0, {"device": "mlx5_0"})  # another job
    assert np.array_equal(other, _base(baseline, ts0, "rdma_port", "port_xmit_bytes", 0, {"device": "mlx5_0"}))


def test_a_node_the_job_has_left_fails_without_stalling_it():
    ep = _episode("host", nodes=(2,), fail_h=5.0)      # node 3 shares job-001 with node 2
    ts = T0 + np.arange(0, 12 * 60) * 60 * NS
    window = (ts > ep.end_ns) & (ts < ep.end_ns + 20 * 60 * NS)

    def node3_traffic(detach_at):
        model = ClusterModel(TOPO, seed=5, episodes=[ep], start_ns=T0, interval_s=60.0)
        model.detach(2, detach_at)
        t, tx = _series(model.generate(np.arange(TOPO.nodes), ts), "rdma_port", "port_xmit_bytes", 3,
                        {"device": "mlx5_0"})
        assert np.array_equal(t, ts)
        return np.diff(tx, prepend=tx[0])[1:], window[1:]

    step, win = node3_traffic(ep.end_ns - HOUR)         # evacuated an hour before it fails: no stall
    assert step[win].min() > 0.5 * np.median(step[~win])
    step, win = node3_traffic(ep.end_ns + HOUR)         # left after the failure: the job stalled
    assert step[win].max() < 0.05 * np.median(step[~win])


def test_repair_reboots_and_replaces(baseline):
    ep = _episode("hbm", variant=0, lead_h=2.0, fail_h=3.0, repair_h=2.0)
    sim = _simulate([ep])
    ts, ce = _series(sim, "gpu", "ecc_corrected_volatile", 1, {"gpu": 3})
    _, agg = _series(sim, "gpu", "ecc_corrected_aggregate", 1, {"gpu": 3})
    _, uuid = _series(sim, "gpu", "uuid", 1, {"gpu": 3})
    after = ts >= ep.repair_ns
    assert ce[after][0] < 5 and agg[after][0] < 5  # rebooted, and a new GPU
    assert uuid[after][0] != uuid[ts < ep.end_ns][0]
    _, agg_other = _series(sim, "gpu", "ecc_corrected_aggregate", 1, {"gpu": 2})
    _, vol_other = _series(sim, "gpu", "ecc_corrected_volatile", 1, {"gpu": 2})
    assert agg_other[after][0] >= agg_other[ts < ep.end_ns][-1]  # the other GPUs keep their lifetime counts
    assert vol_other[after][0] <= vol_other[ts < ep.end_ns][-1]
    ts, rx = _series(sim, "rdma_port", "port_rcv_bytes", 1, {"device": "mlx5_0"})
    assert rx[ts >= ep.repair_ns][0] < rx[ts < ep.end_ns][-1]  # HCA counters reset with the reboot


def test_recovery_episode_degrades_then_heals(baseline):
    ep = _episode("ib_cable", component=1, lead_h=6.0, fail_h=8.0, fails=False, peak=0.8)
    sim = _simulate([ep])
    ts, sym = _series(sim, "rdma_port", "symbol_error", 1, {"device": "mlx5_1"})
    sym0 = _base(baseline, ts, "rdma_port", "symbol_error", 1, {"device": "mlx5_1"})
    assert sym[ts < ep.end_ns][-1] > sym0[ts < ep.end_ns][-1]
    after = ts >= ep.end_ns
    assert np.array_equal(np.diff(sym[after]), np.diff(sym0[after])) or sym[after].min() == 65535
    _, state = _series(sim, "rdma_port", "state", 1, {"device": "mlx5_1"})
    assert set(state) == {4}
    assert len(ts) == len(_series(baseline, "rdma_port", "state", 1, {"device": "mlx5_1"})[0])


def test_batch_telemetry_agrees_with_the_incident_log(tmp_path):
    settings = SimSettings(topology=Topology(nodes=16, nodes_per_leaf=8, job_nodes=8), days=2.0, interval_s=120.0,
                           seed=4, faults=FaultSettings(rate_scale=400.0))
    run(settings, tmp_path)
    incidents = read_table(tmp_path, "incidents").to_pandas()
    assert len(incidents) >= 5
    events = read_table(tmp_path, "events").to_pandas()
    gpu = read_table(tmp_path, "gpu", columns=["ts", "node"]).to_pandas()
    fatal_xids = {"hbm": {48, 95, 64, 94}, "nvlink": {74}, "gpu_off_bus": {79}, "gsp": {119, 120}}
    for inc in incidents.itertuples():
        ts = inc.ts.value
        if inc.scope == "node":
            node_rows = gpu[gpu.node == inc.node].ts.astype("int64")
            gap = node_rows[(node_rows > ts + 15 * 60 * NS) & (node_rows < inc.repaired_at.value)]
            assert gap.empty, inc
            if inc.has_precursor:
                assert inc.precursor_start.value < ts
            else:
                assert pd_isnull(inc.precursor_start)
        at = events[(events.ts.astype("int64") == ts) & (events.node.isin(list(inc.affected_nodes)))]
        if inc.category == "gpu_hbm" or inc.category == "gpu_system_processor":
            assert set(at.xid.dropna().astype(int)) & (fatal_xids["hbm"] | fatal_xids["gsp"]), inc
        if inc.category == "network_switch_cable" or inc.category == "nic":
            assert (at.kind == "link_state").any(), inc


def pd_isnull(v):
    import pandas as pd

    return pd.isnull(v)


def test_xid92_follows_the_ecc_rate_not_the_sampling_interval():
    """The driver judges the corrected-ECC rate on its own window: a failing HBM raises about as many
    Xid 92 events sampled every 5 or 15 s as every 60 s (judged at every sample: 16, 104 and 501)."""
    counts = {}
    for interval_s in (60.0, 15.0, 5.0):
        events = _simulate([_episode("hbm", lead_h=6.0, fail_h=10.0)], interval_s=interval_s)["events"]
        xid92 = events.filter(pc.equal(events.column("xid"), 92))
        assert xid92.num_rows and set(xid92.column("node").to_pylist()) <= {"node-001", "node-002"}
        counts[interval_s] = xid92.num_rows
    assert counts[15.0] <= 1.5 * counts[60.0] and counts[5.0] <= 1.5 * counts[60.0], counts
