"""The transform pipeline: each transform's semantics, validation, degenerate inputs."""

import math

import pytest
import torch

from specdec.errors import InvalidArgumentError, NonFiniteLogitsError
from specdec.exact.sampling import SamplingParams, block_token_counts, greedy_tokens, probs_from_logits, token_counts

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0])


def probs(params, logits=LOGITS, counts=None):
    return probs_from_logits(logits, SamplingParams(**params), counts)


def test_plain_softmax_in_float32_sums_to_one():
    p = probs({})
    assert p.dtype == torch.float32
    assert torch.allclose(p, torch.softmax(LOGITS, -1))


def test_temperature_scales_logits():
    assert torch.allclose(probs({"temperature": 0.5}), torch.softmax(LOGITS / 0.5, -1))


def test_top_k_keeps_the_k_largest_and_ties_at_the_boundary():
    p = probs({"top_k": 2})
    assert (p > 0).nonzero().flatten().tolist() == [0, 5]
    tied = torch.tensor([1.0, 2.0, 2.0, 2.0, 0.0])
    assert (probs({"top_k": 2}, tied) > 0).nonzero().flatten().tolist() == [1, 2, 3]


def test_top_p_keeps_the_smallest_set_reaching_p():
    full = torch.softmax(LOGITS, -1)  # order by prob: 5, 0, 1, 2, 3, 4
    p = probs({"top_p": 0.8})
    kept = (p > 0).nonzero().flatten().tolist()
    sorted_mass = full.sort(descending=True).values.cumsum(0)
    need = int((sorted_mass < 0.8).sum()) + 1
    assert len(kept) == need and set(kept) == set(full.argsort(descending=True)[:need].tolist())
    assert torch.allclose(p[kept], full[kept] / full[kept].sum())


def test_min_p_keeps_tokens_above_fraction_of_max():
    full = torch.softmax(LOGITS, -1)
    p = probs({"min_p": 0.2})
    assert torch.equal(p > 0, full >= 0.2 * full.max())


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    counts = token_counts([0, 4], 6)
    p = probs({"repetition_penalty": 2.0}, counts=counts)
    expected = LOGITS.clone()
    expected[0] = 2.0 / 2.0
    expected[4] = -1.0 * 2.0
    assert torch.allclose(p, torch.softmax(expected, -1))


def test_presence_and_frequency_penalties():
    counts = token_counts([1, 1, 2], 6)
    p = probs({"presence_penalty": 0.5, "frequency_penalty": 0.25}, counts=counts)
    expected = LOGITS - 0.5 * (counts > 0).float() - 0.25 * counts
    assert torch.allclose(p, torch.softmax(expected, -1))


def test_logit_bias():
    p = probs({"logit_bias": {3: 10.0}})
    expected = LOGITS.clone()
    expected[3] += 10.0
    assert torch.allclose(p, torch.softmax(expected, -1))


def test_block_counts_are_position_wise():
    base = token_counts([1], 4)
    counts = block_token_counts(base, [2, 2, 3])
    assert counts.tolist() == [
        [0, 1, 0, 0],
        [0, 1, 1, 0],
        [0, 1, 2, 0],
        [0, 1, 2, 1],
    ]


def test_greedy_is_one_hot_with_ties_to_lowest_id():
    p = probs({"temperature": 0.0}, torch.tensor([1.0, 3.0, 3.0, 2.0]))
    assert p.tolist() == [0.0, 1.0, 0.0, 0.0]


