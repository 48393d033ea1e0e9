"""The adaptive speculation policy (specdec/loop/adaptive_k.py): its choice of k, and that a run's state
can be rebuilt from what it committed (what a coordinator taking over a request relies on)."""

from __future__ import annotations

import itertools
import random

import pytest

from specdec.errors import InvalidArgumentError
from specdec.loop.adaptive_k import AdaptiveK, FixedK, StepCost, make_policy


def flat(steps: list[list[int]]) -> list[int]:
    return [token for step in steps for token in step]


def test_step_cost_parse_and_validation():
    assert StepCost.parse("0.2,0.05") == StepCost(0.2, 0.05)
    assert StepCost(0.2, 0.05).of(0) == 1.0 and StepCost(0.2, 0.05).of(2) == pytest.approx(1.3)
    with pytest.raises(ValueError, match="FIXED,PER_TOKEN"):
        StepCost.parse("0.2")
    with pytest.raises(ValueError, match=">= 0"):
        StepCost(-0.1, 0.1)
    for bad in ({"k": 0}, {"k": 2, "decay": 0.0}, {"k": 2, "max_probe_gap": 0}):
        with pytest.raises(ValueError):
            AdaptiveK(**bad)


def drive(policy, accepted_of, steps: int) -> list[int]:
    """Run the policy ``steps`` steps; ``accepted_of(step, k)`` says how many of a block pass."""
    ks = []
    for step in range(steps):
        k = policy.next_k()
        policy.observe(k, min(k, accepted_of(step, k)) if k else 0)
        ks.append(k)
    return ks


def test_blocks_that_pay_keep_the_requests_k():
    # k=2 costs 1 + 0.17 + 0.38 = 1.55 target-only steps: blocks of 2 tokens (one accepted) pay
    assert drive(AdaptiveK(2), lambda step, k: 1, 100) == [2] * 100
    assert drive(AdaptiveK(5), lambda step, k: k, 100) == [5] * 100


def test_blocks_below_break_even_pause_speculation_and_probes_back_off():
    # alternately 0 and 1 accepted: 1.5 tokens per block, below the 1.55 a block costs
    ks = drive(AdaptiveK(2), lambda step, k: step % 2, 300)
    assert ks[0] == 2  # the optimistic start speculates (one block that fails is enough to pause)
    blocks = [i for i, k in enumerate(ks) if k]
    gaps = [b - a for a, b in itertools.pairwise(blocks)]
    assert max(gaps) > 1 and gaps[-5:] == [17] * 5  # backed off to 16 target-only steps between probes
    assert len(blocks) < 40
    assert set(ks) == {0, 2}  # a probe is a block of the request's k, nothing in between


def test_speculation_resumes_when_the_draft_gets_good_again():
    ks = drive(AdaptiveK(3), lambda step, k: 0 if step < 150 else k, 300)
    assert ks[140:150].count(0) >= 9  # paused while the draft was useless
    assert ks[-100:] == [3] * 100  # a probe found it right again: blocks every step


def test_fixed_k_never_changes():
    policy = make_policy(3, adaptive=False)
    assert isinstance(policy, FixedK)
    assert drive(policy, lambda step, k: 0, 20) == [3] * 20
    assert isinstance(make_policy(0, adaptive=True), FixedK)  # k = 0 has nothing to adapt
    assert isinstance(make_policy(2, adaptive=True), AdaptiveK)


