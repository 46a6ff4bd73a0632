"""The archive (`foreshock serve --archive`): a real service archives every table it takes, the decisions
and the incidents, as one hive-partitioned dataset the predictor reads as is; files roll by size and age;
a full queue drops and counts; a full disk stops the archive and nothing else; a path that cannot be
written stops the service at start."""

from __future__ import annotations

import datetime as dt
import errno
import functools
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from foreshock import dataset as ds
from foreshock import schema as sch
from foreshock.collectors.collector import Collector
from foreshock.collectors.simulated import SimulatedSource
from foreshock.collectors.uplink import StreamingUplink
from foreshock.predictor import offline
from foreshock.service import archive as archive_mod
from foreshock.service.archive import Archive, ArchiveError, ArchiveSettings
from foreshock.service.archive_process import ArchiveProcess
from foreshock.service.decisions import DECISION_SCHEMA, read_decisions
from foreshock.service.scoring import NullScorer
from foreshock.service.server import Settings, SettingsError, build_server
from foreshock.simulator.live import LiveCluster
from foreshock.simulator.topology import Topology
from foreshock.v1 import jobs_pb2 as jpb
from foreshock.v1 import jobs_pb2_grpc
from support import Clock, Serve, wait_until

T = 10
TELEMETRY = [t for t in sch.TABLES if t != "incidents"]
FILE_RE = re.compile(r"^table=[a-z_]+/date=\d{4}-\d{2}-\d{2}/part-\d{19}-[0-9a-f]{8}-\d{6}\.parquet$")


_wait = functools.partial(wait_until, timeout=20.0)


class Sweepers:
    """Real collectors on a live simulated cluster, streaming through the real uplink, each also
    writing what it sends to `sent` (a collector's own spool)."""

    def __init__(self, cluster, address, sent: ds.DatasetWriter):
        self.collectors = []
        inv = cluster.inventory()
        sent.append_table("inventory", inv)
        for node in cluster.nodes:
            up = StreamingUplink(address, node=node, backoff_initial=0.1, ack_timeout=5).start()
            up.submit({"inventory": inv.filter(pc.equal(inv.column("node"), node))})
            self.collectors.append(Collector(node, [SimulatedSource(node, node_model=cluster.node_model(node))],
                                             sent, uplink=up))

    def sweep(self, n: int, interval: float = 0.2) -> None:
        for _ in range(n):
            ts = time.time_ns()
            for c in self.collectors:
                c.sweep_once(ts)
            time.sleep(interval)

    def close(self) -> list[dict]:
        for c in self.collectors:
            c.uplink.close(5.0)
        return [c.uplink.stats() for c in self.collectors]


def _archived(root, table: str) -> pa.Table:
    return pads.dataset(str(root / f"table={table}"), format="parquet", partitioning="hive").to_table()


