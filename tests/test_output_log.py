"""The session log against a real redis-server: the lease fences appends, appends are exactly
once, and readers see each token once."""

from __future__ import annotations

import asyncio
import threading

import pytest

from coordinator.output_log import OutputLog, Run
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
            a = await log.create("r1", b"req", owner="A", reserve=0)
            assert a == Run("A", 1) and await log.create("r1", b"req", owner="B", reserve=0) is None
            assert await log.append("r1", 0, chunk(7, 8, 9), a)
            assert not await log.append("r1", 0, chunk(7, 8, 9), a)  # the reply was lost, the client retried
            with pytest.raises(LeaseLostError):
                await log.append("r1", 3, chunk(10), Run("B", 1))  # B never held it
            await log.redis.delete(log.keys("r1")[2])  # A's lease lapses (a slow loop) and nobody takes it:
            assert not await log.append("r1", 0, chunk(7, 8, 9), a)  # still A's: a retry is a retry
            assert await log.append("r1", 3, chunk(10), a)  # A's next append takes it again
            assert await log.lease_holder("r1") == b"A#1"
            await log.redis.delete(log.keys("r1")[2])  # A's lease lapses (a paused process) ...
            b = await log.acquire_lease("r1", "B")  # ... and B takes over
            assert b == Run("B", 2) and await log.acquire_lease("r1", "C") is None
            with pytest.raises(LeaseLostError):
                await log.append("r1", 4, chunk(11), a)  # A wakes up: fenced
            assert await log.append("r1", 4, chunk(11, finish="length"), b)
            entries = await log.entries("r1")
            assert [(e.start, list(e.chunk.token_ids)) for e in entries] == [(0, [7, 8, 9]), (3, [10]), (4, [11])]
            assert (await log.meta("r1"))["status"] == b"done"
            await log.release_lease("r1", a)  # not A's to release
            assert await log.lease_holder("r1") == b"B#2"
            await log.release_lease("r1", b)  # B released it, done; A wakes again:
            with pytest.raises(LeaseLostError):
                await log.append("r1", 5, chunk(12), a)  # a lapsed lease of a finished request stays lost
            assert await log.refresh_lease("r1", a) == 0
            a9 = await log.create("r9", b"req", owner="A", reserve=0)
            assert await log.append("r9", 0, chunk(1, 2), a9)
            await log.redis.delete(log.keys("r9")[2])
            b9 = await log.acquire_lease("r9", "B")
            assert b9 and await log.append("r9", 2, chunk(3), b9)
            await log.redis.delete(log.keys("r9")[2])  # B's client went away; A wakes behind B's entries:
            with pytest.raises(LeaseLostError):
                await log.append("r9", 2, chunk(3), a9)  # fenced, not a "retried append"
            a9_again = await log.acquire_lease("r9", "A")  # A's own resume takes it over: a run of its own
            assert a9_again == Run("A", 3)
            with pytest.raises(LeaseLostError):
                await log.append("r9", 3, chunk(4), a9)  # the same coordinator's stale run is fenced too
            assert await log.append("r9", 3, chunk(4), a9_again)
            assert await log.acquire_lease("gone", "A") is None and await log.meta("gone") is None
        finally:
            await log.close()

    asyncio.run(scenario())


def test_the_keeper_takes_a_lapsed_lease_again_and_returns_once_another_holds_it(redis_url, monkeypatch):
    from coordinator import output_log

    monkeypatch.setattr(output_log, "LEASE_REFRESH_S", 0.05)

    async def scenario():
        log = OutputLog(redis_url)
        try:
            a = await log.create("r2", b"req", owner="A", reserve=0)
            keeper = asyncio.ensure_future(log.keep_lease("r2", a))
            await asyncio.sleep(0.2)
            assert not keeper.done()  # refreshed while held
            await log.redis.delete(log.keys("r2")[2])  # lapsed (a starved loop), nobody took it over:
            await asyncio.sleep(0.2)
            assert not keeper.done() and await log.lease_holder("r2") == b"A#1"  # taken again
            await log.redis.set(log.keys("r2")[2], "B#2")  # taken over
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
        w = await writer.create(rid, stored, owner="W", reserve=0)  # another coordinator is generating it
        keeper = asyncio.ensure_future(writer.keep_lease(rid, w))

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
            await writer.append(rid, 0, chunk(5, 6), w)
            await writer.append(rid, 2, chunk(7, finish="length"), w)
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
            a = await log.create("big", b"req", owner="A", reserve=0)
            assert await log.append("big", 0, chunk(*range(20)), a)  # ~30 bytes
            with pytest.raises(ResourceExhaustedError, match="bound of 100 bytes per request"):
                await log.append("big", 20, chunk(*range(1000, 1100)), a)  # ~200 bytes
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
            a = await log.create("running", b"req", owner="A", reserve=0)
            assert a
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
                await log.create("late", b"r" * 65536, owner="A", reserve=0)
            assert await log.meta("late") is None
            with pytest.raises(ResourceExhaustedError, match="full; the tokens sent so far stand"):
                await log.append("running", 0, chunk(*range(5000)), a)
        finally:
            await log.close()

    with EmbeddedRedis(maxmemory="4mb") as server:
        asyncio.run(scenario(server.url))


