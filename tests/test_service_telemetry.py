"""Telemetry into a real server on port 0: real collectors on simulated nodes stream through the uplink,
a fatal fault evacuates a job's rank to a healthy spare, and every kind of bad batch is refused by name
while the stream and the service go on."""

from __future__ import annotations

import datetime as dt
import math
import queue
import threading
import time

import grpc
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from foreshock import schema as sch
from foreshock.collectors.collector import Collector
from foreshock.collectors.simulated import SimulatedSource
from foreshock.collectors.uplink import StreamingUplink, UplinkError, encode_table
from foreshock.service.decisions import read_decisions
from foreshock.service.scoring import NullScorer
from foreshock.service.server import Settings, build_server
from foreshock.simulator.live import LiveCluster
from foreshock.simulator.topology import Topology
from foreshock.v1 import jobs_pb2 as jpb
from foreshock.v1 import jobs_pb2_grpc, telemetry_pb2 as tpb, telemetry_pb2_grpc
from support import wait_until

T = 10


_wait = wait_until


def _drain(stream, into):
    try:
        for item in stream:
            into.put(item)
    except grpc.RpcError:
        pass


class Sweeper:
    """Real collectors (foreshock.collectors.Collector) on simulated nodes, swept every `interval` s."""

    def __init__(self, cluster, address, interval=0.25):
        self.cluster = cluster
        self.interval = interval
        inv = cluster.inventory()
        self.collectors = []
        for node in cluster.nodes:
            up = StreamingUplink(address, node=node, backoff_initial=0.1, ack_timeout=5).start()
            up.submit({"inventory": inv.filter(pc.equal(inv.column("node"), node))})
            self.collectors.append(Collector(node, [SimulatedSource(node, node_model=cluster.node_model(node))],
                                             None, uplink=up))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            ts = time.time_ns()
            for c in self.collectors:
                c.sweep_once(ts)
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)
        for c in self.collectors:
            c.uplink.close(2.0)


@pytest.fixture
def plane_settings():
    return {"scorer": NullScorer(), "decision_flush_seconds": 0.0}


def test_collectors_stream_and_a_fatal_fault_moves_the_rank_to_a_spare_on_another_leaf(plane, tmp_path):
    cluster = LiveCluster(Topology(nodes=8, nodes_per_leaf=4, job_nodes=4, gpus_per_node=2, hcas_per_node=2),
                          seed=3, rate_scale=0)
    nodes = cluster.nodes
    with grpc.insecure_channel(plane.address) as ch:
        jobs = jobs_pb2_grpc.JobsStub(ch)
        jobs.RegisterJob(jpb.RegisterJobRequest(
            job_id="llama", ranks=[jpb.RankPlacement(rank=i, node=nodes[i], gpus=[0, 1]) for i in range(4)],
            spare_nodes=[nodes[6], nodes[5]], current_step=50), timeout=T)
        got: queue.Queue = queue.Queue()
        watch = jobs.WatchDirectives(jpb.WatchDirectivesRequest(job_id="llama", rank=1), timeout=60)
        threading.Thread(target=_drain, args=(watch, got), daemon=True).start()
        with Sweeper(cluster, plane.address) as sweeper:
            assert _wait(lambda: plane.ingest.accepted_batches >= 3 * len(nodes))
            assert plane.nodes.topo(nodes[1]).leaf_switch == "leaf-000"
            assert _wait(lambda: all(n in plane.nodes.last_seen_ns for n in nodes))
            cluster.inject(nodes[1], "gpu", component=0, lead_seconds=0.5)
            d = got.get(timeout=20)
            ups = [c.uplink.stats() for c in sweeper.collectors]
        watch.cancel()
    assert (d.kind, list(d.ranks), d.from_node) == (jpb.DIRECTIVE_KIND_EVACUATE, [1], nodes[1])
    assert d.to_node == nodes[5]            # healthy, under the other leaf, lowest name
    assert "Xid 79 on GPU 0" in d.reason or "GPU 0 lost" in d.reason   # whichever the node reported first
    assert plane.ingest.rejected == {}
    assert all(u["dropped_oldest"] == 0 and u["rejected"] == {} and u["acked"] > 0 for u in ups)
    plane.decisions.flush()
    log = read_decisions(plane.state_dir / "decisions").to_pylist()
    (ev,) = [r for r in log if r["kind"] == "evacuate"]
    assert ev["directive_id"] == d.directive_id and ev["node"] == nodes[1]


# -- bad input -------------------------------------------------------------------------------------
NOW = dt.datetime.now(dt.timezone.utc)


def _gpu(node="n1", ts=None, **cols):
    row = {"ts": ts or dt.datetime.now(dt.timezone.utc), "node": node, "gpu": 0, "gpu_lost": False, **cols}
    return sch.to_table("gpu", [row])


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def _rows(name, table=None, raw=None, version=1):
    return tpb.TableRows(table=name, schema_version=version, arrow_ipc=raw if raw is not None else _ipc(table))


def _host_net(node="n1", **cols):
    return sch.to_table("host_net", [{"ts": dt.datetime.now(dt.timezone.utc), "node": node, **cols}])


