"""The selftest's constrained case through the stack (issue 45): the selftest's tiny target and
draft served as separate processes with the selftest's byte-level vocabulary, so the coordinator
and both replicas compile the regex themselves. Sampled requests through Generate emit the
target's constrained law (chi-square at alpha = 1e-3, the selftest's judge, fixed seeds) while
the coordinator proposes the forced runs and the draft's k = 3 blocks cross forced positions;
greedy output is target-only's with forced runs on and off."""

from __future__ import annotations

import os
import re
from collections import Counter

import pytest
from stack_util import generate_many, request, scrape, stub

from specdec.apps.launcher import local_stack
from specdec.apps.selftest import (
    BASE_SEED,
    CASES,
    CHAR_TOKENS,
    DRAFT_SEED,
    build_target,
    case_grammars,
    case_params,
    case_runs,
    exact_law,
    judge,
)
from specdec.v1 import coordinator_pb2 as pb

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STACK_RUNS = int(os.environ.get("SPECDEC_STACK_RUNS", "400"))
CASE = next(c for c in CASES if c.constraint is not None)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from specdec.modeling.tiny import char_tokenizer, perturbed

    root = tmp_path_factory.mktemp("structured-law")
    target = build_target()
    target.save_pretrained(root / "target")
    perturbed(target, scale=0.04, seed=DRAFT_SEED).save_pretrained(root / "draft")
    for name in ("target", "draft"):
        char_tokenizer(list(CHAR_TOKENS)).save_pretrained(root / name)
    return root, target


@pytest.fixture(scope="module")
def stack(models, tmp_path_factory):
    root, _ = models
    from specdec.apps.launcher import free_port

    ports = {name: free_port() for name in ("coordinator", "target", "draft")}
    with local_stack(
        str(root / "target"),
        str(root / "draft"),
        num_speculative_tokens=3,
        log_dir=tmp_path_factory.mktemp("structured-law-logs") / "logs",
        extra_target=["--threads", "1", "--metrics-port", str(ports["target"])],
        extra_draft=["--threads", "1", "--metrics-port", str(ports["draft"])],
        extra_coordinator=["--metrics-port", str(ports["coordinator"])],
    ) as running:
        running.metrics_ports = ports
        yield running


def constrained(seed: int, k: int, forced: bool | None = None, **sampling) -> pb.GenerateRequest:
    kind, spec = CASE.constraint
    req = request(list(CASE.prompt), k=k, method="none" if k == 0 else "", adaptive=False, seed=seed, **sampling)
    req.sampling.structured_output.CopyFrom(pb.StructuredOutput(**{kind: spec}))
    if forced is not None:
        req.speculation.forced_tokens = forced
    return req


@pytest.mark.statistical
def test_the_constrained_law_through_the_stack(stack, models):
    _, target = models
    params = case_params(CASE)
    law = exact_law(target, CASE.prompt, params, CASE.tokens, case_grammars(CASE))
    n = case_runs(CASE, STACK_RUNS)
    requests = [constrained(BASE_SEED + i, CASE.k, max_new_tokens=CASE.tokens, **CASE.params) for i in range(n)]
    before = scrape(stack.metrics_ports["coordinator"]).get("specdec_forced_tokens_total", 0.0)
    replies = generate_many(stack.coordinator_address, requests)
    observed = Counter(tuple(r.token_ids) for r in replies)
    proposed = sum(r.stats.proposed_tokens for r in replies)
    accepted = sum(r.stats.accepted_tokens for r in replies)
    verdict = judge(CASE, observed, law, n, proposed, accepted)
    assert verdict.passed, verdict
    forced = sum(r.stats.forced_tokens for r in replies)
    assert forced > 0  # the coordinator committed forced runs
    assert scrape(stack.metrics_ports["coordinator"])["specdec_forced_tokens_total"] - before == forced
    for replica in ("target", "draft"):  # one compile each, every later session a cache hit
        metrics = scrape(stack.metrics_ports[replica])
        assert metrics["specdec_grammar_compiles"] == 1 and metrics["specdec_grammar_cache_hits"] >= n - 1, replica
    assert all(r.stats.draft_fallbacks == 0 for r in replies)  # the draft served every block


def test_greedy_is_target_onlys_with_forced_runs_on_and_off(stack):
    s = stub(stack.coordinator_address)
    sampling = {"temperature": 0.0, "max_new_tokens": 30}
    alone = s.Generate(constrained(1, 0, **sampling), timeout=60)
    on = s.Generate(constrained(1, 3, **sampling), timeout=60)
    off = s.Generate(constrained(1, 3, forced=False, **sampling), timeout=60)
    assert list(on.token_ids) == list(off.token_ids) == list(alone.token_ids)
    assert on.stats.forced_tokens > 0 and off.stats.forced_tokens == 0
    assert on.stats.target_passes <= off.stats.target_passes  # (a run's tokens need no pass)
    # what the regex admits so far ([xy]+ may go on past 30 tokens)
    assert re.fullmatch(r"[ab]{1,2}-z[cd]{1,2}-z[xy]+\.?", on.text), on.text


def test_invariant_sampling_under_the_constraint_depends_on_the_seed_alone(stack):
    """The selftest's invariant_constrained case through the stack: each seed's tokens with
    speculation (forced runs on and off) are its target-only tokens."""
    s = stub(stack.coordinator_address)
    sampling = {"temperature": 2.5, "invariant": True, "max_new_tokens": 16}
    drafted = 0
    for seed in range(12):
        alone = s.Generate(constrained(seed, 0, **sampling), timeout=60)
        for forced in (True, False):
            speculative = s.Generate(constrained(seed, 3, forced=forced, **sampling), timeout=60)
            assert list(speculative.token_ids) == list(alone.token_ids), (seed, forced)
            drafted += speculative.stats.drafts
    assert drafted > 0
