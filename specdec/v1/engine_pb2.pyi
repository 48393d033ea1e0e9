from specdec.v1 import coordinator_pb2 as _coordinator_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SparseDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class Features(_message.Message):
    __slots__ = ("rows", "dim", "dtype", "data")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    rows: int
    dim: int
    dtype: str
    data: bytes
    def __init__(self, rows: _Optional[int] = ..., dim: _Optional[int] = ..., dtype: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class Commit(_message.Message):
    __slots__ = ("step", "base_len", "tokens", "features")
    STEP_FIELD_NUMBER: _ClassVar[int]
    BASE_LEN_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    step: int
    base_len: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    features: Features
    def __init__(self, step: _Optional[int] = ..., base_len: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., features: _Optional[_Union[Features, _Mapping]] = ...) -> None: ...

class StartSessionRequest(_message.Message):
    __slots__ = ("session_id", "prompt_token_ids", "sampling", "traceparent", "return_features", "features", "prompt_length", "eos_token_ids", "cache_salt")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    RETURN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _coordinator_pb2.SamplingParams
    traceparent: str
    return_features: bool
    features: Features
    prompt_length: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    def __init__(self, session_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_coordinator_pb2.SamplingParams, _Mapping]] = ..., traceparent: _Optional[str] = ..., return_features: _Optional[bool] = ..., features: _Optional[_Union[Features, _Mapping]] = ..., prompt_length: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class StartSessionResponse(_message.Message):
    __slots__ = ("features", "cached_tokens")
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    features: Features
    cached_tokens: int
    def __init__(self, features: _Optional[_Union[Features, _Mapping]] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("session_id", "commit")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    commit: Commit
    def __init__(self, session_id: _Optional[str] = ..., commit: _Optional[_Union[Commit, _Mapping]] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("kind", "model_id", "vocab_size", "context_length", "eos_token_ids", "tokenizer_fingerprint", "live_sessions", "kv_bytes", "kv_bytes_per_token", "draft_kind", "sessions_started", "replica_id", "draining", "tp_size", "rank_param_bytes", "rank_kv_bytes", "feature_size", "cost_sizes", "cost_seconds", "pass_backend", "batch_invariant", "node", "devices")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_KIND_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_STARTED_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_PARAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    RANK_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    FEATURE_SIZE_FIELD_NUMBER: _ClassVar[int]
    COST_SIZES_FIELD_NUMBER: _ClassVar[int]
    COST_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PASS_BACKEND_FIELD_NUMBER: _ClassVar[int]
    BATCH_INVARIANT_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    kind: str
    model_id: str
    vocab_size: int
    context_length: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tokenizer_fingerprint: str
    live_sessions: int
    kv_bytes: int
    kv_bytes_per_token: int
    draft_kind: str
    sessions_started: int
    replica_id: str
    draining: bool
    tp_size: int
    rank_param_bytes: _containers.RepeatedScalarFieldContainer[int]
    rank_kv_bytes: _containers.RepeatedScalarFieldContainer[int]
    feature_size: int
    cost_sizes: _containers.RepeatedScalarFieldContainer[int]
    cost_seconds: _containers.RepeatedScalarFieldContainer[float]
    pass_backend: str
    batch_invariant: bool
    node: str
    devices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, kind: _Optional[str] = ..., model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., context_length: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., tokenizer_fingerprint: _Optional[str] = ..., live_sessions: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., kv_bytes_per_token: _Optional[int] = ..., draft_kind: _Optional[str] = ..., sessions_started: _Optional[int] = ..., replica_id: _Optional[str] = ..., draining: _Optional[bool] = ..., tp_size: _Optional[int] = ..., rank_param_bytes: _Optional[_Iterable[int]] = ..., rank_kv_bytes: _Optional[_Iterable[int]] = ..., feature_size: _Optional[int] = ..., cost_sizes: _Optional[_Iterable[int]] = ..., cost_seconds: _Optional[_Iterable[float]] = ..., pass_backend: _Optional[str] = ..., batch_invariant: _Optional[bool] = ..., node: _Optional[str] = ..., devices: _Optional[_Iterable[str]] = ...) -> None: ...

class PassLoad(_message.Message):
    __slots__ = ("size", "sessions", "seconds", "live_sessions")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    LIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    size: int
    sessions: int
    seconds: float
    live_sessions: int
    def __init__(self, size: _Optional[int] = ..., sessions: _Optional[int] = ..., seconds: _Optional[float] = ..., live_sessions: _Optional[int] = ...) -> None: ...
