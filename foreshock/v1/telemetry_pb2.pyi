from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TableRows(_message.Message):
    __slots__ = ("table", "schema_version", "arrow_ipc", "schema_omitted")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    ARROW_IPC_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_OMITTED_FIELD_NUMBER: _ClassVar[int]
    table: str
    schema_version: int
    arrow_ipc: bytes
    schema_omitted: bool
    def __init__(self, table: _Optional[str] = ..., schema_version: _Optional[int] = ..., arrow_ipc: _Optional[bytes] = ..., schema_omitted: _Optional[bool] = ...) -> None: ...

class SweepBatch(_message.Message):
    __slots__ = ("node", "collector_id", "sequence", "tables", "watermark_ns")
    NODE_FIELD_NUMBER: _ClassVar[int]
    COLLECTOR_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    WATERMARK_NS_FIELD_NUMBER: _ClassVar[int]
    node: str
    collector_id: str
    sequence: int
    tables: _containers.RepeatedCompositeFieldContainer[TableRows]
    watermark_ns: int
    def __init__(self, node: _Optional[str] = ..., collector_id: _Optional[str] = ..., sequence: _Optional[int] = ..., tables: _Optional[_Iterable[_Union[TableRows, _Mapping]]] = ..., watermark_ns: _Optional[int] = ...) -> None: ...

class Rejection(_message.Message):
    __slots__ = ("sequence", "table", "reason", "detail")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    table: str
    reason: str
    detail: str
    def __init__(self, sequence: _Optional[int] = ..., table: _Optional[str] = ..., reason: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class SweepAck(_message.Message):
    __slots__ = ("acked_sequence", "credits", "rejections", "schemas_kept")
    ACKED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    CREDITS_FIELD_NUMBER: _ClassVar[int]
    REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    SCHEMAS_KEPT_FIELD_NUMBER: _ClassVar[int]
    acked_sequence: int
    credits: int
    rejections: _containers.RepeatedCompositeFieldContainer[Rejection]
    schemas_kept: bool
    def __init__(self, acked_sequence: _Optional[int] = ..., credits: _Optional[int] = ..., rejections: _Optional[_Iterable[_Union[Rejection, _Mapping]]] = ..., schemas_kept: _Optional[bool] = ...) -> None: ...
