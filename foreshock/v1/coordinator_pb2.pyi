from foreshock.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ShardEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SHARD_EVENT_KIND_UNSPECIFIED: _ClassVar[ShardEventKind]
    SHARD_EVENT_KIND_ALARM: _ClassVar[ShardEventKind]
    SHARD_EVENT_KIND_CLEARED: _ClassVar[ShardEventKind]
    SHARD_EVENT_KIND_FATAL: _ClassVar[ShardEventKind]
    SHARD_EVENT_KIND_RISK: _ClassVar[ShardEventKind]
    SHARD_EVENT_KIND_FABRIC_SERVICE: _ClassVar[ShardEventKind]
SHARD_EVENT_KIND_UNSPECIFIED: ShardEventKind
SHARD_EVENT_KIND_ALARM: ShardEventKind
SHARD_EVENT_KIND_CLEARED: ShardEventKind
SHARD_EVENT_KIND_FATAL: ShardEventKind
SHARD_EVENT_KIND_RISK: ShardEventKind
SHARD_EVENT_KIND_FABRIC_SERVICE: ShardEventKind

class ShardEvent(_message.Message):
    __slots__ = ("sequence", "kind", "node", "risk", "signals", "ts_ns", "fatal_kind", "description", "leaf_switch", "site", "nvlink_domain", "unit", "finding", "raised")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    RISK_FIELD_NUMBER: _ClassVar[int]
    SIGNALS_FIELD_NUMBER: _ClassVar[int]
    TS_NS_FIELD_NUMBER: _ClassVar[int]
    FATAL_KIND_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    LEAF_SWITCH_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    NVLINK_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    FINDING_FIELD_NUMBER: _ClassVar[int]
    RAISED_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    kind: ShardEventKind
    node: str
    risk: float
    signals: _containers.RepeatedCompositeFieldContainer[_common_pb2.Signal]
    ts_ns: int
    fatal_kind: str
    description: str
    leaf_switch: str
    site: str
    nvlink_domain: str
    unit: str
    finding: str
    raised: bool
    def __init__(self, sequence: _Optional[int] = ..., kind: _Optional[_Union[ShardEventKind, str]] = ..., node: _Optional[str] = ..., risk: _Optional[float] = ..., signals: _Optional[_Iterable[_Union[_common_pb2.Signal, _Mapping]]] = ..., ts_ns: _Optional[int] = ..., fatal_kind: _Optional[str] = ..., description: _Optional[str] = ..., leaf_switch: _Optional[str] = ..., site: _Optional[str] = ..., nvlink_domain: _Optional[str] = ..., unit: _Optional[str] = ..., finding: _Optional[str] = ..., raised: _Optional[bool] = ...) -> None: ...

class GroupTotals(_message.Message):
    __slots__ = ("group", "name", "values")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    group: str
    name: str
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, group: _Optional[str] = ..., name: _Optional[str] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class StepTotals(_message.Message):
    __slots__ = ("step", "groups")
    STEP_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    step: int
    groups: _containers.RepeatedCompositeFieldContainer[GroupTotals]
    def __init__(self, step: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[GroupTotals, _Mapping]]] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("shard", "epoch", "model_version", "events", "totals")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    TOTALS_FIELD_NUMBER: _ClassVar[int]
    shard: str
    epoch: int
    model_version: str
    events: _containers.RepeatedCompositeFieldContainer[ShardEvent]
    totals: _containers.RepeatedCompositeFieldContainer[StepTotals]
    def __init__(self, shard: _Optional[str] = ..., epoch: _Optional[int] = ..., model_version: _Optional[str] = ..., events: _Optional[_Iterable[_Union[ShardEvent, _Mapping]]] = ..., totals: _Optional[_Iterable[_Union[StepTotals, _Mapping]]] = ...) -> None: ...

class ForwardAck(_message.Message):
    __slots__ = ("epoch", "acked_sequence", "peer_totals", "step_times", "step_times_pending")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ACKED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    PEER_TOTALS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIMES_FIELD_NUMBER: _ClassVar[int]
    STEP_TIMES_PENDING_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    acked_sequence: int
    peer_totals: StepTotals
    step_times: bytes
    step_times_pending: bool
    def __init__(self, epoch: _Optional[int] = ..., acked_sequence: _Optional[int] = ..., peer_totals: _Optional[_Union[StepTotals, _Mapping]] = ..., step_times: _Optional[bytes] = ..., step_times_pending: _Optional[bool] = ...) -> None: ...
