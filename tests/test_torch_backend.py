"""The torch backend of the batched pass (specdec/modeling/lean_llama.py, attention.py,
invariant.py): chosen once at load and said why, the same function as transformers' forward for
many sequences in one pass, and -- on its invariant operations -- a row's bits independent of the
other rows of the pass, in float32 and bfloat16 on the default target's widths."""

from __future__ import annotations

import copy

import pytest
import torch

from specdec.modeling import fewrow
from specdec.modeling.attention import KEY_BLOCK, fused_attention, fused_attention_paged, invariant_attention_many
from specdec.modeling.lean_llama import KERNEL, TORCH, TORCH_INVARIANT, LeanLlama, Pass
from specdec.modeling.tiny import smollm2_shaped, tiny_llama


def smollm2_widths(dtype: torch.dtype, seed: int = 0):
    """Two layers of SmolLM2-135M's widths, random weights."""
    return smollm2_shaped(layers=2, vocab_size=512, seed=seed, max_positions=2048).to(dtype)


def test_the_backend_is_chosen_once_at_load_and_says_why(monkeypatch):
    narrow = LeanLlama(tiny_llama(32, hidden_size=32, num_heads=4, num_kv_heads=2))  # head_dim 8: no kernel
    assert narrow.backend == TORCH_INVARIANT and narrow.batch_invariant and "chunked" in narrow.backend_reason
    fast = LeanLlama(tiny_llama(32, hidden_size=32, num_heads=4, num_kv_heads=2), batch_invariant=False)
    assert fast.backend == TORCH and not fast.batch_invariant and "off" in fast.backend_reason
    monkeypatch.setenv("SPECDEC_BATCH_INVARIANT", "0")
    assert LeanLlama(tiny_llama(32, hidden_size=32, num_heads=4, num_kv_heads=2)).backend == TORCH
    monkeypatch.delenv("SPECDEC_BATCH_INVARIANT")
    bf16 = LeanLlama(tiny_llama(32, hidden_size=32).to(torch.bfloat16))
    assert bf16.backend == TORCH_INVARIANT and "bfloat16" in bf16.backend_reason
    if fewrow.layers_available():
        assert LeanLlama(tiny_llama(32, hidden_size=32)).backend == KERNEL


def test_a_failed_invariance_probe_falls_back_to_the_fast_operations_and_names_what_failed(monkeypatch):
    from specdec.modeling import lean_llama

    monkeypatch.setattr(lean_llama, "attention_rows_invariant", lambda *a, **k: False)
    lean = LeanLlama(tiny_llama(32, hidden_size=32, num_heads=4, num_kv_heads=2))
    assert lean.backend == TORCH and "attention" in lean.backend_reason and not lean.batch_invariant


@pytest.mark.parametrize("invariant", [True, False])
def test_many_sequences_in_one_pass_give_transformers_logits_through_steps_and_rollbacks(invariant):
    from transformers import DynamicCache

    model = tiny_llama(
        64, seed=3, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, init_range=0.2, max_positions=256
    )
    reference = copy.deepcopy(model)
    lean = LeanLlama(model, batch_invariant=invariant)
    assert lean.backend == (TORCH_INVARIANT if invariant else TORCH)
    generator = torch.Generator().manual_seed(4)
    lengths = [1, 5, 63, 64, 65, 130]  # prompts on both sides of the attention's key buckets
    caches = [lean.new_cache() for _ in lengths]
    hf_caches = [DynamicCache(config=reference.config) for _ in lengths]
    feeds = [torch.randint(0, 64, (n,), generator=generator) for n in lengths]
    for step in range(12):
        rows = [len(f) if step == 0 else 1 + (step + i) % 5 for i, f in enumerate(feeds)]
        results = lean.forward_batch([Pass(f, c, r) for f, c, r in zip(feeds, caches, rows, strict=True)])
        for (logits, _), feed, hf_cache, r in zip(results, feeds, hf_caches, rows, strict=True):
            with torch.inference_mode():
                expected = reference(input_ids=feed.unsqueeze(0), cache=hf_cache, use_cache=True, logits_to_keep=r)
            torch.testing.assert_close(logits, expected.logits[0], rtol=1e-5, atol=1e-5)
        for i, (cache, hf_cache) in enumerate(zip(caches, hf_caches, strict=True)):
            drop = (step + i) % 3 if step else 0  # roll part of each block back
            drop = min(drop, len(feeds[i]) - 1)
            if drop:
                cache.crop(-drop)
                hf_cache.crop(-drop)
            assert cache.length == hf_cache.get_seq_length()
        feeds = [torch.randint(0, 64, (1 + (step + 1 + i) % 5,), generator=generator) for i in range(len(lengths))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_the_default_targets_widths_a_verify_block_gives_the_bits_of_one_row_steps(dtype, monkeypatch):
    """What greedy speculation's identity with target-only greedy rests on: the target's logits
    for proposal i do not depend on k, nor on the other sessions of the pass -- in float32 with
    the kernel off and in bfloat16, where the library's fused operations measured otherwise
    (docs/batching.md)."""
    monkeypatch.setenv(fewrow.LAYERS_SWITCH_ENV, "0")
    lean = LeanLlama(smollm2_widths(dtype))
    assert lean.backend == TORCH_INVARIANT, lean.backend_reason
    generator = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 512, (58,), generator=generator)  # the blocks cross the 64-key bucket edge
    block = torch.randint(0, 512, (9,), generator=generator)
    stepped, blocked, other = lean.new_cache(), lean.new_cache(), lean.new_cache()
    lean.forward_batch([Pass(prompt, stepped)])
    lean.forward_batch([Pass(prompt, blocked)])
    lean.forward_batch([Pass(torch.randint(0, 512, (100,), generator=generator), other)])
    singles = torch.cat([lean.forward_batch([Pass(block[i : i + 1], stepped)])[0][0] for i in range(len(block))])
    together = lean.forward_batch([Pass(block, blocked, len(block)), Pass(block[:3], other, 3)])[0][0]
    assert torch.equal(together, singles)
    for mine, theirs in zip(blocked.positions(), stepped.positions(), strict=True):
        assert torch.equal(mine, theirs)


