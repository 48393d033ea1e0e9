"""Logprobs: read from the target's row of the verify pass that committed each token, so with
speculation they are the target-only run's, and they are the law the token was drawn from."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from specdec.engine.draft import DraftEngine
from specdec.engine.target import TargetEngine
from specdec.exact.logprobs import RowLogprobs, block_candidates, emitted_logprobs, row_logprobs
from specdec.exact.sampling import SamplingParams, reported_logprobs, token_counts
from specdec.loop.generate import LocalDraft, LocalTarget, SpeculativeRun
from specdec.modeling.tiny import perturbed


def test_rows_give_each_candidate_and_the_top_n_with_ties_to_the_lower_id():
    lp = torch.log(torch.tensor([[0.1, 0.4, 0.1, 0.4], [0.7, 0.1, 0.1, 0.1]]))
    rows = row_logprobs(lp, [[2, 1], [0]], top_n=3)
    assert rows[0].candidates == pytest.approx({2: math.log(0.1), 1: math.log(0.4)})
    assert [t for t, _ in rows[0].top] == [1, 3, 0]  # 0.4, 0.4 (ids 1 < 3), then 0.1 (id 0 first)
    assert [t for t, _ in rows[1].top] == [0, 1, 2]
    assert row_logprobs(lp, [[0], [0]], top_n=0)[0].top == ()
    with pytest.raises(ValueError, match="top_n"):
        row_logprobs(lp, [[0], [0]], top_n=21)


def test_emitted_tokens_take_the_row_they_came_from():
    rows = [RowLogprobs({5: -0.1, 7: -2.0}), RowLogprobs({6: -0.2, 8: -3.0}), RowLogprobs({9: -0.5})]
    assert [e.logprob for e in emitted_logprobs(rows, [5, 8])] == [-0.1, -3.0]  # accepted y_1, recovered r_2
    assert [e.logprob for e in emitted_logprobs(rows, [5, 6, 9])] == [-0.1, -0.2, -0.5]  # all accepted + bonus
    assert block_candidates([5, 6], [7, 8], 9) == [[5, 7], [6, 8], [9]]
    with pytest.raises(ValueError):
        emitted_logprobs(rows[:1], [5, 6])


def _run(target_engine, draft_engine, prompt, params, k):
    run = SpeculativeRun(
        LocalTarget(target_engine), LocalDraft(draft_engine) if k else None, prompt, params, k, adaptive=False
    )

    async def go():
        async for _ in run.steps():
            pass

    asyncio.run(go())
    return run


def _reference(model, prompt, tokens, params):
    """Each token's logprob recomputed from the model alone on its prefix, no cache."""
    out = []
    vocab = model.config.vocab_size
    prompt_seen = token_counts(prompt, vocab) > 0
    for i, t in enumerate(tokens):
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([prompt + tokens[:i]])).logits[0, -1]
        lp = reported_logprobs(logits, params, token_counts(tokens[:i], vocab), prompt_seen)
        out.append(float(lp[t]))
    return out


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.0},
        {"temperature": 0.8, "top_k": 6, "presence_penalty": 0.3, "repetition_penalty": 1.2},
    ],
    ids=["greedy", "sampled"],
)
def test_logprobs_with_speculation_are_the_targets_own(target_model, sampling):
    draft_model = perturbed(target_model, scale=0.04, seed=5)
    params = SamplingParams(seed=7, max_new_tokens=20, ignore_eos=True, logprobs=3, **sampling)
    prompt = [3, 7, 11, 5]
    spec = _run(TargetEngine(target_model), DraftEngine(draft_model), prompt, params, k=3)
    tokens = spec.result().token_ids
    assert spec.stats.accepted_tokens > 0 and len(spec.token_logprobs) == len(tokens) == 20
    assert [e.token for e in spec.token_logprobs] == tokens
    got = [e.logprob for e in spec.token_logprobs]
    assert got == pytest.approx(_reference(target_model, prompt, tokens, params), abs=1e-4)
    assert all(e.top[0][1] >= e.logprob - 1e-6 and len(e.top) == 3 for e in spec.token_logprobs)
    if params.greedy:  # the same tokens target-only: the same logprobs and top-n
        alone = _run(TargetEngine(target_model), None, prompt, params, k=0)
        assert alone.result().token_ids == tokens
        assert [e.logprob for e in alone.token_logprobs] == pytest.approx(got, abs=1e-5)
        assert [[t for t, _ in e.top] for e in alone.token_logprobs] == [
            [t for t, _ in e.top] for e in spec.token_logprobs
        ]
