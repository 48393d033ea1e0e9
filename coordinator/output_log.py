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
(:meth:`OutputLog.check_room`) so that what runs never meets it. A new request *reserves* what its
log may come to hold (:func:`reserved_bytes`) in the same script that creates it, in two ledgers:

- ``specdec:log:running`` -- the reservations of the requests running: a request is admitted only
  while Redis's use plus these plus its own stay under ROOM_FRACTION of maxmemory, so a request
  admitted has room to finish; its entry goes when it finishes;
- ``specdec:log:tenant:<tenant>`` -- what one API key's requests hold: their reservations while
  they run, then the bytes their logs hold until those expire; at most ``max_tenant_bytes``, so
  one client cannot fill the log and lock the others out for the TTL.

Each ledger is a hash (request id -> bytes), a sorted set (request id -> when its entry expires)
and their total. An entry expires ``ttl_s`` after its run's last lease refresh (or its finish), as
the request's own keys do: a dead coordinator's reservations age out with its logs, pruned by the
next admission, and every ledger key has a TTL too. Only requests that can be resumed are logged:
the HTTP API's are not (docs/protocol.md, "Durable output").
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
# A new request is admitted while Redis's use, the running requests' reservations and its own stay
# under this share of its maxmemory: the rest is headroom for their leases and the replicas'
# heartbeats (and for text longer than a reservation allows), which Redis (maxmemory-policy
# noeviction) refuses rather than evicting anything.
ROOM_FRACTION = 0.85
ROOM_CHECK_S = 0.5  # how long one look at Redis's memory stands for the requests that follow
# What one API key's requests may hold of the log (reserved while they run, written until expiry).
DEFAULT_MAX_TENANT_BYTES = 64 << 20
# What a request's log may come to hold, in Redis's bytes, from the shape of its chunks: at worst
# one chunk per token (target-only steps), each a stream entry carrying the request's id, the token
# id and its text; with logprobs, an entry for the token and one per alternative, each an id, a
# float and a token's text (an allowance for a typical token's; docs/protocol.md has the figures).
ENTRY_BYTES = 64  # a stream entry and its chunk's fields, besides the request id and the tokens
TOKEN_BYTES = 16
LOGPROB_BYTES = 20
FINAL_BYTES = 2048  # the last chunk's seed and stats, and the meta's other fields
PRUNE_PER_CALL = 64  # expired ledger entries one admission removes (bounded work per script)


def reserved_bytes(
    max_new_tokens: int, logprobs: int | None, request_id: str, canonical_bytes: int, max_request_bytes: int
) -> int:
    """What a request's log may come to hold: its stored request, and its chunks' worst case for
    its ``max_new_tokens`` and ``logprobs`` (None: off), within the per-request bound."""
    per_token = ENTRY_BYTES + len(request_id.encode()) + TOKEN_BYTES
    if logprobs is not None:
        per_token += (logprobs + 1) * LOGPROB_BYTES
    return canonical_bytes + FINAL_BYTES + min(max_new_tokens * per_token, max_request_bytes)


def ledger_keys(scope: str) -> list[str]:
    """A ledger's hash, sorted set of expiry times, and total (see the module doc)."""
    base = f"specdec:log:{scope}"
    return [base, f"{base}:until", f"{base}:total"]


RUNNING = "running"


def tenant_scope(tenant: str) -> str:
    return f"tenant:{tenant}"


# The ledgers (module doc), as Lua: l = {hash, sorted set, total}; times in Redis's own clock.
_LEDGER = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function ledger_total(l)
  return tonumber(redis.call('GET', l[3]) or '0')
end
local function ledger_prune(l, now)
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', l[2], '-inf', now, 'LIMIT', 0, PRUNE_PER_CALL)) do
    redis.call('DECRBY', l[3], tonumber(redis.call('HGET', l[1], id) or '0'))
    redis.call('HDEL', l[1], id)
    redis.call('ZREM', l[2], id)
  end
end
local function ledger_keep(l, ttl)
  for i = 1, 3 do
    redis.call('PEXPIRE', l[i], ttl)
  end
end
local function ledger_put(l, id, bytes, now, ttl)
  local old = tonumber(redis.call('HGET', l[1], id) or '0')
  redis.call('HSET', l[1], id, bytes)
  redis.call('ZADD', l[2], now + ttl, id)
  redis.call('INCRBY', l[3], bytes - old)
  ledger_keep(l, ttl)
end
local function ledger_drop(l, id)
  local old = redis.call('HGET', l[1], id)
  if old then
    redis.call('DECRBY', l[3], tonumber(old))
    redis.call('HDEL', l[1], id)
    redis.call('ZREM', l[2], id)
  end
end
local function ledger_extend(l, id, now, ttl)
  if redis.call('ZADD', l[2], 'XX', 'CH', now + ttl, id) == 1 then
    ledger_keep(l, ttl)
  end
