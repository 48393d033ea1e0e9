import numpy as np
import pytest
import torch

from specdec.errors import MalformedProposalError
from specdec.sparse import SparseDist, inverse_cdf, sample_dense, sample_sparse, truncate, validate_sparse


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
