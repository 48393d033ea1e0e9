"""The distilled draft shipped in models/smollm2-draft: it is what the issue says it is (small,
bf16, reduced output head), it pairs with the default target (same tokenizer), greedy speculation
with it is the target's own greedy output, and the statistical exactness cases pass with it as the
draft through the real engines (exactness never depends on draft quality; this checks the real one)."""

import json

import pytest
import torch

from specdec.apps import selftest
from specdec.engine.draft import DraftEngine
from specdec.engine.target import TargetEngine
from specdec.exact.sampling import SamplingParams
from specdec.loop.generate import speculative_generate
from specdec.modeling.heads import HEAD_VOCAB_FILE, SubsetHead
from specdec.modeling.loading import (
    default_draft_for,
    encode_prompt,
    load_model,
    load_tokenizer,
    resolve,
    shipped_models_dir,
    tokenizer_fingerprint,
)

FOLDER = shipped_models_dir() / "smollm2-draft"
# Held-out bench prompts: never seen by the distillation (benchmarks/prompts.jsonl, split heldout).
HELD_OUT = [
    "What causes the tides in the ocean?",
    "How do I read a CSV file with pandas and print its first five rows?",
]


@pytest.fixture(scope="module")
def draft():
    return load_model("smollm2-draft", "cpu", torch.float32, quiet=True)


def test_shipped_files_are_small_bf16_with_a_card():
    from safetensors import safe_open

    weights = FOLDER / "model.safetensors"
    assert weights.stat().st_size <= 30_000_000  # the issue: at most 30 MB
    with safe_open(str(weights), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}  # noqa: SIM118 - safe_open is not iterable
    head = json.loads((FOLDER / HEAD_VOCAB_FILE).read_text())["token_ids"]
    assert head == sorted(set(head)) and 0 < len(head) < 49152
    card = (FOLDER / "README.md").read_text()
    assert "acceptance" in card.lower() and "specdec distill" in card
    assert (
        json.loads((FOLDER / "distill.json").read_text())["kl_end"]
        < json.loads((FOLDER / "distill.json").read_text())["kl_start"]
    )


def test_default_draft_is_the_shipped_one_for_the_default_target():
    assert default_draft_for("smollm2") == "smollm2-draft"
    assert default_draft_for("/some/other/model") == "ngram"
    assert resolve("smollm2-draft").location == str(FOLDER)


@pytest.mark.slow
def test_loads_with_reduced_head_and_shares_the_tokenizer(draft, smollm2):
    target, tokenizer = smollm2
    assert isinstance(draft.get_output_embeddings(), SubsetHead)
    assert draft.config.vocab_size == target.config.vocab_size
    assert tokenizer_fingerprint(load_tokenizer("smollm2-draft")) == tokenizer_fingerprint(tokenizer)
    logits = draft(input_ids=torch.tensor([[1, 2, 3]])).logits[0, -1]
    assert logits.shape == (target.config.vocab_size,)
    assert int(torch.isfinite(logits).sum()) == len(draft.get_output_embeddings().token_ids)


@pytest.mark.slow
@pytest.mark.integration
def test_greedy_with_the_shipped_draft_is_the_targets_greedy(draft, smollm2):
    target, tokenizer = smollm2
    proposed = accepted = 0
    for prompt in HELD_OUT:
        ids = encode_prompt(tokenizer, prompt, chat=True)
        expected = target.generate(
            torch.tensor([ids]),
            do_sample=False,
            max_new_tokens=32,
            min_new_tokens=32,
            pad_token_id=tokenizer.pad_token_id,
        )[0, len(ids) :].tolist()
        params = SamplingParams(temperature=0.0, seed=0, max_new_tokens=32, ignore_eos=True)
        result = speculative_generate(TargetEngine(target), DraftEngine(draft), ids, params, 4)
        assert result.token_ids == expected
        proposed += result.stats.proposed_tokens
        accepted += result.stats.accepted_tokens
    # Not exactness (that holds for any draft) but a guard on the artifact: a broken head mapping
    # or a wrong checkpoint drops greedy acceptance on held-out prompts to ~0 (a random draft of
    # this vocabulary: < 0.01). accepted / proposed at k=4 counts the proposals after a rejection too.
    assert accepted / proposed >= 0.15, f"greedy acceptance {accepted / proposed:.2f} on held-out prompts"


def test_invariant_sampling_with_the_shipped_pair_is_the_target_only_output(draft, smollm2):
    """The default models (49152-token vocabulary, the draft's reduced head): invariant sampling
    at temperature 0.7 with the shipped draft at k = 2 and 5 and adaptive, and with n-gram, gives
    the target-only tokens of each seed."""
    from specdec.engine.ngram import NgramDraft

    target_model, tokenizer = smollm2
    target = TargetEngine(target_model)
    ids = encode_prompt(tokenizer, HELD_OUT[0], chat=True)
    accepted = 0
    for seed in (1, 2):
        params = SamplingParams(temperature=0.7, seed=seed, max_new_tokens=24, ignore_eos=True, invariant=True)
        expected = speculative_generate(target, None, ids, params, 0).token_ids
        for make, k, adaptive in [
            (lambda: DraftEngine(draft), 2, False),
            (lambda: DraftEngine(draft), 5, False),
            (lambda: DraftEngine(draft), 4, True),
            (lambda: NgramDraft(target.vocab_size), 3, False),
        ]:
            result = speculative_generate(target, make(), ids, params, k, adaptive=adaptive)
            assert result.token_ids == expected, (seed, k, adaptive)
            accepted += result.stats.accepted_tokens
    assert accepted > 0 and len(target.store) == 0


RUNS = 400  # per case; each run prefills and decodes SmolLM2 (~0.15 s on this CPU)
# A short plain-text prompt: a chat-formatted one (34 tokens) made every run's prefill 2x dearer
# without testing anything more; each transform is covered at N=1000 by `specdec selftest`.
PROMPT = "My favourite fruit is"
CASES = [
    selftest.Case(
        "shipped_draft_top_k",
        "SmolLM2 target + shipped draft, temperature 1, top-k 5, k=2",
        {"temperature": 1.0, "top_k": 5},
        k=2,
        tokens=2,
    ),
    selftest.Case(
        "shipped_draft_penalties_top_p",
        "temperature 0.8, top-p 0.6, repetition 1.3, k=1",
        {"temperature": 0.8, "top_p": 0.6, "repetition_penalty": 1.3},
        k=1,
        tokens=2,
    ),
]


@pytest.mark.slow
@pytest.mark.statistical
@pytest.mark.integration
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_statistical_exactness_with_the_shipped_draft(case, draft, smollm2):
    """alpha = selftest.ALPHA (1e-3) per case, fixed seeds: deterministic."""
    target, tokenizer = smollm2
    prompt = tuple(encode_prompt(tokenizer, PROMPT, chat=False))
    case = selftest.Case(case.name, case.covers, case.params, case.k, "model", case.tokens, 0, prompt)
    result = selftest.check_pair(case, target, DraftEngine(draft), runs=RUNS)
    assert result.passed, f"{result.name}: p={result.p_value:.2e} tv={result.tv:.3f} {result.detail}"
    assert 0.0 < result.acceptance_rate < 1.0  # both the accept and the residual paths were exercised
