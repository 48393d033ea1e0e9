from specdec.v1 import engine_pb2 as _engine_pb2
from specdec.v1 import draft_pb2 as _draft_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyChunk(_message.Message):
    __slots__ = ("session_id", "step", "commit", "proposals", "return_features")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    RETURN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    step: int
    commit: _engine_pb2.Commit
    proposals: _containers.RepeatedCompositeFieldContainer[_draft_pb2.ProposedToken]
    return_features: bool
    def __init__(self, session_id: _Optional[str] = ..., step: _Optional[int] = ..., commit: _Optional[_Union[_engine_pb2.Commit, _Mapping]] = ..., proposals: _Optional[_Iterable[_Union[_draft_pb2.ProposedToken, _Mapping]]] = ..., return_features: _Optional[bool] = ...) -> None: ...

class RowLogprobs(_message.Message):
    __slots__ = ("candidate_ids", "candidate_logprobs", "top_ids", "top_logprobs")
    CANDIDATE_IDS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    candidate_ids: _containers.RepeatedScalarFieldContainer[int]
    candidate_logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, candidate_ids: _Optional[_Iterable[int]] = ..., candidate_logprobs: _Optional[_Iterable[float]] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("p_proposed", "recovered", "bonus", "features", "load", "logprobs")
    P_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_FIELD_NUMBER: _ClassVar[int]
    BONUS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    p_proposed: _containers.RepeatedScalarFieldContainer[float]
    recovered: _containers.RepeatedScalarFieldContainer[int]
    bonus: int
    features: _engine_pb2.Features
    load: _engine_pb2.PassLoad
    logprobs: _containers.RepeatedCompositeFieldContainer[RowLogprobs]
    def __init__(self, p_proposed: _Optional[_Iterable[float]] = ..., recovered: _Optional[_Iterable[int]] = ..., bonus: _Optional[int] = ..., features: _Optional[_Union[_engine_pb2.Features, _Mapping]] = ..., load: _Optional[_Union[_engine_pb2.PassLoad, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[RowLogprobs, _Mapping]]] = ...) -> None: ...
