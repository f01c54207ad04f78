from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVLayoutMsg(_message.Message):
    __slots__ = ("model_fingerprint", "layout", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    layout: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    def __init__(self, model_fingerprint: _Optional[str] = ..., layout: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ...) -> None: ...

class RequestStateMsg(_message.Message):
    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "num_computed_tokens", "params_json", "priority", "max_output_tokens", "first_block", "num_cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    params_json: str
    priority: int
    max_output_tokens: int
    first_block: int
    num_cached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., params_json: _Optional[str] = ..., priority: _Optional[int] = ..., max_output_tokens: _Optional[int] = ..., first_block: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class KVHeaderMsg(_message.Message):
    __slots__ = ("protocol_version", "layout", "state", "shape", "num_bytes", "shm_name", "reservation_token")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    layout: KVLayoutMsg
    state: RequestStateMsg
    shape: _containers.RepeatedScalarFieldContainer[int]
    num_bytes: int
    shm_name: str
    reservation_token: str
    def __init__(self, protocol_version: _Optional[int] = ..., layout: _Optional[_Union[KVLayoutMsg, _Mapping]] = ..., state: _Optional[_Union[RequestStateMsg, _Mapping]] = ..., shape: _Optional[_Iterable[int]] = ..., num_bytes: _Optional[int] = ..., shm_name: _Optional[str] = ..., reservation_token: _Optional[str] = ...) -> None: ...

class KVChunkMsg(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: KVHeaderMsg
    data: bytes
    def __init__(self, header: _Optional[_Union[KVHeaderMsg, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class KVAckMsg(_message.Message):
    __slots__ = ("request_id", "ok", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    ok: bool
    error: str
    def __init__(self, request_id: _Optional[str] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...
