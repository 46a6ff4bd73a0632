"""Scoring rounds: the one round scheduler, and the pipeline it hands drains to.

`RoundScheduler` (one thread) runs a round every `interval` seconds, and at once when ingest wakes it (a
fatal or precursor event, or the collectors' watermarks saying a feature step is complete:
service/steps.py; the step then closes without waiting out its grace period). Tests and `foreshock
serve` run this same scheduler; only the pipeline behind it differs. A round:

1. takes the batches that carry events or topology and checks them here, at once (`prepare`, the
   local Ingest.take_round): a fatal Xid never waits on bulk telemetry or on the worker;
2. when the pipeline is free and a drain is due (a step closes, events were checked, or the bulk has
   waited `drain_interval`), takes the bulk queue and submits one `Drain` to the pipeline: the bulk
   batches, the checked event tables, and whether to score (a step is due, and up to which boundary:
   the step schedule's answers, steps.StepSchedule, for a scorer with steps);
3. applies the pipeline's answers (`Outcome`): the verdicts on the bulk batches (`on_verdicts`), the
   scores;
4. runs the owner's after-round step (`on_round`: node book, Risk watchers, policy, directive expiry),
   acknowledges the event batches acted on (through the Xid context, `gate`), and lets the telemetry
   streams go on once a closing drain has been answered (`hold`).

A pipeline (`Pipeline` below) runs a drain's value checks, feeds the scorer and scores: in this
process, inside submit (`InProcessPipeline`), or in the scoring worker process, answered later
(`worker.WorkerPipeline`, the production path). One drain is in flight at a time: the scheduler's
queues, which are bounded (`max_backlog` batches; overflow drops the oldest and counts it), are the
only queue.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import pyarrow as pa

from foreshock.service.ingest import URGENT_TABLES
from foreshock.service.scoring import ScoreResult, Scorer
from foreshock.service.steps import StepSchedule

log = logging.getLogger(__name__)


MAX_VALIDATED = 4096    # checked event/topology tables waiting for a pipeline that is busy


@dataclass
class Drain:
    """What one round hands the pipeline."""
    items: list                     # bulk batches (ingest.Pending, or {table: arrow table}), unchecked
    now_ns: int
    score: bool                     # a feature step is due: score once the rows are in
    validated: list = field(default_factory=list)   # (table, Pipeline.carry(table)): checked event tables
    submitted: float = 0.0
    close_ns: int | None = None     # the end of the last step this drain closes; None: a scorer without steps
    peer_totals: list = field(default_factory=list)   # a shard's: the other shards' sums, for the scorer first


@dataclass
class Outcome:
    """A pipeline's answer on one drain."""
    result: ScoreResult | None = None   # a scoring drain's scores (fresh: a step closed); None: not scored
    score_error: str = ""
    ingest_errors: int = 0
    verdicts: dict | None = None        # the worker's verdicts, for on_verdicts (ingest.apply_verdicts);
    #                                     None: the checks ran in this process and put them on the streams
    peer_stats: dict | None = None      # a shard scorer's PredictorScorer.peer_stats() after the drain
    left_out: dict | None = None        # PredictorScorer.left_out() after the drain


class Pipeline(Protocol):
    """Runs drains: the value checks, the scorer's ingest, and scoring when the drain says so."""

    worker: object | None    # the scoring worker process, for a pipeline that has one (metrics, start)
    inline: bool             # submit() runs the drain on the scheduler's thread, before it returns
    drain_interval: float    # how long bulk telemetry waits between drains when nothing else is due

    def carry(self, name: str, table: pa.Table) -> object:
        """A checked event table as a drain carries it to the scorer."""

    def submit(self, drain: Drain) -> None:
        """Take one drain (only when not `busy`); its Outcome comes out of answers()."""

    @property
    def busy(self) -> bool: ...

    @property
    def answered(self) -> bool:
        """Answers are waiting to be taken."""

    @property
    def pending(self) -> bool:
        """A drain submitted whose answer has not been taken yet."""

    def answers(self) -> list[tuple[Drain, Outcome | None]]:
        """The drains answered since the last call, oldest first; None: the drain was lost."""

    def start(self, wake: Callable[[], None]) -> None:
        """`wake`: called when an answer arrives from another thread."""

    def stop(self, timeout: float) -> None: ...


def join_tables(items) -> dict[str, pa.Table]:
    """{table: arrow table} batches, joined per table: a drain of batches nothing needs to check."""
    parts: dict[str, list[pa.Table]] = collections.defaultdict(list)
    for item in items:
        for name, t in item.items():
            parts[name].append(t)
    return {name: pa.concat_tables(ts) if len(ts) > 1 else ts[0] for name, ts in parts.items()}


