"""The archive's writer in a process of its own, as `foreshock serve --archive` runs it.

The writer (service/archive.py, Archive) decodes every drain, sorts, compresses and writes Parquet.
Here it runs in the archive process (`python -m foreshock.service.archive_process`: a fresh
interpreter, not a fork, for the reason service/worker.py gives), so none of that work, nor its
Python, shares the service process's GIL with the event loop that acks telemetry and the thread that
runs the scoring rounds.

The service side, `ArchiveProcess`, keeps Archive's consumers' interface (`take_tables`,
`take_batches`, `take_decisions`: by reference, never waiting) in front of a queue bounded by
`queue_bytes`; beyond it a submission is dropped and counted. One sender thread carries the queue to
the archive process over a socket pair, as serialised Arrow IPC: a drain's record batches go as the
scoring worker was sent them (service/worker.py `pack`: each table's batches joined once, shared with
the worker's request, never joined again), with the worker's verdicts so that the archive process
leaves a refused table out; other tables (a round's checked event tables, the decision log's rows) are
written as an IPC stream by the sender. The joined bytes go to the socket as they are, with the GIL
released while it takes them; nothing is decoded in the service process. The archive process runs an
Archive (its own queue, bounded by `queue_bytes` again, and its buffers) and reports its counters and
its log lines back every REPORT_SECONDS; the service logs those lines and exports the counters
(`stats()`, as Archive's).

Failures:
- a root that cannot be written is refused here, at construction, before the service serves
  (ArchiveError naming it);
- a write that fails in the archive process (a full disk, a lost mount or credential) stops the
  archive as Archive does: its log line in the service's log, `foreshock_archive_up` 0, the rest
  dropped and counted; the process stays, dropping, until the service restarts;
- an archive process that dies (killed for memory, a crash in native code) is said once in the log
  with its exit code, counted (`foreshock_archive_restarts_total`; what it held is dropped and counted)
  and started again after a backoff (RESTART_BACKOFF_SECONDS doubling to RESTART_BACKOFF_MAX_SECONDS,
  back to the first once one has run RESTART_RESET_SECONDS): a death is a fault of that process, not
  of the storage, and the archive is the dataset training reads, so it resumes without an operator,
  as the scoring worker does. The new process removes the dead one's unfinished files at its start.
  While none runs, submissions are dropped and counted and `foreshock_archive_up` is 0.
Scoring, the service state and the decision log never depend on any of it.

close() sends what is queued, has the archive process write and publish everything, and waits for it
(at most `timeout` seconds). Memory: `queue_bytes` queued here, and `queue_bytes` queued plus
`buffer_bytes` buffered in the archive process (service/archive.py).
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

from foreshock import dataset as ds
from foreshock import schema as sch
from foreshock.service.archive import Archive, ArchiveError, ArchiveSettings, BoundedSubmissions

log = logging.getLogger("foreshock.service.archive")

START_SECONDS = 60.0              # the archive process's start (a fresh interpreter importing Arrow) at most
REPORT_SECONDS = 0.5              # how often the archive process sends its counters and log lines
MAX_LOG_LINES = 100               # log lines the archive process keeps between two reports; older dropped
RESTART_BACKOFF_SECONDS = 1.0     # the wait before starting a dead archive process again ...
RESTART_BACKOFF_MAX_SECONDS = 60.0   # ... doubling to this: a restart stays under ForeshockArchiveDown's 5 min
RESTART_RESET_SECONDS = 600.0     # a process that ran this long died of something new: the backoff starts over
# The archive is a copy for analysis: where the machine has no core to spare the scheduler gives the
# scoring path's processes the CPU first, and the archive falls behind into its bounded queues
# (dropped and counted beyond them) rather than slow them.
NICE = 10


def _table(buf) -> pa.Table:
    return pa.ipc.open_stream(buf).read_all()


def _message(item) -> tuple[tuple, list[bytes]]:
    """A queued submission as the archive process's message: (kind, meta) and the IPC blobs."""
    kind = item[0]
    if kind == "batches":
        _, items, refused, packed = item
        if packed is None:   # not from the scoring worker's pipeline: packed here, as the worker would be
            from foreshock.service.worker import pack
            packed = pack(items)
        blobs = [e[2] for e in packed["raw"]] + [e[2] for e in packed["decoded"]]
        meta = {"raw": [(e[0], e[1], e[3], e[4]) for e in packed["raw"]],
                "decoded": [(e[0], e[1]) for e in packed["decoded"]],
                "refused": [(v[0], v[1]) for v in refused or ()]}
        return (kind, meta), blobs
    if kind == "tables":
        return (kind, list(item[1])), [sch.ipc_stream(t) for t in item[1].values()]
    return (kind, None), [sch.ipc_stream(item[1])]