def test_greedy_probs_and_logprobs_agree_after_bias_and_penalties():
    from specdec.exact.sampling import logprobs_from_logits, probs_from_logits, token_counts

    logits = torch.tensor([[1.0, 4.0, 3.9, 2.0, -1.0], [0.5, 0.5, 0.1, 0.2, 0.3]])
    counts = token_counts([1, 1], 5)
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5, logit_bias={4: 10.0})
    # row 0: token 1 is penalised (4 / 1.5 < 3.9), the bias makes token 4 (9.0) the argmax
    # row 1: the bias wins again; without it, the tie 0.5 / 0.5 -> 0.333 would go to token 0
    p = probs_from_logits(logits, params, counts)
    assert p.tolist() == [[0.0, 0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0, 1.0]]
    assert torch.equal(logprobs_from_logits(logits, params, counts).exp(), p)
    plain = SamplingParams(temperature=0.0)
    assert probs_from_logits(logits, plain).argmax(-1).tolist() == [1, 0]  # ties to the lowest id
    assert logprobs_from_logits(logits, plain)[1].tolist() == [0.0] + [float("-inf")] * 4


def test_tiny_temperature_is_stable_and_nearly_one_hot():
    p = probs({"temperature": 1e-4})
    assert torch.isfinite(p).all()
    assert p[5] == pytest.approx(1.0, abs=1e-6)
    assert p.sum() == pytest.approx(1.0, abs=1e-6)


def test_neg_inf_logits_are_impossible_tokens_not_errors():
    logits = torch.tensor([0.0, -math.inf, 1.0])
    assert probs({}, logits)[1] == 0.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_logits_raise_a_clear_error(bad):
    with pytest.raises(NonFiniteLogitsError, match="NaN or \\+inf"):
        probs({}, torch.tensor([0.0, bad, 1.0]))
    with pytest.raises(NonFiniteLogitsError, match="empty"):
        probs({}, torch.full((3,), -math.inf))
    # several rows: a bad value anywhere wins over an empty row, and greedy takes the same checks
    rows = torch.tensor([[0.0, 1.0, 2.0], [-math.inf] * 3, [-math.inf, bad, 0.0]])
    with pytest.raises(NonFiniteLogitsError, match="NaN or \\+inf"):
        probs({}, rows)
    with pytest.raises(NonFiniteLogitsError, match="NaN or \\+inf"):
        greedy_tokens(rows, SamplingParams(temperature=0.0))
    with pytest.raises(NonFiniteLogitsError, match="empty"):
        greedy_tokens(rows[:2], SamplingParams(temperature=0.0))


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_k", -1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", 1.0),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("seed", -1),
        ("seed", 2**64),
        ("max_new_tokens", 0),
        ("stop", ("",)),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", dict.fromkeys(range(1025), 1.0)),  # bounded in entries (issue 24, item 7)
        ("stop", ("x",) * 17),
        ("stop", ("x" * 513,)),
    ],
)
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(InvalidArgumentError) as info:
        SamplingParams(**{field: value})
    assert info.value.field.startswith(field)


def test_logit_bias_outside_vocab_is_refused():
    with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
        SamplingParams(logit_bias={10: 1.0}).validate_for_vocab(10)


def test_subset_head_is_the_full_head_on_its_tokens_and_minus_inf_elsewhere():
    from specdec.modeling.heads import SubsetHead

    torch.manual_seed(0)
    weight = torch.randn(10, 4)
    hidden = torch.randn(2, 3, 4)
    ids = torch.tensor([1, 4, 7])
    out = SubsetHead(weight, ids, 10)(hidden)
    full = hidden @ weight.T
    assert out.shape == (2, 3, 10)
    assert torch.allclose(out[..., ids], full[..., ids])
    rest = torch.tensor([i for i in range(10) if i not in (1, 4, 7)])
    assert torch.isneginf(out[..., rest]).all()
    for bad in (torch.tensor([1, 1]), torch.tensor([10]), torch.tensor([-1]), torch.tensor([], dtype=torch.long)):
        with pytest.raises(ValueError):
            SubsetHead(weight, bad, 10)


