"""The speculative loop, in process, over a draft engine and a target engine.

One step (design.md §2): propose (draft) -> verify (target, one pass) -> decide (here, with our
own uniforms) -> stop conditions -> commit to both (riding on the next propose/verify, applied
before anything is computed). The coordinator service runs the same step over gRPC; the pure parts
(``decide``, ``StopChecker``, ``StepStats``) are shared, not copied.
"""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Iterator, Protocol, Sequence

from .errors import MalformedProposalError, SpecdecError
from .kv import Commit
from .proposal import DraftProposal
from .rng import new_seed
from .sampling import SamplingParams
from .verify import StepStats, decide

log = logging.getLogger("specdec.generate")

FINISH_LENGTH, FINISH_STOP, FINISH_EOS = "length", "stop", "eos"


class StopChecker:
    """Applies max_new_tokens, EOS and stop strings to emitted tokens, one token at a time, so a
    stop inside a block cuts the block exactly there."""

    def __init__(self, params: SamplingParams, eos_token_ids: Sequence[int] = (), tokenizer=None):
        if params.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.params = params
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.tokenizer = tokenizer
        self.generated: list[int] = []
        self.finish_reason: str | None = None
        self._stop_at: int | None = None  # character index where the matched stop string starts

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def feed(self, tokens: Sequence[int]) -> list[int]:
        """Append tokens until a stop condition; return those that made it into the output."""
        taken: list[int] = []
        for token in tokens:
            if self.finished:
                break
            self.generated.append(int(token))
            taken.append(int(token))
            if not self.params.ignore_eos and token in self.eos:
                self.finish_reason = FINISH_EOS
            elif self.params.stop and self._find_stop() is not None:
                self.finish_reason = FINISH_STOP
            elif len(self.generated) >= self.params.max_new_tokens:
                self.finish_reason = FINISH_LENGTH
        return taken

    def finish(self, reason: str) -> None:
        if not self.finished:
            self.finish_reason = reason

    def _decode(self) -> str:
        return self.tokenizer.decode(self.generated, skip_special_tokens=True)

    def _find_stop(self) -> int | None:
        text = self._decode()
        hits = [i for i in (text.find(s) for s in self.params.stop) if i >= 0]
        self._stop_at = min(hits) if hits else None
        return self._stop_at

    def text(self) -> str:
        if self.tokenizer is None:
            return ""
        text = self._decode()
        return text[: self._stop_at] if self._stop_at is not None else text


class Drafter(Protocol):
    def prefill(self, session_id: str, prompt: Sequence[int], params: SamplingParams) -> None: ...
    def propose(self, session_id: str, step: int, k: int, commit: Commit | None = None) -> DraftProposal: ...
    def release(self, session_id: str) -> bool: ...


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    seed: int
    stats: StepStats = field(default_factory=StepStats)


class SpeculativeRun:
    """One request through the loop. Iterate :meth:`steps` for the tokens committed by each step
    (what a server streams), then read :meth:`result`."""

    def __init__(self, target, draft: Drafter | None, prompt: Sequence[int], params: SamplingParams,
                 num_speculative_tokens: int, eos_token_ids: Sequence[int] = (), tokenizer=None,
                 session_id: str | None = None):
        if num_speculative_tokens < 0:
            from .errors import InvalidArgumentError

            raise InvalidArgumentError("num_speculative_tokens", f"must be >= 0, got {num_speculative_tokens}")
        self.seed = params.seed if params.seed is not None else new_seed()
        self.params = params.with_seed(self.seed)
        self.target = target
        self.draft = draft if num_speculative_tokens > 0 else None
        self.k = num_speculative_tokens
        self.prompt = [int(t) for t in prompt]
        self.session_id = session_id or uuid.uuid4().hex
        self.stopper = StopChecker(self.params, eos_token_ids, tokenizer)
        self.stats = StepStats()

    def _drop_draft(self, why: str) -> None:
        # The draft is an optimization: trouble with it never fails or changes the request.
        log.warning("session %s: draft disabled (%s); continuing with target-only steps", self.session_id, why)
        self.stats.draft_fallbacks += 1
        draft, self.draft = self.draft, None
        try:
            draft.release(self.session_id)
        except Exception:  # noqa: BLE001 - best effort cleanup of a peer we no longer trust
            pass

    def steps(self) -> Iterator[list[int]]:
        started = time.perf_counter()
        sid = self.session_id
        self.target.prefill(sid, self.prompt, self.params)
        sequence = list(self.prompt)
        target_len = draft_len = len(sequence)  # what each peer has been told is committed
        try:
            if self.draft is not None:
                try:
                    self.draft.prefill(sid, self.prompt, self.params)
                except SpecdecError as exc:
                    self._drop_draft(str(exc))
            step = 0
            context = self.target.context_length
            while not self.stopper.finished:
                room = context - len(sequence) - 1  # a step emits up to k + 1 tokens
                if room < 0:
                    self.stopper.finish(FINISH_LENGTH)
                    break
                step += 1
                proposal = DraftProposal([], [])
                k = min(self.k, room)
                if self.draft is not None and k > 0:
                    t0 = time.perf_counter()
                    try:
                        commit = Commit(step - 1, draft_len, tuple(sequence[draft_len:])) if draft_len < len(sequence) else None
                        proposal = self.draft.propose(sid, step, k, commit=commit)
                        draft_len = len(sequence)
                    except SpecdecError as exc:
                        self._drop_draft(str(exc))
                    self.stats.draft_seconds += time.perf_counter() - t0
                t0 = time.perf_counter()
                commit = Commit(step - 1, target_len, tuple(sequence[target_len:])) if target_len < len(sequence) else None
                try:
                    verdict = self.target.verify(sid, step, proposal.tokens, proposal.q, commit=commit)
                except MalformedProposalError as exc:
                    if not proposal.tokens:
                        raise
                    # The target refused the draft's block: drop the draft, verify nothing.
                    self._drop_draft(str(exc))
                    proposal = DraftProposal([], [])
                    verdict = self.target.verify(sid, step, [], [], commit=commit)
                target_len = len(sequence)
                self.stats.verify_seconds += time.perf_counter() - t0
                decision = decide(proposal.tokens, proposal.q_of_proposals(), verdict, self.seed, len(sequence))
                self.stats.record(decision, len(proposal))
                emitted = self.stopper.feed(decision.tokens)
                sequence.extend(emitted)
                yield emitted
        finally:
            self.target.release(sid)
            if self.draft is not None:
                self.draft.release(sid)
            self.stats.total_seconds = time.perf_counter() - started

    def result(self) -> GenerationResult:
        return GenerationResult(
            token_ids=list(self.stopper.generated),
            text=self.stopper.text(),
            finish_reason=self.stopper.finish_reason or FINISH_LENGTH,
            seed=self.seed,
            stats=self.stats,
        )


def speculative_generate(target, draft: Drafter | None, prompt: Sequence[int], params: SamplingParams,
                         num_speculative_tokens: int = 4, eos_token_ids: Sequence[int] = (), tokenizer=None,
                         session_id: str | None = None) -> GenerationResult:
    """Generate with speculative decoding in process; the output law is the target's alone."""
    run = SpeculativeRun(target, draft, prompt, params, num_speculative_tokens, eos_token_ids, tokenizer, session_id)
    for _ in run.steps():
        pass
    return run.result()
