"""Draft/target engines and the in-process loop on tiny random Llamas."""

import asyncio

import pytest
import torch
from conftest import VOCAB

from specdec.engine.commits import Commit
from specdec.engine.draft import DraftEngine
from specdec.engine.ngram import NgramDraft, ngram_lookup
from specdec.engine.sessions import CacheLimits
from specdec.engine.target import TargetEngine
from specdec.errors import (
    InvalidArgumentError,
    MalformedProposalError,
    NonFiniteLogitsError,
    ResourceExhaustedError,
    SessionNotFoundError,
    StaleStepError,
)
from specdec.exact.proposal import DraftProposal
from specdec.exact.sampling import SamplingParams, probs_from_logits
from specdec.exact.sparse import SparseDist
from specdec.loop.generate import LocalDraft, LocalTarget, SpeculativeRun, generate_async, speculative_generate
from specdec.modeling.paged import BLOCK
from specdec.modeling.tiny import tiny_llama, word_tokenizer

PROMPT = [1, 2, 3, 4, 5]
GREEDY = SamplingParams(temperature=0.0, seed=1, max_new_tokens=24, ignore_eos=True)

TRANSFORMS = {
    "temperature": {"temperature": 0.7},
    "top_k": {"top_k": 5},
    "top_p": {"top_p": 0.7},
    "min_p": {"min_p": 0.1},
    "penalties": {"repetition_penalty": 1.5, "presence_penalty": 0.4, "frequency_penalty": 0.3},
    "logit_bias": {"logit_bias": {7: 2.0, 8: -3.0}},
    "greedy": {"temperature": 0.0},
}


@pytest.fixture
def target(target_model):
    return TargetEngine(target_model)


def full_sequence_probs(model, tokens, params, prompt_len):
    """Reference: the target's distribution at the end of ``tokens`` (its first ``prompt_len``
    the prompt), no cache at all."""
    from specdec.exact.sampling import token_counts

    vocab = model.config.vocab_size
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([tokens])).logits[0, -1]
    generated, prompt_seen = token_counts(tokens[prompt_len:], vocab), token_counts(tokens[:prompt_len], vocab) > 0
    return probs_from_logits(logits, params, generated, prompt_seen=prompt_seen)


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_each_transform_gives_the_same_distribution_on_both_sides(target_model, name):
    params = SamplingParams(seed=4, **TRANSFORMS[name])
    draft = DraftEngine(target_model, top_m=0, eps=0.0)  # no truncation: q is the full row
    target = TargetEngine(target_model)
    prompt = [3, 7, 3, 9, 7]
    draft.prefill("s", prompt, params)
    target.prefill("s", prompt, params)
    proposal = draft.propose("s", 1, 4)
    p_rows = target.target_probs("s", proposal.tokens)
    for i, q in enumerate(proposal.q):
        assert torch.allclose(q.to_dense(VOCAB).float(), p_rows[i], atol=1e-6), f"position {i}"
        # and position-wise penalties: row i saw the prompt plus proposals before i
        reference = full_sequence_probs(target_model, prompt + proposal.tokens[:i], params, len(prompt))
        assert torch.allclose(p_rows[i], reference, atol=1e-5)


def test_forced_rejection_at_index_0_leaves_no_stale_kv(target_model, target):
    params = SamplingParams(temperature=1.0, seed=2)
    target.prefill("s", PROMPT, params)
    committed = list(PROMPT)
    for step in (1, 2, 3):
        block = [10, 11, 12]
        verdict = target.verify("s", step, block, [SparseDist.one_hot(t) for t in block])
        token = next(t for t in range(VOCAB) if t != block[0])  # rejected at index 0: emit r != y_1
        target.commit("s", Commit(step, len(committed), (token,)))
        committed.append(token)
        session = target.store.get("s")
        assert session.cached == committed[:-1]  # the rejected block's KV is gone
        got = target.target_probs("s", [])[0]
        assert torch.allclose(got, full_sequence_probs(target_model, committed, params, len(PROMPT)), atol=1e-5)
        assert len(verdict.recovered) == 3


