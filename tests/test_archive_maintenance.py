"""The archive's compaction and retention (`foreshock archive compact|prune`, service/archive_maintenance.py),
on archives the real writer wrote: a closed day's small files become few, sorted as the writer sorts, and
read back the same through the project's readers; a run cut short anywhere loses no row and shows none
twice, and the next run finishes or undoes it; old dates go per table's days; the command checks its
settings and names what it refuses."""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import time

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from foreshock import cli
from foreshock import dataset as ds
from foreshock import schema as sch
from foreshock.service import archive_maintenance as am
from foreshock.service.archive import Archive, ArchiveSettings
from foreshock.service.decisions import DECISION_SCHEMA

NODES = ["n0", "n1", "n2", "n3"]
ROLL_S = 900
TABLES = ("events", "gpu", "incidents")


def _ts(date: str) -> float:
    return dt.datetime.fromisoformat(date).replace(tzinfo=dt.timezone.utc).timestamp()


def _write_rolls(root, date: str, rolls: int, *, first: int = 0, samples: int = 20) -> None:
    """`rolls` roll periods of `date` from its `first`, as the archive writes them: a writer each, so a
    file per table each; `samples` a node in the gpu table's."""
    start_ns = int(_ts(date)) * 10**9
    for k in range(first, first + rolls):
        t0 = start_ns + k * ROLL_S * 10**9
        events = sch.to_table("events", [
            {"ts": t0 + j * 10**9 + i * 10**6, "node": node, "kind": "xid", "source": "nvml", "xid": 13 + j}
            for i, node in enumerate(NODES) for j in range(3)])
        gpu = sch.to_table("gpu", [
            {"ts": t0 + j * 10**9 + i * 10**6, "node": node, "gpu": j % 8, "temperature_c": 40.0 + k,
             "power_w": 300.0 + j, "gpu_lost": False}
            for i, node in enumerate(NODES[::-1]) for j in range(samples)]
            # the same node and time in every file (a collector's re-sent sweep): readers keep their file order
            + [{"ts": start_ns + 7, "node": "n1", "gpu": 0, "temperature_c": float(k), "gpu_lost": False}])
        decisions = pa.Table.from_pylist([
            {"ts": dt.datetime.fromtimestamp((t0 + i * 10**6) / 1e9, dt.timezone.utc), "kind": "alarm",
             "node": node, "reason": "fatal: Xid 79 on GPU 0"} for i, node in enumerate(NODES)], schema=DECISION_SCHEMA)
        arc = Archive(ArchiveSettings(str(root), fsync=False))
        arc.take_tables({"events": events, "gpu": gpu})
        arc.take_decisions(decisions)
        arc.close()


def _read(root) -> dict[str, pa.Table]:
    """Every table as the project reads it (decisions: its files as the readers list them)."""
    out = {t: ds.read_table(root, t) for t in TABLES}
    files = [str(f) for f in ds.partition_files(root, "decisions")]
    out["decisions"] = pads.dataset(files, format="parquet").to_table().sort_by(
        [("node", "ascending"), ("ts", "ascending")])
    return out


def _same(a: dict[str, pa.Table], b: dict[str, pa.Table]) -> None:
    for t in a:
        assert a[t].schema.equals(b[t].schema, check_metadata=True), t
        assert a[t].num_rows == b[t].num_rows and a[t].equals(b[t]), t


def _data_files(root, table: str, date: str) -> list[str]:
    return sorted(p.name for p in (root / f"table={table}" / f"date={date}").iterdir())


@pytest.fixture
def two_days(tmp_path):
    root = tmp_path / "archive"
    _write_rolls(root, "2026-12-01", 12)
    _write_rolls(root, "2026-12-02", 6)
    return root


NOW = _ts("2026-12-03") + 1800   # 2026-12-01 closed; 2026-12-02 ended half an hour ago, under the hour's settle


