"""Worlds: the clean world is what it always was; a random world is deterministic per seed, differs by pod,
and each precursor shape, signature and collection nuisance shows in the columns docs/simulator.md says."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from foreshock import cli
from foreshock.dataset import read_table
from foreshock.simulator.batch import SimSettings, run
from foreshock.simulator.faults import HOUR, NS, Episode, FaultSettings, schedule
from foreshock.simulator.model import ClusterModel
from foreshock.simulator.scenarios import (KNOBS, SHAPES, SIGNATURES, World, WorldError, knob_table,
                                           shape_intensity, shape_params)
from foreshock.simulator.topology import Topology

T0 = 1_767_571_200 * NS  # 2026-01-05T00:00:00Z
TABLES = ("gpu", "nvlink", "rdma_port", "netdev", "host_net", "path_probe", "events", "inventory", "incidents")
# The clean world's tables, column names and values: its data must not move by a bit. A column added to
# schema v1 moves the digest too; the values of the columns before it must then be shown unchanged.
CLEAN_GOLDEN = "0248175a3f5d1966abfad6b91198dfe4227b17c13bef02b1c72de9fd9a87a5f5"
TOPO = Topology(nodes=4, nodes_per_leaf=2, job_nodes=2, spare_fraction=0.0)
QUIET = {"ts_jitter_s": 0, "missing_share": 0, "outages_per_node_day": 0, "reloads_per_node_day": 0,
         "pma_clears_per_node_day": 0, "gpus_per_node": 8, "hcas_per_node": 8, "job_epoch_h": 0}


def _digest(path) -> str:
    h = hashlib.sha256()
    for table in TABLES:
        data = read_table(path, table)
        h.update(table.encode())
        for name in data.column_names:
            h.update(name.encode())
            h.update(repr(data.column(name).to_pylist()).encode())
    return h.hexdigest()


def test_the_clean_world_is_unchanged(tmp_path):
    settings = SimSettings(topology=Topology(nodes=6, nodes_per_leaf=3, job_nodes=3, sites=2), days=0.5,
                           interval_s=120.0, seed=3, faults=FaultSettings(rate_scale=3000.0))
    run(settings, tmp_path, workers=1)
    assert _digest(tmp_path) == CLEAN_GOLDEN


def _random(seed=2, **kw):
    return SimSettings(topology=Topology(nodes=10, nodes_per_leaf=2, job_nodes=4), days=0.1, interval_s=60.0,
                       seed=seed, faults=FaultSettings(rate_scale=1500.0), world="random", **kw)


def test_a_random_world_is_a_function_of_its_seed_and_its_pods_differ(tmp_path):
    run(_random(), tmp_path / "a", workers=1)
    run(_random(), tmp_path / "b", workers=1)
    run(_random(seed=3), tmp_path / "c", workers=1)
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    assert _digest(tmp_path / "a") != _digest(tmp_path / "c")
    inv = read_table(tmp_path / "a", "inventory").to_pandas()
    assert {4, 8} <= set(inv.gpus) and len(set(zip(inv.gpus, inv.hcas))) >= 2
    gpu = read_table(tmp_path / "a", "gpu").to_pandas()
    for node, n in zip(inv.node, inv.gpus):
        assert gpu[gpu.node == node].gpu.max() == n - 1  # the rows follow the node's type
    nvl = read_table(tmp_path / "a", "nvlink").to_pandas()
    assert set(nvl.links_total.dropna()) <= {12, 18}
    incidents = read_table(tmp_path / "a", "incidents").to_pandas()
    precursor = incidents[incidents.has_precursor]
    assert len(precursor) and all(re.fullmatch(r"[a-z_]+: [a-z0-9_+]+ / [a-z]+( / faint)?", d)
                                  for d in precursor.description)
    # the same knobs, drawn again for the same (seed, pod), give the same world
    w1, w2 = _random().make_world(), _random().make_world()
    for k in KNOBS:
        if k.level == "pod":
            assert np.array_equal(w1.values[k.name], w2.values[k.name]), k.name


def test_a_share_of_the_random_worlds_pods_is_the_clean_world():
    """The family holds the clean world: some pods keep every knob clean, their episodes ramp with the
    clean signature; the other pods' draws are those they would have had anyway."""
    from foreshock.simulator import scenarios as sc

    world = sc.World("random", seed=5, n_pods=40)
    clean = world.values["clean_pod"]
    assert 0 < clean.sum() < len(clean)
    for k in sc.KNOBS:
        if k.level == "pod":
            assert all(world.pod(k.name, p) == k.clean for p in np.flatnonzero(clean)), k.name
    messy = int(np.flatnonzero(~clean)[0])
    assert world.pod("lead_sigma", messy) != sc.KNOB["lead_sigma"].clean
    draws = world.episode_draws("hbm", 1234, int(np.flatnonzero(clean)[0]), 3600.0)
    assert (draws["shape"], draws["signature"], draws["faint"]) == ("ramp", "ecc", False)
    none = sc.World("random", seed=5, n_pods=40, knobs={"clean_pod_share": 0.0})
    assert not none.values["clean_pod"].any()
    assert none.pod("lead_sigma", messy) == world.pod("lead_sigma", messy)


