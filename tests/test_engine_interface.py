"""The one call shape of the replicas' engines (specdec.engine.interface): every engine offers its
operations as works, and the servicer batches exactly those whose works ask for passes."""

from __future__ import annotations

import argparse

import pytest
from conftest import VOCAB

from replica.servicer import batch_runner_for
from specdec.engine.commits import Commit
from specdec.engine.draft import DraftEngine, FeatureDraftEngine
from specdec.engine.interface import ProfiledEngine, ProposingEngine, ReplicaEngine, VerifyingEngine
from specdec.engine.ngram import NgramDraft
from specdec.engine.sessions import run_alone, whole
from specdec.engine.target import TargetEngine
from specdec.exact.sampling import SamplingParams
from specdec.modeling.tiny import tiny_llama
from specdec.training.distill_features import build_feature_draft

ARGS = argparse.Namespace(max_batch_tokens=256, max_batch_sessions=64, max_waiting_sessions=64)
PARAMS = SamplingParams(temperature=0.0, seed=1)


def small(seed: int):
    return tiny_llama(VOCAB, seed=seed, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def engines():
    target = small(3)
    head = list(range(VOCAB))
    feature = build_feature_draft(target, head, embed_size=8, heads=4, kv_heads=2, intermediate=48, seed=7)
    return {
        "target": TargetEngine(target),
        "model": DraftEngine(small(4)),
        "feature": FeatureDraftEngine(feature.eval().requires_grad_(False)),
        "ngram": NgramDraft(VOCAB),
    }


def test_every_engine_offers_the_interface_of_its_side(engines):
    assert isinstance(engines["target"], VerifyingEngine)
    assert engines["ngram"].devices() == ["cpu"] and engines["target"].devices() == ["cpu"]
    for kind in ("model", "feature", "ngram"):
        assert isinstance(engines[kind], ProposingEngine), kind
        assert engines[kind].kind == kind
    assert isinstance(engines["target"], ProfiledEngine) and isinstance(engines["model"], ProfiledEngine)
    assert not isinstance(engines["ngram"], ProfiledEngine)  # nothing to profile: it runs no model
    assert not isinstance(object(), ReplicaEngine)  # (the check can fail)


def test_a_replica_batches_exactly_the_engines_whose_works_ask_for_passes(engines):
    for kind in ("target", "model"):
        runner = batch_runner_for(engines[kind], ARGS)
        assert runner is not None and runner.store is engines[kind].store, kind
    for kind in ("feature", "ngram"):
        assert engines[kind].batch_store is None
        assert batch_runner_for(engines[kind], ARGS) is None, kind


def test_a_whole_work_runs_when_started_and_only_then():
    calls = []
    work = whole(lambda *args: calls.append(args) or "done", 1, 2)
    assert calls == []  # building it runs nothing
    assert run_alone(None, work) == "done" and calls == [(1, 2)]


def test_a_work_that_asks_for_a_pass_cannot_run_without_a_store_and_leaves_nothing(engines):
    engine = engines["model"]
    work = engine.prefill_work("no-store", [1, 2, 3], PARAMS)
    with pytest.raises(RuntimeError, match="no store"):
        run_alone(None, work)
    assert "no-store" not in list(engine.store)  # the work was told, and released its session
    assert work.gi_frame is None  # and is closed: nothing for the garbage collector to finish


def test_the_ngram_drafts_works_give_what_its_calls_give(engines):
    ngram = engines["ngram"]
    prompt = [5, 6, 7, 5, 6]
    run_alone(None, ngram.prefill_work("w", prompt, PARAMS))
    ngram.prefill("c", prompt, PARAMS)
    by_work = run_alone(None, ngram.propose_work("w", 1, 3))
    assert by_work.tokens == ngram.propose("c", 1, 3).tokens == [7, 5, 6]
    for sid in ("w", "c"):
        assert ngram.release(sid)


def test_a_feature_drafts_works_give_what_its_calls_give(engines):
    target, feature = engines["target"], engines["feature"]
    prompt = [3, 9, 4, 1, 7]
    features = run_alone(target.store, target.prefill_work("t", prompt, PARAMS, True))
    assert target.release("t")
    run_alone(None, feature.prefill_work("w", prompt, PARAMS, features))
    feature.prefill("c", prompt, PARAMS, features)
    by_work = run_alone(None, feature.propose_work("w", 1, 3))
    by_call = feature.propose("c", 1, 3)
    assert by_work.tokens == by_call.tokens and len(by_work.tokens) == 3
    for sid in ("w", "c"):
        assert feature.release(sid)


@pytest.mark.parametrize("kind", ["target", "model"])
def test_a_step_work_emits_what_the_engines_own_call_emits(engines, kind):
    engine = engines[kind]
    prompt = [2, 8, 1, 6]
    for sid in ("a", "b"):
        engine.prefill(sid, prompt, PARAMS)
    emitted = run_alone(engine.store, engine.step_work("a", 1))
    expected = engine.verify("b", 1, [], []).bonus if kind == "target" else engine.propose("b", 1, 1).tokens[0]
    assert isinstance(emitted, int) and emitted == expected
    run_alone(engine.store, engine.step_work("a", 2, Commit(1, len(prompt), (emitted,))))
    assert engine.store.get("a").tokens == [*prompt, emitted]
    for sid in ("a", "b"):
        assert engine.release(sid)