def test_a_closed_days_small_files_become_one_sorted_file_that_reads_back_the_same(two_days):
    root = two_days
    before = _read(root)
    assert len(_data_files(root, "events", "2026-12-01")) == 12
    lines = []
    got = am.compact(str(root), file_bytes=128 << 20, settle_seconds=3600, now=NOW, fsync=False,
                     report=lines.append)
    assert got.dates == 4 and got.files_before == 48 and got.files_after == 4 and got.errors == 0
    assert len(lines) == 4 and all(line.startswith("compacted table=") for line in lines)
    for table in ("events", "gpu", "decisions", "incidents"):
        (name,) = _data_files(root, table, "2026-12-01")
        assert ds.part_file_name(0, "x")[:5] == name[:5] and ds.part_writer(name)
        assert len(_data_files(root, table, "2026-12-02")) == 6        # not closed yet: untouched
        f = pq.ParquetFile(root / f"table={table}" / "date=2026-12-01" / name)
        rows = f.read(columns=["node", "ts"]).to_pylist()
        assert rows == sorted(rows, key=lambda r: (r["node"], r["ts"]))  # as the writer sorts a run
        assert ds.file_nodes(root / f"table={table}" / "date=2026-12-01" / name) == set(NODES)
    _same(before, _read(root))
    assert ds.list_nodes(root, "gpu") == NODES
    # a second run finds nothing to do; once the settle has passed, the next day is compacted too
    assert am.compact(str(root), file_bytes=128 << 20, settle_seconds=3600, now=NOW, fsync=False,
                      report=lines.append).dates == 0
    assert am.compact(str(root), file_bytes=128 << 20, settle_seconds=0, now=NOW, fsync=False,
                      report=lines.append).dates == 4
    _same(before, _read(root))


def test_other_readers_read_the_compacted_day_the_same(two_days):
    root = two_days

    def hive(table):
        return pads.dataset(str(root / f"table={table}"), format="parquet", partitioning="hive").to_table() \
            .sort_by([("date", "ascending"), ("node", "ascending"), ("ts", "ascending")])

    before = {t: hive(t) for t in ("events", "decisions")}
    am.compact(str(root), file_bytes=128 << 20, settle_seconds=3600, now=NOW, fsync=False, report=lambda s: None)
    for t, table in before.items():
        assert hive(t).equals(table), t


def test_through_a_uri_and_on_storage_without_rename(two_days):
    """A file:// URI, and a pyarrow filesystem that is not the local one (as an object store is: no
    dot-named file, no rename, no lock; an object is there once written whole)."""
    root = two_days
    before = _read(root)
    got = am.compact(f"file://{root}", file_bytes=128 << 20, settle_seconds=3600, now=NOW, fsync=False,
                     report=lambda s: None)
    assert got.dates == 4 and got.errors == 0
    _same(before, _read(root))
    remote = ds.DatasetRoot(pafs.SubTreeFileSystem(str(root.parent), pafs.LocalFileSystem()), root.name,
                            "mock://bucket/archive")
    got = am.compact(remote, file_bytes=128 << 20, settle_seconds=0, now=NOW, fsync=False, report=lambda s: None)
    assert got.dates == 4 and got.errors == 0 and len(_data_files(root, "gpu", "2026-12-02")) == 1
    _same(before, _read(root))
    lines = []
    got = am.prune(remote, keep_days=1, table_keep_days={"incidents": 0}, now=NOW, report=lines.append)
    assert got.dates == 3 and ds.table_dates(root, "gpu") == ["2026-12-02"]
    assert ds.table_dates(root, "incidents") == ["2026-12-01", "2026-12-02"]
    assert any(line.startswith("dropped table=gpu/date=2026-12-01") for line in lines)


def test_the_file_size_target_makes_several_files_of_about_that_size(two_days):
    root = two_days
    before = _read(root)
    sizes = [(root / "table=gpu" / "date=2026-12-01" / n).stat().st_size for n in _data_files(root, "gpu", "2026-12-01")]
    target = sum(sizes) // 3
    got = am.compact(str(root), file_bytes=target, settle_seconds=3600, now=NOW, fsync=False, report=lambda s: None)
    assert got.errors == 0
    after = _data_files(root, "gpu", "2026-12-01")
    assert 3 <= len(after) <= 4
    _same(before, _read(root))


def test_no_small_file_is_left_alone_to_sort_among_the_outputs(tmp_path, monkeypatch):
    """Rows of the same node and time in several files (a re-sent sweep) are read in file-name order.
    Seven files in runs of three would leave the last alone; an output named with a writer id that
    sorts after its would then be read after it though its sources came first. None is left alone."""
    root = tmp_path / "archive"
    _write_rolls(root, "2026-12-01", 7)
    before = _read(root)
    sizes = [(root / "table=gpu" / "date=2026-12-01" / n).stat().st_size for n in _data_files(root, "gpu", "2026-12-01")]
    ids = iter(f"ffff{k:04x}" for k in range(1 << 16))
    monkeypatch.setattr(ds, "new_writer_id", lambda: next(ids))
    got = am.compact(str(root), file_bytes=int(max(sizes) * 3.5), settle_seconds=3600, now=NOW, fsync=False,
                     report=lambda s: None)
    assert got.errors == 0
    assert all(ds.part_writer(n).startswith("ffff") for n in _data_files(root, "gpu", "2026-12-01"))
    _same(before, _read(root))