def test_stale_kv_would_be_detected(target_model):
    """Negative control for the test above: keeping KV of a rejected token changes the logits."""
    from transformers import DynamicCache

    params = SamplingParams(temperature=1.0)
    with torch.inference_mode():
        cache = DynamicCache(config=target_model.config)
        target_model(input_ids=torch.tensor([[*PROMPT, 10]]), cache=cache)  # KV for a rejected y_1
        stale = target_model(input_ids=torch.tensor([[20]]), cache=cache).logits[0, -1]
    stale_p = probs_from_logits(stale, params)
    assert not torch.allclose(stale_p, full_sequence_probs(target_model, [*PROMPT, 20], params, len(PROMPT)), atol=1e-3)


def test_all_accepted_block_emits_k_plus_one(target_model, target):
    draft = DraftEngine(target_model)  # q == p: everything accepted
    run = SpeculativeRun(
        LocalTarget(target), LocalDraft(draft), PROMPT, SamplingParams(seed=3, max_new_tokens=50, ignore_eos=True), 4
    )

    async def first_step():
        steps = run.steps()
        first = await steps.__anext__()
        await steps.aclose()  # abandoning the run releases the sessions
        return first

    assert len(asyncio.run(first_step())) == 5
    assert run.stats.accepted_tokens == 4 and run.stats.target_passes == 1
    assert len(target.store) == 0 and len(draft.store) == 0


@pytest.mark.parametrize("late", [False, True])
def test_a_request_cancelled_while_its_draft_prefills_frees_the_draft_session(target_model, target, late):
    """The draft's start is awaited when the request is cancelled (a client gone, a deadline):
    the session the replica makes anyway is freed, not left for the TTL. ``late``: the draft
    starts at the first block (the load-aware path) rather than beside the target's prefill."""
    draft = DraftEngine(target_model)
    entered, gate, replicas = asyncio.Event(), asyncio.Event(), []

    class SlowStartDraft(LocalDraft):
        async def start(self, session_id, prompt, params, features=None):
            # as over gRPC: the replica's work goes on when the caller stops waiting for it
            async def replica_side():
                await gate.wait()  # still prefilling when the cancellation arrives
                await LocalDraft.start(self, session_id, prompt, params, features)

            entered.set()
            replicas.append(asyncio.ensure_future(replica_side()))
            await asyncio.shield(replicas[-1])  # cancelling the call does not stop the replica

    async def cancelled_mid_start():
        run = SpeculativeRun(
            LocalTarget(target), SlowStartDraft(draft), PROMPT, SamplingParams(seed=3, max_new_tokens=20), 3
        )
        if late:
            run.load_aware = True  # the draft waits for the first block (no cost curve here: k stays 3)
        task = asyncio.ensure_future(run.steps().__anext__())
        await asyncio.wait_for(entered.wait(), 5)
        task.cancel()
        await asyncio.sleep(0.01)
        assert len(draft.store) == 0  # not made yet: the start is still waiting
        gate.set()  # the replica finishes its prefill after the request is gone
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.gather(*replicas, return_exceptions=True)
        for _ in range(20):  # the release that follows
            await asyncio.sleep(0.01)

    asyncio.run(cancelled_mid_start())
    assert len(target.store) == 0 and len(draft.store) == 0


def test_max_new_tokens_cuts_inside_a_block(target_model, target):
    draft = DraftEngine(target_model)
    result = speculative_generate(target, draft, PROMPT, SamplingParams(seed=3, max_new_tokens=3, ignore_eos=True), 5)
    assert len(result.token_ids) == 3
    assert result.finish_reason == "length"
    assert result.stats.target_passes == 1


def test_eos_inside_a_block_stops_there(target_model, target):
    draft = DraftEngine(target_model)
    base = speculative_generate(target, draft, PROMPT, GREEDY, 5).token_ids
    cut = next(i for i in range(1, len(base)) if base[i] not in base[:i])
    params = SamplingParams(temperature=0.0, seed=1, max_new_tokens=24)
    result = speculative_generate(target, draft, PROMPT, params, 5, eos_token_ids=[base[cut]])
    assert result.token_ids == base[: cut + 1]
    assert result.finish_reason == "eos"
    ignored = speculative_generate(target, draft, PROMPT, GREEDY, 5, eos_token_ids=[base[cut]])
    assert ignored.token_ids == base  # ignore_eos keeps going


