"""The Parquet dataset Foreshock writes and reads: schema-v1 tables, hive-partitioned by table, date, node.

Layout (docs/schema.md):

    ROOT/table=<table>/date=<YYYY-MM-DD>/node=<node>/part-<first ts ns>-<writer id>-<n>.parquet

Files are zstd-compressed and written atomically: each is written under a dot-name that readers skip
(pyarrow, DuckDB and Spark ignore names starting with '.' or '_'), flushed to disk, renamed, and the
directory synced, so a reader, a crash or a power cut never sees a half-written file. Rows are buffered
per table for one *interval* (`rotate_seconds`, a few minutes) and written when it closes. Meanwhile
each appended batch also goes to the table's journal, `ROOT/.journal/<table>-<writer id>-<n>.arrows`,
an append-only Arrow IPC stream written at once (a kill loses nothing appended) and synced at most
every JOURNAL_SYNC_SECONDS (a power cut loses at most that); it is removed when its interval's files
are written. A writer that starts replays the journals no live writer holds (flock) into Parquet, under
the names the interrupted writer would have used, so a crash between writing and removing a journal
writes no row twice. The buffer is bounded (`max_buffer_rows`): reaching it closes the interval early.
The spool is bounded too: when the dataset outgrows `max_bytes`, or the disk's free space drops under
`min_free_bytes`, the oldest closed files are deleted and counted; writing never blocks sampling.

The control plane's archive (`foreshock serve --archive`, service/archive.py) writes the same tables
one level up, a file per table and date holding every node, sorted by node then ts:

    ROOT/table=<table>/date=<YYYY-MM-DD>/part-<first ts ns>-<writer id>-<n>.parquet

and `foreshock archive compact` merges a closed date's files there, naming each file it writes after
the first of the files it replaces (compacted_file_name, which keeps their place in name order), with a
record beside them while it works (COMPACTION_RECORD_PREFIX) that list_dir honours, so every reader here
counts each row once.

The readers here go through pyarrow's filesystem layer (pyarrow.fs): a dataset is a local directory,
relative to the cwd, or any URI pyarrow.fs.FileSystem.from_uri takes (file://, s3://, gs://, hdfs://);
DatasetRoot holds the filesystem and the path, and every listing and read below goes through it.
They take both layouts, in one dataset too: files directly under a date are filtered by
their `node` column (row groups pruned by its statistics), and list_nodes reads the node names those
files carry in their footer (`foreshock.nodes`, NODES_KEY) or, lacking it, their node column.

`node` stays a column inside each file as well as a path component, so a single file is self-describing;
the reader here prunes by path and reads the in-file columns. In the files it is dictionary-encoded
strings (int32 indices), the type pyarrow infers for a hive path key: with a plain string column,
pandas.read_parquet and pyarrow.parquet.read_table refuse the table ("Field node has incompatible
types"); read as schema v1 it is a string again. docs/schema.md shows how each common reader opens a table.
"""

from __future__ import annotations

import collections
import fcntl
import json
import logging
import os
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from foreshock import schema as sch

log = logging.getLogger(__name__)

COMPRESSION = "zstd"
JOURNAL_DIR = ".journal"
JOURNAL_SYNC_SECONDS = 1.0


def _quote(value: str) -> str:
    return urllib.parse.quote(value, safe="-_.@:")


def partition_dir(root: Path, table: str, date: str, node: str) -> Path:
    return Path(root) / f"table={table}" / f"date={date}" / f"node={_quote(node)}"


def date_dir(root: str, table: str, date: str) -> str:
    """The archive's directory of one table and date (a path of the dataset's filesystem)."""
    return f"{root}/table={table}/date={date}"


def part_file_name(first_ts_ns: int, token: str) -> str:
    """A data file's name in either layout: `part-<first ts ns, 19 digits>-<token>.parquet`, where the
    token is `<writer id>-<n>` (8 hex digits, the writer's nth file) or a journal's (`j<writer id>-<n>`)."""
    return f"part-{first_ts_ns:019d}-{token}.parquet"


def new_writer_id() -> str:
    """A writer's id in its files' names: 8 hex digits, new for each writer (part_file_name)."""
    return uuid.uuid4().hex[:8]


def compacted_file_name(first_source: str, writer: str, n: int) -> str:
    """The name of the nth file a compaction (writer id `writer`) makes of a group whose first file in
    name order is `first_source`, a name of either form (part_writer is not ""): that file's stem,
    `part-<first ts ns>-<writer id>-<n>`, then `-<writer>-<n>.parquet`. Readers take a date's files in
    name order; names sort by their stems (fixed-width fields), and no two files a reader takes share
    one (a compaction's outputs replace its sources), so an output sorts where its sources did against
    every other file, whatever its writer id."""
    parts = first_source.split("-")
    return f"{'-'.join(parts[:3])}-{parts[3].removesuffix('.parquet')}-{writer}-{n:06d}.parquet"


