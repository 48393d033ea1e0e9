import numpy as np
import pytest
import torch

from specdec.errors import MalformedProposalError
from specdec.exact.sparse import SparseDist, inverse_cdf, sample_dense, sample_sparse, truncate, validate_sparse


def test_truncate_top_m_keeps_largest_and_renormalises():
    probs = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15])
    q = truncate(probs, top_m=2)
    assert q.token_ids.tolist() == [1, 3]
    assert q.probs.sum() == pytest.approx(1.0, abs=1e-6)
    assert q.normalised() == pytest.approx([0.4 / 0.7, 0.3 / 0.7])


def test_truncate_eps_keeps_smallest_covering_set():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert truncate(probs, eps=0.1).token_ids.tolist() == [0, 1, 2]  # 0.95 >= 0.9
    assert truncate(probs, eps=0.25).token_ids.tolist() == [0, 1]  # 0.8 >= 0.75
    assert truncate(probs).token_ids.tolist() == [0, 1, 2, 3]  # no policy: keeps all mass
    assert truncate(torch.tensor([0.0, 1.0, 0.0])).token_ids.tolist() == [1]  # zeros dropped


def test_truncate_ties_break_toward_lower_id():
    assert truncate(torch.tensor([0.25, 0.25, 0.25, 0.25]), top_m=2).token_ids.tolist() == [0, 1]


def _truncate_by_full_sort(probs, top_m, eps):
    """The policy spelled out on a sort of the whole row (the definition the fast path must match)."""
    p = probs.to(torch.float64)
    order = sorted(range(len(p)), key=lambda i: (-float(p[i]), i))
    kept, mass = [], 0.0
    for i in order:
        if p[i] <= 0 or (top_m and len(kept) == top_m) or (eps and mass >= 1.0 - eps):
            break
        kept.append(i)
        mass += float(p[i])
    return kept or [order[0]]


@pytest.mark.parametrize("top_m, eps", [(1, 0.0), (4, 0.0), (16, 0.0), (4, 1e-4), (16, 0.3), (0, 0.2), (64, 0.0)])
def test_truncate_matches_the_full_sort_definition_with_ties_and_zeros(top_m, eps):
    gen = torch.Generator().manual_seed(top_m * 1000 + int(eps * 1e4))
    for trial in range(40):
        size = int(torch.randint(2, 200, (1,), generator=gen))
        # Few distinct levels: many ties, often straddling the top_m boundary; some exact zeros.
        levels = torch.randint(0, 6, (size,), generator=gen).to(torch.float32)
        if trial % 4 == 0:
            levels = torch.zeros(size)
            levels[int(torch.randint(0, size, (1,), generator=gen))] = 1.0  # one-hot (greedy)
        probs = levels / levels.sum()
        assert truncate(probs, top_m, eps).token_ids.tolist() == _truncate_by_full_sort(probs, top_m, eps)


def test_inverse_cdf_is_exact_on_the_shipped_order():
    q = SparseDist.of([9, 4, 7], [0.5, 0.25, 0.25])
    assert sample_sparse(q, 0.0) == 9
    assert sample_sparse(q, 0.4999) == 9
    assert sample_sparse(q, 0.5) == 4
    assert sample_sparse(q, 0.75) == 7
    assert sample_sparse(q, 0.999999) == 7


def test_sampling_never_returns_a_zero_probability_token():
    weights = np.array([0.0, 0.5, 0.0, 0.5, 0.0])
    for u in np.linspace(0, 1, 1001, endpoint=False):
        assert weights[inverse_cdf(weights, float(u))] > 0
    assert sample_dense(torch.tensor([0.0, 0.0, 1.0]), 0.9999999999) == 2


@pytest.mark.parametrize(
    "ids, probs, proposal, message",
    [
        ([1, 2], [0.5, float("nan")], None, "finite"),
        ([1, 2], [1.5, -0.5], None, "non-negative"),
        ([1, 2], [0.5, 0.4], None, "sum"),
        ([1, 1], [0.5, 0.5], None, "duplicate"),
        ([1, 99], [0.5, 0.5], None, "vocabulary"),
        ([1, 2], [0.5, 0.5], 3, "not in the support"),
        ([1, 2], [1.0, 0.0], 2, "q = 0"),
        ([], [], None, "empty"),
    ],
)
def test_validation_rejects_malformed_q_with_a_clear_error(ids, probs, proposal, message):
    with pytest.raises(MalformedProposalError, match=message):
        validate_sparse(SparseDist.of(ids, probs), proposal=proposal, vocab_size=10)


def test_validation_accepts_rounding_within_tolerance():
    validate_sparse(SparseDist.of([0, 1], [0.49996, 0.5]), proposal=1, vocab_size=2)
