"""A shard takes a new shard map without a restart (`foreshock serve --shard NAME --shard-map FILE`,
service/shardmap.py ShardMapFile and ShardGate.take, service/server.py follow_shard_map): two real
control planes on loopback ports follow one map file; rewriting it moves leaf-01 from a to b. A node
moved away is refused on its open stream's next batch with the new owner's address, and its risk, its
alarm and its per-node metrics leave a; b takes it at once, and a takes the node moved in. A new
version that does not parse, drops the shard or does not fit the inventory is refused, counted, and
the map in force stays. A shard that forwards to a jobs coordinator clears there the alarm of a node it
no longer serves. A real `foreshock serve` process reads the map again on SIGHUP."""

from __future__ import annotations

import datetime as dt
import os
import queue
import signal
import threading

import grpc
import numpy as np
import pyarrow.parquet as pq
import pytest
from prometheus_client import generate_latest
from support import Serve, free_port, two_shard_map, wait_until

from foreshock import schema as sch
from foreshock.collectors.uplink import encode_table
from foreshock.service.nodes import Topology
from foreshock.service.scoring import NullScorer, ScoreResult
from foreshock.service.server import Settings, SettingsError, build_server
from foreshock.service.shardmap import (ADDRESS_KEY, LABEL_KEYS, SHARD_KEY, ShardMapError, ShardMapFile, changes,
                                        load, parse)
from foreshock.v1 import telemetry_pb2 as tpb
from foreshock.v1 import telemetry_pb2_grpc


def _rewrite(path, text, step: int = 1) -> None:
    """A new version with a new mtime, whatever the clock's resolution."""
    st = path.stat()
    path.write_text(text)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + step * 1_000_000_000))


def _gpu(node: str):
    return sch.to_table("gpu", [{"ts": dt.datetime.now(dt.timezone.utc), "node": node, "gpu": 0, "gpu_lost": False}])


def _batch(node: str, sequence: int) -> tpb.SweepBatch:
    return tpb.SweepBatch(node=node, collector_id=f"c-{node}", sequence=sequence, tables=[tpb.TableRows(
        table="gpu", schema_version=sch.SCHEMA_VERSION, arrow_ipc=encode_table("gpu", _gpu(node)))])


def _stream(address: str, node: str, leaf: str, batches: list[int]) -> list:
    with grpc.insecure_channel(address) as ch:
        return list(telemetry_pb2_grpc.TelemetryStub(ch).StreamSweeps(
            iter([_batch(node, s) for s in batches]), timeout=10, metadata=((LABEL_KEYS["leaf_switch"], leaf),)))


class _Scorer(NullScorer):
    """No steps, so every round scores: each node it was fed, at RISK.get(node, 0.3)."""

    RISK = {"n-hot": 0.9}

    def __init__(self):
        self.seen: list[str] = []

    def ingest(self, table, data):
        for node in data.column("node").to_pylist():
            if node not in self.seen:
                self.seen.append(node)

    def score(self, now_ns, close_ns=None):
        return ScoreResult(list(self.seen), np.array([self.RISK.get(n, 0.3) for n in self.seen]))


@pytest.fixture
def shards(tmp_path):
    """Shards a (leaf-01) and b (leaf-02), each following the one map file (looked at every 0.1 s)."""
    addresses = {name: f"127.0.0.1:{free_port()}" for name in "ab"}
    path = tmp_path / "shards.toml"
    path.write_text(two_shard_map(addresses["a"], addresses["b"]))
    planes = {}
    try:
        for name in "ab":
            planes[name] = build_server(Settings.insecure_loopback(
                tmp_path / name, scorer=_Scorer(), listen=addresses[name], shard=name,
                shard_map=ShardMapFile(path), shard_map_check_seconds=0.1,
                topology={"n-fixed-1": Topology(leaf_switch="leaf-01"), "n-fixed-2": Topology(leaf_switch="leaf-02")}))
            planes[name].start()
        yield planes, path, addresses
    finally:
        for p in planes.values():
            p.stop(0.2)