@pytest.mark.parametrize("compaction_id", ["00000000", "ffffffff"])
def test_an_output_sorts_where_its_sources_did_beside_a_file_left_out_of_the_same_first_ts(
        tmp_path, monkeypatch, compaction_id):
    """Every gpu file starts at the same re-sent row, so its writer id alone places it. Two small files,
    a large one left out, two small files: each pair's output is read on its own side of the large one,
    whichever way the compaction's new id sorts against the writers' ids."""
    root = tmp_path / "archive"
    writers = iter(f"3000000{k}" for k in range(5))
    monkeypatch.setattr(ds, "new_writer_id", lambda: next(writers))
    _write_rolls(root, "2026-12-01", 2, first=1)
    _write_rolls(root, "2026-12-01", 1, first=3, samples=4000)
    _write_rolls(root, "2026-12-01", 2, first=4)
    before = _read(root)
    names = _data_files(root, "gpu", "2026-12-01")
    assert [ds.part_writer(n) for n in names] == [f"3000000{k}" for k in range(5)]
    assert len({n.split("-")[1] for n in names}) == 1
    sizes = [(root / "table=gpu" / "date=2026-12-01" / n).stat().st_size for n in names]
    large = sizes.pop(2)
    file_bytes = int(max(sizes) * 2.5)      # a pair of small files fits; the large one is left out
    assert large >= file_bytes
    monkeypatch.setattr(ds, "new_writer_id", lambda: compaction_id)
    got = am.compact(str(root), file_bytes=file_bytes, settle_seconds=3600, now=NOW, fsync=False,
                     report=lambda s: None)
    assert got.errors == 0
    after = _data_files(root, "gpu", "2026-12-01")
    assert [ds.part_writer(n) for n in after] == [compaction_id, "30000002", compaction_id]
    _same(before, _read(root))
    # compacted again, all in one: the output keeps the first writer's file's stem, and its place
    monkeypatch.setattr(ds, "new_writer_id", lambda: "abcdef01")
    got = am.compact(str(root), file_bytes=128 << 20, settle_seconds=3600, now=NOW, fsync=False,
                     report=lambda s: None)
    assert got.errors == 0
    assert _data_files(root, "gpu", "2026-12-01") == [ds.compacted_file_name(names[0], "abcdef01", 1)]
    _same(before, _read(root))


def test_a_dry_run_says_what_it_would_do_and_changes_nothing(two_days):
    root = two_days
    listing = sorted(str(p) for p in root.rglob("*"))
    lines = []
    got = am.compact(str(root), file_bytes=128 << 20, settle_seconds=0, now=NOW, dry_run=True, report=lines.append)
    assert got.dates == 8 and got.files_before == 72 and got.files_after == 8
    assert all(line.startswith("would compact") for line in lines)
    assert sorted(str(p) for p in root.rglob("*")) == listing


def test_a_crash_between_publishing_and_deleting_the_sources_shows_no_row_twice_and_the_next_run_finishes(
        two_days, monkeypatch):
    root = two_days
    before = _read(root)
    real_delete = am._delete

    def crash(*args):
        raise OSError("killed between publishing the outputs and deleting the sources")

    monkeypatch.setattr(am, "_delete", crash)
    got = am.compact(str(root), file_bytes=128 << 20, settle_seconds=3600, now=NOW, fsync=False, report=lambda s: None)
    assert got.errors == 4
    names = _data_files(root, "events", "2026-12-01")
    assert sum(n.startswith("part-") for n in names) == 13 and sum(ds.compaction_record(n) for n in names) == 1
    _same(before, _read(root))            # the readers take the output and leave the sources out
    monkeypatch.setattr(am, "_delete", real_delete)
    lines = []
    got = am.compact(str(root), file_bytes=128 << 20, settle_seconds=3600, now=NOW, fsync=False, report=lines.append)
    assert got.finished == 4 and got.undone == 0 and got.dates == 0
    assert sum("finish the interrupted compaction" in line for line in lines) == 4
    for table in ("events", "gpu", "decisions", "incidents"):
        assert len(_data_files(root, table, "2026-12-01")) == 1
    _same(before, _read(root))


