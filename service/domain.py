"""The control plane's domain types: jobs and their ranks, directives, acknowledgements, and the enums
they use. The enums mirror proto/foreshock/v1/jobs.proto by number (tests/test_service_jobs.py checks
it), so neither the store nor the policy needs the generated stubs; service/servicers.py translates.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class DirectiveKind(enum.IntEnum):
    EVACUATE = 1
    SHRINK = 2
    CHECKPOINT_EXIT = 3


class DirectiveState(enum.IntEnum):
    PENDING = 1
    ACCEPTED = 2
    STATE_TRANSFERRED = 3
    COMPLETED = 4
    FAILED = 5
    CANCELLED = 6


ACTIVE_STATES = (DirectiveState.PENDING, DirectiveState.ACCEPTED, DirectiveState.STATE_TRANSFERRED)
TERMINAL_STATES = (DirectiveState.COMPLETED, DirectiveState.FAILED, DirectiveState.CANCELLED)


class AckPhase(enum.IntEnum):
    ACCEPTED = 1
    STATE_TRANSFERRED = 2
    COMPLETED = 3
    FAILED = 4


ACK_TO_STATE = {
    AckPhase.ACCEPTED: DirectiveState.ACCEPTED,
    AckPhase.STATE_TRANSFERRED: DirectiveState.STATE_TRANSFERRED,
    AckPhase.COMPLETED: DirectiveState.COMPLETED,
    AckPhase.FAILED: DirectiveState.FAILED,
}


class DirectiveCause(enum.IntEnum):
    """Why a directive was issued, mirroring jobs.proto's DirectiveCause; kept in the directives
    table's `origin` column as the name in lower case. An origin "policy" (written before risk and
    fatal were told apart) reads as UNSPECIFIED."""
    UNSPECIFIED = 0
    RISK = 1
    FATAL = 2
    DRAIN = 3
    FAIL_SLOW = 4


class Fallback(enum.IntEnum):
    UNSPECIFIED = 0
    SHRINK = 1
    CHECKPOINT_EXIT = 2


@dataclass(frozen=True)
class Rank:
    rank: int
    node: str
    gpus: tuple[int, ...] = ()


@dataclass(frozen=True)
class Job:
    job_id: str
    ranks: tuple[Rank, ...]
    spares: tuple[str, ...] = ()
    max_concurrent: int = 0          # 0: the service's default
    fallback: Fallback = Fallback.UNSPECIFIED
    step: int = 0
    step_seconds: float = 0.0
    step_at_ns: int = 0              # when `step` was reported
    generation: int = 1
    registered_at_ns: int = 0

    def nodes(self) -> set[str]:
        return {r.node for r in self.ranks}

    def ranks_on(self, node: str) -> tuple[int, ...]:
        return tuple(sorted(r.rank for r in self.ranks if r.node == node))


@dataclass(frozen=True)
class SignalRecord:
    name: str
    value: float
    contribution: float
    description: str


@dataclass(frozen=True)
class Directive:
    directive_id: str
    job_id: str
    kind: DirectiveKind
    ranks: tuple[int, ...]
    from_node: str
    to_node: str
    at_step: int
    deadline_ns: int
    reason: str
    risk: float
    signals: tuple[SignalRecord, ...] = ()
    issued_at_ns: int = 0
    state: DirectiveState = DirectiveState.PENDING
    generation: int = 1
    updated_at_ns: int = 0
    origin: str = "policy"           # a DirectiveCause in lower case: risk | fatal | drain | fail_slow

    @property
    def cause(self) -> DirectiveCause:
        return DirectiveCause.__members__.get(self.origin.upper(), DirectiveCause.UNSPECIFIED)


@dataclass(frozen=True)
class AckRecord:
    directive_id: str
    rank: int
    phase: AckPhase
    reason: str
    phase_seconds: float
    at_ns: int
