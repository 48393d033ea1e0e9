"""The speculative loop: one implementation, used in process and by the coordinator service.

One step (docs/protocol.md): propose (draft) -> verify (target, one pass) -> decide (here, with our
own uniforms) -> stop conditions -> commit to both (riding on the next propose/verify, applied
before anything is computed). The loop talks to its peers through two small async interfaces,
:class:`DraftPeer` and :class:`TargetPeer`: in process they wrap the engines
(:class:`LocalDraft`, :class:`LocalTarget`); in the coordinator they are gRPC clients.

The draft is an optimization: any failure of it (error, timeout, malformed block) drops it for
the rest of the request and the loop continues with target-only steps; the output law is the
target's either way. Target failures propagate: without the target there is no answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

import torch

from specdec.engine.batching import PassLoad
from specdec.engine.commits import Commit
from specdec.errors import InvalidArgumentError, MalformedProposalError, PeerError
from specdec.exact.logprobs import TokenLogprob, emitted_logprobs
from specdec.exact.proposal import DraftProposal
from specdec.exact.rng import new_seed
from specdec.exact.sampling import SamplingParams
from specdec.exact.verify import StepDecision, TargetVerdict, decide, decide_invariant
from specdec.loop.adaptive_k import KPolicy, StepCost, make_policy
from specdec.loop.load_aware_k import DRAFT_CALL_SECONDS, BatchLoad, CostCurve, Costs, GoodputK, SpeculationRegime
from specdec.loop.pipelining import BranchBudget, PreDraft
from specdec.loop.stats import StepStats
from specdec.loop.stopping import FINISH_LENGTH, StopChecker
from specdec.telemetry.tracing import tracer

log = logging.getLogger("specdec.loop.generate")
T = TypeVar("T")

EMPTY = DraftProposal([], [])
# The most tokens of a forced run committed at once: each is a row of the next target pass.
FORCED_RUN_MAX = 16


class ConstraintFollower(Protocol):
    """The request's constraint, following its committed tokens (specdec.modeling.grammar.Matcher)."""

    def follow(self, generated: Sequence[int]) -> None: ...
    def forced(self, limit: int) -> list[int]: ...
    def admits(self, tokens: list[int]) -> int: ...


def forced_run_limit(room: int, remaining: int) -> int:
    """How many of the tokens a constraint forces next are committed at once: within the
    context's ``room``, the request's ``remaining`` tokens and FORCED_RUN_MAX -- and no more are
    computed, each costing a mask over the whole vocabulary. Each is the only token the
    constraint admits at its position, so the target's constrained law there is a point mass on
    it: verifying it (as a proposal with a one-hot q) would accept it with probability one, and
    drawing it needs no randomness. The loop commits the run without a draft call or a target
    pass; the next pass computes its KV among its rows, and every other position keeps its keyed
    draws."""
    return max(0, min(room, remaining, FORCED_RUN_MAX))


def cut_where_forbidden(proposal: DraftProposal, admitted: int) -> DraftProposal:
    """``proposal`` up to its first token the constraint forbids (``admitted`` of its tokens
    pass), where that token's q is one-hot: such a token is a function of the block before it
    (an n-gram lookup), so ending the block there is a stop the draft could have made itself and
    the law stays exact. A sampled token is left in: cutting on a draw would bias the step (the
    verifier rejects it, exactly)."""
    if admitted >= len(proposal) or not proposal.q or len(proposal.q[admitted]) != 1:
        return proposal
    return DraftProposal(proposal.tokens[:admitted], proposal.q[:admitted])


# -- peers -----------------------------------------------------------------------------------
class DraftPeer(Protocol):
    """A draft replica as the loop uses it. A class that subclasses this one explicitly inherits
    the defaults of the members a draft need not report (in process, nothing reported)."""

    # A feature draft reads the target's hidden states: ``start`` then gets the prompt's
    # (``features``, [len(prompt) - 1, H]) and every commit the feature before each new token.
    wants_features: bool = False
    in_process: bool = False  # an engine in this process: a call costs no round trip

    async def start(
        self, session_id: str, prompt: Sequence[int], params: SamplingParams, features: torch.Tensor | None = None
    ) -> None: ...
    async def propose(
        self,
        session_id: str,
        step: int,
        k: int,
        commit: Commit | None,
        assumed: Sequence[int] = (),
        rejections: int = 0,
    ) -> DraftProposal:
        """The block of up to ``k`` after the committed tokens (``commit`` applied first) and,
        for a pre-draft, ``assumed`` ones not committed, with ``rejections`` branches
        (specdec.loop.pipelining)."""
        ...

    async def release(self, session_id: str) -> None: ...

    async def cost_curve(self) -> CostCurve | None:
        """Its batched pass's cost (the load-aware policy's model); None: not reported."""
        return None

    def take_load(self, session_id: str) -> PassLoad | None:
        """The pass that served the session's last call; None: not reported."""
        return None


