"""A feature draft through the real stack: the target streams its hidden states back with every
Verify, the coordinator forwards one per committed token to the draft with the next commit, and
the output is still exactly the target's (statistical case at alpha = 1e-3, greedy token for
token), including after the draft replica serving a request is killed."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from stack_util import generate_many, info, live_sessions, request, stub
from test_failover import kill_serving, replace_replica, stream

from specdec.apps.launcher import local_stack
from specdec.apps.selftest import BASE_SEED, CASES, build_draft, build_target, case_params, case_runs, exact_law, judge
from specdec.modeling.tiny import word_tokenizer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STACK_RUNS = int(os.environ.get("SPECDEC_STACK_RUNS", "400"))
CASE = next(c for c in CASES if c.name == "feature_draft")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("feature-stack-models")
    target = build_target()  # the selftest's: its exact law is enumerable
    target.save_pretrained(root / "target")
    word_tokenizer(target.config.vocab_size).save_pretrained(root / "target")
    build_draft("feature", target, 0).model.save(root / "draft", torch.float32)
    word_tokenizer(target.config.vocab_size).save_pretrained(root / "draft")
    return root, target


@pytest.fixture(scope="module")
def stack(models, tmp_path_factory):
    root, _ = models
    with local_stack(
        str(root / "target"),
        str(root / "draft"),
        num_speculative_tokens=2,
        log_dir=tmp_path_factory.mktemp("feature-stack-logs"),
        draft_replicas=2,
        extra_target=["--threads", "1"],
        extra_draft=["--threads", "1"],
        extra_coordinator=["--max-speculative-tokens", "8"],
    ) as s:
        s.spares = 0
        yield s


def test_services_describe_the_feature_pairing(stack, models):
    children = {c.name: c for c in stack.children}
    draft, target = info(children["draft-0"].address, "draft"), info(children["target-0"].address, "target")
    assert draft.draft_kind == "feature" and draft.feature_size == target.feature_size == models[1].config.hidden_size


@pytest.mark.statistical
def test_exactness_through_the_stack(stack, models):
    _, target = models
    params = case_params(CASE)
    law = exact_law(target, CASE.prompt, params, CASE.tokens)
    n = case_runs(CASE, STACK_RUNS)
    sampling = dict(CASE.params, max_new_tokens=CASE.tokens, ignore_eos=True)
    sampling.setdefault("invariant", False)  # the case's rejection sampling (a seed alone means invariant)
    # fixed k (as the selftest case): every request proposes, whatever the load-aware default would choose
    requests = [request(list(CASE.prompt), k=CASE.k, adaptive=False, seed=BASE_SEED + i, **sampling) for i in range(n)]
    replies = generate_many(stack.coordinator_address, requests)
    observed = Counter(tuple(r.token_ids) for r in replies)
    verdict = judge(
        CASE,
        observed,
        law,
        n,
        sum(r.stats.proposed_tokens for r in replies),
        sum(r.stats.accepted_tokens for r in replies),
    )
    assert verdict.passed, verdict
    assert all(r.stats.draft_fallbacks == 0 and r.stats.proposed_tokens > 0 for r in replies)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_equals_transformers_generate(stack, models, k):
    _, target = models
    prompt = [3, 9, 3, 9, 14, 2]
    expected = target.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=40, min_new_tokens=40, pad_token_id=0
    )[0, len(prompt) :].tolist()
    reply = stub(stack.coordinator_address).Generate(
        request(prompt, k=k, adaptive=False, temperature=0.0, max_new_tokens=40, ignore_eos=True)
    )
    assert list(reply.token_ids) == expected
    assert reply.stats.draft_fallbacks == 0 and reply.stats.proposed_tokens > 0
    for child in stack.children:
        kind = child.name.split("-")[0]
        if kind in ("target", "draft") and child.process.poll() is None:
            assert live_sessions(child.address, kind) == 0


def test_draft_replica_killed_mid_stream_changes_nothing(stack):
    """The replacement replica is prefilled with the features the coordinator kept for every
    committed token, so it proposes what the lost one would have: the same tokens."""
    # fixed k: under the default load-aware policy a seeded sampled request's k (so its tokens)
    # may follow the load and timings (docs/goodput.md)
    req = lambda: request([7, 8, 9], k=2, adaptive=False, temperature=0.8, seed=42, max_new_tokens=300, ignore_eos=True)  # noqa: E731
    undisturbed = list(stub(stack.coordinator_address).Generate(req()).token_ids)
    tokens, last, error = stream(stack, req(), on_first=kill_serving(stack, "draft"))
    assert error is None and tokens == undisturbed
    assert last.stats.draft_failovers == 1 and last.stats.draft_fallbacks == 0
    replace_replica(stack, "draft")