def paged(sequences: list[tuple[torch.Tensor, torch.Tensor]], block: int = 16, seed: int = 0):
    """Sequences' keys/values [Hkv, length, D] as one layer's paged pool, their blocks in a
    shuffled order: (keys [blocks, Hkv, block, D], values, one table per sequence)."""
    counts = [-(-k.shape[1] // block) for k, _ in sequences]
    ids = (torch.randperm(sum(counts), generator=torch.Generator().manual_seed(seed)) + 1).tolist()
    heads, _, dim = sequences[0][0].shape
    pool_k = sequences[0][0].new_zeros(sum(counts) + 1, heads, block, dim)  # block 0: the null block
    pool_v = pool_k.clone()
    tables = []
    for (keys, values), count in zip(sequences, counts, strict=True):
        table, ids = ids[:count], ids[count:]
        for index, block_id in enumerate(table):
            part = slice(index * block, (index + 1) * block)
            pool_k[block_id, :, : keys[:, part].shape[1]] = keys[:, part]
            pool_v[block_id, :, : values[:, part].shape[1]] = values[:, part]
        tables.append(torch.tensor(table, dtype=torch.long))
    return pool_k, pool_v, tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_attention_is_attention_up_to_rounding_across_bucket_edges(dtype):
    generator = torch.Generator().manual_seed(2)
    keys = torch.randn(3, 200, 64, generator=generator).to(dtype)
    values = torch.randn(3, 200, 64, generator=generator).to(dtype)
    values[:, 150:] = 0  # what a cache holds past its length is weighed by 0 either way
    pool_k, pool_v, (table,) = paged([(keys, values)])
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for start, n in ((0, 1), (0, 17), (KEY_BLOCK - 3, 7), (120, 20), (149, 1)):
        q = torch.randn(n, 9, 64, generator=generator).to(dtype)
        expected = fused_attention(q, keys, values, start, 0.125).float()
        got = invariant_attention_many(q, pool_k, pool_v, [(table, start, n)], 0.125)
        assert got.shape == (n, 9 * 64) and got.dtype == dtype
        torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)
        # the fast path reads the same blocks
        fast = fused_attention_paged(q, pool_k, pool_v, [(table, start, n)], 0.125)
        torch.testing.assert_close(fast.float(), expected, rtol=tolerance, atol=tolerance)
    # a bucket that reaches past a sequence's blocks reads the null block's zeros
    q = torch.randn(2, 9, 64, generator=generator).to(dtype)
    short_k, short_v = keys[:, :70].contiguous(), values[:, :70].contiguous()
    short_pool_k, short_pool_v, (short_table,) = paged([(short_k, short_v)])
    assert short_table.shape[0] * 16 < 128  # the bucket of positions 68-69 is 128 keys long
    torch.testing.assert_close(
        invariant_attention_many(q, short_pool_k, short_pool_v, [(short_table, 68, 2)], 0.125).float(),
        fused_attention(q, short_k, short_v, 68, 0.125).float(),
        rtol=tolerance,
        atol=tolerance,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_sequences_attention_equals_each_alone_bit_for_bit_and_fused_up_to_rounding(dtype):
    from specdec.modeling.attention import attention_rows_invariant

    # blocks of 17 rows crossing bucket edges, next to sequences of other lengths (other buckets)
    assert attention_rows_invariant(9, 3, 64, dtype, "cpu", lengths=(5, 64, 65, 200, 2048), block_rows=17)
    # one and two query heads per key/value head (the shipped draft has 4 over 2): a one-row step's
    # products would have 1 or 2 rows, which the library computes with another kernel unpadded
    for heads, kv_heads in ((4, 2), (4, 4)):
        assert attention_rows_invariant(heads, kv_heads, 64, dtype, "cpu", lengths=(5, 64, 300), block_rows=9)
    generator = torch.Generator().manual_seed(3)
    sequences, rows_of, queries, expected = [], [], [], []
    for start, rows in ((0, 3), (62, 4), (100, 1), (101, 1), (30, 40)):
        keys = torch.randn(3, start + rows + 5, 64, generator=generator).to(dtype)
        values = torch.randn(3, start + rows + 5, 64, generator=generator).to(dtype)
        q = torch.randn(rows, 9, 64, generator=generator).to(dtype)
        sequences.append((keys, values))
        rows_of.append((start, rows))
        queries.append(q)
        expected.append(fused_attention(q, keys, values, start, 0.125).float())
    pool_k, pool_v, tables = paged(sequences)
    segments = [(table, start, rows) for table, (start, rows) in zip(tables, rows_of, strict=True)]
    got = invariant_attention_many(torch.cat(queries), pool_k, pool_v, segments, 0.125)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), torch.cat(expected), rtol=tolerance, atol=tolerance)


