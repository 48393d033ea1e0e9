"""Running one engine behind a grpc.aio server: the part the draft and target services share."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc

from replica.batcher import IterationLoop
from replica.model_thread import call_on_model_thread, on_model_thread
from specdec.engine.batching import BatchRunner, PassLoad
from specdec.engine.interface import ReplicaEngine
from specdec.engine.memory import AUTO, DEFAULT_KV_FRACTION, resolve_kv_cap
from specdec.engine.sessions import CacheLimits, Work, run_alone
from specdec.errors import DrainingError
from specdec.runtime import grpc_server as srv
from specdec.runtime import security, wire
from specdec.runtime.flags import (
    byte_count,
    check_cpus_available,
    cpu_set,
    kv_byte_count,
    non_negative_float,
    non_negative_int,
    positive_int,
)
from specdec.runtime.grpc_server import grpc_method
from specdec.runtime.placement import Placement, this_node
from specdec.runtime.registry import Heartbeat, Registry, Replica, new_replica_id
from specdec.telemetry import logs, metrics, tracing
from specdec.v1 import engine_pb2

DEFAULT_PREFIX_CACHE = 256 << 20

log = logging.getLogger("specdec.replica.servicer")


@dataclass
class ServiceSpec:
    name: str  # "draft" / "target" (default OTEL_SERVICE_NAME: specdec-<name>)
    full_service_name: str  # e.g. specdec.v1.Draft
    add_to_server: Callable[[Any, grpc.aio.Server], None]
    servicer: Any  # a SessionServicer subclass
    engine: Any  # the service's engine: stats(), expire_idle(), prefill/commit/release
    host: str
    port: int
    session_ttl: float
    grace_seconds: float = 10.0
    redis_url: str | None = None
    advertise: str | None = None  # the address others reach us at (default: host:port)
    describe: Callable[[str, bool], Replica] | None = None  # (address, draining) -> its registry entry
    drain_seconds: float = 30.0
    on_stop: Callable[[], None] | None = None  # after the server stopped (e.g. stop the other TP ranks)
    metrics_port: int = 0
    health_port: int = 0  # a plaintext port with the health service alone (0: none)
    batch: BatchRunner | None = None  # where the engine's calls are batched (continuous batching)
    batch_gather_ms: float = 8.0  # before a pass, wait this long for the sessions stepping now


def replica_spec(
    args,
    *,
    kind: str,
    full_service_name: str,
    add_to_server: Callable[[Any, grpc.aio.Server], None],
    servicer: SessionServicer,
    engine: Any,
    fingerprint: str,
    vocab_size: int,
    feature_size: int,
    draft_kind: str = "",
    on_stop: Callable[[], None] | None = None,
) -> ServiceSpec:
    """A draft or target replica as its flags (``add_replica_arguments``) describe it: its batch
    runner and profiled pass cost, where it computes, and the registry entry its heartbeat
    publishes (what the coordinator routes by)."""
    batch = batch_runner_for(engine, args)
    servicer.cost_points = profiled_costs(engine, batch, args)
    servicer.placement = replica_placement(engine, args)
    replica_id = args.replica_id or new_replica_id()

    def describe(address: str, draining: bool) -> Replica:
        return Replica(
            kind=kind,
            replica_id=replica_id,
            address=address,
            model_id=args.model,
            fingerprint=fingerprint,
            draft_kind=draft_kind,
            vocab_size=vocab_size,
            load=engine.stats()["live_sessions"],
            capacity=args.max_sessions,
            draining=draining,
            feature_size=feature_size,
            node=servicer.placement.node,
            devices=",".join(servicer.placement.devices),
        )

    return ServiceSpec(
        name=kind,
        full_service_name=full_service_name,
        add_to_server=add_to_server,
        servicer=servicer,
        engine=engine,
        host=args.host,
        port=args.port,
        session_ttl=args.session_ttl,
        redis_url=args.redis or os.environ.get("REDIS_URL"),
        advertise=args.advertise,
        describe=describe,
        drain_seconds=args.drain_seconds,
        metrics_port=args.metrics_port,
        health_port=args.health_port,
        on_stop=on_stop,
        batch=batch,
        batch_gather_ms=args.batch_gather_ms,
    )


def batch_runner_for(engine: ReplicaEngine, args) -> BatchRunner | None:
    """The batch runner over the engine's ``batch_store``, sized by the replica's flags; None
    where its works ask for no pass (they run alone, one at a time)."""
    store = engine.batch_store
    if store is None:
        return None
    return BatchRunner(store, args.max_batch_tokens, args.max_batch_sessions, args.max_waiting_sessions)


def profiled_costs(engine, batch: BatchRunner | None, args) -> list[tuple[int, float]]:
    """The startup profile of the replica's batched pass (specdec.engine.profile), which its Info
    reports for the coordinator's load-aware policy; none where it does not batch."""
    if batch is None:
        return []
    from specdec.engine.profile import pass_costs

    return pass_costs(engine, min(args.max_batch_sessions, args.max_sessions, batch.max_batch_tokens))