def test_a_node_moved_away_is_redirected_and_forgotten_and_one_moved_in_is_taken(shards):
    planes, path, addresses = shards
    a, b = planes["a"], planes["b"]
    # n-hot streams to a, and keeps its stream open across the map change.
    outbox: queue.Queue = queue.Queue()
    outbox.put(_batch("n-hot", 1))
    result: dict = {}

    def stream():
        def requests():
            while (item := outbox.get()) is not None:
                yield item
        with grpc.insecure_channel(a.address) as ch:
            call = telemetry_pb2_grpc.TelemetryStub(ch).StreamSweeps(
                requests(), timeout=20, metadata=((LABEL_KEYS["leaf_switch"], "leaf-01"),))
            try:
                result["acks"] = [ack.acked_sequence for ack in call]
            except grpc.RpcError as exc:
                result["error"] = exc
    t = threading.Thread(target=stream)
    t.start()
    try:
        assert wait_until(lambda: a.nodes.probability("n-hot") == pytest.approx(0.9))
        assert wait_until(lambda: "n-hot" in a.policy.alarms)
        text = generate_latest(a.registry).decode()
        assert 'foreshock_node_failure_risk{leaf_switch="",node="n-hot",site=""} 0.9' in text
        assert 'foreshock_node_evacuation_alarm{cause="risk",node="n-hot"} 1.0' in text
        old = a.shard_gate.map.digest
        assert f'foreshock_shard_map_info{{digest="{old}"}} 1.0' in text

        _rewrite(path, two_shard_map(addresses["a"], addresses["b"], a_leaves=("leaf-02",), b_leaves=("leaf-01",)))
        assert wait_until(lambda: a.shard_gate.map.digest != old and b.shard_gate.map.digest != old)
        new = a.shard_gate.map.digest
        assert b.shard_gate.map.digest == new == load(path).digest

        # n-hot's next batch on the stream a admitted it on: refused, naming b, and nothing taken
        outbox.put(_batch("n-hot", 2))
        t.join(15)
        err = result["error"]
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"belongs to shard 'b' at {addresses['b']}" in err.details()
        assert dict(err.trailing_metadata())[SHARD_KEY] == "b"
        assert dict(err.trailing_metadata())[ADDRESS_KEY] == addresses["b"]
        assert a.ingest.last_sequence("c-n-hot") == 1

        # a forgets it: no risk, no alarm, no per-node series, though its scorer still scores it
        assert wait_until(lambda: a.nodes.probability("n-hot") is None and "n-hot" not in a.policy.alarms)
        assert wait_until(lambda: a.scoring.rounds["interval"] > 3)
        assert a.nodes.probability("n-hot") is None and "n-hot" not in a.nodes.known_nodes()
        assert "n-hot" in a.scorer.seen
        text = generate_latest(a.registry).decode()
        assert 'node="n-hot"' not in text
        assert "foreshock_shard_map_reloads_total 1.0" in text
        assert "foreshock_shard_map_reload_failures_total 0.0" in text
        assert "foreshock_shard_map_refused 0.0" in text
        assert "foreshock_shard_moved_away_nodes_total 1.0" in text
        assert f'foreshock_shard_map_info{{digest="{new}"}} 1.0' in text and old not in text
        a.decisions.flush()
        cleared = [r for f in sorted((a.state_dir / "decisions").rglob("*.parquet"))
                   for r in pq.read_table(f).to_pylist() if r["kind"] == "cleared" and r["node"] == "n-hot"]
        assert [r["reason"] for r in cleared] == ["the shard map moved the node to shard b at " + addresses["b"]]

        # b takes n-hot at once; a takes n-new on leaf-02, which it did not serve before
        assert _stream(addresses["b"], "n-hot", "leaf-01", [2, 3])[-1].acked_sequence == 3
        assert _stream(addresses["a"], "n-new", "leaf-02", [1])[-1].acked_sequence == 1
        assert wait_until(lambda: b.nodes.probability("n-hot") == pytest.approx(0.9))
        assert wait_until(lambda: a.nodes.probability("n-new") == pytest.approx(0.3))
        # and a new stream of n-hot at a, naming no leaf at all, is still sent to b
        with grpc.insecure_channel(a.address) as ch:
            with pytest.raises(grpc.RpcError) as err:
                list(telemetry_pb2_grpc.TelemetryStub(ch).StreamSweeps(iter([_batch("n-hot", 4)]), timeout=10))
        assert dict(err.value.trailing_metadata())[SHARD_KEY] == "b"
    finally:
        outbox.put(None)
        t.join(15)