def test_stop_string_cuts_tokens_and_text(target_model, target, draft_model):
    tokenizer = word_tokenizer(VOCAB)
    draft = DraftEngine(draft_model)
    base = speculative_generate(target, draft, PROMPT, GREEDY, 3, tokenizer=tokenizer).token_ids
    cut = next(i for i in range(2, len(base)) if base[i] not in base[:i])
    stop = f"w{base[cut]}"
    params = SamplingParams(temperature=0.0, seed=1, max_new_tokens=24, stop=(stop,), ignore_eos=True)
    result = speculative_generate(target, draft, PROMPT, params, 3, tokenizer=tokenizer)
    assert result.finish_reason == "stop"
    assert result.token_ids == base[: cut + 1]
    assert stop not in result.text.split()
    assert result.text.strip() == tokenizer.decode(base[:cut])


def test_same_seed_same_output_different_seeds_differ(target, draft_model):
    draft = DraftEngine(draft_model)
    params = SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True)
    outs = [speculative_generate(target, draft, PROMPT, params.with_seed(s), 3).token_ids for s in (1, 1, 2, 3, 4)]
    assert outs[0] == outs[1]
    assert len({tuple(o) for o in outs[1:]}) >= 3


def test_missing_seed_gets_one_and_reports_it(target, draft_model):
    draft = DraftEngine(draft_model)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)
    first = speculative_generate(target, draft, PROMPT, params, 3)
    again = speculative_generate(target, draft, PROMPT, params.with_seed(first.seed), 3)
    assert first.seed is not None and again.token_ids == first.token_ids


def test_output_does_not_depend_on_interleaving(target, draft_model):
    draft = DraftEngine(draft_model)
    jobs = [
        (SamplingParams(temperature=t, max_new_tokens=12, ignore_eos=True, seed=s), k)
        for (t, s, k) in [(1.0, 5, 3), (0.7, 6, 1), (1.0, 7, 5), (0.0, 8, 2)]
    ]
    alone = [speculative_generate(target, draft, PROMPT, p, k).token_ids for p, k in jobs]

    async def together():  # every await in the loop lets another session take a step
        return await asyncio.gather(
            *(
                generate_async(LocalTarget(target), LocalDraft(draft), PROMPT, p, k, session_id=f"s{i}")
                for i, (p, k) in enumerate(jobs)
            )
        )

    assert [r.token_ids for r in asyncio.run(together())] == alone
    assert len(target.store) == 0 and len(draft.store) == 0


def hf_greedy(model, prompt, n, **kw):
    out = model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0, **kw
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("k", [0, 1, 3, 5])
@pytest.mark.parametrize("draft_kind", ["close", "random", "ngram"])
def test_greedy_equals_transformers_generate(target_model, draft_model, other_draft_model, target, k, draft_kind):
    draft = {
        "close": lambda: DraftEngine(draft_model),
        "random": lambda: DraftEngine(other_draft_model),
        "ngram": lambda: NgramDraft(VOCAB),
    }[draft_kind]()
    prompt = [3, 9, 3, 9, 14, 2]
    expected = hf_greedy(target_model, prompt, 24)
    assert speculative_generate(target, draft, prompt, GREEDY, k).token_ids == expected


def test_greedy_with_repetition_penalty_equals_transformers(target_model, draft_model, target):
    params = SamplingParams(temperature=0.0, repetition_penalty=1.3, seed=0, max_new_tokens=20, ignore_eos=True)
    expected = hf_greedy(target_model, PROMPT, 20, repetition_penalty=1.3)
    assert speculative_generate(target, DraftEngine(draft_model), PROMPT, params, 3).token_ids == expected


def test_tiny_temperature_matches_greedy(target, draft_model):
    params = SamplingParams(temperature=1e-4, seed=9, max_new_tokens=16, ignore_eos=True)
    greedy = speculative_generate(target, DraftEngine(draft_model), PROMPT, GREEDY, 3).token_ids
    assert speculative_generate(target, DraftEngine(draft_model), PROMPT, params, 3).token_ids == greedy[:16]


def test_one_hot_target_distribution(target_model, draft_model):
    """top_k=1 makes every p one-hot: the output must be the greedy one for any seed."""
    target = TargetEngine(target_model)
    greedy = speculative_generate(target, DraftEngine(draft_model), PROMPT, GREEDY, 3).token_ids
    for seed in range(3):
        params = SamplingParams(temperature=1.0, top_k=1, seed=seed, max_new_tokens=24, ignore_eos=True)
        assert speculative_generate(target, DraftEngine(draft_model), PROMPT, params, 3).token_ids == greedy


