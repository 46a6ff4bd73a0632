from foreshock.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetNodeRiskRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: str
    def __init__(self, node: _Optional[str] = ...) -> None: ...

class ListRiskiestRequest(_message.Message):
    __slots__ = ("limit", "min_probability")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    MIN_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    limit: int
    min_probability: float
    def __init__(self, limit: _Optional[int] = ..., min_probability: _Optional[float] = ...) -> None: ...

class ListRiskiestResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[_common_pb2.NodeRisk]
    def __init__(self, nodes: _Optional[_Iterable[_Union[_common_pb2.NodeRisk, _Mapping]]] = ...) -> None: ...

class WatchRiskRequest(_message.Message):
    __slots__ = ("nodes", "min_change")
    NODES_FIELD_NUMBER: _ClassVar[int]
    MIN_CHANGE_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedScalarFieldContainer[str]
    min_change: float
    def __init__(self, nodes: _Optional[_Iterable[str]] = ..., min_change: _Optional[float] = ...) -> None: ...