class TargetPeer(Protocol):
    """A target replica as the loop uses it. A class that subclasses this one explicitly inherits
    the defaults of the members a target need not report (no batching, no prefix cache)."""

    context_length: int
    last_live_sessions: int = 0  # the replica's live sessions as it last reported them
    regime: SpeculationRegime | None = None  # its sessions' shared measure of whether speculation pays

    async def start(
        self, session_id: str, prompt: Sequence[int], params: SamplingParams, return_features: bool = False
    ) -> torch.Tensor | None: ...
    async def verify(
        self, session_id: str, step: int, proposal: DraftProposal, commit: Commit | None, return_features: bool = False
    ) -> TargetVerdict: ...
    async def release(self, session_id: str) -> None: ...

    async def cost_curve(self) -> CostCurve | None:
        """Its batched pass's cost (the load-aware policy's model); None: not reported."""
        return None

    def take_load(self, session_id: str) -> PassLoad | None:
        """The pass that served the session's last call; None: not reported."""
        return None

    def take_cached_tokens(self, session_id: str) -> int:
        """The prompt positions the session's start copied from a prefix cache."""
        return 0


class Failover(Protocol):
    """Supplies replacement replicas when a peer fails (the coordinator's registry does this)."""

    async def replace_draft(self, failed: DraftPeer | None) -> DraftPeer | None: ...
    async def replace_target(self, failed: TargetPeer) -> TargetPeer | None: ...


# A target failing with one of these is gone (or lost our session): move to another replica.
TARGET_LOST = frozenset({"UNAVAILABLE", "NOT_FOUND", "DEADLINE_EXCEEDED", "CANCELLED"})
MAX_FAILOVERS = 3


class LocalDraft(DraftPeer):
    """A draft engine in this process (engine calls run inline; ``await`` lets sessions interleave)."""

    in_process = True

    def __init__(self, engine):
        self.engine = engine
        self.wants_features = engine.kind == "feature"

    async def start(self, session_id, prompt, params, features=None):
        if self.wants_features:
            self.engine.prefill(session_id, prompt, params, features)
        else:
            self.engine.prefill(session_id, prompt, params)

    async def propose(self, session_id, step, k, commit, assumed=(), rejections=0):
        await asyncio.sleep(0)
        return self.engine.propose(session_id, step, k, commit, assumed, rejections)

    async def release(self, session_id):
        self.engine.release(session_id)


class LocalTarget(TargetPeer):
    def __init__(self, engine):
        self.engine = engine
        self.context_length = engine.context_length

    async def start(self, session_id, prompt, params, return_features=False):
        return self.engine.prefill(session_id, prompt, params, return_features)

    async def verify(self, session_id, step, proposal, commit, return_features=False):
        await asyncio.sleep(0)
        return self.engine.verify(session_id, step, proposal.tokens, proposal.q, commit, return_features)

    async def release(self, session_id):
        self.engine.release(session_id)


async def _release_quietly(peer, session_id: str) -> None:
    if peer is None:
        return
    with contextlib.suppress(Exception):  # best-effort cleanup of a peer we no longer trust
        await peer.release(session_id)


# -- the loop --------------------------------------------------------------------------------
@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    seed: int
    stats: StepStats = field(default_factory=StepStats)


