"""The constrained law (issue 45): with the constraint applied as one more transform on both sides
-- the draft's q and the target's p masked by the same state-dependent allowed sets -- the exact
verifier's output is the target's constrained law, a token the constraint forbids is never
emitted, and greedy picks the best allowed token. Statistical, fixed seeds, alpha = 1e-3."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from scipy.stats import chisquare

from specdec.exact.constraint import constrained
from specdec.exact.sampling import SamplingParams, greedy_tokens, probs_from_logits
from specdec.exact.sparse import truncate
from specdec.exact.verify import decide, target_verify

pytestmark = pytest.mark.statistical

V = 6
ALPHA = 1e-3
TRIALS = 6_000
K = 2
EMITTED = 2  # the law checked: the first two emitted tokens, jointly


def allowed_after(prefix: tuple[int, ...]) -> torch.Tensor:
    """A toy grammar over 6 tokens whose allowed set depends on the last token: after an even
    token only odd ones, after an odd token only {0, 2, 5}; at the start {1, 2, 3}."""
    if not prefix:
        ids = [1, 2, 3]
    elif prefix[-1] % 2 == 0:
        ids = [1, 3, 5]
    else:
        ids = [0, 2, 5]
    mask = torch.zeros(V, dtype=torch.bool)
    mask[ids] = True
    return mask


def logits_after(prefix: tuple[int, ...], salt: int) -> torch.Tensor:
    """A model: logits as a fixed pseudo-random function of the prefix (float64)."""
    generator = torch.Generator().manual_seed(hash((salt, prefix)) & 0xFFFFFFFF)
    return torch.randn(V, generator=generator, dtype=torch.float64) * 1.5


PARAMS = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=8)


def law(prefix: tuple[int, ...], salt: int, dtype=torch.float64) -> torch.Tensor:
    return probs_from_logits(logits_after(prefix, salt).to(dtype), PARAMS, dtype=dtype, allowed=allowed_after(prefix))


def run_once(rng: random.Random, generator: torch.Generator) -> tuple[int, ...]:
    """One speculative step (k = 2) from the empty prefix, then one more if only one token came
    out: the first two emitted tokens."""
    emitted: tuple[int, ...] = ()
    while len(emitted) < EMITTED:
        proposals, qs, prefix = [], [], emitted
        for _ in range(K):
            q = law(prefix, salt=1, dtype=torch.float32)
            y = int(torch.multinomial(q, 1, generator=generator))
            proposals.append(y)
            qs.append(truncate(q, 0, 0.0))
            prefix = (*prefix, y)
        # the target's k + 1 rows, each under the mask of its own prefix (masks_along in the engines)
        rows = torch.stack([law((*emitted, *proposals[:i]), salt=2, dtype=torch.float32) for i in range(K + 1)])
        seed, position = rng.randrange(1 << 62), len(emitted)
        verdict = target_verify(rows, proposals, qs, seed, position)
        q_proposed = [q.prob(y) for q, y in zip(qs, proposals, strict=True)]
        emitted = (*emitted, *decide(proposals, q_proposed, verdict, seed, position).tokens)
    return emitted[:EMITTED]


def test_speculation_under_a_constraint_emits_the_targets_constrained_law():
    rng, generator = random.Random(7), torch.Generator().manual_seed(7)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(TRIALS):
        pair = run_once(rng, generator)
        counts[pair] = counts.get(pair, 0) + 1
    expected_law = {}
    for a, b in itertools.product(range(V), repeat=2):
        p = float(law((), 2)[a]) * float(law((a,), 2)[b])
        if p > 0:
            expected_law[(a, b)] = p
    forbidden = set(counts) - set(expected_law)
    assert not forbidden, f"emitted pairs the constraint forbids: {forbidden}"
    cells = sorted(expected_law)
    observed = [counts.get(c, 0) for c in cells]
    expected = [expected_law[c] * TRIALS for c in cells]
    assert min(expected) > 5  # the chi-square approximation holds
    assert chisquare(observed, expected).pvalue > ALPHA


def test_greedy_under_a_constraint_is_the_best_allowed_token():
    logits = torch.tensor([[5.0, 1.0, 4.0, 0.5, 3.0, 2.0]])
    greedy = SamplingParams(temperature=0.0)
    assert int(greedy_tokens(logits, greedy)) == 0
    assert int(greedy_tokens(logits, greedy, allowed=allowed_after(()))) == 2  # best of {1, 2, 3}
    one_hot = probs_from_logits(logits, greedy, allowed=allowed_after((1,)))  # {0, 2, 5}: token 0
    assert one_hot[0].tolist() == [1.0, 0, 0, 0, 0, 0]


def test_the_constraint_comes_after_the_bias_and_before_truncation():
    logits = torch.zeros(1, V)
    params = SamplingParams(temperature=1.0, top_k=1, logit_bias={4: 10.0, 3: 5.0})
    # the bias makes 4 the best, the mask forbids it, top-1 then keeps the best allowed: 3
    probs = probs_from_logits(logits, params, allowed=allowed_after(()))
    assert probs[0].tolist() == [0, 0, 0, 1.0, 0, 0]
    assert torch.equal(constrained(logits, allowed_after(())).isfinite()[0], allowed_after(()))