def test_a_knob_set_in_a_scenario_holds_in_every_pod_and_leaves_the_others(tmp_path):
    world = World("random", seed=2, n_pods=4, knobs={"gpus_per_node": 4, "site_temp_amp_c": [5, 5]})
    free = World("random", seed=2, n_pods=4)
    assert set(world.values["gpus_per_node"]) == {4} and set(world.values["site_temp_amp_c"]) == {5.0}
    assert np.array_equal(world.values["chronic_scale"], free.values["chronic_scale"])
    lossy = World("clean", seed=2, n_pods=TOPO.n_leaves, knobs={"missing_share": 0.5})
    rows = _simulate([], hours=2.0, world=lossy)["gpu"].num_rows
    assert 0.4 < rows / (4 * 8 * 120) < 0.6  # a knob set in the clean world takes effect there too
    with pytest.raises(WorldError, match="gpus_per_nod"):
        World("random", knobs={"gpus_per_nod": 4})
    with pytest.raises(WorldError, match="missing_share"):
        World("random", knobs={"missing_share": [0.5, 0.1]})
    scenario = tmp_path / "s.toml"
    scenario.write_text('[simulate]\nnodes = 4\nnodes_per_leaf = 2\ndays = 0.05\nworld = "random"\n'
                        '[simulate.knobs]\ngpus_per_node = 4\n')
    assert cli.main(["simulate", "--scenario", str(scenario), "--out", str(tmp_path / "ds")]) == 0
    assert set(read_table(tmp_path / "ds", "inventory").column("gpus").to_pylist()) == {4}
    bad = tmp_path / "bad.toml"
    bad.write_text('[simulate]\n[simulate.knobs]\nwarp_drive = 1\n')
    assert cli.main(["simulate", "--scenario", str(bad), "--out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()


def test_the_random_world_widens_leads_and_uses_the_infinitehbd_repair_times():
    topo = Topology(nodes=256)
    start, end = T0, T0 + 30 * 24 * HOUR
    clean = schedule(topo, start, end, 4, FaultSettings(rate_scale=20.0))
    # every pod messy: a clean pod keeps the clean world's repair times
    rand = schedule(topo, start, end, 4, FaultSettings(rate_scale=20.0),
                    World("random", seed=4, n_pods=16, knobs={"clean_pod_share": 0.0}))
    fails = [e for e in rand if e.fails]
    # the same stream: the same failures at the same times on the same nodes, but for those that another
    # repair time lets happen or not (a node in repair cannot fail)
    same = {(e.end_ns, e.nodes) for e in fails} & {(e.end_ns, e.nodes) for e in clean if e.fails}
    assert len(same) > 0.8 * len(fails)
    repair_h = np.array([(e.repair_ns - e.end_ns) / HOUR for e in fails])
    assert 12 < np.median(repair_h) < 35 and np.quantile(repair_h, 0.9) > 150
    leads = np.array([(e.end_ns - e.start_ns) / HOUR for e in fails if e.has_precursor])
    assert leads.min() < 10 / 60 and leads.max() > 20
    shapes = {e.extra["shape"] for e in fails if e.has_precursor}
    assert shapes == set(SHAPES)
    assert any(e.extra.get("faint") and e.peak < 0.31 for e in fails)
    lookalikes = {e.mode for e in rand if not e.fails}
    assert {"hbm", "ib_cable", "thermal", "gpu_off_bus_pcie", "nvlink"} <= lookalikes


def _episode(mode, *, node=1, component=3, lead_h=6.0, fail_h=9.0, fails=True, **extra):
    fail = T0 + int(fail_h * HOUR)
    start = fail - int(lead_h * HOUR)
    ep = Episode(f"t-{mode}-{node}", mode, "test" if fails else None, (node,), component, start, fail, fails,
                 fail + int(3 * HOUR) if fails else 0, 1.0, "", 0, 777)
    ep.extra.update(extra)
    return ep


def _simulate(episodes, hours=12.0, world=None, topo=TOPO):
    model = ClusterModel(topo, seed=5, episodes=episodes, start_ns=T0, interval_s=60.0, world=world)
    ts = T0 + np.arange(0, int(hours * 60)) * 60 * NS
    parts = [model.generate(np.arange(topo.nodes), chunk) for chunk in np.array_split(ts, 3)]
    return {name: pa.concat_tables([p[name] for p in parts if name in p]) for name in parts[0]}


def _series(tables, table, column, node, where=None, topo=TOPO):
    data = tables[table].filter(pc.equal(tables[table].column("node"), topo.names[node]))
    for k, v in (where or {}).items():
        data = data.filter(pc.equal(data.column(k), v))
    data = data.sort_by("ts")
    return data.column("ts").cast(pa.int64()).to_numpy(), data.column(column).to_numpy(zero_copy_only=False)


def _rate(ts, v, mask):
    return np.diff(v[mask]).sum() / max((ts[mask][-1] - ts[mask][0]) / NS, 1.0)


def test_a_step_holds_a_flat_rate_where_a_ramp_accelerates():
    step = _episode("hbm", signature="ecc_step", shape="step", shape_params=(0.2,))
    ramp = _episode("hbm", node=2, signature="ecc", shape="ramp")
    sim = _simulate([step, ramp])
    for ep, node, lo, hi in ((step, 1, 0.7, 1.4), (ramp, 2, 2.0, 20.0)):
        ts, ce = _series(sim, "gpu", "ecc_corrected_volatile", node, {"gpu": 3})
        x = (ts - ep.start_ns) / (ep.end_ns - ep.start_ns)
        early, late = _rate(ts, ce, (x > 0.25) & (x < 0.6)), _rate(ts, ce, (x >= 0.6) & (x < 1.0))
        assert early > 0.1 and lo < late / early < hi, (ep.extra["shape"], early, late)


def test_bursts_densify_with_quiet_gaps_and_other_shapes_rise():
    span_s = 6 * 3600.0
    params = shape_params("bursts", np.random.default_rng(1), span_s)
    x = np.linspace(0, 1, 3601)
    b = shape_intensity("bursts", x, params)
    assert set(np.unique(b)) == {0.0, 1.0} and b[x < 0.5].sum() < b[x >= 0.5].sum()
    ep = _episode("gpu_off_bus_pcie", signature="replay_bursts", shape="bursts", shape_params=params)
    sim = _simulate([ep])
    ts, rep = _series(sim, "gpu", "pcie_replay_counter", 1, {"gpu": 3})
    w = (ts >= ep.start_ns) & (ts < ep.end_ns)
    d = np.diff(rep[w])
    assert (d == 0).mean() > 0.5 and d.max() > 30  # quiet gaps between dense bursts
    for shape in ("exponential", "drift"):
        y = shape_intensity(shape, x, shape_params(shape, np.random.default_rng(1), span_s))
        assert y[0] == 0 and abs(y[-1] - 1) < 1e-9 and np.all(np.diff(y) >= 0)


def test_signatures_show_in_their_columns():
    hbm = _episode("hbm", node=0, signature="remaps+temp", shape="ramp", hbm_temp_c=8.0)
    x8 = _episode("gpu_off_bus_pcie", node=1, component=2, signature="x8", shape="drift")
    cable = _episode("ib_cable", node=2, component=1, signature="recoveries", shape="ramp")
    base = _simulate([])
    sim = _simulate([hbm, x8, cable])
    ts, t = _series(sim, "gpu", "hbm_temperature_c", 0, {"gpu": 3})
    _, t0 = _series(base, "gpu", "hbm_temperature_c", 0, {"gpu": 3})
    late = (ts > hbm.end_ns - HOUR) & (ts < hbm.end_ns)
    assert (t - t0[:len(t)])[late].mean() > 4
    _, remap = _series(sim, "gpu", "remapped_rows_correctable", 0, {"gpu": 3})
    _, ce = _series(sim, "gpu", "ecc_corrected_volatile", 0, {"gpu": 3})
    w = (ts >= hbm.start_ns) & (ts < hbm.end_ns)
    assert remap[w][-1] > remap[w][0] and ce[w][-1] - ce[w][0] < 1000  # little corrected ECC
    ts, width = _series(sim, "gpu", "pcie_link_width", 1, {"gpu": 2})
    x = (ts - x8.start_ns) / (x8.end_ns - x8.start_ns)
    assert set(width[(x > 0.2) & (x < 1)]) == {8} and set(width[x <= 0]) == {16}
    ts, lrec = _series(sim, "rdma_port", "link_error_recovery", 2, {"device": "mlx5_1"})
    _, sym = _series(sim, "rdma_port", "symbol_error", 2, {"device": "mlx5_1"})
    _, downed = _series(sim, "rdma_port", "link_downed", 2, {"device": "mlx5_1"})
    w = (ts >= cable.start_ns) & (ts < cable.end_ns)
    assert lrec[w][-1] - lrec[w][0] > 10 and downed[w][-1] > downed[w][0]
    assert sym[w][-1] - sym[w][0] < 0.05 * 30 * (cable.end_ns - cable.start_ns) / NS / 3  # few symbol errors


def test_a_job_slow_straggler_slows_its_whole_job_and_runs_hot():
    slow = _episode("straggler", node=0, signature="job_slow", shape="ramp")
    base, sim = _simulate([]), _simulate([slow])
    late = None
    drops = {}
    for node in (0, 1, 2):  # 0 and 1 share job-000; 2 runs another job
        ts, tx = _series(sim, "rdma_port", "port_xmit_bytes", node, {"device": "mlx5_0"})
        _, tx0 = _series(base, "rdma_port", "port_xmit_bytes", node, {"device": "mlx5_0"})
        late = (ts > slow.end_ns - HOUR) & (ts < slow.end_ns)
        drops[node] = 1 - np.diff(tx[late]).mean() / np.diff(tx0[:len(tx)][late]).mean()
    assert drops[0] > 0.15 and abs(drops[0] - drops[1]) < 0.03 and abs(drops[2]) < 0.01
    ts, bits = _series(sim, "gpu", "clock_event_reasons", 0, {"gpu": 0})
    assert (bits[(ts > slow.end_ns - HOUR) & (ts < slow.end_ns)] & 0x8).all()
    _, bits1 = _series(sim, "gpu", "clock_event_reasons", 1, {"gpu": 0})
    assert not (bits1 & 0x8).any()  # the peers slow down with it but show nothing themselves


def test_nodes_of_one_job_carry_unequal_but_steady_shares_of_its_traffic():
    topo = Topology(nodes=8, nodes_per_leaf=4, job_nodes=4, spare_fraction=0.0)
    knobs = dict(QUIET, load_spread=0.06, load_diurnal=0, job_gap_share=0)
    rates = {}
    for imbalance in (0.0, 0.25):
        world = World("random", seed=5, n_pods=topo.n_leaves, knobs=dict(knobs, job_traffic_imbalance=imbalance))
        sim = _simulate([], hours=6.0, world=world, topo=topo)
        per_node = []
        for node in range(4):                   # job-000
            ts, tx = _series(sim, "rdma_port", "port_xmit_bytes", node, {"device": "mlx5_0"}, topo)
            per_node.append(np.diff(tx)[30:] / np.diff(ts)[30:])
        rates[imbalance] = np.array(per_node)
    share = rates[0.25].mean(axis=1) / rates[0.0].mean(axis=1)
    assert np.allclose(rates[0.0].mean(axis=1), rates[0.0].mean(), rtol=1e-3)   # the clean value: equal
    assert share.max() - share.min() > 0.05 and (np.abs(share - 1.0) <= 0.25 + 1e-3).all()
    # a node's share holds for the job's run: its rate moves with its job, not by itself
    ratio = rates[0.25] / rates[0.0]
    assert np.allclose(ratio, ratio[:, :1], rtol=1e-3)


def test_a_pma_clear_and_a_driver_reload_reset_counters_without_a_failure():
    knobs = dict(QUIET, pma_clears_per_node_day=8.0, reloads_per_node_day=4.0)
    world = World("random", seed=5, n_pods=TOPO.n_leaves, knobs=knobs)
    noisy = _episode("ib_cable", node=1, component=3, lead_h=20.0, fail_h=30.0, fails=False,
                     signature="symbols", shape="drift")
    sim = _simulate([noisy], hours=24.0, world=world)
    _, reloads, clears = zip(*(world.collection_events(1, 0, day) for day in range(int(T0 // (24 * HOUR)) - 1,
                                                                                  int(T0 // (24 * HOUR)) + 1)))
    clears = [t for c in clears for t in c if T0 < t < T0 + 24 * HOUR]
    reloads = [t for r in reloads for t in r if T0 < t < T0 + 24 * HOUR]
    assert clears and reloads
    ts, sym = _series(sim, "rdma_port", "symbol_error", 1, {"device": "mlx5_3"})
    _, data = _series(sim, "rdma_port", "port_xmit_bytes", 1, {"device": "mlx5_3"})
    sym, data = sym.astype(np.int64), data.astype(np.int64)
    dropped = np.flatnonzero(np.diff(sym) < 0) + 1
    # back to about 0: at most the minute's errors since the clear (30/s at the cable's worst)
    assert len(dropped) >= 2 and (sym[dropped] < 60 * 30).all()
    for t in clears:  # a clear leaves the data counters alone; a reload restarts them too
        i = np.searchsorted(ts, t)
        if not any(abs(r - t) < 120 * NS for r in reloads):
            assert data[i] > data[i - 1]
    for t in reloads:
        i = np.searchsorted(ts, t)
        assert data[i] < data[i - 1] and data[i] < data.max() / 10


def test_a_collector_outage_removes_the_nodes_rows_for_its_span():
    world = World("random", seed=5, n_pods=TOPO.n_leaves, knobs=dict(QUIET, outages_per_node_day=8.0))
    sim = _simulate([], hours=24.0, world=world)
    day = int(T0 // (24 * HOUR))
    outages = [o for d in (day - 1, day) for o in world.collection_events(2, 1, d)[0]]
    outages = [(a, b) for a, b in outages if b > T0 + 120 * NS and a < T0 + 23 * HOUR]
    assert outages
    for table in ("gpu", "rdma_port", "netdev", "host_net"):
        ts, _ = _series(sim, table, "node", 2)
        for a, b in outages:
            assert not ((ts >= a) & (ts < b)).any(), table
        assert (ts < outages[0][0]).any() or (ts >= outages[0][1]).any()
    ts1, _ = _series(sim, "gpu", "node", 1)
    assert len(ts1) == 8 * 24 * 60 or any(world.collection_events(1, 0, d)[0] for d in (day - 1, day))


def test_idle_gpus_drop_their_link_generation_and_the_room_follows_the_day():
    topo = Topology(nodes=4, nodes_per_leaf=2, job_nodes=2, spare_fraction=0.25)
    world = World("random", seed=5, n_pods=topo.n_leaves,
                  knobs=dict(QUIET, idle_pcie_downtrain=1, pcie_gen=4, site_temp_amp_c=5.0, job_gap_share=0,
                              load_spread=0.06, load_diurnal=0))
    sim = _simulate([], hours=24.0, world=world, topo=topo)
    spare = int(np.flatnonzero(topo.job_of < 0)[0])
    _, gen = _series(sim, "gpu", "pcie_link_gen", spare, {"gpu": 0}, topo)
    _, gen_max = _series(sim, "gpu", "pcie_link_gen_max", spare, {"gpu": 0}, topo)
    assert set(gen) == {1} and set(gen_max) == {4}
    ts, temp = _series(sim, "gpu", "temperature_c", 0, {"gpu": 0}, topo)
    hour = (ts / NS / 3600) % 24
    assert temp[(hour > 13) & (hour < 17)].mean() - temp[(hour > 1) & (hour < 5)].mean() > 6


def test_the_docs_list_every_knob_of_the_catalogue():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "simulator.md").read_text()
    assert knob_table() in doc
    for knob in KNOBS:
        assert f"`{knob.name}`" in doc, knob.name
    for mode, signatures in SIGNATURES.items():
        assert all(f"`{s}`" in doc for s in signatures), mode


def test_jobs_end_and_start_on_other_nodes_and_the_inventory_follows(tmp_path):
    settings = SimSettings(topology=Topology(nodes=10, nodes_per_leaf=5, job_nodes=4, spare_fraction=0.2),
                           days=1.0, interval_s=300.0, seed=4, faults=FaultSettings(rate_scale=0.0),
                           world="random", knobs=dict(QUIET, job_epoch_h=12, job_gap_share=0))
    run(settings, tmp_path, workers=1)
    inv = read_table(tmp_path, "inventory").to_pandas()
    assert len(set(inv.ts)) == 2 and len(inv) == 20
    jobs = inv.pivot(index="node", columns="ts", values="job")
    assert set(jobs.iloc[:, 0].dropna()).isdisjoint(jobs.iloc[:, 1].dropna())  # new jobs at the change
    gpu = read_table(tmp_path, "gpu", columns=["ts", "node", "utilization_pct"]).to_pandas()
    gpu["late"] = gpu.ts >= jobs.columns[1]
    moved = 0
    for node, (before, after) in jobs.iterrows():
        mine = gpu[gpu.node == node]
        util = (mine[~mine.late].utilization_pct.mean(), mine[mine.late].utilization_pct.mean())
        for label, u in zip((before, after), util):
            assert (u > 50) if isinstance(label, str) else (u < 5), (node, label, u)
        moved += isinstance(before, str) != isinstance(after, str)
    assert moved >= 2  # nodes moved between a job and the spares


@pytest.mark.parametrize("mode", ["gpu_off_bus", "host"])
def test_in_a_random_world_a_fault_without_a_precursor_leaves_no_trace_before_it(mode):
    world = World("random", seed=5, n_pods=TOPO.n_leaves, knobs={"job_epoch_h": 4})
    ep = _episode(mode, node=1, component=2, lead_h=0.0, fail_h=8.0)
    base, sim = _simulate([], world=world), _simulate([ep], world=world)
    for table in ("gpu", "nvlink", "rdma_port", "netdev", "host_net"):
        before = [t.filter(pc.less(t.column("ts").cast(pa.int64()), ep.end_ns)) for t in (base[table], sim[table])]
        assert before[0].equals(before[1]), table
    after = [t.filter(pc.greater(t.column("ts").cast(pa.int64()), ep.end_ns + HOUR)) for t in (base["gpu"], sim["gpu"])]
    assert not after[0].equals(after[1])