def _groups(meta: dict, blobs: list) -> tuple[list, dict[str, pa.Table], int]:
    """A drain's message as Archive.take_groups takes it: (table, schema message, bodies) with every
    body of a refused (batch, table) left out; the tables that came decoded; the bytes kept."""
    refused = {tuple(v) for v in meta["refused"]}
    groups, kept = [], 0
    for (name, head, idx, lengths), joined in zip(meta["raw"], blobs):
        at, bodies = 0, []
        for i, n in zip(idx, lengths):
            if (i, name) not in refused:
                bodies.append(joined[at:at + n])
                kept += n
            at += n
        if bodies:
            groups.append((name, head, bodies))
    tables: dict[str, list[pa.Table]] = collections.defaultdict(list)
    for (i, name), buf in zip(meta["decoded"], blobs[len(meta["raw"]):]):
        if (i, name) not in refused:
            tables[name].append(_table(buf))
            kept += len(buf)
    return groups, {name: pa.concat_tables(parts) for name, parts in tables.items()}, kept


class _Dropped(Exception):
    """A submission the sender drops: no archive process takes it."""


class ArchiveProcess(BoundedSubmissions):
    """Archive's interface, its writer in the archive process: `take_*` from any thread (by reference,
    never blocks), `start()`, `close()` (writes it all), `stats()`, `up`."""

    def __init__(self, settings: ArchiveSettings):
        self.settings = settings
        # The root is checked (and unfinished files of writers killed long ago removed) here, so that
        # `foreshock serve` refuses an archive it cannot write before it serves.
        Archive(settings)
        self._cv = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self.queued_bytes = 0
        self.dropped_bytes = 0      # dropped on this side: queue full, no archive process, closing
        self.restarts = 0           # archive processes that died and were started again
        self._closing = False
        self._child: dict = {}      # the running archive process's latest counters (Archive.stats())
        self._past = collections.Counter()   # what the archive processes that died had counted
        self._past_rows: collections.Counter = collections.Counter()
        self._dead: list[str] = []  # writer ids of archive processes that died
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._live = False          # an archive process runs and takes submissions
        self._stopped = False       # the archive process stopped itself (a failed write) or cannot start
        self._ready = threading.Event()
        self._ended = threading.Event()   # the sender and the supervisor are done (close)
        self._wake = threading.Event()
        self._sender: threading.Thread | None = None
        self._supervisor: threading.Thread | None = None
        self._started = False

    # -- the consumers' side (any thread; by reference) ---------------------------------------------
    def take_tables(self, tables: dict[str, pa.Table]) -> None:
        """A round's checked tables (wire schema)."""
        if tables:
            self._put(("tables", dict(tables)), sum(t.nbytes for t in tables.values()))

    def take_batches(self, items: list, refused, nbytes: int, packed: dict | None = None) -> None:
        """A drain's batches (ingest.Pending) with the value checks' verdicts; `packed`: the scoring
        worker's request for them (service/worker.py pack), whose joined bytes go on as they are."""
        if items:
            self._put(("batches", items, refused, packed), nbytes)

    def take_decisions(self, rows: pa.Table) -> None:
        """Decision log rows (DECISION_SCHEMA); the archive process derives the incidents."""
        if rows.num_rows:
            self._put(("decisions", rows), rows.nbytes)

    @property
    def up(self) -> bool:
        with self._cv:
            return self._live and self._child.get("up", False)

    def _refuses(self) -> bool:
        return self._stopped or self._closing or (self._started and not self._live)

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> "ArchiveProcess":
        """Start the archive process and wait (at most START_SECONDS) until it takes submissions."""
        if self._started:
            return self
        self._started = True
        self._spawn()
        self._sender = threading.Thread(target=self._send_loop, name="foreshock-archive-sender", daemon=True)
        self._supervisor = threading.Thread(target=self._supervise, name="foreshock-archive-supervisor",
                                            daemon=True)
        self._supervisor.start()
        if not self._ready.wait(START_SECONDS):
            log.error("archive: the archive process (pid %s) did not report within %.0f s; until it does, what "
                      "is taken is dropped and counted", self.pid, START_SECONDS)
        # what was queued before the start goes to the archive process once it takes submissions
        self._sender.start()
        return self

    def _spawn(self) -> None:
        parent, child = socket.socketpair()
        writer_id = ds.new_writer_id()
        settings = dataclasses.replace(self.settings, process=False)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "foreshock.service.archive_process", str(child.fileno()),
                 json.dumps({"settings": dataclasses.asdict(settings), "writer_id": writer_id,
                             "dead_writers": self._dead[-100:]})],
                pass_fds=[child.fileno()], stdin=subprocess.DEVNULL)
        finally:
            child.close()
        self._writer_id = writer_id
        self._spawned_at = time.monotonic()
        with self._cv:
            self._conn = Connection(parent.detach())
            self._sent = 0   # submission bytes sent to this archive process

    def close(self, timeout: float = 120.0) -> None:
        """Send what is queued, have the archive process write and publish everything, then stop;
        waits at most `timeout` seconds."""
        if not self._started:
            self.start()
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._wake.set()
        deadline = time.monotonic() + timeout
        self._sender.join(timeout)
        if not self._ended.wait(max(0.0, deadline - time.monotonic())):
            log.error("archive: still writing after %.0f s at stop; what it has not written is lost", timeout)
        proc = self._proc
        if proc is not None and proc.poll() is None:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._supervisor.join(5.0)
        with self._cv:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def stats(self) -> dict:
        with self._cv:
            c, p = self._child, self._past
            rows = collections.Counter(self._past_rows)
            rows.update(c.get("rows", {}))
            return {"up": self._live and c.get("up", False), "errors": p["errors"] + c.get("errors", 0),
                    "dropped_bytes": self.dropped_bytes + p["dropped_bytes"] + c.get("dropped_bytes", 0),
                    "rows": dict(rows), "files": p["files"] + c.get("files", 0),
                    "written_bytes": p["written_bytes"] + c.get("written_bytes", 0),
                    "queued_bytes": self.queued_bytes + c.get("queued_bytes", 0),
                    "buffered_bytes": c.get("buffered_bytes", 0), "restarts": self.restarts}

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # -- the sender thread ---------------------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                got = self._queue.popleft() if self._queue else None
                last = self._closing and not self._queue
                conn = self._conn if self._live else None
            if got is not None:
                item, nbytes = got
                try:
                    if conn is None:
                        raise _Dropped
                    head, blobs = _message(item)
                    # the blobs (megabytes) go as they are, after the small pickled head: no copy into
                    # a pickle, and the GIL is free while the socket takes them
                    conn.send_bytes(pickle.dumps((*head, len(blobs), nbytes)))
                    for blob in blobs:
                        conn.send_bytes(blob)
                    with self._cv:
                        self._sent += nbytes
                except _Dropped:
                    with self._cv:
                        self.dropped_bytes += nbytes
                except (OSError, ValueError):   # the archive process is gone: the supervisor says so
                    with self._cv:
                        self.dropped_bytes += nbytes
                except Exception:   # odd input costs that submission only
                    with self._cv:
                        self._past["errors"] += 1
                        self.dropped_bytes += nbytes
                    log.exception("archive: a submission of %d bytes could not be sent; dropped", nbytes)
                with self._cv:
                    self.queued_bytes -= nbytes
            if last:
                with self._cv:
                    conn = self._conn if self._live else None
                if conn is not None:
                    try:
                        conn.send_bytes(pickle.dumps(("close", None, 0, 0)))
                    except (OSError, ValueError):
                        pass
                return

    # -- the supervisor thread: reports in, deaths out -----------------------------------------------
    def _supervise(self) -> None:
        backoff = RESTART_BACKOFF_SECONDS
        while True:
            outcome = self._receive()
            if outcome == "closed":
                break
            code = self._proc.wait()
            with self._cv:
                c = self._child
                # what it held as of its last report, and what was sent to it after that report
                lost = (max(0, self._sent - c.get("received_bytes", 0)) + c.get("queued_bytes", 0)
                        + c.get("buffered_bytes", 0) + c.get("open_bytes", 0))
                for key in ("errors", "dropped_bytes", "files", "written_bytes"):
                    self._past[key] += c.get(key, 0)
                self._past["dropped_bytes"] += lost
                self._past_rows.update(c.get("rows", {}))
                self._child = {}
                self._live = False
                closing = self._closing
                stopped = self._stopped
                conn, self._conn = self._conn, None
                self._dead.append(self._writer_id)
            if conn is not None:
                conn.close()
            if closing and code == 0:
                break
            if stopped or closing:
                log.error("archive: the archive process (pid %d) exited with code %s; the archive stops here "
                          "(%d bytes not written)", self._proc.pid, code, lost)
                break
            if time.monotonic() - self._spawned_at >= RESTART_RESET_SECONDS:
                backoff = RESTART_BACKOFF_SECONDS
            with self._cv:
                self.restarts += 1
            log.error("archive: the archive process (pid %d) exited with code %s; %d bytes it held are not "
                      "written; starting it again in %.0f s (restart %d); scoring and the service state go on",
                      self._proc.pid, code, lost, backoff, self.restarts)
            if self._wake.wait(backoff):
                break   # closing: nothing to restart for
            backoff = min(RESTART_BACKOFF_MAX_SECONDS, 2 * backoff)
            try:
                self._spawn()
            except OSError as exc:
                log.error("archive: the archive process could not be started again: %s; the archive stops here",
                          exc)
                with self._cv:
                    self._stopped = True
                break
        with self._cv:
            self._live = False
            self._ready.set()
        self._ended.set()

    def _receive(self) -> str:
        """The running archive process's reports until it closes ("closed") or dies ("died")."""
        conn = self._conn
        while True:
            try:
                kind, counters, lines = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError, ValueError, pickle.UnpicklingError):
                return "died"
            for level, line in lines:
                log.log(level, "%s", line)
            with self._cv:
                self._child = counters
                self._live = kind != "closed" and kind != "refused"
                if kind == "refused" or not counters.get("up", True):
                    self._stopped = True   # a failed write, or a root gone: no restart brings it back
            self._ready.set()
            if kind == "closed":
                return "closed"


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