@pytest.mark.parametrize("kind", ["target", "draft", "ngram"])
def test_commits_are_idempotent_and_stale_ones_refused(target_model, kind):
    """One commit protocol (specdec.engine.commits) for every kind of engine session."""
    engine = {"target": TargetEngine, "draft": DraftEngine, "ngram": lambda m: NgramDraft(VOCAB)}[kind](target_model)
    engine.prefill("s", PROMPT, GREEDY)

    def step(number: int) -> None:  # a Propose / Verify for step ``number``
        if kind == "target":
            engine.verify("s", number, [], [])
        else:
            engine.propose("s", number, 1)

    def tokens() -> list[int]:
        return list(engine._sessions["s"].tokens if kind == "ngram" else engine.store.get("s").tokens)

    step(1)
    commit = Commit(1, len(PROMPT), (4, 6))
    engine.commit("s", commit)
    engine.commit("s", commit)  # a retry: no-op
    assert tokens() == [*PROMPT, 4, 6]
    with pytest.raises(StaleStepError, match="already committed"):
        engine.commit("s", Commit(1, len(PROMPT), (5,)))
    with pytest.raises(StaleStepError, match="out of order"):
        engine.commit("s", Commit(3, len(PROMPT) + 5, (5,)))
    with pytest.raises(StaleStepError, match="stale"):
        step(1)
    assert tokens() == [*PROMPT, 4, 6]  # nothing refused was applied
    step(2)  # the next step goes on


def test_commit_riding_on_the_next_request_is_applied_first(target_model):
    draft = DraftEngine(target_model)
    draft.prefill("s", PROMPT, GREEDY)
    first = draft.propose("s", 1, 3)
    second = draft.propose("s", 2, 2, commit=Commit(1, len(PROMPT), (*tuple(first.tokens[:1]), 17)))
    session = draft.store.get("s")
    assert session.tokens == [*PROMPT, first.tokens[0], 17]
    assert session.cached[: len(session.tokens)] == session.tokens  # then the new proposals
    fresh = DraftEngine(target_model)
    fresh.prefill("t", [*PROMPT, first.tokens[0], 17], GREEDY)
    assert fresh.propose("t", 1, 2).tokens == second.tokens


def test_kv_bytes_are_tracked_and_capped(target_model):
    target = TargetEngine(target_model)
    per_token = target.store.bytes_per_token
    target.prefill("a", PROMPT, GREEDY)
    assert target.stats()["kv_bytes"] == BLOCK * per_token  # a whole block of the pool for the prompt
    assert target.stats()["kv_blocks_used"] == 1
    target.release("a")
    assert target.stats() == {
        "live_sessions": 0,
        "kv_bytes": 0,
        "kv_bytes_per_token": per_token,
        "sessions_started": 1,
        "pass_backend": target.store.pass_backend,  # (the backends: tests/test_torch_backend.py)
        "batch_invariant": True,
        "kv_block_size": BLOCK,
        "kv_blocks_used": 0,  # given back with the session
        "kv_pool_blocks": target.store.runner.pool.capacity - 1,
    }

    blocks = lambda n: int(n * BLOCK) * per_token  # noqa: E731
    capped = TargetEngine(
        target_model,
        CacheLimits(max_sessions=2, max_session_kv_bytes=blocks(2), max_total_kv_bytes=blocks(2.5)),
    )
    capped.prefill("a", PROMPT, GREEDY)
    with pytest.raises(ResourceExhaustedError, match="per-session cap"):
        capped.prefill("big", [t % 32 for t in range(40)], GREEDY)  # three blocks
    capped.prefill("b", PROMPT, GREEDY)
    with pytest.raises(ResourceExhaustedError, match="live sessions"):
        capped.prefill("c", PROMPT, GREEDY)
    with pytest.raises(ResourceExhaustedError, match="per-session cap"):  # 35 positions: three blocks
        capped.verify("a", 1, list(range(30)), [SparseDist.one_hot(t) for t in range(30)])
    with pytest.raises(ResourceExhaustedError, match="in all"):  # a second block for "a": three in all
        capped.verify("a", 1, list(range(12)), [SparseDist.one_hot(t) for t in range(12)])
    assert capped.release("a") and capped.release("b") and not capped.release("b")
    assert len(capped.store) == 0