@pytest.mark.parametrize("seed", range(5))
def test_replay_from_committed_step_lengths_rebuilds_the_same_state(seed):
    """A run's next choice is a function of the tokens each of its steps committed."""
    rng = random.Random(seed)
    live = AdaptiveK(4)
    lengths, ks = [], []
    for step in range(300):  # acceptance that drifts: the policy pauses and resumes
        p = 0.85 if (step // 50) % 2 else 0.1
        k = live.next_k()
        accepted = 0
        while accepted < k and rng.random() < p:
            accepted += 1
        live.observe(k, accepted)
        ks.append(k)
        lengths.append(accepted + 1)
    assert ks.count(0) > 30 and ks.count(4) > 30  # the trace exercised both regimes
    for cut in (0, 1, 7, 150, 299, 300):
        replayed = AdaptiveK(4)
        replayed.replay(lengths[:cut])
        if cut < 300:
            assert replayed.next_k() == ks[cut], cut
    assert (replayed.emitted, replayed.weight, replayed.idle, replayed.probe_gap) == (
        live.emitted,
        live.weight,
        live.idle,
        live.probe_gap,
    )


# -- in the loop (tiny random Llamas, real engines) ------------------------------------------
def run_steps(target, draft, params, committed=(), committed_steps=None, cost=StepCost(0.5, 0.3)):
    """Every step's committed tokens, and the run's stats, of one adaptive run (k at most 3)."""
    import asyncio

    from specdec.loop.generate import LocalDraft, LocalTarget, SpeculativeRun

    run = SpeculativeRun(
        LocalTarget(target),
        LocalDraft(draft),
        [1, 2, 3, 4, 5],
        params,
        3,
        committed=list(committed),
        committed_steps=committed_steps,
        adaptive=True,
        step_cost=cost,
    )

    async def collect():
        return [tokens async for tokens in run.steps()]

    return asyncio.run(collect()), run.stats


def test_an_adaptive_run_is_exact_and_skips_a_useless_draft(target_model, draft_model):
    from specdec.engine.draft import DraftEngine
    from specdec.engine.target import TargetEngine
    from specdec.exact.sampling import SamplingParams
    from specdec.loop.generate import speculative_generate
    from specdec.modeling.tiny import negated_head

    target = TargetEngine(target_model)
    greedy = SamplingParams(temperature=0.0, seed=1, max_new_tokens=40, ignore_eos=True)
    alone = speculative_generate(target, None, [1, 2, 3, 4, 5], greedy, 0).token_ids
    steps, _stats = run_steps(target, DraftEngine(draft_model), greedy)
    assert flat(steps) == alone  # any k sequence gives the target's own greedy tokens
    _, useless = run_steps(target, DraftEngine(negated_head(target_model)), greedy, cost=StepCost())
    assert useless.accepted_tokens == 0 and useless.drafts <= useless.target_passes // 3  # mostly target-only


@pytest.mark.parametrize("cut", [1, 4, 9])
def test_an_adaptive_run_resumed_from_its_committed_steps_continues_identically(target_model, draft_model, cut):
    from specdec.engine.draft import DraftEngine
    from specdec.engine.target import TargetEngine
    from specdec.exact.sampling import SamplingParams

    target, draft = TargetEngine(target_model), DraftEngine(draft_model)
    params = SamplingParams(temperature=1.0, seed=99, max_new_tokens=60, ignore_eos=True)
    steps, stats = run_steps(target, draft, params)
    assert 0 < stats.drafts < stats.target_passes  # k changed along the way: blocks and target-only steps
    done = steps[:cut]
    rest, _ = run_steps(target, draft, params, flat(done), [len(s) for s in done])
    assert flat(done) + flat(rest) == flat(steps)
    with pytest.raises(ValueError, match="committed_steps"):
        run_steps(target, draft, params, flat(done), None)


def test_the_stored_request_pins_the_defaults_it_was_given():
    """A takeover re-parses the stored request: every server default it relied on must be in it."""
    from coordinator.requests import canonical
    from specdec.v1 import coordinator_pb2 as pb

    defaults = pb.GenerateRequest()
    defaults.sampling.seed = 7
    defaults.speculation.num_speculative_tokens = 2
    defaults.speculation.method = "draft_model"
    defaults.speculation.adaptive = True
    bare = pb.GenerateRequest(prompt_token_ids=[1, 2, 3])
    stored = pb.GenerateRequest.FromString(canonical(bare, "r1", defaults))
    spec = stored.speculation
    assert stored.request_id == "r1" and stored.sampling.seed == 7
    assert spec.HasField("num_speculative_tokens") and spec.num_speculative_tokens == 2
    assert spec.method == "draft_model" and spec.HasField("adaptive") and spec.adaptive
    # resuming with the same fields left unset is the same request; asking for another policy is not
    resume = pb.GenerateRequest(prompt_token_ids=[1, 2, 3], request_id="r1", resume_from_index=5)
    assert canonical(resume, "r1", stored) == stored.SerializeToString(deterministic=True)
    fixed = pb.GenerateRequest(prompt_token_ids=[1, 2, 3], request_id="r1")
    fixed.speculation.adaptive = False
    assert canonical(fixed, "r1", stored) != stored.SerializeToString(deterministic=True)
    explicit = pb.GenerateRequest(prompt_token_ids=[1, 2, 3])
    explicit.speculation.num_speculative_tokens = 0  # an explicit 0 is kept, not replaced by the default
    assert pb.GenerateRequest.FromString(canonical(explicit, "r2", defaults)).speculation.num_speculative_tokens == 0


def test_coordinator_flags_and_serve_app_args_select_the_policy(monkeypatch):
    import argparse

    from coordinator import serve_app, settings
    from coordinator.main import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    default = config_from_args(parser.parse_args(["--target", "h:1"]))
    assert default.default_adaptive and default.step_cost == StepCost()
    fixed = config_from_args(parser.parse_args(["--target", "h:1", "--fixed-k", "--step-cost", "0.3,0.1"]))
    assert not fixed.default_adaptive and fixed.step_cost == StepCost(0.3, 0.1)
    with pytest.raises(SystemExit):
        parser.parse_args(["--target", "h:1", "--step-cost", "0.3"])
    # the Serve application's args are the same settings under the same names
    app = serve_app.serve_config(
        settings.parse_values({"fixed_k": "true", "step_cost": "0.2,0.1", "redis": "redis://x:1/0"})
    )
    assert not app.default_adaptive and app.step_cost == StepCost(0.2, 0.1)
    assert serve_app.serve_config(settings.parse_values({"fixed_k": False, "redis": "redis://x:1/0"})).default_adaptive
    with pytest.raises(ValueError, match="fixed_k"):
        serve_app.build_app({"fixed_k": "maybe"})
    with pytest.raises(ValueError, match="unknown coordinator settings"):
        serve_app.build_app({"adaptive": True})
    # the registry is required where the replica runs (REDIS_URL comes from its runtime env)
    monkeypatch.delenv("REDIS_URL", raising=False)
    with pytest.raises(ValueError, match="REDIS_URL"):
        serve_app.serve_config(settings.parse_values({}))
    monkeypatch.setenv("REDIS_URL", "redis://y:2/0")
    assert serve_app.serve_config(settings.parse_values({})).redis_url == "redis://y:2/0"


def test_requests_get_the_adaptive_policy_by_default_only_with_a_draft_model():
    from coordinator.config import CoordinatorConfig
    from coordinator.core import CoordinatorCore
    from specdec.v1 import coordinator_pb2 as pb

    core = CoordinatorCore(CoordinatorConfig(target_address="127.0.0.1:1", default_k=2))
    core.requests.vocab_size, core.requests.context_length = 32, 64

    def parsed(method="", adaptive=None, k=None):
        request = pb.GenerateRequest(prompt_token_ids=[1, 2, 3])
        request.speculation.method = method
        if adaptive is not None:
            request.speculation.adaptive = adaptive
        if k is not None:
            request.speculation.num_speculative_tokens = k
        return core.requests.parse(request, "r")

    assert parsed().adaptive and parsed().k == 2 and parsed().method == "draft_model"
    assert not parsed(adaptive=False).adaptive
    assert not parsed("ngram").adaptive  # an empty lookup costs nothing: never paused by default
    assert parsed("ngram", adaptive=True).adaptive  # unless the request asks
    fixed = CoordinatorCore(CoordinatorConfig(target_address="127.0.0.1:1", default_adaptive=False))
    fixed.requests.vocab_size, fixed.requests.context_length = 32, 64
    assert not fixed.requests.parse(pb.GenerateRequest(prompt_token_ids=[1]), "r").adaptive


def test_without_a_session_log_a_request_id_in_flight_is_refused():
    """Static mode (no Redis): a second request reusing a live request_id must not touch the
    first one's run; it gets ALREADY_EXISTS (issue 24, item 5)."""
    import asyncio

    from coordinator.config import CoordinatorConfig
    from coordinator.core import CoordinatorCore
    from specdec.errors import SessionExistsError
    from specdec.v1 import coordinator_pb2 as pb

    core = CoordinatorCore(CoordinatorConfig(target_address="127.0.0.1:1"))
    core.requests.vocab_size, core.requests.context_length = 32, 64
    core.live_ids.add("busy")  # a request with that id is running here

    async def first_chunk(request_id):
        return await core.generate(pb.GenerateRequest(request_id=request_id, prompt_token_ids=[1])).__anext__()

    with pytest.raises(SessionExistsError, match="in flight"):
        asyncio.run(first_chunk("busy"))
    assert core.live_ids == {"busy"}  # the running one's id stays


@pytest.mark.parametrize("request_id", ["r" * 257, "bad\nid"])
def test_a_request_id_is_bounded_and_printable(request_id):
    """The request id becomes Redis keys and log fields: long or control-character ids are refused
    before anything is stored (issue 24, item 7)."""
    import asyncio

    from coordinator.config import CoordinatorConfig
    from coordinator.core import CoordinatorCore
    from specdec.v1 import coordinator_pb2 as pb

    core = CoordinatorCore(CoordinatorConfig(target_address="127.0.0.1:1"))
    core.requests.vocab_size, core.requests.context_length = 32, 64

    async def first_chunk():
        return await core.generate(pb.GenerateRequest(request_id=request_id, prompt_token_ids=[1])).__anext__()

    with pytest.raises(InvalidArgumentError) as info:
        asyncio.run(first_chunk())
    assert info.value.field == "request_id" and "printable" in str(info.value)
    assert core.live_ids == set()


def test_health_names_what_the_coordinator_lacks():
    """No target known, or none answering: not serving, and the reason says which (issue 24,
    item 16); the front publishes it to the gRPC health service and GET /health."""
    import asyncio

    from coordinator.config import CoordinatorConfig
    from coordinator.core import CoordinatorCore
    from specdec.runtime.registry import Replica

    async def scenario():
        core = CoordinatorCore(CoordinatorConfig(target_address="127.0.0.1:1"))
        try:
            nobody = await core.health()
            core.pool.static["127.0.0.1:1"] = Replica("target", "static-127.0.0.1:1", "127.0.0.1:1")
            silent = await core.health()
        finally:
            await core.close()
        return nobody, silent

    nobody, silent = asyncio.run(scenario())
    assert nobody == "no target replica is registered"
    assert silent == "none of the 1 target replica(s) answers"


def test_coordinator_settings_fall_back_on_the_environment_and_flags_win():
    """SPECDEC_<NAME> (what deploy/'s ConfigMap sets) configures the coordinator where no flag or
    Serve arg does; a bad value names the variable."""
    from coordinator import settings

    env = {"SPECDEC_NUM_SPECULATIVE_TOKENS": "5", "SPECDEC_FIXED_K": "true", "SPECDEC_STEP_COST": "0.1,0.2"}
    from_env = settings.values_from_env(env)
    assert from_env == {"num_speculative_tokens": 5, "fixed_k": True, "step_cost": settings._step_cost("0.1,0.2")}
    with pytest.raises(ValueError, match="SPECDEC_MAX_SPECULATIVE_TOKENS"):
        settings.values_from_env({"SPECDEC_MAX_SPECULATIVE_TOKENS": "many"})
    import os

    saved = dict(os.environ)
    try:
        os.environ.update(env)
        config = settings.config_from({"num_speculative_tokens": 2})  # a flag / Serve arg
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert config.default_k == 2 and config.default_adaptive is False
