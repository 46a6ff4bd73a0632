"""The telemetry path at scale, in a real server on port 0: schemas once a stream, value-check verdicts
that reach a collector even when its stream ends first, de-duplication that survives a restart, and
the scoring worker process (its verdicts, its scores, and its death: reported, restarted, service on)."""

from __future__ import annotations

import functools
import math
import os
import queue
import signal
import threading
import time
import urllib.request

import grpc
import pyarrow as pa
import pytest

from foreshock.collectors.simulated import SimpleNodeModel
from foreshock.collectors.uplink import StreamingUplink, encode_table, split_stream
from foreshock.service.scoring import NullScorer
from foreshock.service.server import Settings, build_server
from foreshock.v1 import telemetry_pb2 as tpb
from foreshock.v1 import telemetry_pb2_grpc
from support import wait_until

T = 10


_wait = functools.partial(wait_until, step=0.02)


class RawStream:
    """A collector's stream at the wire: SweepBatch in, SweepAck out."""

    def __init__(self, address):
        self.channel = grpc.insecure_channel(address)
        self.q: queue.Queue = queue.Queue()
        self.acks: queue.Queue = queue.Queue()

        def requests():
            while (item := self.q.get()) is not None:
                yield item
        self.call = telemetry_pb2_grpc.TelemetryStub(self.channel).StreamSweeps(requests(), timeout=60)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        try:
            for ack in self.call:
                self.acks.put(ack)
        except grpc.RpcError:
            pass
        self.acks.put(None)

    def send(self, node, seq, tables, collector="c-1"):
        self.q.put(tpb.SweepBatch(node=node, collector_id=collector, sequence=seq, tables=tables))
        return self.acks.get(timeout=T)

    def close(self):
        """Half-close; every ack the server still sends, until it ends the stream."""
        self.q.put(None)
        out = []
        while (ack := self.acks.get(timeout=T)) is not None:
            out.append(ack)
        self.channel.close()
        return out


def _rows(node, ts, tables=("gpu", "rdma_port")):
    return {k: v for k, v in SimpleNodeModel(node, gpus=2, hcas=2, seed=1).sample(ts).items() if k in tables}


def _nan_gpu(node, ts):
    gpu = _rows(node, ts, ("gpu",))["gpu"]
    i = gpu.schema.get_field_index("temperature_c")
    return gpu.set_column(i, gpu.schema.field(i), pa.array([math.nan] * gpu.num_rows, gpu.schema.field(i).type))


def test_the_schema_goes_once_a_stream_and_an_unsent_one_is_refused(plane):
    up = StreamingUplink(plane.address, node="n1", backoff_initial=0.1).start()
    sizes = []
    try:
        for k in range(6):
            before = plane.ingest.bytes_received
            up.submit(_rows("n1", time.time_ns()))
            assert _wait(lambda: up.stats()["acked"] == k + 1)
            sizes.append(plane.ingest.bytes_received - before)
    finally:
        up.close(2)
    assert not up.stats()["rejected"] and plane.ingest.accepted_batches == 6
    # The first batches (before the server's first ack said it keeps schemas) carry them whole.
    assert sizes[-1] < 0.6 * sizes[0], sizes
    assert plane.ingest.accepted_rows["rdma_port"] == 6 * 2

    s = RawStream(plane.address)
    body = split_stream(encode_table("gpu", _rows("n2", time.time_ns(), ("gpu",))["gpu"]))[1]
    ack = s.send("n2", 1, [tpb.TableRows(table="gpu", schema_version=1, arrow_ipc=body, schema_omitted=True)])
    assert ack.schemas_kept and [r.reason for r in ack.rejections] == ["unknown_schema"]
    whole = encode_table("gpu", _rows("n2", time.time_ns(), ("gpu",))["gpu"])
    ack = s.send("n2", 2, [tpb.TableRows(table="gpu", schema_version=1, arrow_ipc=whole)])
    assert not ack.rejections
    body = split_stream(encode_table("gpu", _rows("n2", time.time_ns(), ("gpu",))["gpu"]))[1]
    ack = s.send("n2", 3, [tpb.TableRows(table="gpu", schema_version=1, arrow_ipc=body, schema_omitted=True)])
    assert not ack.rejections
    ack = s.send("n2", 4, [tpb.TableRows(table="gpu", schema_version=1, arrow_ipc=b"\xff\xff\xff\xffjunk" * 4,
                                         schema_omitted=True)])
    s.close()
    assert _wait(lambda: plane.ingest.accepted_rows["gpu"] >= 2 * 6 + 2 * 2)
    assert plane.ingest.rejected["unknown_schema"] == 1


