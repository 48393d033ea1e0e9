"""coordinator.durable.run_ahead: the speculative loop runs one step ahead of logging and sending,
without reordering, losing or hiding anything, and without leaking sessions when stopped."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.durable import run_ahead


def test_items_arrive_in_order_while_the_source_works_ahead():
    events = []

    async def source():
        for i in range(4):
            events.append(f"make {i}")
            await asyncio.sleep(0)
            yield i

    async def consume():
        got = []
        async for item in run_ahead(source()):
            events.append(f"handle {item} start")
            await asyncio.sleep(0.01)  # logging + sending one chunk
            events.append(f"handle {item} end")
            got.append(item)
        return got

    assert asyncio.run(consume()) == [0, 1, 2, 3]
    # the next item was being made while the previous one was handled
    assert events.index("make 1") < events.index("handle 0 end")
    assert events.index("make 3") < events.index("handle 2 end")


def test_the_sources_error_reaches_the_caller_after_its_items():
    async def source():
        yield 1
        raise ValueError("target lost")

    async def consume():
        got = []
        with pytest.raises(ValueError, match="target lost"):
            async for item in run_ahead(source()):
                got.append(item)
        return got

    assert asyncio.run(consume()) == [1]


@pytest.mark.parametrize("source_blocked", [True, False])
def test_stopping_early_runs_the_sources_cleanup(source_blocked):
    """A client gone: the loop's finally (which releases the sessions) must run, whether the
    source was mid-step (awaiting an RPC) or waiting for the caller to take its next item."""
    cleaned = []

    async def source():
        try:
            for i in range(100):
                if source_blocked:
                    await asyncio.sleep(10)  # an RPC in flight
                yield i
        finally:
            await asyncio.sleep(0)
            cleaned.append(True)

    async def consume():
        stream = run_ahead(source())
        if not source_blocked:
            assert await stream.__anext__() == 0
            await asyncio.sleep(0.01)  # the source has made item 1 and waits to hand it over
        else:
            task = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        await stream.aclose()
        assert cleaned == [True]  # before the caller moves on, not when the loop shuts down

    asyncio.run(consume())
