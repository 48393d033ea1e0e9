"""Durable, resumable output: each request's committed tokens in a Redis Stream.

Keys (all with a TTL, refreshed on every write):
- ``specdec:req:<id>:meta``  hash: the canonical request (serialized, resolved seed included),
  status (running / done), created-at;
- ``specdec:req:<id>:out``   stream: one entry per committed chunk: ``start`` (index of its first
  token), ``chunk`` (a serialized GenerateChunk; the last one carries finish_reason/seed/stats);
- ``specdec:req:<id>:lease`` the coordinator currently generating it (TTL LEASE_S, refreshed
  every LEASE_REFRESH_S). When it dies the lease lapses and a resuming replica takes over.

A chunk is appended (and fsync'ed by Redis, ``appendfsync always``) before it is sent, so a token
a client has seen is never lost. An append is one script that checks the lease and writes the
entry at an explicit stream id derived from the chunk's first token index (``start + 1``): the
lease is a fence (a coordinator whose lease lapsed -- a paused process, a slow fsync -- cannot
write after the one that took over), and an append retried after a lost reply finds its entry
already there and writes nothing (exactly once, not at least once).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from specdec.errors import LeaseLostError
from specdec.v1 import coordinator_pb2

log = logging.getLogger("specdec.output_log")

LEASE_S = 3.0
LEASE_REFRESH_S = 1.0
DEFAULT_TTL_S = 3600.0

# Extend the lease only if we still hold it (never steal a lease another replica took over).
_REFRESH = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
# KEYS: out, meta, lease. ARGV: owner, stream id's time part (start + 1), start, chunk, ttl ms,
# done (1 for the last chunk). -1: the caller does not hold the lease (nothing written); 0: an
# entry at or past this id exists (a retried append: nothing written); 1: appended.
_APPEND = """
if redis.call('GET', KEYS[3]) ~= ARGV[1] then
  return -1
end
local top = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if #top > 0 and tonumber(string.match(top[1][1], '^(%d+)')) >= tonumber(ARGV[2]) then
  return 0
end
redis.call('XADD', KEYS[1], ARGV[2] .. '-0', 'start', ARGV[3], 'chunk', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
if ARGV[6] == '1' then
  redis.call('HSET', KEYS[2], 'status', 'done')
end
redis.call('PEXPIRE', KEYS[2], ARGV[5])
return 1
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


@dataclass
class Entry:
    entry_id: bytes
    start: int
    chunk: coordinator_pb2.GenerateChunk

    @property
    def end(self) -> int:
        return self.start + len(self.chunk.token_ids)


class OutputLog:
    def __init__(self, url: str, ttl_s: float = DEFAULT_TTL_S):
        from specdec.runtime.redis_client import connect

        self.redis = connect(url)
        self.ttl_ms = int(ttl_s * 1000)
        self._refresh = self.redis.register_script(_REFRESH)
        self._release = self.redis.register_script(_RELEASE)
        self._append = self.redis.register_script(_APPEND)

    @staticmethod
    def keys(request_id: str) -> tuple[str, str, str]:
        base = f"specdec:req:{request_id}"
        return f"{base}:meta", f"{base}:out", f"{base}:lease"

    async def create(self, request_id: str, canonical: bytes, owner: str) -> bool:
        """Record a new request and take its lease; False if the request id already exists."""
        meta, _, lease = self.keys(request_id)
        if not await self.redis.hsetnx(meta, "request", canonical):
            return False
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(meta, "status", "running")
            pipe.pexpire(meta, self.ttl_ms)
            pipe.set(lease, owner, px=int(LEASE_S * 1000))
            await pipe.execute()
        return True

    async def meta(self, request_id: str) -> dict[str, bytes] | None:
        data = await self.redis.hgetall(self.keys(request_id)[0])
        return {k.decode(): v for k, v in data.items()} if data else None

    async def append(self, request_id: str, start: int, chunk: coordinator_pb2.GenerateChunk, owner: str) -> bool:
        """Append the chunk whose first token is token ``start``, if ``owner`` still holds the
        lease (else LeaseLostError); False when it was already appended (a retry)."""
        meta, out, lease = self.keys(request_id)
        done = "1" if chunk.finish_reason else "0"
        args = [owner, start + 1, start, chunk.SerializeToString(), self.ttl_ms, done]
        written = int(await self._append(keys=[out, meta, lease], args=args))
        if written < 0:
            raise LeaseLostError(
                f"request {request_id!r}: another coordinator took it over; resume with resume_from_index"
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

    async def acquire_lease(self, request_id: str, owner: str) -> bool:
        return bool(await self.redis.set(self.keys(request_id)[2], owner, nx=True, px=int(LEASE_S * 1000)))

    async def lease_holder(self, request_id: str) -> bytes | None:
        return await self.redis.get(self.keys(request_id)[2])

    async def refresh_lease(self, request_id: str, owner: str) -> bool:
        return bool(await self._refresh(keys=[self.keys(request_id)[2]], args=[owner, int(LEASE_S * 1000)]))

    async def release_lease(self, request_id: str, owner: str) -> None:
        await self._release(keys=[self.keys(request_id)[2]], args=[owner])

    async def keep_lease(self, request_id: str, owner: str) -> None:
        """Refresh the lease until cancelled (run as a task beside the generation); returns once
        it is lost, so the generation can stop at once (the appends are fenced anyway)."""
        while True:
            await asyncio.sleep(LEASE_REFRESH_S)
            try:
                if not await self.refresh_lease(request_id, owner):
                    log.warning("request %s: lease lost", request_id)
                    return
            except Exception as exc:  # noqa: BLE001 - Redis trouble: the write path will report it
                log.warning("request %s: lease refresh failed (%s)", request_id, exc)

    async def close(self) -> None:
        await self.redis.aclose()
