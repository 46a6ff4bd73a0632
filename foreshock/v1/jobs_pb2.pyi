import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from foreshock.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FallbackPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FALLBACK_POLICY_UNSPECIFIED: _ClassVar[FallbackPolicy]
    FALLBACK_POLICY_SHRINK: _ClassVar[FallbackPolicy]
    FALLBACK_POLICY_CHECKPOINT_EXIT: _ClassVar[FallbackPolicy]

class DirectiveKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DIRECTIVE_KIND_UNSPECIFIED: _ClassVar[DirectiveKind]
    DIRECTIVE_KIND_EVACUATE: _ClassVar[DirectiveKind]
    DIRECTIVE_KIND_SHRINK: _ClassVar[DirectiveKind]
    DIRECTIVE_KIND_CHECKPOINT_EXIT: _ClassVar[DirectiveKind]

class DirectiveCause(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DIRECTIVE_CAUSE_UNSPECIFIED: _ClassVar[DirectiveCause]
    DIRECTIVE_CAUSE_RISK: _ClassVar[DirectiveCause]
    DIRECTIVE_CAUSE_FATAL: _ClassVar[DirectiveCause]
    DIRECTIVE_CAUSE_DRAIN: _ClassVar[DirectiveCause]
    DIRECTIVE_CAUSE_FAIL_SLOW: _ClassVar[DirectiveCause]

class DirectiveState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DIRECTIVE_STATE_UNSPECIFIED: _ClassVar[DirectiveState]
    DIRECTIVE_STATE_PENDING: _ClassVar[DirectiveState]
    DIRECTIVE_STATE_ACCEPTED: _ClassVar[DirectiveState]
    DIRECTIVE_STATE_STATE_TRANSFERRED: _ClassVar[DirectiveState]
    DIRECTIVE_STATE_COMPLETED: _ClassVar[DirectiveState]
    DIRECTIVE_STATE_FAILED: _ClassVar[DirectiveState]
    DIRECTIVE_STATE_CANCELLED: _ClassVar[DirectiveState]

class AckPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACK_PHASE_UNSPECIFIED: _ClassVar[AckPhase]
    ACK_PHASE_ACCEPTED: _ClassVar[AckPhase]
    ACK_PHASE_STATE_TRANSFERRED: _ClassVar[AckPhase]
    ACK_PHASE_COMPLETED: _ClassVar[AckPhase]
    ACK_PHASE_FAILED: _ClassVar[AckPhase]
FALLBACK_POLICY_UNSPECIFIED: FallbackPolicy
FALLBACK_POLICY_SHRINK: FallbackPolicy
FALLBACK_POLICY_CHECKPOINT_EXIT: FallbackPolicy
DIRECTIVE_KIND_UNSPECIFIED: DirectiveKind
DIRECTIVE_KIND_EVACUATE: DirectiveKind
DIRECTIVE_KIND_SHRINK: DirectiveKind
DIRECTIVE_KIND_CHECKPOINT_EXIT: DirectiveKind
DIRECTIVE_CAUSE_UNSPECIFIED: DirectiveCause
DIRECTIVE_CAUSE_RISK: DirectiveCause
DIRECTIVE_CAUSE_FATAL: DirectiveCause
DIRECTIVE_CAUSE_DRAIN: DirectiveCause
DIRECTIVE_CAUSE_FAIL_SLOW: DirectiveCause
DIRECTIVE_STATE_UNSPECIFIED: DirectiveState
DIRECTIVE_STATE_PENDING: DirectiveState
DIRECTIVE_STATE_ACCEPTED: DirectiveState
DIRECTIVE_STATE_STATE_TRANSFERRED: DirectiveState
DIRECTIVE_STATE_COMPLETED: DirectiveState
DIRECTIVE_STATE_FAILED: DirectiveState
DIRECTIVE_STATE_CANCELLED: DirectiveState
ACK_PHASE_UNSPECIFIED: AckPhase
ACK_PHASE_ACCEPTED: AckPhase
ACK_PHASE_STATE_TRANSFERRED: AckPhase
ACK_PHASE_COMPLETED: AckPhase
ACK_PHASE_FAILED: AckPhase

class RankPlacement(_message.Message):
    __slots__ = ("rank", "node", "gpus")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    node: str
    gpus: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rank: _Optional[int] = ..., node: _Optional[str] = ..., gpus: _Optional[_Iterable[int]] = ...) -> None: ...

class RegisterJobRequest(_message.Message):
    __slots__ = ("job_id", "ranks", "spare_nodes", "max_concurrent_evacuations", "fallback", "current_step")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    SPARE_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_EVACUATIONS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    CURRENT_STEP_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    ranks: _containers.RepeatedCompositeFieldContainer[RankPlacement]
    spare_nodes: _containers.RepeatedScalarFieldContainer[str]
    max_concurrent_evacuations: int
    fallback: FallbackPolicy
    current_step: int
    def __init__(self, job_id: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[RankPlacement, _Mapping]]] = ..., spare_nodes: _Optional[_Iterable[str]] = ..., max_concurrent_evacuations: _Optional[int] = ..., fallback: _Optional[_Union[FallbackPolicy, str]] = ..., current_step: _Optional[int] = ...) -> None: ...

