"""Pipelined drafting (specdec.loop.pipelining): a draft drafts past a block it assumes, without
committing it, exactly as it would once that block is committed; the loop uses such a block only
on the branch it was drafted for, so a pipelined run is token for token the serial run."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from conftest import VOCAB

from specdec.engine.commits import Commit
from specdec.engine.draft import DraftEngine, FeatureDraftEngine
from specdec.engine.ngram import NgramDraft
from specdec.engine.target import TargetEngine
from specdec.errors import InvalidArgumentError
from specdec.exact.proposal import MAX_BLOCK, DraftProposal
from specdec.exact.sampling import SamplingParams
from specdec.exact.sparse import SparseDist
from specdec.loop.generate import LocalDraft, LocalTarget, SpeculativeRun, speculative_generate
from specdec.loop.pipelining import PreDraft

PROMPT = [1, 2, 3, 4, 5]
SAMPLED = SamplingParams(temperature=1.0, seed=7, max_new_tokens=24, ignore_eos=True, repetition_penalty=1.3)
GREEDY = SamplingParams(temperature=0.0, seed=8, max_new_tokens=24, ignore_eos=True)


def block(tokens: list[int]) -> DraftProposal:
    return DraftProposal(tokens, [SparseDist.one_hot(t) for t in tokens])


# -- the pure choice ---------------------------------------------------------------------------
def test_a_pre_draft_is_used_only_on_the_branch_it_assumed():
    ahead = PreDraft(base_len=3, assumed=(7, 8), drafted=block([9, 10, 11, 12]))
    assert ahead.branch == (7, 8, 9)  # the block, then the guessed bonus
    assert ahead.block_for([0, 1, 2, 7, 8, 9], 3).tokens == [10, 11, 12]
    assert ahead.block_for([0, 1, 2, 7, 8, 9], 2).tokens == [10, 11]  # a smaller k takes a prefix
    assert ahead.block_for([0, 1, 2, 7, 8, 5], 3) is None  # another bonus token
    assert ahead.block_for([0, 1, 2, 7, 4], 3) is None  # a rejection
    assert ahead.block_for([0, 1, 2, 7, 8, 9, 1], 3) is None  # more committed since (a forced run)
    assert ahead.block_for([0, 1, 2, 7, 8, 9], 4) is None  # a longer block than was drafted
    assert PreDraft(3, (7,), block([9])).block_for([0, 1, 2, 7, 9], 1) is None  # only a guess


# -- the engines -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["model", "ngram"])
@pytest.mark.parametrize("params", [SAMPLED, GREEDY], ids=["sampled", "greedy"])
def test_a_draft_proposes_after_assumed_tokens_what_it_proposes_once_they_are_committed(draft_model, kind, params):
    def started():
        engine = DraftEngine(draft_model) if kind == "model" else NgramDraft(VOCAB)
        engine.prefill("s", prompt, params)
        return engine

    prompt = [*PROMPT, 1, 2, 3, 4] if kind == "ngram" else PROMPT  # something for the lookup to find
    ahead, serial, other_serial = started(), started(), started()
    first = ahead.propose("s", 1, 3)
    assert serial.propose("s", 1, 3).tokens == other_serial.propose("s", 1, 3).tokens == first.tokens
    assumed = [*first.tokens, 4]
    drafted = ahead.propose("s", 2, 3, None, assumed)
    serial_block = serial.propose("s", 2, 3, Commit(1, len(prompt), tuple(assumed)))
    assert drafted.tokens and drafted.tokens == serial_block.tokens
    assert [q.prob(y) for y, q in zip(drafted.tokens, drafted.q, strict=True)] == pytest.approx(
        [q.prob(y) for y, q in zip(serial_block.tokens, serial_block.q, strict=True)]
    )
    # nothing was committed: another branch commits and drafts as if the pre-draft never ran
    other = (first.tokens[0], 6)
    assert (
        ahead.propose("s", 2, 3, Commit(1, len(prompt), other)).tokens
        == other_serial.propose("s", 2, 3, Commit(1, len(prompt), other)).tokens
    )
    if kind == "model":
        session = ahead.store.get("s")
        assert session.tokens == [*prompt, *other]
        assert session.cached[: len(session.tokens)] == session.tokens  # the assumed KV is gone


def test_a_pre_draft_leaves_the_committed_state_alone(target_model, draft_model):
    draft = DraftEngine(draft_model)
    draft.prefill("s", PROMPT, SAMPLED)
    session = draft.store.get("s")
    counts = session.counts.clone()
    draft.propose("s", 1, 2, None, [9, 9, 9])
    assert session.tokens == PROMPT
    assert torch.equal(session.counts, counts)
    assert session.ledger.committed_step == 0


def test_a_feature_draft_cannot_draft_ahead(target_model):
    from specdec.training.distill_features import build_feature_draft

    model = build_feature_draft(
        target_model, list(range(VOCAB)), embed_size=8, heads=4, kv_heads=2, intermediate=32, seed=1
    )
    engine = FeatureDraftEngine(model.eval().requires_grad_(False))
    with pytest.raises(InvalidArgumentError, match="assumed"):
        engine.propose("s", 1, 2, None, [1])


@pytest.mark.parametrize("assumed", [[VOCAB], [-1], [1] * (MAX_BLOCK + 2)])
def test_bad_assumed_tokens_are_invalid_arguments(draft_model, assumed):
    for engine in (DraftEngine(draft_model), NgramDraft(VOCAB)):
        engine.prefill("s", PROMPT, SAMPLED)
        with pytest.raises(InvalidArgumentError, match="assumed"):
            engine.propose("s", 1, 2, None, assumed)


# -- the loop ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "temperature, invariant", [(0.0, False), (1.0, False), (1.0, True)], ids=["greedy", "sampled", "invariant"]
)
def test_a_pipelined_run_is_token_for_token_the_serial_run(target_model, draft_model, temperature, invariant):
    target, draft = TargetEngine(target_model), DraftEngine(draft_model)
    hits = predrafts = 0
    for seed in range(12):
        params = SamplingParams(temperature=temperature, seed=seed, max_new_tokens=20, ignore_eos=True)
        params = dataclasses.replace(params, invariant=invariant)
        serial = speculative_generate(target, draft, PROMPT, params, 2)
        piped = speculative_generate(target, draft, PROMPT, params, 2, pipeline=True)
        assert piped.token_ids == serial.token_ids
        assert piped.stats.target_passes == serial.stats.target_passes
        hits, predrafts = hits + piped.stats.predraft_hits, predrafts + piped.stats.predrafts
        assert serial.stats.predrafts == 0
    assert 0 < hits < predrafts  # both branches taken
    assert len(target.store) == len(draft.store) == 0


class _FailingPreDrafts(LocalDraft):
    """A draft replica whose pre-drafts fail (an older replica that refuses the field, a timeout)."""

    async def propose(self, session_id, step, k, commit, assumed=()):
        if assumed:
            raise RuntimeError("no pre-drafts here")
        return await super().propose(session_id, step, k, commit)


def test_a_failing_pre_draft_costs_nothing_but_itself(target_model, draft_model):
    target, draft = TargetEngine(target_model), DraftEngine(draft_model)
    serial = speculative_generate(target, draft, PROMPT, SAMPLED, 2)
    run = SpeculativeRun(LocalTarget(target), _FailingPreDrafts(draft), PROMPT, SAMPLED, 2, pipeline=True)

    async def go():
        async for _ in run.steps():
            pass

    asyncio.run(go())
    result = run.result()
    assert result.token_ids == serial.token_ids
    assert result.stats.predrafts > 0 and result.stats.predraft_hits == 0
    assert result.stats.draft_fallbacks == 0  # the draft itself still serves its own proposals
    assert len(target.store) == len(draft.store) == 0


def test_a_lost_verify_cancels_its_pre_draft_and_frees_everything(target_model, draft_model):
    target, draft = TargetEngine(target_model), DraftEngine(draft_model)

    class Fails(LocalTarget):
        calls = 0

        async def verify(self, *args, **kwargs):
            Fails.calls += 1
            if Fails.calls == 3:
                raise RuntimeError("target gone")
            return await super().verify(*args, **kwargs)

    run = SpeculativeRun(Fails(target), LocalDraft(draft), PROMPT, SAMPLED, 2, pipeline=True)

    async def go():
        async for _ in run.steps():
            pass

    with pytest.raises(RuntimeError, match="target gone"):
        asyncio.run(go())
    assert run.stats.predrafts >= 2
    assert len(target.store) == len(draft.store) == 0