def test_a_value_check_verdict_reaches_a_collector_whose_stream_ends_first(plane):
    s = RawStream(plane.address)
    ack = s.send("n3", 1, [tpb.TableRows(table="gpu", schema_version=1, arrow_ipc=encode_table("gpu", _nan_gpu("n3", time.time_ns())))])
    assert not ack.rejections                     # the value checks run with the next drain
    late = s.close()                              # ... after the collector half-closed
    assert [(r.sequence, r.reason) for a in late for r in a.rejections] == [(1, "nan_value")]

    # The uplink hears the server out when it closes.
    up = StreamingUplink(plane.address, node="n4", backoff_initial=0.1).start()
    up.submit({"gpu": _nan_gpu("n4", time.time_ns())})
    assert _wait(lambda: up.stats()["acked"] == 1)
    up.close(3)
    assert up.rejections["nan_value"] == 1, up.stats()

    # A stream that breaks before the checks ran: the verdict rides on the collector's next stream.
    s = RawStream(plane.address)
    s.send("n3", 2, [tpb.TableRows(table="gpu", schema_version=1, arrow_ipc=encode_table("gpu", _nan_gpu("n3", time.time_ns())))])
    s.call.cancel()
    # the server has checked the batch and seen the stream end (a loaded machine notices the cancel late)
    assert _wait(lambda: plane.ingest.rejected["nan_value"] == 3 and plane.ingest.connected() == 0)
    s = RawStream(plane.address)
    ack = s.send("n3", 3, [])
    assert [(r.sequence, r.reason) for r in ack.rejections] == [(2, "nan_value")]
    s.close()

    # The collector reconnects before the server noticed its old stream break: the live stream carries
    # the verdict on its next ack, not a stream after it.
    old = RawStream(plane.address)
    old.send("n3", 4, [tpb.TableRows(table="gpu", schema_version=1, arrow_ipc=encode_table("gpu", _nan_gpu("n3", time.time_ns())))])
    assert _wait(lambda: plane.ingest.rejected["nan_value"] == 4)
    new = RawStream(plane.address)
    assert not new.send("n3", 5, []).rejections
    old.call.cancel()
    assert _wait(lambda: plane.ingest.connected() == 1)
    assert [(r.sequence, r.reason) for r in new.send("n3", 6, []).rejections] == [(4, "nan_value")]
    new.close()