end
""".replace("PRUNE_PER_CALL", str(PRUNE_PER_CALL))
# KEYS: meta, lease, the running ledger (3), the tenant's ledger (3). ARGV: the canonical request,
# the first run's token, lease ms, ttl ms, request id, bytes to reserve, the room left under
# ROOM_FRACTION (-1: unbounded), the tenant's bound (-1: none), the tenant. Creates the request
# with its reservation, or nothing: {1, 0} created; {0, 0} the id exists; {-1, reserved by running
# requests} no room; {-2, what the tenant holds} past the tenant's bound.
_CREATE = (
    _LEDGER
    + """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {0, 0}
end
local now, ttl, bytes = now_ms(), tonumber(ARGV[4]), tonumber(ARGV[6])
local running, tenant = {KEYS[3], KEYS[4], KEYS[5]}, {KEYS[6], KEYS[7], KEYS[8]}
ledger_prune(running, now)
ledger_prune(tenant, now)
local reserved = ledger_total(running)
if tonumber(ARGV[7]) >= 0 and reserved + bytes > tonumber(ARGV[7]) then
  return {-1, reserved}
end
local held = ledger_total(tenant)
if tonumber(ARGV[8]) >= 0 and held + bytes > tonumber(ARGV[8]) then
  return {-2, held}
end
redis.call('HSET', KEYS[1], 'request', ARGV[1], 'status', 'running', 'epoch', 1, 'tenant', ARGV[9])
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
ledger_put(running, ARGV[5], bytes, now, ttl)
ledger_put(tenant, ARGV[5], bytes, now, ttl)
return {1, 0}
"""
)
# A run may write while its lease (``owner#epoch``) is in place, or lapsed with the request's epoch
# still its own: nobody took the request over since, so the log is as this run left it (a loop
# starved past the lease on a loaded machine, with no reader waiting to take over). Once another
# run took over -- even one that has let go since -- the epoch has moved on and this one is fenced.
_OURS = """
local function ours(holder, meta, token, epoch)
  return holder == token or (not holder and redis.call('HGET', meta, 'epoch') == epoch)
end
"""
# KEYS: lease, meta, the running ledger (3), the tenant's ledger (3). ARGV: the run's token, lease
# ms, its epoch, request id, ttl ms. Extend the lease if we hold it; take it again if it lapsed and
# the request is still ours and not finished; either way its reservations live on (a request
# running past the TTL keeps them). 1: extended, 2: taken again, 0: lost.
_REFRESH = (
    _LEDGER
    + _OURS
    + """
local holder = redis.call('GET', KEYS[1])
local held = 0
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  held = 1
elseif ours(holder, KEYS[2], ARGV[1], ARGV[3]) and redis.call('HGET', KEYS[2], 'status') ~= 'done' then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  held = 2
end
if held > 0 then
  local now = now_ms()
  ledger_extend({KEYS[3], KEYS[4], KEYS[5]}, ARGV[4], now, tonumber(ARGV[5]))
  ledger_extend({KEYS[6], KEYS[7], KEYS[8]}, ARGV[4], now, tonumber(ARGV[5]))
end
return held
"""
)
# KEYS: lease, meta. ARGV: owner, lease ms. A takeover: {the request's next epoch, its tenant},
# the lease in that run's name; {0, ''} when another holds the lease or the request is gone.
_ACQUIRE = """
if redis.call('EXISTS', KEYS[1]) == 1 or redis.call('EXISTS', KEYS[2]) == 0 then
  return {0, ''}
