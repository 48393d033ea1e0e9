"""Durable, resumable output: each request's committed tokens in a Redis Stream.

Keys (all with a TTL, refreshed on every write):
- ``specdec:req:<id>:meta``  hash: the canonical request (serialized, resolved seed included),
  status (running / done), the bytes of its chunks so far, its epoch (the run that owns it);
- ``specdec:req:<id>:out``   stream: one entry per committed chunk: ``start`` (index of its first
  token), ``chunk`` (a serialized GenerateChunk; the last one carries finish_reason/seed/stats);
- ``specdec:req:<id>:lease`` the run currently generating it (TTL LEASE_S, refreshed every
  LEASE_REFRESH_S): its coordinator and the request's *epoch* (``owner#epoch``, a :class:`Run`).
  The meta's ``epoch`` is bumped by every takeover. When a coordinator dies the lease lapses and a
  resuming replica takes over (the next epoch); one merely slow past it (a starved loop) takes a
  lapsed lease again only while the epoch is still its own: nobody took over, so nobody wrote.

A chunk is appended (and fsync'ed by Redis, ``appendfsync always``) before it is sent, so a token
a client has seen is never lost. An append is one script that checks the lease and writes the
entry at an explicit stream id derived from the chunk's first token index (``start + 1``): the
lease and epoch are a fence (a run whose lease lapsed -- a paused process, a slow fsync -- cannot
write after one that took over, even one that has let go since), and an append retried after a
lost reply finds its entry already there and writes nothing (exactly once, not at least once).

Bounds: a request's chunks at most ``max_request_bytes``; every key a TTL (``ttl_s`` after the
last write); and Redis's own maxmemory, which the coordinator keeps new requests under
(:meth:`OutputLog.check_room`) so that what runs never meets it. Only requests that can be
resumed are logged: the HTTP API's are not (docs/protocol.md, "Durable output").
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from specdec.errors import LeaseLostError, ResourceExhaustedError
from specdec.v1 import coordinator_pb2

log = logging.getLogger("specdec.output_log")

LEASE_S = 3.0
LEASE_REFRESH_S = 1.0
LEASE_MS = int(LEASE_S * 1000)  # as Redis takes it (PX)
DEFAULT_TTL_S = 600.0
# One request's log holds at most this many bytes of chunks: the largest a request the default
# limits allow writes (4096 tokens with 20 logprobs each) is about a third of it.
DEFAULT_MAX_REQUEST_BYTES = 4 << 20
# A new request is admitted while Redis uses less than this share of its maxmemory: the rest is
# headroom for the requests already running, their leases and the replicas' heartbeats, which
# Redis (maxmemory-policy noeviction) refuses rather than evicting anything.
ROOM_FRACTION = 0.85
ROOM_CHECK_S = 0.5  # how long one look at Redis's memory stands for the requests that follow

# A run may write while its lease (``owner#epoch``) is in place, or lapsed with the request's epoch
# still its own: nobody took the request over since, so the log is as this run left it (a loop
# starved past the lease on a loaded machine, with no reader waiting to take over). Once another
# run took over -- even one that has let go since -- the epoch has moved on and this one is fenced.
_OURS = """
local function ours(holder, meta, token, epoch)
  return holder == token or (not holder and redis.call('HGET', meta, 'epoch') == epoch)
end
"""
# KEYS: lease, meta. ARGV: the run's token, lease ms, its epoch. Extend the lease if we hold it;
# take it again if it lapsed and the request is still ours and not finished. 1: extended, 2: taken
# again, 0: lost.
_REFRESH = (
    _OURS
    + """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if ours(holder, KEYS[2], ARGV[1], ARGV[3]) and redis.call('HGET', KEYS[2], 'status') ~= 'done' then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 2
end
return 0
"""
)
# KEYS: lease, meta. ARGV: owner, lease ms. A takeover: the request's next epoch, and the lease in
# that run's name; 0 when another holds the lease or the request is gone.
_ACQUIRE = """
if redis.call('EXISTS', KEYS[1]) == 1 or redis.call('EXISTS', KEYS[2]) == 0 then
  return 0
end
local epoch = redis.call('HINCRBY', KEYS[2], 'epoch', 1)
redis.call('SET', KEYS[1], ARGV[1] .. '#' .. epoch, 'PX', ARGV[2])
return epoch
"""
# KEYS: out, meta, lease. ARGV: the run's token, stream id's time part (start + 1), start, chunk,
# ttl ms, done (1 for the last chunk), the request's byte bound, the lease ms, the run's epoch.
# -1: the request is not this run's (another holds the lease, or took it over since), or it is
# finished (nothing written); -2: the chunk would take the request past its bound (nothing
# written); 0: an entry at or past this id exists (this run's append, retried: nothing written);
# 1: appended (a lapsed lease still ours is taken again, as in _REFRESH).
_APPEND = (
    _OURS
    + """