class SpeculativeRun:
    """One request through the loop. ``async for tokens in run.steps()`` yields the tokens
    committed by each step (what a server streams); then read :meth:`result`."""

    def __init__(
        self,
        target: TargetPeer,
        draft: DraftPeer | None,
        prompt: Sequence[int],
        params: SamplingParams,
        num_speculative_tokens: int,
        eos_token_ids: Sequence[int] = (),
        tokenizer=None,
        session_id: str | None = None,
        failover: Failover | None = None,
        committed: Sequence[int] = (),
        committed_steps: Sequence[int] | None = None,
        adaptive: bool = False,
        step_cost: StepCost = StepCost(),
        load_aware: bool = False,
        constraint: ConstraintFollower | None = None,
        forced_runs: bool = True,
        pipeline: bool = False,
        pipeline_branches: int | None = None,
        contention: float = 0.0,
    ):
        """``committed``: tokens this request already committed in an earlier run (a resumed or
        taken-over request continues from them, with the same seed, hence the same tokens);
        ``committed_steps``: how many of them each earlier step committed (an adaptive run
        rebuilds its state from them). ``adaptive``: a step proposes ``num_speculative_tokens``
        while the request's blocks pay for themselves, else none (specdec.loop.adaptive_k).
        ``load_aware`` (with ``adaptive``): instead, each step's k in 0 .. num_speculative_tokens
        maximises the batch's expected goodput from the load the replicas report
        (specdec.loop.load_aware_k), where the target reports its pass cost; seeded sampled output
        then depends on the load. ``constraint``: a matcher of the request's structured-output
        constraint, which the loop follows to end an n-gram block at a token it forbids, and with
        ``forced_runs`` to commit the runs it forces without a draft call or a target pass
        (:func:`forced_run_limit`); None: neither. ``pipeline``: while the target verifies a block, the
        draft drafts the next one for the branch "all accepted, bonus as the draft guesses"
        (specdec.loop.pipelining; not for a feature draft, which needs the verdict's features),
        with as many rejection branches as fit in a verify, or ``pipeline_branches`` every time.
        ``contention``: what the load-aware regime assumes of the machine before it has measured it
        (load_aware_k.SHARED_HARDWARE_CONTENTION: the draft and target share their hardware, 0: apart;
        load_aware_k.SpeculationRegime.contention)."""
        if num_speculative_tokens < 0:
            raise InvalidArgumentError("num_speculative_tokens", f"must be >= 0, got {num_speculative_tokens}")
        if committed_steps is None:
            if committed and adaptive:
                raise ValueError("an adaptive run resumed from committed tokens needs committed_steps")
            committed_steps = ()
        elif sum(committed_steps) != len(committed):
            raise ValueError(f"committed_steps add up to {sum(committed_steps)}, not {len(committed)} tokens")
        self.seed = params.seed if params.seed is not None else new_seed()
        # every session of the run, started when it may, is told where the prompt ends and
        # which ids min_tokens keeps out
        self.params = replace(
            params.with_seed(self.seed),
            prompt_length=len(prompt),
            eos_token_ids=params.eos_token_ids or tuple(int(t) for t in eos_token_ids),
        )
        self.target = target
        self.draft = draft if num_speculative_tokens > 0 else None
        self.policy: KPolicy = make_policy(num_speculative_tokens, adaptive, step_cost)
        self.goodput: GoodputK | None = None  # the policy, once it is the load-aware one
        # A forced run is committed without a target pass: it has no logprob rows and no target
        # features for a feature draft, so those requests verify every token.
        wants_features = draft is not None and draft.wants_features
        self.constraint = constraint
        self.forced_runs = forced_runs and params.logprobs is None and not wants_features
        self.pipeline = pipeline and self.draft is not None and not wants_features
        self._ahead: PreDraft | None = None  # the draft's blocks past the block last verified
        self.budget = BranchBudget(num_speculative_tokens, pipeline_branches)  # how much fits in a verify
        self.prompt = [int(t) for t in prompt]
        self.context_length = target.context_length
        # the policy chose k at the steps the constraint forced nothing; only those replay (at
        # the start of steps(): finding them follows the constraint, which is off the event loop)
        self._committed = [int(t) for t in committed]
        self.committed_steps = list(committed_steps)
        self.adaptive = adaptive and num_speculative_tokens > 0
        self.load_aware = load_aware and self.adaptive
        self.contention = contention
        self.k_max = num_speculative_tokens
        self.draft_load: PassLoad | None = None  # the latest draft pass this request was in
        self.session_id = session_id or uuid.uuid4().hex
        self.stopper = StopChecker(self.params, eos_token_ids, tokenizer)
        self.stopper.resume(committed)
        self.stats = StepStats()
        self.stats.policy = "load_aware" if self.load_aware else "adaptive" if self.adaptive else "fixed"
        self.step = 0
        self.failover = failover
        self.sequence = self.prompt + [int(t) for t in committed]  # prompt + committed tokens
        self.target_len = self.draft_len = len(self.sequence)  # what each peer was told is committed
        self.draft_started = False  # a draft session exists for this run (started by the first block)
        # Starts whose caller was cancelled mid-call: the call runs on to its end (a session made
        # on the replica after the cancellation is still ours to free), and _release_all frees it.
        self._orphaned_starts: list[tuple[Any, asyncio.Future]] = []
        self.token_logprobs: list[TokenLogprob] = []  # per generated token, when params.logprobs is set
        # For a feature draft: the target's hidden state after each committed token but the last,
        # [len(sequence) - 1, H] (row t precedes token t + 1); None when no draft needs them.
        self.features: torch.Tensor | None = None

    @property
    def wants_features(self) -> bool:
        return self.draft is not None and self.draft.wants_features

    async def _start_on(self, peer: Any, call: Any) -> Any:
        """Await a peer's start call so that a cancellation of this request (a client gone, a
        deadline) does not cut it off mid-flight: the replica may make the session anyway, and
        nothing would free it before its TTL. A cancelled start is left to _release_all."""
        pending = asyncio.ensure_future(call)
        try:
            return await asyncio.shield(pending)
        except asyncio.CancelledError:
            self._orphaned_starts.append((peer, pending))
            raise

    async def _start_target(self, target: TargetPeer) -> None:
        call = target.start(self.session_id, self.sequence, self.params, self.wants_features)
        features = await self._start_on(target, call)
        if self.wants_features:
            self.features = features
        cached = target.take_cached_tokens(self.session_id)
        if not self.stats.target_passes:  # the run's first start (not a failover's re-prefill)
            self.stats.cached_prompt_tokens = min(cached, len(self.prompt))

    async def _start_draft(self, draft: DraftPeer) -> None:
        if draft.wants_features:
            call = draft.start(self.session_id, self.sequence, self.params, self.features)
        else:
            call = draft.start(self.session_id, self.sequence, self.params)
        await self._start_on(draft, call)
        self.draft_started, self.draft_len = True, len(self.sequence)

    async def _start_draft_or_drop(self) -> None:
        assert self.draft is not None
        try:
            await self._start_draft(self.draft)
        except Exception as exc:  # noqa: BLE001 - the draft may fail, the request may not
            await self._drop_draft(f"start: {exc}")

    @property
    def _draft_starts_late(self) -> bool:
        """A load-aware run may never speculate (under load): its draft session, and the draft's
        prefill of the prompt (CPU the target's passes need on a shared machine), wait for its
        first block. The draft's draws are keyed by position, so a late start proposes the same."""
        return self.load_aware and not self.wants_features

    async def _drop_draft(self, why: str) -> None:
        """The draft failed: move the session to another draft replica (re-prefilled from the
        committed tokens) if the failover offers one, else continue with target-only steps."""
        failed, self.draft, self._ahead = self.draft, None, None
        await _release_quietly(failed, self.session_id)
        while self.failover is not None and self.stats.draft_failovers < MAX_FAILOVERS:
            replacement = await self.failover.replace_draft(failed)
            if replacement is None:
                break
            self.stats.draft_failovers += 1
            try:
                await self._start_draft(replacement)
            except Exception as exc:  # noqa: BLE001
                why, failed = f"{why}; replacement failed too: {exc}", replacement
                continue
            log.warning("session %s: draft failed (%s); moved to another replica", self.session_id, why)
            self.draft, self.draft_len = replacement, len(self.sequence)
            return
        log.warning("session %s: draft dropped (%s); continuing with target-only steps", self.session_id, why)
        self.stats.draft_fallbacks += 1

    async def _replace_target(self, exc: Exception) -> None:
        """The target replica is gone: re-prefill the session on another one, or give up."""
        code = getattr(exc, "code", "")
        if self.failover is None or code not in TARGET_LOST or self.stats.target_failovers >= MAX_FAILOVERS:
            raise exc
        failed, self.target = self.target, None  # type: ignore[assignment]  # while replaced; _release_all skips None
        await _release_quietly(failed, self.session_id)
        replacement = await self.failover.replace_target(failed)
        if replacement is None:
            raise exc
        self.stats.target_failovers += 1
        log.warning("session %s: target failed (%s); moving to another replica", self.session_id, exc)
        await self._start_target(replacement)
        self.target, self.target_len = replacement, len(self.sequence)

    async def steps(self) -> AsyncGenerator[list[int], None]:
        started = time.perf_counter()
        sid = self.session_id
        regime = self.target.regime if self.load_aware else None
        if regime is not None:
            regime.request_started()
        try:
            self.committed_steps = await self._off_loop(self._policy_steps, self._committed, self.committed_steps)
            self.policy.replay(self.committed_steps)
            if regime is not None:
                regime.prefill_started()
            try:  # both prefills: a burst of them spoils the regime's window (specdec.loop.load_aware_k)
                try:
                    await self._start_target(self.target)
                except PeerError as exc:
                    await self._replace_target(exc)
                if self.draft is not None and not self._draft_starts_late:
                    await self._start_draft_or_drop()
            finally:
                if regime is not None:
                    regime.prefill_finished()
            if self.load_aware:
                await self._use_load_aware_policy()
            last_start = 0.0
            while not self.stopper.finished:
                room = self.target.context_length - len(self.sequence) - 1  # a step emits up to k + 1
                if room < 0:
                    self.stopper.finish(FINISH_LENGTH)
                    break
                forced = await self._off_loop(self._forced_run, list(self.stopper.generated), room)
                if forced:  # committed as they are: no draft, no pass, not a step of the policy
                    self.step += 1  # (a number of its own: the next step's commit carries the run)
                    emitted = self.stopper.feed(forced)
                    self.sequence.extend(emitted)
                    self.stats.forced_tokens += len(emitted)
                    yield emitted
                    continue
                self.step += 1
                # The span ends before the yield: a span must not stay current across a suspension.
                with tracer().start_as_current_span("specdec.step") as span:
                    span.set_attribute("specdec.session_id", sid)
                    span.set_attribute("specdec.step", self.step)
                    k = self.policy.next_k()
                    step_start = time.perf_counter()
                    cycle, last_start = (step_start - last_start if last_start else 0.0), step_start
                    draft_before = self.stats.draft_seconds
                    proposal = await self._propose(min(k, room))
                    proposal, verdict = await self._verify_pipelined(proposal)
                    proposing = self.stats.draft_seconds - draft_before if len(proposal) else 0.0
                    decision = self._decide(proposal, verdict)
                    # What the policy chose, not what the draft managed: a replay from the
                    # committed tokens (which cannot see a short or dropped block) agrees.
                    self.policy.observe(k, decision.num_accepted)
                    self._observe_load(k, cycle, proposing)
                    self.stats.record_choice(k)
                    self.stats.record(decision, len(proposal))
                    emitted = self.stopper.feed(decision.tokens)
                    if self.params.logprobs is not None:
                        self._keep_logprobs(verdict, emitted)
                    self._keep_features(verdict, len(emitted))
                    self.sequence.extend(emitted)
                    span.set_attribute("specdec.k", len(proposal))
                    span.set_attribute("specdec.accepted", decision.num_accepted)
                    span.set_attribute(
                        "specdec.first_rejected", -1 if decision.rejected_at is None else decision.rejected_at
                    )
                    span.set_attribute("specdec.emitted", len(emitted))
                yield emitted
        finally:
            if regime is not None:
                regime.request_finished()
            self.stats.total_seconds = time.perf_counter() - started
            await self._release_all()

    async def _off_loop(self, work: Callable[..., T], *args) -> T:
        """``work`` on a thread where it follows the constraint (masks over the whole vocabulary
        may take a while; the event loop serves every other request meanwhile), else here."""
        if self.constraint is None:
            return work(*args)
        return await asyncio.to_thread(work, *args)

    def _forced_run(self, generated: Sequence[int], room: int) -> list[int]:
        """The run the constraint forces after ``generated`` (empty: a step of the policy and the
        draft comes next). A pure function of the committed tokens, so a replay finds the same."""
        limit = forced_run_limit(room, self.params.max_new_tokens - len(generated))
        if self.constraint is None or not self.forced_runs or limit <= 0:
            return []
        self.constraint.follow(generated)
        return [int(t) for t in self.constraint.forced(limit)]

    def _policy_steps(self, committed: list[int], committed_steps: list[int]) -> list[int]:
        """Of the chunks that committed ``committed`` (tokens per step or forced run), the steps
        whose k the policy chose: a forced run is skipped, as it was when it ran."""
        if self.constraint is None or not self.forced_runs:
            return committed_steps
        chosen, at = [], 0
        for n in committed_steps:
            room = self.context_length - (len(self.prompt) + at) - 1
            if not self._forced_run(committed[:at], room):
                chosen.append(n)
            at += n
        return chosen

    def _decide(self, proposal: DraftProposal, verdict: TargetVerdict) -> StepDecision:
        """The exact rule of the session's mode: invariant sampling matches the proposals against
        the target's Gumbel-max tokens; otherwise rejection sampling with our own uniforms."""
        if self.params.invariant:
            return decide_invariant(proposal.tokens, verdict)
        return decide(proposal.tokens, proposal.q_of_proposals(), verdict, self.seed, len(self.sequence))

    async def _use_load_aware_policy(self) -> None:
        """Switch to the goodput policy where the target reports its pass cost (a replica that
        does not batch reports none: the request keeps the adaptive policy)."""
        target_curve = await self.target.cost_curve()
        if target_curve is None:
            self.load_aware = False
            self.stats.policy = "adaptive"
            return
        draft_curve, call = None, DRAFT_CALL_SECONDS
        if self.draft is not None:
            draft_curve = await self.draft.cost_curve()
            call = 0.0 if self.draft.in_process else call  # the n-gram draft: no round trip
        regime = self.target.regime
        costs = Costs(target_curve, draft_curve, call)
        self.policy = self.goodput = GoodputK(self.k_max, costs, regime=regime, contention=self.contention)
        self.goodput.replay(self.committed_steps)
        # The first step decides for the load the request joins, as the replica last reported it
        # (that report most likely counts this session already), not for an idle replica: that
        # would make every new request under load prefill the draft and speculate once.
        live = self.target.last_live_sessions
        if live > 1:
            self.goodput.observe_load(BatchLoad(other_live=live - 1))

    def _observe_load(self, k: int, cycle: float, proposing: float) -> None:
        """Tell a load-aware policy what this step saw of the batch."""
        if not self.load_aware or self.goodput is None:
            return
        target_load = self.target.take_load(self.session_id)
        draft_load = self.draft.take_load(self.session_id) if self.draft is not None else None
        if draft_load is not None:
            self.draft_load = draft_load
        others = self.draft_load.sessions - 1 if self.draft_load is not None else 0
        if target_load is None:
            load = BatchLoad(other_drafting=others, cycle_seconds=cycle, last_k=k, propose_seconds=proposing)
        else:
            load = BatchLoad(
                other_rows=max(0, target_load.size - (k + 1)),
                other_sessions=max(0, target_load.sessions - 1),
                other_drafting=max(0, others),
                other_live=max(0, target_load.live_sessions - 1),
                cycle_seconds=cycle,
                last_k=k,
                propose_seconds=proposing,
            )
        self.goodput.observe_load(load)

    async def _propose(self, k: int) -> DraftProposal:
        """The draft's block of up to ``k`` (EMPTY without a draft); a draft that fails is dropped.
        Where the draft already drafted it while the last block was verified, that block."""
        sid, step, proposal = self.session_id, self.step, EMPTY
        ahead, self._ahead = self._ahead, None
        if ahead is not None and self.draft is not None and k > 0:
            found = ahead.block_for(self.sequence, k)
            if found is not None:
                block, rejected = found
                self.stats.predraft_hits += 1
                self.stats.predraft_rejection_hits += rejected
                return await self._off_loop(self._cut_forbidden, block)
        if self.draft is not None and k > 0 and not self.draft_started:
            # (its prefill is not a proposal's time, nor -- a burst of prefills -- the regime's)
            regime = self.target.regime if self.load_aware else None
            if regime is not None:
                regime.prefill_started()
            try:
                await self._start_draft_or_drop()
            finally:
                if regime is not None:
                    regime.prefill_finished()
        t0 = time.perf_counter()
        # Retried on a replacement replica: the step must propose exactly what the lost replica
        # would have (same draws), or the tokens would differ from an undisturbed run.
        while self.draft is not None and k > 0:
            try:
                commit = self._commit(self.draft_len, with_features=self.wants_features)
                proposal = await self.draft.propose(sid, step, k, commit)
                self.draft_len = len(self.sequence)
                if len(proposal) > k:
                    raise MalformedProposalError("proposals", f"{len(proposal)} tokens for k={k}")
                if proposal.tokens and proposal.carries_q == self.params.invariant:
                    raise MalformedProposalError("q", "the draft's block does not match the session's sampling mode")
                break
            except Exception as exc:  # noqa: BLE001 - see module docstring
                proposal = EMPTY
                await self._drop_draft(f"propose: {exc}")
        self.stats.draft_seconds += time.perf_counter() - t0
        return await self._off_loop(self._cut_forbidden, proposal)

    def _cut_forbidden(self, proposal: DraftProposal) -> DraftProposal:
        if self.constraint is not None and proposal.tokens:  # an n-gram block's forbidden tail
            self.constraint.follow(self.stopper.generated)
            proposal = cut_where_forbidden(proposal, self.constraint.admits(proposal.tokens))
        return proposal

    async def _verify_pipelined(self, proposal: DraftProposal) -> tuple[DraftProposal, TargetVerdict]:
        """:meth:`_verify`, with the draft drafting past ``proposal`` meanwhile where the run
        pipelines (the wait for that pre-draft after the verdict counts as draft time)."""
        if not (self.pipeline and self.draft is not None and proposal.tokens):
            return await self._verify(proposal)
        rejections = self.budget.rejections(len(proposal))
        if rejections is None:  # not even the chain past the block fits in a verify now
            return await self._verify(proposal)
        ahead = asyncio.ensure_future(self._predraft(self.draft, proposal, rejections))
        verify_before = self.stats.verify_seconds
        try:
            proposal, verdict = await self._verify(proposal)
        except BaseException:
            ahead.cancel()
            await asyncio.gather(ahead, return_exceptions=True)
            raise
        t0 = time.perf_counter()
        predraft = await ahead
        self.stats.draft_seconds += time.perf_counter() - t0
        if predraft is not None:
            self.budget.observe(rejections, predraft[1], self.stats.verify_seconds - verify_before)
        # a block the target refused (and the draft with it) has no branch to follow
        self._ahead = predraft[0] if predraft is not None and self.draft is not None and proposal.tokens else None
        return proposal, verdict

    async def _predraft(
        self, draft: DraftPeer, proposal: DraftProposal, rejections: int
    ) -> tuple[PreDraft, float] | None:
        """The draft's blocks past ``proposal`` for the next step (specdec.loop.pipelining): the
        all-accepted chain and ``rejections`` rejection branches, and the seconds they took. A
        failure here loses only the pre-draft: the next step's own propose meets it and drops
        the draft the usual way."""
        commit = self._commit(self.draft_len)
        base_len = len(self.sequence)
        t0 = time.perf_counter()
        self.stats.predrafts += 1
        with tracer().start_as_current_span("specdec.predraft") as span:
            span.set_attribute("specdec.step", self.step + 1)
            try:
                drafted = await draft.propose(
                    self.session_id, self.step + 1, self.k_max + 1, commit, proposal.tokens, rejections
                )
            except Exception as exc:  # noqa: BLE001 - see the docstring
                log.debug("session %s: pre-draft failed: %s", self.session_id, exc)
                return None
            finally:
                seconds = time.perf_counter() - t0
                self.stats.predraft_seconds += seconds
            span.set_attribute("specdec.proposed", len(drafted))
            span.set_attribute("specdec.rejection_branches", len(drafted.branches))
        if draft is self.draft:
            self.draft_len = base_len
        if (drafted.tokens and drafted.carries_q == self.params.invariant) or len(drafted) > self.k_max + 1:
            return None  # malformed: not used (the next propose checks the draft again)
        return PreDraft(base_len, tuple(proposal.tokens), drafted), seconds

    async def _verify(self, proposal: DraftProposal) -> tuple[DraftProposal, TargetVerdict]:
        """The target's verdict on ``proposal`` (the block it verified: a drafted block the target
        refuses drops the draft and verifies none), moving to another target replica if it is lost."""
        sid, step = self.session_id, self.step
        t0 = time.perf_counter()
        while True:
            commit = self._commit(self.target_len)
            try:
                verdict = await self.target.verify(sid, step, proposal, commit, self.wants_features)
                break
            except MalformedProposalError as exc:
                if not proposal.tokens:
                    raise
                # The target refused the draft's block: drop this draft, verify nothing.
                await self._drop_draft(f"target refused its block: {exc}")
                proposal = EMPTY
            except PeerError as exc:
                await self._replace_target(exc)  # raises when there is nowhere to go
        self.target_len = len(self.sequence)
        self.stats.verify_seconds += time.perf_counter() - t0
        return proposal, verdict

    def _keep_logprobs(self, verdict: TargetVerdict, emitted: Sequence[int]) -> None:
        """The emitted tokens' log-probabilities, from the rows of the verify pass that
        committed them (specdec.exact.logprobs)."""
        if verdict.logprobs is None:
            raise PeerError("UNAVAILABLE", "the target replica returned no logprobs (an older version?)")
        self.token_logprobs.extend(emitted_logprobs(verdict.logprobs, emitted))

    def _keep_features(self, verdict: TargetVerdict, emitted: int) -> None:
        """Row i of the block's features precedes the i-th emitted token: keep one per token."""
        if self.features is None or not emitted:
            return
        if verdict.features is None or verdict.features.shape[0] < emitted:
            self.features = None  # incomplete from here on: a feature draft can no longer be fed
            return
        self.features = torch.cat((self.features, verdict.features[:emitted].to(self.features.dtype)))

    def _commit(self, peer_len: int, with_features: bool = False) -> Commit | None:
        """Everything committed since the peer last heard, as the previous step's commit (with
        the target's feature before each of those tokens, for a feature draft)."""
        if peer_len >= len(self.sequence):
            return None
        features = None
        if with_features and self.features is not None:
            features = self.features[peer_len - 1 : len(self.sequence) - 1]
        return Commit(self.step - 1, peer_len, tuple(self.sequence[peer_len:]), features)

    async def _release_all(self) -> None:
        # Shielded: a cancelled request must still free its caches on every service.
        await asyncio.shield(self._release_everywhere())

    async def _release_everywhere(self) -> None:
        peers = [p for p in (self.target, self.draft if self.draft_started else None) if p is not None]
        if self._orphaned_starts:  # wait for cut-off starts to land, then free what they made
            await asyncio.gather(*(start for _, start in self._orphaned_starts), return_exceptions=True)
            made = [p for p, start in self._orphaned_starts if not start.cancelled() and start.exception() is None]
            peers += [p for p in made if all(p is not q for q in peers)]
        await asyncio.gather(*(p.release(self.session_id) for p in peers), return_exceptions=True)

    def result(self) -> GenerationResult:
        return GenerationResult(
            token_ids=list(self.stopper.generated),
            text=self.stopper.text(),
            finish_reason=self.stopper.finish_reason or FINISH_LENGTH,
            seed=self.seed,
            stats=self.stats,
        )


