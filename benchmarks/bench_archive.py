"""The archive's compaction (`foreshock archive compact`, service/archive_maintenance.py) on a day of the
small files `foreshock serve --archive` leaves: its small tables (events, decisions and the incidents
derived from them) published a file a roll period, 96 a day each with the default 900 s. The day is
written by the real writer (service/archive.py, one writer per roll period, fsync off), then compacted
as the command does it (fsync on). Printed: files and bytes before and after, the compaction's time,
and what the project's readers pay for the day before and after (a table, one node of it, its node
list). Results: benchmarks/results/archive-compaction-2026-12-04.md.

    python -m benchmarks archive [--nodes 512] [--rolls 96] [--events-per-node 2]
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow as pa

DAY = "2026-12-01"
ROLL_S = 900


def write_day(root: Path, nodes: int, rolls: int, events_per_node: int) -> None:
    from foreshock import schema as sch
    from foreshock.service.archive import Archive, ArchiveSettings
    from foreshock.service.decisions import DECISION_SCHEMA

    start_ns = int(dt.datetime.fromisoformat(DAY).replace(tzinfo=dt.timezone.utc).timestamp()) * 10**9
    names = [f"node-{i:04d}" for i in range(nodes)]
    for k in range(rolls):
        t0 = start_ns + k * ROLL_S * 10**9
        events = sch.to_table("events", [
            {"ts": t0 + j * 10**10 + i * 10**6, "node": node, "kind": "xid", "source": "nvml", "xid": 13 + j % 3,
             "gpu": j % 8, "message": f"Xid {13 + j % 3} on GPU {j % 8}"}
            for i, node in enumerate(names) for j in range(events_per_node)])
        alarms = names[k % nodes::max(1, nodes // 4)]
        decisions = pa.Table.from_pylist([
            {"ts": dt.datetime.fromtimestamp((t0 + i * 10**6) / 1e9, dt.timezone.utc), "kind": "alarm", "node": node,
             "risk": 0.9, "threshold": 0.5, "reason": "fatal: Xid 79 on GPU 0"}
            for i, node in enumerate(alarms)], schema=DECISION_SCHEMA)
        arc = Archive(ArchiveSettings(str(root), fsync=False))
        arc.take_tables({"events": events})
        arc.take_decisions(decisions)
        arc.close()


def _files(root: Path) -> tuple[int, int]:
    files = [p for p in root.rglob("*.parquet") if not p.name.startswith(".")]
    return len(files), sum(p.stat().st_size for p in files)


def _median_s(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def readers(root: Path) -> dict[str, float]:
    from foreshock import dataset as ds

    ds._DATE_FILES.clear()   # the listing cache: each read below lists the directory afresh
    return {"read events": _median_s(lambda: (ds._DATE_FILES.clear(), ds.read_table(root, "events"))),
            "read events of one node": _median_s(
                lambda: (ds._DATE_FILES.clear(), ds.read_table(root, "events", nodes=["node-0001"]))),
            "list events' nodes": _median_s(lambda: ds.list_nodes(root, "events"))}


def main(argv: list[str]) -> int:
    from foreshock import dataset as ds
    from foreshock.service import archive_maintenance as am
    from foreshock.service.command import DEFAULTS

    parser = argparse.ArgumentParser(prog="bench_archive")
    parser.add_argument("--nodes", type=int, default=512)
    parser.add_argument("--rolls", type=int, default=96)
    parser.add_argument("--events-per-node", type=int, default=2)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "archive"
        t = time.perf_counter()
        write_day(root, args.nodes, args.rolls, args.events_per_node)
        print(f"wrote a day of {args.rolls} roll periods, {args.nodes} nodes, in {time.perf_counter() - t:.1f} s")
        before_files, before_bytes = _files(root)
        before_rows = ds.read_table(root, "events")
        before = readers(root)
        now = dt.datetime.fromisoformat(DAY).replace(tzinfo=dt.timezone.utc).timestamp() + 2 * 86_400
        summary = am.compact(str(root), file_bytes=DEFAULTS["archive_file_bytes"], settle_seconds=3600, now=now,
                             report=lambda line: None)
        after_files, after_bytes = _files(root)
        after = readers(root)
        assert ds.read_table(root, "events").equals(before_rows), "compaction changed the rows"
        print(f"compaction: {summary.dates} date directories, {before_files} -> {after_files} files, "
              f"{before_bytes / 2**20:.2f} -> {after_bytes / 2**20:.2f} MiB, {summary.seconds:.2f} s")
        for key in before:
            print(f"{key}: {before[key] * 1000:.1f} -> {after[key] * 1000:.1f} ms")
    return 0
