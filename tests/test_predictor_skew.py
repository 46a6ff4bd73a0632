"""Train/serve skew is a defect: the online scorer, fed the same samples, computes the offline features."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from foreshock import dataset
from foreshock import fabric
from foreshock import schema as sch
from foreshock.collectors.sxid import parse_sxid
from foreshock.predictor import features as ft
from foreshock.predictor import offline, online, registry, synthetic

STEP_NS = ft.STEP_SECONDS * 1_000_000_000
NODES = ["node-a", "node-b", "node-c", "node-d"]
STEPS = 45


# Two ranks a node in job-1, node-b's first 1.5x slower; job-2 one rank alone (never judged); job-3's
# rank 1 measures no compute part (its whole step is compared). The steps end around minute boundaries,
# so some training steps' ranks fall into two feature steps.
PLACEMENT = {"job-1": [(n, 2 * i + k) for i, n in enumerate(NODES) for k in (0, 1)],
             "job-2": [("node-d", 0)],
             "job-3": [("node-a", 0), ("node-b", 1), ("node-c", 2)]}


def _bad_step_times(node: str) -> pa.Table:
    """Rows the step-time signal skips: a negative and a NaN duration, a compute part over the step."""
    t0 = synthetic.T0_NS + 5 * 60 * 1_000_000_000
    return sch.to_table("step_times", [
        {"ts": pd.Timestamp(t0 + k, tz="UTC"), "node": node, "job": "job-1", "rank": 2, "step": 10_000 + k,
         "step_seconds": total, "compute_seconds": compute}
        for k, (total, compute) in enumerate(((-1.0, None), (float("nan"), None), (1.0, 2.0)))])


SXID_LINES = {   # collectors/sxid.py's format (real lines: examples/kmsg/sxid-lines.txt)
    "nonfatal": "nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error",
    "fatal": "nvidia-nvswitch0: SXid (PCI:0000:a9:00.0): 20034, Fatal, Link 30 LTSSM Fault Up",
    "detail": "nvidia-nvswitch0: SXid (PCI:0000:a9:00.0): 20034, Severity 1 Engine instance 30 Sub-engine instance 00",
    "correctable": "nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 99999, Correctable, Link 07 a number no table knows",
}


def _with_fabric(gpu: pa.Table, node: str) -> pa.Table:
    """The gpu rows with NVML fabric information as the collector writes it (fabric.gpu_columns): node-a
    registered and healthy; node-b's GPU 5 recovering from an access timeout from sample 10 to 29 and
    with degraded bandwidth from sample 15; node-c without fabric information (no NVSwitch behind its
    GPUs); node-d's GPU 2 still registering for its first 10 samples, one row of a state nvml.h does not
    define and one that holds NOT_SUPPORTED (no fabric: unknown, not malformed)."""
    if node == "node-c":
        return gpu
    g = gpu.column("gpu").to_numpy()
    sample = np.arange(gpu.num_rows) // (g.max() + 1)
    rows = []
    for k, s_ in zip(g.tolist(), sample.tolist()):
        mask, state = fabric.HEALTHY_MASK, fabric.STATE_COMPLETED
        if node == "node-b" and k == 5 and 10 <= s_ < 30:
            mask = fabric.with_unhealthy(mask, "fabric_access_timeout_recovery")
        if node == "node-b" and k == 5 and s_ >= 15:
            mask = fabric.with_unhealthy(mask, "fabric_degraded_bw")
        if node == "node-d" and k == 2 and s_ < 10:
            state = fabric.STATE_IN_PROGRESS
        rows.append(fabric.gpu_columns(fabric.FabricInfo(bytes(range(1, 17)), 0, 7, state, mask, 1)))
    if node == "node-d":
        rows[20 * 8] = dict(rows[20 * 8], fabric_state=7)
        rows[21 * 8] = dict(rows[21 * 8], fabric_state=fabric.STATE_NOT_SUPPORTED)
    for col in fabric.GPU_COLUMNS:
        gpu = gpu.set_column(gpu.schema.get_field_index(col), col,
                             pa.array([r[col] for r in rows], gpu.schema.field(col).type))
    return gpu


def _sxids(node: str, events: pa.Table) -> pa.Table:
    """node-b: a non-fatal SXid every third sample from sample 12, then one fatal SXid with its detail
    line, and a correctable one (counted as non-fatal); node-d: an SXid row of a severity the collector
    never writes and one without its code (skipped and counted)."""
    t0 = synthetic.T0_NS + 3_000_000_000
    at = []
    if node == "node-b":
        at = [(t0 + i * 20_000_000_000, parse_sxid(SXID_LINES["nonfatal"])) for i in range(12, 40, 3)]
        at += [(t0 + 40 * 20_000_000_000 + k, parse_sxid(SXID_LINES[w]))
               for k, w in enumerate(("fatal", "detail", "correctable"))]
    elif node == "node-d":
        bad = parse_sxid(SXID_LINES["nonfatal"])
        at = [(t0 + 200_000_000_000, dict(bad, severity="bogus")), (t0 + 220_000_000_000, dict(bad, sxid=None))]
    rows = [dict(r, ts=pd.Timestamp(ts, tz="UTC"), node=node, source="kmsg") for ts, r in at]
    return pa.concat_tables([events, sch.to_table("events", rows)]) if rows else events


@pytest.fixture(scope="module")
def telemetry():
    tables = {n: synthetic.node_tables(n, STEPS, seed=i, ecc_ramp_from=10 if n == "node-b" else None,
                                       wrap_port_counter=True, interval_s=20)
              for i, n in enumerate(NODES)}
    steps = synthetic.step_times(PLACEMENT, STEPS * 20, slow={("job-1", 2): 1.5}, unmeasured={("job-3", 1)},
                                 t0_ns=synthetic.T0_NS - 25_000_000)
    for n in NODES:
        own = steps.filter(pc.equal(steps.column("node"), n))
        tables[n]["step_times"] = pa.concat_tables([own, _bad_step_times(n)]) if n == "node-c" else own
        tables[n]["gpu"] = _with_fabric(tables[n]["gpu"], n)
        tables[n]["events"] = _sxids(n, tables[n]["events"])
    inv = synthetic.inventory(NODES, leaf_of=lambda i: f"leaf-{i // 2}", job_of=lambda i: "job-1")
    return tables, inv


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "numpy"])
def test_online_features_equal_offline_features(tmp_path, telemetry, kernel, tiny_model_dir):
    tables, inv = telemetry
    root = tmp_path / "data"
    w = dataset.DatasetWriter(root, fsync=False)
    for per_node in tables.values():
        for name, t in per_node.items():
            w.write_table(name, t)
    w.write_table("inventory", inv)
    with offline.FeatureBuilder(root) as fb:
        off = {nf.node: nf for nf in fb}
        assert {r: fb.step_time_stats[r] for r in ("bad_step_seconds", "bad_compute_seconds")} == \
            {"bad_step_seconds": 2, "bad_compute_seconds": 1}
        assert fb.fabric_stats == FABRIC_MALFORMED
    assert set(off) == set(NODES)

    model = registry.load_model(tiny_model_dir(tmp_path / "m"))
    scorer = online.OnlineScorer(model, explain_top=0, kernel=kernel)
    scorer.ingest("inventory", inv)
    rng = np.random.default_rng(7)
    first = off["node-a"].steps[0]
    compared = 0
    for step in range(first, first + STEPS * 20 // 60):
        lo, hi = step * STEP_NS, (step + 1) * STEP_NS
        # every table of every node for this step, in two batches of mixed nodes, rows shuffled
        # within each (an entity's rows must only arrive in time order across batches)
        for name in tables["node-a"]:
            for group in (NODES[::2], NODES[1::2]):
                parts = []
                for n in group:
                    t = tables[n][name]
                    ts = pc.cast(t.column("ts"), pa.int64())
                    parts.append(t.filter(pc.and_(pc.greater_equal(ts, lo), pc.less(ts, hi))))
                batch = pa.concat_tables(parts)
                scorer.ingest(name, batch.take(pa.array(rng.permutation(batch.num_rows))))
        scorer.score(hi + 6_000_000_000)  # past the 5 s grace
        for n in NODES:
            nf = off[n]
            row = np.searchsorted(nf.steps, step)
            on = scorer.features_of(n)
            np.testing.assert_array_equal(on, nf.X[row], err_msg=f"{n} step {step - first}")
            compared += 1
    assert compared >= 4 * 14
    # the comparison is not vacuous: the sick node's ECC and the peer features are live
    sick = off["node-b"].X[-1]
    assert sick[ft.FEATURE_NAMES.index("ecc_sbe_30m")] > 0
    assert np.isfinite(sick[ft.FEATURE_NAMES.index("traffic_vs_job_5m")])
    assert np.isfinite(sick[ft.FEATURE_NAMES.index("leaf_peers_link_err_frac_30m")])
    # ... and so are the step times: node-b's slow rank against its job, the others as fast as theirs
    col = {n: ft.FEATURE_NAMES.index(n) for n in ("steptime_vs_job_30m", "steptime_slow_share_30m")}
    assert 1.45 < sick[col["steptime_vs_job_30m"]] < 1.55
    assert sick[col["steptime_slow_share_30m"]] == 1.0   # its slow rank in job-1 (not its other one, nor job-3's)
    assert 0.98 < off["node-a"].X[-1, col["steptime_vs_job_30m"]] < 1.03
    assert off["node-a"].X[-1, col["steptime_slow_share_30m"]] == 0.0
    assert scorer.stats["step_times_bad_step_seconds"] == 2 and scorer.stats["late_step_times"] == 0
    # ... and so is the fabric: node-b's degraded GPU, the registering GPU of node-d, the SXids by class
    last = {n: dict(zip(ft.FEATURE_NAMES[ft.FABRIC_COLS], off[n].X[-1, ft.FABRIC_COLS].tolist())) for n in NODES}
    b = last["node-b"]
    assert b["fabric_degraded_bw_now"] == 1.0 and b["fabric_degraded_bw_max30m"] == 1.0
    assert b["fabric_access_timeout_recovery_now"] == 0.0 and b["fabric_access_timeout_recovery_max30m"] == 1.0
    assert b["fabric_registration_failed_now"] == 0.0 and b["fabric_incorrect_configuration_now"] == 0.0
    assert b["sxid_nonfatal_30m"] == 11 and b["sxid_fatal_30m"] == 1   # 10 and the correctable; the detail line is no SXid
    assert b["minutes_since_sxid_fatal"] == 2 and b["minutes_since_sxid_nonfatal"] == 2
    assert np.isnan(b["sxid_fatal_1m"])   # no events rows in the last step: unknown, as the Xid counts
    assert last["node-a"]["fabric_degraded_bw_now"] == 0.0 and last["node-a"]["minutes_since_sxid_fatal"] == ft.SINCE_CAP_MINUTES
    assert all(np.isnan(v) for k, v in last["node-c"].items() if k.startswith("fabric_"))   # no fabric info: unknown
    d = last["node-d"]
    assert d["fabric_registration_failed_now"] == 0.0 and d["fabric_registration_failed_max30m"] == 1.0
    assert d["sxid_nonfatal_30m"] == 0 and d["sxid_fatal_30m"] == 0            # the malformed rows count as none
    assert {r: scorer.stats[r] for r in FABRIC_MALFORMED} == FABRIC_MALFORMED


FABRIC_MALFORMED = {"sxid_unknown_class": 1, "sxid_no_code": 1, "fabric_state_undefined": 1}


def _offline_and_online(tmp_path, tables: dict[str, pa.Table], inv: pa.Table, model, kernel: bool):
    """Every node's offline features of `tables` (any nodes) and the online scorer fed the same rows a
    step at a time (mixed nodes, shuffled), compared at every step."""
    root = tmp_path / "data"
    w = dataset.DatasetWriter(root, fsync=False)
    for name, t in tables.items():
        w.write_table(name, t)
    w.write_table("inventory", inv)
    with offline.FeatureBuilder(root) as fb:
        off = {nf.node: nf for nf in fb}
    scorer = online.OnlineScorer(model, explain_top=0, kernel=kernel)
    scorer.ingest("inventory", inv)
    rng = np.random.default_rng(5)
    first = min(int(nf.steps[0]) for nf in off.values())
    last = max(int(nf.steps[-1]) for nf in off.values())
    for step in range(first, last + 1):
        lo, hi = step * STEP_NS, (step + 1) * STEP_NS
        for name, t in tables.items():
            ts = pc.cast(t.column("ts"), pa.int64())
            batch = t.filter(pc.and_(pc.greater_equal(ts, lo), pc.less(ts, hi)))
            if batch.num_rows:
                scorer.ingest(name, batch.take(pa.array(rng.permutation(batch.num_rows))))
        scorer.score(hi + 6_000_000_000)
        for n, nf in off.items():
            row = np.searchsorted(nf.steps, step)
            np.testing.assert_array_equal(scorer.features_of(n), nf.X[row], err_msg=f"{n} step {step - first}")
    return off, scorer


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "numpy"])
def test_online_features_equal_offline_features_in_a_simulated_nvl72_rack_whose_fabric_fails(
        tmp_path, kernel, tiny_model_dir):
    """Two NVLink domains of three 4-GPU trays (the simulator's GB200 racks); the first domain's NVSwitch
    fabric fails (simulator/faults.py, mode nvswitch): non-fatal SXids densify and its GPUs report
    access-timeout recovery, then degraded bandwidth, then a fatal SXid. Offline == online at every step,
    on every node of both domains."""
    from foreshock.simulator.faults import HOUR, NS, NVLINK_FABRIC, Episode
    from foreshock.simulator.model import ClusterModel
    from foreshock.simulator.topology import Topology

    topo = Topology(nodes=6, gpus_per_node=4, hcas_per_node=4, nvlink_domain_nodes=3, nodes_per_leaf=6,
                    job_nodes=3, spare_fraction=0.0)
    t0 = 1_767_571_200 * NS
    fail = t0 + int(6 * HOUR)
    episode = Episode("t-nvswitch", "nvswitch", NVLINK_FABRIC, (0, 1, 2), 5, fail - int(4 * HOUR), fail, True,
                      fail + int(3 * HOUR), 1.0, topo.nvlink_domain_name(0), 7, 4242)
    start = fail - 100 * 60 * NS
    sim = ClusterModel(topo, seed=5, episodes=[episode], start_ns=start, interval_s=30.0)
    tables = sim.generate(np.arange(6), start + np.arange(0, 110 * 60, 30) * NS)
    tables = {name: t for name, t in tables.items() if name in ("gpu", "nvlink", "rdma_port", "host_net", "events")}
    nodes = sorted(set(tables["gpu"].column("node").to_pylist()))
    inv = synthetic.inventory(nodes, leaf_of=lambda i: "leaf-0", t0_ns=start)
    model = registry.load_model(tiny_model_dir(tmp_path / "m"))
    off, scorer = _offline_and_online(tmp_path, tables, inv, model, kernel)

    col = {n: i for i, n in enumerate(ft.FEATURE_NAMES)}
    failing, other = nodes[:3], nodes[3:]
    for n in failing:
        X = off[n].X
        assert np.nanmax(X[:, col["sxid_nonfatal_30m"]]) >= 3 and X[-1, col["sxid_fatal_30m"]] == 1
        assert X[-1, col["minutes_since_sxid_fatal"]] <= 10
        assert X[-1, col["fabric_degraded_bw_now"]] == 1 and X[-1, col["fabric_access_timeout_recovery_now"]] == 1
        assert X[0, col["fabric_degraded_bw_now"]] == 0     # healthy at first, degraded before the failure
    for n in other:
        X = off[n].X
        assert np.nanmax(X[:, col["fabric_degraded_bw_max30m"]]) == 0 and (X[:, col["fabric_registration_failed_now"]] == 0).all()
        assert (np.nan_to_num(X[:, col["sxid_nonfatal_30m"]]) == 0).all()
        assert (X[:, col["minutes_since_sxid_fatal"]] == ft.SINCE_CAP_MINUTES).all()
    assert not {k: v for k, v in scorer.stats.items() if k.startswith(("fabric_", "sxid_"))}


@pytest.mark.parametrize("interval_s", [120, 300])
def test_online_features_equal_offline_features_when_the_collector_samples_every_few_steps(
        tmp_path, interval_s, tiny_model_dir):
    """A collector sampling every 2 or 5 minutes: each delta spread over the steps its sample covers
    (signals.py) lands in steps the online scorer has not closed yet, so it gives the offline features at
    every step, and every step of the node has features, the ECC ramp's count live in them."""
    tables = {n: synthetic.node_tables(n, 40, seed=i, ecc_ramp_from=8 if n == "node-b" else None,
                                       interval_s=interval_s) for i, n in enumerate(NODES)}
    merged = {name: pa.concat_tables([tables[n][name] for n in NODES]) for name in tables["node-a"]}
    inv = synthetic.inventory(NODES, leaf_of=lambda i: f"leaf-{i // 2}", job_of=lambda i: "job-1")
    model = registry.load_model(tiny_model_dir(tmp_path / "m"))
    off, scorer = _offline_and_online(tmp_path, merged, inv, model, kernel=True)
    for n in NODES:
        sampled_steps = 40 * interval_s // ft.STEP_SECONDS
        assert off[n].present.sum() >= sampled_steps - sampled_steps // 5, n
    ecc = off["node-b"].X[:, ft.FEATURE_NAMES.index("ecc_sbe_30m")]
    assert np.nanmax(ecc) > 0


def _warming_hbm(tables: dict[str, pa.Table], gpu: int, warm_from: int, remaps_at: tuple[int, ...]) -> dict:
    """The node's tables with one GPU's HBM warming apart from its die from sample `warm_from` (up to 6
    degC over 40 samples) and a row remapped for correctable errors at each of `remaps_at`."""
    g = tables["gpu"]
    idx = g.column("gpu").to_numpy()
    sample = np.arange(g.num_rows) // (idx.max() + 1)
    mine = idx == gpu
    hbm = g.column("hbm_temperature_c").to_numpy().astype(np.float64)
    hbm = hbm + np.where(mine, np.clip((sample - warm_from) / 40.0, 0.0, 1.0) * 6.0, 0.0)
    remapped = np.where(mine, sum((sample >= s_).astype(np.int64) for s_ in remaps_at), 0)
    for col, values in (("hbm_temperature_c", np.round(hbm)), ("remapped_rows_correctable", remapped)):
        g = g.set_column(g.schema.get_field_index(col), col, pa.array(values, g.schema.field(col).type))
    return dict(tables, gpu=g)


def test_online_warming_columns_equal_offline_over_the_hours_their_usual_needs(tmp_path, tiny_model_dir):
    """The warming columns need 6 hours of a node's usual: over 7 hours, one GPU's HBM warming apart from
    its die while its node remaps rows reads the same online and offline at every step (from the raw rows,
    in shuffled batches), and only that node's remapping column is set."""
    steps = 7 * 60 + 30
    nodes = ["node-a", "node-b"]
    tables = {n: synthetic.node_tables(n, steps, seed=i) for i, n in enumerate(nodes)}
    tables["node-a"] = _warming_hbm(tables["node-a"], gpu=3, warm_from=steps - 60, remaps_at=(steps - 70, steps - 40))
    merged = {name: pa.concat_tables([tables[n][name] for n in nodes]) for name in tables["node-a"]}
    inv = synthetic.inventory(nodes, leaf_of=lambda i: "leaf-0", job_of=lambda i: "job-1")
    model = registry.load_model(tiny_model_dir(tmp_path / "m"))
    off, _ = _offline_and_online(tmp_path, merged, inv, model, kernel=True)
    col = {n: ft.FEATURE_NAMES.index(n) for n in ("hbm_gap_excess_vs_usual", "hbm_gap_excess_remapping")}
    a, b = off["node-a"].X, off["node-b"].X
    assert a[-1, col["hbm_gap_excess_vs_usual"]] > 3.0 and a[-1, col["hbm_gap_excess_remapping"]] > 3.0
    assert np.isnan(a[:6 * 60 - 1, col["hbm_gap_excess_vs_usual"]]).all()
    assert np.nanmax(b[:, col["hbm_gap_excess_remapping"]]) == 0.0


def test_block_size_does_not_change_features():
    rng = np.random.default_rng(3)
    x = rng.poisson(0.3, (2, 300, len(ft.ALL_NAMES))).astype(float) * 1.7
    x[:, 50:80] = np.nan
    whole, _ = ft.compute(x, np.arange(300), ft.FeatureState.empty(2))
    for block in (1, 13, 64):
        state, parts = ft.FeatureState.empty(2), []
        for i in range(0, 300, block):
            f, state = ft.compute(x[:, i:i + block], np.arange(i, min(i + block, 300)), state)
            parts.append(f)
        np.testing.assert_array_equal(np.concatenate(parts, axis=1), whole)


def test_peer_totals_take_memory_for_the_days_a_group_ran_and_sum_as_a_dense_table(tmp_path):
    """A month of short jobs: each job's totals take the days it ran, not the month, and every cell
    (count, totals, nonzero counts) is exactly the dense table's sum, also after save and load."""
    rng = np.random.default_rng(3)
    day = offline.TOTALS_CHUNK_STEPS
    first, last = 500, 500 + 30 * day - 1
    totals = offline.PeerTotals(first, last)
    k = len(ft.PEER_INPUTS)
    dense: dict = {}
    for _ in range(24):
        a = first + int(rng.integers(0, 25 * day))
        steps = np.arange(a, min(last, a + int(rng.integers(60, 2 * day))) + 1)
        present = rng.random(len(steps)) > 0.1
        own = rng.random((len(steps), k)) * (rng.random((len(steps), k)) > 0.5)
        labels = np.array([f"job-{rng.integers(0, 12)}", ""], dtype=object)
        codes = totals.code_rows("job", labels, (rng.random(len(steps)) < 0.2).astype(np.int64))
        totals.add("job", codes, steps, present, own)
        for c, s, p, o in zip(codes, steps, present, own):
            if c >= 0 and p:
                cell = dense.setdefault((c, s), [0.0, np.zeros(k), np.zeros(k)])
                cell[0] += 1.0
                cell[1] = cell[1] + o
                cell[2] = cell[2] + (o > 0)
    # 24 node spans of at most 2 days over 12 jobs: at most 3 days each, never the 30 x 12 of a dense table
    assert totals.used["job"] <= 24 * 3 < 30 * len(totals.codes["job"])
    keys = list(dense) + [(0, first), (1, last)]
    codes = np.array([c for c, _ in keys])
    steps = np.array([s for _, s in keys])
    want = [dense.get(key, [0.0, np.zeros(k), np.zeros(k)]) for key in keys]
    totals.save(tmp_path)
    for t in (totals, offline.PeerTotals.load(tmp_path, first, last - first + 1)):
        count, total, nonzero = t.lookup("job", codes, steps)
        assert np.array_equal(count, [w[0] for w in want])
        assert np.array_equal(total, np.stack([w[1] for w in want]))
        assert np.array_equal(nonzero, np.stack([w[2] for w in want]))
