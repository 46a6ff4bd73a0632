"""Compaction and retention of the archive that `foreshock serve --archive` writes (service/archive.py),
run by `foreshock archive compact|prune` (service/archive_command.py; docs/service.md, "The archive").

The layout, the file names and the compaction record are foreshock/dataset.py's (date_dir,
part_file_name, compacted_file_name, COMPACTION_RECORD_PREFIX); the files are written as the archive
writes them (parquet_options, ROW_GROUP_ROWS, the node names in the footer under NODES_KEY), by the
project's one atomic Parquet writer (dataset.AtomicParquetFile), through pyarrow.fs, so a URI works
as a path does.

Compaction merges the small files of a closed date directory (its date ended `settle_seconds` ago)
into files of about `file_bytes`: the files under `file_bytes` are taken in name order and grouped
while a group's bytes stay within it (never across a file left out, and a small file never left alone
between groups: _plan); each group of two or more becomes one file, its rows sorted by
node then ts as the writer sorts a run (stable: rows alike keep their order), named after the group's
first file (dataset.compacted_file_name), so that it sorts where its sources did and readers, who take
rows of the same node and time in file-name order, read them in the same order as before. A group is
read whole, so memory is about one output file's rows as Arrow. In one date directory, in this order:

  1. the record `_compaction-<id>.json` (the sources' names, how many outputs) is written atomically;
  2. each output `<its first source's stem>-<id>-<n>.parquet` is written and published (a dot-name,
     then synced and renamed; on an object store, visible when its upload completes);
  3. the sources are deleted, the directory synced;
  4. the record is deleted.

The project's readers (dataset.list_dir) take a directory with a record as the record says: its
sources until every output is in place, its outputs alone from then on, so they read each row once
whenever they list. A crash, or an error, leaves:

  - before 1 is in place: nothing, or the record's dot-named temporary file, which the next run deletes;
  - between 1 and the last output published: the record and some outputs, which readers leave out for
    the sources; the next run undoes it (deletes those outputs and their dot-named files, then the
    record) and compacts again; an error in this process undoes it at once;
  - between the last output published and 4: the record, every output and some sources, which readers
    leave out; the next run finishes it (deletes the sources left, then the record).

No row is lost at any step (a source goes only once every output holding its rows is in place), and
no reader of the project's sees a row twice. A reader that does not know the record (DuckDB, Spark,
pandas on the directory) sees the outputs and the sources together while step 3 runs, and after a
crash there until the next run finishes it. A reader that listed the files before a compaction and
opens them after step 3 finds a source gone (a missing file, not a wrong answer): it reads again.

Retention drops whole date directories whose every row is older than the table's `keep_days`
(0: kept forever). On a local disk the directory is first renamed to a dot-name (`.date=D.pruned-<id>`,
which readers skip) and then deleted, so a reader sees the date whole or not at all; a crash leaves
the dot-named directory, deleted by the next run. On an object store there is no rename: its objects
are deleted one by one. A date directory that holds a live writer's file in progress (a dot-name
touched within twice the longest roll period serve allows) is left for a later run.

One run at a time: on a local root each run holds a lock on the root directory (flock) and a second
one is refused; on an object store, run it from one place (one cron job).
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from foreshock import dataset as ds
from foreshock.service.archive import ROW_GROUP_ROWS, parquet_options
from foreshock.service.command import ARCHIVE_ROLL_SECONDS_MAX

log = logging.getLogger(__name__)

PRUNED_MARK = ".pruned-"                          # .date=<D>.pruned-<id>: a date directory being dropped
LIVE_IN_PROGRESS_S = 2 * ARCHIVE_ROLL_SECONDS_MAX  # a writer's file in progress touched since is a live one's
DAY_S = 86_400


class MaintenanceError(ValueError):
    """An archive that cannot be compacted or pruned (not there, locked, unreadable); the message names it."""


@dataclass
class Summary:
    """What a run did (or, with dry_run, would do)."""
    dates: int = 0             # date directories compacted or dropped
    files_before: int = 0      # their files taken (compaction: the sources; retention: every file dropped)
    files_after: int = 0       # compaction: the files written in their place
    bytes_before: int = 0
    bytes_after: int = 0
    finished: int = 0          # interrupted compactions completed
    undone: int = 0            # interrupted compactions rolled back
    skipped: list[str] = field(default_factory=list)   # directories left as they are, and why
    errors: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class _Group:
    paths: list[str]
    nbytes: int
    schema: pa.Schema
    nodes: frozenset[str]


def _open(uri: "str | ds.DatasetRoot") -> ds.DatasetRoot:
    try:
        return ds.open_dataset_root(uri)
    except ds.DatasetError as exc:
        raise MaintenanceError(f"archive {exc}") from None


@contextmanager
def _one_run(root: ds.DatasetRoot):
    if not root.local:
        yield
        return
    try:
        fd = os.open(root.path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise MaintenanceError(f"archive {root}: {exc.strerror}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise MaintenanceError(f"archive {root}: another `foreshock archive` run holds it") from None
        yield
    finally:
        os.close(fd)


def _tables(root: ds.DatasetRoot) -> list[str]:
    return [d.rpartition("/")[2][len("table="):] for d in ds.list_dir(root.fs, root.path)[0]
            if d.rpartition("/")[2].startswith("table=")]


def _day(date: str) -> dt.date | None:
    try:
        return dt.date.fromisoformat(date)
    except ValueError:
        return None


def _utc_day(ts: float) -> dt.date:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).date()


def _files(fs: pafs.FileSystem, directory: str) -> list[pafs.FileInfo]:
    return [i for i in fs.get_file_info(pafs.FileSelector(directory, allow_not_found=True))
            if i.type == pafs.FileType.File]


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):,.1f} MiB"


# -- compaction ------------------------------------------------------------------------------------
def compact(uri: "str | ds.DatasetRoot", *, file_bytes: int, settle_seconds: float, dry_run: bool = False,
            now: float | None = None, fsync: bool = True,
            report: Callable[[str], None] = print) -> Summary:
    """Merge the small files of every closed date directory of every table (module docstring);
    `report` gets a line per directory compacted (or, with dry_run, that would be)."""
    started = time.monotonic()
    now = time.time() if now is None else now
    root = _open(uri)
    out = Summary()
    with _one_run(root):
        for table in _tables(root):
            for date in ds.table_dates(root, table):
                day = _day(date)
                if day is None:
                    continue
                ends = dt.datetime.combine(day + dt.timedelta(days=1), dt.time(), dt.timezone.utc).timestamp()
                if now < ends + settle_seconds:
                    continue
                directory = ds.date_dir(root.path, table, date)
                try:
                    _settle(root, directory, dry_run, out, report)
                    groups = _plan(root, directory, file_bytes)
                except (OSError, ValueError, pa.ArrowException) as exc:
                    out.skipped.append(f"{root.show(directory)}: {exc}")
                    log.warning("archive compaction: %s left as it is: %s", root.show(directory), exc)
                    continue
                if not groups:
                    continue
                before = sum(len(g.paths) for g in groups)
                nbytes = sum(g.nbytes for g in groups)
                if dry_run:
                    report(f"would compact table={table}/date={date}: {before} files ({_mib(nbytes)}) "
                           f"into {len(groups)}")
                    written = nbytes
                else:
                    try:
                        written = _compact_date(root, directory, groups, fsync)
                    except (OSError, pa.ArrowException) as exc:
                        out.errors += 1
                        log.error("archive compaction of %s failed: %s (undone if its outputs were not all "
                                  "in place, else the next run deletes the sources left; readers count each "
                                  "row once meanwhile)", root.show(directory), exc)
                        continue
                    report(f"compacted table={table}/date={date}: {before} files ({_mib(nbytes)}) into "
                           f"{len(groups)} ({_mib(written)})")
                out.dates += 1
                out.files_before += before
                out.files_after += len(groups)
                out.bytes_before += nbytes
                out.bytes_after += written
    out.seconds = time.monotonic() - started
    return out


def _settle(root: ds.DatasetRoot, directory: str, dry_run: bool, out: Summary,
            report: Callable[[str], None]) -> None:
    """Finish or undo the compactions a crash interrupted in `directory` (the module docstring's cases)."""
    fs = root.fs
    infos = _files(fs, directory)
    for info in infos:
        if info.base_name.startswith(".") and info.base_name.endswith(".tmp") \
                and ds.compaction_record(info.base_name[1:-len(".tmp")]):
            if not dry_run:   # a record never put in place: its compaction had not begun
                fs.delete_file(info.path)
            continue
        if not ds.compaction_record(info.base_name):
            continue
        record = ds.read_compaction_record(fs, info.path)
        writer = record["writer"]
        names = [i.base_name for i in infos if ds.data_file(i.base_name)]
        if ds.compaction_complete(record, names):
            doomed = [f"{directory}/{n}" for n in set(record["sources"]) & set(names)]
            verb = "finish"
            out.finished += 1
        else:
            # its outputs, published or in progress (AtomicParquetFile's `.NAME.tmp`)
            doomed = [i.path for i in infos
                      if ds.part_writer(i.base_name) == writer
                      or (i.base_name.startswith(".") and i.base_name.endswith(".tmp")
                          and ds.part_writer(i.base_name[1:-len(".tmp")]) == writer)]
            verb = "undo"
            out.undone += 1
        report(f"{'would ' if dry_run else ''}{verb} the interrupted compaction {writer} of "
               f"{root.show(directory)} (deleting {len(doomed)} files)")
        if not dry_run:
            _delete(root, directory, doomed)
            fs.delete_file(info.path)


def _plan(root: ds.DatasetRoot, directory: str, file_bytes: int) -> list[_Group]:
    """The groups of small files to merge, each checked: one schema, the node names of its files."""
    sizes = {i.path: i.size for i in _files(root.fs, directory)}
    # Readers take a directory's files in name order, and rows of the same node and time (a re-sent
    # sweep) in that order. An output takes its first source's place in that order, so a run never
    # spans a file left out: a large one, or one not named as the archive names files (an output is
    # named after its first source). A run of one file is not merged, so a small file is never left
    # alone among runs (it joins the run before it, or after it).
    segments: list[list[str]] = [[]]
    for path in ds.list_dir(root.fs, directory)[1]:
        if sizes.get(path, file_bytes) < file_bytes and ds.part_writer(path.rpartition("/")[2]):
            segments[-1].append(path)
        elif segments[-1]:
            segments.append([])
    runs: list[list[str]] = []
    for segment in segments:
        mine: list[list[str]] = []
        total = 0
        for path in segment:
            if not mine or total + sizes[path] > file_bytes:
                mine.append([])
                total = 0
            mine[-1].append(path)
            total += sizes[path]
        if len(mine) > 1 and len(mine[0]) == 1:
            mine[1].insert(0, mine.pop(0)[0])
        for k in range(len(mine) - 1, 0, -1):
            if len(mine[k]) == 1:
                mine[k - 1].extend(mine.pop(k))
        runs.extend(mine)
    groups = []
    for paths in (r for r in runs if len(r) > 1):
        schema = None
        nodes: set[str] = set()
        for path in paths:
            with root.fs.open_input_file(path) as f:
                got = pq.ParquetFile(f).schema_arrow
            if schema is None:
                schema = got
            elif not got.equals(schema, check_metadata=True):
                raise ValueError(f"{root.show(path)} has another schema than {root.show(paths[0])}")
            nodes |= ds.file_nodes(path, root)
        groups.append(_Group(paths, sum(sizes[p] for p in paths), schema, frozenset(nodes)))
    return groups


def _compact_date(root: ds.DatasetRoot, directory: str, groups: list[_Group], fsync: bool) -> int:
    """Steps 1-4 of the module docstring; returns the bytes written. An error undoes what was done."""
    fs = root.fs
    writer = ds.new_writer_id()
    record = f"{directory}/{ds.compaction_record_name(writer)}"
    sources = [p for g in groups for p in g.paths]
    _write_atomic(root, record, json.dumps({"writer": writer, "sources": [p.rpartition("/")[2] for p in sources],
                                            "outputs": len(groups)}).encode(), fsync)
    written = 0
    try:
        for n, group in enumerate(groups, 1):
            data = pads.dataset(group.paths, schema=group.schema, format="parquet", filesystem=fs).to_table()
            data = data.sort_by([("node", "ascending"), ("ts", "ascending")])
            name = ds.compacted_file_name(group.paths[0].rpartition("/")[2], writer, n)
            f = ds.AtomicParquetFile(f"{directory}/{name}", group.schema, filesystem=fs, fsync=fsync,
                                     **parquet_options(group.schema))
            try:
                f.write(data, ROW_GROUP_ROWS)
            except BaseException:
                f.abort()
                raise
            del data
            written += f.commit({ds.NODES_KEY: json.dumps(sorted(group.nodes)).encode()})
    except BaseException:
        try:
            _settle(root, directory, False, Summary(), lambda line: None)
        except (OSError, ValueError, pa.ArrowException) as exc:
            log.error("archive compaction: undoing %s failed too (the next run undoes it): %s", record, exc)
        raise
    _delete(root, directory, sources)
    fs.delete_file(record)
    return written


def _write_atomic(root: ds.DatasetRoot, path: str, data: bytes, fsync: bool) -> None:
    """A small file put in place whole: on a local disk written under a dot-name, synced and renamed;
    on an object store an object is visible only once written whole."""
    if not root.local:
        with root.fs.open_output_stream(path) as f:
            f.write(data)
        return
    head, _, name = path.rpartition("/")
    tmp = f"{head}/.{name}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync:
        ds._fsync_dir(head)


def _delete(root: ds.DatasetRoot, directory: str, paths: Iterable[str]) -> None:
    for path in paths:
        try:
            root.fs.delete_file(path)
        except FileNotFoundError:
            pass
    if root.local:
        ds._fsync_dir(directory)   # the deletions are on disk before the record goes


# -- retention -------------------------------------------------------------------------------------
def prune(uri: "str | ds.DatasetRoot", *, keep_days: int, table_keep_days: Mapping[str, int] | None = None,
          dry_run: bool = False, now: float | None = None,
          report: Callable[[str], None] = print) -> Summary:
    """Drop every date directory whose rows are all older than its table's days to keep
    (`table_keep_days`, else `keep_days`; 0 keeps it forever)."""
    started = time.monotonic()
    now = time.time() if now is None else now
    table_keep_days = dict(table_keep_days or {})
    root = _open(uri)
    out = Summary()
    with _one_run(root):
        for table in _tables(root):
            table_dir = root.join(f"table={table}")
            if not dry_run:
                _remove_pruned_leftovers(root, table_dir)
            keep = table_keep_days.get(table, keep_days)
            if not keep:
                continue
            # a date whose next midnight is at least `keep` days ago
            oldest_kept = _utc_day(now - keep * DAY_S)
            for date in ds.table_dates(root, table):
                day = _day(date)
                if day is None or day >= oldest_kept:
                    continue
                directory = ds.date_dir(root.path, table, date)
                try:
                    files = [i for i in root.fs.get_file_info(pafs.FileSelector(directory, recursive=True))
                             if i.type == pafs.FileType.File]
                    live = [i for i in files if i.base_name.startswith(".") and i.mtime is not None
                            and now - i.mtime.timestamp() < LIVE_IN_PROGRESS_S]
                    if live:
                        out.skipped.append(f"{root.show(directory)}: a writer's file in progress, "
                                           f"{root.show(live[0].path)}")
                        continue
                    nbytes = sum(i.size for i in files)
                    if not dry_run:
                        _drop(root, table_dir, directory, date)
                except (OSError, pa.ArrowException) as exc:
                    out.errors += 1
                    log.error("archive retention: dropping %s failed: %s", root.show(directory), exc)
                    continue
                report(f"{'would drop' if dry_run else 'dropped'} table={table}/date={date} "
                       f"({len(files)} files, {_mib(nbytes)}; older than {keep} days)")
                out.dates += 1
                out.files_before += len(files)
                out.bytes_before += nbytes
    out.seconds = time.monotonic() - started
    return out


def _drop(root: ds.DatasetRoot, table_dir: str, directory: str, date: str) -> None:
    if root.local:
        hidden = f"{table_dir}/.date={date}{PRUNED_MARK}{ds.new_writer_id()}"
        root.fs.move(directory, hidden)
        ds._fsync_dir(table_dir)
        root.fs.delete_dir(hidden)
    else:
        root.fs.delete_dir(directory)


def _remove_pruned_leftovers(root: ds.DatasetRoot, table_dir: str) -> None:
    for info in root.fs.get_file_info(pafs.FileSelector(table_dir, allow_not_found=True)):
        if info.type == pafs.FileType.Directory and info.base_name.startswith(".date=") \
                and PRUNED_MARK in info.base_name:
            root.fs.delete_dir(info.path)
            log.info("archive retention: removed %s, left by an interrupted run", info.path)


__all__ = ["compact", "prune", "Summary", "MaintenanceError"]