@pytest.mark.slow
def test_a_real_serve_archives_every_table_the_decisions_and_incidents_and_the_predictor_reads_it(tmp_path):
    archive = tmp_path / "archive"
    sent = ds.DatasetWriter(tmp_path / "sent", fsync=False, journal=False)
    cluster = LiveCluster(Topology(nodes=6, nodes_per_leaf=3, job_nodes=3, gpus_per_node=2, hcas_per_node=2),
                          seed=5, rate_scale=0)
    nodes = cluster.nodes
    serve = Serve(tmp_path / "state", "--archive", str(archive), "--archive-roll-seconds", "1")
    try:
        with grpc.insecure_channel(serve.address) as ch:
            jobs = jobs_pb2_grpc.JobsStub(ch)
            jobs.RegisterJob(jpb.RegisterJobRequest(
                job_id="j", ranks=[jpb.RankPlacement(rank=i, node=nodes[i], gpus=[0, 1]) for i in range(3)],
                spare_nodes=[nodes[4], nodes[5]], current_step=10), timeout=T)
            sweepers = Sweepers(cluster, serve.address, sent)
            try:
                sweepers.sweep(8)
                # The roll period passes with telemetry still coming: files are written mid-run, not only at stop.
                assert _wait(lambda: serve.metric("foreshock_archive_files_total") > 0)
                cluster.inject(nodes[1], "gpu", component=0, lead_seconds=0.2)
                sweepers.sweep(6)
                (d,) = jobs.ListDirectives(jpb.ListDirectivesRequest(job_id="j"), timeout=T).directives
            finally:
                ups = sweepers.close()
        assert all(u["dropped_oldest"] == 0 and u["rejected"] == {} and u["acked"] > 0 for u in ups)
        assert serve.metric("foreshock_archive_up") == 1.0
        assert serve.metric("foreshock_archive_dropped_bytes_total") == 0.0
        assert serve.term() == 0
    finally:
        serve.kill()
    sent.flush()

    # One hive-partitioned dataset: table and date are its partition keys, every file where they say.
    files = sorted(p.relative_to(archive).as_posix() for p in archive.rglob("*") if p.is_file())
    assert files and all(FILE_RE.match(f) for f in files), files
    whole = pads.dataset(str(archive), format="parquet", partitioning="hive")
    assert whole.partitioning.schema.names == ["table", "date"]
    today = {f.split("/")[1] for f in files}
    assert today <= {f"date={(dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=k)).date()}" for k in (0, 1)}

    # Every telemetry row sent is archived, once, as sent (the collectors' own spool holds the same).
    tables = 0
    for table in TELEMETRY:
        mine = ds.read_table(tmp_path / "sent", table)
        assert whole.count_rows(filter=pc.field("table") == table) == mine.num_rows, table
        if not mine.num_rows:
            continue
        tables += 1
        got = _archived(archive, table)
        assert got.num_rows == mine.num_rows and "date" in got.column_names, table
        assert ds.read_table(archive, table).equals(mine), table
    assert tables >= 5   # gpu, nvlink, rdma_port, netdev, events, inventory, ... whatever the nodes sent
    assert ds.list_nodes(archive, "gpu") == sorted(nodes)

    # The evacuation it ordered and the incident it derived from the fatal alarm.
    decisions = _archived(archive, "decisions")
    (ev,) = [r for r in decisions.to_pylist() if r["kind"] == "evacuate"]
    assert (ev["directive_id"], ev["node"], ev["to_node"]) == (d.directive_id, nodes[1], d.to_node)
    incidents = ds.read_table(archive, "incidents")
    assert nodes[1] in incidents.column("node").to_pylist()
    assert set(incidents.column("category").to_pylist()) == {"fatal_event"}

    # The predictor reads the archive as is: the same features as from the collectors' own files.
    with offline.FeatureBuilder(archive, workers=1) as a, offline.FeatureBuilder(tmp_path / "sent", workers=1) as b:
        fa, fb = list(a), list(b)
    assert [f.node for f in fa] == [f.node for f in fb] == sorted(nodes)
    for x, y in zip(fa, fb):
        assert np.array_equal(x.steps, y.steps) and np.array_equal(x.X, y.X, equal_nan=True)


