"""Directives as the migrator sees them, where they come from, and how the ranks agree on when to act.

A Directive mirrors foreshock.v1.Directive (proto/foreshock/v1/jobs.proto): evacuate `ranks` from
`from_node` to `to_node` at the step boundary `at_step` (or, with no spare, shrink or checkpoint and
exit). A DirectiveSource delivers them (the gRPC ServiceClient, or LocalDirectiveSource in-process) and
takes acknowledgements; neither side may raise into the training loop.

Agreement: every rank keeps a DirectiveBook. At each step it contributes a three-element control vector
to a sum all-reduce the job already runs (one more bucket slot in the gradient all-reduce):
`[ready, key, go]`, where ready = 1 when the rank knows a pending directive, key = a 10-bit hash of that
directive's id plus one, go = 1 when that directive's step has come. Every rank sees the same sums, so
"sum(ready) == W and sum(key) == W * my key and sum(go) == W" is true on all ranks or on none: they act at
the same step boundary or not at all. The values stay exact in float32 for worlds up to 16,384 ranks.
The switch plan itself (which ranks, which spare) is then published by one coordinator, so a rare hash
collision between two different directives still yields one consistent action.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import queue
import threading
import time
import zlib
from collections.abc import Iterable
from typing import Protocol

log = logging.getLogger("foreshock.migrator")

CONTROL_SIZE = 3
KEY_SPACE = 1024
MAX_EXACT_WORLD = (1 << 24) // (KEY_SPACE + 1)


def drain(inbox: "queue.Queue") -> list:
    """Everything queued now, without waiting (the training loop never blocks on directives)."""
    out = []
    while True:
        try:
            out.append(inbox.get_nowait())
        except queue.Empty:
            return out


class DirectiveKind(enum.Enum):
    EVACUATE = "evacuate"
    SHRINK = "shrink"
    CHECKPOINT_EXIT = "checkpoint_exit"


class AckPhase(enum.Enum):
    ACCEPTED = "accepted"
    STATE_TRANSFERRED = "state_transferred"
    COMPLETED = "completed"
    FAILED = "failed"


@dataclasses.dataclass(frozen=True)
class Directive:
    directive_id: str
    kind: DirectiveKind
    ranks: tuple[int, ...]
    from_node: str = ""
    to_node: str = ""
    at_step: int = 0
    reason: str = ""
    cancelled: bool = False
    generation: int = 0
    deadline: float | None = None     # seconds since the epoch

    @property
    def key(self) -> int:
        return zlib.crc32(self.directive_id.encode()) % KEY_SPACE + 1


@dataclasses.dataclass(frozen=True)
class Ack:
    directive_id: str
    rank: int
    phase: AckPhase
    reason: str = ""
    phase_seconds: float = 0.0


class DirectiveSource(Protocol):
    """Where a rank's directives come from and where its acknowledgements go. Must never raise."""

    def poll(self) -> list[Directive]:
        """Directives (and cancellations) delivered since the last poll; non-blocking."""

    def ack(self, ack: Ack) -> None:
        """Queue an acknowledgement; non-blocking."""

    def close(self) -> None: ...


class LocalDirectiveSource:
    """An in-process source: directives pushed by the caller (tests, a job driving its own moves)."""

    def __init__(self) -> None:
        self._inbox: queue.SimpleQueue[Directive] = queue.SimpleQueue()
        self.acks: list[Ack] = []
        self._lock = threading.Lock()

    def push(self, directive: Directive) -> None:
        self._inbox.put(directive)

    def poll(self) -> list[Directive]:
        return drain(self._inbox)

    def ack(self, ack: Ack) -> None:
        with self._lock:
            self.acks.append(ack)

    def close(self) -> None:
        pass


class NullDirectiveSource(LocalDirectiveSource):
    """No control plane: training runs, nothing is ever directed."""


class DirectiveBook:
    """One rank's view of the job's directives: deduplicated, cancellable, acted on once."""

    def __init__(self, done: Iterable[str] = ()) -> None:
        self._pending: dict[str, Directive] = {}
        self._order: dict[str, int] = {}
        self._seq = 0
        self.done: set[str] = set(done)
        self.redelivered: list[str] = []     # ids delivered again after they were acted on
        self.first_seen: dict[str, float] = {}

    def offer(self, directive: Directive) -> bool:
        """Record a delivery; True if it changed what is pending."""
        did = directive.directive_id
        if directive.cancelled:
            return self._pending.pop(did, None) is not None
        if did in self.done:
            self.redelivered.append(did)
            return False
        if did in self._pending:
            return False
        self._pending[did] = directive
        self.first_seen.setdefault(did, time.monotonic())
        self._order[did] = self._seq
        self._seq += 1
        return True

    def candidate(self) -> Directive | None:
        if not self._pending:
            return None
        return min(self._pending.values(), key=lambda d: (d.at_step, self._order[d.directive_id]))

    def get(self, directive_id: str) -> Directive | None:
        return self._pending.get(directive_id)

    def finish(self, directive_id: str) -> None:
        self._pending.pop(directive_id, None)
        self.done.add(directive_id)

    def expire(self, wall_now: float, keep: Iterable[str] = ()) -> list[Directive]:
        """Drop the pending directives whose deadline (seconds since the epoch) has passed, except those
        in `keep` (already agreed by every rank: their switch goes ahead); they count as done. A rank
        that drops one stops standing for it, so no rank can agree on it afterwards (decide() needs
        all), whatever moment each rank's clock says it expired."""
        keep = set(keep)
        gone = [d for did, d in self._pending.items()
                if d.deadline is not None and d.deadline < wall_now and did not in keep]
        for d in gone:
            self.finish(d.directive_id)
        return gone

    def control(self, next_completed_step: int) -> tuple[list[float], Directive | None]:
        """This rank's contribution, given the step count after the step now running completes, and
        the candidate it stands for (decide() must be given that same candidate, not a later one)."""
        cand = self.candidate()
        if cand is None:
            return [0.0, 0.0, 0.0], None
        return [1.0, float(cand.key), 1.0 if next_completed_step >= cand.at_step else 0.0], cand

    @staticmethod
    def decide(summed: Iterable[float], world_size: int,
               candidate: Directive | None) -> tuple[Directive | None, bool]:
        """(directive all ranks agree on or None, whether its step has come on every rank)."""
        ready, key, go = (round(float(v)) for v in summed)
        if candidate is None or ready != world_size or key != world_size * candidate.key:
            return None, False
        return candidate, go == world_size


def now() -> float:
    return time.monotonic()
