"""The n-gram (prompt lookup) draft: no model, proposes by matching the last n tokens.

It looks for the most recent earlier occurrence of the sequence's last n tokens (n from
``max_n`` down to ``min_n``) in prompt + output and proposes the tokens that followed it. The
proposal is deterministic, so it ships a one-hot q, which keeps the verifier exact for any
sampling settings (acceptance of y is then simply p(y)); an invariant-sampling session ships no q
(a deterministic proposal is its own Gumbel-max token under any noise). With no match it proposes nothing and the
step is a plain target step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from specdec.engine.commits import Commit, CommitLedger
from specdec.engine.sessions import WholeDraftWorks
from specdec.errors import (
    InvalidArgumentError,
    ResourceExhaustedError,
    SessionExistsError,
    SessionNotFoundError,
)
from specdec.exact.proposal import DraftProposal, check_assumed
from specdec.exact.sampling import SamplingParams
from specdec.exact.sparse import SparseDist


def ngram_lookup(tokens: Sequence[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = list(tokens[length - n :])
        # Scan right to left so the most recent match wins; the match must end before the suffix.
        for start in range(length - n - 1, -1, -1):
            if list(tokens[start : start + n]) == suffix:
                follow = list(tokens[start + n : start + n + k])
                if follow:
                    return follow
    return []


@dataclass
class _NgramSession:
    session_id: str
    tokens: list[int]
    ships_q: bool = True  # False for an invariant-sampling session: its blocks are tokens alone
    last_used: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)
    ledger: CommitLedger = field(init=False)  # where the session stands in the commit protocol

    def __post_init__(self) -> None:
        self.ledger = CommitLedger(self.session_id)


class NgramDraft(WholeDraftWorks):  # a lookup runs no model: its works run whole
    kind = "ngram"
    feature_size = 0
    context_length = 0  # a lookup has no context limit

    def __init__(self, vocab_size: int, max_n: int = 3, min_n: int = 1, max_sessions: int = 4096):
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.vocab_size = vocab_size
        self.max_n, self.min_n = max_n, min_n
        self.max_sessions = max_sessions
        self.model_id = f"ngram(n={min_n}..{max_n})"
        self._sessions: dict[str, _NgramSession] = {}
        self._lock = threading.Lock()
        self.sessions_started = 0

    def _get(self, session_id: str) -> _NgramSession:
        try:
            session = self._sessions[session_id]
            session.last_used = time.monotonic()
            return session
        except KeyError:
            raise SessionNotFoundError(f"ngram draft: unknown session {session_id!r}") from None

    def prefill(self, session_id: str, prompt: Sequence[int], params: SamplingParams) -> None:
        if not prompt:
            raise InvalidArgumentError("prompt", "must contain at least one token")
        with self._lock:
            if session_id in self._sessions:
                raise SessionExistsError(f"ngram draft: session {session_id!r} already exists")
            if len(self._sessions) >= self.max_sessions:
                raise ResourceExhaustedError(
                    f"ngram draft: {len(self._sessions)} live sessions, the cap is {self.max_sessions}"
                )
            self._sessions[session_id] = _NgramSession(
                session_id, [int(t) for t in prompt], ships_q=not params.invariant
            )
            self.sessions_started += 1

    def devices(self) -> list[str]:
        return ["cpu"]  # a lookup runs on the host

    def propose(
        self,
        session_id: str,
        step: int,
        k: int,
        commit: Commit | None = None,
        assumed: Sequence[int] = (),
        rejections: int = 0,
    ) -> DraftProposal:
        """``assumed``: tokens taken as committed, not committed (specdec.engine.draft.DraftEngine.propose_work);
        ``rejections``: ignored (a lookup has no likeliest other token: no rejection branches)."""
        session = self._get(session_id)
        with session.lock:
            if commit is not None:
                self._commit(session, commit)
            session.ledger.check_step(step)
            history = session.tokens + check_assumed(assumed, self.vocab_size)
            tokens = ngram_lookup(history, k, self.max_n, self.min_n) if k > 0 else []
            return DraftProposal(tokens, [SparseDist.one_hot(t) for t in tokens] if session.ships_q else [])

    def _commit(self, session: _NgramSession, commit: Commit) -> None:
        if session.ledger.admits(commit, len(session.tokens)):
            session.tokens.extend(int(t) for t in commit.tokens)
            session.ledger.applied(commit)

    def commit(self, session_id: str, commit: Commit) -> None:
        session = self._get(session_id)
        with session.lock:
            self._commit(session, commit)

    def release(self, session_id: str) -> bool:
        with self._lock:
            return self._sessions.pop(session_id, None) is not None

    def expire_idle(self, ttl_seconds: float) -> list[str]:
        now = time.monotonic()
        stale = [sid for sid, s in list(self._sessions.items()) if now - s.last_used > ttl_seconds]
        return [sid for sid in stale if self.release(sid)]

    def stats(self) -> dict:
        return {"live_sessions": len(self._sessions), "kv_bytes": 0, "sessions_started": self.sessions_started}
