"""The archive: what the control plane takes in, as one hive-partitioned Parquet dataset that
`foreshock train` and `foreshock evaluate` read as is (`foreshock serve --archive DIR_OR_URI`).

Layout (read by foreshock/dataset.py; docs/schema.md):

    ROOT/table=<table>/date=<YYYY-MM-DD>/part-<first ts ns>-<writer id>-<n>.parquet

- each schema-v1 telemetry table (foreshock/schema.py) as taken: the batches that passed the receipt
  and value checks (service/ingest.py), their rows as the collectors sent them;
- `decisions`: the decision log's rows (service/decisions.py, DECISION_SCHEMA): alarms, every
  directive ordered (kinds evacuate, shrink, checkpoint_exit, with its node, spare, step and ranks),
  drains, acks and outcomes;
- `incidents` (schema v1): the fatal alarms and fabric incidents, as decisions.incident_rows derives them.

A file holds one table's rows of one date for every node, sorted by node then ts, so that its row
groups' statistics prune by node, with the node names in its footer (dataset.NODES_KEY). A table's
rows are buffered until they reach `file_bytes` (Arrow's size in memory; zstd Parquet is several times
smaller) or the oldest has waited `roll_seconds`, and when all tables' buffers together pass
`buffer_bytes` the largest is written early. Files are written atomically (dataset.write_parquet_atomic)
through pyarrow's filesystem layer (pyarrow.fs.FileSystem.from_uri): a local path, or any URI pyarrow
supports (s3://, gs://, hdfs://...).

Off the scoring path: the two consumers hand their tables over in O(1), the ingest stage once its
value checks have run (`take_tables`, `take_batches`, on the scoring thread) and the decision log when
it flushes (`take_decisions`), onto a queue bounded by `queue_bytes`; one writer thread decodes,
buffers, sorts and writes. When the queue is full a submission is dropped and counted
(`foreshock_archive_dropped_bytes_total`): the archive never holds back scoring or an ack, and the
collectors' own spools hold the same rows.

Failures: a root that cannot be written is refused at construction (ArchiveError, naming it:
`foreshock serve` does not start). A write that fails later (a full disk, a lost mount or credential)
stops the archive: one log line naming the file and the error, `foreshock_archive_up` 0,
`foreshock_archive_errors_total` counts it, and what was buffered or comes later is dropped and
counted. Scoring, the state and the decision log go on untouched; a restart of the service resumes it.

The archive is a copy for analysis, outside an ack's promise: a kill loses what it had buffered.
Memory: at most `queue_bytes` queued and `buffer_bytes` buffered, plus the sorted copy of the file
being written.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from foreshock import config
from foreshock import dataset as ds
from foreshock import schema as sch
from foreshock.service.command import ARCHIVE_CHECKS, DEFAULTS
from foreshock.service.decisions import DECISION_SCHEMA, incident_rows
from foreshock.service.ingest import _EOS, RawBatch

log = logging.getLogger(__name__)

# The settings' defaults and allowed ranges are `foreshock serve`'s, declared once (service/command.py).
CHECKS = ARCHIVE_CHECKS
ROW_GROUP_ROWS = 128 * 1024   # rows per row group: a few hundred nodes' rows each, pruned by node
TICK_SECONDS = 1.0            # how often the writer looks at the buffers' age when nothing comes
DECISIONS = "decisions"


class ArchiveError(ValueError):
    """An archive that cannot be used; the message names it."""


@dataclass(frozen=True)
class ArchiveSettings:
    uri: str                                # a directory, or a URI pyarrow.fs understands (s3://bucket/prefix)
    file_bytes: int = DEFAULTS["archive_file_bytes"]       # a table's buffer is written as a file at this
    #                                                        size (Arrow bytes in memory) ...
    roll_seconds: float = DEFAULTS["archive_roll_seconds"]  # ... or once its oldest rows waited this long
    buffer_bytes: int = DEFAULTS["archive_buffer_bytes"]   # every table's buffer together; over it, the
    #                                                        largest is written
    queue_bytes: int = DEFAULTS["archive_queue_bytes"]     # submissions waiting for the writer; beyond,
    #                                                        dropped and counted
    fsync: bool = True

    def __post_init__(self):
        if not self.uri:
            raise ArchiveError("archive: no directory or URI given")
        for key, value in (("archive_file_bytes", self.file_bytes), ("archive_buffer_bytes", self.buffer_bytes),
                           ("archive_roll_seconds", self.roll_seconds), ("archive_queue_bytes", self.queue_bytes)):
            check = CHECKS[key]
            if not check.ok(value):   # NaN fails it too
                raise ArchiveError(f"{key} {value!r}: {check.allowed}")


def filesystem_of(uri: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path) of a directory or URI; a plain path is a local one, relative to the cwd."""
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise ArchiveError(f"archive {uri!r}: {exc}") from None
    return fs, path.rstrip("/")