@pytest.mark.slow
def test_train_on_the_archive_gives_the_model_of_the_data_the_service_was_sent(tmp_path):
    """A simulated day (its last 23 hours, so that every row passes the receipt's time window) sent
    through a running service, node by node, an hour a batch, with the real uplink; `foreshock train`
    on the archive, with the day's incidents beside it (the ingest takes no incidents table), learns
    the model the day itself gives: the same training rows, thresholds and validation figures."""
    from foreshock.predictor.train import train
    sim, archive = tmp_path / "sim", tmp_path / "archive"
    start = dt.datetime.now(dt.timezone.utc).replace(minute=0, second=0, microsecond=0) - dt.timedelta(hours=23)
    subprocess.run([sys.executable, "-m", "foreshock.cli", "simulate", "--world", "clean", "--nodes", "12",
                    "--days", "0.9", "--interval", "60", "--seed", "3", "--rate-scale", "300", "--workers", "1",
                    "--start", start.strftime("%Y-%m-%dT%H:%M:%SZ"), "--out", str(sim)], check=True,
                   capture_output=True, timeout=300)
    plane = build_server(Settings.insecure_loopback(tmp_path / "state", scorer=NullScorer(), fsync=False,
                                                    archive=ArchiveSettings(str(archive), fsync=False)))
    plane.start()
    try:
        tables = ["gpu", "nvlink", "rdma_port", "netdev", "host_net", "events"]
        for node in ds.list_nodes(sim, "gpu"):
            up = StreamingUplink(plane.address, node=node, backoff_initial=0.1, max_queue=5000).start()
            up.submit({"inventory": ds.read_table(sim, "inventory", nodes=[node])})
            data = {t: ds.read_table(sim, t, nodes=[node]) for t in tables}
            hour = {t: pc.divide(pc.cast(d.column("ts"), pa.int64()), 3_600_000_000_000) for t, d in data.items()}
            for h in sorted(set().union(*(set(x.to_pylist()) for x in hour.values()))):
                up.submit({t: d.filter(pc.equal(hour[t], h)) for t, d in data.items()
                           if pc.any(pc.equal(hour[t], h)).as_py()})
            # close() gives up at once on a stream not yet connected: wait for the acks first
            assert _wait(lambda: up.stats()["acked"] == up.stats()["submitted"], timeout=180), up.stats()
            up.close(5.0)
    finally:
        plane.stop(0.5)
    assert plane.ingest.rejected == {} and plane.archive.stats()["dropped_bytes"] == 0
    for t in ("inventory", *tables):
        assert ds.read_table(archive, t).equals(ds.read_table(sim, t)), t
    incidents = ds.read_table(sim, "incidents")
    assert incidents.num_rows >= 5
    ds.write_parquet_atomic(incidents, _mkdir(archive / "table=incidents" / "date=2026-01-01") / "part-0.parquet")
    # the two models must agree, not be good: a short boosting run shows that as well as a long one
    a = train(sim, tmp_path / "model-sim", prior_scale=300, seed=0, max_iter=20)
    b = train(archive, tmp_path / "model-archive", prior_scale=300, seed=0, max_iter=20)
    for key in ("thresholds", "recommended_threshold", "threshold_curves", "metrics"):   # as JSON: NaN == NaN
        assert json.dumps(a[key], sort_keys=True) == json.dumps(b[key], sort_keys=True), key
    for key in ("nodes", "incidents", "train_steps", "train_rows_sampled", "train_positive_rows"):
        assert a["training"][key] == b["training"][key], key


def _mkdir(path):
    path.mkdir(parents=True, exist_ok=True)
    return path


def _gpu(node: str, n: int, ts0: int, nan: bool = False) -> pa.Table:
    rows = [{"ts": ts0 + k * 1_000_000, "node": node, "gpu": k % 8, "temperature_c": float("nan") if nan else 40.0,
             "power_w": 300.0, "gpu_lost": False} for k in range(n)]
    return sch.to_table("gpu", rows)


@pytest.mark.parametrize("process", [True, False])
def test_the_scoring_worker_path_archives_what_its_value_checks_took(tmp_path, process):
    """With the scoring worker (as `foreshock serve` runs), bulk batches are archived from the stage that
    applies the worker's verdicts: a batch the value checks refused is not archived, whether the writer
    is the archive process (`foreshock serve`'s) or a thread of the service."""
    archive = tmp_path / "archive"
    plane = build_server(Settings.insecure_loopback(tmp_path / "state", scoring_process=True,
                                                    archive=ArchiveSettings(str(archive), fsync=False,
                                                                            process=process)))
    plane.start()
    try:
        up = StreamingUplink(plane.address, node="w1", backoff_initial=0.1).start()
        now = time.time_ns()
        for k in range(5):
            up.submit({"gpu": _gpu("w1", 8, now + k * 1_000_000_000, nan=(k == 2))})
        assert _wait(lambda: plane.ingest.accepted_rows["gpu"] == 32 and plane.ingest.rejected.get("nan_value"))
        up.close(5.0)
    finally:
        plane.stop(0.5)
    got = ds.read_table(archive, "gpu")
    assert got.num_rows == 32 and not pc.any(pc.is_nan(got.column("temperature_c"))).as_py()
    assert plane.archive.stats()["rows"]["gpu"] == 32