class RegisterJobResponse(_message.Message):
    __slots__ = ("job_id", "generation")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    generation: int
    def __init__(self, job_id: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class ReportStepRequest(_message.Message):
    __slots__ = ("job_id", "step", "step_seconds")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    step_seconds: float
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ..., step_seconds: _Optional[float] = ...) -> None: ...

class ReportStepResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StepTime(_message.Message):
    __slots__ = ("step", "step_seconds", "compute_seconds", "end_ns")
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    END_NS_FIELD_NUMBER: _ClassVar[int]
    step: int
    step_seconds: float
    compute_seconds: float
    end_ns: int
    def __init__(self, step: _Optional[int] = ..., step_seconds: _Optional[float] = ..., compute_seconds: _Optional[float] = ..., end_ns: _Optional[int] = ...) -> None: ...

class ReportStepTimesRequest(_message.Message):
    __slots__ = ("job_id", "rank", "node", "steps")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    node: str
    steps: _containers.RepeatedCompositeFieldContainer[StepTime]
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., node: _Optional[str] = ..., steps: _Optional[_Iterable[_Union[StepTime, _Mapping]]] = ...) -> None: ...

class ReportStepTimesResponse(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    def __init__(self, accepted: _Optional[int] = ...) -> None: ...

class DeregisterJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class DeregisterJobResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Directive(_message.Message):
    __slots__ = ("directive_id", "job_id", "kind", "ranks", "from_node", "to_node", "at_step", "deadline", "reason", "risk", "signals", "issued_at", "state", "generation", "cause")
    DIRECTIVE_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    TO_NODE_FIELD_NUMBER: _ClassVar[int]
    AT_STEP_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RISK_FIELD_NUMBER: _ClassVar[int]
    SIGNALS_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    directive_id: str
    job_id: str
    kind: DirectiveKind
    ranks: _containers.RepeatedScalarFieldContainer[int]
    from_node: str
    to_node: str
    at_step: int
    deadline: _timestamp_pb2.Timestamp
    reason: str
    risk: float
    signals: _containers.RepeatedCompositeFieldContainer[_common_pb2.Signal]
    issued_at: _timestamp_pb2.Timestamp
    state: DirectiveState
    generation: int
    cause: DirectiveCause
    def __init__(self, directive_id: _Optional[str] = ..., job_id: _Optional[str] = ..., kind: _Optional[_Union[DirectiveKind, str]] = ..., ranks: _Optional[_Iterable[int]] = ..., from_node: _Optional[str] = ..., to_node: _Optional[str] = ..., at_step: _Optional[int] = ..., deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., reason: _Optional[str] = ..., risk: _Optional[float] = ..., signals: _Optional[_Iterable[_Union[_common_pb2.Signal, _Mapping]]] = ..., issued_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., state: _Optional[_Union[DirectiveState, str]] = ..., generation: _Optional[int] = ..., cause: _Optional[_Union[DirectiveCause, str]] = ...) -> None: ...

class WatchDirectivesRequest(_message.Message):
    __slots__ = ("job_id", "rank")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...

class AckDirectiveRequest(_message.Message):
    __slots__ = ("job_id", "directive_id", "rank", "phase", "reason", "phase_seconds")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    DIRECTIVE_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PHASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    directive_id: str
    rank: int
    phase: AckPhase
    reason: str
    phase_seconds: float
    def __init__(self, job_id: _Optional[str] = ..., directive_id: _Optional[str] = ..., rank: _Optional[int] = ..., phase: _Optional[_Union[AckPhase, str]] = ..., reason: _Optional[str] = ..., phase_seconds: _Optional[float] = ...) -> None: ...

class AckDirectiveResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: DirectiveState
    def __init__(self, state: _Optional[_Union[DirectiveState, str]] = ...) -> None: ...

class CancelDirectiveRequest(_message.Message):
    __slots__ = ("directive_id", "reason")
    DIRECTIVE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    directive_id: str
    reason: str
    def __init__(self, directive_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelDirectiveResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: DirectiveState
    def __init__(self, state: _Optional[_Union[DirectiveState, str]] = ...) -> None: ...

class DrainNodeRequest(_message.Message):
    __slots__ = ("node", "reason")
    NODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node: str
    reason: str
    def __init__(self, node: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class DrainNodeResponse(_message.Message):
    __slots__ = ("directives",)
    DIRECTIVES_FIELD_NUMBER: _ClassVar[int]
    directives: _containers.RepeatedCompositeFieldContainer[Directive]
    def __init__(self, directives: _Optional[_Iterable[_Union[Directive, _Mapping]]] = ...) -> None: ...

class ListDirectivesRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListDirectivesResponse(_message.Message):
    __slots__ = ("directives",)
    DIRECTIVES_FIELD_NUMBER: _ClassVar[int]
    directives: _containers.RepeatedCompositeFieldContainer[Directive]
    def __init__(self, directives: _Optional[_Iterable[_Union[Directive, _Mapping]]] = ...) -> None: ...
