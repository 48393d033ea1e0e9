"""Prefix-aware routing as pure functions (coordinator.affinity); through a real stack of two
target and two draft replicas in tests/test_failover.py."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.affinity import (
    AFFINITY_BLOCK,
    AFFINITY_MAX_EXTRA_SESSIONS,
    PrefixAffinity,
    choose_near_prefix,
    prefix_keys,
)
from coordinator.routing import PeerPool, SessionRouting
from specdec.runtime.registry import Replica


def target(rid: str, load: int = 0, capacity: int = 32) -> Replica:
    return Replica("target", rid, f"h:{rid}", "m", "fp", vocab_size=100, load=load, capacity=capacity)


def test_the_block_is_the_replicas_prefix_cache_block():
    from specdec.modeling.paged import BLOCK

    assert AFFINITY_BLOCK == BLOCK  # the prefix cache's blocks are the pool's


def test_keys_name_whole_prefixes_block_by_block():
    a = list(range(40))
    keys = prefix_keys(a)
    assert len(keys) == 2  # two whole blocks of 16; the last 8 tokens are no block
    assert prefix_keys(a[:32]) == keys and prefix_keys(a[:31]) == keys[:1]
    b = [*a[:16], 99, *a[17:]]  # differs in the second block only
    assert prefix_keys(b)[0] == keys[0] and prefix_keys(b)[1] != keys[1]
    c = [*a[:16][::-1], *a[16:]]  # same second block after a different first one: another prefix
    assert prefix_keys(c)[1] != keys[1]
    assert prefix_keys(a[:15]) == []


def test_the_memory_names_the_latest_holder_longest_prefix_first_and_is_bounded():
    memory = PrefixAffinity(max_blocks=4)
    long, short = prefix_keys(list(range(48))), prefix_keys(list(range(16)))
    memory.remember(long, "r1")
    assert list(memory.holders(long)) == [("r1", 3), ("r1", 2), ("r1", 1)]
    memory.remember(short, "r2")  # a later session on the first block alone went elsewhere
    assert list(memory.holders(long)) == [("r1", 3), ("r1", 2), ("r2", 1)]
    memory.remember(prefix_keys(list(range(100, 148))), "r3")  # three new blocks: the oldest go
    assert len(memory) == 4
    assert list(memory.holders(long)) == [("r2", 1)]  # the first block was touched last of those
    with pytest.raises(ValueError, match="max_blocks"):
        PrefixAffinity(max_blocks=0)


def test_a_session_goes_where_its_prefix_is_unless_that_replica_is_much_busier_or_full():
    prompt = list(range(40))  # 32 of 40 tokens in whole blocks
    memory = PrefixAffinity()
    memory.remember(prefix_keys(prompt), "busy")

    def pick(busy_load, capacity=32, idle_load=0, length=40, pending=None):
        candidates = [target("busy", busy_load, capacity), target("idle", idle_load)]
        chosen, shared = choose_near_prefix(candidates, memory.holders(prefix_keys(prompt)), length, pending)
        return chosen.replica_id if chosen else None, shared

    assert pick(0) == ("busy", 32)  # a tie: the holder
    assert pick(AFFINITY_MAX_EXTRA_SESSIONS) == ("busy", 32)  # a few sessions busier: still the holder
    assert pick(AFFINITY_MAX_EXTRA_SESSIONS + 1) == ("idle", 0)  # too much busier: balance wins
    assert pick(3, idle_load=2) == ("busy", 32)  # the gap is what counts, not the load
    assert pick(2, pending={"busy": AFFINITY_MAX_EXTRA_SESSIONS}) == ("idle", 0)  # our unreported picks count
    assert pick(3, capacity=3) == ("idle", 0)  # full
    assert pick(1, length=65) == ("idle", 0)  # 32 of 65 tokens: under half the prompt is not worth it
    assert choose_near_prefix([], memory.holders(prefix_keys(prompt)), 40) == (None, 0)
    # the holder is not a candidate (draining, excluded, or another model's): the least loaded
    chosen, shared = choose_near_prefix([target("idle", 3)], memory.holders(prefix_keys(prompt)), 40)
    assert chosen is not None and chosen.replica_id == "idle" and shared == 0


def test_the_pool_remembers_its_picks_and_can_be_told_not_to():
    """PeerPool with static replicas (no registry): the same prompt goes back where it went; a
    different one to the least loaded; with prefix routing off, both go to the least loaded."""

    async def picks(prefix_routing: bool) -> list[str]:
        pool = PeerPool(None, prefix_routing=prefix_routing)
        pool.static = {r.address: r for r in (target("a"), target("b"))}
        long_a, long_b = list(range(40)), list(range(50, 90))
        out = []
        for prompt in (long_a, long_b, long_a, long_a, long_b):
            routing = SessionRouting(pool, prompt)
            await routing.first_target()
            assert routing.target is not None
            out.append(routing.target.replica_id)
        return out

    # least loaded alone: our own picks count as load until a heartbeat shows them (no registry
    # here: they count for two heartbeats), so the picks alternate
    assert asyncio.run(picks(False)) == ["a", "b", "a", "b", "a"]
    assert asyncio.run(picks(True)) == ["a", "b", "a", "a", "b"]


def test_prefix_routing_is_on_by_default_and_each_way_of_running_the_coordinator_turns_it_off():
    import argparse

    from coordinator import settings
    from coordinator.main import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args(["--target", "h:1"])).prefix_routing
    assert not config_from_args(parser.parse_args(["--target", "h:1", "--no-prefix-routing"])).prefix_routing
    assert not settings.config_from(settings.parse_values({"no_prefix_routing": "true"})).prefix_routing  # Serve args
    env = settings.values_from_env({"SPECDEC_NO_PREFIX_ROUTING": "yes"})
    assert not settings.config_from(env).prefix_routing
