"""Requests kept in the session log (Redis): every committed chunk is appended, fenced by the
generating coordinator's lease, before it is sent; a client that lost its stream resumes from any
index, and a request whose coordinator died is taken over by the next call that finds its lease
lapsed, continuing from the logged tokens with the same seed (docs/protocol.md). Knows nothing of
replicas or the loop: the core hands it the admission and the generation."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

from coordinator.output_log import OutputLog, Run, reserved_bytes
from coordinator.requests import ParsedRequest, RequestParser, canonical
from specdec.errors import InvalidArgumentError, LeaseLostError, PeerError, ResourceExhaustedError, SessionNotFoundError
from specdec.v1 import coordinator_pb2

log = logging.getLogger("specdec.coordinator")

LOG_POLL_S = 0.05  # a resumed stream's wait for new log entries
LEASE_CHECK_POLLS = 20  # ... and how many waits between looks at the lease

# (parsed request, committed tokens, tokens per committed step, trace carrier) -> its chunks
Generate = Callable[
    [ParsedRequest, list[int], list[int], dict | None], AsyncGenerator[coordinator_pb2.GenerateChunk, None]
]


async def run_ahead(source: AsyncGenerator, depth: int = 1) -> AsyncIterator:
    """The items of ``source``, which runs in its own task up to ``depth`` items ahead of the
    caller: while the caller logs item n to Redis and hands it to Ray (a few ms per step), the
    next step's RPCs are already in flight. Order and exceptions are the source's; closing this
    iterator (a client gone, an error downstream) cancels the source's task and closes the source,
    so its cleanup (the sessions' release) has run when this returns."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=depth)
    end = object()

    async def pump() -> None:
        try:
            async for item in source:
                await queue.put((item, None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, raised there
            await queue.put((end, exc))
            return
        finally:
            await source.aclose()  # cancelled while an item waited in the queue: clean up now
        await queue.put((end, None))

    task = asyncio.ensure_future(pump())
    try:
        while True:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is end:
                return
            yield item
    finally:
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def trim_chunk(chunk, start: int, from_index: int, tokens: list[int], tokenizer):
    """The part of ``chunk`` (tokens [start, start+len)) at or after ``from_index``; None if
    nothing is left to send. ``tokens``: every token up to the end of this chunk; ``tokenizer``
    (None: no text) decodes the text of the remainder."""
    end = start + len(chunk.token_ids)
    if start >= from_index:
        return chunk
    if end <= from_index and not chunk.finish_reason:
        return None
    out = coordinator_pb2.GenerateChunk()
    out.CopyFrom(chunk)
    cut = max(0, from_index - start)
    del out.token_ids[:]
    out.token_ids.extend(chunk.token_ids[cut:])
    del out.logprobs[:]
    out.logprobs.extend(chunk.logprobs[cut:])
    if tokenizer is not None:  # text of the remainder only
        head = tokenizer.decode(tokens[: min(from_index, end)], skip_special_tokens=True)
        whole = tokenizer.decode(tokens[:end], skip_special_tokens=True)
        out.text = whole[len(head) :] if whole.startswith(head) else chunk.text
    return out


class DurableRequests:
    """The session-log side of the coordinator: a new logged request, a resumed stream, a takeover.

    ``admitted(logged)``: the core's admission (a slot among its concurrent requests, and room in
    the log); ``generate``: one run of the loop."""

    def __init__(
        self,
        session_log: OutputLog,
        owner: str,
        requests: RequestParser,
        max_readers: int,
        admitted: Callable[[bool], AbstractAsyncContextManager[None]],
        generate: Generate,
    ):
        self.log = session_log
        self.owner = owner  # this coordinator's name on the leases it holds
        self.requests = requests
        self.max_readers = max_readers
        self.readers = 0  # resumed streams reading the log now
        self.admitted = admitted
        self.generate = generate

    async def stream(
        self, request: coordinator_pb2.GenerateRequest, request_id: str, trace_carrier: dict | None, tenant: str = ""
    ) -> AsyncIterator[coordinator_pb2.GenerateChunk]:
        """A request's chunks: generated here and logged when the log does not know its id (or
        it has none), else read from the log from ``resume_from_index`` (taken over if nobody
        generates it). ``tenant``: the caller's API key's (its bound on the log), "" for none."""
        meta = await self.log.meta(request_id) if request.request_id else None
        if meta is None:
            if request.resume_from_index:
                raise SessionNotFoundError(f"request_id {request_id!r}: nothing to resume (unknown or expired)")
            parsed = self.requests.parse(request, request_id, await self.requests.encode(request))
            stored = canonical(request, request_id, parsed.resolved())
            params = parsed.params
            reserve = reserved_bytes(
                params.max_new_tokens, params.logprobs, request_id, len(stored), self.log.max_request_bytes
            )
            async with self.admitted(True):
                await self.requests.check_constraint(parsed)  # refused: nothing written
                run = await self.log.create(request_id, stored, self.owner, reserve, tenant)
                if run is not None:
                    async for chunk in self._owned(run, parsed, [], [], 0, trace_carrier):
                        yield chunk
                    return
            meta = await self.log.meta(request_id)  # created concurrently by another call
            if meta is None:  # ... and already expired or deleted
                raise SessionNotFoundError(f"request_id {request_id!r}: created and gone meanwhile; retry")
        async for chunk in self._resume(request, request_id, meta, trace_carrier):
            yield chunk

    async def _owned(
        self,
        run: Run,
        parsed: ParsedRequest,
        committed: list[int],
        committed_steps: list[int],
        from_index: int,
        trace_carrier,
    ) -> AsyncIterator[coordinator_pb2.GenerateChunk]:
        """Generate as ``run``, holding its lease: append each chunk (one step's tokens) to the
        log, then send it (the next step runs meanwhile: see :func:`run_ahead`)."""
        session_log = self.log
        keeper = asyncio.create_task(session_log.keep_lease(parsed.request_id, run))
        tokens = list(committed)
        try:
            async for chunk in run_ahead(self.generate(parsed, committed, committed_steps, trace_carrier)):
                if keeper.done():  # the lease lapsed: another coordinator may be generating it
                    raise LeaseLostError(f"request {parsed.request_id!r}: lease lost; resume with resume_from_index")
                start = len(tokens)
                await session_log.append(parsed.request_id, start, chunk, run)  # fenced
                tokens.extend(chunk.token_ids)
                out = trim_chunk(chunk, start, from_index, tokens, self.requests.tokenizer)
                if out is not None:
                    yield out
        finally:
            keeper.cancel()
            with contextlib.suppress(Exception):  # the lease expires by itself
                await asyncio.shield(session_log.release_lease(parsed.request_id, run))

    async def _resume(self, request, request_id: str, meta: dict, trace_carrier):
        """A resumed stream: counted against ``max_resume_readers`` (each polls the log)."""
        if self.readers >= self.max_readers:
            raise ResourceExhaustedError(f"{self.readers} resumed streams are reading, the limit is {self.max_readers}")
        self.readers += 1
        try:
            async for chunk in self._read_log(request, request_id, meta, trace_carrier):
                yield chunk
        finally:
            self.readers -= 1

    async def _read_log(self, request, request_id: str, meta: dict, trace_carrier):
        session_log = self.log
        stored = coordinator_pb2.GenerateRequest.FromString(meta["request"])
        if canonical(request, request_id, stored) != stored.SerializeToString(deterministic=True):
            raise InvalidArgumentError("request_id", f"{request_id!r} is already used by a different request")
        from_index = request.resume_from_index
        tokens: list[int] = []
        steps: list[int] = []  # tokens per log entry, i.e. per step of the runs that wrote them
        last, polls = b"-", 0
        while True:
            # Polled, not a blocking read: a waiting reader holds no pooled connection, so readers
            # can never starve the lease refreshes and appends of the pool (issue 24).
            entries = await session_log.entries(request_id, last)
            for entry in entries:
                last = entry.entry_id
                out = self._absorb(entry, from_index, tokens, steps)
                if out is not None:
                    yield out
                if entry.chunk.finish_reason:
                    return
            if entries:
                continue
            polls += 1
            if (polls - 1) % LEASE_CHECK_POLLS:  # the lease: at the first wait, then once a second
                await asyncio.sleep(LOG_POLL_S)
                continue
            if from_index > len(tokens) and await session_log.lease_holder(request_id) is None:
                raise InvalidArgumentError(
                    "resume_from_index", f"{from_index} is past the {len(tokens)} tokens this request committed"
                )
            # Nobody is generating it (its coordinator died, or its client cancelled): take over,
            # continuing from the committed tokens with the same seed, hence the same tokens.
            run = await session_log.acquire_lease(request_id, self.owner)
            if run is not None:
                for entry in await session_log.entries(request_id, last):  # appended before the lease lapsed
                    last = entry.entry_id
                    out = self._absorb(entry, from_index, tokens, steps)
                    if out is not None:
                        yield out
                    if entry.chunk.finish_reason:
                        await session_log.release_lease(request_id, run)
                        return
                log.info("request %s: taking over after %d committed tokens", request_id, len(tokens))
                parsed = self.requests.parse(stored, request_id, await self.requests.encode(stored))
                try:
                    async with self.admitted(True):
                        async for chunk in self._owned(run, parsed, tokens, steps, from_index, trace_carrier):
                            yield chunk
                except ResourceExhaustedError:  # no room to take it over here: it stays resumable
                    await session_log.release_lease(request_id, run)
                    raise
                return

    def _absorb(self, entry, from_index: int, tokens: list[int], steps: list[int]):
        """Adds one log entry to what a resumed call has read (its tokens, and the step that wrote
        them, for the policy's replay); returns the part of it the caller has not seen, or None.
        An entry that does not start where the read tokens end is skipped (a duplicate: appends
        are exactly-once, readers defensive all the same) or refused (a gap)."""
        if entry.start < len(tokens):
            log.warning("request log: skipping a duplicate entry at token %d", entry.start)
            return None
        if entry.start > len(tokens):
            raise PeerError("UNAVAILABLE", f"session log: entry at token {entry.start} after {len(tokens)} tokens")
        tokens.extend(entry.chunk.token_ids)
        steps.append(len(entry.chunk.token_ids))
        return trim_chunk(entry.chunk, entry.start, from_index, tokens, self.requests.tokenizer)
