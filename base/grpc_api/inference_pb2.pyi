from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Parameters(_message.Message):
    __slots__ = ("max_tokens", "temperature")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ...) -> None: ...

class InferRequest(_message.Message):
    __slots__ = ("input", "timeout_ms", "model", "parameters")
    INPUT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    input: str
    timeout_ms: int
    model: str
    parameters: Parameters
    def __init__(self, input: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., model: _Optional[str] = ..., parameters: _Optional[_Union[Parameters, _Mapping]] = ...) -> None: ...

class InferResponse(_message.Message):
    __slots__ = ("request_id", "output", "latency_ms", "tier", "batch_size", "queue_ms", "served_by", "model", "tokens_used", "model_version")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    SERVED_BY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_USED_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    output: str
    latency_ms: float
    tier: str
    batch_size: int
    queue_ms: int
    served_by: str
    model: str
    tokens_used: int
    model_version: str
    def __init__(self, request_id: _Optional[str] = ..., output: _Optional[str] = ..., latency_ms: _Optional[float] = ..., tier: _Optional[str] = ..., batch_size: _Optional[int] = ..., queue_ms: _Optional[int] = ..., served_by: _Optional[str] = ..., model: _Optional[str] = ..., tokens_used: _Optional[int] = ..., model_version: _Optional[str] = ...) -> None: ...
