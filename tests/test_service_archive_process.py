"""The archive's writer in a process of its own (service/archive_process.py), as `foreshock serve
--archive` runs it: it writes the rows the writer thread writes from the same submissions (the scoring
worker's joined batches, the value checks' verdicts, the decision log's rows); a failed write stops it
and nothing else; a killed archive process is said, counted and started again, its unfinished files
removed; a stop publishes everything. Real processes, real files."""

from __future__ import annotations

import datetime as dt
import functools
import logging
import re
import shutil
import signal
import struct
import time
from dataclasses import dataclass, field

import grpc
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from foreshock import dataset as ds
from foreshock import schema as sch
from foreshock.collectors.uplink import StreamingUplink
from foreshock.service import archive_process as ap
from foreshock.service.archive import Archive, ArchiveSettings
from foreshock.service.archive_process import ArchiveProcess
from foreshock.service.decisions import DECISION_SCHEMA, read_decisions
from foreshock.service.scoring import NullScorer
from foreshock.service.server import Settings, build_server
from foreshock.service.validation import RawBatch, wire_schema
from foreshock.service.worker import pack
from foreshock.v1 import jobs_pb2 as jpb
from foreshock.v1 import jobs_pb2_grpc
from support import wait_until

T = 10
_wait = functools.partial(wait_until, timeout=30.0)


def _gpu(node: str, n: int, ts0: int, temperature: float = 40.0) -> pa.Table:
    rows = [{"ts": ts0 + k * 1_000_000, "node": node, "gpu": k % 8, "temperature_c": temperature + k % 7,
             "power_w": 300.0 + k, "gpu_lost": False} for k in range(n)]
    return sch.to_table("gpu", rows)


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def _split(buf: bytes) -> tuple[bytes, bytes]:
    """An IPC stream as ingest keeps a batch of a known schema: the schema message, the record batches."""
    marker, length = struct.unpack_from("<Ii", buf, 0)
    assert marker == 0xFFFFFFFF
    return buf[:8 + length], buf[8 + length:-8]


@dataclass
class Item:
    """A drain's batch as ingest.Pending carries it (what pack and the writer read of one)."""
    node: str
    sequence: int
    tables: dict = field(default_factory=dict)
    nbytes: int = 0


def _drain(now: int) -> tuple[list[Item], list[tuple]]:
    """Twelve nodes' batches, as the scoring worker path hands them over: known-schema record batches
    sharing one schema message (the round decoder's groups), one batch decoded, one refused by the
    value checks (its verdict), with events beside."""
    items = []
    head = None
    for j in range(12):
        t = _gpu(f"n{j:02d}", 16, now + j)
        h, body = _split(_ipc(t.cast(wire_schema("gpu"))))
        head = head or h   # ingest keeps one schema message per known schema
        items.append(Item(f"n{j:02d}", j + 1, {"gpu": RawBatch(head, body)}, len(h) + len(body)))
    items[3].tables["gpu"] = _gpu("n03", 16, now + 3).cast(wire_schema("gpu"))   # decoded in the service
    events = sch.to_table("events", [{"ts": dt.datetime.fromtimestamp(now / 1e9, dt.timezone.utc), "node": "n05",
                                      "kind": "xid", "source": "kmsg", "xid": 31}])
    items[5].tables["events"] = events.cast(wire_schema("events"))
    refused = [(7, "gpu", "nan_value", "temperature_c")]
    return items, refused


def _decisions(now: int) -> pa.Table:
    ts = dt.datetime.fromtimestamp(now / 1e9, dt.timezone.utc)
    return pa.Table.from_pylist([
        {"ts": ts, "kind": "alarm", "node": "n02", "reason": "fatal: Xid 79 on GPU 0"},
        {"ts": ts, "kind": "evacuate", "node": "n02", "job": "j", "directive_id": "d1", "to_node": "s1"}],
        schema=DECISION_SCHEMA)


def _archived(root, table: str) -> pa.Table:
    files = sorted((root / f"table={table}").rglob("part-*.parquet"), key=lambda f: f.name.split("-")[1])
    return pa.concat_tables([pq.read_table(f) for f in files])