# -- a lapsed lease is retaken only where nobody ran the request since (issue 62, item 6) ------
def test_a_lapsed_owner_cannot_retake_a_request_another_ran_and_left(redis_url):
    """A lapses, B takes the request over, writes tokens [3, 7) and lets go (its client left);
    A's refresh must not take the lease again (nobody holds it, but the log is no longer as A
    left it), and A's appends are refused, not written past B's: the log stays one run of
    consecutive tokens a reader can resume from."""

    async def scenario():
        log = OutputLog(redis_url)
        try:
            a = await log.create("r6", b"req", owner="A", reserve=0)
            assert await log.append("r6", 0, chunk(0, 1, 2), a)
            await log.redis.delete(log.keys("r6")[2])  # A's lease lapses (a paused process) ...
            b = await log.acquire_lease("r6", "B")  # ... B takes over ...
            assert await log.append("r6", 3, chunk(3, 4, 5, 6), b)
            await log.release_lease("r6", b)  # ... and its client goes away
            assert await log.refresh_lease("r6", a) == 0  # A wakes: the request is no longer its
            with pytest.raises(LeaseLostError):
                await log.append("r6", 5, chunk(5, 6, 7), a)
            with pytest.raises(LeaseLostError):
                await log.append("r6", 8, chunk(8, 9, finish="length"), a)
            entries = await log.entries("r6")
            assert [(e.start, e.end) for e in entries] == [(0, 3), (3, 7)]
            assert await log.lease_holder("r6") is None  # free for the next resuming reader
        finally:
            await log.close()

    asyncio.run(scenario())


def test_a_run_whose_request_was_taken_over_and_left_is_aborted_and_the_log_stays_resumable(redis_url, monkeypatch):
    """The same sequence through a coordinator's own generation (its lease keeper running): the
    stale run's stream ends ABORTED at its next chunk instead of writing past the takeover, and
    a reader of the log finds consecutive tokens. The loop is a stand-in (this is the session
    log's side of one run); the log, its scripts and the keeper are real."""
    from coordinator import output_log
    from coordinator.config import CoordinatorConfig
    from coordinator.core import CoordinatorCore
    from specdec.errors import SpecdecError

    monkeypatch.setattr(output_log, "LEASE_REFRESH_S", 0.05)

    async def scenario():
        core = CoordinatorCore(CoordinatorConfig(redis_url=redis_url))
        core.requests.vocab_size, core.requests.context_length = 32, 64
        rid = "r7"

        async def b_takes_over_and_leaves():
            other = OutputLog(redis_url)
            try:
                await other.redis.delete(other.keys(rid)[2])  # A's lease lapses ...
                b = await other.acquire_lease(rid, "B")  # ... B takes over, writes [3, 7) and lets go
                assert b is not None and await other.append(rid, 3, chunk(3, 4, 5, 6), b)
                await other.release_lease(rid, b)
            finally:
                await other.close()

        async def loop(parsed, committed, steps, carrier):  # A's run, paused past its lease after 3 tokens
            yield chunk(0, 1, 2)
            while not await core.log.entries(rid):  # (the loop runs a step ahead of the log)
                await asyncio.sleep(0.01)
            # A's whole event loop stands still (its lease keeper too) while B runs elsewhere
            b = threading.Thread(target=asyncio.run, args=(b_takes_over_and_leaves(),))
            b.start()
            b.join()
            await asyncio.sleep(0.3)  # A wakes; its keeper looks at the lease (a few times)
            for piece in (chunk(3, 4), chunk(5, 6, 7), chunk(8, 9, finish="length")):
                yield piece

        core.durable.generate = loop
        received: list[int] = []
        try:
            with pytest.raises(LeaseLostError) as lost:
                async for piece in core.generate(pb.GenerateRequest(request_id=rid, prompt_token_ids=[1, 2])):
                    received.extend(piece.token_ids)
            assert isinstance(lost.value, SpecdecError) and lost.value.code == "ABORTED"
            assert received == [0, 1, 2]
            entries = await core.log.entries(rid)
            assert [(e.start, e.end) for e in entries] == [(0, 3), (3, 7)]  # B's run, consecutive
            assert (await core.log.meta(rid))["status"] == b"running"  # resumable: nobody holds it
            assert await core.log.lease_holder(rid) is None
        finally:
            await core.close()

    asyncio.run(scenario())