def archive_main(conn: Connection, settings: ArchiveSettings, writer_id: str, dead_writers: list[str]) -> None:
    """The archive process: take submissions until told to close (or the service process is gone),
    then write and publish everything; report the counters and log lines every REPORT_SECONDS."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the service stops it, in order
    try:
        os.nice(NICE)
    except OSError:
        pass
    lines = _Lines()
    logging.getLogger().addHandler(lines)
    logging.getLogger().setLevel(logging.WARNING)
    from foreshock.service.tuning import tune_malloc
    tune_malloc()
    try:
        arc = Archive(settings, writer_id=writer_id, dead_writers=dead_writers).start()
    except ArchiveError as exc:   # the root went away since the service checked it
        conn.send_bytes(pickle.dumps(("refused", {"up": False}, [(logging.ERROR, str(exc))])))
        sys.exit(2)

    received = 0

    def report(kind: str) -> None:
        conn.send_bytes(pickle.dumps((kind, dict(arc.stats(), received_bytes=received), lines.take())))

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
            try:
                if kind == "batches":
                    groups, tables, kept = _groups(meta, blobs)
                    arc.take_groups(groups, kept)
                    arc.take_tables(tables)
                elif kind == "tables":
                    arc.take_tables({name: _table(buf) for name, buf in zip(meta, blobs)})
                else:
                    arc.take_decisions(_table(blobs[0]))
            except Exception:   # odd input costs that submission only
                arc.count_unreadable(nbytes)
                log.exception("archive: a submission of %d bytes could not be read; dropped", nbytes)
            del blobs
            received += nbytes
        # after each submission too: what a process that dies held is known to its last submission
        if ready or time.monotonic() - reported >= REPORT_SECONDS:
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
    _args = json.loads(sys.argv[2])
    archive_main(Connection(int(sys.argv[1])), ArchiveSettings(**_args["settings"]), _args["writer_id"],
                 _args["dead_writers"])


__all__ = ["ArchiveProcess"]