CASES = [
    ("unknown_table", [_rows("gpus", _gpu())]),
    ("unknown_table", [_rows("incidents", sch.to_table("incidents", []))]),
    ("unknown_table", [_rows("step_times", sch.to_table("step_times", []))]),
    ("bad_schema_version", [_rows("gpu", _gpu(), version=2)]),
    ("bad_ipc", [_rows("gpu", raw=b"\xff\xff\xff\xff garbage")]),
    ("bad_ipc", [_rows("gpu", raw=b"")]),
    ("bad_schema", [_rows("gpu", pa.table({"ts": pa.array([0], pa.timestamp("ns", tz="UTC")), "node": ["n1"],
                                          "gpu": [0], "gpu_lost": [False], "bogus": [1]}))]),
    ("bad_schema", [_rows("gpu", pa.table({"ts": pa.array([0], pa.timestamp("ns", tz="UTC")), "node": ["n1"],
                                          "gpu": ["zero"], "gpu_lost": [False]}))]),
    # A negative NRestarts: the column is uint32, so the cast at receipt refuses it.
    ("bad_schema", [_rows("systemd_unit", pa.table({"ts": pa.array([0], pa.timestamp("ns", tz="UTC")),
                                                    "node": ["n1"], "unit": ["nvidia-fabricmanager.service"],
                                                    "n_restarts": pa.array([-1], pa.int64())}))]),
    ("node_mismatch", [_rows("gpu", _gpu(node="n2"))]),
    ("ts_future", [_rows("gpu", _gpu(ts=NOW + dt.timedelta(hours=2)))]),
    ("ts_past", [_rows("gpu", _gpu(ts=NOW - dt.timedelta(days=30)))]),
    ("nan_value", [_rows("gpu", _gpu(temperature_c=math.nan))]),
    ("nan_value", [_rows("gpu", _gpu(power_w=math.inf))]),
    ("negative_counter", [_rows("host_net", _host_net(Tcp_RetransSegs=-5))]),
    ("negative_counter", [_rows("gpu", _gpu(energy_j=-1.0))]),
    ("oversized", [_rows("gpu", raw=b"\xff\xff\xff\xff" + b"\0" * (5 << 20))]),
]