class InProcessPipeline:
    """The value checks (`prepare`, ingest.Ingest.take_round: the verdicts go onto the streams) and
    the scorer in this process, run inside submit(). Drains are less frequent than the worker's: here
    they cost the scoring thread's time, which the event loop's receipt shares one GIL with."""

    worker = None
    inline = True
    drain_interval = 1.0

    def __init__(self, scorer: Scorer, *, prepare: Callable[[list], dict[str, pa.Table]] | None = None):
        self.scorer = scorer
        self.prepare = prepare
        self._answers: list[tuple[Drain, Outcome]] = []

    def carry(self, name: str, table: pa.Table) -> pa.Table:
        return table

    @property
    def busy(self) -> bool:
        return False

    @property
    def answered(self) -> bool:
        return bool(self._answers)

    @property
    def pending(self) -> bool:
        return bool(self._answers)

    def answers(self) -> list[tuple[Drain, Outcome]]:
        out, self._answers = self._answers, []
        return out

    def submit(self, drain: Drain) -> None:
        tables: dict[str, pa.Table] = {}
        if drain.items:
            tables = self.prepare(drain.items) if self.prepare is not None else join_tables(drain.items)
        # As the worker does: the drain's checked bulk first, then the event tables checked in the round.
        for name, t in drain.validated:
            tables[name] = pa.concat_tables([tables[name], t.cast(tables[name].schema)]) if name in tables else t
        outcome = Outcome()
        if drain.peer_totals:
            self.scorer.set_peer_totals(drain.peer_totals)
        for name, data in tables.items():
            try:
                self.scorer.ingest(name, data)
            except Exception:
                outcome.ingest_errors += 1
                log.exception("scorer could not ingest %d rows of %s", data.num_rows, name)
        if drain.score:
            try:
                outcome.result = self.scorer.score(drain.now_ns, drain.close_ns)
            except Exception as exc:
                outcome.score_error = f"{type(exc).__name__}: {exc}"
                log.exception("scoring round failed")
            if hasattr(self.scorer, "peer_stats"):
                outcome.peer_stats = self.scorer.peer_stats()
        if hasattr(self.scorer, "left_out"):
            outcome.left_out = self.scorer.left_out()
        self._answers.append((drain, outcome))

    def start(self, wake: Callable[[], None]) -> None:
        pass

    def stop(self, timeout: float = 5.0) -> None:
        pass


def acted(items) -> None:
    """Tell the streams of these batches that the policy has acted on them (ingest.Pending.acted)."""
    for item in items:
        callback = getattr(item, "acted", None)
        if callback is not None:
            try:
                callback()
            except Exception:
                log.exception("acknowledging an acted-on batch failed")