def test_the_archive_process_writes_the_rows_the_writer_thread_writes(tmp_path):
    """The same submissions to the writer thread and to the archive process give the same dataset: the
    drain's record batches sent on as the worker was sent them, a refused table left out, a round's
    tables and the decision log's rows (with the incidents derived from them)."""
    now = time.time_ns()
    items, refused = _drain(now)
    nbytes = sum(i.nbytes for i in items)
    tables = {"gpu": _gpu("r1", 40, now + 10**9)}
    by_thread = Archive(ArchiveSettings(str(tmp_path / "thread"), fsync=False, process=False)).start()
    by_process = ArchiveProcess(ArchiveSettings(str(tmp_path / "process"), fsync=False)).start()
    assert by_process.up and by_process.pid is not None
    by_thread.take_batches(items, refused, nbytes)
    by_process.take_batches(items, refused, nbytes, packed=pack(items))   # the worker's request, as the pipeline has it
    by_process.take_batches(items[:2], [], 1)                            # packed on the sender thread
    by_thread.take_batches(items[:2], [], 1)
    for arc in (by_thread, by_process):
        arc.take_tables(tables)
        arc.take_decisions(_decisions(now))
        arc.close()
    a, b = by_thread.stats(), by_process.stats()
    assert a["rows"] == b["rows"] and a["rows"]["gpu"] == 11 * 16 + 2 * 16 + 40 and b["dropped_bytes"] == 0
    assert b["rows"]["events"] == 1 and b["rows"]["decisions"] == 2 and b["rows"]["incidents"] == 1
    for table in ("gpu", "events", "decisions", "incidents"):
        x, y = _archived(tmp_path / "thread", table), _archived(tmp_path / "process", table)
        assert x.num_rows and x.equals(y), table
    gpu = ds.read_table(tmp_path / "process", "gpu")
    assert "n07" not in gpu.column("node").to_pylist()   # the refused batch
    assert ds.file_nodes(next((tmp_path / "process" / "table=gpu").rglob("part-*.parquet"))) >= {"n00", "r1"}
    assert not any((tmp_path / "process").rglob(".*.tmp"))


def test_a_killed_archive_process_is_said_counted_and_started_again(tmp_path, caplog):
    """Killed (out of memory, say) with a file half written: one log line with its exit code, the
    restart counted, what it held dropped and counted; a new archive process takes what comes after,
    removes the dead one's unfinished file at once, and publishes at the stop."""
    root = tmp_path / "archive"
    arc = ArchiveProcess(ArchiveSettings(str(root), buffer_bytes=1 << 20, roll_seconds=3600, fsync=False)).start()
    try:
        now = time.time_ns()
        first = _gpu("k1", 60_000, now)   # over the 1 MiB buffer: written into a file not yet published
        assert first.nbytes > 1 << 20
        arc.take_tables({"gpu": first})
        assert _wait(lambda: any(root.rglob(".part-*.parquet.tmp")))
        (unfinished,) = root.rglob(".part-*.parquet.tmp")
        dead = arc.pid
        with caplog.at_level(logging.ERROR, logger="foreshock.service.archive"):
            arc._proc.send_signal(signal.SIGKILL)
            assert _wait(lambda: arc.stats()["restarts"] == 1)
            assert not arc.up
            assert _wait(lambda: arc.up)   # started again after the backoff
        assert arc.pid != dead and not unfinished.exists()
        st = arc.stats()
        assert st["dropped_bytes"] >= first.nbytes and st["files"] == 0 and st["errors"] == 0
        (line,) = [r.getMessage() for r in caplog.records if "archive process" in r.getMessage()]
        assert f"pid {dead}" in line and "exited with code -9" in line and "starting it again" in line
        later = _gpu("k2", 100, now + 10**9)
        arc.take_tables({"gpu": later})
    finally:
        arc.close()
    got = ds.read_table(root, "gpu")
    assert got.column("node").unique().to_pylist() == ["k2"] and got.num_rows == 100
    assert arc.stats()["rows"] == {"gpu": 100} and arc.stats()["restarts"] == 1


def _exposition(plane) -> str:
    from prometheus_client import generate_latest
    return generate_latest(plane.registry).decode()


