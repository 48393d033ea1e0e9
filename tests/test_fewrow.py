"""The few-row product kernel (specdec/modeling/fewrow.py, specdec/modeling/kernels/fewrow.c) computes x @ w^T.

It is compiled here on first use; where it cannot run (no AVX-512F, no C compiler) the tests that
need it are skipped with the reason, and the lean pass keeps torch's product (tested as well).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

from specdec.modeling import fewrow, lean_llama, ops

REASON = fewrow.unavailable_reason()
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"few-row kernel unavailable: {REASON}")


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8, 9, 17, 70])
@pytest.mark.parametrize("out_features, in_features", [(960, 576), (577, 576), (13, 32), (5, 16), (64, 1536)])
def test_kernel_equals_the_torch_product(rows, out_features, in_features):
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=generator)
    w = torch.randn(out_features, in_features, generator=generator)
    y = fewrow.few_row_product(x, w)
    assert y is not None and y.shape == (rows, out_features) and y.is_contiguous()
    torch.testing.assert_close(y, (x.double() @ w.double().t()).float(), rtol=1e-5, atol=1e-4)


@needs_kernel
def test_kernel_reads_views_at_their_offset():
    """A fused weight's rows are views into one tensor: the kernel must start at the view's data."""
    fused = torch.randn(96, 64)
    part = fused[32:80]
    x = torch.randn(3, 64)
    torch.testing.assert_close(fewrow.few_row_product(x, part), x @ part.t(), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_product_is_the_same_bits_whatever_rows_share_the_call(dtype):
    """Batch invariance: row i of a product over n rows equals, bit for bit, the product of row i
    alone, for every n (tiles of 8 rows, blocks of 64, and their remainders)."""
    generator = torch.Generator().manual_seed(7)
    w = torch.randn(200, 576, generator=generator).to(dtype)
    x = torch.randn(150, 576, generator=generator)
    alone = torch.cat([fewrow.few_row_product(x[i : i + 1], w) for i in range(len(x))])
    for n in (2, 3, 5, 8, 9, 16, 63, 64, 65, 150):
        for offset in (0, 150 - n):
            together = fewrow.few_row_product(x[offset : offset + n], w)
            assert torch.equal(together, alone[offset : offset + n]), (n, offset)


def test_kernel_declines_what_it_does_not_cover():
    w = torch.randn(8, 32)
    assert fewrow.few_row_product(torch.randn(0, 32), w) is None  # no rows
    assert fewrow.few_row_product(torch.randn(3, 24), torch.randn(8, 24)) is None  # width not a multiple of 16
    assert fewrow.few_row_product(torch.randn(3, 32, dtype=torch.float64), w.double()) is None
    assert fewrow.few_row_product(torch.randn(3, 32), w.t().contiguous().t()) is None  # non-contiguous weight
    with torch.enable_grad():  # autograd cannot see through the kernel: training keeps torch
        assert fewrow.few_row_product(torch.randn(3, 32, requires_grad=True), w) is None


def test_lean_product_sends_one_to_four_rows_to_the_kernel(monkeypatch):
    calls = []

    def recorded(x, weight):
        calls.append(x.shape[0])
        return None  # decline: product() must then fall back to torch and still be right

    monkeypatch.setattr(ops, "few_row_product", recorded)
    w = torch.randn(40, 32)
    for rows in (1, 2, 3, 4, 5):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(ops.product(x, w), x @ w.t(), rtol=1e-5, atol=1e-5)
    assert calls == [1, 2, 3, 4]


def _probe(env: dict) -> str:
    code = "from specdec.modeling import fewrow; print(fewrow.unavailable_reason())"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={**os.environ, **env}
    ).stdout.strip()


def test_switch_turns_the_kernel_off():
    assert "SPECDEC_FEWROW_KERNEL" in _probe({"SPECDEC_FEWROW_KERNEL": "0"})


@needs_kernel
def test_kernel_is_built_once_into_the_cache(tmp_path):
    assert _probe({"SPECDEC_CACHE_DIR": str(tmp_path)}) == "None"
    built = list((tmp_path / "kernels").glob("fewrow-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    assert _probe({"SPECDEC_CACHE_DIR": str(tmp_path)}) == "None"  # the second process loads the same file
    manifest = built[0].with_name(built[0].name + ".sha256")
    assert built[0].stat().st_mtime_ns == stamp and sorted((tmp_path / "kernels").iterdir()) == [built[0], manifest]
    assert (tmp_path / "kernels").stat().st_mode & 0o777 == 0o700  # private: nobody else can plant a library


@needs_kernel
def test_a_library_planted_in_the_cache_never_runs(tmp_path):
    """Issue 24, item 15: a shared object dropped into the cache under the kernel's name is not
    loaded (its hash is not the manifest's: the kernel is rebuilt), and nothing in a cache
    directory others can write is loaded at all."""
    cache = {"SPECDEC_CACHE_DIR": str(tmp_path)}
    assert _probe(cache) == "None"
    (library,) = (tmp_path / "kernels").glob("fewrow-*.so")
    marker = tmp_path / "planted-code-ran"
    planted_source = tmp_path / "planted.c"
    planted_source.write_text(
        "#include <stdio.h>\n"
        f'__attribute__((constructor)) static void run(void) {{ fclose(fopen("{marker}", "w")); }}\n'
        "int fewrow_mm(void) { return 0; }\n"
    )
    cc = fewrow._compiler()
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(library), str(planted_source)], check=True)
    assert _probe(cache) == "None"  # rebuilt, and the real kernel loaded
    assert not marker.exists()
    assert fewrow._sha256(library) == library.with_name(library.name + ".sha256").read_text()

    subprocess.run([cc, "-shared", "-fPIC", "-o", str(library), str(planted_source)], check=True)
    (tmp_path / "kernels").chmod(0o777)  # a directory anyone may write: trusted for nothing
    assert "writable by others" in _probe(cache)
    assert not marker.exists()


def test_without_a_compiler_it_says_so_once_and_products_fall_back(tmp_path):
    code = (
        "import torch; from specdec.modeling import fewrow, ops\n"
        "x, w = torch.randn(3, 32), torch.randn(8, 32)\n"
        "assert torch.allclose(ops.product(x, w), x @ w.t(), atol=1e-5)\n"
        "ops.product(x, w)\n"
        "print(fewrow.unavailable_reason())"
    )
    env = {**os.environ, "PATH": str(tmp_path), "CC": str(tmp_path / "no-cc"), "SPECDEC_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert result.returncode == 0, result.stderr
    # (on a CPU without AVX-512F that is the reason given first)
    assert ("no C compiler" if fewrow._cpu_has_avx512f() else "AVX-512F") in result.stdout
    assert result.stderr.count("few-row product kernel unavailable") == 1


# -- the decoder layers in one call (fewrow_batch) --------------------------------------------------
def kernel_llama(seed: int = 0, num_layers: int = 2):
    """Grouped-query attention (4 query heads over 2 KV heads) with widths the layer kernel covers
    (head_dim 16, hidden 64, MLP 128); 64 tokens."""
    from specdec.modeling.tiny import tiny_llama

    return tiny_llama(
        vocab_size=64,
        seed=seed,
        hidden_size=64,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        init_range=0.2,
        max_positions=512,
    )


needs_layers = pytest.mark.skipif(
    REASON is not None or not fewrow.layers_available(),
    reason=f"layer kernel unavailable: {REASON or 'SPECDEC_FEWROW_LAYERS=0'}",
)


@needs_layers
def test_layer_kernel_equals_the_torch_layers_through_steps_and_rollbacks():
    lean = lean_llama.LeanLlama(kernel_llama())
    assert lean._kernel_layers is not None
    generator = torch.Generator().manual_seed(5)
    kernel_cache, torch_cache = lean.new_cache(), lean.new_cache()
    prompt = torch.randint(0, 64, (70,), generator=generator)  # the prefill (70 rows) runs in torch
    lean.forward(prompt, kernel_cache, 1)
    lean.forward(prompt, torch_cache, 1)
    saved = lean._kernel_layers
    for step in range(80):  # rows 1..4, part of each block rolled back, the cache grows past 64 and 128
        rows = 1 + step % 4
        block = torch.randint(0, 64, (rows,), generator=generator)
        fast = lean.forward(block, kernel_cache, rows)
        lean._kernel_layers = None
        try:
            slow = lean.forward(block, torch_cache, rows)
        finally:
            lean._kernel_layers = saved
        torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
        for mine, theirs in zip(kernel_cache.positions(), torch_cache.positions(), strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
        drop = step % rows
        if drop:
            kernel_cache.crop(-drop)
            torch_cache.crop(-drop)
    assert kernel_cache.length > 128


@needs_layers
@pytest.mark.parametrize("rows", [2, 3, 4])
def test_a_block_gives_bit_for_bit_what_one_row_passes_give(rows):
    """Why it matters: the target's verdict on proposal i must not depend on k, so a greedy
    speculative run emits exactly the target-only tokens, ties included."""
    lean = lean_llama.LeanLlama(kernel_llama(seed=2))
    prompt = torch.arange(3, 40)
    block = torch.tensor([7, 11, 13, 17][:rows])
    one_by_one, whole = lean.new_cache(), lean.new_cache()
    lean.forward(prompt, one_by_one, 1)
    lean.forward(prompt, whole, 1)
    singles = torch.cat([lean.forward(block[i : i + 1], one_by_one, 1) for i in range(rows)])
    assert torch.equal(lean.forward(block, whole, rows), singles)
    for mine, theirs in zip(whole.positions(), one_by_one.positions(), strict=True):
        assert torch.equal(mine, theirs)


def test_layer_kernel_declines_what_it_does_not_cover(monkeypatch):
    from specdec.modeling.tiny import tiny_llama

    narrow = lean_llama.LeanLlama(tiny_llama(vocab_size=32, hidden_size=32, num_heads=4, num_kv_heads=2))
    assert narrow._kernel_layers is None  # head_dim 8: not a multiple of 16
    assert lean_llama.LeanLlama(kernel_llama().to(torch.float64))._kernel_layers is None
    monkeypatch.setenv("SPECDEC_FEWROW_LAYERS", "0")
    assert not fewrow.layers_available()
    assert lean_llama.LeanLlama(kernel_llama())._kernel_layers is None


@needs_layers
def test_layer_kernel_refuses_what_does_not_fit_and_touches_nothing():
    """It writes through raw pointers: a shape or layout it was not given must be refused."""
    lean = lean_llama.LeanLlama(kernel_llama())
    cache = lean.new_cache()
    cache.reserve(8)
    cos, sin = lean._rope_table(8)
    pool = lean.pool
    keys_before = pool.keys.clone()

    def layers(x, start=0, keys=pool.keys, table=None, rows_cos=None, rows=None):
        """The kernel over x as one sequence's ``rows`` (default: all of x's rows)."""
        n = x.shape[0]
        table = cache.table() if table is None else table
        rows_cos = cos[start : start + n] if rows_cos is None else rows_cos
        segment = (table, start, n if rows is None else rows)
        return fewrow.batch_layers(
            x,
            lean._kernel_layers,
            keys,
            pool.values,
            [segment],
            rows_cos,
            sin[start : start + n],
            4,
            2,
            16,
            128,
            lean.eps,
            lean.scaling,
        )

    def refused(x, **kwargs):
        before = x.clone()
        return not layers(x, **kwargs) and torch.equal(x, before)

    assert refused(torch.randn(0, 64))  # no rows
    assert refused(torch.randn(3, 64), start=cache.capacity - 2)  # past the blocks the table holds
    assert refused(torch.randn(3, 64), table=torch.tensor([pool.capacity]))  # a block outside the pool
    assert refused(torch.randn(3, 64), table=torch.tensor([-1]))
    assert refused(torch.randn(3, 64), table=cache.table().int())  # not int64 ids
    assert refused(torch.randn(3, 64), rows_cos=cos[:2])  # rotary rows for another block
    assert refused(torch.randn(3, 64), keys=pool.keys.transpose(3, 4))  # not the pool layout
    assert refused(torch.randn(64, 3).t())  # non-contiguous rows
    assert refused(torch.randn(3, 64), rows=2)  # the segments do not cover x's rows
    assert torch.equal(pool.keys, keys_before)
    assert layers(torch.randn(3, 64))  # the same call, well formed


@needs_layers
@pytest.mark.statistical
@pytest.mark.parametrize("params, k", [({"temperature": 1.0}, 3), ({"temperature": 0.7, "top_p": 0.9}, 2)])
def test_statistical_exactness_through_the_layer_kernel(params, k):
    """Speculative runs whose target and draft passes go through the layer kernel follow the law
    transformers' forward gives (alpha = selftest.ALPHA = 1e-3, fixed seeds: deterministic)."""
    from specdec.apps import selftest
    from specdec.engine.draft import DraftEngine
    from specdec.modeling.tiny import perturbed

    target = kernel_llama(seed=11, num_layers=1)
    draft = DraftEngine(perturbed(target, scale=0.3, seed=23), top_m=0, eps=0.0)
    assert draft.store.runner._kernel_layers is not None
    case = selftest.Case("layer_kernel", "target and draft through fewrow_batch", params, k=k, tokens=2)
    result = selftest.check_pair(case, target, draft, runs=600)
    assert result.passed, f"p={result.p_value:.2e} tv={result.tv:.3f} {result.detail}"
    assert 0.0 < result.acceptance_rate < 1.0