def test_probs_of_a_reduced_head_are_zero_outside_it_under_every_transform():
    logits = torch.tensor([1.0, float("-inf"), 0.5, float("-inf"), 2.0])
    counts = torch.tensor([0.0, 3.0, 1.0, 0.0, 0.0])
    for params in (
        SamplingParams(temperature=0.7),
        SamplingParams(top_k=2),
        SamplingParams(top_p=0.9),
        SamplingParams(min_p=0.1),
        SamplingParams(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3),
    ):
        probs = probs_from_logits(logits, params, counts)
        assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1) < 1e-6
        assert probs[1] == 0 and probs[3] == 0


@pytest.mark.parametrize("seed", range(6))
def test_greedy_fast_paths_equal_the_general_ones(seed):
    """The draft's greedy q and the target's greedy verdict, computed from argmaxes only, are what
    the dense pipeline and the general verifier give -- with ties, bias and penalties, and any
    q (one-hot or not, containing the argmax or not)."""
    from specdec.exact.sampling import greedy_tokens
    from specdec.exact.sparse import SparseDist, sample_sparse, truncate
    from specdec.exact.verify import target_verify, target_verify_greedy

    gen = torch.Generator().manual_seed(seed)
    vocab, k = 40, 3
    logits = torch.randint(-3, 4, (k + 1, vocab), generator=gen).float()  # integer logits: many ties
    params = SamplingParams(
        temperature=0.0, seed=seed, logit_bias={5: 2.0, 7: -1.0}, repetition_penalty=1.3, presence_penalty=0.4
    )
    proposals = torch.randint(0, vocab, (k,), generator=gen).tolist()
    counts = block_token_counts(token_counts([5, 5, 9, 1], vocab), proposals)
    argmax = greedy_tokens(logits, params, counts)
    dense = probs_from_logits(logits, params, counts)
    assert torch.equal(dense.argmax(-1), argmax) and torch.equal(dense.sum(-1), torch.ones(k + 1))
    for row in range(k + 1):  # the draft's q: the one-hot the pipeline + truncation would ship
        q = truncate(dense[row], 64, 1e-4)
        assert q == SparseDist.one_hot(int(argmax[row])) and sample_sparse(q, 0.37) == int(argmax[row])
    other = int(argmax[1]) if int(argmax[1]) != proposals[1] else (proposals[1] + 1) % vocab
    qs = [
        SparseDist.one_hot(proposals[0]),
        SparseDist.of([proposals[1], other], [0.5, 0.5]),
        SparseDist.of([proposals[2], (proposals[2] + 1) % vocab], [0.9, 0.1]),
    ]
    assert target_verify(dense, proposals, qs, seed, 10) == target_verify_greedy(argmax.tolist(), proposals)


def test_presence_and_frequency_count_only_generated_tokens_repetition_the_prompt_too():
    """OpenAI's and vLLM's meaning: the additive penalties see the generated tokens; the
    multiplicative repetition penalty (transformers') sees the prompt as well."""
    logits = torch.tensor([1.0, 1.0, 1.0, 1.0])
    generated = token_counts([1, 1], 4)  # token 1 generated twice
    prompt_seen = token_counts([2], 4) > 0  # token 2 only in the prompt
    additive = SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25)
    p = probs_from_logits(logits, additive, generated, prompt_seen=prompt_seen)
    expected = torch.softmax(torch.tensor([1.0, 1.0 - 0.5 - 0.5, 1.0, 1.0]), -1)
    assert torch.allclose(p, expected)  # token 2 (prompt only) is not penalised
    repetition = SamplingParams(temperature=1.0, repetition_penalty=2.0)
    p = probs_from_logits(logits, repetition, generated, prompt_seen=prompt_seen)
    assert torch.allclose(p, torch.softmax(torch.tensor([1.0, 0.5, 0.5, 1.0]), -1))  # both seen