async def generate_async(
    target: TargetPeer,
    draft: DraftPeer | None,
    prompt: Sequence[int],
    params: SamplingParams,
    num_speculative_tokens: int = 4,
    eos_token_ids: Sequence[int] = (),
    tokenizer=None,
    session_id: str | None = None,
    adaptive: bool = False,
    step_cost: StepCost = StepCost(),
    load_aware: bool = False,
    constraint: ConstraintFollower | None = None,
    forced_runs: bool = True,
    pipeline: bool = False,
    pipeline_branches: int | None = None,
) -> GenerationResult:
    run = SpeculativeRun(
        target,
        draft,
        prompt,
        params,
        num_speculative_tokens,
        eos_token_ids,
        tokenizer,
        session_id,
        adaptive=adaptive,
        step_cost=step_cost,
        load_aware=load_aware,
        constraint=constraint,
        forced_runs=forced_runs,
        pipeline=pipeline,
        pipeline_branches=pipeline_branches,
    )
    async for _ in run.steps():
        pass
    return run.result()


def speculative_generate(
    target,
    draft,
    prompt: Sequence[int],
    params: SamplingParams,
    num_speculative_tokens: int = 4,
    eos_token_ids: Sequence[int] = (),
    tokenizer=None,
    session_id: str | None = None,
    adaptive: bool = False,
    step_cost: StepCost = StepCost(),
    constraint: ConstraintFollower | None = None,
    forced_runs: bool = True,
    pipeline: bool = False,
    pipeline_branches: int | None = None,
) -> GenerationResult:
    """In process, over engines: generate with speculative decoding; the law is the target's.
    ``constraint``: a matcher of ``params.constraint`` for the loop (SpeculativeRun)."""
    target_peer = LocalTarget(target)
    draft_peer = LocalDraft(draft) if draft is not None else None
    return asyncio.run(
        generate_async(
            target_peer,
            draft_peer,
            prompt,
            params,
            num_speculative_tokens,
            eos_token_ids,
            tokenizer,
            session_id,
            adaptive,
            step_cost,
            constraint=constraint,
            forced_runs=forced_runs,
            pipeline=pipeline,
            pipeline_branches=pipeline_branches,
        )
    )
