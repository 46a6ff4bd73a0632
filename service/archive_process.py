"""The archive's writer in a process of its own, as `foreshock serve --archive` runs it.

The writer (service/archive.py, Archive) decodes every drain, sorts, compresses and writes. As a thread
of the service process its Python holds the service's GIL while the event loop acks telemetry and the
scoring thread runs its rounds, and at 2,048 nodes on two cores that lengthened the acks' and the fatal
path's tails (benchmarks/results/archive-2026-12-04.md). `ArchiveProcess` keeps the same consumers'
side (`take_tables`, `take_batches`, `take_decisions`: by reference, never waiting, onto a queue bounded
by `queue_bytes`, dropped and counted beyond it) and one sender thread that carries each submission to
the archive process over a socket pair: a drain's accepted record batches joined per table and schema
message (the join and the send release the GIL; nothing is decoded here), other tables as Arrow IPC.
The archive process (`python -m foreshock.service.archive_process`, a fresh interpreter: a fork of a
process running gRPC and Arrow's thread pools can hang) runs an Archive with its own bounded queue
and buffers, and sends back its counters and its log lines twice a second; the service process logs
those lines and exports the counters (stats(), as Archive's).

Failures are the writer's (a full disk: the archive stops, one log line, `foreshock_archive_up` 0, the
rest dropped and counted), plus the process itself: one that dies stops the archive the same way, said
once; scoring and the service state go on. close() has the process write and publish everything and
waits for it, at most `timeout` seconds.

Memory: `queue_bytes` here (submissions not yet sent), and in the archive process `queue_bytes` queued
and `buffer_bytes` buffered (service/archive.py).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

import pyarrow as pa

from foreshock.service.archive import Archive, ArchiveError, ArchiveSettings
from foreshock.service.validation import RawBatch

log = logging.getLogger("foreshock.service.archive")

START_SECONDS = 60.0      # the archive process's start (a fresh interpreter importing Arrow) at most
REPORT_SECONDS = 0.5      # how often the archive process sends its counters and log lines
MAX_LOG_LINES = 100       # log lines the archive process keeps between two reports; older ones dropped
# The archive is a copy for analysis: where the machine has no core to spare, the scheduler gives the
# scoring path's processes (and the collectors on it) the CPU first, and the archive falls behind into
# its bounded queue (dropped and counted beyond it) instead of slowing them.
NICE = 10


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _table(buf: bytes) -> pa.Table:
    return pa.ipc.open_stream(buf).read_all()


def pack_batches(items: list, refused) -> tuple[list, list[bytes]]:
    """A drain's accepted tables as the archive process's message: per table and schema message the
    head and each body's length, the bodies joined into one bytes object; tables a batch carries
    decoded (not as a known schema's record batches) as Arrow IPC. A refused table is left out."""
    out = {(v[0], v[1]) for v in refused or ()}
    groups: dict[tuple[str, int], tuple[str, bytes, list[bytes]]] = {}
    decoded: list[tuple[str, bytes]] = []
    for i, item in enumerate(items):
        for name, t in item.tables.items():
            if (i, name) in out:
                continue
            if type(t) is RawBatch:
                g = groups.get((name, id(t.head)))
                if g is None:
                    g = groups[(name, id(t.head))] = (name, t.head, [])
                g[2].append(t.body)
            else:
                decoded.append((name, _ipc(t)))
    meta = {"groups": [(name, head, [len(b) for b in bodies]) for name, head, bodies in groups.values()],
            "decoded": [name for name, _ in decoded]}
    return meta, [b"".join(bodies) for _, _, bodies in groups.values()] + [buf for _, buf in decoded]


def _unpack_groups(meta: dict, blobs: list[bytes]) -> tuple[list, dict[str, pa.Table]]:
    groups = []
    for (name, head, lengths), joined in zip(meta["groups"], blobs):
        at, bodies = 0, []
        for n in lengths:
            bodies.append(joined[at:at + n])
            at += n
        groups.append((name, head, bodies))
    tables = {}
    for name, buf in zip(meta["decoded"], blobs[len(meta["groups"]):]):
        t = _table(buf)
        tables[name] = pa.concat_tables([tables[name], t]) if name in tables else t
    return groups, tables


class ArchiveProcess:
    """Archive's interface, its writer in the archive process: `take_*` from any thread (by reference,
    never blocks), `start()`, `close()` (writes it all), `stats()`, `up`."""

    def __init__(self, settings: ArchiveSettings):
        self.settings = settings
        # the root is checked (and a killed writer's files removed) here, so that `foreshock serve`
        # refuses an archive it cannot write before it serves; the writer is not started here
        Archive(settings)
        self._cv = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self.queued_bytes = 0
        self.dropped_bytes = 0      # dropped on this side: queue full, archive stopped, closing
        self.errors = 0             # the archive process died
        self._down = False          # this side stopped the archive (the process died)
        self._closing = False
        self._ready = threading.Event()   # the archive process has reported once
        self._ended = threading.Event()   # the archive process said it wrote everything, or died
        self._child: dict = {}      # the archive process's latest counters (Archive.stats())
        self._told_failure = False
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._sender: threading.Thread | None = None
        self._receiver: threading.Thread | None = None

    # -- the consumers' side (any thread; by reference) ---------------------------------------------
    def take_tables(self, tables: dict[str, pa.Table]) -> None:
        if tables:
            self._put(("tables", dict(tables)), sum(t.nbytes for t in tables.values()))

    def take_batches(self, items: list, refused, nbytes: int) -> None:
        if items:
            self._put(("batches", items, refused), nbytes)

    def take_decisions(self, rows: pa.Table) -> None:
        if rows.num_rows:
            self._put(("decisions", rows), rows.nbytes)

    @property
    def up(self) -> bool:
        with self._cv:
            return not self._down and self._child.get("up", True)

    def _put(self, item, nbytes: int) -> None:
        with self._cv:
            if (self._down or not self._child.get("up", True) or self._closing
                    or self.queued_bytes + nbytes > self.settings.queue_bytes):
                # Never wait for the archive: the scoring path goes on, the loss is counted.
                self.dropped_bytes += nbytes
                return
            self._queue.append((item, nbytes))
            self.queued_bytes += nbytes
            self._cv.notify()

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> "ArchiveProcess":
        if self._proc is not None:
            return self
        parent, child = socket.socketpair()
        settings = dataclasses.replace(self.settings, process=False)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "foreshock.service.archive_process", str(child.fileno()),
                 json.dumps(dataclasses.asdict(settings))],
                pass_fds=[child.fileno()], stdin=subprocess.DEVNULL)
        finally:
            child.close()
        self._conn = Connection(parent.detach())
        self._sender = threading.Thread(target=self._send_loop, name="foreshock-archive-sender", daemon=True)
        self._receiver = threading.Thread(target=self._receive_loop, name="foreshock-archive-receiver",
                                          daemon=True)
        self._sender.start()
        self._receiver.start()
        # what is taken from now on goes to a writer that runs (or the archive is down, and said so)
        deadline = time.monotonic() + START_SECONDS
        while not (self._ready.is_set() or self._ended.is_set()) and time.monotonic() < deadline:
            self._ready.wait(0.1)
        return self

    def close(self, timeout: float = 120.0) -> None:
        """Have the archive process write and publish everything, then stop; waits at most `timeout` s."""
        self.start()
        with self._cv:
            self._closing = True
            self._cv.notify()
        deadline = time.monotonic() + timeout
        self._sender.join(timeout)
        if not self._ended.wait(max(0.0, deadline - time.monotonic())):
            log.error("archive: still writing after %.0f s at stop; what it has not written is lost", timeout)
        try:
            self._proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._receiver.join(5.0)
        self._conn.close()

    def stats(self) -> dict:
        with self._cv:
            c = self._child
            return {"up": not self._down and c.get("up", True), "errors": self.errors + c.get("errors", 0),
                    "dropped_bytes": self.dropped_bytes + c.get("dropped_bytes", 0),
                    "rows": dict(c.get("rows", {})), "files": c.get("files", 0),
                    "written_bytes": c.get("written_bytes", 0),
                    "queued_bytes": self.queued_bytes + c.get("queued_bytes", 0),
                    "buffered_bytes": c.get("buffered_bytes", 0)}

    # -- the sender and receiver threads -------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                got = self._queue.popleft() if self._queue else None
                last = self._closing and not self._queue
            if got is not None:
                item, nbytes = got
                try:
                    if not self.up:
                        raise _Dropped
                    self._send(item, nbytes)
                except _Dropped:
                    with self._cv:
                        self.dropped_bytes += nbytes
                except (OSError, ValueError):   # the archive process is gone: the receiver says so
                    with self._cv:
                        self.dropped_bytes += nbytes
                except Exception:   # odd input costs that submission only
                    with self._cv:
                        self.errors += 1
                        self.dropped_bytes += nbytes
                    log.exception("archive: a submission of %d bytes could not be read; dropped", nbytes)
                with self._cv:
                    self.queued_bytes -= nbytes
            if last:
                try:
                    self._conn.send_bytes(pickle.dumps(("close", None, 0, 0)))
                except (OSError, ValueError):
                    pass
                return

    def _send(self, item, nbytes: int) -> None:
        kind = item[0]
        if kind == "batches":
            meta, blobs = pack_batches(item[1], item[2])
        elif kind == "tables":
            meta, blobs = list(item[1]), [_ipc(t) for t in item[1].values()]
        else:
            meta, blobs = None, [_ipc(item[1])]
        # the joined record batches (megabytes) go as they are, after the small pickled rest: no copy
        # into a pickle, and the GIL is free while the socket takes them
        self._conn.send_bytes(pickle.dumps((kind, meta, len(blobs), nbytes)))
        for blob in blobs:
            self._conn.send_bytes(blob)

    def _receive_loop(self) -> None:
        while True:
            try:
                kind, counters, lines = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError, ValueError):
                break
            for level, line in lines:
                log.log(level, "%s", line)
            with self._cv:
                self._child = counters
            self._ready.set()
            if kind == "closed":
                self._ended.set()
                return
        code = self._proc.wait() if self._proc is not None else "?"
        with self._cv:
            c = self._child
            # what this side still queues is counted as the sender drops it
            lost = c.get("queued_bytes", 0) + c.get("buffered_bytes", 0)
            self._child = dict(c, queued_bytes=0, buffered_bytes=0,
                               dropped_bytes=c.get("dropped_bytes", 0) + lost)
            self._down = True
            self.errors += 1
        log.error("archive: the archive process (pid %s) exited with code %s; the archive stops here (%d bytes "
                  "not written; scoring and the service state go on; restart the service to resume archiving)",
                  self._proc.pid if self._proc is not None else "?", code, lost)
        self._ended.set()