def part_writer(name: str) -> str:
    """The writer id in a data file's name, a writer's (part_file_name) or a compaction's
    (compacted_file_name); "" for a name of neither form."""
    parts = name.split("-")
    if parts[0] != "part":
        return ""
    return parts[2] if len(parts) == 4 else parts[4] if len(parts) == 6 else ""


@dataclass
class WriterStats:
    rows_written: collections.Counter = field(default_factory=collections.Counter)
    files_written: int = 0
    bytes_written: int = 0
    files_dropped: int = 0
    bytes_dropped: int = 0
    write_errors: int = 0
    rows_recovered: int = 0      # rows replayed from the journals of an interrupted writer


class _Journal:
    """One table's open interval as an append-only Arrow IPC stream file, held under flock."""

    def __init__(self, path: Path, schema: pa.Schema, fsync: bool):
        self.path = path
        self.fh = open(path, "xb")   # holds the lock, and syncs
        fcntl.flock(self.fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # Arrow's own buffered file: a batch is one write() at flush, not a Python call per buffer
        self.sink = pa.BufferedOutputStream(pa.OSFile(str(path), "wb"), 1 << 16)
        self.writer = pa.ipc.new_stream(self.sink, schema)
        self.sink.flush()
        self._fsync = fsync
        self._synced_at = 0.0
        if fsync:
            _fsync_dir(path.parent)

    def append(self, data: pa.Table) -> None:
        self.writer.write_table(data)
        self.sink.flush()  # into the page cache: a killed process loses nothing written
        if self._fsync and time.monotonic() - self._synced_at >= JOURNAL_SYNC_SECONDS:
            os.fsync(self.fh.fileno())
            self._synced_at = time.monotonic()

    def close(self) -> None:
        if not self.fh.closed:
            self.writer.close()
            self.sink.close()
            self.fh.close()

    def discard(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AtomicParquetFile:
    """A Parquet file published whole: written a run of row groups at a time (`write`) where no reader
    looks, and put in place by `commit()`; `abort()` leaves nothing.

    On the local filesystem (`filesystem` None or local) it is written under a dot-name beside `path`
    (`.NAME.tmp`, which readers skip), and commit() syncs it, renames it over `path` and syncs the
    directory. On any other pyarrow filesystem (an object store: S3, GCS, ...) it is written to `path`
    directly: an object becomes visible only whole, when its upload completes at commit(), and a
    rename there is a copy. `options` are pyarrow.parquet.ParquetWriter's."""

    def __init__(self, path: str | os.PathLike, schema: pa.Schema, *, filesystem: pafs.FileSystem | None = None,
                 fsync: bool = True, **options):
        self.local = filesystem is None or isinstance(filesystem, pafs.LocalFileSystem)
        self.fs = pafs.LocalFileSystem() if self.local else filesystem
        self.path = str(path)
        self.fsync = fsync
        head, _, name = self.path.rpartition("/")
        self.tmp = f"{head}/.{name}.tmp" if self.local else self.path
        self._sink = self.fs.open_output_stream(self.tmp)
        try:
            self._writer = pq.ParquetWriter(self._sink, schema, **options)
        except BaseException:
            self._sink.close()
            self._remove()
            raise
        self._open = True

    def write(self, data: pa.Table, row_group_size: int | None = None) -> None:
        self._writer.write_table(data, row_group_size=row_group_size)

    @property
    def size(self) -> int:
        """Bytes written so far (the footer comes at commit)."""
        return self._sink.tell()

    def commit(self, metadata: dict[bytes, bytes] | None = None) -> int:
        """Finish the file (with `metadata` in its footer) and put it in place; returns its size."""
        try:
            if metadata:
                self._writer.add_key_value_metadata(metadata)
            self._writer.close()
            self._sink.close()
            self._open = False
            if self.local:
                if self.fsync:
                    fd = os.open(self.tmp, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                os.replace(self.tmp, self.path)
                if self.fsync:
                    _fsync_dir(Path(self.path).parent)
        except BaseException:
            self.abort()
            raise
        return self.fs.get_file_info(self.path).size

    def abort(self) -> None:
        """Close and remove what was written (errors here are not raised: the file is lost either way)."""
        if self._open:
            self._open = False
            for close in (self._writer.close, self._sink.close):
                try:
                    close()
                except (OSError, pa.ArrowException):
                    pass
        self._remove()

    def _remove(self) -> None:
        try:
            self.fs.delete_file(self.tmp)
        except (OSError, pa.ArrowException):
            pass


def write_parquet_atomic(data: pa.Table, path: str | os.PathLike, *, filesystem: pafs.FileSystem | None = None,
                         fsync: bool = True, row_group_size: int | None = None, **options) -> int:
    """Write `data` as the Parquet file `path` at once, so that no reader ever sees part of it
    (AtomicParquetFile); returns its size. On an error nothing is left under either name."""
    f = AtomicParquetFile(path, data.schema, filesystem=filesystem, fsync=fsync, **options)
    try:
        f.write(data, row_group_size)
    except BaseException:
        f.abort()
        raise
    return f.commit()


def _read_journal(fh) -> pa.Table | None:
    """The whole batches of a journal; a torn last batch (a kill mid-write) is left out."""
    try:
        reader = pa.ipc.open_stream(fh)
    except (pa.ArrowInvalid, OSError):
        return None   # not even the schema was written
    batches = []
    while True:
        try:
            batches.append(reader.read_next_batch())
        except StopIteration:
            break
        except (pa.ArrowInvalid, OSError):
            break
    return pa.Table.from_batches(batches, reader.schema) if batches else None


class DatasetWriter:
    """Buffers schema-v1 rows and writes them as partitioned Parquet files, atomically, with a bounded spool.

    Thread-safe: sources may append from their own threads (the NVML event thread, the kmsg follower).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        rotate_seconds: float = 300.0,
        max_buffer_rows: int = 500_000,
        max_bytes: int | None = None,
        min_free_bytes: int = 0,
        fsync: bool = True,
        clock=time.time,
        parquet_options: dict[str, dict] | None = None,
        journal: bool = True,
        clear_leftovers: bool = True,
    ):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.rotate_seconds = float(rotate_seconds)
        self.max_buffer_rows = int(max_buffer_rows)
        self.max_bytes = max_bytes
        self.min_free_bytes = int(min_free_bytes)
        self.fsync = fsync
        # Extra pyarrow.parquet.write_table keywords per table ("*": every table), e.g. a simulator's
        # column_encoding={"port_xmit_bytes": "DELTA_BINARY_PACKED"} with use_dictionary=[...].
        self.parquet_options = dict(parquet_options or {})
        self._clock = clock
        self._id = new_writer_id()
        self._seq = 0
        self._lock = threading.Lock()
        self._rows: dict[str, list[dict]] = collections.defaultdict(list)
        self._tables: dict[str, list[pa.Table]] = collections.defaultdict(list)
        self._buffered: collections.Counter = collections.Counter()
        self._opened_at = clock()
        self.stats = WriterStats()
        self._closed_files: collections.deque[tuple[Path, int]] = collections.deque()
        self._spool_bytes = 0
        self.journal = journal
        # False: other writers are writing under the same root now (the simulator's Ray tasks), so a
        # temporary file there is theirs, not a leftover; the one who opened the root first cleared it
        self.clear_leftovers = clear_leftovers
        self._journals: dict[str, _Journal] = {}
        self._journal_seq = 0
        self._scan_existing()
        if journal:
            self._replay_journals()

    # -- appending -------------------------------------------------------------------------------
    def append_rows(self, table: str, rows: list[dict]) -> None:
        """Buffer row dicts of a table (validated when the interval is written)."""
        if not rows:
            return
        sch.schema(table)  # an unknown table is refused now, not at flush time
        try:
            data = sch.to_table(table, rows) if self.journal else None
        except (sch.SchemaError, pa.ArrowException, TypeError, ValueError):
            data = None  # refused (and counted) when the interval is written, as without a journal
        with self._lock:
            if data is not None:
                self._journal_append(table, data)
            self._rows[table].extend(rows)
            self._buffered[table] += len(rows)
            over = self._buffered[table] >= self.max_buffer_rows
        if over:
            self.flush(tables=[table])

    def append_table(self, table: str, data: pa.Table) -> None:
        """Buffer an Arrow table (conformed to the schema now, so a bad batch is refused whole)."""
        if data.num_rows == 0:
            return
        data = sch.conform(table, data)
        with self._lock:
            if self.journal:
                self._journal_append(table, data)
            self._tables[table].append(data)
            self._buffered[table] += data.num_rows
            over = self._buffered[table] >= self.max_buffer_rows
        if over:
            self.flush(tables=[table])

    def _journal_append(self, table: str, data: pa.Table) -> None:
        """Under self._lock. A journal that cannot be written costs its durability, never the rows."""
        try:
            j = self._journals.get(table)
            if j is None:
                directory = self.root / JOURNAL_DIR
                directory.mkdir(exist_ok=True)
                self._journal_seq += 1
                j = self._journals[table] = _Journal(
                    directory / f"{table}-{self._id}-{self._journal_seq:06d}.arrows", sch.schema(table), self.fsync)
            j.append(data)
        except (OSError, pa.ArrowException) as exc:
            self.stats.write_errors += 1
            log.error("journal of table %s under %s: %s", table, self.root, exc)

    def buffered_rows(self) -> int:
        with self._lock:
            return sum(self._buffered.values())

    # -- intervals -------------------------------------------------------------------------------
    def maybe_rotate(self, now: float | None = None) -> bool:
        now = self._clock() if now is None else now
        if now - self._opened_at >= self.rotate_seconds:
            self.flush()
            return True
        return False

    def flush(self, tables: Iterable[str] | None = None) -> list[Path]:
        """Close the open interval (of the given tables, or all): write every buffered row to files."""
        with self._lock:
            names = list(tables) if tables is not None else sorted(set(self._rows) | set(self._tables))
            pending = []
            for name in names:
                rows, parts = self._rows.pop(name, []), self._tables.pop(name, [])
                self._buffered.pop(name, None)
                journal = self._journals.pop(name, None)
                if rows or parts:
                    pending.append((name, rows, parts, journal))
                elif journal is not None:
                    journal.discard()
            if tables is None:
                self._opened_at = self._clock()
        written: list[Path] = []
        for name, rows, parts, journal in pending:
            try:
                if rows:
                    parts = [*parts, sch.to_table(name, rows)]
                # One chunk per column: Parquet writes a table of many small chunks (one per sweep)
                # several times slower than the same rows combined.
                data = pa.concat_tables(parts).combine_chunks() if len(parts) > 1 else parts[0]
                written += self.write_table(name, data, token=_journal_token(journal.path) if journal else None)
            except (sch.SchemaError, OSError, pa.ArrowException) as exc:
                # The rows of this table in this interval are lost here; the error names the table and
                # is counted, and every other table is still written. Their journal is kept: the next
                # writer to start on this root tries them again.
                self.stats.write_errors += 1
                log.error("writing table %s under %s failed: %s", name, self.root, exc)
                if journal is not None:
                    journal.close()
                continue
            if journal is not None:
                journal.discard()
        self._enforce_spool()
        return written

    def close(self) -> None:
        self.flush()

    # -- the journals of an interrupted writer ---------------------------------------------------
    def _replay_journals(self) -> None:
        directory = self.root / JOURNAL_DIR
        for path in sorted(directory.glob("*.arrows")):
            table = path.name.split("-", 1)[0]
            try:
                fh = open(path, "rb")
            except OSError:
                continue
            with fh:
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live writer's open interval
                try:
                    data = _read_journal(fh)
                    if data is not None:
                        # Partitions the interrupted writer had already renamed into place are skipped.
                        before = self.stats.rows_written[table]
                        self.write_table(table, data, token=_journal_token(path), skip_existing=True)
                        recovered = self.stats.rows_written[table] - before
                        self.stats.rows_recovered += recovered
                        log.info("replayed %d %s rows from the journal %s", recovered, table, path)
                except (sch.SchemaError, OSError, pa.ArrowException) as exc:
                    self.stats.write_errors += 1
                    log.error("journal %s cannot be replayed, removing it: %s", path, exc)
            path.unlink(missing_ok=True)

    # -- writing ---------------------------------------------------------------------------------
    def write_table(self, table: str, data: pa.Table, *, token: str | None = None,
                    skip_existing: bool = False) -> list[Path]:
        """Write a conformed table now, one file per (date, node) partition it spans. `token` names
        the files after a journal (deterministically, so that a replay finds what was written)."""
        if data.num_rows == 0:
            return []
        data = sch.conform(table, data)
        out = []
        for (date, node), part in _split_partitions(data):
            path = self._write_file(table, date, node, part, token, skip_existing)
            if path is not None:
                out.append(path)
                self.stats.rows_written[table] += part.num_rows
        return out

    def _write_file(self, table: str, date: str, node: str, part: pa.Table, token: str | None = None,
                    skip_existing: bool = False) -> Path | None:
        directory = partition_dir(self.root, table, date, node)
        created = not directory.exists()
        directory.mkdir(parents=True, exist_ok=True)
        first_ts = pc.min(part.column("ts")).value
        if token is None:
            with self._lock:
                self._seq += 1
                token = f"{self._id}-{self._seq:06d}"
        name = part_file_name(first_ts, token)
        final = directory / name
        if skip_existing and final.exists():
            return None
        options = {"compression": COMPRESSION, "use_dictionary": True, "write_statistics": True,
                   **self.parquet_options.get("*", {}), **self.parquet_options.get(table, {})}
        size = write_parquet_atomic(_node_as_path_key(part), final, fsync=self.fsync, **options)
        if self.fsync and created:  # a new partition's entries up to the root
            for d in directory.parents:
                _fsync_dir(d)
                if d == self.root:
                    break
        self.stats.files_written += 1
        self.stats.bytes_written += size
        with self._lock:
            self._closed_files.append((final, size))
            self._spool_bytes += size
        return final

    # -- the bounded spool -----------------------------------------------------------------------
    def _scan_existing(self) -> None:
        files = []
        for path in self.root.glob("table=*/date=*/node=*/*.parquet"):
            try:
                st = path.stat()
            except OSError:
                continue
            files.append((st.st_mtime, path, st.st_size))
        for _, path, size in sorted(files):
            self._closed_files.append((path, size))
            self._spool_bytes += size
        # Leftovers of an interrupted write are never complete files: remove them.
        for tmp in self.root.glob("table=*/date=*/node=*/.*.tmp") if self.clear_leftovers else ():
            try:
                tmp.unlink()
            except OSError:
                pass

    def _disk_free(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def _over_budget(self) -> bool:
        if self.max_bytes is not None and self._spool_bytes > self.max_bytes:
            return True
        return self.min_free_bytes > 0 and self._disk_free() < self.min_free_bytes

    def _enforce_spool(self) -> None:
        with self._lock:
            while self._closed_files and self._over_budget():
                path, size = self._closed_files.popleft()
                self._spool_bytes -= size
                try:
                    path.unlink()
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    log.error("dropping spooled file %s failed: %s", path, exc)
                    continue
                self.stats.files_dropped += 1
                self.stats.bytes_dropped += size
                log.warning("spool over budget: dropped oldest file %s (%d bytes)", path, size)

    @property
    def spool_bytes(self) -> int:
        return self._spool_bytes


def _journal_token(path: Path) -> str:
    """`gpu-<writer id>-<n>.arrows` -> `j<writer id>-<n>`: the names of that interval's files."""
    return "j" + path.stem.split("-", 1)[1]


def _split_partitions(data: pa.Table) -> Iterator[tuple[tuple[str, str], pa.Table]]:
    nodes = data.column("node")
    # Fast path, without formatting every timestamp: one node, and first and last day the same.
    bounds = pc.min_max(data.column("ts"))
    lo, hi = (pc.strftime(bounds[k], format="%Y-%m-%d", locale="C").as_py() for k in ("min", "max"))
    if lo == hi and pc.count_distinct(nodes).as_py() == 1:
        yield (lo, nodes[0].as_py()), data
        return
    dates = pc.strftime(data.column("ts"), format="%Y-%m-%d", locale="C")
    keys = pc.binary_join_element_wise(nodes, dates, "\x00")
    encoded = pc.dictionary_encode(keys).combine_chunks()
    codes = encoded.indices.to_numpy()
    order = np.argsort(codes, kind="stable")
    sorted_codes = codes[order]
    bounds = np.flatnonzero(np.diff(sorted_codes)) + 1
    starts = np.concatenate([[0], bounds])
    ends = np.concatenate([bounds, [len(order)]])
    taken = data.take(pa.array(order))
    dictionary = encoded.dictionary
    for s, e in zip(starts, ends):
        node, date = dictionary[int(sorted_codes[s])].as_py().split("\x00")
        yield (date, node), taken.slice(int(s), int(e - s))


# the type pyarrow.parquet's hive discovery infers for node=... (infer_dictionary=True); a bare
# pyarrow.dataset.dataset(partitioning="hive") infers string and refuses to merge the two (docs/schema.md)
NODE_IN_FILE = pa.dictionary(pa.int32(), pa.string())


def _node_as_path_key(part: pa.Table) -> pa.Table:
    i = part.schema.get_field_index("node")
    if i < 0 or part.schema.field(i).type == NODE_IN_FILE:
        return part
    return part.set_column(i, pa.field("node", NODE_IN_FILE, part.schema.field(i).nullable),
                           part.column(i).cast(NODE_IN_FILE))


# -- reading ---------------------------------------------------------------------------------------
NODES_KEY = b"foreshock.nodes"   # a file of many nodes: their names (a JSON list) in its footer's key-value metadata
OPEN_TIMEOUT_S = 30.0            # a dataset URI whose storage does not answer by then is refused (open_dataset_root)


class DatasetError(ValueError):
    """A dataset that cannot be opened (a URI pyarrow cannot read, storage that does not answer, no
    such directory); the message names it as given."""


def filesystem_of(uri: str | os.PathLike) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path) of a directory or URI; a plain path is a local one, relative to the cwd.
    A URI is whatever pyarrow.fs.FileSystem.from_uri takes (file://, s3://, gs://, hdfs://, ...)."""
    uri = os.fspath(uri)
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise DatasetError(f"{uri!r}: {exc}") from None
    return fs, path.rstrip("/") or path


@dataclass(frozen=True)
class DatasetRoot:
    """A dataset's root on a pyarrow filesystem: what every reader below goes through, whatever the
    storage (dataset_root makes one from a path or URI; the readers also take a path or URI and make
    it themselves). Picklable, the filesystem with it (pyarrow's local, S3, GCS and HDFS ones pickle),
    so a work item carries it to a process or a Ray worker, which reopens it there. `name` is the
    path or URI as given: the messages say it, and str() is it."""
    fs: pafs.FileSystem
    path: str
    name: str

    def join(self, *parts: str) -> str:
        return "/".join((self.path, *parts))

    @property
    def local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    def show(self, path: str) -> str:
        """A path of this dataset as a person would name it: itself on a local disk, else under the URI."""
        if self.local or not path.startswith(self.path):
            return path
        return self.name.rstrip("/") + path[len(self.path):]

    def __str__(self) -> str:
        return self.name


def dataset_root(root: "str | os.PathLike | DatasetRoot") -> DatasetRoot:
    """The DatasetRoot of a path or URI (one is returned as is). Nothing is read: open_dataset_root
    also checks that it is there."""
    if isinstance(root, DatasetRoot):
        return root
    name = os.fspath(root)
    fs, path = filesystem_of(name)
    return DatasetRoot(fs, path, name if "://" in name else str(Path(name)))


# Asked in a child process, which can be killed: opening a URI can already wait on the network (an S3
# URI without a region asks for the bucket's), and a request to storage that does not answer blocks in
# pyarrow's C++ where no thread can stop it (GCS retries for minutes; an S3 request still in flight
# holds the interpreter's exit).
_PROBE = """
import sys
try:
    import pyarrow.fs as fs
    f, p = fs.FileSystem.from_uri(sys.argv[1])
    print(f.get_file_info(p.rstrip("/") or p).type.name)
except Exception as exc:
    print(" ".join(str(exc).split()), file=sys.stderr)
    sys.exit(1)
"""


def remote(uri: str | os.PathLike) -> bool:
    """A URI of storage reached over the network (s3://, gs://, hdfs://, ...): not a local path or file://."""
    uri = os.fspath(uri)
    return "://" in uri and not uri.startswith("file://")


def probe_storage(uri: str, timeout_s: float = OPEN_TIMEOUT_S) -> None:
    """Open a URI of remote storage and ask it for `uri`'s path in a child process that is killed after
    `timeout_s` (a client of storage that never answers can hang past any thread's deadline, and keep
    the process from exiting). Raises DatasetError naming the URI."""
    import subprocess
    import sys
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE, uri], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise DatasetError(f"dataset {uri!r}: its storage does not answer within {timeout_s:g} s") from None
    if out.returncode != 0:
        lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
        raise DatasetError(f"dataset {uri!r}: {lines[-1] if lines else f'exit status {out.returncode}'}")


def open_dataset_root(root: "str | os.PathLike | DatasetRoot", timeout_s: float = OPEN_TIMEOUT_S) -> DatasetRoot:
    """dataset_root, checked: the directory is there. A URI of remote storage is first opened and
    asked in a child process given `timeout_s` to answer (a local path or file:// is asked here, at
    no cost; a DatasetRoot is taken as asked already). Raises DatasetError naming the input."""
    r = root if isinstance(root, DatasetRoot) else None
    if r is None:
        name = os.fspath(root)
        if remote(name):
            probe_storage(name, timeout_s)
        r = dataset_root(name)
    try:
        kind = r.fs.get_file_info(r.path).type
    except (OSError, pa.ArrowException) as exc:
        raise DatasetError(f"dataset {r.name!r}: {exc}") from None
    if kind != pafs.FileType.Directory:
        raise DatasetError(f"dataset directory {r.name} does not exist")
    return r


def data_file(name: str) -> bool:
    """A file name the readers take: Parquet, not a writer's hidden file in progress."""
    return name.endswith(".parquet") and not name.startswith((".", "_"))


def _base(path: str) -> str:
    return path.rpartition("/")[2]


# A compaction of an archive date directory (service/archive_maintenance.py) under way, or cut short:
# `_compaction-<writer id>.json` beside the files, {"writer": id, "sources": [file names], "outputs": n},
# written before its first output and removed after its last source. Its outputs are the files named
# with its writer id (part_writer). Until all n are in place a reader takes the sources and none of the
# outputs; from then on the outputs and none of the sources: each row once, whenever the listing is made.
COMPACTION_RECORD_PREFIX = "_compaction-"
COMPACTION_RECORD_SUFFIX = ".json"


def compaction_record_name(writer: str) -> str:
    return f"{COMPACTION_RECORD_PREFIX}{writer}{COMPACTION_RECORD_SUFFIX}"


def compaction_record(name: str) -> bool:
    return name.startswith(COMPACTION_RECORD_PREFIX) and name.endswith(COMPACTION_RECORD_SUFFIX)


def read_compaction_record(fs: pafs.FileSystem, path: str) -> dict:
    """A compaction record's contents; FileNotFoundError once its compaction has finished, ValueError
    for one that is not a record."""
    with fs.open_input_stream(path) as f:
        record = json.loads(f.read())
    if not (isinstance(record, dict) and isinstance(record.get("writer"), str)
            and isinstance(record.get("sources"), list) and isinstance(record.get("outputs"), int)):
        raise ValueError(f"{path}: not a compaction record")
    return record


def compaction_complete(record: dict, names: Iterable[str]) -> bool:
    """Whether every output of the compaction is among these file names (so its sources are replaced)."""
    return sum(part_writer(n) == record["writer"] for n in names) >= record["outputs"]


def list_dir(fs: pafs.FileSystem, path: str) -> tuple[list[str], list[str]]:
    """(subdirectories, data files) directly in the directory `path` of `fs`, each sorted, as full
    paths; nothing for a path that is not there. A compaction under way counts its rows once
    (COMPACTION_RECORD_PREFIX)."""
    infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    dirs = sorted(i.path for i in infos if i.type == pafs.FileType.Directory)
    files = sorted(i.path for i in infos if i.type == pafs.FileType.File and data_file(i.base_name))
    for info in infos:
        if info.type == pafs.FileType.File and compaction_record(info.base_name):
            try:
                record = read_compaction_record(fs, info.path)
            except FileNotFoundError:   # it finished since the listing: its sources are gone
                return list_dir(fs, path)
            except (OSError, ValueError, pa.ArrowException) as exc:
                log.warning("%s: unreadable compaction record, ignored: %s", info.path, exc)
                continue
            names = [_base(f) for f in files]
            if compaction_complete(record, names):
                gone = set(record["sources"])
                files = [f for f in files if _base(f) not in gone]
            else:
                files = [f for f in files if part_writer(_base(f)) != record["writer"]]
    return dirs, files


_DATE_FILES: dict[tuple, tuple[object, list[str]]] = {}   # (filesystem, date directory) -> (validity, files)
LISTING_TTL_S = 60.0   # storage that keeps no directory mtime (an object store): a listing is reused this long


def date_files(date_dir: str | os.PathLike, fs: pafs.FileSystem | None = None) -> list[str]:
    """The Parquet files directly in a `date=` directory (the archive's layout), sorted; `date_dir` is
    a path of `fs` (default: a local path). Cached per directory: the offline reader asks once per node
    and date. On a local disk the cache holds while the directory's mtime does; an object store keeps
    none, and a listing there is reused for LISTING_TTL_S (a dataset is not rewritten under a run)."""
    if fs is None:
        fs, date_dir = pafs.LocalFileSystem(), os.path.abspath(date_dir)
    date_dir = os.fspath(date_dir)
    key = (fs.type_name, date_dir)
    got = _DATE_FILES.get(key)
    if isinstance(fs, pafs.LocalFileSystem):
        info = fs.get_file_info(date_dir)
        if info.type != pafs.FileType.Directory:
            return []
        valid = info.mtime_ns
        if got is not None and got[0] == valid:
            return got[1]
    else:
        now = time.monotonic()
        if got is not None and now < got[0]:
            return got[1]
        valid = now + LISTING_TTL_S
    files = list_dir(fs, date_dir)[1]
    if len(_DATE_FILES) >= 4096:
        _DATE_FILES.clear()
    _DATE_FILES[key] = (valid, files)
    return files


def table_dates(root: "str | os.PathLike | DatasetRoot", table: str) -> list[str]:
    """The dates (YYYY-MM-DD) a table has a `date=` directory for, sorted."""
    r = dataset_root(root)
    dirs, _ = list_dir(r.fs, r.join(f"table={table}"))
    return [_base(d)[len("date="):] for d in dirs if _base(d).startswith("date=")]


def partition_files(root: "str | os.PathLike | DatasetRoot", table: str, *, nodes: Iterable[str] | None = None,
                    dates: Iterable[str] | None = None) -> list[PurePosixPath]:
    """The table's files (paths of the dataset's filesystem: `Path`s on the local disk, which can be
    opened and stat'ed as before, else PurePosixPaths): each node partition's, and, whatever `nodes`
    says, those directly under a date (the archive's, every node in one file: read_table filters
    their rows)."""
    r = dataset_root(root)
    node_dirs = None if nodes is None else {f"node={_quote(n)}" for n in nodes}
    date_dirs = None if dates is None else {f"date={d}" for d in dates}
    out = []
    for ddir in list_dir(r.fs, r.join(f"table={table}"))[0]:
        name = _base(ddir)
        if not name.startswith("date=") or (date_dirs is not None and name not in date_dirs):
            continue
        subdirs, files = list_dir(r.fs, ddir)
        out.extend(files)
        for ndir in subdirs:
            name = _base(ndir)
            if name.startswith("node=") and (node_dirs is None or name in node_dirs):
                out.extend(list_dir(r.fs, ndir)[1])
    kind = Path if r.local else PurePosixPath
    return [kind(f) for f in out]


def file_nodes(path: str | os.PathLike, root: "DatasetRoot | None" = None) -> set[str]:
    """The nodes of a file that holds many (the archive's): from its footer, else its node column."""
    fs = root.fs if root is not None else None
    f = pq.ParquetFile(os.fspath(path) if fs is None else fs.open_input_file(os.fspath(path)))
    meta = f.metadata.metadata or {}
    if NODES_KEY in meta:
        return set(json.loads(meta[NODES_KEY]))
    out: set[str] = set()
    for i in range(f.num_row_groups):   # a row group at a time: bounded memory
        out.update(pc.unique(f.read_row_group(i, columns=["node"]).column("node")).to_pylist())
    return out


def list_nodes(root: "str | os.PathLike | DatasetRoot", table: str) -> list[str]:
    r = dataset_root(root)
    names: set[str] = set()
    for ddir in list_dir(r.fs, r.join(f"table={table}"))[0]:
        if not _base(ddir).startswith("date="):
            continue
        subdirs, files = list_dir(r.fs, ddir)
        names.update(urllib.parse.unquote(_base(n)[len("node="):]) for n in subdirs if _base(n).startswith("node="))
        for f in files:
            names |= file_nodes(f, r)
    return sorted(names)


def read_table(root: "str | os.PathLike | DatasetRoot", table: str, *, nodes: Iterable[str] | None = None,
               dates: Iterable[str] | None = None, columns: list[str] | None = None,
               filter: pc.Expression | None = None) -> pa.Table:
    """Read one table (optionally some nodes/dates/columns), sorted by node then ts, in schema v1."""
    r = dataset_root(root)
    nodes = None if nodes is None else list(nodes)
    files = partition_files(r, table, nodes=nodes, dates=dates)
    full = sch.schema(table)
    if not files:
        empty = full.empty_table()
        return empty.select(columns) if columns else empty
    if nodes is not None and any(f.parent.name.startswith("date=") for f in files):
        # files of many nodes among them: keep the rows of these nodes (node partitions hold only them)
        mine = pc.field("node").isin(nodes)
        filter = mine if filter is None else (filter & mine)
    dataset = pads.dataset([str(f) for f in files], schema=full, format="parquet", filesystem=r.fs)
    data = dataset.to_table(columns=columns, filter=filter)
    keys = [k for k in ("node", "ts") if k in data.column_names]
    return data.sort_by([(k, "ascending") for k in keys]) if keys else data


def iter_node_tables(root: "str | os.PathLike | DatasetRoot", table: str, *, columns: list[str] | None = None,
                     nodes: Iterable[str] | None = None) -> Iterator[tuple[str, pa.Table]]:
    """Stream a table node-partition by node-partition: memory stays bounded by one node's rows."""
    r = dataset_root(root)
    for node in (list_nodes(r, table) if nodes is None else nodes):
        yield node, read_table(r, table, nodes=[node], columns=columns)