def test_files_roll_by_size_and_each_run_is_sorted_by_node(tmp_path):
    """Files are published at file_bytes on disk, each a series of runs (one per buffer flush, here at
    the 1 MiB buffer bound), each run sorted by node in row groups that a read of one node prunes."""
    arc = Archive(ArchiveSettings(str(tmp_path), file_bytes=1 << 20, buffer_bytes=1 << 20, roll_seconds=3600,
                                  fsync=False)).start()
    rng = np.random.default_rng(1)
    now = time.time_ns()
    sent = 0
    for k in range(40):     # a random double a row: 0.12 MiB of Parquet each, 5 MiB in all
        t = pa.concat_tables([_gpu(f"n{j:02d}", 2000, now + k * 10**9) for j in range(8)])
        t = t.set_column(t.schema.get_field_index("power_w"), t.schema.field("power_w"),
                         pa.array(rng.random(t.num_rows)))
        arc.take_tables({"gpu": t})
        sent += t.num_rows
    arc.close()
    files = sorted((tmp_path / "table=gpu").rglob("*.parquet"))
    assert len(files) >= 4 and arc.stats()["dropped_bytes"] == 0 and arc.stats()["files"] == len(files)
    assert sum(pq.ParquetFile(f).metadata.num_rows for f in files) == sent == arc.stats()["rows"]["gpu"]
    assert all(f.stat().st_size >= 1 << 20 for f in files[:-1])    # the last: what was left at close
    for f in files:
        pf = pq.ParquetFile(f)
        for g in range(pf.num_row_groups):
            node = pf.read_row_group(g, columns=["node"]).column("node").to_pylist()
            assert node == sorted(node)
        assert ds.file_nodes(f) == {f"n{j:02d}" for j in range(8)}
        assert pf.schema_arrow.field("temperature_c").metadata == sch.schema("gpu").field("temperature_c").metadata
    assert ds.read_table(tmp_path, "gpu", nodes=["n03"]).num_rows == sent // 8


def test_rows_wait_at_most_the_roll_period(tmp_path):
    arc = Archive(ArchiveSettings(str(tmp_path), roll_seconds=1, fsync=False)).start()
    try:
        arc.take_tables({"gpu": _gpu("n1", 4, time.time_ns())})
        assert _wait(lambda: arc.stats()["files"] == 1, timeout=10)
        assert ds.read_table(tmp_path, "gpu").num_rows == 4
    finally:
        arc.close()


def test_a_killed_writers_unfinished_files_are_removed_once_two_roll_periods_old(tmp_path):
    d = tmp_path / "table=gpu" / "date=2026-12-01"
    d.mkdir(parents=True)
    dead, live = d / ".part-1-aaaaaaaa-000001.parquet.tmp", d / ".part-2-bbbbbbbb-000001.parquet.tmp"
    dead.write_bytes(b"PAR1")
    live.write_bytes(b"PAR1")
    old = time.time() - 2 * 60 - 1
    os.utime(dead, (old, old))
    Archive(ArchiveSettings(str(tmp_path), roll_seconds=60, fsync=False)).close()
    assert not dead.exists() and live.exists()


@pytest.mark.parametrize("writer", [Archive, ArchiveProcess])
def test_a_full_queue_drops_and_counts_and_never_waits(tmp_path, writer):
    arc = writer(ArchiveSettings(str(tmp_path), queue_bytes=1 << 20, fsync=False))   # writer not started
    t = _gpu("n1", 2000, time.time_ns())
    for _ in range(40):   # with nobody writing, a blocking queue would hang here
        arc.take_tables({"gpu": t})
    taken = (1 << 20) // t.nbytes
    st = arc.stats()
    assert st["queued_bytes"] == taken * t.nbytes and st["dropped_bytes"] == (40 - taken) * t.nbytes
    arc.close()   # writes what was queued
    assert ds.read_table(tmp_path, "gpu").num_rows == taken * 2000


