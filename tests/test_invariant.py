"""Invariant sampling, the pure part (issue 26): the noise is a pure function of (seed, t, v) --
the same bits in another process, in any batch of positions -- Gumbel-max sampling with it has
the target's law for every transform, and speculative decoding with it emits exactly the
target-only tokens for any draft and any schedule. Statistical tests use fixed seeds and a
significance level of 1e-3 each."""

from __future__ import annotations

import hashlib
import random
import subprocess
import sys

import pytest
import torch
from scipy import stats

from specdec.exact.gumbel import gumbel_argmax, gumbel_noise, invariant_decision, uniforms
from specdec.exact.sampling import SamplingParams, logprobs_from_logits

ALPHA = 1e-3


def _digest(seed: int, positions: list[int], vocab: int) -> str:
    return hashlib.sha256(gumbel_noise(seed, positions, vocab).numpy().tobytes()).hexdigest()


def test_the_noise_is_a_pure_function_of_seed_position_and_token():
    code = (
        "import hashlib; from specdec.exact.gumbel import gumbel_noise; "
        "print(hashlib.sha256(gumbel_noise(123, [0, 5, 1000], 50000).numpy().tobytes()).hexdigest())"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == _digest(123, [0, 5, 1000], 50000)  # another process: the same bits
    alone = gumbel_noise(123, [5], 50000)[0]
    assert torch.equal(alone, gumbel_noise(123, [0, 5, 1000], 50000)[1])  # whatever else is in the batch
    assert not torch.equal(alone, gumbel_noise(123, [6], 50000)[0])
    assert not torch.equal(alone, gumbel_noise(124, [5], 50000)[0])
    assert torch.equal(gumbel_noise(123, [5], 100)[0], alone[:100])  # a token's noise ignores the vocabulary size


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_the_noise_is_the_same_bits_on_cuda():
    assert torch.equal(gumbel_noise(9, [0, 77], 151936, device="cuda").cpu(), gumbel_noise(9, [0, 77], 151936))


@pytest.mark.statistical
def test_the_uniforms_are_uniform_and_the_noise_is_gumbel():
    u = uniforms(2024, [3], 1 << 20)[0].numpy()
    counts, _ = torch.histogram(torch.from_numpy(u), bins=128, range=(0.0, 1.0))
    assert stats.chisquare(counts.numpy()).pvalue > ALPHA
    g = gumbel_noise(2025, [0, 1], 1 << 17).flatten().numpy()
    assert stats.kstest(g[:20000], stats.gumbel_r.cdf).pvalue > ALPHA


TRANSFORMS = {
    "temperature 1": SamplingParams(temperature=1.0),
    "temperature 0.6": SamplingParams(temperature=0.6),
    "top_k 5": SamplingParams(temperature=0.9, top_k=5),
    "top_p 0.8": SamplingParams(temperature=1.2, top_p=0.8),
    "min_p 0.05": SamplingParams(temperature=1.0, min_p=0.05),
    "logit_bias": SamplingParams(temperature=1.0, logit_bias={3: 2.0, 7: -5.0}),
}


@pytest.mark.statistical
@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_invariant_sampling_has_the_targets_law_for_every_transform(name):
    """x = argmax(log p + g) over 4000 seeds against p itself (the Gumbel-max trick), for the
    transformed distribution each sampling transform makes."""
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(7)) * 2.0
    logprobs = logprobs_from_logits(logits, TRANSFORMS[name])
    p = logprobs.exp()[0].double()
    draws = [gumbel_argmax(logprobs, gumbel_noise(seed, [0], 12))[0] for seed in range(4000)]
    observed = torch.bincount(torch.tensor(draws), minlength=12).double()
    assert observed[p == 0].sum() == 0  # a filtered token never wins
    keep = p > 0
    expected = p[keep] / p[keep].sum() * len(draws)  # float32 rows sum to 1 only to rounding
    assert stats.chisquare(observed[keep].numpy(), expected.numpy()).pvalue > ALPHA


# -- pathwise: any draft, any k, any schedule: the target-only tokens -------------------------------
@pytest.fixture(scope="module")
def models():
    from specdec.modeling.tiny import perturbed, tiny_llama

    target = tiny_llama(vocab_size=40, seed=11, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1)
    return target.eval(), perturbed(target, scale=0.3, seed=12).eval()


PARAMS = SamplingParams(temperature=0.9, top_k=20)


def _logprobs(model, tokens: list[int], rows: int) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, len(tokens) - rows :]
    return logprobs_from_logits(logits, PARAMS)