local holder = redis.call('GET', KEYS[3])
if not ours(holder, KEYS[2], ARGV[1], ARGV[9]) then
  return -1
end
local top = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if #top > 0 and tonumber(string.match(top[1][1], '^(%d+)')) >= tonumber(ARGV[2]) then
  return 0
end
if redis.call('HGET', KEYS[2], 'status') == 'done' then
  return -1
end
if not holder then
  redis.call('SET', KEYS[3], ARGV[1], 'PX', ARGV[8])
end
local bytes = tonumber(redis.call('HGET', KEYS[2], 'bytes') or '0') + string.len(ARGV[4])
if bytes > tonumber(ARGV[7]) then
  return -2
end
redis.call('HSET', KEYS[2], 'bytes', bytes)
redis.call('XADD', KEYS[1], ARGV[2] .. '-0', 'start', ARGV[3], 'chunk', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
if ARGV[6] == '1' then
  redis.call('HSET', KEYS[2], 'status', 'done')
end
redis.call('PEXPIRE', KEYS[2], ARGV[5])
return 1
"""
)
# KEYS: lease. ARGV: the run's token. Only the run's own lease: a stale run never frees a newer
# one's, even of the same coordinator.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


@dataclass(frozen=True)
class Run:
    """One run of a request -- the first, or a takeover: the coordinator generating it and the
    request's epoch when this run took its lease (1 for the first; every takeover bumps it)."""

    owner: str
    epoch: int

    @property
    def token(self) -> str:
        """What the lease holds while this run has it."""
        return f"{self.owner}#{self.epoch}"


@dataclass
class Entry:
    entry_id: bytes
    start: int
    chunk: coordinator_pb2.GenerateChunk

    @property
    def end(self) -> int:
        return self.start + len(self.chunk.token_ids)


def _full(exc: Exception) -> bool:
    """Whether Redis refused a write for want of memory (maxmemory, noeviction): an OOM reply,
    which redis-py raises as OutOfMemoryError (inside a script, as the script's error)."""
    import redis.exceptions

    return isinstance(exc, redis.exceptions.OutOfMemoryError) or "maxmemory" in str(exc)


class OutputLog:
    def __init__(self, url: str, ttl_s: float = DEFAULT_TTL_S, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES):
        from specdec.runtime.redis_client import connect

        if ttl_s <= 0 or max_request_bytes <= 0:
            raise ValueError("the session log's TTL and per-request bytes must be > 0")
        self.redis = connect(url)
        self.ttl_ms = int(ttl_s * 1000)
        self.max_request_bytes = max_request_bytes
        self._refresh = self.redis.register_script(_REFRESH)
        self._release = self.redis.register_script(_RELEASE)
        self._append = self.redis.register_script(_APPEND)
        self._acquire = self.redis.register_script(_ACQUIRE)
        self._room_looked = -ROOM_CHECK_S  # when Redis's memory was last read
        self._no_room = ""  # why new requests are refused (empty: they are not)

    async def memory(self) -> tuple[int, int]:
        """(used bytes, maxmemory) of Redis; maxmemory 0 = no bound configured."""
        info = await self.redis.info("memory")
        return int(info["used_memory"]), int(info.get("maxmemory", 0))

    async def check_room(self) -> None:
        """Refuse a new request (RESOURCE_EXHAUSTED) while Redis is past ROOM_FRACTION of its
        maxmemory: what runs keeps the rest. Without a maxmemory only the TTLs bound the log."""
        now = time.monotonic()
        if now - self._room_looked >= ROOM_CHECK_S:
            used, limit = await self.memory()
            self._room_looked = now
            full = limit and used >= ROOM_FRACTION * limit
            self._no_room = (
                f"the session log (Redis) holds {used} bytes of its {limit}-byte maxmemory; retry in a while "
                "(finished outputs expire)"
                if full
                else ""
            )
        if self._no_room:
            raise ResourceExhaustedError(self._no_room)

    @staticmethod
    def keys(request_id: str) -> tuple[str, str, str]:
        base = f"specdec:req:{request_id}"
        return f"{base}:meta", f"{base}:out", f"{base}:lease"

    async def create(self, request_id: str, canonical: bytes, owner: str) -> Run | None:
        """Record a new request and take its lease (its first run); None if the request id
        already exists."""
        import redis.exceptions

        meta, _, lease = self.keys(request_id)
        run = Run(owner, 1)
        try:
            if not await self.redis.hsetnx(meta, "request", canonical):
                return None
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hset(meta, mapping={"status": "running", "epoch": run.epoch})
                pipe.pexpire(meta, self.ttl_ms)
                pipe.set(lease, run.token, px=LEASE_MS)
                await pipe.execute()
        except redis.exceptions.ResponseError as exc:
            if _full(exc):
                await self.redis.delete(meta)  # deleting frees memory: allowed when full
                raise ResourceExhaustedError(f"the session log (Redis) is full: {exc}") from None
            raise
        return run

    async def meta(self, request_id: str) -> dict[str, bytes] | None:
        data = await self.redis.hgetall(self.keys(request_id)[0])
        return {k.decode(): v for k, v in data.items()} if data else None

    async def append(self, request_id: str, start: int, chunk: coordinator_pb2.GenerateChunk, run: Run) -> bool:
        """Append the chunk whose first token is token ``start``, if the request is still ``run``'s
        (else LeaseLostError); False when it was already appended (a retry)."""
        import redis.exceptions

        meta, out, lease = self.keys(request_id)
        done = "1" if chunk.finish_reason else "0"
        args = [
            run.token,
            start + 1,
            start,
            chunk.SerializeToString(),
            self.ttl_ms,
            done,
            self.max_request_bytes,
            LEASE_MS,
            run.epoch,
        ]
        try:
            written = int(await self._append(keys=[out, meta, lease], args=args))
        except redis.exceptions.ResponseError as exc:
            if _full(exc):
                raise ResourceExhaustedError(
                    f"request {request_id!r}: the session log (Redis) is full; the tokens sent so far stand"
                ) from None
            raise
        if written == -1:
            raise LeaseLostError(f"request {request_id!r}: another run took it over; resume with resume_from_index")
        if written == -2:
            raise ResourceExhaustedError(
                f"request {request_id!r}: its output passed the session log's bound of {self.max_request_bytes} "
                "bytes per request"
            )
        return written == 1

    async def entries(self, request_id: str, after: bytes = b"-") -> list[Entry]:
        """Entries after ``after`` (exclusive; b"-" = from the start), without waiting: a reader
        polls, so none holds a pooled connection while it waits."""
        out = self.keys(request_id)[1]
        rows = await self.redis.xrange(out, min=b"-" if after == b"-" else b"(" + after)
        return [
            Entry(entry_id, int(fields[b"start"]), coordinator_pb2.GenerateChunk.FromString(fields[b"chunk"]))
            for entry_id, fields in rows
        ]

    async def acquire_lease(self, request_id: str, owner: str) -> Run | None:
        """Take a request over (nobody holds its lease): the new run, or None."""
        meta, _, lease = self.keys(request_id)
        epoch = int(await self._acquire(keys=[lease, meta], args=[owner, LEASE_MS]))
        return Run(owner, epoch) if epoch else None

    async def lease_holder(self, request_id: str) -> bytes | None:
        return await self.redis.get(self.keys(request_id)[2])

    async def refresh_lease(self, request_id: str, run: Run) -> int:
        """1: extended; 2: it had lapsed and nobody took it over since, taken again; 0: lost
        (another run holds it or held it since, or the request is finished)."""
        meta, _, lease = self.keys(request_id)
        return int(await self._refresh(keys=[lease, meta], args=[run.token, LEASE_MS, run.epoch]))

    async def release_lease(self, request_id: str, run: Run) -> None:
        await self._release(keys=[self.keys(request_id)[2]], args=[run.token])

    async def keep_lease(self, request_id: str, run: Run) -> None:
        """Refresh the lease until cancelled (run as a task beside the generation); returns once
        it is lost, so the generation can stop at once (the appends are fenced anyway)."""
        while True:
            await asyncio.sleep(LEASE_REFRESH_S)
            try:
                held = await self.refresh_lease(request_id, run)
                if not held:
                    log.warning("request %s: lease lost (another run took the request over)", request_id)
                    return
                if held == 2:  # nobody was waiting to take over: a slow loop, not a dead coordinator
                    log.info("request %s: the lease had lapsed (this process was slow) and was taken again", request_id)
            except Exception as exc:  # noqa: BLE001 - Redis trouble: the write path will report it
                log.warning("request %s: lease refresh failed (%s)", request_id, exc)

    async def close(self) -> None:
        await self.redis.aclose()