def cache_limits(args, device, ranks_on_host: int = 1) -> CacheLimits:
    """The replica's session caps from its flags; ``--max-kv-bytes auto`` is resolved here, so
    call it once the model is loaded (what is free then is what the caches may use)."""
    cap = resolve_kv_cap(args.max_kv_bytes, device, args.kv_memory_fraction, ranks_on_host)
    how = f"auto, {args.kv_memory_fraction:g} of the free memory" if args.max_kv_bytes == AUTO else "--max-kv-bytes"
    log.info("KV pool cap: %s (%s)", f"{cap / (1 << 30):.2f} GiB" if cap else "none", how)
    return CacheLimits(args.max_sessions, args.max_session_kv_bytes, cap, args.prefix_cache_bytes)


def replica_placement(engine: ReplicaEngine, args) -> Placement:
    """Where a replica's passes compute: its node, and each device (a tensor-parallel group:
    every rank's, as the ranks report them; a draft without a model, the n-gram one: the CPU)."""
    return Placement.of(this_node(args.node_name), engine.devices())


def add_replica_arguments(p) -> None:
    """The flags every draft/target replica takes (device, caps, registry, drain, metrics, TLS)."""
    security.add_arguments(p)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16 (GPU default), float16")
    p.add_argument("--max-sessions", type=int, default=256)
    p.add_argument(
        "--max-kv-bytes",
        type=kv_byte_count,
        default=AUTO,
        help="cap on all sessions' KV bytes, allocated: auto (default: --kv-memory-fraction of the memory free "
        "once the model is loaded, within the container's limit), a count like 2GiB, or 0 = none",
    )
    p.add_argument(
        "--kv-memory-fraction",
        type=float,
        default=DEFAULT_KV_FRACTION,
        help="with --max-kv-bytes auto, the share of free memory the KV pool may take",
    )
    p.add_argument("--max-session-kv-bytes", type=int, default=0, help="cap per session (0 = none)")
    p.add_argument(
        "--prefix-cache-bytes",
        type=byte_count,
        default=DEFAULT_PREFIX_CACHE,
        help="KV of computed prompts (and finished sessions) kept so a new session that starts the same way "
        "copies it instead of computing it, outside the KV pool: a count like 256MiB, or 0 = off (default "
        "256MiB; on a batch-invariant backend only, where a copy is the same bits; docs/batching.md)",
    )
    p.add_argument("--session-ttl", type=float, default=600.0, help="free sessions idle this long (s)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default; see --cpus)")
    p.add_argument(
        "--cpus",
        type=cpu_set,
        default=None,
        help="run on these CPUs only (0-3, 0,2), with as many torch threads unless --threads says: cores of "
        "its own for this replica, as a device of its own would be (default: every CPU)",
    )
    p.add_argument(
        "--node-name",
        default=None,
        help="the machine this replica computes on, as it reports it (coordinators pipeline drafting only for "
        "a draft and a target that share no hardware: docs/pipelining.md; default: SPECDEC_NODE_NAME, else the "
        "hostname)",
    )
    p.add_argument("--redis", default=None, help="register in this Redis (default: REDIS_URL; unset = no registry)")
    p.add_argument(
        "--advertise",
        default=None,
        help="address coordinators use to reach this replica (default: HOST:PORT, 127.0.0.1 for a wildcard host)",
    )
    p.add_argument("--replica-id", default=None, help="registry id (default: random)")
    p.add_argument("--drain-seconds", type=float, default=30.0, help="on SIGTERM, wait this long for live sessions")
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus /metrics on this port (0 = off)")
    p.add_argument(
        "--health-port",
        type=int,
        default=0,
        help="also answer the standard gRPC health check, alone and in plaintext, on this port: kubelet's gRPC "
        "probes speak no TLS (0 = off; the service port answers it too). Readiness is the service '' (able to "
        f"take sessions: not while draining or while passes fail), liveness the service '{srv.LIVENESS_SERVICE}' "
        "(the process: not while passes fail)",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=positive_int,
        default=256,
        help="rows one batched pass may carry; a prefill is fed in chunks of what is left (docs/batching.md)",
    )
    p.add_argument(
        "--max-batch-sessions",
        type=positive_int,
        default=64,
        help="sessions one batched pass may carry (1 = no batching)",
    )
    p.add_argument(
        "--batch-gather-ms",
        type=non_negative_float,
        default=8.0,
        help="before a pass, wait up to this long for every session stepping now to come back with its "
        "next request (0 = never; a lone session never waits; docs/batching.md)",
    )
    p.add_argument(
        "--no-batch-invariant",
        action="store_true",
        help="where the CPU's float32 layer kernel does not run (bfloat16, a GPU, other widths), batch with "
        "torch's fastest operations: a row's rounding then depends on what shares its pass, so greedy output "
        "under load or with speculation may differ from one stream's (default: row-count invariant "
        "operations; docs/batching.md, 'Backends')",
    )
    p.add_argument(
        "--max-waiting-sessions",
        type=non_negative_int,
        default=64,
        help="session starts that may wait for KV room (or a session slot); one more is RESOURCE_EXHAUSTED",
    )


