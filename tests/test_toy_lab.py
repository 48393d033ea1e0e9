"""The toy lab of docs/exactness.md (one position, three tokens, worked by hand), reproduced with
the library's own functions, plus its variations and a seeded statistical check of the split
verifier (target_verify + decide) on dense p and q."""

import math
from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdec.errors import MalformedProposalError
from specdec.exact.sparse import SparseDist, validate_sparse
from specdec.exact.verify import decide, emission_law, target_verify

P = [0.50, 0.30, 0.20]
Q = [0.20, 0.50, 0.30]
ALPHA = 1e-3


def test_toy_lab_values_exact():
    law = emission_law(P, Q)
    assert law.accepted_mass == [0.2, 0.3, 0.2]
    assert law.residual_mass == [0.5 - 0.2, 0.0, 0.0]
    assert law.reject_probability == pytest.approx(0.3, abs=1e-15)
    assert law.corrected == [1.0, 0.0, 0.0]
    assert law.emitted == pytest.approx(P, abs=1e-15)


def test_variation_q_equals_p_never_rejects():
    law = emission_law(P, P)
    assert law.reject_probability == 0.0
    assert law.corrected is None  # no division by zero: the correction is never needed
    assert law.emitted == P
    # And the real decision procedure accepts every proposal, whatever the uniforms.
    p_rows = torch.tensor([P, P], dtype=torch.float32)
    q = SparseDist.of([0, 1, 2], P)
    for seed in range(300):
        for y in range(3):
            verdict = target_verify(p_rows, [y], [q], seed, first_position=7)
            decision = decide([y], [q.prob(y)], verdict, seed, first_position=7)
            assert decision.num_accepted == 1 and decision.tokens[0] == y


def test_variation_q_zero_on_target_supported_token():
    q = [0.0, 0.6, 0.4]  # the draft never proposes token 0, which the target likes
    law = emission_law(P, q)
    assert law.accepted_mass[0] == 0.0
    assert law.residual_mass[0] == 0.5
    assert law.emitted == pytest.approx(P, abs=1e-15)
    # A proposal of token 0 under this q cannot have been sampled: it is refused, not evaluated.
    with pytest.raises(MalformedProposalError, match="q = 0"):
        validate_sparse(SparseDist.of([0, 1, 2], q), proposal=0)


def _one_step_frequencies(p, q, n, seed_offset=0):
    """Empirical law of the first emitted token of a k=1 step (seeded, dense p and q)."""
    p_rows = torch.tensor([p, p], dtype=torch.float32)
    qd = SparseDist.of(range(len(q)), q)
    from specdec.exact.rng import Purpose, uniform
    from specdec.exact.sparse import sample_sparse

    counts = Counter()
    for seed in range(seed_offset, seed_offset + n):
        y = sample_sparse(qd, uniform(seed, 0, Purpose.DRAFT))
        verdict = target_verify(p_rows, [y], [qd], seed, first_position=0)
        counts[decide([y], [qd.prob(y)], verdict, seed, first_position=0).tokens[0]] += 1
    return np.array([counts[i] for i in range(len(p))])


@pytest.mark.statistical
def test_split_verifier_emits_the_target_law():
    """Chi-square at alpha = 1e-3 with seeds 0..N-1 (deterministic)."""
    rng = np.random.default_rng(1234)
    for _ in range(3):
        p = rng.dirichlet(np.ones(6) * 0.7)
        q = rng.dirichlet(np.ones(6) * 0.7)
        n = 6000
        observed = _one_step_frequencies(p.tolist(), q.tolist(), n)
        expected = torch.tensor(p, dtype=torch.float32).double().numpy()
        expected = expected / expected.sum() * n
        assert chisquare(observed, expected).pvalue >= ALPHA


@pytest.mark.statistical
def test_convergence_tv_shrinks_like_inverse_sqrt_n():
    """vLLM-style convergence: the TV distance between the empirical and the target law falls
    like 1/sqrt(N). Mean TV over 6 disjoint seed blocks at N=250 and N=4000 (16x more samples,
    ideally 4x smaller TV); deterministic, and we demand at least 2.5x."""
    p = [0.05, 0.4, 0.25, 0.2, 0.1]
    q = [0.3, 0.1, 0.3, 0.0, 0.3]  # q = 0 on a token the target likes: the residual supplies it
    target = np.array(p)

    def mean_tv(n):
        tvs = [
            0.5 * np.abs(_one_step_frequencies(p, q, n, seed_offset=10**6 * (r + 1)) / n - target).sum()
            for r in range(6)
        ]
        return float(np.mean(tvs))

    small, large = mean_tv(250), mean_tv(4000)
    assert large < small / 2.5
    # and the constant is the sampling-noise one, not a bias: E[TV] ~ 0.4 * sum(sqrt(p(1-p))) / sqrt(N)
    assert large < 2 * 0.4 * sum(math.sqrt(x * (1 - x)) for x in p) / math.sqrt(4000)
