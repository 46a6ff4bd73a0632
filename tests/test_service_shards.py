"""Shards (`foreshock serve --shard NAME --shard-map FILE`, service/shardmap.py): the map's bad input
refused with the offender named; two real control planes on loopback ports (in process, and as two
`foreshock serve` processes), each taking only its shard's nodes and sending another shard's collector
on with FAILED_PRECONDITION and the right shard in the trailing metadata; real uplinks and a real
`foreshock collect` that follow that redirect, and that move when the map file changes (mtime, SIGHUP),
losing no sweep on the way."""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from prometheus_client import generate_latest
from support import free_port, two_shard_map, wait_until

from foreshock import schema as sch
from foreshock.collectors import metrics as collector_metrics
from foreshock.collectors.collector import Collector
from foreshock.collectors.uplink import StreamingUplink, UplinkError, encode_table
from foreshock.service.nodes import Topology
from foreshock.service.scoring import NullScorer
from foreshock.service.server import Settings, SettingsError, build_server
from foreshock.service.shardmap import (ADDRESS_KEY, LABEL_KEYS, SHARD_KEY, ShardMapError, ShardMapFile, load,
                                        parse)
from foreshock.v1 import telemetry_pb2 as tpb
from foreshock.v1 import telemetry_pb2_grpc


def _write(path, text):
    path.write_text(text)
    return path


def _gpu(node: str):
    return sch.to_table("gpu", [{"ts": dt.datetime.now(dt.timezone.utc), "node": node, "gpu": 0, "gpu_lost": False}])


def _rows(name: str, table) -> tpb.TableRows:
    return tpb.TableRows(table=name, schema_version=sch.SCHEMA_VERSION, arrow_ipc=encode_table(name, table))


# -- the map's bad input --------------------------------------------------------------------------------
def test_a_leaf_in_two_shards_is_refused_naming_the_leaf_both_shards_and_the_file(tmp_path):
    f = _write(tmp_path / "map.toml", two_shard_map("h:1", "h:2", a_leaves=("leaf-01", "leaf-07"),
                                                b_leaves=("leaf-07",)))
    with pytest.raises(ShardMapError, match=r"map\.toml.*\[shards\.b\] leaves: leaf 'leaf-07' is in two shards: a, b"):
        load(f)


@pytest.mark.parametrize("data,match", [
    ({"shards": {"a": {"address": "h:1", "leaves": ["l1"], "selector": {"nvlink_domain": "x"}}}},
     r"\[shards\.a\] selector nvlink_domain: not a label a selector may use"),
    ({"shards": {"a": {"address": "h:1"}}}, r"\[shards\.a\]: owns nothing"),
    ({"shards": {"a": {"address": "h:1", "leaves": ["l1"]}, "b": {"address": "h:1", "leaves": ["l2"]}}},
     r"\[shards\.b\] address: 'h:1' is shard 'a'"),
    ({"shards": {"a": {"address": "nohost", "leaves": ["l1"]}}}, r"\[shards\.a\] address: 'nohost'"),
    ({"shards": {"a": {"address": "h:1", "leafs": ["l1"]}}}, r"\[shards\.a\] leafs: unknown key"),
    ({"shard": {}}, r"m\.toml: shard: unknown key"),
    ({"shards": {"a b": {"address": "h:1", "leaves": ["l1"]}}}, r"\[shards\.a b\]: a shard name"),
])
def test_bad_map_entries_are_refused_naming_the_key(data, match):
    with pytest.raises(ShardMapError, match=match):
        parse(data, "m.toml")


def test_inventory_check_names_unknown_leaves_nodes_in_two_shards_and_unowned_leaves():
    m = parse({"shards": {
        "a": {"address": "h:1", "leaves": ["leaf-01", "leaf-09"]},
        "b": {"address": "h:2", "selector": {"site": "dc2"}}}}, "m.toml")
    inventory = {
        "n1": {"leaf_switch": "leaf-01", "site": "dc1"},
        "n2": {"leaf_switch": "leaf-01", "site": "dc2"},     # a by its leaf, b by its site
        "n3": {"leaf_switch": "leaf-03", "site": "dc1"},     # nobody's
        "n4": {"leaf_switch": "leaf-04", "site": "dc2"},     # b's
    }
    with pytest.raises(ShardMapError) as err:
        m.check_inventory(inventory)
    text = str(err.value)
    assert "leaves the inventory does not have: leaf-09" in text
    assert "nodes in two shards: n2 (a, b)" in text
    assert "leaves no shard owns: leaf-03" in text
    assert "leaf-04" not in text and "n1" not in text
    m.check_inventory({k: v for k, v in inventory.items() if k in ("n1", "n4")} | {"n5": {"leaf_switch": "leaf-09"}})
    assert m.shard_of("n4", "leaf-04", {"site": "dc2"}).name == "b"
    with pytest.raises(ShardMapError, match=r"node 'n3' \(leaf switch 'leaf-03', site 'dc1'\) is in no shard"):
        m.shard_of("n3", "leaf-03", {"site": "dc1"})


