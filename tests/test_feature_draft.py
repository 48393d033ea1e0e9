"""Feature drafts (EAGLE-style): the model, the target's features, the engine's cache rule, the
wire format, and the loop in process. The stack and distillation have their own modules."""

from __future__ import annotations

import pytest
import torch

from coordinator.replica_choice import compatible_draft
from specdec.engine.commits import Commit
from specdec.engine.draft import FeatureDraftEngine, draft_engine_for
from specdec.engine.target import TargetEngine
from specdec.errors import InvalidArgumentError
from specdec.exact.sampling import SamplingParams
from specdec.loop.generate import speculative_generate
from specdec.modeling.feature_draft import FeatureDraft, FeatureDraftConfig
from specdec.modeling.loading import load_model
from specdec.modeling.tiny import tiny_llama
from specdec.runtime import wire
from specdec.runtime.registry import Replica
from specdec.training.distill_features import build_feature_draft, expected_tokens_per_step

VOCAB = 32
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
GREEDY = SamplingParams(temperature=0.0, seed=0, max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def target_model():
    return tiny_llama(VOCAB, seed=3, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def feature_model(target_model):
    head = [*range(0, VOCAB, 2), 1, 3, 5]  # a reduced head: the other odd tokens get q = 0
    return (
        build_feature_draft(target_model, sorted(head), embed_size=8, heads=4, kv_heads=2, intermediate=48, seed=7)
        .eval()
        .requires_grad_(False)
    )


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def final_hidden(model, ids):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].float()


# -- the model -----------------------------------------------------------------------------------
def test_unrolled_training_equals_the_drafting_chain():
    """Step s of the training unroll at position t is exactly what drafting computes for the s-th
    proposal there: a cache of target-fed positions up to t-s+1, then its own predictions fed back."""
    torch.manual_seed(0)
    config = FeatureDraftConfig(
        vocab_size=50,
        hidden_size=32,
        embed_size=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        head_vocab_size=20,
    )
    model = FeatureDraft(config, torch.arange(0, 40, 2)).to(torch.float64)
    tokens = torch.randint(0, 50, (2, 11))
    features = torch.randn(2, 11, 32, dtype=torch.float64)
    preceding = torch.cat((torch.zeros(2, 1, 32, dtype=torch.float64), features[:, :-1]), dim=1)
    unrolled = model.unrolled(tokens, preceding, 3)
    for b in range(2):
        for s in range(1, 4):
            for t in range(s - 1, 11):
                first = t - s + 1
                cache = model.new_cache()
                h = model.extend(tokens[b, : first + 1], preceding[b, : first + 1], cache)[-1]
                for position in range(first + 1, t + 1):
                    h = model.extend(tokens[b, position : position + 1], h.view(1, -1), cache)[-1]
                assert torch.allclose(h, unrolled[s - 1][b, t], atol=1e-10), (b, s, t)


def test_logits_are_the_head_rows_and_minus_inf_elsewhere(feature_model):
    hidden = torch.randn(3, 32)
    logits = feature_model.logits(hidden)
    ids = feature_model.head_token_ids
    assert logits.shape == (3, VOCAB)
    assert torch.allclose(logits[:, ids], hidden @ feature_model.head.weight.T, atol=1e-5)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(logits[:, outside]).all()


def test_save_and_load_round_trip(tmp_path, feature_model):
    feature_model.save(tmp_path / "d", torch.float32)
    loaded = load_model(str(tmp_path / "d"), "cpu", torch.float32, quiet=True)
    assert isinstance(loaded, FeatureDraft) and loaded.config == FeatureDraftConfig.from_dict(
        {**feature_model.config.__dict__, "_name_or_path": str(tmp_path / "d")}
    )
    assert torch.equal(loaded.head_token_ids, feature_model.head_token_ids)
    for (name, a), (_, b) in zip(feature_model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert isinstance(draft_engine_for(loaded), FeatureDraftEngine)


def test_expected_tokens_per_step_is_the_acceptance_chain():
    assert expected_tokens_per_step([0.5, 0.5], 1) == 1.5
    assert expected_tokens_per_step([0.8, 0.5], 2) == pytest.approx(1 + 0.8 + 0.4)
    assert expected_tokens_per_step([0.8, 0.5], 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)  # last rate reused


# -- the target's features -----------------------------------------------------------------------
@pytest.mark.parametrize("lean", ["1", "0"])
def test_target_features_are_its_final_hidden_states(target_model, monkeypatch, lean):
    """Prefill returns the hidden state after every prompt token but the last; Verify those of
    the pending token and the block -- the lean pass and transformers' forward alike."""
    monkeypatch.setenv("SPECDEC_LEAN_FORWARD", lean)
    engine = TargetEngine(target_model)
    assert (engine.store.runner is not None) == (lean == "1")
    features = engine.prefill("s", PROMPT, GREEDY, True)
    block = [7, 8]
    expected = final_hidden(target_model, PROMPT + block)
    assert features.shape == (len(PROMPT) - 1, 32)
    assert torch.allclose(features, expected[: len(PROMPT) - 1], atol=1e-5)
    from specdec.exact.sparse import SparseDist

    verdict = engine.verify("s", 1, block, [SparseDist.one_hot(t) for t in block], None, True)
    assert torch.allclose(verdict.features, expected[len(PROMPT) - 1 :], atol=1e-5)
    assert engine.verify("s", 2, [], [], None, False).features is None  # only when asked
    assert engine.prefill("t", PROMPT, GREEDY) is None


# -- the engine ----------------------------------------------------------------------------------
def test_cache_holds_only_target_fed_positions(target_model, feature_model):
    """After a proposal the cache holds the committed tokens only (draft-fed positions are cut),
    so a session that accepted part of a block drafts exactly like a fresh session prefilled with
    the whole sequence and the target's features (the cache rule of docs/exactness.md)."""
    draft = FeatureDraftEngine(feature_model, top_m=0, eps=0.0)
    params = SamplingParams(temperature=1.0, seed=5, max_new_tokens=50, ignore_eos=True)
    draft.prefill("a", PROMPT, params, final_hidden(target_model, PROMPT)[:-1])
    first = draft.propose("a", 1, 3)
    session = draft.store.get("a")
    assert session.cache.length == len(session.cached) == len(PROMPT)
    # the first two proposals accepted, then a recovered token: the draft fed those two itself
    accepted = (*first.tokens[:2], (first.tokens[2] + 1) % VOCAB)
    sequence = PROMPT + list(accepted)
    features = final_hidden(target_model, sequence)
    commit = Commit(1, len(PROMPT), accepted, features[len(PROMPT) - 1 : len(sequence) - 1])
    resumed = draft.propose("a", 2, 3, commit)
    draft.prefill("b", sequence, params, features[: len(sequence) - 1])
    fresh = draft.propose("b", 2, 3)
    assert resumed.tokens == fresh.tokens
    for q1, q2 in zip(resumed.q, fresh.q, strict=True):  # equal up to float rounding (fed in other chunks)
        assert list(q1.token_ids) == list(q2.token_ids)
        assert max(abs(float(a) - float(b)) for a, b in zip(q1.probs, q2.probs, strict=False)) < 1e-5
    # a retried commit is the same commit: applied once, features not appended twice
    draft.commit("a", commit)
    assert draft.propose("a", 3, 3).tokens == resumed.tokens
    assert draft.release("a") and draft.release("b") and len(draft.store) == 0


def test_missing_or_misshapen_features_are_invalid_argument(feature_model):
    draft = FeatureDraftEngine(feature_model)
    with pytest.raises(InvalidArgumentError, match=r"^features: a feature draft needs"):
        draft.prefill("s", PROMPT, GREEDY)
    with pytest.raises(InvalidArgumentError, match=r"^features: expected \[7, 32\]"):
        draft.prefill("s", PROMPT, GREEDY, torch.zeros(8, 32))
    draft.prefill("s", PROMPT, GREEDY, torch.zeros(7, 32))
    with pytest.raises(InvalidArgumentError, match=r"^commit\.features: a feature draft needs"):
        draft.commit("s", Commit(1, len(PROMPT), (1, 2)))
    with pytest.raises(InvalidArgumentError, match=r"^commit.features: expected \[2, 32\]"):
        draft.propose("s", 1, 2, Commit(1, len(PROMPT), (1, 2), torch.zeros(2, 16)))
    assert len(draft.store.get("s").tokens) == len(PROMPT)  # nothing half-applied


# -- the wire ------------------------------------------------------------------------------------
def test_features_travel_as_float16_or_float32_and_are_checked():
    x = torch.randn(4, 6) * 30
    msg = wire.features_to_proto(x)
    assert (msg.dtype, msg.rows, msg.dim, len(msg.data)) == ("float16", 4, 6, 48)
    assert torch.allclose(wire.features_from_proto(msg), x, rtol=1e-3, atol=1e-2)
    x[1, 2] = 1e6  # beyond float16: sent as float32, exactly
    msg = wire.features_to_proto(x)
    assert msg.dtype == "float32" and torch.equal(wire.features_from_proto(msg), x)
    bad = wire.features_to_proto(torch.ones(2, 3))
    bad.rows = 3
    with pytest.raises(InvalidArgumentError, match="do not hold"):
        wire.features_from_proto(bad, "commit.features")
    bad = wire.features_to_proto(torch.tensor([[float("nan")]]))
    with pytest.raises(InvalidArgumentError, match=r"^features: values must be finite"):
        wire.features_from_proto(bad)
    commit = wire.commit_from_proto(wire.commit_to_proto(Commit(3, 9, (1, 2), torch.ones(2, 5))))
    assert commit == Commit(3, 9, (1, 2)) and torch.equal(commit.features, torch.ones(2, 5))


def test_registry_pairs_a_feature_draft_only_with_a_target_of_its_width():
    target = Replica("target", "t", "a:1", fingerprint="fp", vocab_size=32, feature_size=32)
    draft = Replica("draft", "d", "a:2", fingerprint="fp", draft_kind="feature", vocab_size=32, feature_size=32)
    assert compatible_draft(draft, target)
    assert not compatible_draft(Replica(**{**draft.__dict__, "feature_size": 64}), target)
    assert not compatible_draft(Replica(**{**draft.__dict__, "feature_size": 0}), target)
    assert compatible_draft(Replica(**{**draft.__dict__, "draft_kind": "model", "feature_size": 0}), target)


# -- the loop, in process ------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_with_a_feature_draft_is_the_targets_greedy(target_model, feature_model, k):
    expected = hf_greedy(target_model, PROMPT, 24)
    draft = FeatureDraftEngine(feature_model)
    result = speculative_generate(TargetEngine(target_model), draft, PROMPT, GREEDY, k)
    assert result.token_ids == expected
    assert result.stats.proposed_tokens > 0 and result.stats.draft_fallbacks == 0
    assert len(draft.store) == 0


def test_a_broken_feature_draft_directory_is_a_clear_load_error(tmp_path, feature_model):
    from specdec.errors import ModelLoadError

    feature_model.save(tmp_path / "d")
    (tmp_path / "d" / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ModelLoadError, match="cannot load the feature draft in"):
        load_model(str(tmp_path / "d"), "cpu", quiet=True)
    (tmp_path / "d" / "config.json").write_text('{"model_type": "specdec_feature_draft", "vocab_size": 3}')
    with pytest.raises(ModelLoadError, match="hidden_size"):
        load_model(str(tmp_path / "d"), "cpu", quiet=True)


def test_feature_loss_in_bf16_autocast_matches_fp32_and_trains_fp32_weights(target_model):
    """The bf16 path (``--precision``) changes the arithmetic of the draft's products only: the loss
    is within bf16 rounding of the fp32 one, the weights and their gradients stay fp32, and both
    paths agree on what the teacher's top token is."""
    from specdec.training.distill_features import feature_loss, make_feature_batch
    from specdec.training.feature_corpus import FeatureRecord

    torch.manual_seed(1)
    draft = build_feature_draft(
        target_model, list(range(VOCAB)), embed_size=8, heads=4, kv_heads=2, intermediate=48, seed=7
    ).train()
    ids = torch.randint(0, VOCAB, (14,)).tolist()
    records = [FeatureRecord(ids, 5, final_hidden(target_model, ids)[:-1].half())]
    batch = make_feature_batch(records, 64)
    teacher = target_model.get_output_embeddings().weight.detach().float()
    results = {}
    for bf16 in (False, True):
        draft.zero_grad()
        loss, _agree, n = feature_loss(draft, batch, teacher, 2, 0.8, 0.1, bf16=bf16)
        loss.backward()
        grad = next(draft.parameters()).grad
        assert loss.dtype == torch.float32 and grad is not None and grad.dtype == torch.float32
        assert torch.isfinite(loss) and n == len(ids) - 5
        results[bf16] = loss.item()
    assert results[True] == pytest.approx(results[False], rel=0.05)
    assert all(p.dtype == torch.float32 for p in draft.parameters())


def test_invariant_sampling_with_a_feature_draft_is_the_target_only_output(target_model, feature_model):
    """Invariant sampling through the loop over the engines, the feature draft fed the target's
    features: for every seed and k = 1..8 (and adaptive) the tokens are those of target-only
    invariant sampling with the seed (docs/exactness.md)."""
    target = TargetEngine(target_model)
    accepted = 0
    for seed in range(3):
        params = SamplingParams(
            temperature=0.9, top_p=0.95, seed=seed, max_new_tokens=20, ignore_eos=True, invariant=True
        )
        expected = speculative_generate(target, None, PROMPT, params, 0).token_ids
        for k, adaptive in [(k, False) for k in range(1, 9)] + [(4, True)]:
            result = speculative_generate(
                target, FeatureDraftEngine(feature_model), PROMPT, params, k, adaptive=adaptive
            )
            assert result.token_ids == expected, (seed, k, adaptive)
            accepted += result.stats.accepted_tokens
    assert accepted > 0 and len(target.store) == 0