def _stream(plane, batches, node="n1"):
    """Send `batches` on one stream; once all are answered and a scoring round has checked their values,
    send an empty heartbeat batch, whose ack carries the verdicts of the round's value checks."""
    outgoing: queue.Queue = queue.Queue()
    for b in batches:
        outgoing.put(b)

    def requests():
        while (item := outgoing.get()) is not None:
            yield item
    acks = []
    cid = batches[0].collector_id or "c1"
    with grpc.insecure_channel(plane.address, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        for ack in telemetry_pb2_grpc.TelemetryStub(ch).StreamSweeps(requests(), timeout=T):
            acks.append(ack)
            if len(acks) == len(batches):
                rounds = sum(plane.scoring.rounds.values())
                assert _wait(lambda: plane.scoring.backlog() == 0 and sum(plane.scoring.rounds.values()) > rounds + 1)
                outgoing.put(tpb.SweepBatch(node=node, collector_id=cid, sequence=10_000))
            elif len(acks) > len(batches):
                outgoing.put(None)
    return acks


@pytest.mark.parametrize("reason, tables", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_each_bad_table_is_refused_by_name_and_the_rest_of_the_batch_is_taken(plane, reason, tables):
    good = _rows("netdev", sch.to_table("netdev", [{"ts": NOW, "node": "n1", "iface": "eth0", "mtu": 1500}]))
    acks = _stream(plane, [tpb.SweepBatch(node="n1", collector_id="c1", sequence=1, tables=tables + [good]),
                           tpb.SweepBatch(node="n1", collector_id="c1", sequence=2, tables=[good])])
    assert [a.acked_sequence for a in acks] == [1, 2, 10_000]
    rejs = [r for a in acks for r in a.rejections]   # on receipt, or after the round's value checks
    assert len(rejs) == 1, rejs
    rej = rejs[0]
    assert (rej.sequence, rej.reason) == (1, reason) and rej.detail
    assert plane.ingest.accepted_rows["netdev"] == 2 and plane.ingest.accepted_rows["gpu"] == 0
    assert plane.ingest.rejected[reason] == 1


def test_bad_batches_and_a_stream_that_changes_node(plane):
    t = _rows("gpu", _gpu())
    acks = _stream(plane, [
        tpb.SweepBatch(node="", collector_id="c1", sequence=1, tables=[t]),
        tpb.SweepBatch(node="n1", collector_id="", sequence=2, tables=[t]),
        tpb.SweepBatch(node="n1", collector_id="c1", sequence=3, tables=[t]),
        tpb.SweepBatch(node="n2", collector_id="c1", sequence=4, tables=[_rows("gpu", _gpu(node="n2"))]),
        tpb.SweepBatch(node="n1", collector_id="c1", sequence=5, tables=[t] * 40),
        tpb.SweepBatch(node="n1", collector_id="c1", sequence=3, tables=[t]),   # a re-send: not ingested again
    ])
    assert [[r.reason for r in a.rejections] for a in acks] == [
        ["bad_batch"], ["bad_batch"], [], ["node_mismatch"], ["bad_batch"], [], []]
    assert plane.ingest.accepted_rows["gpu"] == 1 and plane.ingest.duplicate_batches == 1
    assert all(a.credits >= 1 for a in acks)


def test_a_message_over_the_grpc_limit_ends_only_that_stream(tmp_path):
    plane = build_server(Settings.insecure_loopback(tmp_path, scorer=NullScorer(), max_message_bytes=1 << 20))
    plane.start()
    try:
        huge = tpb.SweepBatch(node="n1", collector_id="c1", sequence=1,
                              tables=[_rows("gpu", raw=b"\0" * (2 << 20))])
        with pytest.raises(grpc.RpcError) as info:
            _stream(plane, [huge])
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        acks = _stream(plane, [tpb.SweepBatch(node="n1", collector_id="c2", sequence=1, tables=[_rows("gpu", _gpu())])])
        assert acks[0].acked_sequence == 1 and not any(a.rejections for a in acks)
    finally:
        plane.stop(0)


def test_fatal_event_wakes_a_scoring_round_at_once(tmp_path):
    plane = build_server(Settings.insecure_loopback(tmp_path, scorer=NullScorer(), score_interval=30.0))
    plane.start()
    try:
        # Xid 95 is never collateral (foreshock/xid.py): it does not wait for the Xid context's window.
        ev = sch.to_table("events", [{"ts": NOW, "node": "n1", "kind": "xid", "source": "kmsg", "severity": "fatal",
                                      "xid": 95, "gpu": 2, "message": "Uncontained: LTC TAG (0x2,0x0)"}])
        with grpc.insecure_channel(plane.address) as ch:
            batch = tpb.SweepBatch(node="n1", collector_id="c1", sequence=1, tables=[_rows("events", ev)])
            list(telemetry_pb2_grpc.TelemetryStub(ch).StreamSweeps(iter([batch]), timeout=T))
        assert _wait(lambda: plane.scoring.rounds["events"] >= 1, timeout=5)  # at once, not after 30 s
        assert "n1" in plane.policy.alarms and "Xid 95 on GPU 2" in plane.policy.alarms["n1"].reason
    finally:
        plane.stop(0)


# -- the uplink on its own -------------------------------------------------------------------------
def test_uplink_queue_is_bounded_and_drops_the_oldest():
    up = StreamingUplink("127.0.0.1:9", node="n1", max_queue=3)   # never started: nothing is sent
    for _ in range(5):
        assert up.submit({"gpu": _gpu()})
    s = up.stats()
    assert (s["queued"], s["dropped_oldest"], s["submitted"]) == (3, 2, 5)
    assert not up.submit({"nonsense": _gpu()})


def test_uplink_refuses_plaintext_off_loopback():
    with pytest.raises(UplinkError, match="loopback"):
        StreamingUplink("10.1.2.3:7443", node="n1")


def test_uplink_reconnects_with_backoff_and_resends_unacknowledged(tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    up = StreamingUplink(f"127.0.0.1:{port}", node="n1", backoff_initial=0.05, backoff_max=0.2,
                         connect_timeout=0.2).start()
    try:
        for _ in range(3):
            up.submit({"gpu": _gpu()})
        assert _wait(lambda: up.stats()["reconnects"] >= 2, timeout=10)   # nobody listens yet
        plane = build_server(Settings.insecure_loopback(tmp_path, scorer=NullScorer(), listen=f"127.0.0.1:{port}"))
        plane.start()
        try:
            assert _wait(lambda: up.stats()["acked"] == 3, timeout=15)
            assert _wait(lambda: plane.ingest.accepted_rows["gpu"] == 3)
            assert plane.ingest.duplicate_batches == 0
        finally:
            plane.stop(0)
    finally:
        up.close(0.5)


def test_encode_table_keeps_schema_v1_types():
    t = _gpu(temperature_c=40.0)
    back = pa.ipc.open_stream(encode_table("gpu", t)).read_all()
    assert back.schema.equals(sch.schema("gpu"), check_metadata=False)
    assert back.column("temperature_c").to_pylist() == [40.0]


@pytest.mark.slow
def test_foreshock_collect_service_streams_into_the_control_plane(plane, tmp_path):
    """The real node service (`foreshock collect --service`) as a process, streaming to this server."""
    import signal
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-m", "foreshock.cli", "collect", "--sources", "simulated",
                             "--node", "sim-1", "--out", str(tmp_path / "data"), "--interval", "0.2",
                             "--metrics-listen", "", "--service", plane.address],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert _wait(lambda: plane.ingest.accepted_rows["gpu"] >= 3 * 8, timeout=60), proc.stderr.read() \
            if proc.poll() is not None else plane.ingest.stats()
        assert plane.ingest.rejected == {} and "sim-1" in plane.nodes.last_seen_ns
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert proc.returncode == 0