# -- bfloat16 twins of weights that are bf16 values (a draft shipped in bf16) -----------------------
def test_only_weights_that_are_bf16_values_get_a_twin():
    exact = torch.randn(64, 32).bfloat16().float()
    twin = fewrow.lossless_bf16(exact)
    assert twin is not None and twin.dtype == torch.bfloat16 and torch.equal(twin.float(), exact)
    assert fewrow.lossless_bf16(torch.randn(64, 32)) is None  # float32 values: a twin would round them
    late = exact.clone()
    late[-1, -1] += 1e-4  # past the first 4096 values checked up front: the full check must catch it
    assert (
        fewrow.lossless_bf16(torch.cat([exact] * 3)) is not None
        and fewrow.lossless_bf16(torch.cat([exact] * 2 + [late])) is None
    )


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_a_bf16_twin_gives_the_float32_products_bit_for_bit(rows):
    generator = torch.Generator().manual_seed(rows)
    w = torch.randn(300, 576, generator=generator).bfloat16().float()
    x = torch.randn(rows, 576, generator=generator)
    assert torch.equal(fewrow.few_row_product(x, fewrow.lossless_bf16(w)), fewrow.few_row_product(x, w))


@needs_layers
def test_a_model_of_bf16_values_runs_its_layers_and_head_from_twins_with_the_same_logits():
    model = kernel_llama(seed=4)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.bfloat16().float())
    twinned, reference = lean_llama.LeanLlama(model), lean_llama.LeanLlama(copy.deepcopy(model))
    assert all(slot.bf16 == 1 for slot in twinned._kernel_layers) and twinned._head_twin is not None
    for slot, (_, wqkv, wo, _, wgu, wdown) in zip(reference._kernel_layers, reference.layers, strict=True):
        slot.bf16 = 0  # the reference reads the float32 weights
        slot.wqkv, slot.wo, slot.wgu, slot.wdown = wqkv.data_ptr(), wo.data_ptr(), wgu.data_ptr(), wdown.data_ptr()
    reference._head_twin = None
    prompt, block = torch.arange(2, 30), torch.tensor([5, 9, 33])
    for lean in (twinned, reference):
        lean.cache = lean.new_cache()
        lean.forward(prompt, lean.cache, 1)
    assert torch.equal(twinned.forward(block, twinned.cache, 3), reference.forward(block, reference.cache, 3))