def _metric(text: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def _drain_is_issued_and_logged(plane, tmp_path, node: str) -> None:
    """The service state goes on: a drain is issued, stored and logged."""
    with grpc.insecure_channel(plane.address) as ch:
        jobs = jobs_pb2_grpc.JobsStub(ch)
        jobs.RegisterJob(jpb.RegisterJobRequest(job_id="j", ranks=[jpb.RankPlacement(rank=0, node=node)],
                                                spare_nodes=["s0"], current_step=1), timeout=T)
        (d,) = jobs.DrainNode(jpb.DrainNodeRequest(node=node, reason="archive test"), timeout=T).directives
    plane.decisions.flush()
    assert d.directive_id in read_decisions(tmp_path / "state" / "decisions").column("directive_id").to_pylist()


def test_a_service_whose_archive_process_dies_reports_it_and_goes_on(tmp_path, caplog):
    """In the service: the metrics say it (up 0 until the new process runs, restarts_total 1), the
    log line is in the service's log, telemetry is still taken, and the stop publishes what the new
    archive process took."""
    root = tmp_path / "archive"
    plane = build_server(Settings.insecure_loopback(
        tmp_path / "state", scorer=NullScorer(), decision_flush_seconds=0.0,
        archive=ArchiveSettings(str(root), fsync=False)))
    plane.start()
    try:
        assert isinstance(plane.archive, ArchiveProcess) and plane.archive.up
        up = StreamingUplink(plane.address, node="k1", backoff_initial=0.1).start()
        now = time.time_ns()
        up.submit({"gpu": _gpu("k1", 8, now)})
        assert _wait(lambda: plane.archive.stats()["buffered_bytes"] > 0)
        with caplog.at_level(logging.ERROR, logger="foreshock.service.archive"):
            plane.archive._proc.kill()
            assert _wait(lambda: plane.archive.stats()["restarts"] == 1)
            text = _exposition(plane)
            assert _metric(text, "foreshock_archive_restarts_total") == 1.0
            assert _metric(text, "foreshock_archive_dropped_bytes_total") > 0
            assert _wait(lambda: plane.archive.up)
        up.submit({"gpu": _gpu("k1", 8, now + 10**9)})
        assert _wait(lambda: plane.ingest.accepted_rows["gpu"] == 16)
        assert _wait(lambda: plane.archive.stats()["buffered_bytes"] > 0)
        up.close(5.0)
        assert _metric(_exposition(plane), "foreshock_archive_up") == 1.0
        (line,) = [r.getMessage() for r in caplog.records if "archive" in r.getMessage()]
        assert "archive process" in line and "exited with code -9" in line
        _drain_is_issued_and_logged(plane, tmp_path, "k1")
    finally:
        plane.stop(0.5)
    got = ds.read_table(root, "gpu")
    assert got.num_rows == 8 and pc.min(got.column("ts")).value == now + 10**9
    assert _archived(root, "decisions").num_rows >= 1   # the drain, taken by the new archive process


def test_a_write_that_fails_in_the_archive_process_stops_the_archive_and_nothing_else(tmp_path, caplog):
    """The archive's root gone after start (a mount lost; the archive process cannot be reached by the
    in-process ENOSPC seam, and the real full filesystem is tests/test_service_archive.py's): one log
    line in the service's log naming the table, the path and the error; `foreshock_archive_up` 0; no
    restart (the storage, not the process, failed); what comes after dropped and counted; telemetry is
    still taken and the service state goes on."""
    root = tmp_path / "archive"
    plane = build_server(Settings.insecure_loopback(
        tmp_path / "state", scorer=NullScorer(), decision_flush_seconds=0.0,
        archive=ArchiveSettings(str(root), roll_seconds=1, fsync=False)))
    plane.start()
    try:
        shutil.rmtree(root)
        root.write_text("the mount is gone")
        up = StreamingUplink(plane.address, node="p1", backoff_initial=0.1).start()
        now = time.time_ns()
        with caplog.at_level(logging.ERROR, logger="foreshock.service.archive"):
            up.submit({"gpu": _gpu("p1", 8, now)})
            assert _wait(lambda: not plane.archive.up)
            dropped = plane.archive.stats()["dropped_bytes"]
            for k in range(1, 4):
                up.submit({"gpu": _gpu("p1", 8, now + k * 10**9)})
            assert _wait(lambda: plane.ingest.accepted_rows["gpu"] == 32)
            assert _wait(lambda: plane.archive.stats()["dropped_bytes"] > dropped)
        up.close(5.0)
        (line,) = [r.getMessage() for r in caplog.records if "archive" in r.getMessage()]
        assert "table gpu" in line and str(root) in line and "the archive stops here" in line
        text = _exposition(plane)
        assert _metric(text, "foreshock_archive_up") == 0.0 and _metric(text, "foreshock_archive_errors_total") == 1.0
        assert _metric(text, "foreshock_archive_restarts_total") == 0.0
        st = plane.archive.stats()
        assert st["queued_bytes"] == st["buffered_bytes"] == 0
        _drain_is_issued_and_logged(plane, tmp_path, "p1")
    finally:
        plane.stop(0.5)


def test_a_full_send_queue_drops_and_counts_while_the_archive_process_is_down(tmp_path, monkeypatch):
    """Between a death and the restart nothing is queued for a process that is not there: each
    submission is dropped and counted at once, never waited on."""
    monkeypatch.setattr(ap, "RESTART_BACKOFF_SECONDS", 30.0)
    arc = ArchiveProcess(ArchiveSettings(str(tmp_path), fsync=False)).start()
    try:
        arc._proc.kill()
        assert _wait(lambda: arc.stats()["restarts"] == 1)
        t = _gpu("d1", 100, time.time_ns())
        t0 = time.monotonic()
        for _ in range(50):
            arc.take_tables({"gpu": t})
        assert time.monotonic() - t0 < 1.0
        st = arc.stats()
        assert st["dropped_bytes"] == 50 * t.nbytes and st["queued_bytes"] == 0 and not st["up"]
    finally:
        t0 = time.monotonic()
        arc.close()   # does not wait out the backoff
        assert time.monotonic() - t0 < 10
