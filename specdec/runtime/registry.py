"""The replica registry in Redis: who serves what, how loaded, and whether it is alive.

Every draft and target replica publishes one hash ``specdec:replica:<kind>:<id>`` (address, model,
tokenizer fingerprint, load = live sessions, capacity, draining) and refreshes it every
HEARTBEAT_S with a TTL of REPLICA_TTL_S: a replica that dies simply stops refreshing and drops
out within a few seconds, and no key outlives its TTL. Coordinators list replicas when a new
session starts and pick one with the pure functions below; a session keeps its replicas for life.

Anything that can write Redis could publish a record, so records are authenticated: a replica
holding the internal token (security: the one its services require) signs each record -- every
field and the time it was signed -- with an HMAC under a key derived from the token, and a
coordinator holding the token considers only records that verify and were signed within the TTL
(plus clock skew), so neither a forged record nor an old one written back is ever chosen. Without
a token (a local stack on loopback) records are unsigned and only their bounds are checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from specdec.runtime import security
from specdec.runtime.placement import MAX_DEVICES, Placement
from specdec.telemetry import metrics

log = logging.getLogger("specdec.runtime.registry")

PREFIX = "specdec:replica"
HEARTBEAT_S = 1.0
REPLICA_TTL_S = 3.0
# A record's bounds: anything can write Redis (a bug, another deployment, an intruder), and a
# record past these -- a negative load would win every least-loaded choice -- is ignored.
MAX_RECORD_SESSIONS = 1 << 20
MAX_RECORD_VOCAB = 1 << 24
MAX_RECORD_TEXT = 1024
MAX_RECORD_DEVICES_TEXT = MAX_DEVICES * 64  # a GPU's identity is its UUID (runtime.placement)
KINDS = ("draft", "target")
DRAFT_KINDS = ("", "model", "ngram", "feature")
# Authentication (module doc). A record is refreshed every HEARTBEAT_S, so a real one is never
# older than that when read; one signed longer ago than it may live, or later than now, is a
# replay -- up to MAX_CLOCK_SKEW_S apart, the replica's and the coordinator's clocks may disagree.
MAX_CLOCK_SKEW_S = 2.0
MAX_RECORD_AGE_S = REPLICA_TTL_S + MAX_CLOCK_SKEW_S
SIGNED_AT, MAC = "signed_at", "mac"  # the hash fields a signed record adds (epoch ms, hex HMAC)
SIGNING_CONTEXT = b"specdec registry record v1"
# Why a record was ignored (the label of specdec_registry_records_ignored_total).
INVALID, UNSIGNED, FORGED, STALE = "invalid", "unsigned", "forged", "stale"
MAX_REFUSAL_LINES = 10  # log lines about ignored records per REFUSAL_WINDOW_S, in all
REFUSAL_WINDOW_S = 60.0


@dataclass(frozen=True)
class Replica:
    kind: str  # "draft" / "target"
    replica_id: str
    address: str
    model_id: str = ""
    fingerprint: str = ""  # tokenizer fingerprint ("" = none, e.g. the n-gram draft)
    draft_kind: str = ""  # "model" / "ngram" for drafts
    vocab_size: int = 0
    load: int = 0  # live sessions
    capacity: int = 0  # max sessions (0 = unknown)
    draining: bool = False
    feature_size: int = 0  # target: its hidden size; feature draft: the features it reads
    node: str = ""  # where it computes (runtime.placement): the node ...
    devices: str = ""  # ... and its devices' identities, comma-separated ("" = unknown)

    @property
    def placement(self) -> Placement:
        return Placement.of(self.node, self.devices.split(","))

    @property
    def key(self) -> str:
        return f"{PREFIX}:{self.kind}:{self.replica_id}"

    def to_hash(self) -> dict[str, str]:
        return {k: str(int(v) if isinstance(v, bool) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_hash(cls, data: dict) -> Replica:
        data = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in data.items()
        }
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in data:
                raw = data[f.name]
                kwargs[f.name] = (
                    bool(int(raw)) if f.type in ("bool", bool) else int(raw) if f.type in ("int", int) else raw
                )
        return cls(**kwargs)


def record_problem(replica: Replica, key_kind: str | None = None) -> str | None:
    """Why a registry record must not be routed to (None: it may). ``key_kind``: the kind its
    key names, which the record must repeat."""
    if replica.kind not in KINDS or (key_kind is not None and replica.kind != key_kind):
        return f"kind {replica.kind!r} (key: {key_kind!r})"
    host, _, port = replica.address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f"address {replica.address[:64]!r} is not HOST:PORT"
    for name in ("replica_id", "address", "model_id", "fingerprint", "node"):
        if len(getattr(replica, name)) > MAX_RECORD_TEXT:
            return f"{name} longer than {MAX_RECORD_TEXT} characters"
    if len(replica.devices) > MAX_RECORD_DEVICES_TEXT:
        return f"devices longer than {MAX_RECORD_DEVICES_TEXT} characters"
    if replica.draft_kind not in DRAFT_KINDS:
        return f"draft_kind {replica.draft_kind!r}"
    for name, top in (("load", MAX_RECORD_SESSIONS), ("capacity", MAX_RECORD_SESSIONS)):
        if not 0 <= getattr(replica, name) <= top:
            return f"{name} {getattr(replica, name)} outside [0, {top}]"
    for name in ("vocab_size", "feature_size"):
        if not 0 <= getattr(replica, name) <= MAX_RECORD_VOCAB:
            return f"{name} {getattr(replica, name)} outside [0, {MAX_RECORD_VOCAB}]"
    return None


def same_model(replica: Replica, expected: Replica | None) -> bool:
    """Whether ``replica`` serves the model a coordinator pinned at start (its target's model id,
    tokenizer fingerprint and vocabulary): two deployments sharing one Redis must not mix."""
    if expected is None:
        return True
    return (replica.model_id, replica.fingerprint, replica.vocab_size) == (
        expected.model_id,
        expected.fingerprint,
        expected.vocab_size,
    )


def new_replica_id() -> str:
    return uuid.uuid4().hex[:12]


# -- authentication ----------------------------------------------------------------------------
def signing_key(token: str) -> bytes:
    """The registry's HMAC key, derived from the internal token: a key of its own, so a MAC is
    never computed with the bearer token itself."""
    return hmac.new(token.encode(), SIGNING_CONTEXT, hashlib.sha256).digest()


def record_mac(key: bytes, replica: Replica, signed_at_ms: int) -> str:
    """The HMAC of a record's canonical bytes: every field as ``to_hash`` writes it, and when it
    was signed (so an old record cannot be made to look fresh)."""
    message = json.dumps([replica.to_hash(), signed_at_ms], sort_keys=True, separators=(",", ":"))
    return hmac.new(key, SIGNING_CONTEXT + b"\n" + message.encode(), hashlib.sha256).hexdigest()


def signed_fields(replica: Replica, key: bytes | None, now: float) -> dict[str, str]:
    """What a replica writes: its fields, and with a key, when it signed them and the MAC."""
    data = replica.to_hash()
    if key is not None:
        signed_at_ms = int(now * 1000)
        data[SIGNED_AT], data[MAC] = str(signed_at_ms), record_mac(key, replica, signed_at_ms)
    return data


@dataclass(frozen=True)
class Refusal:
    """Why a registry record is ignored: ``reason`` (INVALID / UNSIGNED / FORGED / STALE, a
    metric label) and ``detail`` (for the log)."""

    reason: str
    detail: str


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def check_record(name: str, data: Mapping, kind: str, key: bytes | None, now: float) -> Replica | Refusal:
    """The replica the record ``data`` at key ``name`` describes, if it may be routed to: within
    its bounds, under its own key, and -- with a key -- signed by a holder of the token within
    MAX_RECORD_AGE_S of ``now`` (epoch seconds). Otherwise why not."""
    fields_ = {_text(k): _text(v) for k, v in data.items()}
    try:
        replica = Replica.from_hash(fields_)
        problem = record_problem(replica, kind)
    except (ValueError, TypeError) as exc:
        return Refusal(INVALID, f"unreadable ({exc})")
    if problem is not None:
        return Refusal(INVALID, problem)
    if name != replica.key:  # a real record copied under another replica's key
        return Refusal(INVALID, f"its key names another replica than {replica.replica_id[:64]!r}")
    if key is None:
        return replica
    mac, signed_at = fields_.get(MAC, ""), fields_.get(SIGNED_AT, "")
    if not mac or not signed_at:
        return Refusal(UNSIGNED, "unsigned: does the replica hold the internal token?")
    well_formed = len(mac) == 2 * hashlib.sha256().digest_size and signed_at.isascii() and signed_at.isdigit()
    if not (well_formed and len(signed_at) <= 16) or not hmac.compare_digest(
        mac.encode(), record_mac(key, replica, int(signed_at)).encode()
    ):
        return Refusal(FORGED, "its MAC does not verify: written without this deployment's internal token")
    age = now - int(signed_at) / 1000
    if not -MAX_CLOCK_SKEW_S <= age <= MAX_RECORD_AGE_S:
        return Refusal(STALE, f"signed {age:.1f}s ago: a replayed record, or the clocks are {age:.0f}s apart")
    return replica


class RefusalLog:
    """Whether to log an ignored record: once per key, and at most MAX_REFUSAL_LINES lines per
    REFUSAL_WINDOW_S in all -- whoever writes fresh keys must not flood the log (the metric counts
    every one). ``suppressed``: refusals not logged since the last line."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._seen: set[str] = set()
        self._window_start = clock()
        self._lines = 0
        self.suppressed = 0

    def should_log(self, name: str) -> bool:
        if name in self._seen:
            return False
        if len(self._seen) > MAX_RECORD_SESSIONS:  # bounded: forget, and log again
            self._seen.clear()
        self._seen.add(name)
        now = self._clock()
        if now - self._window_start >= REFUSAL_WINDOW_S:
            self._window_start, self._lines = now, 0
        if self._lines >= MAX_REFUSAL_LINES:
            self.suppressed += 1
            return False
        self._lines += 1
        return True

    def take_suppressed(self) -> int:
        """The refusals not logged since the last line (and now none)."""
        count, self.suppressed = self.suppressed, 0
        return count


