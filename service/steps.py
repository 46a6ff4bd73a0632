"""When a feature step's telemetry is all in: the collectors' watermarks, per node.

Every SweepBatch carries a watermark (proto/foreshock/v1/telemetry.proto, `SweepBatch.watermark_ns`):
the collector's promise that no sampled row it sends later has an earlier ts, i.e. the time of its
next sweep. A step [B - step, B) is complete once every node that is reporting has promised past B:
nothing more can arrive for it, and the scorer may close it at once instead of waiting out its grace
period after B (the one-minute steps of predictor/features.py; a risk crossing is only seen when its
step closes). This is the event-time watermark of stream processors (Flink, Beam) kept per node.

A node is reporting when its last watermark lies in or after the open step (it swept within about
one step); a collector that stops holds the close back until the grace period ends, for at most two
steps, and then no longer counts. A batch without a watermark (an older collector) turns early closes
off for two steps: its rows could still come after the close. Bounded: `max_nodes` nodes tracked, nodes
silent for `forget_steps` steps forgotten.

`note()` runs on the gRPC event loop for every batch and costs a dict update and a set update.

`StepSchedule` is the one place that answers, for the round scheduler (service/rounds.py), when a
step closes: whether a close is due (the watermarks completed the open step, or its grace period is
over), up to which boundary, which queued batches the closing drain takes, whether bulk drains follow
the step in its last half second, and which rows the scorer needs before it scores (`rows_now`, which
the scoring worker calls on the rows of a closing drain).

`CloseHold`: while the round that closes a complete step runs (the worker's ingest of the step's last
rows, scoring, the policy, the directive to the job), telemetry streams wait before their next batch
without events, for at most `max_seconds`. Those batches are all past the step's end (the
watermarks promise it), so nothing the close needs waits; their bytes stay in the streams' HTTP/2
windows (nothing is dropped or buffered anew) and their acks come that much later. On two cores shared
with the collectors, the receipt of 2,048 batches a second is most of a core: the close's critical
path otherwise runs two to three times slower (docs/scaling.md).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pyarrow as pa
import pyarrow.compute as pc

EAGER_BEFORE_NS = 500_000_000   # StepSchedule.eager: a step's last half second


class StepTracker:
    def __init__(self, step_ns: int, *, max_nodes: int = 100_000, forget_steps: int = 10):
        if step_ns <= 0:
            raise ValueError(f"step_ns {step_ns} must be > 0")
        self.step_ns = int(step_ns)
        self.max_nodes = int(max_nodes)
        self.forget_steps = int(forget_steps)
        self._lock = threading.Lock()
        self._watermark: dict[str, int] = {}
        self._waiting: set[str] = set()     # reporting in the open step, not yet promised past its end
        self._boundary: int | None = None   # the end of the open step (the earliest not closed)
        self._reporting = 0                 # nodes whose watermark passed into or beyond the open step
        self._unpromised_until = 0          # a batch without a watermark: no early close before this
        self._fired = False
        self.untracked_nodes = 0            # over max_nodes: not tracked (they never hold a close back)

    def note(self, node: str, watermark_ns: int, now_ns: int) -> bool:
        """One accepted batch of `node` with its watermark (0: none) at server time now_ns. True when
        it completes the open step (the caller then wakes the scoring round)."""
        with self._lock:
            if watermark_ns <= 0:
                # Its rows could still arrive for the open step after an early close.
                self._unpromised_until = max(self._unpromised_until, now_ns + 2 * self.step_ns)
                return False
            old = self._watermark.get(node)
            if old is None:
                if len(self._watermark) >= self.max_nodes:
                    self.untracked_nodes += 1
                    return False
            elif watermark_ns <= old:
                return False   # a re-sent or reordered batch promises nothing new
            self._watermark[node] = watermark_ns
            b = self._boundary
            if b is None:
                return False   # the scoring loop has not said which step is open yet (closed())
            lo = b - self.step_ns
            if watermark_ns >= lo and (old is None or old < lo):
                self._reporting += 1
            if lo <= watermark_ns < b:
                self._waiting.add(node)
            else:
                self._waiting.discard(node)
            if self._fired or self._waiting or not self._reporting or now_ns < self._unpromised_until:
                return False
            self._fired = True
            return True

    @property
    def boundary_ns(self) -> int | None:
        """The end of the open step (None until the scoring loop has said which one is open)."""
        return self._boundary

    def nearly_complete(self, fraction: float = 0.02) -> bool:
        """At most `fraction` of the reporting nodes (and at least one) still owe rows of the open step."""
        with self._lock:
            return bool(self._waiting) and len(self._waiting) <= max(1, int(self._reporting * fraction))

    def complete_boundary(self) -> int | None:
        """The end of the open step if every reporting node has promised past it, else None."""
        with self._lock:
            return self._boundary if self._fired else None

    def closed(self, boundary_ns: int) -> None:
        """The scorer closed every step that ends at or before boundary_ns: track the next one."""
        with self._lock:
            b = (boundary_ns // self.step_ns + 1) * self.step_ns   # the end of the first step not closed
            if self._boundary is not None and b <= self._boundary:
                return
            self._boundary = b
            lo = b - self.step_ns
            gone = b - self.forget_steps * self.step_ns
            for node in [n for n, w in self._watermark.items() if w < gone]:
                del self._watermark[node]
            self._waiting = {n for n, w in self._watermark.items() if lo <= w < b}
            self._reporting = sum(1 for w in self._watermark.values() if w >= lo)
            self._fired = False

    def stats(self) -> dict:
        with self._lock:
            return {"tracked_nodes": len(self._watermark), "waiting": len(self._waiting),
                    "boundary_ns": self._boundary, "untracked_nodes": self.untracked_nodes}


class StepSchedule:
    """When the scorer's feature steps close (module docstring). Steps are [k * step_ns, (k + 1) *
    step_ns); a step closes `grace_ns` after its end, or as soon as the collectors' watermarks
    (`tracker`, which the receipt notes every batch's into) say its rows are all in. Used by the round
    scheduler's thread; only `tracker` is shared with the event loop."""

    def __init__(self, step_ns: int, grace_ns: int):
        self.tracker = StepTracker(step_ns)
        self.step_ns = int(step_ns)
        self.grace_ns = int(grace_ns)
        self.early_closes = 0          # closes the watermarks brought before the grace period was over
        self._closed_ns = 0            # when the last close ran (its boundary, if that is later)
        self._mark: int | None = None  # bulk batches queued when the watermarks completed the open step

    def next_due_ns(self, now_ns: int) -> int:
        """When the step open at now_ns closes at the latest: the round that runs then sees a crossing
        at once."""
        return (now_ns // self.step_ns + 1) * self.step_ns + self.grace_ns

    def complete(self) -> bool:
        """Every reporting node's watermark is past the open step's end."""
        return self.tracker.complete_boundary() is not None

    def due(self, now_ns: int) -> bool:
        """A round at now_ns closes a step: the watermarks completed one, or a grace period is over."""
        return self.complete() or self.next_due_ns(self._closed_ns) <= now_ns

    def completed(self, queued: int) -> None:
        """The watermarks completed the open step when `queued` bulk batches had been queued since the
        start: every batch queued after that is past the step's end (the watermarks promise it)."""
        self._mark = queued

    def batches_now(self, waiting: int, taken: int, due: bool) -> int:
        """How many of the `waiting` bulk batches (`taken` already drained since the start) a round's
        drain takes: at a close the watermarks brought, only those queued before the step completed."""
        if due and self.complete() and self._mark is not None:
            return min(waiting, max(0, self._mark - taken))
        return waiting

    def close(self, now_ns: int, drained_all: bool) -> int:
        """The end of the last step a round at now_ns closes: by the grace period, or the open step's
        end when the watermarks say it is complete and the round took every batch received (an
        overloaded service, more than a drain behind, waits for the grace period)."""
        self._mark = None
        boundary = ((now_ns - self.grace_ns) // self.step_ns) * self.step_ns
        if drained_all:
            complete = self.tracker.complete_boundary()
            if complete is not None and complete > boundary:
                self.early_closes += 1
                boundary = complete
        # A step the watermarks completed just before its end is not due again at the end of its grace
        # period: the next close is the next step's.
        self._closed_ns = max(now_ns, boundary)
        return boundary

    def sent(self, boundary_ns: int) -> None:
        """The drain that closes the steps up to boundary_ns has every batch received so far: the
        watermarks now count for the next step."""
        self.tracker.closed(boundary_ns)

    def eager(self, now_ns: int) -> bool | None:
        """In the last half second of a step, until the watermarks complete it or its grace period is
        over, bulk drains follow the step instead of the drain interval: True (back to back) while many
        nodes still owe rows of it, so that little is left to take when it completes; False (none) once
        nearly all are in, so that the pipeline is free when the last ones come. None: not in that
        window."""
        if self.complete():
            return None
        b = self.tracker.boundary_ns
        if b is None:
            return None
        if not b - EAGER_BEFORE_NS <= now_ns < b + self.grace_ns:
            return None
        return not self.tracker.nearly_complete()

    @staticmethod
    def rows_now(tables: list[tuple[str, pa.Table]], boundary_ns: int | None) -> tuple[list, list]:
        """Of a closing drain's rows, those the closing step(s) need (ts before `boundary_ns`, the end of
        the last step it closes), and the rest, which may wait until the scores are sent. Splitting by
        time keeps every entity's rows in time order across the two. boundary_ns None: a scorer without
        steps, which needs them all."""
        if boundary_ns is None:
            return tables, []
        now, later = [], []
        for name, data in tables:
            if name == "inventory" or "ts" not in data.schema.names or data.num_rows == 0:
                now.append((name, data))
                continue
            early = pc.less(pc.cast(data.column("ts"), pa.int64()), boundary_ns)
            n_early = pc.sum(early).as_py() or 0
            if n_early == data.num_rows:
                now.append((name, data))
            elif n_early == 0:
                later.append((name, data))
            else:
                now.append((name, data.filter(early)))
                later.append((name, data.filter(pc.invert(early))))
        return now, later


class CloseHold:
    """Telemetry streams pause while a step's closing round runs (module docstring).

    `hold()` and `release()` may be called from any thread; `held` is a plain read, cheap enough for
    every batch; `wait()` runs on the gRPC event loop (`bind()` it first: until then nothing holds).
    A hold ends `resume_seconds` after `release()` (so that the closing round's own replies, the
    directive among them, leave the event loop before the held streams' batches come in) or after
    `max_seconds`, whichever is first; 0 turns holds off."""

    MAX_SECONDS = 5.0

    def __init__(self, max_seconds: float = 0.5, *, resume_seconds: float = 0.02):
        if not 0 <= max_seconds <= self.MAX_SECONDS:
            raise ValueError(f"close hold {max_seconds!r} s must be in [0, {self.MAX_SECONDS:g}] seconds")
        self.max_seconds = float(max_seconds)
        self.resume_seconds = min(max(float(resume_seconds), 0.0), self.max_seconds)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread_id = 0
        self._open: asyncio.Event | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._since = 0.0
        self._generation = 0         # which hold a pending release belongs to
        self._releasing = False
        self.holds = 0               # holds begun
        self.expired = 0             # holds that ran out before the round released them
        self.held_seconds = 0.0

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Called on the event loop's thread, with the loop running it."""
        self._loop = loop
        self._thread_id = threading.get_ident()
        self._open = asyncio.Event()
        self._open.set()

    @property
    def held(self) -> bool:
        return self._open is not None and not self._open.is_set()

    async def wait(self) -> None:
        if self._open is not None:
            await self._open.wait()

    def _call(self, fn) -> None:
        loop = self._loop
        if loop is None or self.max_seconds == 0:
            return
        if threading.get_ident() == self._thread_id:
            fn()
        else:
            try:
                loop.call_soon_threadsafe(fn)
            except RuntimeError:
                pass   # the loop is closed: the service is stopping

    def hold(self) -> None:
        self._call(self._hold)

    def release(self) -> None:
        self._call(self._release_soon)

    def _hold(self) -> None:
        if self.held:
            return
        self._open.clear()
        self._since = time.monotonic()
        self._generation += 1
        self._releasing = False
        self.holds += 1
        self._timer = self._loop.call_later(self.max_seconds, self._expire)

    def _release_soon(self) -> None:
        if self.held and not self._releasing:
            self._releasing = True
            self._loop.call_later(self.resume_seconds, self._release, self._generation)

    def _expire(self) -> None:
        self._timer = None
        if self.held and not self._releasing:
            self.expired += 1
        self._release(self._generation)

    def _release(self, generation: int) -> None:
        if generation != self._generation or not self.held:
            return   # a release of an earlier hold, late
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.held_seconds += time.monotonic() - self._since
        self._open.set()
