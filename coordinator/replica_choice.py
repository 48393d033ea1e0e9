"""Which replica a session goes to: pure functions of the registry's view (no I/O), the
coordinator's choice among the replicas that registered (specdec.runtime.registry)."""

from __future__ import annotations

from collections.abc import Sequence

from specdec.runtime.registry import Replica


def load_with_pending(r: Replica, pending: dict[str, int] | None) -> int:
    """The replica's live sessions plus this coordinator's picks its heartbeat does not show yet."""
    return r.load + (pending or {}).get(r.replica_id, 0)


def _order(r: Replica, pending: dict[str, int] | None):
    load = load_with_pending(r, pending)
    return (load / r.capacity if r.capacity else float(load), load, r.replica_id)


def least_loaded(candidates: Sequence[Replica], pending: dict[str, int] | None = None) -> Replica | None:
    """The least-utilised of ``candidates`` (ties: fewer sessions, then the replica id)."""
    return min(candidates, key=lambda r: _order(r, pending), default=None)


def compatible_draft(draft: Replica, target: Replica) -> bool:
    """A draft may serve a target only if they produce the same token events: the n-gram draft
    works on token ids of the sequence itself; a model draft needs the target's vocabulary size and
    tokenizer fingerprint, and a feature draft also the target's hidden size."""
    if draft.draft_kind == "ngram":
        return True
    if draft.vocab_size != target.vocab_size:
        return False
    if draft.draft_kind == "feature" and not (draft.feature_size and draft.feature_size == target.feature_size):
        return False  # it reads the target's hidden states: their width must match
    return bool(draft.fingerprint) and draft.fingerprint == target.fingerprint


def target_candidates(targets: Sequence[Replica], exclude: Sequence[str] = ()) -> list[Replica]:
    """The targets a new session may start on: not draining, not excluded."""
    return [t for t in targets if not t.draining and t.replica_id not in exclude]


def draft_candidates(drafts: Sequence[Replica], target: Replica, exclude: Sequence[str] = ()) -> list[Replica]:
    """The drafts a session on ``target`` may use: compatible with it, not draining, not excluded."""
    return [d for d in drafts if not d.draining and d.replica_id not in exclude and compatible_draft(d, target)]


def choose_target(
    targets: Sequence[Replica], exclude: Sequence[str] = (), pending: dict[str, int] | None = None
) -> Replica | None:
    """The least-utilised target that is not draining. ``pending``: sessions this coordinator
    started recently that the replicas' heartbeats do not show yet (ordering only: a full
    replica refuses the session itself, with RESOURCE_EXHAUSTED)."""
    return least_loaded(target_candidates(targets, exclude), pending)


def choose_draft(
    drafts: Sequence[Replica], target: Replica, exclude: Sequence[str] = (), pending: dict[str, int] | None = None
) -> Replica | None:
    """The least-utilised draft compatible with ``target`` that is not draining."""
    return least_loaded(draft_candidates(drafts, target, exclude), pending)