# -- Redis access ----------------------------------------------------------------------------
class Registry:
    """``token``: the internal token records are signed and verified with (default: this
    process's, security.current(); "" or none: unsigned records, bounds only)."""

    def __init__(self, url: str, token: str | None = None):
        from specdec.runtime.redis_client import connect

        self.url = url
        self.redis = connect(url)
        token = security.current().token if token is None else token
        self._key = signing_key(token) if token else None
        self._refusals = RefusalLog()

    @property
    def authenticated(self) -> bool:
        return self._key is not None

    async def publish(self, replica: Replica, ttl: float = REPLICA_TTL_S) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(replica.key, mapping=signed_fields(replica, self._key, time.time()))
            pipe.pexpire(replica.key, int(ttl * 1000))
            await pipe.execute()

    async def remove(self, replica: Replica) -> None:
        await self.redis.delete(replica.key)

    async def replicas(self, kind: str) -> list[Replica]:
        keys = [k async for k in self.redis.scan_iter(match=f"{PREFIX}:{kind}:*", count=200)]
        if not keys:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hgetall(key)
            rows = await pipe.execute()
        found = []
        now = time.time()
        for key, row in zip(keys, rows, strict=True):
            if not row:
                continue
            name = _text(key)
            verdict = check_record(name, row, kind, self._key, now)
            if isinstance(verdict, Refusal):
                self._refuse(name, verdict)
                continue
            found.append(verdict)
        return sorted(found, key=lambda r: r.replica_id)

    def _refuse(self, name: str, refusal: Refusal) -> None:
        metrics.REGISTRY_RECORDS_IGNORED.labels(refusal.reason).inc()
        if self._refusals.should_log(name):
            suppressed = self._refusals.take_suppressed()
            more = f" ({suppressed} more ignored records not logged)" if suppressed else ""
            log.warning("ignoring registry record %s: %s%s", name[:200], refusal.detail, more)

    async def close(self) -> None:
        await self.redis.aclose()


class Heartbeat:
    """Publishes a replica every HEARTBEAT_S from ``describe()`` (fresh load each time) until
    stopped; Redis errors are logged and retried, so a Redis restart only delays the next beat."""

    def __init__(self, registry: Registry, describe: Callable[[], Replica]):
        self.registry = registry
        self.describe = describe
        self._task: asyncio.Task | None = None
        self.beats = 0

    async def beat(self) -> None:
        await self.registry.publish(self.describe())
        self.beats += 1

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        failing = False
        while True:
            try:
                await self.beat()
                if failing:
                    log.info("registry heartbeat restored")
                failing = False
            except Exception as exc:  # noqa: BLE001 - keep beating through Redis trouble
                if not failing:
                    log.warning("registry heartbeat failed (%s); retrying", exc)
                failing = True
            await asyncio.sleep(HEARTBEAT_S)

    async def stop(self, deregister: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if deregister:
            try:
                await self.registry.remove(self.describe())
            except Exception as exc:  # noqa: BLE001
                log.warning("could not deregister (%s); the key expires in %.0fs", exc, REPLICA_TTL_S)