def tiny_architecture(model_type: str, seed: int = 0):
    """A two-layer random model of one of the lean pass's other architectures (grouped-query
    heads of 8; Qwen2 with its q/k/v biases, Qwen3 with its q/k norms)."""
    import transformers

    config_class, model_class = {
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[model_type]
    torch.manual_seed(seed)
    config = config_class(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        sliding_window=None,
        initializer_range=0.2,
    )
    model = model_class(config).eval()
    with torch.no_grad():  # biases and norm weights away from their 0 / 1 initialisation, so they count
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
    return model


@pytest.mark.parametrize("model_type", ["mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("invariant", [True, False])
def test_other_architectures_give_transformers_logits_in_one_batched_pass(model_type, invariant):
    from transformers import DynamicCache

    from specdec.modeling.lean_llama import lean_runner

    model = tiny_architecture(model_type)
    reference = copy.deepcopy(model)
    lean = lean_runner(model, batch_invariant=invariant)
    assert lean is not None and lean.backend == (TORCH_INVARIANT if invariant else TORCH)
    if model_type == "qwen2":
        assert all(bias is not None for bias in lean.qkv_biases)
    if model_type == "qwen3":
        assert all(norms is not None for norms in lean.qk_norms)
    generator = torch.Generator().manual_seed(5)
    feeds = [torch.randint(0, 64, (n,), generator=generator) for n in (3, 66, 20)]
    caches = [lean.new_cache() for _ in feeds]
    hf_caches = [DynamicCache(config=reference.config) for _ in feeds]
    for step in range(4):
        rows = [len(f) for f in feeds]
        results = lean.forward_batch([Pass(f, c, r) for f, c, r in zip(feeds, caches, rows, strict=True)])
        for (logits, _), feed, hf_cache, r in zip(results, feeds, hf_caches, rows, strict=True):
            with torch.inference_mode():
                expected = reference(input_ids=feed.unsqueeze(0), cache=hf_cache, use_cache=True, logits_to_keep=r)
            torch.testing.assert_close(logits, expected.logits[0], rtol=1e-4, atol=1e-4)
        feeds = [torch.randint(0, 64, (1 + (step + i) % 4,), generator=generator) for i in range(len(feeds))]


def test_what_the_lean_pass_does_not_cover_is_refused_with_the_reason():
    from specdec.modeling.lean_llama import _supported

    mistral = tiny_architecture("mistral")
    mistral.config.sliding_window = 16  # shorter than its 256-position context
    assert "sliding window of 16" in _supported(mistral)
    qwen2 = tiny_architecture("qwen2")
    qwen2.model.layers[1].self_attn.k_proj.bias = None
    assert "some of q/k/v" in _supported(qwen2)
    assert _supported(tiny_architecture("qwen3")) is None
