from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class Gate(_message.Message):
    __slots__ = ("phase", "request_id")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    phase: str
    request_id: str
    def __init__(self, phase: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class GateReply(_message.Message):
    __slots__ = ("reached",)
    REACHED_FIELD_NUMBER: _ClassVar[int]
    reached: bool
    def __init__(self, reached: _Optional[bool] = ...) -> None: ...