end
local epoch = redis.call('HINCRBY', KEYS[2], 'epoch', 1)
redis.call('SET', KEYS[1], ARGV[1] .. '#' .. epoch, 'PX', ARGV[2])
return {epoch, redis.call('HGET', KEYS[2], 'tenant') or ''}
"""
# KEYS: out, meta, lease, the running ledger (3), the tenant's ledger (3). ARGV: the run's token,
# stream id's time part (start + 1), start, chunk, ttl ms, done (1 for the last chunk), the
# request's byte bound, the lease ms, the run's epoch, request id. The last chunk settles the
# ledgers: the request's reservation leaves the running one, and its tenant's holds what its log
# holds until it expires.
# -1: the request is not this run's (another holds the lease, or took it over since), or it is
# finished (nothing written); -2: the chunk would take the request past its bound (nothing
# written); 0: an entry at or past this id exists (this run's append, retried: nothing written);
# 1: appended (a lapsed lease still ours is taken again, as in _REFRESH).
_APPEND = (
    _LEDGER
    + _OURS
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
  ledger_drop({KEYS[4], KEYS[5], KEYS[6]}, ARGV[10])
  local kept = bytes + redis.call('HSTRLEN', KEYS[2], 'request')
  ledger_put({KEYS[7], KEYS[8], KEYS[9]}, ARGV[10], kept, now_ms(), tonumber(ARGV[5]))
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
    tenant: str = ""  # whose ledger holds the request's bytes ("": a call without an API key)

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
    def __init__(
        self,
        url: str,
        ttl_s: float = DEFAULT_TTL_S,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        max_tenant_bytes: int = DEFAULT_MAX_TENANT_BYTES,
    ):
        from specdec.runtime.redis_client import connect

        if ttl_s <= 0 or max_request_bytes <= 0 or max_tenant_bytes <= 0:
            raise ValueError("the session log's TTL, per-request and per-key bytes must be > 0")
        self.redis = connect(url)
        self.ttl_ms = int(ttl_s * 1000)
        self.max_request_bytes = max_request_bytes
        self.max_tenant_bytes = max_tenant_bytes
        self._create = self.redis.register_script(_CREATE)
        self._refresh = self.redis.register_script(_REFRESH)
        self._release = self.redis.register_script(_RELEASE)
        self._append = self.redis.register_script(_APPEND)
        self._acquire = self.redis.register_script(_ACQUIRE)
        self._room_looked = -ROOM_CHECK_S  # when Redis's memory was last read
        self._used, self._limit = 0, 0  # ... what it said (a limit of 0: none known)
        self._no_room = ""  # why new requests are refused (empty: they are not)

    async def memory(self) -> tuple[int, int]:
        """(used bytes, maxmemory) of Redis; maxmemory 0 = no bound configured."""
        info = await self.redis.info("memory")
        return int(info["used_memory"]), int(info.get("maxmemory", 0))

    async def check_room(self) -> None:
        """Refuse a new request (RESOURCE_EXHAUSTED) while Redis is past ROOM_FRACTION of its
        maxmemory: what runs keeps the rest. Without a maxmemory only the TTLs, the per-request
        and the per-key bounds bound the log. The look stands for :meth:`create`'s room too."""
        now = time.monotonic()
        if now - self._room_looked >= ROOM_CHECK_S:
            used, limit = await self.memory()
            self._room_looked, self._used, self._limit = now, used, limit
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

    async def create(self, request_id: str, canonical: bytes, owner: str, reserve: int, tenant: str = "") -> Run | None:
        """Record a new request, reserving ``reserve`` bytes for its log (:func:`reserved_bytes`),
        and take its lease (its first run); None if the request id already exists. Refused
        (RESOURCE_EXHAUSTED, nothing written) when the running requests' reservations and Redis's
        use at the last :meth:`check_room` leave no room for it, or when ``tenant`` (an API key's;
        "" for none, which has no bound) would hold more than ``max_tenant_bytes``."""
        import redis.exceptions

        meta, _, lease = self.keys(request_id)
        run = Run(owner, 1, tenant)
        room = int(ROOM_FRACTION * self._limit) - self._used if self._limit else -1
        bound = self.max_tenant_bytes if tenant else -1
        args = [canonical, run.token, LEASE_MS, self.ttl_ms, request_id, reserve, room, bound, tenant]
        try:
            created, total = await self._create(keys=[meta, lease, *self._ledgers(tenant)], args=args)
        except redis.exceptions.ResponseError as exc:
            if _full(exc):
                raise ResourceExhaustedError(f"the session log (Redis) is full: {exc}") from None
            raise
        if created == -1:
            raise ResourceExhaustedError(
                f"the session log (Redis) is too full for request {request_id!r}, which may write up to {reserve} "
                f"bytes: {self._used} bytes of its {self._limit}-byte maxmemory are in use and the running requests "
                f"have {int(total)} more reserved; retry in a while (finished outputs expire)"
            )
        if created == -2:
            raise ResourceExhaustedError(
                f"this API key's requests hold {int(total)} bytes of the session log (reserved while they run, "
                f"kept until their outputs expire); request {request_id!r} may write up to {reserve} more, past "
                f"the per-key bound of {self.max_tenant_bytes} bytes (--max-output-bytes-per-key); retry once its "
                "outputs expire, or ask for fewer tokens or logprobs"
            )
        return run if created == 1 else None

    @staticmethod
    def _ledgers(tenant: str) -> list[str]:
        """The running ledger's keys, then the tenant's: what the scripts take after a request's."""
        return [*ledger_keys(RUNNING), *ledger_keys(tenant_scope(tenant))]

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
            request_id,
        ]
        try:
            written = int(await self._append(keys=[out, meta, lease, *self._ledgers(run.tenant)], args=args))
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
        epoch, tenant = await self._acquire(keys=[lease, meta], args=[owner, LEASE_MS])
        return Run(owner, int(epoch), tenant.decode()) if epoch else None

    async def lease_holder(self, request_id: str) -> bytes | None:
        return await self.redis.get(self.keys(request_id)[2])

    async def refresh_lease(self, request_id: str, run: Run) -> int:
        """1: extended; 2: it had lapsed and nobody took it over since, taken again; 0: lost
        (another run holds it or held it since, or the request is finished)."""
        meta, _, lease = self.keys(request_id)
        keys = [lease, meta, *self._ledgers(run.tenant)]
        return int(await self._refresh(keys=keys, args=[run.token, LEASE_MS, run.epoch, request_id, self.ttl_ms]))

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