def test_decisions_are_archived_with_the_incidents_derived_from_them(tmp_path):
    arc = Archive(ArchiveSettings(str(tmp_path), fsync=False))
    now = dt.datetime.now(dt.timezone.utc)
    rows = pa.Table.from_pylist([
        {"ts": now, "kind": "alarm", "node": "n1", "reason": "fatal: Xid 79 on GPU 0"},
        {"ts": now, "kind": "evacuate", "node": "n1", "job": "j", "directive_id": "d1", "to_node": "s1"},
        {"ts": now, "kind": "fabric_incident", "node": "leaf-1", "scope": "leaf_switch", "nodes": ["a", "b", "c"],
         "reason": "3 of 4 nodes in alarm"}], schema=DECISION_SCHEMA)
    arc.take_decisions(rows)
    arc.close()
    assert _archived(tmp_path, "decisions").num_rows == 3
    inc = ds.read_table(tmp_path, "incidents")
    assert sorted(zip(inc.column("scope").to_pylist(), inc.column("node").to_pylist())) == \
        [("node", "n1"), ("switch", "leaf-1")]


class DiskFull(ds.AtomicParquetFile):
    """The archive's files on a disk that is full: every write fails as the kernel says it."""

    def write(self, data, row_group_size=None):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_stops_the_archive_and_nothing_else(tmp_path, monkeypatch, caplog):
    """ENOSPC injected at the filesystem seam (the one write helper): the archive stops with a metric
    and a log line; telemetry is still taken, the decision log and the directives go on. The writer is
    a thread here, where the seam reaches it (the archive process: tests/test_service_archive_process.py
    and the real full filesystem below)."""

    monkeypatch.setattr(archive_mod, "AtomicParquetFile", DiskFull)   # the archive's seam; the state's untouched
    plane = build_server(Settings.insecure_loopback(
        tmp_path / "state", scorer=NullScorer(), decision_flush_seconds=0.0,
        archive=ArchiveSettings(str(tmp_path / "archive"), roll_seconds=1, fsync=False, process=False)))
    plane.start()
    try:
        up = StreamingUplink(plane.address, node="f1", backoff_initial=0.1).start()
        now = time.time_ns()
        with caplog.at_level(logging.ERROR, logger="foreshock.service.archive"):
            up.submit({"gpu": _gpu("f1", 8, now)})
            assert _wait(lambda: not plane.archive.up, timeout=15)
            for k in range(1, 4):
                up.submit({"gpu": _gpu("f1", 8, now + k * 10**9)})
            assert _wait(lambda: plane.ingest.accepted_rows["gpu"] == 32)
        up.close(5.0)
        (line,) = [r.getMessage() for r in caplog.records if "archive" in r.getMessage()]
        assert "No space left on device" in line and "table gpu" in line
        text = _exposition(plane)
        assert "foreshock_archive_up 0.0" in text and "foreshock_archive_errors_total 1.0" in text
        assert float(re.search(r"^foreshock_archive_dropped_bytes_total (\S+)$", text, re.M).group(1)) > 0
        if shutil.which("promtool"):
            out = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True,
                                 timeout=30)
            assert out.returncode == 0, out.stdout + out.stderr
        # The service state goes on: a drain is issued, stored and logged.
        with grpc.insecure_channel(plane.address) as ch:
            jobs = jobs_pb2_grpc.JobsStub(ch)
            jobs.RegisterJob(jpb.RegisterJobRequest(job_id="j", ranks=[jpb.RankPlacement(rank=0, node="f1")],
                                                    spare_nodes=["s0"], current_step=1), timeout=T)
            (d,) = jobs.DrainNode(jpb.DrainNodeRequest(node="f1", reason="disk test"), timeout=T).directives
        plane.decisions.flush()
    finally:
        plane.stop(0.5)
    logged = read_decisions(tmp_path / "state" / "decisions").column("directive_id").to_pylist()
    assert d.directive_id in logged


