"""The few-row product kernel (specdec/fewrow.py, specdec/kernels/fewrow.c) computes x @ w^T.

It is compiled here on first use; where it cannot run (no AVX-512F, no C compiler) the tests that
need it are skipped with the reason, and the lean pass keeps torch's product (tested as well).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from specdec import fewrow, lean_llama

REASON = fewrow.unavailable_reason()
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"few-row kernel unavailable: {REASON}")


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
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


def test_kernel_declines_what_it_does_not_cover():
    w = torch.randn(8, 32)
    assert fewrow.few_row_product(torch.randn(5, 32), w) is None  # more than 4 rows
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

    monkeypatch.setattr(lean_llama, "few_row_product", recorded)
    w = torch.randn(40, 32)
    for rows in (1, 2, 3, 4, 5):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(lean_llama.product(x, w), x @ w.t(), rtol=1e-5, atol=1e-5)
    assert calls == [1, 2, 3, 4]


def _probe(env: dict) -> str:
    code = "from specdec import fewrow; print(fewrow.unavailable_reason())"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, **env}).stdout.strip()


def test_switch_turns_the_kernel_off():
    assert "SPECDEC_FEWROW_KERNEL" in _probe({"SPECDEC_FEWROW_KERNEL": "0"})


@needs_kernel
def test_kernel_is_built_once_into_the_cache(tmp_path):
    assert _probe({"SPECDEC_CACHE_DIR": str(tmp_path)}) == "None"
    built = list((tmp_path / "kernels").glob("fewrow-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    assert _probe({"SPECDEC_CACHE_DIR": str(tmp_path)}) == "None"  # the second process loads the same file
    assert built[0].stat().st_mtime_ns == stamp and list((tmp_path / "kernels").iterdir()) == built


def test_without_a_compiler_it_says_so_once_and_products_fall_back(tmp_path):
    code = ("import torch; from specdec import fewrow, lean_llama\n"
            "x, w = torch.randn(3, 32), torch.randn(8, 32)\n"
            "assert torch.allclose(lean_llama.product(x, w), x @ w.t(), atol=1e-5)\n"
            "lean_llama.product(x, w)\n"
            "print(fewrow.unavailable_reason())")
    env = {**os.environ, "PATH": str(tmp_path), "CC": str(tmp_path / "no-cc"), "SPECDEC_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    # (on a CPU without AVX-512F that is the reason given first)
    assert ("no C compiler" if fewrow._cpu_has_avx512f() else "AVX-512F") in result.stdout
    assert result.stderr.count("few-row product kernel unavailable") == 1