def apply_pass_arguments(args) -> None:
    """The pass's flags -> this process (its CPUs) and its environment, read when the model loads."""
    from specdec.modeling.lean_llama import INVARIANT_ENV

    if getattr(args, "no_batch_invariant", False):
        os.environ[INVARIANT_ENV] = "0"
    if getattr(args, "cpus", None):
        pin_to_cpus(args.cpus)
        args.threads = args.threads or len(args.cpus)


def pin_to_cpus(cpus: set[int]) -> None:
    """Run every thread of this process (and those it starts later) on ``cpus`` only: a Linux
    affinity is per thread, and libraries may have started threads before this runs."""
    check_cpus_available(cpus, "--cpus")
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task), cpus)


class SessionServicer:
    """The session RPCs the draft and target services share: StartSession, Commit, Release.
    Subclasses set ``kind`` ("draft"/"target"), ``engine`` and ``model_spec``."""

    kind = "engine"
    draining = False  # set on SIGTERM: live sessions finish, new ones are refused
    unhealthy = ""  # why the iteration loop cannot run (empty: it can): new sessions are refused meanwhile
    engine: ReplicaEngine
    model_spec: str
    batching: IterationLoop | None = None  # set where the engine's calls are batched
    cost_points: list[tuple[int, float]] = []  # noqa: RUF012 - replaced, never mutated: its pass profile
    placement = Placement()  # where it computes (set at start: replica_placement)

    def replica_info(self, stats: dict) -> dict[str, Any]:
        """The EngineInfo fields both kinds report alike: sessions and KV from the engine's
        ``stats``, draining, the pass profile and backend, where it computes."""
        return {
            "live_sessions": stats["live_sessions"],
            "kv_bytes": stats["kv_bytes"],
            "sessions_started": stats.get("sessions_started", 0),
            "draining": self.draining,
            "kv_bytes_per_token": stats.get("kv_bytes_per_token", 0),
            "cost_sizes": [n for n, _ in self.cost_points],
            "cost_seconds": [t for _, t in self.cost_points],
            "pass_backend": stats.get("pass_backend", ""),
            "batch_invariant": bool(stats.get("batch_invariant", False)),
            "node": self.placement.node,
            "devices": list(self.placement.devices),
        }

    async def run_work(self, session_id: str, work: Work, admit_tokens: int | None = None) -> Any:
        """The result of one of the engine's works: in the batch where this replica batches, else
        alone on the model thread. ``admit_tokens``: it starts a session of that many prompt
        tokens (which waits for KV room where this replica batches)."""
        return (await self.run_work_with_load(session_id, work, admit_tokens))[0]

    async def run_work_with_load(
        self, session_id: str, work: Work, admit_tokens: int | None = None
    ) -> tuple[Any, PassLoad | None]:
        """:meth:`run_work`, and the last batched pass it took part in (None: not batched)."""
        if self.batching is not None:
            return await self.batching.run_with_load(work, session_id, admit_tokens)
        return await on_model_thread(run_alone, self.engine.batch_store, work), None

    @grpc_method
    async def StartSession(self, request, context):
        if self.draining:
            raise DrainingError(f"{self.model_spec}: this {self.kind} replica is draining; start the session elsewhere")
        if self.unhealthy:
            raise DrainingError(
                f"{self.model_spec}: this {self.kind} replica cannot run its passes ({self.unhealthy}); "
                "start the session elsewhere"
            )
        params = replace(
            wire.sampling_from_proto(request.sampling),
            prompt_length=request.prompt_length,
            eos_token_ids=tuple(request.eos_token_ids),
            cache_salt=request.cache_salt,
        )
        extra = self.prefill_arguments(request)
        with tracing.tracer().start_as_current_span(f"{self.kind}.start_session") as span:
            span.set_attribute("specdec.session_id", request.session_id)
            span.set_attribute("specdec.prompt_tokens", len(request.prompt_token_ids))
            span.set_attribute("specdec.invariant", params.invariant)
            features = await self.run_work(
                request.session_id,
                self.engine.prefill_work(request.session_id, list(request.prompt_token_ids), params, *extra),
                admit_tokens=len(request.prompt_token_ids),
            )
            copied = self.copied_positions(request.session_id)
            span.set_attribute("specdec.cached_tokens", copied)
        return engine_pb2.StartSessionResponse(features=wire.features_to_proto(features), cached_tokens=copied)

    def copied_positions(self, session_id: str) -> int:
        """Positions the session's start copied from the engine's prefix cache (0 where it has none)."""
        store = self.engine.batch_store
        return store.copied_positions(session_id) if store is not None else 0

    def prefill_arguments(self, request) -> tuple:
        """What ``engine.prefill_work`` takes after (session, prompt, params), read from the request."""
        return ()

    async def _commit(self, session_id: str, commit) -> None:
        with tracing.tracer().start_as_current_span(f"{self.kind}.commit") as span:
            span.set_attribute("specdec.session_id", session_id)
            span.set_attribute("specdec.step", commit.step)
            span.set_attribute("specdec.committed_tokens", len(commit.tokens))
            await on_model_thread(self.engine.commit, session_id, commit)

    @grpc_method
    async def Commit(self, request, context):
        await self._commit(request.session_id, wire.commit_from_proto(request.commit))
        return engine_pb2.CommitResponse()

    @grpc_method
    async def Release(self, request, context):
        # Shielded: a Release queued behind a long pass must run even when its caller's deadline
        # passes first (cancelling a queued model-thread call would drop it, and the session would
        # hold its KV until the TTL).
        released = await asyncio.shield(on_model_thread(self.engine.release, request.session_id))
        return engine_pb2.ReleaseResponse(released=released)


