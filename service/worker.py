"""The scoring worker: a child process that decodes and value-checks the bulk telemetry and runs the
predictor's online scorer, so the service uses a second core (the event loop and the scorer no longer
share one GIL). docs/scaling.md has the measurements.

Split of the work:
- The service process (gRPC event loop): protobuf, the receipt checks, the ack (service/ingest.py).
  Its scoring thread runs the policy, the store and the directive watchers, and handles batches with
  events or topology itself, at once (the fatal path never waits on the worker or on bulk telemetry).
- The worker (`python -m foreshock.service.worker`: a fresh interpreter, see ScoringWorker; a socket
  pair is its pipe):
  fed the raw record-batch bytes of every other batch, it runs the same value checks
  (service/validation.py) and `OnlineScorer.ingest`, and scores when a feature step closes. It answers
  each request with the verdicts (a Rejection per refused table, which rides on its stream's next ack),
  the rows taken, the GPUs it saw lost, the fabric's services' states, and the scores.
- `WorkerPipeline` is the round scheduler's pipeline (service/rounds.py) that carries drains to it.

The pipe between them carries one request at a time (bounded: the service's backlog is the only
queue, and it has a bound), pickled: both ends are this code, the payload is bytes, ints and strings,
and nothing crosses a trust boundary. A worker that dies or does not answer within `timeout` is
reported (log, `foreshock_scoring_worker_restarts_total`, `foreshock_scoring_worker_up`), killed and
started again; the new worker carries on from the scorer's last checkpoint (written every few minutes
and at a stop: the 3-day baselines survive, the 30-minute windows refill).
"""

from __future__ import annotations

import collections
import gc
import json
import logging
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection

import numpy as np
import pyarrow as pa

from foreshock import schema as sch
from foreshock.service import validation
from foreshock.service.fabricunits import unit_rows
from foreshock.service.ingest import IngestLimits, Pending
from foreshock.service.nodes import lost_gpus
from foreshock.service.rounds import Drain, Outcome
from foreshock.service.scoring import ScoreResult
from foreshock.service.steps import StepSchedule
from foreshock.service.validation import RawBatch, wire_schema

log = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """The scoring worker died or did not answer in time; the message says which."""


def _encode(name: str, table: pa.Table) -> bytes:
    return sch.ipc_stream(table, wire_schema(name))


def _decode(buf) -> pa.Table:
    return pa.ipc.open_stream(buf).read_all()


def pack(items: list[Pending]) -> dict:
    """A drain's batches as the worker's request: per table and schema, the schema message once and
    every batch's record batches joined (one bytes object), with each part's owner and length."""
    groups: dict[tuple[str, int], tuple[bytes, list[int], list[bytes]]] = {}
    decoded: list[tuple[int, str, bytes]] = []
    owners = [(item.sequence, item.node) for item in items]
    for i, item in enumerate(items):
        for name, t in item.tables.items():
            if type(t) is RawBatch:
                g = groups.get((name, id(t.head)))
                if g is None:
                    g = groups[(name, id(t.head))] = (t.head, [], [])
                g[1].append(i)
                g[2].append(t.body)
            else:
                decoded.append((i, name, _encode(name, t)))
    raw = [(name, head, b"".join(bodies), idx, list(map(len, bodies)))
           for (name, _), (head, idx, bodies) in groups.items()]
    return {"owners": owners, "raw": raw, "decoded": decoded}


@dataclass
class _Batch:
    """One batch of a drain as the worker has it: its node and its tables (validation.Received)."""
    node: str
    tables: dict[str, pa.Table | RawBatch] = field(default_factory=dict)


def _unpack(req: dict) -> list[_Batch]:
    batches = [_Batch(node) for _seq, node in req["owners"]]
    for name, head, joined, idx, lengths in req["raw"]:
        at = 0
        for i, n in zip(idx, lengths):
            batches[i].tables[name] = RawBatch(head, joined[at:at + n])   # bytes: cheap keys for fastipc
            at += n
    for i, name, buf in req["decoded"]:
        batches[i].tables[name] = _decode(buf).cast(wire_schema(name))
    return batches


