"""The session log against a real redis-server: the lease fences appends, appends are exactly
once, and readers see each token once."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.output_log import OutputLog
from specdec.errors import LeaseLostError
from specdec.runtime.redis_embedded import EmbeddedRedis
from specdec.v1 import coordinator_pb2 as pb

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def redis_url():
    with EmbeddedRedis() as server:
        yield server.url


def chunk(*tokens, finish=""):
    return pb.GenerateChunk(token_ids=list(tokens), finish_reason=finish)


def test_only_the_lease_holder_appends_and_a_retried_append_writes_nothing(redis_url):
    async def scenario():
        log = OutputLog(redis_url)
        try:
            assert await log.create("r1", b"req", owner="A")
            assert await log.append("r1", 0, chunk(7, 8, 9), "A")
            assert not await log.append("r1", 0, chunk(7, 8, 9), "A")  # the reply was lost, the client retried
            with pytest.raises(LeaseLostError):
                await log.append("r1", 3, chunk(10), "B")  # B never held it
            await log.redis.delete(log.keys("r1")[2])  # A's lease lapses (a slow loop) and nobody takes it:
            assert await log.append("r1", 3, chunk(10), "A")  # A's next append takes it again
            assert await log.lease_holder("r1") == b"A"
            await log.redis.delete(log.keys("r1")[2])  # A's lease lapses (a paused process) ...
            assert await log.acquire_lease("r1", "B")  # ... and B takes over
            with pytest.raises(LeaseLostError):
                await log.append("r1", 4, chunk(11), "A")  # A wakes up: fenced
            assert await log.append("r1", 4, chunk(11, finish="length"), "B")
            entries = await log.entries("r1")
            assert [(e.start, list(e.chunk.token_ids)) for e in entries] == [(0, [7, 8, 9]), (3, [10]), (4, [11])]
            assert (await log.meta("r1"))["status"] == b"done"
            await log.redis.delete(log.keys("r1")[2])  # B released it, done; A wakes again:
            with pytest.raises(LeaseLostError):
                await log.append("r1", 5, chunk(12), "A")  # a lapsed lease of a finished request stays lost
            assert await log.refresh_lease("r1", "A") == 0
            assert await log.create("r9", b"req", owner="A")
            assert await log.append("r9", 0, chunk(1, 2), "A")
            await log.redis.delete(log.keys("r9")[2])
            assert await log.acquire_lease("r9", "B") and await log.append("r9", 2, chunk(3), "B")
            await log.redis.delete(log.keys("r9")[2])  # B's client went away; A wakes behind B's entries:
            with pytest.raises(LeaseLostError):
                await log.append("r9", 2, chunk(3), "A")  # fenced, not a "retried append"
        finally:
            await log.close()

    asyncio.run(scenario())


def test_the_keeper_takes_a_lapsed_lease_again_and_returns_once_another_holds_it(redis_url, monkeypatch):
    from coordinator import output_log

    monkeypatch.setattr(output_log, "LEASE_REFRESH_S", 0.05)

    async def scenario():
        log = OutputLog(redis_url)
        try:
            assert await log.create("r2", b"req", owner="A")
            keeper = asyncio.ensure_future(log.keep_lease("r2", "A"))
            await asyncio.sleep(0.2)
            assert not keeper.done()  # refreshed while held
            await log.redis.delete(log.keys("r2")[2])  # lapsed (a starved loop), nobody took it over:
            await asyncio.sleep(0.2)
            assert not keeper.done() and await log.lease_holder("r2") == b"A"  # taken again
            await log.redis.set(log.keys("r2")[2], "B")  # taken over
            await asyncio.wait_for(keeper, 2.0)  # returns: the generation can stop now
        finally:
            await log.close()

    asyncio.run(scenario())


def test_resumed_readers_are_capped_and_hold_no_connection_while_they_wait(redis_url):
    from coordinator.config import CoordinatorConfig
    from coordinator.core import CoordinatorCore
    from coordinator.requests import canonical
    from specdec.errors import ResourceExhaustedError

    async def scenario():
        core = CoordinatorCore(CoordinatorConfig(redis_url=redis_url, max_resume_readers=50))
        core.requests.vocab_size, core.requests.context_length = 32, 64
        rid = "r3"
        req = pb.GenerateRequest(request_id=rid, prompt_token_ids=[1, 2])
        stored = canonical(req, rid, core.requests.parse(req, rid).resolved())
        writer = OutputLog(redis_url)
        assert await writer.create(rid, stored, owner="W")  # another coordinator is generating it
        keeper = asyncio.ensure_future(writer.keep_lease(rid, "W"))

        async def read():
            return [t for c in [c async for c in core.generate(req)] for t in c.token_ids]

        try:
            readers = [asyncio.ensure_future(read()) for _ in range(50)]
            for _ in range(200):  # every reader reaches its polling wait (a loaded machine: later)
                if core.durable.readers == 50:
                    break
                await asyncio.sleep(0.05)
            assert core.durable.readers == 50
            # Polling: between polls nobody holds a pooled connection. The readers poll in step, so a
            # single look can land inside a burst of 50 reads on a loaded machine; the least of many
            # looks cannot be small if each waiting reader parked a connection (a blocking read).
            pool = core.log.redis.connection_pool
            in_use = []
            for _ in range(100):
                in_use.append(len(pool._in_use_connections))
                await asyncio.sleep(0.01)
            assert min(in_use) <= 4, in_use
            with pytest.raises(ResourceExhaustedError, match="limit is 50"):
                await read()
            await writer.append(rid, 0, chunk(5, 6), "W")
            await writer.append(rid, 2, chunk(7, finish="length"), "W")
            assert await asyncio.wait_for(asyncio.gather(*readers), 10) == [[5, 6, 7]] * 50
            assert core.durable.readers == 0
        finally:
            keeper.cancel()
            await writer.close()
            await core.close()

    asyncio.run(scenario())


# -- bounds (issue 42, item 1) ------------------------------------------------------------------
def test_a_requests_log_stops_at_its_byte_bound_and_writes_nothing_past_it(redis_url):
    from specdec.errors import ResourceExhaustedError

    async def scenario():
        log = OutputLog(redis_url, max_request_bytes=100)
        try:
            assert await log.create("big", b"req", owner="A")
            assert await log.append("big", 0, chunk(*range(20)), "A")  # ~30 bytes
            with pytest.raises(ResourceExhaustedError, match="bound of 100 bytes per request"):
                await log.append("big", 20, chunk(*range(1000, 1100)), "A")  # ~200 bytes
            assert [e.start for e in await log.entries("big")] == [0]
            assert int((await log.meta("big"))["bytes"]) < 100
        finally:
            await log.close()

    asyncio.run(scenario())


def test_new_requests_are_refused_past_the_share_of_maxmemory_and_a_full_redis_refuses_clearly():
    """With Redis near its maxmemory (noeviction) a coordinator admits nothing new, naming the
    session log; what does not fit at all is RESOURCE_EXHAUSTED, not a Redis traceback, and a
    refused create leaves no key behind."""
    import redis.exceptions

    from coordinator import output_log
    from specdec.errors import ResourceExhaustedError

    async def scenario(url):
        log = OutputLog(url)
        try:
            await log.check_room()  # room: nothing raised
            assert await log.create("running", b"req", owner="A")
            used, limit = await log.memory()
            assert limit == 4 << 20 and used < limit
            filler = b"x" * 4096
            with pytest.raises(redis.exceptions.OutOfMemoryError):  # fill Redis to its bound (outside the log)
                for i in range(2000):
                    await log.redis.set(f"fill:{i}", filler)
            log._room_looked = -output_log.ROOM_CHECK_S  # look again now
            with pytest.raises(ResourceExhaustedError, match=r"session log .* maxmemory"):
                await log.check_room()
            with pytest.raises(ResourceExhaustedError, match="full"):
                await log.create("late", b"r" * 65536, owner="A")
            assert await log.meta("late") is None
            with pytest.raises(ResourceExhaustedError, match="full; the tokens sent so far stand"):
                await log.append("running", 0, chunk(*range(5000)), "A")
        finally:
            await log.close()

    with EmbeddedRedis(maxmemory="4mb") as server:
        asyncio.run(scenario(server.url))
