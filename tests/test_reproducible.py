"""What a seed fixes (specdec/loop/reproducible.py): the rule that gives each request its sampling
mode and whether its schedule of k may follow the load, its place in the coordinator's parse, and
how the stored request pins it for a takeover. The stack-level promise (alone == under load ==
after a draft kill == after a takeover, on both APIs) is tested in tests/test_failover.py."""

from __future__ import annotations

import itertools

import pytest

from specdec.loop.reproducible import SEEDED_SAMPLING, resolve_reproducibility


def resolve(**kwargs):
    base = {"seeded": True, "sampled": True, "invariant": None, "replayable": None}
    return resolve_reproducibility(**{**base, **kwargs})


def test_a_seeded_sampled_request_samples_invariantly_by_default_and_may_follow_the_load():
    assert resolve() == (True, False)


def test_under_seeded_sampling_replayable_it_keeps_rejection_sampling_on_a_replayable_schedule():
    assert resolve(seeded_sampling="replayable") == (False, True)


def test_a_seeded_request_that_refuses_invariance_gets_a_replayable_schedule():
    assert resolve(invariant=False) == (False, True)


@pytest.mark.parametrize("seeded, sampled", [(False, True), (True, False), (False, False)])
def test_unseeded_or_greedy_requests_keep_the_servers_defaults(seeded, sampled):
    """Nothing to reproduce (no seed), or nothing a schedule can change (greedy is the target's
    argmax): standard sampling, load-aware, unless the server says otherwise."""
    for mode in SEEDED_SAMPLING:
        assert resolve(seeded=seeded, sampled=sampled, seeded_sampling=mode) == (False, False)
        assert resolve(seeded=seeded, sampled=sampled, seeded_sampling=mode, replayable_default=True) == (False, True)
        assert resolve(seeded=seeded, sampled=sampled, seeded_sampling=mode, invariant_default=True) == (True, False)


def test_what_a_request_says_wins_and_every_combination_fixes_a_seeded_sampled_requests_tokens():
    """Whatever the server's settings, a seeded sampled request that leaves the choice to the
    server gets tokens no load can change: invariant (any schedule) or a replayable schedule."""
    for mode, inv_default, rep_default in itertools.product(SEEDED_SAMPLING, (False, True), (False, True)):
        server = {"seeded_sampling": mode, "invariant_default": inv_default, "replayable_default": rep_default}
        invariant, replayable = resolve(**server)
        assert invariant or replayable, server
        for asked_inv, asked_rep in itertools.product((False, True), (False, True)):
            assert resolve(invariant=asked_inv, replayable=asked_rep, **server) == (asked_inv, asked_rep)
        # refusing invariance, the request gets a replayable schedule; refusing the replayable
        # schedule, it samples invariantly where the server's choice for seeds is invariance
        assert resolve(invariant=False, **server) == (False, True), server
        if mode == "invariant" or inv_default:
            assert resolve(replayable=False, **server) == (True, False), server


def test_an_unknown_mode_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="invariant"):
        resolve(seeded_sampling="sometimes")


# -- in the coordinator --------------------------------------------------------------------
def core_with(**config):
    from coordinator.config import CoordinatorConfig
    from coordinator.core import CoordinatorCore

    core = CoordinatorCore(CoordinatorConfig(target_address="127.0.0.1:1", **config))
    core.requests.vocab_size, core.requests.context_length = 32, 64
    return core


def bare(seed=None, temperature=0.8, **speculation):
    from specdec.v1 import coordinator_pb2 as pb

    request = pb.GenerateRequest(prompt_token_ids=[1, 2, 3])
    request.sampling.temperature = temperature
    if seed is not None:
        request.sampling.seed = seed
    for name, value in speculation.items():
        setattr(request.speculation, name, value)
    return request


def test_parse_resolves_the_mode_from_the_clients_seed_not_from_the_one_the_server_draws():
    core = core_with()
    seeded = core.requests.parse(bare(seed=5), "r")
    assert seeded.params.invariant and not seeded.replayable and seeded.params.seed == 5
    unseeded = core.requests.parse(bare(), "r")
    assert unseeded.params.seed is not None  # drawn and reported, but the client fixed nothing
    assert not unseeded.params.invariant and not unseeded.replayable
    greedy = core.requests.parse(bare(seed=5, temperature=0.0), "r")
    assert not greedy.params.invariant and not greedy.replayable
    replayable = core_with(seeded_sampling="replayable").requests.parse(bare(seed=5), "r")
    assert not replayable.params.invariant and replayable.replayable


def test_the_stored_request_pins_the_resolved_mode_so_a_takeover_with_other_defaults_keeps_it():
    """The session log stores the request with every server choice filled in; a coordinator
    taking it over re-parses that, whatever its own settings -- and the stored request still
    matches the client's resume call, which leaves those fields unset."""
    from coordinator.requests import canonical
    from specdec.v1 import coordinator_pb2 as pb

    original = bare(seed=9)
    stored_bytes = canonical(original, "r1", core_with().requests.parse(original, "r1").resolved())
    stored = pb.GenerateRequest.FromString(stored_bytes)
    assert stored.sampling.HasField("invariant") and stored.sampling.invariant
    assert stored.speculation.HasField("replayable") and not stored.speculation.replayable
    for other in ({"seeded_sampling": "replayable"}, {"replayable_schedule": True}, {"invariant_sampling": True}):
        taken = core_with(**other).requests.parse(stored, "r1")
        assert (taken.params.invariant, taken.replayable) == (True, False), other
    # an unseeded request stays unseeded in spirit: its drawn seed is stored, its mode too
    loose = bare()
    stored = pb.GenerateRequest.FromString(canonical(loose, "r2", core_with().requests.parse(loose, "r2").resolved()))
    taken = core_with().requests.parse(stored, "r2")
    assert not taken.params.invariant and not taken.replayable
    resume = bare(seed=9)
    resume.resume_from_index = 4
    assert canonical(resume, "r1", pb.GenerateRequest.FromString(stored_bytes)) == stored_bytes


def test_the_setting_is_a_flag_a_serve_arg_and_an_environment_variable():
    import argparse

    from coordinator import settings
    from coordinator.main import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args(["--target", "h:1"])).seeded_sampling == "invariant"
    chosen = parser.parse_args(["--target", "h:1", "--seeded-sampling", "replayable"])
    assert config_from_args(chosen).seeded_sampling == "replayable"
    with pytest.raises(SystemExit):
        parser.parse_args(["--target", "h:1", "--seeded-sampling", "never"])
    with pytest.raises(ValueError, match="seeded_sampling"):
        settings.parse_values({"seeded_sampling": "never"})
    env = settings.values_from_env({"SPECDEC_SEEDED_SAMPLING": "replayable"})
    assert env == {"seeded_sampling": "replayable"}


def test_specdec_serve_passes_the_choice_to_its_coordinator():
    import argparse

    from specdec.apps import cli

    parser = argparse.ArgumentParser()
    cli._stack_flags(parser)
    args = parser.parse_args(["--seeded-sampling", "replayable"])
    args.fixed_k = False
    assert cli._policy_flags(args) == ["--seeded-sampling", "replayable"]
    assert cli._policy_flags(parser.parse_args([])) == []