def target_only(model, prompt: list[int], seed: int, n: int) -> list[int]:
    tokens = list(prompt)
    while len(tokens) < len(prompt) + n:
        t = len(tokens)
        tokens += gumbel_argmax(_logprobs(model, tokens, 1), gumbel_noise(seed, [t], 40))
    return tokens[len(prompt) :]


def speculative(target, draft, prompt: list[int], seed: int, n: int, schedule) -> tuple[list[int], int]:
    """(tokens, accepted proposals): each step's k from ``schedule``, the draft proposing with
    the same noise (``draft`` None: a draft that proposes arbitrary tokens)."""
    tokens, accepted_total, step = list(prompt), 0, 0
    rng = random.Random(seed)
    while len(tokens) < len(prompt) + n:
        k, base = schedule(step), len(tokens)
        proposals: list[int] = []
        for i in range(k):
            if draft is None:
                proposals.append(rng.randrange(40))
            else:
                proposals += gumbel_argmax(_logprobs(draft, tokens + proposals, 1), gumbel_noise(seed, [base + i], 40))
        target_lp = _logprobs(target, tokens + proposals, k + 1)
        xs = gumbel_argmax(target_lp, gumbel_noise(seed, list(range(base, base + k + 1)), 40))
        accepted, emitted = invariant_decision(proposals, xs)
        tokens += emitted
        accepted_total += accepted
        step += 1
    return tokens[len(prompt) : len(prompt) + n], accepted_total


def fixed(k: int):
    return lambda step: k


