"""The archive: what the control plane takes in, as one hive-partitioned Parquet dataset that
`foreshock train` and `foreshock evaluate` read as is (`foreshock serve --archive DIR_OR_URI`).

Layout (read by foreshock/dataset.py; docs/schema.md):

    ROOT/table=<table>/date=<YYYY-MM-DD>/part-<first ts ns>-<writer id>-<n>.parquet

- each schema-v1 telemetry table (foreshock/schema.py) as taken: the batches that passed the receipt
  and value checks (service/ingest.py), their rows as the collectors sent them;
- `decisions`: the decision log's rows (service/decisions.py, DECISION_SCHEMA): alarms, every
  directive ordered (kinds evacuate, shrink, checkpoint_exit, with its node, spare, step and ranks),
  drains, acks and outcomes;
- `incidents` (schema v1): the fatal alarms and fabric incidents, as decisions.incident_rows derives them;
- `step_times` (schema v1): the samples of each ReportStepTimes the service accepted (service/steptimes.py).

A file holds one table's rows of one UTC date for every node, with the node names in its footer
(dataset.NODES_KEY). Rows wait in memory per table; when all tables' rows together pass
`buffer_bytes`, the largest table's are sorted by node and time and written into its file as a run of
row groups (ROW_GROUP_ROWS each, so that a read of one node skips the others' row groups by their
statistics). A file is published (dataset.AtomicParquetFile: written under a dot-name, then synced
and renamed; an object store's upload completes) once it holds `file_bytes` of Parquet, or once its
table's oldest rows not yet published have waited `roll_seconds`. Memory stays with the buffers
while files grow to analytics sizes. Storage is addressed through pyarrow's filesystem layer
(dataset.filesystem_of, the readers' too): a local path, or any URI pyarrow supports (s3://, gs://, hdfs://).

Off the scoring path: the consumers hand their tables over by reference, the ingest stage once its
value checks have run (`take_tables`, `take_batches`, on the scoring thread), the decision log when
it flushes (`take_decisions`) and the step times once per accepted report (`take_tables`), onto a
queue bounded by `queue_bytes`; one writer thread decodes, buffers, sorts and writes. When the queue
is full a submission is dropped and counted
(`foreshock_archive_dropped_bytes_total`): the archive never holds back scoring or an ack, and the
collectors' own spools hold the same rows. `foreshock serve` runs this writer in a process of its own
(`ArchiveSettings.process`, service/archive_process.py), so that its CPU and its Python's GIL time are
not the service process's; with `process=False` it is a thread of the service process
(benchmarks/results/archive-process-2026-12-05.md compares the two).

Failures: a root that cannot be written is refused at construction (ArchiveError, naming it:
`foreshock serve` does not start). A write that fails later (a full disk, a lost mount or credential)
stops the archive: one log line naming the file and the error, `foreshock_archive_up` 0,
`foreshock_archive_errors_total` counts it, and what was buffered or comes later is dropped and
counted. Scoring, the state and the decision log go on untouched; a restart of the service resumes it.

The archive is a copy for analysis, outside an ack's promise: a kill loses what it had not published
(up to a roll period; the unfinished dot-named files are removed by the next start, once two roll
periods old). Memory: at most `queue_bytes` queued and `buffer_bytes` buffered, plus the sorted copy
of the run being written.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from foreshock import dataset as ds
from foreshock.dataset import AtomicParquetFile   # the archive's seam onto storage (a test fills the disk here)
from foreshock import schema as sch
from foreshock.service.command import ARCHIVE_CHECKS, DEFAULTS
from foreshock.service.decisions import DECISION_SCHEMA, incident_rows
from foreshock.service.fastipc import EOS, BatchDecoder
from foreshock.service.validation import RawBatch, wire_schema

log = logging.getLogger(__name__)

ROW_GROUP_ROWS = 128 * 1024   # rows sorted by node: a read of one node skips the others' row groups


def parquet_options(schema: pa.Schema) -> dict:
    """pyarrow.parquet writer keywords for an archive file of `schema`: the dataset's compression,
    statistics, and dictionary encoding on the string columns only (node names, kinds, units: few
    values). A day's timestamps and counters are nearly all distinct: dictionary-encoded they overflow
    the dictionary page into a fallback that compresses worse than plain encoding
    (benchmarks/results/archive-compaction-2026-12-04.md)."""
    strings = [f.name for f in schema
               if pa.types.is_string(f.type) or pa.types.is_large_string(f.type) or pa.types.is_dictionary(f.type)]
    return {"compression": ds.COMPRESSION, "use_dictionary": strings, "write_statistics": True}

TICK_SECONDS = 1.0            # how often the writer looks at the buffers' age when nothing comes
DECISIONS = "decisions"


class ArchiveError(ValueError):
    """An archive that cannot be used; the message names it."""


@dataclass(frozen=True)
class ArchiveSettings:
    uri: str                                # a directory, or a URI pyarrow.fs understands (s3://bucket/prefix)
    file_bytes: int = DEFAULTS["archive_file_bytes"]       # a file is published at this size (Parquet) ...
    roll_seconds: float = DEFAULTS["archive_roll_seconds"]  # ... or once its table's oldest rows not yet
    #                                                        published waited this long
    buffer_bytes: int = DEFAULTS["archive_buffer_bytes"]   # rows in memory (Arrow), all tables together;
    #                                                        over it the largest table's go into its file
    queue_bytes: int = DEFAULTS["archive_queue_bytes"]     # submissions waiting for the writer; beyond,
    #                                                        dropped and counted
    fsync: bool = True
    process: bool = True    # the writer in a process of its own (service/archive_process.py), as
    #                         `foreshock serve` runs it; False: a thread of the service process

    def __post_init__(self):
        if not self.uri:
            raise ArchiveError("archive: no directory or URI given")
        # the defaults and ranges are `foreshock serve`'s, declared once there (service/command.py)
        for key, value in (("archive_file_bytes", self.file_bytes), ("archive_buffer_bytes", self.buffer_bytes),
                           ("archive_roll_seconds", self.roll_seconds), ("archive_queue_bytes", self.queue_bytes)):
            check = ARCHIVE_CHECKS[key]
            if not check.ok(value):   # NaN fails it too
                raise ArchiveError(f"{key} {value!r}: {check.allowed}")


class _Open:
    """A file being written: its run of row groups so far, the nodes in it, the bytes taken into it."""
    __slots__ = ("file", "nodes", "nbytes", "rows")

    def __init__(self, file: AtomicParquetFile):
        self.file = file
        self.nodes: set[str] = set()
        self.nbytes = 0
        self.rows = 0


class BoundedSubmissions:
    """What both archive front ends (Archive here, ArchiveProcess) share: submissions queued up to
    `settings.queue_bytes` under `self._cv`, never waited for. A submission the owner refuses
    (`_refuses`, asked under the lock) or one over the bound is dropped and counted."""

    def _refuses(self) -> bool:
        raise NotImplementedError

    def _put(self, item, nbytes: int) -> None:
        with self._cv:
            if self._refuses() or self.queued_bytes + nbytes > self.settings.queue_bytes:
                # Never wait for the archive: the scoring path goes on, the loss is counted.
                self.dropped_bytes += nbytes
                return
            self._queue.append((item, nbytes))
            self.queued_bytes += nbytes
            self._cv.notify()


class Archive(BoundedSubmissions):
    """The writer: `take_*` from any thread (by reference, never blocks), `start()`, `close()` (writes it all)."""

    def __init__(self, settings: ArchiveSettings, *, writer_id: str = "", dead_writers=()):
        """`writer_id`: the id in this writer's file names (a new one when empty); `dead_writers`: ids of
        writers known dead (an archive process that died), whose unfinished files are removed now
        rather than two roll periods on."""
        self.settings = settings
        try:
            self.fs, self.root = ds.filesystem_of(settings.uri)
        except ds.DatasetError as exc:
            raise ArchiveError(f"archive {exc}") from None
        self._id = writer_id or ds.new_writer_id()
        self._seq = 0
        self._check_writable()
        self._remove_stale(dead_writers)
        self._cv = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self.queued_bytes = 0
        self._closing = False
        self._thread: threading.Thread | None = None
        # the writer thread's own: per table its buffered parts, since when it holds rows not yet
        # published, its files being written (per date), and its batch decoder
        self._buffers: dict[str, list[pa.Table]] = {}
        self._buffer_bytes: collections.Counter = collections.Counter()
        self.buffered_bytes = 0
        self._since: dict[str, float] = {}
        self._open: dict[tuple[str, str], _Open] = {}
        self._dirs: set[str] = set()
        self._decoders: dict[str, BatchDecoder] = {}
        self._writing: tuple[str, str] = ("", self.root)   # the table and file of the write under way
        self._flushing = 0
        self.up = True
        self.errors = 0
        self.dropped_bytes = 0
        self.rows: collections.Counter = collections.Counter()   # table -> rows published
        self.files = 0
        self.written_bytes = 0
        self.open_bytes = 0   # rows (Arrow bytes) in files being written, not yet published

    def _check_writable(self) -> None:
        uri = self.settings.uri
        if ds.remote(uri):
            # remote storage that does not answer would hang serve's start: asked first, with a deadline
            try:
                ds.probe_storage(uri, ds.OPEN_TIMEOUT_S)
            except ds.DatasetError as exc:
                raise ArchiveError(f"archive {uri!r} cannot be written: {exc}") from None
        probe = f"{self.root}/.foreshock-archive-probe-{self._id}"
        try:
            self.fs.create_dir(self.root, recursive=True)
            with self.fs.open_output_stream(probe) as out:
                out.write(b"foreshock archive probe\n")
            self.fs.delete_file(probe)
        except (OSError, pa.ArrowException) as exc:
            raise ArchiveError(f"archive {self.settings.uri!r} cannot be written: {exc}") from None

    def _remove_stale(self, dead=()) -> None:
        """A killed writer's files in progress (dot-names, which readers skip): a live writer's is
        written at least every roll period, so one untouched for two is dead, and so is any of a
        writer in `dead`. Local roots only (on an object store an unfinished upload is invisible, and
        the store's lifecycle rules expire it)."""
        if not isinstance(self.fs, pafs.LocalFileSystem):
            return
        cutoff = time.time() - 2 * self.settings.roll_seconds
        dead = set(dead)
        removed = 0
        for tmp in Path(self.root).glob("table=*/date=*/.part-*.parquet.tmp"):
            try:
                if ds.part_writer(tmp.name[1:-len(".tmp")]) in dead or tmp.stat().st_mtime < cutoff:
                    tmp.unlink()
                    removed += 1
            except OSError:
                pass
        if removed:
            log.warning("archive: removed %d unfinished files of a writer that was killed", removed)

    # -- the consumers' side (any thread; by reference: the cost is summing sizes) -------------------
    def take_tables(self, tables: dict[str, pa.Table]) -> None:
        """A round's checked telemetry tables (wire schema: schema-v1 names and types)."""
        if tables:
            self._put(("tables", dict(tables)), sum(t.nbytes for t in tables.values()))

    def take_batches(self, items: list, refused, nbytes: int, packed: dict | None = None) -> None:
        """A drain's batches (ingest.Pending) with the value checks' verdicts: (item index, table, ...)
        for each table refused. The batches are decoded here, in the writer thread (`packed`, the
        scoring worker's request for them, is the archive process's: service/archive_process.py)."""
        if items:
            self._put(("batches", items, refused), nbytes)

    def take_groups(self, groups: list[tuple[str, bytes, list[bytes]]], nbytes: int) -> None:
        """A drain's accepted record batches grouped by table and schema message (table, schema
        message, record batch bodies), as the archive process receives them (service/archive_process.py)."""
        if groups:
            self._put(("groups", groups), nbytes)

    def take_decisions(self, rows: pa.Table) -> None:
        """Decision log rows (DECISION_SCHEMA) as written to the log; incidents are derived from them."""
        if rows.num_rows:
            self._put(("decisions", rows), rows.nbytes)

    def count_unreadable(self, nbytes: int) -> None:
        """A submission that could not be read before it reached the queue: an error, its bytes dropped."""
        with self._cv:
            self.errors += 1
            self.dropped_bytes += nbytes

    def _refuses(self) -> bool:
        return not self.up or self._closing

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> "Archive":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="foreshock-archive", daemon=True)
            self._thread.start()
        return self

    def close(self, timeout: float = 120.0) -> None:
        """Write and publish everything queued and buffered, then stop; waits at most `timeout` s."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        if self._thread is None:
            self._run()
        else:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("archive: still writing after %.0f s at stop; what it has not written is lost", timeout)

    def stats(self) -> dict:
        with self._cv:
            return {"up": self.up, "errors": self.errors, "dropped_bytes": self.dropped_bytes,
                    "rows": dict(self.rows), "files": self.files, "written_bytes": self.written_bytes,
                    "queued_bytes": self.queued_bytes, "buffered_bytes": self.buffered_bytes,
                    "open_bytes": self.open_bytes + self._flushing}

    # -- the writer thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                if not self._queue and not self._closing:
                    self._cv.wait(TICK_SECONDS)
                got = self._queue.popleft() if self._queue else None
                if got is not None:
                    self.queued_bytes -= got[1]
                last = self._closing and not self._queue
            if got is not None:
                if self.up:
                    try:
                        self._take(got[0])
                    except Exception:   # odd input costs that submission only
                        with self._cv:
                            self.errors += 1
                            self.dropped_bytes += got[1]
                        log.exception("archive: a submission of %d bytes could not be read; dropped", got[1])
                else:
                    with self._cv:
                        self.dropped_bytes += got[1]
            try:
                self._roll(everything=last)
            except Exception as exc:   # a full disk, or anything else: the archive stops, said once
                self._stop_on(exc)
            if last:
                return

    def _take(self, item) -> None:
        kind = item[0]
        if kind == "tables":
            for name, table in item[1].items():
                self._buffer(name, table)
        elif kind == "batches":
            for name, table in self._decode_batches(item[1], item[2]).items():
                self._buffer(name, table)
        elif kind == "groups":
            for name, table in self._decode_groups(item[1], {}).items():
                self._buffer(name, table)
        else:
            rows = item[1]
            self._buffer(DECISIONS, rows)
            incidents = incident_rows(rows)
            if incidents.num_rows:
                self._buffer("incidents", incidents)

    def _decode_batches(self, items: list, refused) -> dict[str, pa.Table]:
        """A drain's accepted tables, each table's batches decoded together by the decoder the scoring
        worker uses (service/fastipc.py: one chunk per column); a table the value checks refused is
        left out."""
        out_refused = {(v[0], v[1]) for v in refused or ()}
        groups: dict[tuple[str, int], tuple[bytes, list[bytes]]] = {}
        decoded: dict[str, list[pa.Table]] = collections.defaultdict(list)
        for i, item in enumerate(items):
            for name, t in item.tables.items():
                if (i, name) in out_refused:
                    continue
                if type(t) is RawBatch:
                    g = groups.get((name, id(t.head)))
                    if g is None:
                        g = groups[(name, id(t.head))] = (t.head, [])
                    g[1].append(t.body)
                else:
                    decoded[name].append(t)
        return self._decode_groups([(name, head, bodies) for (name, _), (head, bodies) in groups.items()],
                                   decoded)

    def _decode_groups(self, groups, decoded: dict[str, list[pa.Table]]) -> dict[str, pa.Table]:
        """Each (table, schema message, record batch bodies) decoded at once, with `decoded`'s tables."""
        decoded = collections.defaultdict(list, decoded)
        for name, head, bodies in groups:
            dec = self._decoders.get(name)
            if dec is None:
                dec = self._decoders[name] = BatchDecoder(wire_schema(name))
            got = dec.decode(head, bodies)
            decoded[name].append(got[0] if got is not None else
                                 pa.ipc.open_stream(b"".join([head, *bodies, EOS])).read_all().combine_chunks())
        return {name: (pa.concat_tables(parts) if len(parts) > 1 else parts[0]) for name, parts in decoded.items()}

    def _buffer(self, name: str, table: pa.Table) -> None:
        self._buffers.setdefault(name, []).append(table)
        self._since.setdefault(name, time.monotonic())
        self._buffer_bytes[name] += table.nbytes
        with self._cv:
            self.buffered_bytes += table.nbytes

    def _roll(self, everything: bool = False) -> None:
        """Publish what has waited a roll period (or everything), and keep the buffers under their bound."""
        s = self.settings
        now = time.monotonic()
        for name in sorted(self._since):
            if self.up and (everything or now - self._since[name] >= s.roll_seconds):
                self._flush(name)
                self._publish(name)
        while self.up and self.buffered_bytes > s.buffer_bytes and self._buffer_bytes:
            self._flush(max(self._buffer_bytes, key=self._buffer_bytes.__getitem__))

    def _flush(self, name: str) -> None:
        """The table's buffer, sorted by node and time, as a run of row groups into its file of each
        date; a file that reached file_bytes is published."""
        parts = self._buffers.pop(name, [])
        nbytes = self._buffer_bytes.pop(name, 0)
        with self._cv:
            self.buffered_bytes -= nbytes
            self._flushing = nbytes   # out of the buffer, not yet in a file: lost too if this fails
        if not parts:
            return
        data = _conform(name, parts)
        del parts
        for date, part in _by_date(data):
            size = part.nbytes
            part = part.sort_by([("node", "ascending"), ("ts", "ascending")])
            f = self._open.get((name, date))
            if f is None:
                directory = ds.date_dir(self.root, name, date)
                if directory not in self._dirs:
                    self._writing = (name, directory)
                    self.fs.create_dir(directory, recursive=True)
                    self._dirs.add(directory)
                self._seq += 1
                first = pc.min(part.column("ts")).value
                f = self._open[(name, date)] = _Open(AtomicParquetFile(
                    f"{directory}/{ds.part_file_name(first, f'{self._id}-{self._seq:06d}')}", part.schema,
                    filesystem=self.fs, fsync=self.settings.fsync, **parquet_options(part.schema)))
            self._writing = (name, f.file.path)
            f.file.write(part, ROW_GROUP_ROWS)
            f.nodes.update(pc.unique(part.column("node")).to_pylist())
            f.nbytes += size
            with self._cv:
                self.open_bytes += size
            f.rows += part.num_rows
            self._flushing -= size
            if f.file.size >= self.settings.file_bytes:
                self._publish(name, date)
        self._flushing = 0

    def _publish(self, name: str, date: str | None = None) -> None:
        """Finish the table's files (of `date`, or all) and put them in place."""
        for key in [k for k in self._open if k[0] == name and (date is None or k[1] == date)]:
            f = self._open[key]
            self._writing = (name, f.file.path)
            size = f.file.commit({ds.NODES_KEY: json.dumps(sorted(f.nodes)).encode()})
            del self._open[key]
            with self._cv:
                self.open_bytes -= f.nbytes
                self.rows[name] += f.rows
                self.files += 1
                self.written_bytes += size
        if name not in self._buffers and not any(k[0] == name for k in self._open):
            self._since.pop(name, None)

    def _stop_on(self, exc: Exception) -> None:
        """A write failed: the archive stops (a full disk would fail every later write too)."""
        files = list(self._open.values())
        self._open.clear()
        for f in files:
            f.file.abort()
        with self._cv:
            self.up = False
            self.errors += 1
            lost = sum(f.nbytes for f in files) + self._flushing + self.buffered_bytes + self.queued_bytes
            self._flushing = 0
            self.open_bytes = 0
            self.dropped_bytes += lost
            self._queue.clear()
            self.queued_bytes = 0
            self.buffered_bytes = 0
        self._buffers.clear()
        self._buffer_bytes.clear()
        self._since.clear()
        name, path = self._writing
        log.error("archive: writing table %s to %s failed: %s; the archive stops here (%d bytes not written; "
                  "scoring and the service state go on; restart the service to resume archiving)",
                  name, path, exc, lost)


def _conform(name: str, parts: list[pa.Table]) -> pa.Table:
    """The buffered parts as one table of the exact schema (the wire's lacks the field metadata)."""
    schema = DECISION_SCHEMA if name == DECISIONS else sch.schema(name)
    return pa.concat_tables([p if p.schema.equals(schema, check_metadata=True) else p.cast(schema)
                             for p in parts])


def _by_date(data: pa.Table):
    """(date, rows) per UTC date of `ts`: one file each."""
    ts = data.column("ts")
    bounds = pc.min_max(ts)
    lo, hi = (pc.strftime(bounds[k], format="%Y-%m-%d", locale="C").as_py() for k in ("min", "max"))
    if lo == hi:
        yield lo, data
        return
    days = pc.strftime(ts, format="%Y-%m-%d", locale="C")
    for day in sorted(pc.unique(days).to_pylist()):
        yield day, data.filter(pc.equal(days, day))


__all__ = ["Archive", "ArchiveSettings", "ArchiveError"]