# -- a request's log bytes reserved at admission, and bounded per API key (issue 62, item 7) ---
ALPHA, BRAVO = "sk-alpha-0123456789abcdef", "sk-bravo-0123456789abcdef"


def logprob_chunks(parsed, committed, steps, carrier):
    """A stand-in for the loop (the session log's side of admission is under test): the chunks
    of a request of ``max_new_tokens`` tokens, 4 a step, each with its logprobs as the loop sends
    them (a token's text and its top alternatives)."""

    async def chunks():
        n, top = parsed.params.max_new_tokens, parsed.params.logprobs
        for start in range(len(committed), n, 4):
            tokens = list(range(start, min(start + 4, n)))
            piece = pb.GenerateChunk(request_id=parsed.request_id, token_ids=[t % 32 for t in tokens])
            if top is not None:
                for t in tokens:
                    piece.logprobs.add(
                        logprob=-1.5,
                        token=f"w{t % 32}",
                        top_ids=list(range(top)),
                        top_logprobs=[-2.0] * top,
                        top_tokens=[f"w{i}" for i in range(top)],
                    )
            if start + 4 >= n:
                piece.finish_reason = "length"
            yield piece
            await asyncio.sleep(0)

    return chunks()


def test_one_api_key_cannot_lock_the_others_out_of_the_session_log(monkeypatch):
    """The issue's case, scaled to a 6 MB Redis: one key floods requests of 1000 tokens with 20
    logprobs each; before, all were admitted, their logs took Redis past its admission line and
    another key's small request was refused for the outputs' TTL. Now each request's log bytes
    are reserved at admission and one key may hold at most --max-output-bytes-per-key of them:
    its own requests past that are refused before they write anything, naming the bound, every
    one it admitted runs to its end, and the other key still gets in."""
    from coordinator import settings
    from coordinator.api_keys import ApiKey, ApiKeys
    from coordinator.front import CoordinatorFront, LocalBackend
    from specdec.errors import SpecdecError

    monkeypatch.setenv("SPECDEC_MAX_OUTPUT_BYTES_PER_KEY", str(2 << 20))

    async def scenario(url):
        front = CoordinatorFront(
            LocalBackend(settings.config_from({"redis": url})),
            keys=ApiKeys([ApiKey("alpha", ALPHA, 32), ApiKey("bravo", BRAVO, 32)]),
        )
        core = front.backend.core
        core.requests.vocab_size, core.requests.context_length = 32, 2048
        core.durable.generate = logprob_chunks

        async def call(key, rid, **sampling):
            request = pb.GenerateRequest(request_id=rid, prompt_token_ids=[1, 2, 3], sampling=sampling)
            tokens = 0
            try:
                async for piece in front.stream(request, {}, key=front.authenticate(f"Bearer {key}")):
                    tokens += len(piece.token_ids)
                return tokens, "OK", ""
            except SpecdecError as exc:
                return tokens, exc.code, str(exc)

        try:
            heavy = {"max_new_tokens": 1000, "logprobs": 20, "ignore_eos": True}
            flood = await asyncio.gather(*(call(ALPHA, f"alpha-{i}", **heavy) for i in range(20)))
            done = [o for o in flood if o[1] == "OK"]
            refused = [o for o in flood if o[1] != "OK"]
            assert done and all(tokens == 1000 for tokens, _, _ in done), flood
            assert refused, flood  # alpha is past its bound ...
            for tokens, code, message in refused:  # ... and told so before anything was written
                assert (tokens, code) == (0, "RESOURCE_EXHAUSTED") and "--max-output-bytes-per-key" in message, flood
            small = {"max_new_tokens": 16, "ignore_eos": True}
            assert await call(BRAVO, "bravo-1", **small) == (16, "OK", "")  # another key gets in
            used, limit = await core.log.memory()
            assert used < limit
        finally:
            await core.close()

    with EmbeddedRedis(maxmemory="6mb") as server:
        asyncio.run(scenario(server.url))