def test_a_new_map_that_cannot_be_used_is_refused_and_the_map_in_force_stays(shards):
    planes, path, addresses = shards
    a = planes["a"]
    first = a.shard_gate.map

    def metrics():
        return generate_latest(a.registry).decode()

    bad = [
        ("[shards.a]\naddress = 1\n", "address"),                                      # not a map
        (f'[shards.b]\naddress = "{addresses["b"]}"\nleaves = ["leaf-01", "leaf-02"]\n',
         "no shard 'a' (it has b)"),                                                     # drops shard a
        (two_shard_map(addresses["a"], addresses["b"], a_leaves=("leaf-01",), b_leaves=("leaf-03",)),
         "leaves no shard owns: leaf-02"),                                               # n-fixed-2
    ]
    for i, (text, why) in enumerate(bad, start=1):
        _rewrite(path, text, step=i)
        assert wait_until(lambda: a.shard_map_file.failed_reloads == i), metrics()
        assert why in a.shard_map_file.refused
        assert a.shard_gate.map is first
        assert f"foreshock_shard_map_reload_failures_total {float(i)}" in metrics()
        assert "foreshock_shard_map_refused 1.0" in metrics()
    # a serves on, with the map it had
    assert _stream(a.address, "n-1", "leaf-01", [1])[-1].acked_sequence == 1
    with pytest.raises(grpc.RpcError) as err:
        _stream(a.address, "n-2", "leaf-02", [1])
    assert dict(err.value.trailing_metadata())[SHARD_KEY] == "b"
    # the same map again: in force, nothing taken, nothing refused
    _rewrite(path, two_shard_map(addresses["a"], addresses["b"]), step=9)
    assert wait_until(lambda: a.shard_map_file.refused == "")
    assert a.shard_gate.map is first and a.shard_map_file.reloads == 0
    assert "foreshock_shard_map_refused 0.0" in metrics()


def test_a_followed_map_must_name_the_shard_and_fit_the_topology_from_the_start(tmp_path):
    path = tmp_path / "map.toml"
    path.write_text(two_shard_map("127.0.0.1:1", "127.0.0.1:2"))
    with pytest.raises(SettingsError, match=r"no shard 'c' \(it has a, b\)"):
        build_server(Settings.insecure_loopback(tmp_path / "s", scorer=NullScorer(), shard="c",
                                                shard_map=ShardMapFile(path)))
    with pytest.raises(SettingsError, match="leaves no shard owns: leaf-09"):
        build_server(Settings.insecure_loopback(tmp_path / "s", scorer=NullScorer(), shard="a",
                                                shard_map=ShardMapFile(path),
                                                topology={"n9": Topology(leaf_switch="leaf-09")}))
    with pytest.raises(SettingsError, match=r"shard_map_check_seconds 0 must be in \[0.05, 3600\]"):
        build_server(Settings.insecure_loopback(tmp_path / "s", scorer=NullScorer(), shard="a",
                                                shard_map=ShardMapFile(path), shard_map_check_seconds=0))
    assert not (tmp_path / "s").exists()