def test_a_batch_taken_before_a_restart_is_not_taken_again(tmp_path):
    settings = Settings.insecure_loopback(tmp_path / "state", scorer=NullScorer())
    p = build_server(settings)
    p.start()
    try:
        s = RawStream(p.address)
        for seq in (1, 2, 3):
            s.send("n5", seq, [tpb.TableRows(table="gpu", schema_version=1,
                                             arrow_ipc=encode_table("gpu", _rows("n5", time.time_ns(), ("gpu",))["gpu"]))])
        assert _wait(lambda: p.ingest.accepted_rows["gpu"] == 6)
        s.close()
    finally:
        p.stop(0)
    p = build_server(settings)
    p.start()
    try:
        s = RawStream(p.address)
        gpu = lambda: [tpb.TableRows(table="gpu", schema_version=1,  # noqa: E731
                                     arrow_ipc=encode_table("gpu", _rows("n5", time.time_ns(), ("gpu",))["gpu"]))]
        assert s.send("n5", 3, gpu()).acked_sequence == 3      # re-sent after the restart: acknowledged ...
        assert p.ingest.duplicate_batches == 1                 # ... and not taken again
        s.send("n5", 4, gpu())
        assert _wait(lambda: p.ingest.accepted_rows["gpu"] == 2)
        s.close()
    finally:
        p.stop(0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from foreshock.predictor import synthetic
    return synthetic.pcie_replay_model_dir(tmp_path_factory.mktemp("model"), version="test-worker-1",
                                           rows=600, max_iter=10)


def _metric(port, name):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return None


def test_the_scoring_worker_checks_scores_and_is_restarted_when_it_dies(model_dir, tmp_path):
    p = build_server(Settings.insecure_loopback(tmp_path / "state", model_path=str(model_dir),
                                                metrics_listen="127.0.0.1:0", scorer_grace_seconds=0.1,
                                                scoring_process=True))
    p.start()
    try:
        worker = p.scoring.worker
        assert worker.up and worker.pid != os.getpid()
        s = RawStream(p.address)
        seq = 0

        def sweep(table):
            nonlocal seq
            seq += 1
            return s.send("n6", seq, [tpb.TableRows(table="gpu", schema_version=1, arrow_ipc=encode_table("gpu", table))])

        sweep(_rows("n6", time.time_ns(), ("gpu",))["gpu"])
        assert _wait(lambda: p.ingest.accepted_rows["gpu"] == 2)          # checked in the worker
        # (scored there too: test_service_risk.py runs its risk crossing through this worker)
        sweep(_nan_gpu("n6", time.time_ns()))
        got = []

        def verdict():
            got.extend(sweep(_rows("n6", time.time_ns(), ("gpu",))["gpu"]).rejections)
            return got
        assert _wait(verdict, step=0.2)
        assert [r.reason for r in got] == ["nan_value"] and p.ingest.rejected["nan_value"] == 1

        dead = worker.pid
        os.kill(dead, signal.SIGKILL)
        sweep(_rows("n6", time.time_ns(), ("gpu",))["gpu"])              # a drain finds it dead
        assert _wait(lambda: _metric(p.metrics_port, "foreshock_scoring_worker_restarts_total") == 1.0, 30)
        assert _wait(lambda: worker.pid not in (None, dead)) and "died" in worker.last_error, worker.last_error
        ack = sweep(_rows("n6", time.time_ns(), ("gpu",))["gpu"])        # and the service goes on
        assert ack.acked_sequence == seq
        s.close()
    finally:
        p.stop(0)
    assert p.scoring.worker.pid is None and not p.scoring.worker.up   # stopped, the process reaped


@pytest.mark.parametrize("scoring_process", [True, False], ids=["worker", "in-process"])
def test_the_scorer_state_survives_a_restart(model_dir, tmp_path, scoring_process):
    """A stopped control plane leaves the online scorer's checkpoint in its state directory (written
    by the worker process, or by the service when it scores itself), and the next one carries on from
    it: the nodes, their baselines and counter positions (tests/test_predictor_checkpoint.py checks
    the values)."""
    state = tmp_path / "state"
    settings = dict(model_path=str(model_dir), scorer_grace_seconds=0.1, scoring_process=scoring_process)
    p = build_server(Settings.insecure_loopback(state, **settings))
    p.start()
    try:
        s = RawStream(p.address)
        s.send("n6", 1, [tpb.TableRows(table="gpu", schema_version=1,
                                       arrow_ipc=encode_table("gpu", _rows("n6", time.time_ns(), ("gpu",))["gpu"]))])
        assert _wait(lambda: p.ingest.accepted_rows["gpu"] == 2)
        s.close()
    finally:
        p.stop(0)
    assert (state / "scorer-state.npz").is_file()
    again = build_server(Settings.insecure_loopback(state, **settings))
    again.start()
    try:
        if scoring_process:
            assert again.scoring.worker.restored.startswith("restored 1 nodes"), again.scoring.worker.restored
        else:
            assert again.scorer._online.nodes == ["n6"]
    finally:
        again.stop(0)


def test_the_checkpoint_period_is_range_checked(tmp_path):
    from foreshock.service.server import SettingsError

    with pytest.raises(SettingsError, match="scorer_checkpoint_seconds 0"):
        build_server(Settings.insecure_loopback(tmp_path / "s", scorer=NullScorer(), scorer_checkpoint_seconds=0))