def test_a_crash_while_writing_the_outputs_loses_nothing_and_the_next_run_undoes_and_compacts(
        two_days, monkeypatch):
    root = two_days
    before = _read(root)
    commits = []
    real_commit = ds.AtomicParquetFile.commit

    def commit_then_die(self, metadata=None):
        if "table=gpu" in self.path:
            if commits:                   # gpu's second output: killed after its rows were written
                raise SystemExit("killed")
            commits.append(self.path)
        return real_commit(self, metadata)

    monkeypatch.setattr(ds.AtomicParquetFile, "commit", commit_then_die)
    monkeypatch.setattr(am, "_settle", lambda *a, **k: None)   # a kill: nothing in this process cleans up
    target = sum((root / "table=gpu" / "date=2026-12-01" / n).stat().st_size
                 for n in _data_files(root, "gpu", "2026-12-01")) // 3
    with pytest.raises(SystemExit):
        am.compact(str(root), file_bytes=target, settle_seconds=3600, now=NOW, fsync=False, report=lambda s: None)
    monkeypatch.undo()
    names = _data_files(root, "gpu", "2026-12-01")
    (record,) = [n for n in names if ds.compaction_record(n)]
    writer = json.loads((root / "table=gpu" / "date=2026-12-01" / record).read_text())["writer"]
    assert sum(ds.part_writer(n) == writer for n in names) == 1     # one output of several in place
    assert any(n.startswith(".") and n.endswith(".tmp") for n in names)  # the second, unfinished
    _same(before, _read(root))            # the readers take the sources and leave the output out
    got = am.compact(str(root), file_bytes=target, settle_seconds=3600, now=NOW, fsync=False, report=lambda s: None)
    assert got.undone == 1 and got.errors == 0 and got.dates >= 2     # gpu again, incidents (the others may merge further)
    names = _data_files(root, "gpu", "2026-12-01")
    assert all(n.startswith("part-") and ds.part_writer(n) != writer for n in names)
    _same(before, _read(root))


def test_a_crash_while_writing_the_record_leaves_nothing_the_next_run_keeps(two_days):
    root = two_days
    d = root / "table=gpu" / "date=2026-12-01"
    torn = d / f".{ds.compaction_record_name('abcdef01')}.tmp"
    torn.write_text('{"writer": "abcd')
    before = _read(root)
    got = am.compact(str(root), file_bytes=128 << 20, settle_seconds=3600, now=NOW, fsync=False, report=lambda s: None)
    assert got.dates == 4 and got.errors == 0 and not torn.exists()
    assert len(_data_files(root, "gpu", "2026-12-01")) == 1
    _same(before, _read(root))


def test_an_error_while_writing_undoes_the_compaction_at_once(two_days, monkeypatch):
    root = two_days
    before = _read(root)
    listing = _data_files(root, "gpu", "2026-12-01")

    def full(self, data, row_group_size=None):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ds.AtomicParquetFile, "write", full)
    got = am.compact(str(root), file_bytes=128 << 20, settle_seconds=3600, now=NOW, fsync=False, report=lambda s: None)
    assert got.errors == 4 and got.dates == 0
    assert _data_files(root, "gpu", "2026-12-01") == listing
    monkeypatch.undo()
    _same(before, _read(root))


def test_files_of_different_schemas_are_left_as_they_are(two_days):
    root = two_days
    d = root / "table=gpu" / "date=2026-12-01"
    odd = pa.table({"ts": pa.array([1], pa.timestamp("ns", "UTC")), "node": ["n9"]})
    ds.write_parquet_atomic(odd, d / ds.part_file_name(1, "ffffffff-000001"), fsync=False)
    got = am.compact(str(root), file_bytes=128 << 20, settle_seconds=3600, now=NOW, fsync=False, report=lambda s: None)
    assert got.dates == 3 and any("table=gpu/date=2026-12-01" in s and "schema" in s for s in got.skipped)
    assert len(_data_files(root, "gpu", "2026-12-01")) == 13


def _days(root, dates, tables=("events", "decisions")):
    for date in dates:
        _write_rolls(root, date, 1)


def test_retention_drops_dates_older_than_each_tables_days(tmp_path):
    root = tmp_path / "archive"
    _days(root, ["2026-11-01", "2026-11-02", "2026-11-03", "2026-11-04", "2026-11-05"])
    now = _ts("2026-11-06") + 12 * 3600
    leftover = root / "table=gpu" / ".date=2026-10-01.pruned-abcdef01"
    leftover.mkdir()
    (leftover / "part-x.parquet").write_bytes(b"PAR1")
    listing = sorted(str(p) for p in root.rglob("*"))
    lines = []
    dry = am.prune(str(root), keep_days=2, table_keep_days={"decisions": 0, "events": 1}, dry_run=True, now=now,
                   report=lines.append)
    assert sorted(str(p) for p in root.rglob("*")) == listing and all(x.startswith("would drop") for x in lines)
    got = am.prune(str(root), keep_days=2, table_keep_days={"decisions": 0, "events": 1}, now=now, report=lines.append)
    assert (got.dates, got.files_before) == (dry.dates, dry.files_before)
    assert ds.table_dates(root, "gpu") == ds.table_dates(root, "incidents") == ["2026-11-04", "2026-11-05"]
    assert ds.table_dates(root, "events") == ["2026-11-05"]
    assert len(ds.table_dates(root, "decisions")) == 5                 # 0: kept forever
    assert not leftover.exists()
    assert sorted(os.listdir(root / "table=gpu")) == ["date=2026-11-04", "date=2026-11-05"]
    assert ds.read_table(root, "events").num_rows == 12


