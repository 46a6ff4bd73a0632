"""The online scorer: ingest schema-v1 batches, score every node, explain the risky ones."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from foreshock import schema as sch
from foreshock.predictor import features as ft
from foreshock.predictor import online, registry, synthetic

STEP_NS = ft.STEP_SECONDS * 1_000_000_000


@pytest.fixture(scope="module")
def model(tmp_path_factory, tiny_model_dir):
    return registry.load_model(tiny_model_dir(tmp_path_factory.mktemp("m") / "m"))


def _slice(table: pa.Table, lo: int, hi: int) -> pa.Table:
    import pyarrow.compute as pc
    ts = pc.cast(table.column("ts"), pa.int64())
    return table.filter(pc.and_(pc.greater_equal(ts, lo), pc.less(ts, hi)))


def test_scores_every_node_and_explains_the_failing_one(model):
    sick = synthetic.node_tables("node-sick", 40, seed=1, ecc_ramp_from=15)
    well = synthetic.node_tables("node-well", 40, seed=2)
    scorer = online.OnlineScorer(model)
    scorer.set_inventory(synthetic.inventory(["node-sick", "node-well"]))
    t0 = synthetic.T0_NS - synthetic.T0_NS % STEP_NS
    for k in range(0, 40, 4):  # four steps a round: the scorer advances them as one block
        lo, hi = t0 + k * STEP_NS, t0 + (k + 4) * STEP_NS
        for tables in (sick, well):
            for name, tbl in tables.items():
                scorer.ingest(name, _slice(tbl, lo, hi))
        batch = scorer.score(hi + 6_000_000_000)
    assert sorted(batch.nodes) == ["node-sick", "node-well"]
    p = dict(zip(batch.nodes, batch.probability))
    assert p["node-sick"] > 0.25 and p["node-sick"] > 5 * p["node-well"]
    sig = batch.signals[batch.nodes.index("node-sick")]
    assert sig and sig[0].name == "ecc_sbe"
    assert "HBM corrected" in sig[0].description and "GPU 3" in sig[0].description
    assert sig[0].contribution > 0
    assert batch.horizon_seconds == 1800 and batch.model_version == "tiny-test"


def test_a_node_with_an_nvlink_link_down_is_named_with_its_evidence_whatever_its_risk(tmp_path, tiny_model_dir):
    """Hard evidence from the raw tables: an NVLink link down, and an IB port whose link_downed counter
    went up twice in a few minutes; a port that went down once (a reseat) is not named."""
    import json

    import pyarrow.compute as pc

    d = tiny_model_dir(tmp_path / "m")
    man = json.loads((d / registry.MANIFEST_FILE).read_text())
    man["hard_evidence"] = ["nvl_links_down_now", "pcie_width_deficit_now", "ib_link_downed_30m"]
    (d / registry.MANIFEST_FILE).write_text(json.dumps(man))
    model = registry.load_model(d)
    t0 = synthetic.T0_NS - synthetic.T0_NS % STEP_NS
    names = ("node-down", "node-well", "node-flap", "node-once")
    tables = {n: synthetic.node_tables(n, 12, seed=k) for k, n in enumerate(names)}
    nv = tables["node-down"]["nvlink"]
    late = pc.greater_equal(pc.cast(nv.column("ts"), pa.int64()), t0 + 8 * STEP_NS)
    gpu2 = pc.and_(late, pc.equal(nv.column("gpu"), 2))
    up = pc.if_else(gpu2, pa.scalar(15, pa.int16()), nv.column("links_up"))
    tables["node-down"]["nvlink"] = nv.set_column(nv.schema.get_field_index("links_up"), "links_up", up)
    for node, steps in (("node-flap", (7, 9)), ("node-once", (7,))):
        rp = tables[node]["rdma_port"]
        ts = pc.cast(rp.column("ts"), pa.int64()).to_numpy()
        mlx1 = (rp.column("device").to_numpy(zero_copy_only=False) == "mlx5_1")
        downs = sum((ts >= t0 + k * STEP_NS) & mlx1 for k in steps).astype(np.uint64)
        counter = pa.array(rp.column("link_downed").to_numpy() + downs, pa.uint64())
        tables[node]["rdma_port"] = rp.set_column(rp.schema.get_field_index("link_downed"), "link_downed", counter)
    scorer = online.OnlineScorer(model)
    scorer.set_inventory(synthetic.inventory(list(names)))
    for node in names:
        for name, tbl in tables[node].items():
            scorer.ingest(name, tbl)
    batch = scorer.score(t0 + 12 * STEP_NS + 6_000_000_000)
    assert set(batch.evidence) == {"node-down", "node-flap"}
    assert batch.evidence["node-down"].startswith("NVLink links down on the worst GPU: 3 links now")
    assert batch.evidence["node-flap"].startswith(
        "InfiniBand link-down events (link_downed) on the worst port: 2 in the last 30 min")
    assert batch.probability[batch.nodes.index("node-down")] < 0.5   # the tiny model does not read it


def test_bad_batches_are_refused_and_change_nothing(model):
    scorer = online.OnlineScorer(model)
    with pytest.raises(sch.SchemaError, match="unknown table"):
        scorer.ingest("nonsense", pa.table({"x": [1]}))
    bad = pa.table({"ts": pa.array([1], pa.int64()).cast(sch.TS), "node": ["n"], "gpu": [0], "bogus": [1]})
    with pytest.raises(sch.SchemaError, match="bogus"):
        scorer.ingest("gpu", bad)
    assert scorer.nodes == [] and len(scorer.score(10**18)) == 0


def test_node_bound_and_late_rows_are_counted(model):
    scorer = online.OnlineScorer(model, max_nodes=1)
    a = synthetic.node_tables("a", 5)
    b = synthetic.node_tables("b", 5)
    scorer.ingest("gpu", a["gpu"])
    with pytest.raises(sch.SchemaError, match="max_nodes"):
        scorer.ingest("gpu", b["gpu"])
    assert scorer.nodes == ["a"]
    scorer.score(synthetic.T0_NS + 10 * STEP_NS)
    late = synthetic.node_tables("a", 3, seed=5, t0_ns=synthetic.T0_NS - 5 * STEP_NS)
    scorer.ingest("gpu", late["gpu"])
    assert scorer.stats["late_rows"] > 0 or scorer._stage.stats.dropped_late["gpu"] > 0


def test_pending_rows_are_bounded(model):
    scorer = online.OnlineScorer(model, max_pending_rows=100)
    tables = synthetic.node_tables("a", 50)
    scorer.ingest("gpu", tables["gpu"])
    assert scorer._pending_rows <= 100
    assert scorer.stats["dropped_pending_rows"] > 0


def test_a_kernel_event_read_after_its_step_closed_is_dropped_and_counted(model):
    """An Xid keeps the kernel's time; read after its step closed (on the watermarks, or after the
    grace period), it is dropped and counted like any late row, not moved into the open step, where
    it would count twice as much as offline."""
    import pandas as pd
    scorer = online.OnlineScorer(model, grace_seconds=0)
    tables = synthetic.node_tables("a", 8)
    t0 = synthetic.T0_NS - synthetic.T0_NS % STEP_NS        # the step of the first sample
    for name, t in tables.items():
        scorer.ingest(name, _slice(t, 0, t0 + 5 * STEP_NS))
    scorer.score(t0 + 5 * STEP_NS, close_ns=t0 + 5 * STEP_NS)    # steps before t0 + 5 steps closed
    fatal = ft.FEATURE_NAMES.index("xid_fatal_1m")
    xid = sch.to_table("events", [{"ts": pd.Timestamp(t0 + 5 * STEP_NS - 10**9, tz="UTC"), "node": "a",
                                   "kind": "xid", "source": "kmsg", "severity": "fatal", "xid": 79, "gpu": 3,
                                   "message": "NVRM: Xid 79, GPU has fallen off the bus."}])
    scorer.ingest("events", xid)
    assert scorer.stats["late_rows"] == 1
    for name, t in tables.items():
        scorer.ingest(name, _slice(t, t0 + 5 * STEP_NS, t0 + 6 * STEP_NS))
    scorer.score(t0 + 6 * STEP_NS, close_ns=t0 + 6 * STEP_NS)
    assert not scorer.features_of("a")[fatal] > 0              # not in the step that was open


def test_a_nodes_first_step_is_not_scored_online_or_offline(model):
    """The first step has no deltas to difference (they read 0): no model learned such a row, so neither
    path scores it; the next step is scored. A node joining later starts its own count."""
    early = synthetic.node_tables("node-early", 6, seed=3)
    late = synthetic.node_tables("node-late", 6, seed=4, t0_ns=synthetic.T0_NS + 2 * STEP_NS)
    scorer = online.OnlineScorer(model)
    scorer.set_inventory(synthetic.inventory(["node-early", "node-late"]))
    t0 = synthetic.T0_NS - synthetic.T0_NS % STEP_NS
    scored = []
    for k in range(4):
        lo, hi = t0 + k * STEP_NS, t0 + (k + 1) * STEP_NS
        for name, tbl in early.items():
            scorer.ingest(name, _slice(tbl, lo, hi))
        if k >= 2:     # node-late's telemetry starts two steps later
            for name, tbl in late.items():
                scorer.ingest(name, _slice(tbl, lo, hi))
        scored.append(sorted(scorer.score(hi + 6_000_000_000).nodes))
    assert scored == [[], ["node-early"], ["node-early"], ["node-early", "node-late"]]

    from foreshock.predictor import offline
    steps = np.arange(10, 14)
    nf = offline.NodeFeatures("n", steps, np.array([True, False, True, True]), np.zeros((4, ft.N_FEATURES)))
    assert nf.scoreable.tolist() == [False, False, True, True]


def test_rows_left_out_of_the_features_are_counted_by_reason(model):
    """Rows for a step already closed, telemetry and step times alike, are left out and counted under
    their reason; every reason is reported, at 0 where nothing was left out (what the service exports)."""
    scorer = online.OnlineScorer(model, explain_top=0)
    tables = synthetic.node_tables("n0", 4, seed=3)
    for name, t in tables.items():
        scorer.ingest(name, t)
    scorer.score(synthetic.T0_NS + 4 * STEP_NS + 6_000_000_000)       # every step closed
    assert set(scorer.left_out()) == set(online.LEFT_OUT) and not any(scorer.left_out().values())
    first = synthetic.T0_NS // STEP_NS
    gpu = _slice(tables["gpu"], first * STEP_NS, (first + 1) * STEP_NS)
    scorer.ingest("gpu", gpu)                                          # repeats of what n0 sent
    other = _slice(synthetic.node_tables("n1", 1, seed=4)["gpu"], first * STEP_NS, (first + 1) * STEP_NS)
    scorer.ingest("gpu", other)                                        # a new node's, for a closed step
    scorer.ingest("step_times", sch.to_table("step_times", [
        {"ts": first * STEP_NS, "node": "n0", "job": "j", "rank": r, "step": 1, "step_seconds": 1.0,
         "compute_seconds": 0.5} for r in range(3)]))
    left = scorer.left_out()
    assert left["not_newer_rows"] == gpu.num_rows and left["late_rows"] == other.num_rows
    assert left["late_step_times"] == 3 and sum(left.values()) == gpu.num_rows + other.num_rows + 3