def test_a_failed_write_drops_every_table_buffered_and_what_comes_after(tmp_path, monkeypatch):

    monkeypatch.setattr(archive_mod, "AtomicParquetFile", DiskFull)
    arc = Archive(ArchiveSettings(str(tmp_path), fsync=False))   # the writer runs inside close()
    gpu, events = _gpu("n1", 10, time.time_ns()), sch.to_table("events", [
        {"ts": dt.datetime.now(dt.timezone.utc), "node": "n1", "kind": "xid", "source": "kmsg", "xid": 79}])
    arc.take_tables({"gpu": gpu, "events": events})
    arc.close()
    arc.take_tables({"gpu": gpu})
    st = arc.stats()
    assert (st["up"], st["errors"], st["files"]) == (False, 1, 0)
    assert st["dropped_bytes"] == 2 * gpu.nbytes + events.nbytes and st["buffered_bytes"] == st["queued_bytes"] == 0


def _exposition(plane) -> str:
    from prometheus_client import generate_latest
    return generate_latest(plane.registry).decode()


@pytest.mark.slow
def test_a_real_full_filesystem_stops_the_archive_and_serve_goes_on(tmp_path):
    """A real tmpfs of 1 MiB, nearly full (root only: elsewhere the ENOSPC injection above covers it)."""
    small = tmp_path / "small"
    small.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        with open(small / "filler", "wb") as f:   # leave a few KiB: the start-up probe fits, files do not
            try:
                f.write(b"\0" * (1 << 20))
            except OSError:
                pass
        os.truncate(small / "filler", os.path.getsize(small / "filler") - 8192)
        serve = Serve(tmp_path / "state", "--archive", str(small / "archive"), "--archive-roll-seconds", "1")
        try:
            up = StreamingUplink(serve.address, node="t1", backoff_initial=0.1).start()
            now = time.time_ns()
            for k in range(20):
                up.submit({"gpu": _gpu("t1", 2000, now + k * 10**8)})
            assert _wait(lambda: serve.metric("foreshock_archive_up") == 0.0)
            up.submit({"gpu": _gpu("t1", 8, now + 10**10)})
            assert _wait(lambda: serve.metric('foreshock_ingest_rows_total{table="gpu"}') == 40_008)
            up.close(5.0)
            assert serve.metric("foreshock_archive_errors_total") == 1.0
            assert serve.term() == 0
            err = serve.proc.stderr.read()
            assert "No space left on device" in err and str(small / "archive") in err
        finally:
            serve.kill()
    finally:
        subprocess.run(["umount", str(small)], check=False)