def test_retention_leaves_a_date_a_live_writer_is_writing_into(tmp_path):
    root = tmp_path / "archive"
    _days(root, ["2026-11-01"])
    (root / "table=gpu" / "date=2026-11-01" / ".part-1-abcdef01-000001.parquet.tmp").write_bytes(b"PAR1")
    got = am.prune(str(root), keep_days=1, now=time.time(), report=lambda s: None)
    assert ds.table_dates(root, "gpu") == ["2026-11-01"] and ds.table_dates(root, "events") == []
    assert any("table=gpu/date=2026-11-01" in s and "in progress" in s for s in got.skipped)


def test_the_command_compacts_and_prunes_and_says_so(tmp_path, capsys):
    root = tmp_path / "archive"
    _write_rolls(root, "2021-03-01", 3)
    assert cli.main(["archive", "compact", "--archive", str(root), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would compact table=gpu/date=2021-03-01: 3 files" in out and "(dry run): 4 dates, 12 files -> 4" in out
    assert len(_data_files(root, "gpu", "2021-03-01")) == 3
    assert cli.main(["archive", "compact", "--archive", str(root)]) == 0
    assert len(_data_files(root, "gpu", "2021-03-01")) == 1
    assert cli.main(["archive", "prune", "--archive", str(root)]) == 0
    assert "nothing to drop" in capsys.readouterr().out
    cfg = tmp_path / "f.toml"       # the archive named once, in [serve], for the service and its cron jobs
    cfg.write_text(f'[serve]\narchive = "{root}"\n[archive]\nkeep_days = 30\ntable_keep_days = ["incidents=0"]\n')
    assert cli.main(["archive", "prune", "--config", str(cfg)]) == 0
    assert "dropped table=gpu/date=2021-03-01" in capsys.readouterr().out
    assert ds.table_dates(root, "gpu") == [] and ds.table_dates(root, "incidents") == ["2021-03-01"]


@pytest.mark.parametrize("argv, needle", [
    (["compact", "--file-bytes", "5"], "file_bytes from flag --file-bytes: must be in"),
    (["compact", "--settle-seconds", "-1"], "settle_seconds from flag --settle-seconds: must be in"),
    (["compact", "--settle-seconds", "nan"], "settle_seconds from flag --settle-seconds: expected a finite number"),
    (["prune", "--keep-days", "-1"], "keep_days from flag --keep-days: must be in"),
    (["prune", "--keep-days", "3", "--table-keep-days", "gpus=3"], "table_keep_days 'gpus=3': must be TABLE=DAYS"),
    (["prune", "--keep-days", "3", "--table-keep-days", "gpu=x"], "table_keep_days 'gpu=x': DAYS must be"),
    (["prune", "--keep-days", "3", "--table-keep-days", "gpu=1", "--table-keep-days", "gpu=2"], "given twice"),
])
def test_the_command_refuses_bad_settings_naming_them_and_touches_nothing(argv, needle, tmp_path, capsys):
    root = tmp_path / "archive"
    _write_rolls(root, "2021-03-01", 2)
    listing = sorted(str(p) for p in root.rglob("*"))
    assert cli.main(["archive", *argv, "--archive", str(root)]) == 2
    assert needle in capsys.readouterr().err
    assert sorted(str(p) for p in root.rglob("*")) == listing


def test_the_command_names_an_archive_it_cannot_use(tmp_path, capsys):
    assert cli.main(["archive", "compact"]) == 2
    assert "archive: none given" in capsys.readouterr().err
    assert cli.main(["archive", "prune", "--keep-days", "1", "--archive", str(tmp_path / "nope")]) == 2
    assert str(tmp_path / "nope") in capsys.readouterr().err
    root = tmp_path / "archive"
    _write_rolls(root, "2021-03-01", 2)
    held = os.open(root, os.O_RDONLY | os.O_DIRECTORY)     # another run in progress
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert cli.main(["archive", "compact", "--archive", str(root)]) == 2
    finally:
        os.close(held)
    assert "another `foreshock archive` run" in capsys.readouterr().err
