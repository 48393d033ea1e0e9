"""The replica registry in Redis: who serves what, how loaded, and whether it is alive.

Every draft and target replica publishes one hash ``specdec:replica:<kind>:<id>`` (address, model,
tokenizer fingerprint, load = live sessions, capacity, draining) and refreshes it every
HEARTBEAT_S with a TTL of REPLICA_TTL_S: a replica that dies simply stops refreshing and drops
out within a few seconds, and no key outlives its TTL. Coordinators list replicas when a new
session starts and pick one with the pure functions below; a session keeps its replicas for life.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

from specdec.runtime.placement import MAX_DEVICES, Placement

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


# -- Redis access ----------------------------------------------------------------------------
class Registry:
    def __init__(self, url: str):
        from specdec.runtime.redis_client import connect

        self.url = url
        self.redis = connect(url)
        self._refused: set[str] = set()  # keys whose bad records were already logged

    async def publish(self, replica: Replica, ttl: float = REPLICA_TTL_S) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(replica.key, mapping=replica.to_hash())
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
        for key, row in zip(keys, rows, strict=True):
            if not row:
                continue
            name = key.decode() if isinstance(key, bytes) else key
            try:
                replica = Replica.from_hash(row)
                problem = record_problem(replica, kind)
            except (ValueError, TypeError) as exc:
                problem = f"unreadable ({exc})"
            if problem is not None:
                if len(self._refused) > MAX_RECORD_SESSIONS:  # bounded: forget, and log again
                    self._refused.clear()
                if name not in self._refused:
                    self._refused.add(name)
                    log.warning("ignoring registry record %s: %s", name[:200], problem)
                continue
            found.append(replica)
        return sorted(found, key=lambda r: r.replica_id)

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
