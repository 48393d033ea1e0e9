"""Row-count invariant products (specdec/modeling/invariant.py): the chunked product equals the
plain one up to rounding, the probe tells invariant from not, and on this machine the shapes of
the default target measure as the module says."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec.modeling.invariant import K_CHUNK, ChunkedLinear, chunk_bounds, rows_invariant


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chunked_product_is_the_product_up_to_rounding(dtype):
    torch.manual_seed(0)
    weight = torch.randn(96, 1300, dtype=dtype)
    x = torch.randn(7, 1300, dtype=dtype)
    chunked = ChunkedLinear(weight)
    assert [e - s for s, e in chunked.bounds] == [K_CHUNK, K_CHUNK, 1300 - 2 * K_CHUNK]
    tolerance = 1e-3 if dtype == torch.float32 else 0.5
    assert torch.allclose(chunked(x).float(), F.linear(x, weight).float(), atol=tolerance, rtol=1e-2)
    narrow = ChunkedLinear(weight[:, :300].contiguous())
    assert len(narrow.chunks) == 1 and torch.equal(narrow(x[:, :300].contiguous()), narrow(x[:, :300].contiguous()))
    with pytest.raises(ValueError):
        ChunkedLinear(weight, chunk=0)


def test_a_narrow_tail_joins_the_chunk_before():
    assert chunk_bounds(576) == [(0, 576)]  # SmolLM2's hidden size: one product, not 512 + 64
    assert chunk_bounds(1536) == [(0, 512), (512, 1024), (1024, 1536)]
    assert chunk_bounds(1100) == [(0, 512), (512, 1100)]
    assert chunk_bounds(300) == [(0, 300)]


def test_the_probe_tells_a_row_count_dependent_function_from_an_invariant_one():
    assert rows_invariant(lambda x: x * 2.0, 8, torch.float32, "cpu")
    # a function whose rows depend on how many there are (as a GEMM's blocking can)
    assert not rows_invariant(lambda x: x + x.shape[0] * 1e-3, 8, torch.float32, "cpu")
    # or on where a row sits in the batch
    assert not rows_invariant(lambda x: x + torch.arange(x.shape[0]).unsqueeze(1) * 1e-3, 8, torch.float32, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_default_targets_shapes_chunked_are_row_count_invariant_here(dtype):
    """SmolLM2-135M's products (qkv 1728x576, o 576x576, gate/up 3072x576, down 576x1536), chunked:
    what the torch batched pass will rely on, checked on this machine (the probe, not the module's
    claim, decides at load time elsewhere). The plain down projection is the counter-example."""
    torch.manual_seed(1)
    for out_features, in_features in ((1728, 576), (576, 576), (3072, 576), (576, 1536)):
        chunked = ChunkedLinear(torch.randn(out_features, in_features, dtype=dtype))
        assert rows_invariant(chunked, in_features, dtype, "cpu"), (out_features, in_features, dtype)
