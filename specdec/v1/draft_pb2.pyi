from specdec.v1 import engine_pb2 as _engine_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProposeRequest(_message.Message):
    __slots__ = ("session_id", "step", "k", "commit", "assumed", "rejection_branches")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_FIELD_NUMBER: _ClassVar[int]
    REJECTION_BRANCHES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    step: int
    k: int
    commit: _engine_pb2.Commit
    assumed: _containers.RepeatedScalarFieldContainer[int]
    rejection_branches: int
    def __init__(self, session_id: _Optional[str] = ..., step: _Optional[int] = ..., k: _Optional[int] = ..., commit: _Optional[_Union[_engine_pb2.Commit, _Mapping]] = ..., assumed: _Optional[_Iterable[int]] = ..., rejection_branches: _Optional[int] = ...) -> None: ...

class ProposedToken(_message.Message):
    __slots__ = ("token_id", "q")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    q: _engine_pb2.SparseDistribution
    def __init__(self, token_id: _Optional[int] = ..., q: _Optional[_Union[_engine_pb2.SparseDistribution, _Mapping]] = ...) -> None: ...

class Branch(_message.Message):
    __slots__ = ("prefix", "tokens")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    prefix: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedCompositeFieldContainer[ProposedToken]
    def __init__(self, prefix: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[_Union[ProposedToken, _Mapping]]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("tokens", "load", "branches")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[ProposedToken]
    load: _engine_pb2.PassLoad
    branches: _containers.RepeatedCompositeFieldContainer[Branch]
    def __init__(self, tokens: _Optional[_Iterable[_Union[ProposedToken, _Mapping]]] = ..., load: _Optional[_Union[_engine_pb2.PassLoad, _Mapping]] = ..., branches: _Optional[_Iterable[_Union[Branch, _Mapping]]] = ...) -> None: ...
