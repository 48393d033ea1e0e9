"""The stack on the torch backend of the batched pass (docs/batching.md, "Backends"): target and
draft as separate processes with the float32 layer kernel off, so every pass -- batched verify
blocks, draft positions, chunked prefills, prefix copies -- runs torch's row-count invariant
operations. The selftest's statistical cases hold 8 streams at a time, greedy streams under load
are the target's own, and the replicas say which backend they run."""

from __future__ import annotations

from collections import Counter

import pytest
from stack_util import generate_many, greedy_continuations, info, request, save_selftest_pair, scrape

from specdec.apps.launcher import local_stack
from specdec.apps.selftest import BASE_SEED, CASES, case_params, case_runs, exact_law, judge

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUNS = 200  # per sampled case: half test_stack's, the same alpha (1e-3); the kernel's stack runs 400


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("torch-stack-models")
    return root, save_selftest_pair(root)


@pytest.fixture(scope="module")
def stack(models):
    from specdec.apps.launcher import free_port

    root, _ = models
    ports = {name: free_port() for name in ("target", "draft")}
    with local_stack(
        str(root / "target"),
        str(root / "draft"),
        num_speculative_tokens=3,
        extra_target=["--threads", "1", "--metrics-port", str(ports["target"])],
        extra_draft=["--threads", "1", "--metrics-port", str(ports["draft"])],
        extra_coordinator=["--max-speculative-tokens", "8"],
        env={"SPECDEC_FEWROW_LAYERS": "0"},  # the layer kernel off: the torch backend
    ) as s:
        s.metrics_ports = ports
        yield s


def replica(stack, kind: str) -> str:
    return next(c.address for c in stack.children if c.name == f"{kind}-0")


def test_both_replicas_run_the_invariant_torch_backend_and_say_so(stack):
    for kind in ("target", "draft"):
        described = info(replica(stack, kind), kind)
        assert (described.pass_backend, described.batch_invariant) == ("torch-invariant", True), kind
        metrics = scrape(stack.metrics_ports[kind])
        assert metrics["specdec_pass_backend_info|backend=torch-invariant|batch_invariant=true"] == 1.0, kind


# (the constrained cases need a vocabulary a grammar engine reads: tests/test_structured_law_stack.py)
STACK_CASES = [
    c
    for c in CASES
    if c.draft in ("model", "ngram") and c.top_m == 0 and not c.load_aware and c.constraint is None and not c.pipeline
]


@pytest.mark.statistical
@pytest.mark.parametrize("case", STACK_CASES, ids=[c.name for c in STACK_CASES])
def test_exactness_through_the_stack_on_the_torch_backend(stack, models, case):
    """The selftest's statistical cases through Generate, 8 streams at a time: chi-square at
    alpha = 1e-3, fixed seeds (as tests/test_stack.py, on the other backend)."""
    _, target = models
    params = case_params(case)
    law = exact_law(target, case.prompt, params, case.tokens)
    n = case_runs(case, RUNS)
    sampling = dict(case.params, max_new_tokens=case.tokens, ignore_eos=True)
    sampling.setdefault("invariant", False)
    schedule = {
        "k": case.k,
        "method": "ngram" if case.draft == "ngram" else "draft_model",
        # fixed k: the case's own schedule (test_stack covers the load-aware k)
        "adaptive": False,
        "replayable": False,
    }
    requests = [request(list(case.prompt), seed=BASE_SEED + i, **schedule, **sampling) for i in range(n)]
    replies = generate_many(stack.coordinator_address, requests, concurrency=8)
    observed = Counter(tuple(r.token_ids) for r in replies)
    proposed = sum(r.stats.proposed_tokens for r in replies)
    accepted = sum(r.stats.accepted_tokens for r in replies)
    verdict = judge(case, observed, law, n, proposed, accepted)
    assert verdict.passed, verdict


def test_greedy_streams_under_load_are_the_targets_own_and_share_passes(stack, models):
    _, target = models
    before = scrape(stack.metrics_ports["target"])
    prompts = [[3 + i % 8, 9, 3, 9, 14, 2, 7, 1][: 2 + i % 7] for i in range(16)]
    methods = [("draft_model", 1 + i % 5) if i % 3 else ("none", 0) for i in range(16)]
    reqs = [
        request(p, k=k, method=m, adaptive=False, temperature=0.0, max_new_tokens=24, ignore_eos=True)
        for p, (m, k) in zip(prompts, methods, strict=True)
    ]
    replies = generate_many(stack.coordinator_address, reqs, concurrency=16)
    expected = greedy_continuations(target, prompts, 24)
    assert [list(r.token_ids) for r in replies] == expected
    after = scrape(stack.metrics_ports["target"])
    passes = after["specdec_batch_sessions_count"] - before.get("specdec_batch_sessions_count", 0)
    alone = after["specdec_batch_sessions_bucket|le=1.0"] - before.get("specdec_batch_sessions_bucket|le=1.0", 0)
    assert passes > alone  # some passes carried more than one session