async def ledger_total(log, scope):
    from coordinator.output_log import ledger_keys

    return int(await log.redis.get(ledger_keys(scope)[2]) or 0)


def test_a_reservation_is_held_while_its_request_runs_settled_at_its_end_and_ages_out_with_its_log():
    """The ledgers against a real redis-server: a request reserves its bytes when it is created,
    in the running ledger and its key's; its last chunk (here written by a run that took it over)
    settles them -- out of the running one, its log's bytes in its key's; a request whose
    coordinator died keeps its reservation until its log would expire, then the next admission
    prunes it. Past its key's bound a request is refused and writes nothing; another key is not."""
    from coordinator import output_log
    from coordinator.output_log import ledger_keys, tenant_scope
    from specdec.errors import ResourceExhaustedError

    async def scenario(url):
        log = OutputLog(url, ttl_s=1.5, max_tenant_bytes=10_000)
        try:
            await log.check_room()
            a = await log.create("a", b"req", owner="A", reserve=4000, tenant="t1")
            assert a == Run("A", 1, "t1")
            assert await ledger_total(log, "running") == await ledger_total(log, tenant_scope("t1")) == 4000
            assert await log.append("a", 0, chunk(1, 2), a)
            await log.redis.delete(log.keys("a")[2])  # A dies; a resuming reader takes the request over
            b = await log.acquire_lease("a", "B")
            assert b == Run("B", 2, "t1")  # the same key's
            assert await log.append("a", 2, chunk(3, finish="length"), b)
            kept = int((await log.meta("a"))["bytes"]) + len(b"req")
            assert await ledger_total(log, "running") == 0
            assert await ledger_total(log, tenant_scope("t1")) == kept  # its log, until it expires

            dead = await log.create("dead", b"req", owner="A", reserve=6000, tenant="t1")  # never refreshed
            assert dead and await ledger_total(log, tenant_scope("t1")) == kept + 6000
            with pytest.raises(ResourceExhaustedError, match=r"per-key bound of 10000 bytes \(--max-output-bytes"):
                await log.create("over", b"req", owner="A", reserve=4000, tenant="t1")
            assert await log.meta("over") is None
            assert await log.create("other", b"req", owner="A", reserve=4000, tenant="t2")  # another key
            assert await log.create("anonymous", b"req", owner="A", reserve=20_000)  # no key: no bound

            await asyncio.sleep(1.7)  # the logs expire, and so do their reservations
            assert await log.meta("dead") is None
            assert await log.create("later", b"req", owner="A", reserve=9000, tenant="t1")
            assert await ledger_total(log, tenant_scope("t1")) == 9000
            assert await ledger_total(log, "running") == 9000
            for key in [*ledger_keys("running"), *ledger_keys(tenant_scope("t1"))]:
                assert 0 < await log.redis.pttl(key) <= 1500  # nothing outlives the TTL

            # Room: Redis's use plus the running reservations stay under its admission line
            log._room_looked = -output_log.ROOM_CHECK_S  # look at Redis's memory again now
            await log.check_room()
            used, limit = await log.memory()
            room = int(output_log.ROOM_FRACTION * limit) - used - 9000
            assert await log.create("big", b"req", owner="A", reserve=room - 100_000)
            with pytest.raises(ResourceExhaustedError, match=r"too full for request 'big2'.* more reserved"):
                await log.create("big2", b"req", owner="A", reserve=200_000)
            assert await log.meta("big2") is None
        finally:
            await log.close()

    with EmbeddedRedis(maxmemory="64mb") as server:
        asyncio.run(scenario(server.url))


def test_the_lease_keeper_keeps_a_running_requests_reservation_past_the_ttl(redis_url, monkeypatch):
    from coordinator import output_log

    monkeypatch.setattr(output_log, "LEASE_REFRESH_S", 0.05)

    async def scenario():
        log = OutputLog(redis_url, ttl_s=0.5)
        try:
            run = await log.create("long", b"req", owner="A", reserve=5000, tenant="t5")
            keeper = asyncio.ensure_future(log.keep_lease("long", run))
            await asyncio.sleep(1.2)  # past the TTL, running
            assert await log.create("probe", b"req", owner="A", reserve=1, tenant="t5")  # prunes what expired
            assert await ledger_total(log, "tenant:t5") == 5001
            keeper.cancel()  # its coordinator dies
            await asyncio.sleep(0.7)
            assert await log.create("probe2", b"req", owner="A", reserve=1, tenant="t5")
            assert await ledger_total(log, "tenant:t5") == 1
        finally:
            await log.close()

    asyncio.run(scenario())