class _Dropped(Exception):
    """A submission the sender drops: the archive stopped."""


class _Lines(logging.Handler):
    """The archive process's log lines, kept for the next report (the service process logs them)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: collections.deque = collections.deque(maxlen=MAX_LOG_LINES)

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + logging.Formatter().formatException(record.exc_info)
        self.lines.append((record.levelno, text))

    def take(self) -> list:
        out = list(self.lines)
        self.lines.clear()
        return out


def archive_main(conn: Connection, settings: ArchiveSettings) -> None:
    """The archive process: take submissions until told to close (or the service process is gone),
    then write and publish everything; report the counters and log lines every REPORT_SECONDS."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the service stops it, in order
    os.nice(NICE)
    lines = _Lines()
    logging.getLogger().addHandler(lines)
    logging.getLogger().setLevel(logging.WARNING)
    from foreshock.service.server import tune_malloc
    tune_malloc()
    try:
        arc = Archive(settings).start()
    except ArchiveError as exc:   # the root went away since the service checked it
        conn.send_bytes(pickle.dumps(("stats", {"up": False}, [(logging.ERROR, str(exc))])))
        sys.exit(2)

    def report(kind: str) -> None:
        conn.send_bytes(pickle.dumps((kind, arc.stats(), lines.take())))

    report("stats")
    reported = time.monotonic()
    while True:
        try:
            ready = conn.poll(REPORT_SECONDS)
            if ready:
                kind, meta, n, nbytes = pickle.loads(conn.recv_bytes())
                blobs = [conn.recv_bytes() for _ in range(n)]
        except (EOFError, OSError):
            break   # the service process is gone: what was taken is still written
        if ready:
            if kind == "close":
                break
            if kind == "batches":
                groups, tables = _unpack_groups(meta, blobs)
                arc.take_groups(groups, sum(map(len, blobs[:len(groups)])))
                arc.take_tables(tables)
            elif kind == "tables":
                arc.take_tables({name: _table(buf) for name, buf in zip(meta, blobs)})
            else:
                arc.take_decisions(_table(blobs[0]))
        if time.monotonic() - reported >= REPORT_SECONDS:
            reported = time.monotonic()
            try:
                report("stats")
            except (OSError, ValueError):
                break
    arc.close()
    try:
        report("closed")
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    archive_main(Connection(int(sys.argv[1])), ArchiveSettings(**json.loads(sys.argv[2])))
