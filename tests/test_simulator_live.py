"""Live mode: per-node models in the collectors' NodeModel protocol, faults injected on command, and the
`foreshock simulate` command line."""

from __future__ import annotations

import numpy as np
import pyarrow.compute as pc
import pytest

from foreshock import cli
from foreshock import schema as sch
from foreshock.collectors.simulated import NodeModel, SimulatedSource
from foreshock.dataset import read_table
from foreshock.simulator.faults import NS
from foreshock.simulator.live import LiveCluster
from foreshock.simulator.model import ClusterModel
from foreshock.simulator.topology import Topology, TopologyError

T0 = 1_767_571_200 * NS


def _cluster(**kw):
    return LiveCluster(Topology(nodes=24, nodes_per_leaf=8, job_nodes=8), seed=3, rate_scale=0.0, start_ns=T0, **kw)


def test_node_models_run_under_the_real_collector_source():
    cluster = _cluster()
    node = cluster.node_model("node-017")
    assert isinstance(node, NodeModel) and node.node == "node-017"
    assert isinstance(cluster.model, ClusterModel)  # the batch simulator's physics, not a copy
    source = SimulatedSource("node-017", node_model=node)
    first = source.sweep(T0 + NS)
    second = source.sweep(T0 + 2 * NS)
    for name in ("gpu", "nvlink", "rdma_port", "netdev", "host_net"):
        assert first[name].schema.equals(sch.schema(name), check_metadata=False)
        assert set(first[name].column("node").to_pylist()) == {"node-017"}
    assert first["gpu"].num_rows == 8 and first["rdma_port"].num_rows == 8
    tx = [first["rdma_port"].column("port_xmit_bytes").to_numpy(), second["rdma_port"].column("port_xmit_bytes").to_numpy()]
    for s in range(3, 63):
        tx.append(source.sweep(T0 + s * NS)["rdma_port"].column("port_xmit_bytes").to_numpy())
    steps = np.diff(np.array(tx, dtype=np.float64), axis=0)
    # the training step's rhythm at 1 s: all-reduce bursts under the 50 GB/s line rate, quiet compute
    assert steps.max() < 50e9 and steps.max() > 20e9 and steps.min() < 1e8
    # and over a minute, the job's average load (about 20 GB/s per HCA)
    assert 10e9 < steps[-60:].sum(axis=0).mean() / 60 < 25e9


def test_inject_degrades_node_17_hca_3_now_and_fails_it_later():
    cluster = _cluster()
    node = cluster.node_model("node-017")
    peer = cluster.node_model("node-018")
    ep = cluster.inject("node-017", "hca", component=3, lead_seconds=120, repair_seconds=600, now_ns=T0 + 10 * NS)
    assert ep.mode == "ib_cable" and ep.nodes == (17,)
    seen = []
    for s in range(1, 135):
        ts = T0 + s * NS
        out = node.sample(ts)
        peer.sample(ts)
        rdma = out["rdma_port"]
        port = rdma.filter(pc.equal(rdma.column("device"), "mlx5_3"))
        if port.num_rows:
            seen.append((ts, port.column("symbol_error")[0].as_py(), port.column("state")[0].as_py(),
                         port.column("local_ack_timeout_err")[0].as_py()))
    before = [x for x in seen if x[0] < T0 + 10 * NS]
    during = [x for x in seen if T0 + 10 * NS <= x[0] < ep.end_ns]
    after = [x for x in seen if x[0] >= ep.end_ns]
    assert during[-1][1] - before[-1][1] > 100 and during[-1][3] > before[-1][3]
    assert {x[2] for x in during} == {4} and after and after[0][2] == 1
    assert cluster.incidents(T0 + 100 * NS).num_rows == 0
    incidents = cluster.incidents(T0 + 200 * NS)
    assert incidents.num_rows == 1
    row = incidents.to_pylist()[0]
    assert row["node"] == "node-017" and row["category"] == "network_switch_cable" and row["component"] == "mlx5_3/1"
    assert row["has_precursor"] and row["precursor_start"] is not None
    truth = cluster.ground_truth()
    assert truth[-1]["injected"] and truth[-1]["fail_ns"] == ep.end_ns


def test_inject_refuses_bad_requests_and_changes_nothing():
    cluster = _cluster()
    with pytest.raises(ValueError, match="unknown failure mode 'melt'"):
        cluster.inject("node-001", "melt")
    with pytest.raises(ValueError, match="hca index in 0..7"):
        cluster.inject("node-001", "ib_cable", component=9)
    with pytest.raises(TopologyError, match="no node 'node-999'"):
        cluster.inject("node-999", "hbm")
    assert cluster.ground_truth() == []