async def _expiry_loop(engine, ttl: float) -> None:
    # Sessions whose coordinator vanished without a Release are freed after ``ttl`` idle seconds.
    while True:
        await asyncio.sleep(min(30.0, max(1.0, ttl / 4)))
        expired = await on_model_thread(engine.expire_idle, ttl)
        if expired:
            log.warning("expired %d idle session(s)", len(expired))


async def run(spec: ServiceSpec, on_ready: Callable[[], None] | None = None) -> None:
    settings = security.current()
    server = srv.create_server(token=settings.token or None)
    spec.add_to_server(spec.servicer, server)
    health = srv.add_health_and_reflection(server, [spec.full_service_name])
    address = f"{spec.host}:{spec.port}"
    bound = security.bind(server, address, settings)
    if bound == 0:
        raise SystemExit(f"specdec {spec.name}: cannot listen on {address}")
    if spec.batch is not None:

        async def loop_health(serving: bool, reason: str) -> None:
            # The iteration loop is this process's own: while it cannot run passes the replica is
            # neither ready nor live (no new session reaches it, so only a restart recovers it).
            spec.servicer.unhealthy = "" if serving else reason
            await srv.set_serving(health, [spec.full_service_name], serving)
            await srv.set_live(health, serving)

        spec.servicer.batching = IterationLoop(spec.batch, spec.batch_gather_ms / 1000, on_health=loop_health)
    await server.start()
    probes = None
    if spec.health_port:  # health alone: it tells nothing but SERVING or not, so no TLS is lost
        probes = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health, probes)
        if probes.add_insecure_port(f"{spec.host}:{spec.health_port}") == 0:
            raise SystemExit(f"specdec {spec.name}: cannot listen on {spec.host}:{spec.health_port} (--health-port)")
        await probes.start()
    metrics.watch_engine(spec.engine)
    metrics.serve_metrics(spec.metrics_port, spec.host)
    await srv.set_serving(health, [spec.full_service_name], True)
    await srv.set_live(health, True)
    how = ("mutual TLS" if settings.ca else "TLS") if settings.server_tls else "plaintext"
    how += ", token required" if settings.token else ""
    print(f"[specdec] {spec.name} service SERVING on {spec.host}:{bound} ({how})", file=sys.stderr, flush=True)
    if on_ready:
        on_ready()
    expiry = asyncio.create_task(_expiry_loop(spec.engine, spec.session_ttl))
    heartbeat = None
    if spec.redis_url and spec.describe is not None:
        describe = spec.describe
        advertise = spec.advertise or f"{'127.0.0.1' if spec.host in ('0.0.0.0', '::', '[::]') else spec.host}:{bound}"
        registry = Registry(spec.redis_url)
        # an unhealthy replica is listed as draining: coordinators start no new session on it
        heartbeat = Heartbeat(
            registry, lambda: describe(advertise, spec.servicer.draining or bool(spec.servicer.unhealthy))
        )
        heartbeat.start()
        print(
            f"[specdec] {spec.name} registered in {security.redacted(spec.redis_url)} as {advertise}"
            f" ({'signed records' if registry.authenticated else 'unsigned records: no internal token'})",
            file=sys.stderr,
            flush=True,
        )

    async def drain() -> None:
        # Refuse new sessions, tell the registry and the readiness check at once, let live sessions
        # finish, deregister. Liveness stays SERVING: the process is sound, and failing it now
        # would have it killed with the sessions it is finishing.
        spec.servicer.draining = True
        await srv.set_serving(health, [spec.full_service_name], False)
        if heartbeat is not None:
            with contextlib.suppress(Exception):  # the TTL will drop us anyway
                await heartbeat.beat()
        deadline = asyncio.get_running_loop().time() + spec.drain_seconds
        while spec.engine.stats()["live_sessions"] and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.2)
        left = spec.engine.stats()["live_sessions"]
        if left:
            log.warning("drain timeout: handing back %d live session(s)", left)
        if heartbeat is not None:
            await heartbeat.stop(deregister=True)

    async def release_all() -> None:
        expiry.cancel()
        if probes is not None:
            await probes.stop(None)
        await on_model_thread(spec.engine.expire_idle, -1.0)  # free every remaining session
        if spec.on_stop is not None:
            await on_model_thread(spec.on_stop)

    async def broken() -> None:
        # A tensor-parallel peer rank died (SIGUSR1 from the supervisor): say so and leave now.
        log.error("the tensor-parallel group is broken: NOT_SERVING, deregistering, exiting")
        await srv.set_serving(health, [spec.full_service_name], False)
        await srv.set_live(health, False)
        if heartbeat is not None:
            await heartbeat.stop(deregister=True)
        await asyncio.sleep(1.0)
        os._exit(1)

    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, lambda: asyncio.ensure_future(broken()))

    await srv.serve_until_signal(server, health, [spec.full_service_name], spec.grace_seconds, release_all, drain)


def main_async(spec_factory: Callable[[], ServiceSpec], service_name: str) -> int:
    logs.configure(service_name)
    tracing.init_tracing(f"specdec-{service_name}")
    spec = call_on_model_thread(spec_factory)  # loads the model on the thread that will run it
    asyncio.run(run(spec))
    return 0
