import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Signal(_message.Message):
    __slots__ = ("name", "value", "contribution", "description")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTION_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: float
    contribution: float
    description: str
    def __init__(self, name: _Optional[str] = ..., value: _Optional[float] = ..., contribution: _Optional[float] = ..., description: _Optional[str] = ...) -> None: ...

class NodeRisk(_message.Message):
    __slots__ = ("node", "probability", "horizon_seconds", "model_version", "signals", "scored_at", "above_threshold", "leaf_switch", "site")
    NODE_FIELD_NUMBER: _ClassVar[int]
    PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    HORIZON_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SIGNALS_FIELD_NUMBER: _ClassVar[int]
    SCORED_AT_FIELD_NUMBER: _ClassVar[int]
    ABOVE_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    LEAF_SWITCH_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    node: str
    probability: float
    horizon_seconds: int
    model_version: str
    signals: _containers.RepeatedCompositeFieldContainer[Signal]
    scored_at: _timestamp_pb2.Timestamp
    above_threshold: bool
    leaf_switch: str
    site: str
    def __init__(self, node: _Optional[str] = ..., probability: _Optional[float] = ..., horizon_seconds: _Optional[int] = ..., model_version: _Optional[str] = ..., signals: _Optional[_Iterable[_Union[Signal, _Mapping]]] = ..., scored_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., above_threshold: _Optional[bool] = ..., leaf_switch: _Optional[str] = ..., site: _Optional[str] = ...) -> None: ...