class _Buffer:
    __slots__ = ("parts", "nbytes", "since")

    def __init__(self):
        self.parts: list[pa.Table] = []
        self.nbytes = 0
        self.since = 0.0


class Archive:
    """The writer: `take_*` from any thread (O(1), never blocks), `start()`, `close()` (writes it all)."""

    def __init__(self, settings: ArchiveSettings):
        self.settings = settings
        self.fs, self.root = filesystem_of(settings.uri)
        self._local = isinstance(self.fs, pafs.LocalFileSystem)
        self._id = uuid.uuid4().hex[:8]
        self._seq = 0
        self._check_writable()
        self._cv = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self.queued_bytes = 0
        self._closing = False
        self._thread: threading.Thread | None = None
        self._buffers: dict[str, _Buffer] = {}
        self.buffered_bytes = 0
        self._dirs: set[str] = set()
        self.up = True
        self.errors = 0
        self.dropped_bytes = 0
        self.rows: collections.Counter = collections.Counter()   # table -> rows written
        self.files = 0
        self.written_bytes = 0

    def _check_writable(self) -> None:
        probe = f"{self.root}/.foreshock-archive-probe-{self._id}"
        try:
            self.fs.create_dir(self.root, recursive=True)
            with self.fs.open_output_stream(probe) as out:
                out.write(b"foreshock archive probe\n")
            self.fs.delete_file(probe)
        except (OSError, pa.ArrowException) as exc:
            raise ArchiveError(f"archive {self.settings.uri!r} cannot be written: {exc}") from None

    # -- the consumers' side (any thread; O(1) apart from summing sizes) ---------------------------
    def take_tables(self, tables: dict[str, pa.Table]) -> None:
        """A round's checked telemetry tables (wire schema: schema-v1 names and types)."""
        if tables:
            self._put(("tables", dict(tables)), sum(t.nbytes for t in tables.values()))

    def take_batches(self, items: list, refused, nbytes: int) -> None:
        """A drain's batches (ingest.Pending) with the value checks' verdicts: (item index, table, ...)
        for each table refused. The batches are decoded here, in the writer thread."""
        if items:
            self._put(("batches", items, refused), nbytes)

    def take_decisions(self, rows: pa.Table) -> None:
        """Decision log rows (DECISION_SCHEMA) as written to the log; incidents are derived from them."""
        if rows.num_rows:
            self._put(("decisions", rows), rows.nbytes)

    def _put(self, item, nbytes: int) -> None:
        with self._cv:
            if not self.up or self._closing or self.queued_bytes + nbytes > self.settings.queue_bytes:
                # Never wait for the writer: the scoring path goes on, the loss is counted.
                self.dropped_bytes += nbytes
                return
            self._queue.append((item, nbytes))
            self.queued_bytes += nbytes
            self._cv.notify()

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> "Archive":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="foreshock-archive", daemon=True)
            self._thread.start()
        return self

    def close(self, timeout: float = 120.0) -> None:
        """Write everything queued and buffered, then stop; waits at most `timeout` seconds."""
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
                    "queued_bytes": self.queued_bytes, "buffered_bytes": self.buffered_bytes}

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
            self._roll(everything=last)
            if last:
                return

    def _take(self, item) -> None:
        kind = item[0]
        if kind == "tables":
            for name, table in item[1].items():
                self._buffer(name, table)
        elif kind == "batches":
            for name, table in _decode_batches(item[1], item[2]).items():
                self._buffer(name, table)
        else:
            rows = item[1]
            self._buffer(DECISIONS, rows)
            incidents = incident_rows(rows)
            if incidents.num_rows:
                self._buffer("incidents", incidents)

    def _buffer(self, name: str, table: pa.Table) -> None:
        b = self._buffers.get(name)
        if b is None:
            b = self._buffers[name] = _Buffer()
        if not b.parts:
            b.since = time.monotonic()
        b.parts.append(table)
        b.nbytes += table.nbytes
        self.buffered_bytes += table.nbytes

    def _roll(self, everything: bool = False) -> None:
        s = self.settings
        now = time.monotonic()
        for name in sorted(self._buffers):
            b = self._buffers[name]
            if b.parts and (everything or b.nbytes >= s.file_bytes or now - b.since >= s.roll_seconds):
                self._write(name)
        while self.buffered_bytes > s.buffer_bytes:
            self._write(max(self._buffers, key=lambda n: self._buffers[n].nbytes))

    def _write(self, name: str) -> None:
        b = self._buffers.pop(name)
        self.buffered_bytes -= b.nbytes
        if not self.up:
            with self._cv:
                self.dropped_bytes += b.nbytes
            return
        path = None
        try:
            data = _conform(name, b.parts)
            for date, part in _by_date(data):
                part = part.sort_by([("node", "ascending"), ("ts", "ascending")])
                nodes = pc.unique(part.column("node")).to_pylist()
                part = part.replace_schema_metadata({**(part.schema.metadata or {}),
                                                     ds.NODES_KEY: json.dumps(sorted(nodes)).encode()})
                directory = f"{self.root}/table={name}/date={date}"
                if directory not in self._dirs:
                    self.fs.create_dir(directory, recursive=True)
                    self._dirs.add(directory)
                self._seq += 1
                first = pc.min(part.column("ts")).value
                path = f"{directory}/part-{first:019d}-{self._id}-{self._seq:06d}.parquet"
                size = ds.write_parquet_atomic(part, path, filesystem=self.fs, fsync=self.settings.fsync,
                                               compression=ds.COMPRESSION, use_dictionary=True,
                                               write_statistics=True, row_group_size=ROW_GROUP_ROWS)
                with self._cv:
                    self.rows[name] += part.num_rows
                    self.files += 1
                    self.written_bytes += size
        except (OSError, pa.ArrowException) as exc:
            self._stop_on(name, path, exc, b.nbytes)

    def _stop_on(self, name: str, path, exc: Exception, nbytes: int) -> None:
        """A write failed: the archive stops (a full disk would fail every later write too)."""
        with self._cv:
            self.up = False
            self.errors += 1
            lost = nbytes + self.buffered_bytes + self.queued_bytes
            self.dropped_bytes += lost
            self._buffers.clear()
            self.buffered_bytes = 0
            self._queue.clear()
            self.queued_bytes = 0
        log.error("archive: writing table %s to %s failed: %s; the archive stops here (%d bytes not written; "
                  "scoring and the service state go on; restart the service to resume archiving)",
                  name, path or self.root, exc, lost)


def _decode_batches(items: list, refused) -> dict[str, pa.Table]:
    """A drain's accepted tables: per table and schema message, every batch's record batches read as
    one Arrow stream (as the scoring worker reads them); a table the value checks refused is left out."""
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
    for (name, _), (head, bodies) in groups.items():
        decoded[name].append(pa.ipc.open_stream(b"".join([head, *bodies, _EOS])).read_all())
    return {name: (pa.concat_tables(parts) if len(parts) > 1 else parts[0]) for name, parts in decoded.items()}


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


__all__ = ["Archive", "ArchiveSettings", "ArchiveError", "CHECKS", "filesystem_of"]