def test_bad_requests_get_clear_errors(target_model):
    target = TargetEngine(target_model)
    with pytest.raises(InvalidArgumentError, match="prompt_token_ids"):
        target.prefill("s", [1, VOCAB + 5], GREEDY)
    with pytest.raises(InvalidArgumentError, match="prompt"):
        target.prefill("s", [], GREEDY)
    with pytest.raises(InvalidArgumentError, match="context"):
        target.prefill("s", [1] * 200, GREEDY)
    with pytest.raises(SessionNotFoundError, match="unknown session"):
        target.verify("nope", 1, [], [])
    target.prefill("s", PROMPT, GREEDY)
    with pytest.raises(MalformedProposalError, match=r"q\[1\]"):
        target.verify("s", 1, [4, 5], [SparseDist.one_hot(4), SparseDist.of([5, 6], [0.5, 0.2])])
    with pytest.raises(MalformedProposalError, match="not in the support"):
        target.verify("s", 1, [4], [SparseDist.one_hot(5)])


def test_nan_logits_raise_a_clear_error():
    broken = tiny_llama(VOCAB, seed=1)
    with torch.no_grad():
        broken.lm_head.weight[3, 0] = float("nan")
    target = TargetEngine(broken)
    target.prefill("s", PROMPT, GREEDY)
    with pytest.raises(NonFiniteLogitsError):
        target.verify("s", 1, [], [])


class CorruptingDraft:
    """A draft whose shipped q does not contain its proposal (a malformed block)."""

    kind = "model"

    def __init__(self, inner):
        self.inner = inner

    def prefill(self, *a):
        self.inner.prefill(*a)

    def propose(self, session_id, step, k, commit=None):
        p = self.inner.propose(session_id, step, k, commit)
        return DraftProposal(p.tokens, [SparseDist.one_hot((t + 1) % VOCAB) for t in p.tokens])

    def release(self, session_id):
        return self.inner.release(session_id)


def test_malformed_draft_never_fails_or_changes_a_request(target_model, draft_model, target):
    expected = hf_greedy(target_model, PROMPT, 24)
    draft = CorruptingDraft(DraftEngine(draft_model))
    result = speculative_generate(target, draft, PROMPT, GREEDY, 3)
    assert result.token_ids == expected
    assert result.stats.draft_fallbacks == 1
    assert len(draft.inner.store) == 0


def test_generation_stops_at_the_context_length(draft_model):
    small = tiny_llama(VOCAB, seed=3, max_positions=40)
    target = TargetEngine(small)
    draft = NgramDraft(VOCAB)
    result = speculative_generate(
        target, draft, list(range(1, 31)), SamplingParams(seed=1, max_new_tokens=100, ignore_eos=True), 4
    )
    assert len(result.token_ids) == 10 and result.finish_reason == "length"


def test_ngram_lookup():
    assert ngram_lookup([1, 2, 3, 1, 2], 3) == [3, 1, 2]
    assert ngram_lookup([1, 2, 3, 9, 2], 2) == [3, 9]  # falls back to a 1-gram match
    assert ngram_lookup([1, 2, 3], 2) == []
    assert ngram_lookup([5, 5, 5, 5], 2) == [5]  # the continuation of the latest match


def test_a_session_started_from_generated_tokens_is_told_where_its_prompt_ends(target_model):
    """A failover, resume or late draft starts a session from prompt + committed tokens: with
    the request's prompt_length its penalties are those of the session that generated them."""
    from dataclasses import replace

    params = SamplingParams(
        temperature=1.0, seed=3, repetition_penalty=1.4, presence_penalty=0.8, frequency_penalty=0.5
    )
    prompt, generated = [3, 7, 3, 9], [7, 7, 12]
    original = TargetEngine(target_model)
    original.prefill("s", prompt, params)
    original.commit("s", Commit(1, len(prompt), tuple(generated)))
    moved = TargetEngine(target_model)
    moved.prefill("s", prompt + generated, replace(params, prompt_length=len(prompt)))
    want = original.target_probs("s", [5])
    assert torch.allclose(moved.target_probs("s", [5]), want, atol=1e-6)
    naive = TargetEngine(target_model)  # all of it taken for prompt: the penalties differ
    naive.prefill("s", prompt + generated, params)
    assert not torch.allclose(naive.target_probs("s", [5]), want, atol=1e-3)
    assert torch.allclose(
        want[0], full_sequence_probs(target_model, prompt + generated, params, len(prompt)), atol=1e-5
    )
