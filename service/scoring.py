"""Scoring: the adapter over the predictor's online scorer, and the loop that runs scoring rounds.

The adapter (`PredictorScorer`) is the only place that knows foreshock.predictor's API
(registry.load_model(path) -> LoadedModel with .manifest; online.OnlineScorer(model) with
ingest(table, arrow_table) and score(now_ns) -> ScoreBatch(nodes, probability, signals)); everything
else talks to the small `Scorer` protocol below.

The loop (`ScoringLoop`, one thread) runs a round every `interval` seconds, and at once when ingest
wakes it (a fatal or precursor event, or the collectors' watermarks saying a feature step is complete:
service/steps.py; the step then closes without waiting out its grace period). A round: drain the
ingest queue (telemetry grouped by table, so the scorer ingests one Arrow table per table per round,
not one per node), score every node in one vectorised call, publish the round (node book, Risk watchers), run the policy, expire overdue
directives. The queue is bounded (`max_backlog` batches); overflow drops the oldest and counts it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow as pa

from foreshock import risk
from foreshock.predictor.errors import ModelError
from foreshock.service.ingest import URGENT_TABLES
from foreshock.service.steps import StepTracker
from foreshock.service.domain import SignalRecord

log = logging.getLogger(__name__)


@dataclass
class ScoreResult:
    nodes: list[str]
    probability: np.ndarray
    signals: list[list[SignalRecord]] = field(default_factory=list)
    fresh: bool = True          # False: no step closed since the last round, the same scores again


class Scorer(Protocol):
    model_version: str
    horizon_seconds: int
    manifest: dict

    def ingest(self, table: str, data: pa.Table) -> None: ...

    def score(self, now_ns: int) -> ScoreResult: ...


class NullScorer:
    """No model: telemetry is validated and counted, nothing is scored (the service says so at start)."""

    model_version = "none"
    horizon_seconds = 0
    manifest: dict = {}

    def ingest(self, table: str, data: pa.Table) -> None:
        pass

    def score(self, now_ns: int) -> ScoreResult:
        return ScoreResult([], np.zeros(0))


class PredictorScorer:
    """foreshock.predictor's OnlineScorer behind the Scorer protocol."""

    def __init__(self, model_path: str | Path, *, grace_seconds: float = 2.0):
        try:
            from foreshock.predictor import online, registry
        except ImportError as exc:
            raise ModelError(f"the predictor is not available in this build: {exc}") from exc
        try:
            self.model = registry.load_model(model_path)
        except Exception as exc:
            raise ModelError(f"model {model_path}: {exc}") from exc
        self.model_path = str(model_path)
        self.manifest = dict(getattr(self.model, "manifest", {}) or {})
        self.model_version = str(self.manifest.get("version", "unknown"))
        self.horizon_seconds = int(self.manifest.get("horizon_seconds", 0) or 0)
        # Collectors sweep every second and the service answers within a round, so a step's rows are
        # all in a second or two after it ends; a shorter grace than the scorer's default means an
        # earlier verdict on the step that crosses the threshold.
        self._online = online.OnlineScorer(self.model, grace_seconds=grace_seconds)
        self._step_ns = self._online.step_ns
        self._grace_ns = int(grace_seconds * 1e9)
        self._last: ScoreResult | None = None

    def threshold(self, budget: float | None) -> float | None:
        return risk.threshold_for_budget(self.manifest, budget)

    def ingest(self, table: str, data: pa.Table) -> None:
        self._online.ingest(table, data)

    @property
    def step_ns(self) -> int:
        return self._step_ns

    @property
    def grace_ns(self) -> int:
        return self._grace_ns

    def score(self, now_ns: int, close_ns: int | None = None) -> ScoreResult:
        """close_ns: also close the steps that end by then (their telemetry is all in: the
        watermarks), before their grace period is over."""
        # Features change only when a step closes; between closes a round re-scores nothing.
        if self._last is not None and self._online.advance(now_ns, close_ns) == 0:
            return ScoreResult(self._last.nodes, self._last.probability, self._last.signals, fresh=False)
        batch = self._online.score(now_ns, close_ns)
        signals = [[SignalRecord(str(s.name), float(s.value), float(s.contribution), str(s.description))
                    for s in node_signals] for node_signals in batch.signals]
        self._last = ScoreResult(list(batch.nodes), np.asarray(batch.probability, dtype=np.float64), signals)
        return self._last

    # -- checkpoint (the owner calls these: the scoring worker, or the service when it scores itself) --
    def restore_state(self, path: str | Path) -> str | None:
        """Carry on from the checkpoint at `path` when there is one (online.OnlineScorer.restore_state).
        Returns what was restored, or None when there is no file; a file that cannot be used is
        logged, kept aside as `<path>.refused` for a person to read, and the scorer starts cold."""
        path = Path(path)
        self._checkpoint_at = time.monotonic()
        if not path.exists():
            return None
        try:
            return self._online.restore_state(path)
        except ValueError as exc:
            log.warning("scorer checkpoint not used, the 3-day baselines start over: %s", exc)
            try:
                path.replace(path.with_name(path.name + ".refused"))
            except OSError:
                pass
            return None

    def checkpoint(self, path: str | Path, every_seconds: float, force: bool = False) -> int | None:
        """Write the scorer's checkpoint when `every_seconds` have passed since the last one (or
        `force`: at shutdown). Returns the bytes written, None when not due; never raises: a failed
        write is logged and retried at the next call."""
        now = time.monotonic()
        if not force and now - getattr(self, "_checkpoint_at", now) < every_seconds:
            return None
        self._checkpoint_at = now
        try:
            return self._online.save_state(path)
        except Exception:   # noqa: BLE001 - a full disk must not stop scoring
            log.exception("writing the scorer checkpoint %s", path)
            return None

    def next_due_ns(self, now_ns: int) -> int:
        """When the next step closes: the round that should run then sees the crossing at once."""
        return (now_ns // self._step_ns + 1) * self._step_ns + self._grace_ns

    def step_boundary_ns(self, now_ns: int) -> int:
        """The end of the last step a round at now_ns closes: the rows before it are what it scores."""
        return ((now_ns - self._grace_ns) // self._step_ns) * self._step_ns


def default_model_path() -> Path | None:
    try:
        from foreshock.predictor import registry
    except ImportError:
        return None
    try:
        return Path(registry.default_model_path())
    except Exception:
        return None


def acted(items) -> None:
    """Tell the streams of these batches that the policy has acted on them (ingest.Pending.acted)."""
    for item in items:
        callback = getattr(item, "acted", None)
        if callback is not None:
            try:
                callback()
            except Exception:
                log.exception("acknowledging an acted-on batch failed")


class ScoringLoop:
    """Everything it calls is given to the constructor: `on_round` (the owner's after-round step),
    `prepare` (the value checks over a drain, ingest.Ingest.take_round), `hold` (a steps.CloseHold:
    telemetry streams wait while a complete step closes) and `gate` (the Xid context,
    service/xidcontext.py: a batch whose collateral Xid waits for its window is acknowledged only once
    that Xid is decided, and a round runs when the window ends)."""

    worker = None   # the scoring worker process, for a loop that has one (RemoteScoringLoop)

    def __init__(self, scorer: Scorer, *, interval: float = 0.1, max_backlog: int = 50_000,
                 on_round: Callable[[ScoreResult, int, str, float], None] | None = None,
                 prepare: Callable[[list], dict[str, pa.Table]] | None = None, drain_interval: float = 1.0,
                 max_drain: int = 8192, clock=time.time_ns, hold=None, gate=None):
        self.scorer = scorer
        self.interval = interval
        self.max_backlog = max_backlog
        self.on_round = on_round
        self.prepare = prepare
        self.drain_interval = drain_interval
        self.max_drain = max_drain          # batches per drain: an overloaded service keeps answering
        self._last_drain = 0.0
        self._clock = clock
        self._queue: collections.deque = collections.deque()
        self._qlock = threading.Lock()
        self._wake = threading.Event()
        self._why = "interval"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._subs: dict[int, Callable] = {}
        self._next = 0
        self.rounds: collections.Counter = collections.Counter()
        self.dropped_batches = 0
        self.ingest_errors = 0
        self.score_errors = 0
        self.last_round_seconds = 0.0
        self.last_round_ns = 0
        # Which feature step is complete, from the collectors' watermarks (ingest notes them).
        step_ns = getattr(scorer, "step_ns", None)
        self.steps = StepTracker(step_ns) if isinstance(step_ns, int) and step_ns > 0 else None
        self.early_closes = 0
        self.hold = hold
        self.gate = gate
        self._unsettled: collections.deque = collections.deque()

    # -- feeding -------------------------------------------------------------------------------------
    @staticmethod
    def _forget(item) -> None:
        """A batch dropped from a full backlog will never be checked: its stream stops waiting for it."""
        session = getattr(item, "session", None)
        if session is not None and hasattr(session, "checked"):
            session.checked += 1

    def enqueue(self, item) -> int:
        """Queue received telemetry (ingest.Pending, or a {table: arrow table} dict) for the next round."""
        with self._qlock:
            self._queue.append(item)
            while len(self._queue) > self.max_backlog:
                self._forget(self._queue.popleft())
                self.dropped_batches += 1
            return len(self._queue)

    def _step_due(self) -> bool:
        due = getattr(self.scorer, "next_due_ns", None)
        if due is None:
            return True
        if self._step_complete():
            return True
        now = self._clock()
        return due(self.last_round_ns) <= now   # a step closes between the last round and this one

    def _step_complete(self) -> bool:
        """Every reporting node's watermark is past the open step's end."""
        return self.steps is not None and self.steps.complete_boundary() is not None

    def _close_boundary(self, now_ns: int, drained_all: bool) -> int | None:
        """The end of the last step a round at now_ns closes: by the grace period, or earlier when
        the watermarks say the open step is complete and the round took every batch received (an
        overloaded service, more than a drain behind, waits for the grace period as before). None for
        a scorer without steps."""
        boundary_of = getattr(self.scorer, "step_boundary_ns", None)
        if boundary_of is None:
            return None
        boundary = boundary_of(now_ns)
        if self.steps is not None and drained_all:
            complete = self.steps.complete_boundary()
            if complete is not None and complete > boundary:
                self.early_closes += 1
                return complete
        return boundary

    def _closed(self, boundary: int | None) -> None:
        if self.steps is not None and boundary is not None:
            self.steps.closed(boundary)

    def _release_hold(self) -> None:
        if self.hold is not None:
            self.hold.release()

    def backlog(self) -> int:
        return len(self._queue)

    def _settled(self) -> bool:
        """Nothing received is waiting to be taken into a round."""
        return not self._queue

    def drain_backlog(self, timeout: float = 5.0) -> bool:
        """Ask the running loop for rounds until everything received has been taken (checked, scored,
        archived), at most `timeout` seconds; True when it all was. For stop(): call it once the
        receipt has stopped, so that telemetry a collector was acknowledged for is not left queued."""
        if self._thread is None or not self._thread.is_alive():
            return self._settled()
        end = time.monotonic() + timeout
        while not self._settled() and time.monotonic() < end:
            self.wake("flush")
            time.sleep(0.02)
        return self._settled()

    def _acted(self, items) -> None:
        """acted(), unless a collateral Xid taken so far is still undecided: the round's batches wait until
        it is (at most the context's window after it was taken, which bounds _unsettled; each stream
        acknowledges anyway after servicers.ACTED_ACK_SECONDS, longer than any window)."""
        gate = self.gate
        if gate is not None:
            if items and not gate.settled(gate.mark()):
                self._unsettled.append((gate.mark(), items))
                items = []
            while self._unsettled and gate.settled(self._unsettled[0][0]):
                items = list(items) + list(self._unsettled.popleft()[1])
        acted(items)

    def wake(self, why: str) -> None:
        if why == "step" and self.hold is not None:
            self.hold.hold()   # released once the closing round has acted (_release_hold)
        if why == "events" or self._why != "events":   # a pending event round is not downgraded
            self._why = why
        self._wake.set()

    # -- risk watchers -------------------------------------------------------------------------------
    def subscribe(self, callback: Callable) -> int:
        self._next += 1
        self._subs[self._next] = callback
        return self._next

    def unsubscribe(self, token: int) -> None:
        self._subs.pop(token, None)

    @property
    def watched(self) -> bool:
        """Someone watches the risk (WatchRisk): a round's scores are worth publishing."""
        return bool(self._subs)

    def publish(self, risks: list) -> None:
        for cb in list(self._subs.values()):
            try:
                cb(risks)
            except Exception:
                log.debug("risk watcher gone", exc_info=True)

    # -- rounds --------------------------------------------------------------------------------------
    @staticmethod
    def _urgent(item) -> bool:
        return not URGENT_TABLES.isdisjoint(getattr(item, "tables", item))

    def _drain(self, urgent_only: bool = False) -> list:
        with self._qlock:
            if urgent_only:
                # An event round takes only the batches that carry events (or topology), so a fatal
                # Xid is not held up behind a second of everyone's telemetry; the rest waits its turn.
                items = [it for it in self._queue if self._urgent(it)]
                if items:
                    rest = [it for it in self._queue if not self._urgent(it)]
                    self._queue.clear()
                    self._queue.extend(rest)
            else:
                items = [self._queue.popleft() for _ in range(min(len(self._queue), self.max_drain))]
        if not items:
            return items
        if self.prepare is not None:
            tables = self.prepare(items)   # the value checks, vectorised over the round
        else:
            parts: dict[str, list[pa.Table]] = collections.defaultdict(list)
            for item in items:
                for name, t in item.items():
                    parts[name].append(t)
            tables = {name: pa.concat_tables(ts) if len(ts) > 1 else ts[0] for name, ts in parts.items()}
        for name, data in tables.items():
            try:
                self.scorer.ingest(name, data)
            except Exception:
                self.ingest_errors += 1
                log.exception("scorer could not ingest %d rows of %s", data.num_rows, name)
        return items

    def run_round(self, why: str = "interval") -> ScoreResult | None:
        t0 = time.perf_counter()
        # Telemetry only changes scores when a feature step closes, so it is drained (checked and
        # handed to the scorer) once a `drain_interval`, in big cheap batches; a round woken by events
        # or due at a step close drains at once.
        drained = []
        if why == "events":
            drained = self._drain(urgent_only=True)   # the bulk waits for the next round: act on the event first
            if self._step_due():
                drained += self._drain()   # ... unless a step closes in this round: it needs every row before it
        elif why == "flush" or time.monotonic() - self._last_drain >= self.drain_interval or self._step_due():
            self._last_drain = time.monotonic()
            drained = self._drain()
        now = self._clock()
        boundary = self._close_boundary(now, drained_all=not self._queue)
        try:
            result = self.scorer.score(now) if boundary is None else self.scorer.score(now, boundary)
        except Exception:
            self.score_errors += 1
            log.exception("scoring round failed")
            return None
        self._closed(boundary)
        elapsed = time.perf_counter() - t0
        self.last_round_seconds = elapsed
        self.last_round_ns = now
        self.rounds[why] += 1
        if self.on_round is not None:
            try:
                self.on_round(result, now, why, elapsed)
            except Exception:
                log.exception("after-round step failed")
        self._acted(drained)
        if self.steps is not None and not self._step_complete():
            self._release_hold()   # this round closed the complete step: the streams go on
        return result

    def _run(self) -> None:
        due = getattr(self.scorer, "next_due_ns", None)
        while not self._stop.is_set():
            timeout = self.interval
            if due is not None:
                now = self._clock()
                timeout = min(timeout, max(0.0, (due(now) - now) / 1e9))
            deadline = self.gate.next_deadline_ns() if self.gate is not None else None
            if deadline is not None:
                timeout = min(timeout, max(0.0, (deadline - self._clock()) / 1e9))
            self._wake.wait(timeout)
            if self._stop.is_set():
                break
            why = self._why if self._wake.is_set() else "interval"
            self._wake.clear()
            self._why = "interval"
            self.run_round(why)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="foreshock-scoring", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
