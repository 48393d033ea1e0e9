"""The lean Llama pass (specdec/modeling/lean_llama.py) computes what transformers computes.

Logits are compared with transformers' own forward (same weights, its DynamicCache) through a
prefill, single- and multi-row steps, rollbacks (crop) and the growth of the preallocated cache;
models the pass does not cover must fall back to transformers.
"""

from __future__ import annotations

import copy

import pytest
import torch

from specdec.engine.sessions import SessionStore
from specdec.exact.sampling import SamplingParams
from specdec.modeling.cache import LeanCache
from specdec.modeling.dimensions import kv_bytes_per_token
from specdec.modeling.lean_llama import LeanLlama, lean_runner
from specdec.modeling.paged import BLOCK, PagedCache
from specdec.modeling.tiny import tiny_llama


def grouped_llama(seed: int = 0):
    """4 query heads sharing 2 key/value heads (grouped-query attention, as SmolLM2), 2 layers."""
    return tiny_llama(
        vocab_size=64,
        seed=seed,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        init_range=0.2,
        max_positions=256,
    )


def hf_logits(model, cache, ids: list[int], rows: int) -> torch.Tensor:
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True, logits_to_keep=rows)
    return out.logits[0]


def test_logits_match_transformers_through_steps_rollbacks_and_growth():
    from transformers import DynamicCache

    model = grouped_llama()
    reference = copy.deepcopy(model)  # before the lean pass re-points the weights into fused tensors
    lean = LeanLlama(model)
    generator = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(0, 64, (n,), generator=generator).tolist()  # noqa: E731
    hf_cache, lean_cache = DynamicCache(config=reference.config), lean.new_cache()
    prompt = ids(40)
    torch.testing.assert_close(
        lean.forward(torch.tensor(prompt), lean_cache, 3),
        hf_logits(reference, hf_cache, prompt, 3),
        rtol=1e-5,
        atol=1e-5,
    )
    # Steps of 1-5 rows, each followed by a rollback of part of it, until the cache has grown
    # past its initial capacity twice (64 -> 128 -> 256 positions).
    step = 0
    while lean_cache.length < 150:
        rows = 1 + step % 5
        block = ids(rows)
        torch.testing.assert_close(
            lean.forward(torch.tensor(block), lean_cache, rows),
            hf_logits(reference, hf_cache, block, rows),
            rtol=1e-5,
            atol=1e-5,
        )
        drop = step % rows  # 0 .. rows-1 positions rejected
        if drop:
            lean_cache.crop(-drop)
            hf_cache.crop(-drop)
        assert lean_cache.length == hf_cache.get_seq_length()
        step += 1
    assert lean_cache.capacity >= 150
    # The model object itself still computes the same (its weights are views of the fused ones).
    probe = ids(12)
    torch.testing.assert_close(hf_logits(model, None, probe, 12), hf_logits(reference, None, probe, 12), rtol=0, atol=0)


def test_greedy_continuation_matches_transformers_generate():
    model = grouped_llama(seed=3)
    reference = copy.deepcopy(model)
    lean = LeanLlama(model)
    prompt = [5, 17, 2, 40, 33]
    expected = reference.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=30, min_new_tokens=30, pad_token_id=0
    )[0, len(prompt) :].tolist()
    cache, tokens, feed = lean.new_cache(), [], prompt
    for _ in range(30):
        token = int(lean.forward(torch.tensor(feed), cache, 1)[-1].argmax())
        tokens.append(token)
        feed = [token]
    assert tokens == expected


def test_session_store_uses_the_lean_pass_only_where_it_applies(monkeypatch):
    params = SamplingParams(temperature=0.0, seed=1)
    store = SessionStore(grouped_llama())
    session = store.create("s", [1, 2, 3, 4], params)
    assert isinstance(session.cache, PagedCache)
    store.forward(session, [7, 8], rows=3)
    # accounted as allocated: whole blocks of the pool -- one for the prompt, still one for the 6
    # positions the pass holds; a 17th position takes a second
    per_token = kv_bytes_per_token(store.model.config, torch.float32)
    assert session.kv_bytes == BLOCK * per_token == session.cache.nbytes()
    store.forward(session, list(range(5, 18)), rows=1)  # 4 + 13 positions (the rolled-back 7, 8 dropped)
    assert session.kv_bytes == 2 * BLOCK * per_token and store.runner.pool.used == 2
    store.release("s")  # its blocks go back to the pool
    assert store.runner.pool.used == 0
    # A tensor-parallel shard keeps transformers' forward (its layers carry the collectives).
    assert SessionStore(grouped_llama(), kv_shards=2).runner is None
    # Switched off by the environment, for comparisons.
    monkeypatch.setenv("SPECDEC_LEAN_FORWARD", "0")
    assert lean_runner(grouped_llama()) is None


@pytest.mark.parametrize(
    "change",
    [{"attention_bias": True}, {"hidden_act": "gelu"}, {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}],
)
def test_models_it_does_not_cover_fall_back_to_transformers(change):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        **change,
    )
    model = LlamaForCausalLM(config).eval()
    assert lean_runner(model) is None
    store = SessionStore(model)
    session = store.create("s", [1, 2, 3], SamplingParams(temperature=0.0, seed=1))
    assert not isinstance(session.cache, PagedCache)
    assert store.forward(session, [4], rows=2).shape == (2, 32)


def test_cache_refuses_what_it_cannot_hold():
    cache = LeanCache(layers=1, kv_heads=1, head_dim=4, dtype=torch.float32, device="cpu", max_length=100)
    with pytest.raises(ValueError, match="context of 100"):
        cache.reserve(101)
    with pytest.raises(ValueError, match="negative"):
        cache.crop(3)
    cache.reserve(80)
    cache.length = 80
    cache.crop(-200)
    assert cache.length == 0