def test_min_tokens_keeps_eos_and_stop_ids_out_until_enough_are_generated():
    logits = torch.zeros(2, 5)
    params = SamplingParams(temperature=1.0, min_tokens=2, max_new_tokens=8, stop_token_ids=(3,), eos_token_ids=(4,))
    counts = torch.stack([token_counts([1], 5), token_counts([1, 2], 5)])  # 1 and 2 generated so far
    p = probs_from_logits(logits, params, counts)
    assert p[0].tolist() == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0.0, 0.0])  # too early to end
    assert p[1].tolist() == pytest.approx([0.2] * 5)  # two generated: anything goes
    greedy = SamplingParams(temperature=0.0, min_tokens=1, eos_token_ids=(0,))
    assert int(greedy_tokens(torch.tensor([5.0, 1.0, 2.0]), greedy, token_counts([], 3))) == 2
    with pytest.raises(InvalidArgumentError, match="min_tokens"):
        SamplingParams(min_tokens=9, max_new_tokens=8)
    with pytest.raises(ValueError, match="min_tokens"):
        probs_from_logits(logits, params)  # the counts say how many are generated: required


def test_values_that_would_overflow_float32_are_greedy_or_refused():
    """A tiny temperature or repetition penalty, or a huge bias, would turn logits to inf and the
    distribution to NaN (INTERNAL); now greedy (vLLM's rule) or INVALID_ARGUMENT naming the field."""
    logits = torch.tensor([[30.0, 29.0, -5.0]])
    tiny = SamplingParams(temperature=1e-38)
    assert tiny.greedy and probs_from_logits(logits, tiny).tolist() == [[1.0, 0.0, 0.0]]
    assert not SamplingParams(temperature=1e-4).greedy
    assert torch.isfinite(probs_from_logits(logits, SamplingParams(temperature=1e-4))).all()
    with pytest.raises(InvalidArgumentError, match="logit_bias"):
        SamplingParams(temperature=0.5, logit_bias={1: 3e38})
    with pytest.raises(InvalidArgumentError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=1e-38)
    extreme = SamplingParams(temperature=1e-5, logit_bias={2: 100.0}, repetition_penalty=0.01, frequency_penalty=2.0)
    assert torch.isfinite(probs_from_logits(logits, extreme, token_counts([2, 2], 3))).all()


def test_rows_of_many_sessions_transform_as_each_alone_bit_for_bit():
    """The pipeline over the rows of several sessions at once, each row with its own parameters
    (what a pass's verdicts are computed with: specdec.engine.target.VerifyRows), gives every
    row the bits it gets with its session alone -- and a step a row's parameters leave out
    leaves the row as it was."""
    from specdec.exact.sampling import RowParams, logprobs_from_logits, logprobs_rows

    generator = torch.Generator().manual_seed(4)
    sessions = [
        (SamplingParams(temperature=0.8, seed=1), 3),
        (SamplingParams(temperature=1.0, top_k=7, seed=1), 1),
        (SamplingParams(temperature=0.6, top_p=0.8, seed=1), 5),
        (SamplingParams(temperature=1.3, min_p=0.1, top_k=30, top_p=0.95, seed=1), 2),
        (SamplingParams(temperature=1.0, top_k=500, seed=1), 2),  # k past the vocabulary: no cut
    ]
    logits = torch.randn(sum(rows for _, rows in sessions), 200, generator=generator) * 3
    logits[3, :50] = logits[3].max() + 1.0  # 50 tied at the top of the top_k = 7 row: all kept
    together = logprobs_rows(logits, RowParams.of(sessions))
    row = 0
    for params, rows in sessions:
        alone = logprobs_from_logits(logits[row : row + rows], params)
        assert torch.equal(together[row : row + rows], alone)
        row += rows
    plain = logprobs_rows(logits[:3], RowParams.of(sessions[:1]))
    assert torch.equal(plain, torch.log_softmax(logits[:3] / torch.tensor(0.8), dim=-1))
    assert int(torch.isfinite(together[3]).sum()) == 50
    assert int(torch.isfinite(together[-1]).sum()) == 200  # top_k past the vocabulary cuts nothing