def test_a_forwarding_shard_tells_the_coordinator_a_node_it_no_longer_serves_is_cleared(tmp_path):
    """The coordinator holds a shard's risk alarm until that shard clears it; a node moved away is
    cleared with its last risk, so no alarm is left that no shard will ever clear."""
    from foreshock.service.coordinator import CoordinatorSettings
    from foreshock.service.forwarder import ForwardSettings

    coordinator = build_server(Settings.insecure_loopback(
        tmp_path / "coordinator", threshold=0.5,
        coordinator=CoordinatorSettings(str(tmp_path / "lease"), lock_poll_seconds=0.05)))
    coordinator.start()
    address = f"127.0.0.1:{free_port()}"
    path = tmp_path / "shards.toml"
    path.write_text(two_shard_map(address, "127.0.0.1:1"))
    shard = None
    try:
        assert wait_until(lambda: coordinator.leading, 10)
        shard = build_server(Settings.insecure_loopback(
            tmp_path / "a", scorer=_Scorer(), listen=address, shard="a", shard_map=ShardMapFile(path),
            shard_map_check_seconds=0.1, threshold=0.5,
            forward=ForwardSettings((coordinator.address,), "a", summary_seconds=1.0,
                                    backoff_initial_seconds=0.05, backoff_max_seconds=0.3)))
        shard.start()
        assert _stream(address, "n-hot", "leaf-01", [1])[-1].acked_sequence == 1
        assert wait_until(lambda: "n-hot" in coordinator.policy.alarms, 10)
        _rewrite(path, two_shard_map(address, "127.0.0.1:1", a_leaves=("leaf-02",), b_leaves=("leaf-01",)))
        assert wait_until(lambda: "n-hot" not in coordinator.policy.alarms, 10)
        assert coordinator.nodes.probability("n-hot") == pytest.approx(0.9)   # its last risk, not 0
        assert shard.nodes.probability("n-hot") is None
    finally:
        if shard is not None:
            shard.stop(0.5)
        coordinator.stop(0.5)


def test_changes_and_digest_say_what_moved_and_ignore_what_does_not_matter():
    old = parse({"shards": {"a": {"address": "h:1", "leaves": ["l1", "l2"]},
                            "b": {"address": "h:2", "leaves": ["l3"]}}}, "m.toml")
    same = parse({"shards": {"b": {"address": "h:2", "leaves": ["l3"]},
                             "a": {"address": "h:1", "leaves": ["l2", "l1"]}}}, "other.toml")
    assert old.digest == same.digest and len(old.digest) == 12
    new = parse({"shards": {"a": {"address": "h:9", "leaves": ["l1", "l4"], "selector": {"site": "dc2"}},
                            "b": {"address": "h:2", "leaves": ["l2", "l3"]},
                            "c": {"address": "h:3", "leaves": ["l5"]}}}, "m.toml")
    assert new.digest != old.digest
    said = changes(old, new, "a")
    assert "leaves moved in: l4" in said and "leaves moved out: l2 (to b)" in said
    assert "selector none -> {site = 'dc2'}" in said and "its address h:1 -> h:9" in said
    assert "shards added: c" in said and "shards changed: b" in said
    assert changes(old, same, "a") == "nothing for this shard"
    with pytest.raises(ShardMapError, match="no shard 'c'"):
        changes(old, new, "c")


def test_serve_reads_its_map_again_on_sighup(tmp_path):
    """The new map has the old one's size and mtime, so only SIGHUP makes the shard read it."""
    import urllib.request

    addresses = {name: f"127.0.0.1:{free_port()}" for name in "ab"}
    path = tmp_path / "shards.toml"
    path.write_text(two_shard_map(addresses["a"], addresses["b"]))
    stamp = path.stat()
    first = load(path).digest
    serve = Serve(tmp_path / "a", "--listen", addresses["a"], "--shard", "a", "--shard-map", str(path))
    try:
        def text():
            return urllib.request.urlopen(f"http://{serve.metrics}/metrics", timeout=10).read().decode()
        assert f'foreshock_shard_map_info{{digest="{first}"}} 1.0' in text()
        path.write_text(two_shard_map(addresses["a"], addresses["b"], a_leaves=("leaf-02",), b_leaves=("leaf-01",)))
        os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
        moved = load(path).digest
        serve.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: f'foreshock_shard_map_info{{digest="{moved}"}} 1.0' in text(), timeout=15)
        assert "foreshock_shard_map_reloads_total 1.0" in text()
        assert serve.term() == 0
        err = serve.proc.stderr.read()
        assert f"took the new map {moved} (was {first}); shard a: leaves moved in: leaf-02; " \
               "leaves moved out: leaf-01 (to b)" in err, err
    finally:
        serve.kill()