def test_a_plane_refuses_a_map_that_does_not_fit_its_topology_and_an_unknown_shard(tmp_path):
    m = load(_write(tmp_path / "map.toml", two_shard_map("127.0.0.1:1", "127.0.0.1:2")))
    topology = {"n1": Topology(leaf_switch="leaf-01"), "n9": Topology(leaf_switch="leaf-09")}
    with pytest.raises(SettingsError, match="leaves no shard owns: leaf-09"):
        build_server(Settings.insecure_loopback(tmp_path / "s", scorer=NullScorer(), shard="a", shard_map=m,
                                                topology=topology))
    with pytest.raises(SettingsError, match=r"no shard 'c' \(it has a, b\)"):
        build_server(Settings.insecure_loopback(tmp_path / "s", scorer=NullScorer(), shard="c", shard_map=m))
    assert not (tmp_path / "s").exists()   # refused before anything was made


def test_serve_with_an_unknown_shard_exits_2_naming_it(tmp_path):
    f = _write(tmp_path / "map.toml", two_shard_map("127.0.0.1:1", "127.0.0.1:2"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORESHOCK_")}
    out = subprocess.run([sys.executable, "-m", "foreshock.cli", "serve", "--insecure", "--no-model",
                          "--state", str(tmp_path / "s"), "--shard", "c", "--shard-map", str(f)],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2
    assert f"shard map {f}: no shard 'c' (it has a, b)" in out.stderr


# -- two shards on loopback ------------------------------------------------------------------------------
@pytest.fixture
def shards(tmp_path):
    """Shards a (leaf-01) and b (leaf-02) of one map, two real control planes on loopback ports."""
    addresses = {name: f"127.0.0.1:{free_port()}" for name in "ab"}
    path = _write(tmp_path / "shards.toml", two_shard_map(addresses["a"], addresses["b"]))
    m = load(path)
    planes = {}
    try:
        for name in "ab":
            planes[name] = build_server(Settings.insecure_loopback(
                tmp_path / name, scorer=NullScorer(), listen=addresses[name], shard=name, shard_map=m))
            planes[name].start()
        yield planes, path
    finally:
        for p in planes.values():
            p.stop(0.2)


def test_a_shard_refuses_another_shards_node_naming_the_right_shard_and_takes_nothing(shards):
    planes, _ = shards
    a, b = planes["a"], planes["b"]
    batch = tpb.SweepBatch(node="n-b1", collector_id="c-b1", sequence=1, tables=[_rows("gpu", _gpu("n-b1"))])
    with grpc.insecure_channel(a.address) as ch:
        call = telemetry_pb2_grpc.TelemetryStub(ch).StreamSweeps(
            iter([batch]), timeout=10, metadata=((LABEL_KEYS["leaf_switch"], "leaf-02"),))
        with pytest.raises(grpc.RpcError) as err:
            list(call)
    e = err.value
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "node 'n-b1' on leaf switch 'leaf-02' belongs to shard 'b' at " + b.address in e.details()
    assert dict(e.trailing_metadata())[SHARD_KEY] == "b"
    assert dict(e.trailing_metadata())[ADDRESS_KEY] == b.address
    assert a.ingest.accepted_batches == 0 and a.ingest.last_sequence("c-b1") is None
    # a node whose leaf nobody said: refused too, saying so, not taken
    batch.node = "n-x"
    with grpc.insecure_channel(a.address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            list(telemetry_pb2_grpc.TelemetryStub(ch).StreamSweeps(iter([batch]), timeout=10))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "node 'n-x'" in err.value.details() and "names no leaf switch" in err.value.details()
    assert SHARD_KEY not in dict(err.value.trailing_metadata() or ())
    metrics = generate_latest(a.registry).decode()
    assert f'foreshock_shard_info{{address="{a.settings.shard_map.shard("a").address}",shard="a"}} 1.0' in metrics
    assert 'foreshock_shard_redirected_streams_total{to_shard="b"} 1.0' in metrics
    assert "foreshock_shard_unplaced_streams_total 1.0" in metrics
    lint = subprocess.run(["promtool", "check", "metrics"], input=metrics, capture_output=True, text=True, timeout=30)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    # a's service goes on: its own node is taken
    batch.node, batch.collector_id = "n-a1", "c-a1"
    batch.tables[0].CopyFrom(_rows("gpu", _gpu("n-a1")))
    with grpc.insecure_channel(a.address) as ch:
        acks = list(telemetry_pb2_grpc.TelemetryStub(ch).StreamSweeps(
            iter([batch]), timeout=10, metadata=((LABEL_KEYS["leaf_switch"], "leaf-01"),)))
    assert acks and acks[-1].acked_sequence == 1 and a.ingest.last_sequence("c-a1") == 1


def test_an_inventory_row_in_the_batch_places_the_node(shards):
    """Without labels in the metadata, the node's inventory row (the demo and simulator send one first)
    is what places it."""
    planes, _ = shards
    inv = sch.to_table("inventory", [{"ts": dt.datetime.now(dt.timezone.utc), "node": "n-b2",
                                      "leaf_switch": "leaf-02", "site": "dc1"}])
    batch = tpb.SweepBatch(node="n-b2", collector_id="c-b2", sequence=1, tables=[_rows("inventory", inv)])
    with grpc.insecure_channel(planes["a"].address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            list(telemetry_pb2_grpc.TelemetryStub(ch).StreamSweeps(iter([batch]), timeout=10))
    assert dict(err.value.trailing_metadata())[SHARD_KEY] == "b"
    with grpc.insecure_channel(planes["b"].address) as ch:
        acks = list(telemetry_pb2_grpc.TelemetryStub(ch).StreamSweeps(iter([batch]), timeout=10))
    assert acks[-1].acked_sequence == 1
    assert wait_until(lambda: planes["b"].nodes.topo("n-b2").leaf_switch == "leaf-02")


def test_an_uplink_with_a_stale_map_is_redirected_to_its_shard_and_loses_no_sweep(shards, tmp_path):
    planes, _ = shards
    a, b = planes["a"], planes["b"]
    # The collector's copy of the map still places leaf-02 in shard a.
    stale = _write(tmp_path / "stale.toml", two_shard_map(a.address, b.address, a_leaves=("leaf-01", "leaf-02"),
                                                      b_leaves=("leaf-03",)))
    up = StreamingUplink("", node="n-b1", shard_map=ShardMapFile(stale), labels={"leaf_switch": "leaf-02"},
                         backoff_initial=0.05, backoff_max=0.2, connect_timeout=2)
    assert up.target == a.address
    up.start()
    try:
        for _ in range(5):
            assert up.submit({"gpu": _gpu("n-b1")})
        assert wait_until(lambda: up.stats()["acked"] == 5, timeout=15), up.stats()
        stats = up.stats()
        assert (stats["target"], stats["shard"], stats["redirects"], stats["dropped_oldest"]) == (b.address, "b", 1, 0)
        assert b.ingest.last_sequence(up.collector_id) == 5
        assert a.ingest.last_sequence(up.collector_id) is None and a.ingest.accepted_batches == 0
        assert wait_until(lambda: b.ingest.accepted_rows["gpu"] == 5)
        # the collector's /metrics says where it streams, and that it was sent there
        text = collector_metrics.render(Collector("n-b1", [], None, uplink=up)).decode()
        assert f'foreshock_collector_uplink_target_info{{shard="b",target="{b.address}"}} 1.0' in text
        assert "foreshock_collector_uplink_redirects_total 1.0" in text
        lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
        assert lint.returncode == 0, lint.stdout + lint.stderr
    finally:
        up.close(2)


def test_redirects_are_bounded_when_the_shards_maps_disagree(tmp_path):
    """Two shards each sure the node is the other's: the uplink follows at most max_redirects in a row,
    then backs off; its queue keeps its bound and nothing is acknowledged that no one took."""
    addresses = {name: f"127.0.0.1:{free_port()}" for name in "ab"}
    maps = {"a": load(_write(tmp_path / "a.toml", two_shard_map(addresses["a"], addresses["b"], a_leaves=("leaf-01",),
                                                            b_leaves=("leaf-02",)))),
            "b": load(_write(tmp_path / "b.toml", two_shard_map(addresses["a"], addresses["b"], a_leaves=("leaf-02",),
                                                            b_leaves=("leaf-01",))))}
    planes = {}
    try:
        for name in "ab":
            planes[name] = build_server(Settings.insecure_loopback(
                tmp_path / name, scorer=NullScorer(), listen=addresses[name], shard=name, shard_map=maps[name]))
            planes[name].start()
        up = StreamingUplink("", node="n1", shard_map=ShardMapFile(tmp_path / "a.toml"),
                             labels={"leaf_switch": "leaf-02"}, max_redirects=2, max_queue=3,
                             backoff_initial=0.3, backoff_max=0.3, connect_timeout=2).start()
        try:
            for _ in range(5):
                up.submit({"gpu": _gpu("n1")})
            assert wait_until(lambda: up.stats()["reconnects"] >= 3, timeout=15)
            time.sleep(0.5)
            s = up.stats()
            # each cycle: 2 redirects followed at once, the 3rd refused and backed off (a reconnect), then
            # from the map's shard again; never a tight loop
            assert 2 <= s["redirects"] <= 2 * (s["reconnects"] + 1), s
            assert (s["acked"], s["dropped_oldest"]) == (0, 2), s
            assert all(p.ingest.accepted_batches == 0 for p in planes.values())
        finally:
            up.close(0.5)
        assert up.stats()["unsent_at_close"] == 3   # the queue's bound, all kept to the end
    finally:
        for p in planes.values():
            p.stop(0.2)


def test_an_uplink_moves_when_its_map_file_changes(tmp_path):
    addresses = {name: f"127.0.0.1:{free_port()}" for name in "ab"}
    planes = {}
    try:
        for name in "ab":   # unsharded planes: only the collector's map decides here
            planes[name] = build_server(Settings.insecure_loopback(tmp_path / name, scorer=NullScorer(),
                                                                   listen=addresses[name]))
            planes[name].start()
        path = _write(tmp_path / "map.toml", two_shard_map(addresses["a"], addresses["b"]))
        up = StreamingUplink("", node="n1", shard_map=ShardMapFile(path), labels={"leaf_switch": "leaf-01"},
                             backoff_initial=0.05, backoff_max=0.2, connect_timeout=2).start()
        try:
            up.submit({"gpu": _gpu("n1")})
            assert wait_until(lambda: up.stats()["acked"] == 1, timeout=10)
            assert planes["a"].ingest.last_sequence(up.collector_id) == 1
            _write(path, two_shard_map(addresses["a"], addresses["b"], a_leaves=("leaf-02",), b_leaves=("leaf-01",)))
            st = path.stat()
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))   # a new mtime, whatever the clock
            assert wait_until(lambda: up.stats()["target"] == addresses["b"], timeout=10)
            for _ in range(3):
                up.submit({"gpu": _gpu("n1")})
            assert wait_until(lambda: up.stats()["acked"] == 4, timeout=10)
            assert planes["b"].ingest.last_sequence(up.collector_id) == 4
            assert planes["a"].ingest.last_sequence(up.collector_id) == 1
            assert (up.stats()["shard"], up.stats()["shard_moves"]) == ("b", 1)
            # a map that no longer parses leaves the last good one in force, and says so
            path.write_text("[shards.a]\naddress = 1\n")
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
            up.shard_map.request_reload()
            assert up.shard_map.current().shard("b").address == addresses["b"]
            assert up.shard_map.failed_reloads >= 1
        finally:
            up.close(1)
    finally:
        for p in planes.values():
            p.stop(0.2)


def test_an_uplink_refuses_a_map_that_does_not_place_its_node(tmp_path):
    path = _write(tmp_path / "map.toml", two_shard_map("127.0.0.1:1", "127.0.0.1:2"))
    with pytest.raises(UplinkError, match=r"node 'n1' \(leaf switch 'leaf-77'\) is in no shard"):
        StreamingUplink("", node="n1", shard_map=ShardMapFile(path), labels={"leaf_switch": "leaf-77"})
    with pytest.raises(UplinkError, match="uplink label site 'dc\\u00e9'"):
        StreamingUplink("", node="n1", shard_map=ShardMapFile(path), labels={"leaf_switch": "leaf-01", "site": "dc\u00e9"})
    with pytest.raises(UplinkError, match="the map names the target"):
        StreamingUplink("127.0.0.1:1", node="n1", shard_map=ShardMapFile(path), labels={"leaf_switch": "leaf-01"})


# -- `foreshock collect --shard-map`, a real process ------------------------------------------------------
def _collect(tmp_path, *flags) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORESHOCK_")}
    return subprocess.Popen(
        [sys.executable, "-m", "foreshock", "collect", "--sources", "simulated", "--interval", "0.1",
         "--metrics-listen", "", "--node", "n1", "--out", str(tmp_path / "spool"), "--sim-gpus", "1",
         "--sim-hcas", "1", *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.parametrize("flags,message", [
    (["--leaf-switch", "leaf-77"], "node 'n1' (leaf switch 'leaf-77') is in no shard"),
    ([], "node 'n1' (leaf switch '') is in no shard (give --leaf-switch)"),
    (["--leaf-switch", "leaf-01", "--service", "127.0.0.1:1"], "--service and --shard-map are exclusive"),
    (["--leaf-switch", "leaf 01"], "leaf_switch from flag --leaf-switch: must be at most 256 printable ASCII"),
])
def test_collect_refuses_a_map_that_does_not_place_its_node_before_opening_anything(tmp_path, flags, message):
    path = _write(tmp_path / "map.toml", two_shard_map("127.0.0.1:1", "127.0.0.1:2"))
    proc = _collect(tmp_path, "--shard-map", str(path), *flags)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and message in err, err
    assert not (tmp_path / "spool").exists()


def test_collect_moves_to_the_shard_the_map_names_after_sighup(tmp_path):
    """The new map has the old one's size and mtime, so only SIGHUP can make the collector read it."""
    addresses = {name: f"127.0.0.1:{free_port()}" for name in "ab"}
    planes = {}
    proc = None
    try:
        for name in "ab":   # unsharded planes: only the collector's map decides here
            planes[name] = build_server(Settings.insecure_loopback(tmp_path / name, scorer=NullScorer(),
                                                                   listen=addresses[name]))
            planes[name].start()
        path = _write(tmp_path / "map.toml", two_shard_map(addresses["a"], addresses["b"]))
        stamp = path.stat()
        proc = _collect(tmp_path, "--shard-map", str(path), "--leaf-switch", "leaf-01")
        a, b = planes["a"].ingest, planes["b"].ingest
        assert wait_until(lambda: a.accepted_rows["gpu"] >= 3, timeout=30), proc.stderr
        # written beside it, stamped with its mtime and moved over it, so the collector never sees a stamp
        # of its own (a half-written file, or the new text before its mtime is set back)
        staged = _write(tmp_path / "map.toml.new", two_shard_map(addresses["a"], addresses["b"],
                                                                   a_leaves=("leaf-02",), b_leaves=("leaf-01",)))
        os.utime(staged, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
        os.replace(staged, path)
        assert (path.stat().st_size, path.stat().st_mtime_ns) == (stamp.st_size, stamp.st_mtime_ns)
        time.sleep(1.5)
        assert b.accepted_rows["gpu"] == 0   # not read again yet
        proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: b.accepted_rows["gpu"] >= 3, timeout=15)
        moved_at = a.accepted_rows["gpu"]
        time.sleep(0.5)
        assert a.accepted_rows["gpu"] == moved_at   # a hears no more from it
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)   # a stop past its bound exits 1 with the threads' stacks
        assert proc.returncode == 0, err
        assert "now places it in shard b" in err
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.communicate()
        for p in planes.values():
            p.stop(0.2)


def test_serve_checks_the_map_against_an_inventory_dataset_naming_the_offenders(tmp_path):
    from foreshock import config
    from foreshock.dataset import DatasetWriter
    from foreshock.service import command

    now = dt.datetime.now(dt.timezone.utc)
    writer = DatasetWriter(tmp_path / "ds", fsync=False)
    writer.append_table("inventory", sch.to_table("inventory", [
        {"ts": now, "node": "n1", "leaf_switch": "leaf-01"}, {"ts": now, "node": "n2", "leaf_switch": "leaf-02"},
        {"ts": now, "node": "n3", "leaf_switch": "leaf-03"}]))
    writer.close()
    f = _write(tmp_path / "map.toml", two_shard_map("127.0.0.1:1", "127.0.0.1:2", b_leaves=("leaf-02", "leaf-09")))

    def settings(**flags):
        cfg = config.resolve("serve", command.DEFAULTS, env={}, flags={
            "no_model": True, "insecure": True, "state": str(tmp_path / "s"), **flags})
        return command.settings_from(cfg)

    with pytest.raises(SettingsError) as err:
        settings(shard="a", shard_map=str(f), shard_inventory=str(tmp_path / "ds"))
    assert "leaves the inventory does not have: leaf-09" in str(err.value)
    assert "leaves no shard owns: leaf-03" in str(err.value)
    with pytest.raises(SettingsError, match="no inventory rows"):
        settings(shard="a", shard_map=str(f), shard_inventory=str(tmp_path / "empty"))
    with pytest.raises(SettingsError, match="--shard and --shard-map go together"):
        settings(shard_map=str(f))
    with pytest.raises(SettingsError, match="give --shard and --shard-map too"):
        settings(shard_inventory=str(tmp_path / "ds"))
    fits = _write(tmp_path / "fits.toml", two_shard_map("127.0.0.1:1", "127.0.0.1:2", b_leaves=("leaf-02", "leaf-03")))
    s = settings(shard="b", shard_map=str(fits), shard_inventory=str(tmp_path / "ds"))
    assert (s.shard, s.shard_map.current().shard("b").leaves) == ("b", frozenset({"leaf-02", "leaf-03"}))
    assert not (tmp_path / "s").exists()


def test_a_reread_of_an_unchanged_map_keeps_the_redirect(tmp_path):
    """SIGHUP on a map that did not change must not send the uplink back to a shard that redirected it."""
    path = _write(tmp_path / "map.toml", two_shard_map("127.0.0.1:1", "127.0.0.1:2"))
    f = ShardMapFile(path)
    first = f.current()
    f.request_reload()
    assert f.current() is first and f.reloads == 0
    _write(path, two_shard_map("127.0.0.1:1", "127.0.0.1:3"))
    f.request_reload()
    assert f.current().shard("b").address == "127.0.0.1:3" and f.reloads == 1


def test_two_serve_processes_and_an_uplink_sent_from_a_to_b(tmp_path):
    """`foreshock serve --shard` as real processes: each says its shard on /metrics, and a collector whose
    stale map names shard a for its leaf ends up streaming every sweep to b."""
    import urllib.request

    from support import Serve

    addresses = {name: f"127.0.0.1:{free_port()}" for name in "ab"}
    path = _write(tmp_path / "shards.toml", two_shard_map(addresses["a"], addresses["b"]))
    stale = _write(tmp_path / "stale.toml", two_shard_map(addresses["a"], addresses["b"], a_leaves=("leaf-01", "leaf-02"),
                                                      b_leaves=("leaf-03",)))
    serves = {}
    try:
        for name in "ab":
            serves[name] = Serve(tmp_path / name, "--listen", addresses[name], "--shard", name, "--shard-map", str(path))
        assert all(serves[n].address == addresses[n] for n in "ab")
        assert f"listening on {addresses['a']} as shard a, metrics on" in serves["a"].banner
        up = StreamingUplink("", node="n-b1", shard_map=ShardMapFile(stale), labels={"leaf_switch": "leaf-02"},
                             backoff_initial=0.05, backoff_max=0.2, connect_timeout=5).start()
        try:
            for _ in range(4):
                up.submit({"gpu": _gpu("n-b1")})
            assert wait_until(lambda: up.stats()["acked"] == 4, timeout=20), up.stats()
            assert (up.stats()["target"], up.stats()["redirects"]) == (addresses["b"], 1)
        finally:
            up.close(2)

        def scrape(name):
            return urllib.request.urlopen(f"http://{serves[name].metrics}/metrics", timeout=10).read().decode()
        a_text, b_text = scrape("a"), scrape("b")
        assert f'foreshock_shard_info{{address="{addresses["a"]}",shard="a"}} 1.0' in a_text
        assert 'foreshock_shard_redirected_streams_total{to_shard="b"} 1.0' in a_text
        assert 'foreshock_ingest_rows_total{table="gpu"} 4.0' in b_text
        assert 'foreshock_ingest_rows_total{table="gpu"}' not in a_text or \
            'foreshock_ingest_rows_total{table="gpu"} 0.0' in a_text
        assert all(serves[n].term() == 0 for n in "ab")
    finally:
        for s in serves.values():
            s.kill()