SCHEDULES = {
    **{f"k={k}": fixed(k) for k in range(1, 9)},
    "k=0 then 3": lambda step: 0 if step % 2 else 3,
    "any k": lambda step: random.Random(step * 7919).randrange(0, 9),  # as a load-aware policy might
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_speculative_invariant_output_is_the_target_only_output(models, schedule):
    target, draft = models
    accepted = 0
    for seed in range(6):
        prompt = [1 + seed, 5, 9]
        expected = target_only(target, prompt, seed, 20)
        got, hits = speculative(target, draft, prompt, seed, 20, SCHEDULES[schedule])
        assert got == expected, (schedule, seed)
        accepted += hits
    if schedule != "k=0 then 3":
        assert accepted > 0  # the draft's proposals were accepted, not only corrected


def test_any_draft_even_a_useless_one_leaves_the_output_unchanged(models):
    target, _ = models
    for seed in range(4):
        expected = target_only(target, [2, 3], seed, 16)
        assert speculative(target, None, [2, 3], seed, 16, lambda step: 4)[0] == expected


def test_the_decision_accepts_while_equal_and_emits_the_targets_token():
    assert invariant_decision([4, 5, 6], [4, 5, 6, 7]) == (3, [4, 5, 6, 7])  # all accepted + bonus
    assert invariant_decision([4, 9, 6], [4, 5, 6, 7]) == (1, [4, 5])  # corrected at the mismatch
    assert invariant_decision([], [8]) == (0, [8])  # target-only step
    with pytest.raises(ValueError, match="need 3 target tokens"):
        invariant_decision([1, 2], [1, 2])


@pytest.mark.statistical
def test_acceptance_is_at_least_the_gumbel_coupling_bound():
    """P(y = x) >= (1 - TV) / (1 + TV) for Gumbel-coupled samples of p and q (docs/exactness.md),
    checked on random pairs over 6000 seeds, with a one-sided binomial test at ALPHA."""
    gen = torch.Generator().manual_seed(3)
    for pair in range(4):
        lp = torch.log_softmax(torch.randn(1, 30, generator=gen) * 1.5, dim=-1)
        lq = torch.log_softmax(lp + torch.randn(1, 30, generator=gen) * (0.5 + pair), dim=-1)
        tv = 0.5 * (lp.exp() - lq.exp()).abs().sum().item()
        bound = (1 - tv) / (1 + tv)
        seeds = range(pair * 10_000, pair * 10_000 + 6000)
        hits = sum(
            gumbel_argmax(lp, g)[0] == gumbel_argmax(lq, g)[0] for g in (gumbel_noise(s, [0], 30) for s in seeds)
        )
        assert stats.binomtest(hits, 6000, bound, alternative="less").pvalue > ALPHA, (pair, tv, hits / 6000, bound)


# -- the wire: invariant blocks carry tokens alone -----------------------------------------------
def test_a_block_without_q_is_valid_only_in_invariant_mode_and_a_q_only_outside_it():
    from specdec.errors import MalformedProposalError
    from specdec.exact.sparse import SparseDist
    from specdec.exact.verify import validate_block

    one_hots = [SparseDist.one_hot(3), SparseDist.one_hot(4)]
    validate_block([3, 4], [], 30, invariant=True)
    validate_block([3, 4], one_hots, 30, invariant=False)
    validate_block([], [], 30, invariant=False)  # an empty block is a plain target step in either mode
    with pytest.raises(MalformedProposalError, match="carry no q"):
        validate_block([3, 4], one_hots, 30, invariant=True)
    with pytest.raises(MalformedProposalError, match="without q"):
        validate_block([3, 4], [], 30, invariant=False)
    with pytest.raises(MalformedProposalError, match="outside the vocabulary"):
        validate_block([3, 40], [], 30, invariant=True)


def test_the_wire_ships_an_invariant_block_as_tokens_and_refuses_a_half_shipped_q():
    from specdec.errors import MalformedProposalError
    from specdec.exact.proposal import DraftProposal
    from specdec.exact.sparse import SparseDist
    from specdec.runtime import wire
    from specdec.v1 import draft_pb2

    tokens_only = wire.proposed_tokens_to_proto(DraftProposal([3, 4, 5]))
    assert [t.HasField("q") for t in tokens_only] == [False] * 3
    back = wire.proposal_from_proto(draft_pb2.ProposeResponse(tokens=tokens_only).tokens)
    assert back.tokens == [3, 4, 5] and back.q == [] and not back.carries_q
    with_q = wire.proposed_tokens_to_proto(DraftProposal([3], [SparseDist.one_hot(3)]))
    assert wire.proposal_from_proto(with_q).carries_q
    with pytest.raises(MalformedProposalError, match="1 of 2 proposals carry a q"):
        wire.proposal_from_proto([*with_q, draft_pb2.ProposedToken(token_id=4)])
    with pytest.raises(ValueError, match="no q"):
        DraftProposal([3]).q_of_proposals()


def test_the_engines_propose_and_verify_invariant_blocks_without_q(models):
    from specdec.engine.draft import DraftEngine
    from specdec.engine.ngram import NgramDraft
    from specdec.engine.target import TargetEngine
    from specdec.errors import MalformedProposalError
    from specdec.exact.sparse import SparseDist

    target_model, draft_model = models
    target, draft = TargetEngine(target_model), DraftEngine(draft_model)
    ngram = NgramDraft(target.vocab_size)
    prompt = [1, 2, 3, 1, 2]
    for invariant in (True, False):
        params = SamplingParams(temperature=0.9, seed=5, invariant=invariant)
        sid = f"s-{invariant}"
        target.prefill(sid, prompt, params)
        draft.prefill(sid, prompt, params)
        ngram.prefill(sid, prompt, params)
        block = draft.propose(sid, 1, 4)
        assert len(block) == 4 and block.carries_q is not invariant
        assert ngram.propose(sid, 1, 2).carries_q is not invariant  # it matches "1 2" -> proposes "3 1"
        wrong = [] if not invariant else [SparseDist.one_hot(t) for t in block.tokens]
        with pytest.raises(MalformedProposalError, match="q"):
            target.verify(sid, 1, block.tokens, wrong)
        verdict = target.verify(sid, 1, block.tokens, block.q)  # the refused block left no trace
        assert len(verdict.recovered) == 4


# -- through the real services ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from stack_util import save_tiny_pair

    from specdec.apps.launcher import local_stack

    target, draft = save_tiny_pair(
        tmp_path_factory.mktemp("invariant-models"),
        48,
        seed=51,
        draft_scale=0.08,
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        max_positions=512,
    )
    with local_stack(target, draft, log_dir=tmp_path_factory.mktemp("invariant-logs")) as s:
        yield s


@pytest.mark.integration
@pytest.mark.slow
def test_invariant_output_is_the_target_only_output_through_the_stack_at_any_k_and_load(stack):
    """The draft and target services, the coordinator and its Ray actor: with invariant sampling
    a seed gives the same tokens with speculation off, with the draft model at k = 1..6 fixed or
    adaptive, with the n-gram draft, and beside concurrent streams."""
    import threading

    from stack_util import generate_many, request, stub

    client = stub(stack.coordinator_address)
    sampling = {"temperature": 0.8, "top_k": 30, "max_new_tokens": 40, "ignore_eos": True, "invariant": True}

    def run(seed, **speculation):
        return list(
            client.Generate(request([4, 8, 15, 16], seed=seed, **speculation, **sampling), timeout=120).token_ids
        )

    stop = threading.Event()

    def background():  # other users' streams sharing the batches
        while not stop.is_set():
            generate_many(stack.coordinator_address, [request([23, 42], seed=9, k=3, **sampling)] * 3, concurrency=3)

    load = threading.Thread(target=background)
    load.start()
    accepted = 0
    try:
        for seed in (1, 2, 3):
            expected = run(seed, k=0)
            variants = [{"k": k, "adaptive": False} for k in (1, 2, 4, 6)] + [{"k": 4, "adaptive": True}]
            variants.append({"k": 3, "method": "ngram", "adaptive": False})
            for speculation in variants:
                reply = client.Generate(request([4, 8, 15, 16], seed=seed, **speculation, **sampling), timeout=120)
                assert list(reply.token_ids) == expected, (seed, speculation)
                accepted += reply.stats.accepted_tokens
    finally:
        stop.set()
        load.join(120)
    assert accepted > 0  # the drafts' proposals were accepted, not only corrected


@pytest.mark.integration
def test_the_services_ship_invariant_blocks_without_q_and_refuse_the_wrong_mode(stack):
    """Through the real draft and target services: an invariant session's Propose answers tokens
    alone; Verify with a q for it, or without q for a standard session, is INVALID_ARGUMENT."""
    import grpc

    from specdec.v1 import coordinator_pb2, draft_pb2, draft_pb2_grpc, engine_pb2, target_pb2, target_pb2_grpc

    def address(kind):
        return next(c.address for c in stack.children if c.name == f"{kind}-0")

    target = target_pb2_grpc.TargetStub(grpc.insecure_channel(address("target")))
    draft = draft_pb2_grpc.DraftStub(grpc.insecure_channel(address("draft")))
    with_q = draft_pb2.ProposedToken(token_id=5, q=engine_pb2.SparseDistribution(token_ids=[5], probs=[1.0]))
    without_q = draft_pb2.ProposedToken(token_id=5)
    for invariant, wrong in ((True, with_q), (False, without_q)):
        sid = f"wire-{invariant}"
        sampling = coordinator_pb2.SamplingParams(temperature=0.9, seed=3, max_new_tokens=8, invariant=invariant)
        start = engine_pb2.StartSessionRequest(session_id=sid, prompt_token_ids=[1, 2, 3], sampling=sampling)
        target.StartSession(start, timeout=30)
        draft.StartSession(start, timeout=30)
        try:
            proposed = draft.Propose(draft_pb2.ProposeRequest(session_id=sid, step=1, k=3), timeout=30).tokens
            assert len(proposed) == 3
            assert all(t.HasField("q") for t in proposed) is not invariant
            with pytest.raises(grpc.RpcError) as refused:
                header = target_pb2.VerifyChunk(session_id=sid, step=1)
                target.Verify(iter([header, target_pb2.VerifyChunk(proposals=[wrong])]), timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "q" in refused.value.details(), refused.value.details()
            chunks = [target_pb2.VerifyChunk(session_id=sid, step=1), target_pb2.VerifyChunk(proposals=proposed)]
            assert len(target.Verify(iter(chunks), timeout=30).recovered) == 3  # the right block passes
        finally:
            for stub in (target, draft):
                stub.Release(engine_pb2.ReleaseRequest(session_id=sid), timeout=30)


@pytest.mark.parametrize("method", ["model", "ngram"])
def test_invariant_output_through_the_loop_over_the_engines_is_the_target_only_output(models, method):
    """The coordinator's loop over the engines (the draft model or n-gram, the target's verdict
    and the q-less decision): k = 1..8 fixed and adaptive give the target-only tokens."""
    from specdec.engine.draft import DraftEngine
    from specdec.engine.ngram import NgramDraft
    from specdec.engine.target import TargetEngine
    from specdec.loop.generate import speculative_generate

    target_model, draft_model = models
    target = TargetEngine(target_model)
    accepted = 0
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # repeats, so the n-gram draft finds matches
    for seed in range(3):
        params = SamplingParams(
            temperature=0.9, top_k=20, seed=seed, max_new_tokens=24, ignore_eos=True, invariant=True
        )
        expected = speculative_generate(target, None, prompt, params, 0).token_ids
        for k, adaptive in [(k, False) for k in range(1, 9)] + [(4, True)]:
            draft = DraftEngine(draft_model) if method == "model" else NgramDraft(40)
            result = speculative_generate(target, draft, prompt, params, k, adaptive=adaptive)
            assert result.token_ids == expected, (seed, k, adaptive)
            assert result.stats.draft_fallbacks == 0
            accepted += result.stats.accepted_tokens
    assert accepted > 0
