"""What a replica's engine offers: the one call shape the servicers, the batch runner and the
startup profile rely on, so none of them probes an engine for what it can do.

Every operation that runs the model is a *work* (specdec.engine.sessions.Work): a generator that
asks for the passes it needs. A batch runner over the engine's ``batch_store`` runs works of many
sessions together (specdec.engine.batching); ``run_alone`` runs one where one call is wanted. An
engine whose operations share no pass (an n-gram lookup, a feature draft's chain) has no
``batch_store`` and works that run whole when started (``sessions.whole``). Bookkeeping that runs
no model (commit, release, expiry, stats) stays a plain call.

Implemented by: specdec.engine.target.TargetEngine, specdec.engine.tensor_parallel.DistributedTargetEngine
(targets); specdec.engine.draft.DraftEngine, FeatureDraftEngine, specdec.engine.ngram.NgramDraft (drafts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from specdec.engine.commits import Commit
from specdec.engine.sessions import Work


@runtime_checkable
class ReplicaEngine(Protocol):
    """What every replica's engine offers."""

    @property
    def model_id(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def context_length(self) -> int:
        """Its model's context (0: none, an n-gram lookup)."""

    @property
    def batch_store(self) -> Any:
        """The store a batch runner runs its works' passes on (a SessionStore, or a tensor-parallel
        group's mirror of one); None where its works ask for no pass."""

    @property
    def prefill_work(self) -> Callable[..., Work]:
        """(session_id, prompt, params, *what its kind needs) -> the work that starts a session
        (a target may return the prompt's features; a feature draft takes them)."""

    def devices(self) -> list[str]:
        """Where its passes compute (modeling.loading.device_identity; a tensor-parallel group:
        every rank's)."""

    def commit(self, session_id: str, commit: Commit) -> None: ...

    def release(self, session_id: str) -> bool: ...

    def expire_idle(self, ttl_seconds: float) -> list[str]: ...

    def stats(self) -> dict: ...


@runtime_checkable
class ProposingEngine(ReplicaEngine, Protocol):
    """A draft replica's engine."""

    kind: str  # "model", "feature" or "ngram" (EngineInfo.draft_kind)
    feature_size: int  # the target features it reads per token (0: none)

    @property
    def propose_work(self) -> Callable[..., Work]:
        """(session_id, step, k, commit=None, assumed=(), rejections=0) -> a work whose result is
        a specdec.exact.proposal.DraftProposal."""


@runtime_checkable
class VerifyingEngine(ReplicaEngine, Protocol):
    """A target replica's engine."""

    @property
    def feature_size(self) -> int:
        """The width of the features it returns for a feature draft."""

    def rank_stats(self) -> list[dict]:
        """Each rank's ``param_bytes`` and ``kv_bytes`` (one rank unless tensor-parallel)."""

    @property
    def verify_work(self) -> Callable[..., Work]:
        """(session_id, step, proposals, q_block, commit=None, return_features=False) -> a work
        whose result is a specdec.exact.verify.TargetVerdict."""


@runtime_checkable
class ProfiledEngine(Protocol):
    """An engine whose batched pass the startup profile times (specdec.engine.profile)."""

    @property
    def store(self) -> Any: ...

    @property
    def step_work(self) -> Callable[..., Work]:
        """(session_id, step, commit=None) -> a work taking one step with nothing proposed, whose
        result is the token it emits."""