def test_accelerated_fault_process_and_whole_cluster_step():
    cluster = LiveCluster(Topology(nodes=64), seed=1, rate_scale=200.0, speed=3600.0, start_ns=T0, horizon_s=3600)
    truth = [t for t in cluster.ground_truth() if t["fail_ns"] and t["precursor_start_ns"]]
    assert truth, "at 200x rates and 3600x speed an hour holds failures"
    # lead times of hours play out in seconds
    assert max(t["fail_ns"] - t["precursor_start_ns"] for t in truth) < 600 * NS
    out = cluster.step(T0 + NS)
    assert out["gpu"].num_rows <= 64 * 8 and len(set(out["gpu"].column("node").to_pylist())) >= 60


def test_simulate_command(tmp_path, capsys):
    out = tmp_path / "ds"
    code = cli.main(["simulate", "--nodes", "6", "--days", "0.1", "--interval", "120", "--seed", "2",
                     "--out", str(out), "--rate-scale", "5", "--nodes-per-leaf", "3", "--job-nodes", "3"])
    assert code == 0
    text = capsys.readouterr().out
    assert "rows:" in text and "incidents:" in text
    quiet = tmp_path / "quiet"   # too small to hold an incident: it says so, train would have nothing
    assert cli.main(["simulate", "--nodes", "2", "--days", "0.01", "--seed", "2", "--out", str(quiet)]) == 0
    assert "no incident in 2 nodes" in capsys.readouterr().err
    assert read_table(out, "inventory").num_rows == 6
    assert read_table(out, "gpu").num_rows == 6 * 8 * 72
    # a second run into the same dataset is refused, and the first is left as it was
    assert cli.main(["simulate", "--nodes", "2", "--days", "0.01", "--out", str(out)]) == 2
    assert "already holds a dataset" in capsys.readouterr().err
    assert read_table(out, "inventory").num_rows == 6


def test_simulate_scenario_file_and_bad_settings(tmp_path, capsys):
    scenario = tmp_path / "s.toml"
    scenario.write_text('[simulate]\nnodes = 3\ndays = 0.05\nsites = 2\nnodes_per_leaf = 1\nlink_layer = "Ethernet"\n')
    out = tmp_path / "ds"
    assert cli.main(["simulate", "--scenario", str(scenario), "--out", str(out)]) == 0
    rdma = read_table(out, "rdma_port")
    assert set(rdma.column("link_layer").to_pylist()) == {"Ethernet"}
    assert rdma.column("np_cnp_sent").null_count == 0  # RoCE ports have congestion-control counters
    assert read_table(out, "path_probe").num_rows > 0
    assert cli.main(["simulate", "--nodes", "0", "--out", str(tmp_path / "x")]) == 2
    assert "nodes must be a positive integer" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text("[simulate]\nnodez = 3\n")
    assert cli.main(["simulate", "--scenario", str(bad)]) == 2
    assert "nodez" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_sample_all_hands_each_node_model_its_rows_of_the_vectorised_step():
    import pyarrow.compute as pc
    from foreshock.simulator.live import LiveCluster
    from foreshock.simulator.topology import Topology

    topo = Topology(nodes=20, nodes_per_leaf=10)
    start = 1_800_000_000 * 10**9
    batched = LiveCluster(topo, seed=5, rate_scale=0, start_ns=start)
    stepped = LiveCluster(topo, seed=5, rate_scale=0, start_ns=start)
    for k in range(1, 4):
        ts = start + k * 10**9
        batched.sample_all(ts)
        whole = stepped.step(ts)
        for name in topo.names:
            got = batched.node_model(name).sample(ts)
            assert sorted(got) == sorted(whole)
            for table, data in whole.items():
                want = data.filter(pc.equal(data.column("node"), name))
                assert got[table].equals(want), (name, table, k)
    # a timestamp the cache does not hold is sampled directly, and a node's slice is handed out once
    ts = start + 10 * 10**9
    direct = batched.node_model(0).sample(ts)
    assert set(pc.unique(direct["gpu"].column("node")).to_pylist()) == {topo.names[0]}
    assert pc.min(direct["gpu"].column("ts")).value == ts


def test_disturb_degrades_and_recovers_without_an_incident():
    import pyarrow.compute as pc
    from foreshock.simulator.live import LiveCluster
    from foreshock.simulator.topology import Topology

    start = 1_800_000_000 * 10**9
    cluster = LiveCluster(Topology(nodes=16), seed=3, rate_scale=0, start_ns=start)
    node = cluster.node_model("node-005")
    node.sample(start)
    cluster.disturb("node-005", "ib_cable", component=2, seconds=120, peak=0.8, now_ns=start)
    tables = [node.sample(start + s * 10**9) for s in range(10, 240, 10)]
    port = [pc.sum(t["rdma_port"].filter(pc.equal(t["rdma_port"].column("device"), "mlx5_2"))
                   .column("symbol_error")).as_py() for t in tables]
    assert port[-1] > port[0], "the disturbed port shows symbol errors"
    assert cluster.incidents(until_ns=start + 10**12).num_rows == 0
    with pytest.raises(ValueError, match="disturb"):
        cluster.disturb("node-005", "sdc")