def test_serve_refuses_an_archive_it_cannot_write_and_names_it(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    target = blocker / "archive"
    out = subprocess.run([sys.executable, "-m", "foreshock.cli", "serve", "--insecure", "--listen", "127.0.0.1:0",
                          "--metrics-listen", "", "--no-model", "--state", str(tmp_path / "state"),
                          "--archive", str(target)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and str(target) in out.stderr and "cannot be written" in out.stderr
    with pytest.raises(SettingsError, match="cannot be written"):
        build_server(Settings.insecure_loopback(tmp_path / "s2", scorer=NullScorer(),
                                                archive=ArchiveSettings(str(target))))


@pytest.mark.parametrize("flag,value", [("--archive-roll-seconds", "0"), ("--archive-file-bytes", "1000"),
                                        ("--archive-queue-bytes", str(1 << 40)), ("--archive-roll-seconds", "nan")])
def test_archive_settings_are_range_checked(tmp_path, flag, value):
    out = subprocess.run([sys.executable, "-m", "foreshock.cli", "serve", "--insecure", "--no-model",
                          "--state", str(tmp_path), "--archive", str(tmp_path / "a"), flag, value],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and flag.lstrip("-").replace("-", "_") in out.stderr
    with pytest.raises(ArchiveError):
        ArchiveSettings(str(tmp_path), roll_seconds=0.5)


def test_the_readers_take_both_layouts_in_one_dataset(tmp_path):
    """A node-partitioned spool and archive files side by side under one root."""
    now = time.time_ns()
    w = ds.DatasetWriter(tmp_path, fsync=False, journal=False)
    w.append_table("gpu", _gpu("spool-1", 5, now))
    w.flush()
    arc = Archive(ArchiveSettings(str(tmp_path), fsync=False))
    arc.take_tables({"gpu": pa.concat_tables([_gpu("a1", 3, now), _gpu("a2", 4, now)])})
    arc.close()
    assert ds.list_nodes(tmp_path, "gpu") == ["a1", "a2", "spool-1"]
    assert ds.read_table(tmp_path, "gpu").num_rows == 12
    assert ds.read_table(tmp_path, "gpu", nodes=["a2"]).column("node").unique().to_pylist() == ["a2"]
    assert ds.read_table(tmp_path, "gpu", nodes=["spool-1", "a1"]).num_rows == 8
    assert dict((n, t.num_rows) for n, t in ds.iter_node_tables(tmp_path, "gpu")) == {"a1": 3, "a2": 4, "spool-1": 5}
    assert offline.read_node(tmp_path, "a2")["gpu"].num_rows == 4
    meta = pq.ParquetFile(next((tmp_path / "table=gpu").glob("date=*/part-*.parquet"))).metadata.metadata
    assert json.loads(meta[ds.NODES_KEY]) == ["a1", "a2"]


@pytest.mark.parametrize("scoring_process,archive_process", [(False, False), (True, False), (True, True)])
def test_stop_takes_and_archives_what_collectors_were_acknowledged_for(tmp_path, scoring_process, archive_process):
    """Telemetry acknowledged but still queued for its round when the service stops is taken (and so
    archived) before the scoring loop ends, not left behind: the loop's drains are made rare here, so
    every batch is still queued at stop."""
    archive = tmp_path / "archive"
    clock = Clock(time.time_ns())
    plane = build_server(Settings.insecure_loopback(tmp_path / "state", scoring_process=scoring_process,
                                                    scoring_clock=clock,
                                                    archive=ArchiveSettings(str(archive), fsync=False,
                                                                            process=archive_process)))
    # The rounds' clock stands a third into a feature step: after the first round's close no step comes
    # due and no drain follows a step's last half second, wherever the wall clock's minute falls.
    step = plane.scorer.step_ns
    clock.now = clock.now // step * step + step // 3
    plane.scoring.drain_interval = 3600.0
    plane.start()
    try:
        # The first round closes the steps before the clock's (a scorer that has closed none is due):
        # the batches must not be queued before it has run.
        assert _wait(lambda: sum(plane.scoring.rounds.values()) > 0)
        up = StreamingUplink(plane.address, node="q1", backoff_initial=0.1).start()
        for k in range(5):
            up.submit({"gpu": _gpu("q1", 8, clock.now + k * 1_000_000_000)})
        assert _wait(lambda: up.stats()["acked"] == 5)
        assert plane.scoring.backlog() == 5          # acknowledged, not yet taken
    finally:
        plane.stop(0.5)                              # the collector is still streaming
        up.close(0.5)
    assert plane.scoring.backlog() == 0
    assert ds.read_table(archive, "gpu").num_rows == 40


def test_archive_files_dictionary_encode_their_strings_and_not_their_timestamps(tmp_path):
    """Node names repeat, timestamps do not: a dictionary on `ts` overflows into a fallback that
    compresses worse than plain, so only the string columns get one."""
    from foreshock.service.archive import parquet_options

    rows = [{"ts": 1_764_547_200_000_000_000 + i * 1_000_003, "node": f"node-{i % 16:03d}", "kind": "xid",
             "source": "nvml", "xid": 13, "gpu": i % 8, "message": "Xid 13"} for i in range(4096)]
    table = sch.to_table("events", rows)
    path = tmp_path / "part.parquet"
    f = ds.AtomicParquetFile(str(path), table.schema, fsync=False, **parquet_options(table.schema))
    f.write(table, 1024)
    f.commit()
    meta = pq.ParquetFile(path).metadata.row_group(0)
    encodings = {meta.column(i).path_in_schema: set(meta.column(i).encodings) for i in range(meta.num_columns)}
    assert {"RLE_DICTIONARY", "PLAIN_DICTIONARY"} & encodings["node"]
    assert not {"RLE_DICTIONARY", "PLAIN_DICTIONARY"} & encodings["ts"]
    assert pq.read_table(path).equals(table)