def worker_main(conn, model_path: str, grace_seconds: float, limits: dict, state_path: str = "",
                checkpoint_seconds: float = 300.0, share_totals: bool = False) -> None:
    """The worker process: load the model (and the scorer's checkpoint at `state_path`, when there is
    one), then answer requests until the pipe closes. The checkpoint is written every
    `checkpoint_seconds`, after a scoring answer has gone, and at a stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the service stops it, in order
    logging.basicConfig(level=logging.WARNING, format="foreshock scoring worker: %(levelname)s %(message)s")
    from foreshock.service.scoring import ModelError, PredictorScorer
    try:
        scorer = PredictorScorer(model_path, grace_seconds=grace_seconds, share_totals=share_totals)
    except ModelError as exc:
        conn.send_bytes(pickle.dumps(("error", str(exc))))
        return
    # The model and the imports are long-lived: out of the collector's sight. A drain allocates tens of
    # thousands of objects, which would otherwise run full collections over the scorer's state.
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    from foreshock.service.tuning import tune_malloc
    tune_malloc()
    # One OpenMP thread: scikit-learn's predict (a model without the compiled path) runs many small
    # parallel regions, and on a machine whose cores the service and the collectors' streams keep busy
    # each one waits for a descheduled thread (measured: explanations 7 -> 175 ms under that load).
    try:
        from threadpoolctl import threadpool_limits
        threadpool_limits(1, user_api="openmp")
    except Exception:   # noqa: BLE001 - an optional tuning
        log.debug("threadpoolctl not available", exc_info=True)
    value_limits = IngestLimits(**limits)
    decoders: dict = {}   # kept from drain to drain: validation.check_round's
    restored = scorer.restore_state(state_path) if state_path else None
    conn.send_bytes(pickle.dumps(("ready", scorer.model_version, restored)))
    try:
        # Rows of the still-open step that came with a scoring request: held back until the answer is
        # sent (the step that closes does not need them) and taken first at the next request.
        held: list[tuple[str, pa.Table]] = []
        while True:
            try:
                msg = conn.recv_bytes()
            except (EOFError, OSError):
                return
            kind, req, *n_blobs = pickle.loads(msg)
            if kind == "stop":
                if state_path:
                    for name, data in held:   # rows of the open step, taken so that the checkpoint has them
                        try:
                            scorer.ingest(name, data)
                        except Exception:   # noqa: BLE001 - logged; the checkpoint goes on without them
                            log.exception("scorer could not ingest %d rows of %s", data.num_rows, name)
                    scorer.checkpoint(state_path, checkpoint_seconds, force=True)
                return
            try:
                blobs = [conn.recv_bytes() for _ in range(n_blobs[0] if n_blobs else 0)]
            except (EOFError, OSError):
                return
            req["raw"] = [(name, head, blobs[k], idx, lengths) for name, head, k, idx, lengths in req["raw"]]
            t0 = time.perf_counter()
            now_ns = req["now_ns"]
            batches = _unpack(req)
            # The value checks use the wall clock, as the service process's do (timestamps are the nodes' clocks).
            checked_ns = time.time_ns()
            checked = validation.check_round(batches, checked_ns, value_limits, decoders) if batches \
                else validation.CheckedRound()
            tables = checked.tables
            # Drains carry no events or topology (the rounds check those in the service process): of what
            # the service must act on, only a lost GPU and the fabric's services' states can be in them.
            lost = lost_gpus(tables["gpu"], checked_ns) if "gpu" in tables else []
            # The fabric's services' states, for the service process's judge (service/fabricunits.py).
            units = unit_rows(tables["systemd_unit"]) if "systemd_unit" in tables else []
            for name, buf in req.get("validated", []):
                t = _decode(buf)
                if name in tables:
                    tables[name] = pa.concat_tables([tables[name], t.cast(tables[name].schema)])
                else:
                    tables[name] = t
            ingest_errors = 0
            if req.get("peer_totals"):
                scorer.set_peer_totals(req["peer_totals"])
            now_tables = list(tables.items())
            close_ns = req.get("close_ns")
            if req.get("score"):
                now_tables, later = StepSchedule.rows_now(now_tables, close_ns)
            else:
                later = []
            for name, data in held + now_tables:
                try:
                    scorer.ingest(name, data)
                except Exception:
                    ingest_errors += 1
                    log.exception("scorer could not ingest %d rows of %s", data.num_rows, name)
            held = later
            score = None
            score_error = ""
            if req.get("score"):
                try:
                    r = scorer.score(now_ns, close_ns)
                    score = (r.nodes, r.probability, r.signals, r.fresh, r.totals, r.evidence)
                except Exception as exc:
                    score_error = f"{type(exc).__name__}: {exc}"
                    log.exception("scoring round failed")
            # Each batch's verdicts together, in the order they were found, as its stream will hear them.
            verdicts = [tuple(v) for v in sorted(checked.verdicts, key=lambda v: v.part)]
            conn.send_bytes(pickle.dumps(("done", {
                "verdicts": verdicts, "rejected": dict(collections.Counter(v[2] for v in verdicts)),
                "rows": dict(checked.rows), "lost": lost, "units": units, "score": score, "score_error": score_error,
                "ingest_errors": ingest_errors, "peer_stats": scorer.peer_stats() if share_totals else None,
                "left_out": scorer.left_out(),
                "seconds": time.perf_counter() - t0})))
            if state_path and req.get("score"):
                scorer.checkpoint(state_path, checkpoint_seconds)
    finally:
        scorer.close()   # a judgement under way ends, an error in it logged, before the process does


class ScoringWorker:
    """The service side of the worker process: start, call with a deadline, restart, stop.

    The worker is a fresh interpreter (`python -m foreshock.service.worker`), not a fork: the service
    process runs gRPC, Arrow and OpenMP thread pools, and a fork of it hangs in the first Arrow or
    scikit-learn call that needs one (measured: the first drain never came back). It loads the model
    itself (a few seconds); start() waits for it."""

    def __init__(self, model_path: str, *, grace_seconds: float = 2.0, limits: IngestLimits | None = None,
                 timeout: float = 60.0, start_timeout: float = 120.0, state_path: str = "",
                 checkpoint_seconds: float = 300.0, share_totals: bool = False):
        self.model_path = str(model_path)
        self.share_totals = bool(share_totals)
        self.state_path = str(state_path)
        self.checkpoint_seconds = float(checkpoint_seconds)
        self.restored: str | None = None   # what the worker's scorer carried on from, as it said
        self.grace_seconds = grace_seconds
        self.limits = limits or IngestLimits()
        self.timeout = timeout
        self.start_timeout = start_timeout
        self._proc: subprocess.Popen | None = None
        self._conn = None
        self._ready = False
        self.restarts = 0
        self.last_error = ""

    def _alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def up(self) -> bool:
        return self._ready and self._alive()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        parent, child = socket.socketpair()
        limits = asdict(self.limits)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "foreshock.service.worker", str(child.fileno()), self.model_path,
                 repr(float(self.grace_seconds)), json.dumps(limits), self.state_path,
                 repr(self.checkpoint_seconds), "share-totals" if self.share_totals else ""],
                pass_fds=[child.fileno()], stdin=subprocess.DEVNULL)
        finally:
            child.close()
        self._conn = Connection(parent.detach())
        self._ready = False

    def wait_ready(self) -> None:
        """Block until the worker has loaded its model (WorkerError if it cannot)."""
        try:
            self._wait_ready()
        except WorkerError as exc:
            self.last_error = str(exc)
            self.kill()
            raise

    def _wait_ready(self) -> None:
        if self._ready:
            return
        kind, detail, *rest = self._recv(self.start_timeout, "start")
        if kind != "ready":
            raise WorkerError(f"scoring worker could not start: {detail}")
        self.restored = rest[0] if rest else None
        if self.restored:
            log.info("scoring worker: %s", self.restored)
        self._ready = True

    def _recv(self, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        conn = self._conn
        if conn is None:
            raise WorkerError("scoring worker is not running")
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError(f"scoring worker (pid {self.pid}) did not answer {what} within {timeout:.0f} s")
            try:
                if conn.poll(min(left, 0.5)):
                    return pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                proc = self._proc
                try:
                    code = proc.wait(2) if proc is not None else "?"
                except subprocess.TimeoutExpired:
                    code = "? (still running)"
                raise WorkerError(f"scoring worker (pid {self.pid}) died: exit code {code}") from None
            proc = self._proc
            if proc is None or proc.poll() is not None:
                raise WorkerError(f"scoring worker (pid {self.pid}) died: exit code "
                                  f"{proc.returncode if proc is not None else '?'}")

    def call(self, request: dict) -> dict:
        """One request, answered within `timeout` seconds, or WorkerError (the worker is then stopped)."""
        try:
            self._wait_ready()
            try:
                # The joined record batches (megabytes) go as they are, after the small pickled rest:
                # no copy into a pickle, and the GIL is free while the socket takes them.
                blobs = [entry[2] for entry in request["raw"]]
                request = dict(request, raw=[(e[0], e[1], k, e[3], e[4]) for k, e in enumerate(request["raw"])])
                conn = self._conn
                if conn is None:
                    raise WorkerError("scoring worker is not running")
                conn.send_bytes(pickle.dumps(("drain", request, len(blobs))))
                for blob in blobs:
                    conn.send_bytes(blob)
            except (OSError, ValueError) as exc:
                raise WorkerError(f"scoring worker (pid {self.pid}) died: {exc}") from None
            kind, reply = self._recv(self.timeout, "a drain")
            return reply
        except WorkerError as exc:
            self.last_error = str(exc)
            self.kill()
            raise

    def restart(self) -> None:
        self.kill()
        self.restarts += 1
        self.start()

    def kill(self) -> None:
        self._ready = False
        if self._alive():
            self._proc.kill()
        if self._proc is not None:
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                log.error("scoring worker (pid %s) does not exit", self.pid)
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def stop(self, timeout: float = 5.0) -> None:
        if self._proc is None:
            return
        try:
            if self._conn is not None:
                self._conn.send_bytes(pickle.dumps(("stop", None)))
        except (OSError, ValueError):
            pass
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        self.kill()
        self._proc = None


class WorkerPipeline:
    """The rounds' pipeline (service/rounds.py) in the worker process: the bulk decode, value checks
    and scoring there. The scheduler never waits on the worker: a feeder thread carries one drain at a
    time and keeps the answer until the next round takes it. Event tables checked in the service
    process travel as Arrow IPC bytes, encoded once, when the round checks them (`carry`)."""

    inline = False
    drain_interval = 0.25

    def __init__(self, worker: ScoringWorker):
        self.worker = worker
        self._feed_q: list[Drain] = []
        self._feed_cv = threading.Condition()
        self._busy = False
        self._replies: collections.deque = collections.deque()
        self._feeder: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = None
        self.worker_errors = 0
        self._failing = 0          # consecutive failed drains: the restart backoff
        self.worker_seconds = 0.0
        self.lost_batches = 0

    def carry(self, name: str, table: pa.Table) -> bytes:
        return _encode(name, table)

    @property
    def busy(self) -> bool:
        return self._busy

    @property
    def answered(self) -> bool:
        return bool(self._replies)

    @property
    def pending(self) -> bool:
        with self._feed_cv:
            in_flight = self._busy or bool(self._feed_q)
        return in_flight or bool(self._replies)

    def answers(self) -> list[tuple[Drain, Outcome | None]]:
        out = []
        while self._replies:
            out.append(self._replies.popleft())
        return out

    def submit(self, drain: Drain) -> None:
        with self._feed_cv:
            self._busy = True
            self._feed_q.append(drain)
            self._feed_cv.notify()

    @staticmethod
    def _outcome(reply: dict) -> Outcome:
        result = None
        if reply["score"] is not None:
            nodes, prob, signals, is_fresh, totals, evidence = reply["score"]
            result = ScoreResult(list(nodes), np.asarray(prob, dtype=np.float64), signals, fresh=is_fresh,
                                 totals=totals, evidence=evidence)
        return Outcome(result, reply["score_error"], reply["ingest_errors"], verdicts=reply,
                       peer_stats=reply.get("peer_stats"), left_out=reply.get("left_out"))

    def _feed(self) -> None:
        while True:
            with self._feed_cv:
                while not self._feed_q and not self._stop.is_set():
                    self._feed_cv.wait(0.5)
                if self._stop.is_set():
                    return
                drain = self._feed_q.pop(0)
            t0 = time.perf_counter()
            packed = pack(drain.items)
            try:
                reply = self.worker.call({"now_ns": drain.now_ns, "score": drain.score, "validated": drain.validated,
                                          "close_ns": drain.close_ns, "peer_totals": drain.peer_totals,
                                          **packed})
            except WorkerError as exc:
                reply = None
                if self._stop.is_set():
                    log.info("scoring worker stopped with a drain of %d batches in flight", len(drain.items))
                else:
                    self.worker_errors += 1
                    self.lost_batches += len(drain.items)
                    log.error("%s; %d batches lost; restarting it (restart %d)", exc, len(drain.items),
                              self.worker.restarts + 1)
                    self._failing += 1
                    # A worker that cannot start at all is not restarted in a tight loop.
                    if not self._stop.wait(min(30.0, 0.25 * 2 ** min(self._failing - 1, 7))):
                        try:
                            self.worker.restart()
                        except Exception:
                            log.exception("scoring worker restart failed")
            if reply is not None:
                self._failing = 0
                # the drain's batches as joined for the worker, for the archive process to send on as
                # they are (ingest.apply_verdicts; service/archive_process.py)
                reply["packed"] = packed
            self.worker_seconds += time.perf_counter() - t0
            self._replies.append((drain, None if reply is None else self._outcome(reply)))
            with self._feed_cv:
                self._busy = False
            if self._wake is not None:
                self._wake()

    def start(self, wake) -> None:
        if not self.worker.up:
            self.worker.start()
            self.worker.wait_ready()   # a service that says it serves is scoring
        self._wake = wake
        self._feeder = threading.Thread(target=self._feed, name="foreshock-scoring-feeder", daemon=True)
        self._feeder.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        with self._feed_cv:
            self._feed_cv.notify_all()
        if self._feeder is not None:
            self._feeder.join(timeout)
        self.worker.stop(timeout)


if __name__ == "__main__":
    worker_main(Connection(int(sys.argv[1])), sys.argv[2], float(sys.argv[3]), json.loads(sys.argv[4]),
                sys.argv[5], float(sys.argv[6]), sys.argv[7] == "share-totals")