class RoundScheduler:
    """Everything it calls is given to the constructor: the `pipeline`, `on_round` (the owner's
    after-round step, (result, now_ns, why, seconds)), `prepare` (the value checks over the event
    batches, ingest.Ingest.take_round), `on_verdicts` (a pipeline's verdicts onto the streams,
    ingest.Ingest.apply_verdicts), `hold` (a steps.CloseHold: telemetry streams wait while a complete
    step closes) and `gate` (the Xid context, service/xidcontext.py: a batch whose collateral Xid waits
    for its window is acknowledged only once that Xid is decided, and a round runs when the window
    ends). `drain_interval` None: the pipeline's."""

    def __init__(self, scorer: Scorer, pipeline: Pipeline, *, interval: float = 0.1, max_backlog: int = 50_000,
                 on_round: Callable[[ScoreResult, int, str, float], None] | None = None,
                 prepare: Callable[[list], dict[str, pa.Table]] | None = None,
                 on_verdicts: Callable[[list, dict | None], None] | None = None,
                 drain_interval: float | None = None, max_drain: int = 8192, clock=time.time_ns,
                 hold=None, gate=None):
        self.scorer = scorer
        self.pipeline = pipeline
        self.interval = interval
        self.max_backlog = max_backlog
        self.on_round = on_round
        self.prepare = prepare
        self.on_verdicts = on_verdicts
        self.drain_interval = pipeline.drain_interval if drain_interval is None else drain_interval
        self.max_drain = max_drain          # batches per drain: an overloaded service keeps answering
        self._last_drain = 0.0
        self._clock = clock
        self._queue: collections.deque = collections.deque()        # bulk telemetry
        self._urgent_q: collections.deque = collections.deque()     # batches with events or topology
        self._qlock = threading.Lock()
        self._wake = threading.Event()
        self._why = "interval"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._subs: dict[int, Callable] = {}
        self._next = 0
        self._validated: list[tuple[str, object]] = []
        # rows checked outside the rounds (the Jobs API's step times), for the scorer with the next drain
        self._checked: collections.deque = collections.deque()
        self.dropped_checked = 0
        self._last = ScoreResult([], np.zeros(0), fresh=False)
        self.rounds: collections.Counter = collections.Counter()
        self.dropped_batches = 0
        self.ingest_errors = 0
        self.score_errors = 0
        self.last_round_seconds = 0.0
        self.last_round_ns = 0
        # When the scorer's steps close; None: a scorer without steps, which scores every round.
        self.schedule = StepSchedule(scorer.step_ns, scorer.grace_ns) if scorer.step_ns else None
        # The collectors' watermarks, which the receipt notes (ingest.Ingest's `steps`).
        self.steps = self.schedule.tracker if self.schedule is not None else None
        self.hold = hold
        self.gate = gate
        self._unsettled: collections.deque = collections.deque()
        self._enqueued = 0          # bulk batches queued, and taken off the queue, since the start
        self._taken = 0
        # A shard's peer totals exchange (forwarder.AlarmForwarder: take_peer_totals, put_totals): the
        # other shards' sums go to the scorer with the next drain, its own go out after each step
        self.totals = None
        self.peer_stats: dict[str, int] = {}
        self.left_out: dict[str, int] = {}     # the scorer's rows left out of the features, by reason

    @property
    def early_closes(self) -> int:
        """Steps closed because the watermarks said their rows were all in, before the grace period."""
        return self.schedule.early_closes if self.schedule is not None else 0

    @property
    def worker(self):
        """The scoring worker process, where the pipeline has one."""
        return self.pipeline.worker

    # -- feeding -------------------------------------------------------------------------------------
    @staticmethod
    def _forget(item) -> None:
        """A batch dropped from a full backlog will never be checked: its stream stops waiting for it."""
        session = getattr(item, "session", None)
        if session is not None and hasattr(session, "checked"):
            session.checked += 1

    @staticmethod
    def _urgent(item) -> bool:
        return not URGENT_TABLES.isdisjoint(getattr(item, "tables", item))

    def enqueue(self, item) -> int:
        """Queue received telemetry (ingest.Pending, or a {table: arrow table} dict) for the next round."""
        with self._qlock:
            if self._urgent(item):
                self._urgent_q.append(item)
                while len(self._urgent_q) > self.max_backlog:
                    self._forget(self._urgent_q.popleft())
                    self.dropped_batches += 1
            else:
                self._queue.append(item)
                self._enqueued += 1
                while len(self._queue) > self.max_backlog:
                    self._forget(self._queue.popleft())
                    self._taken += 1
                    self.dropped_batches += 1
            return len(self._queue) + len(self._urgent_q)

    def take_checked(self, name: str, table: pa.Table) -> None:
        """Rows checked elsewhere for the scorer (service/steptimes.py StepTimes' `feed`): they go with
        the next drain and never make one themselves. Bounded as the bulk queue is: past `max_backlog`
        tables the oldest is dropped and counted (`dropped_checked`)."""
        with self._qlock:
            self._checked.append((name, table))
            while len(self._checked) > self.max_backlog:
                self._checked.popleft()
                self.dropped_checked += 1

    def _take_checked(self) -> list[tuple[str, object]]:
        with self._qlock:
            got, self._checked = self._checked, collections.deque()
        return [(name, self.pipeline.carry(name, t)) for name, t in join_tables({n: t} for n, t in got).items()]

    def wake(self, why: str) -> None:
        if why == "step":
            # Every batch queued from now on is past the step's end (the watermarks promise it): the
            # round that closes the step takes only the batches before this mark.
            with self._qlock:
                if self.schedule is not None:
                    self.schedule.completed(self._enqueued)
            if self.hold is not None:
                self.hold.hold()   # released once the closing drain's answer has been acted on
        if why == "events" or self._why != "events":   # a pending event round is not downgraded
            self._why = why
        self._wake.set()

    def backlog(self) -> int:
        return len(self._queue) + len(self._urgent_q)

    def _settled(self) -> bool:
        """Nothing received is waiting to be taken into a round, or to be answered."""
        return not self._queue and not self._urgent_q and not self._validated and not self.pipeline.pending

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

    def _after_round(self, result: ScoreResult, now_ns: int, why: str, seconds: float) -> None:
        if self.on_round is not None:
            try:
                self.on_round(result, now_ns, why, seconds)
            except Exception:
                log.exception("after-round step failed")

    def run_round(self, why: str = "interval") -> ScoreResult:
        t0 = time.perf_counter()
        now = self._clock()
        with self._qlock:
            urgent = list(self._urgent_q)
            self._urgent_q.clear()
        if urgent:
            # Events and topology first, here: a fatal Xid does not wait for anyone's bulk telemetry.
            tables = self.prepare(urgent) if self.prepare is not None else join_tables(urgent)
            self._validated += [(name, self.pipeline.carry(name, t)) for name, t in tables.items()]
            del self._validated[:-MAX_VALIDATED]   # a pipeline that is behind gets the latest ones
            why = "events"
            if self.pipeline.answered or (self.pipeline.inline and self._queue):
                # The policy acts on the fatal events before this round does the slow part: applying
                # the worker's answers on bulk telemetry (thousands of batches' verdicts, maybe every
                # node's new scores), or checking the bulk here.
                self._after_round(self._last, now, why, time.perf_counter() - t0)
        # Telemetry only changes scores when a feature step closes, so bulk is drained once a
        # `drain_interval`, in big cheap batches; a round with events, or due at a step close, drains at once.
        # A scorer without steps scores every round.
        step = self.schedule.due(self._clock()) if self.schedule is not None else True
        closing = self.schedule.eager(now) if self.schedule is not None else None
        if not self.pipeline.busy and (self._validated or step or (self._queue and (why == "flush" or (
                closing if closing is not None else time.monotonic() - self._last_drain >= self.drain_interval)))):
            self._last_drain = time.monotonic()
            with self._qlock:
                take = len(self._queue)
                if self.schedule is not None:
                    take = self.schedule.batches_now(take, self._taken, step)
                items = [self._queue.popleft() for _ in range(min(take, self.max_drain))]
                self._taken += len(items)
                drained_all = take <= self.max_drain
            boundary = None
            if step and self.schedule is not None:
                boundary = self.schedule.close(now, drained_all=drained_all)
            validated, self._validated = self._validated, []
            validated += self._take_checked()
            peer = self.totals.take_peer_totals() if self.totals is not None else None
            self.pipeline.submit(Drain(items, now, step, validated, time.perf_counter(), boundary,
                                       peer_totals=[peer] if peer is not None else []))
            if boundary is not None:
                self.schedule.sent(boundary)
        fresh = None
        closed = False
        for drain, outcome in self.pipeline.answers():
            closed = closed or drain.score
            if outcome is None:
                if self.on_verdicts is not None:
                    self.on_verdicts(drain.items, None)
                continue
            if outcome.verdicts is not None and self.on_verdicts is not None:
                try:
                    self.on_verdicts(drain.items, outcome.verdicts)
                except Exception:
                    log.exception("applying the pipeline's verdicts failed")
            self.ingest_errors += outcome.ingest_errors
            if outcome.score_error:
                self.score_errors += 1
            r = outcome.result
            if outcome.peer_stats is not None:
                self.peer_stats = outcome.peer_stats
            if outcome.left_out is not None:
                self.left_out = outcome.left_out
            if r is not None and r.totals and self.totals is not None:
                self.totals.put_totals(r.totals)
            if r is not None:
                self._last = dataclasses.replace(r, fresh=False, totals=[])
                if r.fresh:
                    fresh = (r, drain.now_ns)
        elapsed = time.perf_counter() - t0
        self.last_round_seconds = elapsed
        self.last_round_ns = now
        self.rounds[why if why in ("events", "flush", "step") else "interval"] += 1
        if fresh is not None:
            self._after_round(fresh[0], fresh[1], why, elapsed)
        else:
            self._after_round(self._last, now, why, elapsed)
        self._acted(urgent)   # bulk batches carry no events: nobody waits on them
        if closed and self.schedule is not None and self.hold is not None:
            self.hold.release()   # the closing drain's answer has been acted on
        return fresh[0] if fresh is not None else self._last

    def _run(self) -> None:
        while not self._stop.is_set():
            timeout = self.interval
            if self.schedule is not None:
                now = self._clock()
                timeout = min(timeout, max(0.0, (self.schedule.next_due_ns(now) - now) / 1e9))
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
        self.pipeline.start(lambda: self.wake("worker"))
        self._thread = threading.Thread(target=self._run, name="foreshock-scoring", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.pipeline.stop(timeout)
