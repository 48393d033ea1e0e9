"""The coordinator on Ray: the step loops run in Ray actors; the gRPC front dispatches to them.

Each :class:`CoordinatorActor` is an async Ray actor holding a :class:`CoordinatorCore` (its own
channels to the draft and target services) and serving many requests concurrently. A request is
one call of its ``generate`` method, a Ray streaming generator that yields serialized
GenerateChunks as tokens are committed. The front picks the replica with the fewest requests in
flight. Cancelling the gRPC call (client cancel, deadline, disconnect) cancels the Ray task, which
cancels the loop, which releases the session on both services. Actors restart on failure
(``max_restarts=-1``); a request in flight on a dead actor fails with UNAVAILABLE.

Trace context crosses the Ray call as W3C headers (``carrier``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from coordinator.config import CoordinatorConfig
from coordinator.core import CoordinatorCore
from specdec.errors import PeerError, SpecdecError
from specdec.runtime import security
from specdec.telemetry import logs, tracing
from specdec.v1 import coordinator_pb2

log = logging.getLogger("specdec.coordinator")
STREAM_BACKPRESSURE_CHUNKS = 16


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class CoordinatorActor:
    def __init__(self, config: dict):
        logs.configure("coordinator actor")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        tracing.init_tracing("specdec-coordinator")
        self.core = CoordinatorCore(CoordinatorConfig(**config))
        self.ready = False

    async def setup(self) -> bool:
        if not self.ready:
            await self.core.setup()
            self.ready = True
        return True

    async def generate(self, request_bytes: bytes, carrier: dict, durable: bool = True, tenant: str = ""):
        if not self.ready:
            await self.setup()
        request = coordinator_pb2.GenerateRequest.FromString(request_bytes)
        async for chunk in self.core.generate(request, carrier, durable, tenant):
            yield chunk.SerializeToString()

    async def cost_model(self) -> list:
        return self.core.cost_model()

    async def health(self) -> str | None:
        return await self.core.health() if self.ready else "setting up"

    async def model_id(self) -> str:
        if not self.ready:
            await self.setup()
        return self.core.model_id


def _unwrap(exc: BaseException) -> BaseException:
    """The error the actor raised, as the front should report it."""
    if isinstance(exc, RayActorError) or isinstance(getattr(exc, "cause", None), RayActorError):
        log.warning("coordinator replica lost: %s", exc)
    if isinstance(exc, RayTaskError):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, SpecdecError):
            return cause
        if isinstance(cause, RayActorError):
            return PeerError("UNAVAILABLE", "a coordinator replica died mid-request; resume or retry")
        # the actor's own exception (a Redis refusal, a bug), classified as raised there; the
        # RayTaskError around it carries a traceback, pid and node address no client should see
        return cause if isinstance(cause, Exception) else exc
    if isinstance(exc, RayActorError):
        return PeerError("UNAVAILABLE", "the coordinator replica is unavailable; retry")
    return exc


class RayBackend:
    def __init__(self, config: CoordinatorConfig, replicas: int = 1, address: str | None = None):
        if replicas < 1:
            raise ValueError("need at least one coordinator replica")
        self.config = config
        self.replicas = replicas
        self.address = address or os.environ.get("RAY_ADDRESS")
        self.actors: list = []
        self.in_flight: list[int] = []

    async def start(self) -> None:
        if not ray.is_initialized():
            if self.address:
                ray.init(address=self.address, include_dashboard=False, log_to_driver=True)
            else:
                ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=True)
        config = asdict(self.config)
        # Tracing and transport-security settings travel to the actors explicitly (a joined
        # cluster has its own env): the actors dial the draft and target services as we would.
        env = {k: v for k, v in os.environ.items() if k.startswith("OTEL_") or k == "HF_HUB_OFFLINE"}
        env.update(security.forwarded_env())
        options = {"runtime_env": {"env_vars": env}} if env else {}
        actor_class: Any = CoordinatorActor  # ray.remote made it an ActorClass: .options, .remote
        self.actors = [actor_class.options(**options).remote(config) for _ in range(self.replicas)]
        self.in_flight = [0] * self.replicas
        for actor in self.actors:
            try:
                await actor.setup.remote()
            except RayTaskError as exc:
                raise _unwrap(exc) from None

    def _pick(self) -> int:
        return min(range(len(self.actors)), key=lambda i: self.in_flight[i])

    async def generate(self, request, carrier, durable: bool = True, tenant: str = ""):
        index = self._pick()
        self.in_flight[index] += 1
        # backpressure: the actor pauses a request's generation while this many of its chunks
        # wait for the front (a client that stops reading holds its own request, nobody else's)
        stream = (
            self.actors[index]
            .generate.options(num_returns="streaming", _generator_backpressure_num_objects=STREAM_BACKPRESSURE_CHUNKS)
            .remote(request.SerializeToString(), carrier, durable, tenant)
        )
        finished = False
        try:
            async for ref in stream:
                try:
                    data = await ref
                except (RayTaskError, RayActorError) as exc:
                    raise _unwrap(exc) from None
                chunk = coordinator_pb2.GenerateChunk.FromString(data)
                yield chunk
                if chunk.finish_reason:
                    finished = True
        except (RayTaskError, RayActorError) as exc:
            raise _unwrap(exc) from None
        finally:
            self.in_flight[index] -= 1
            if not finished:
                ray.cancel(stream)  # client gone or error: stop the loop, free the sessions

    async def cost_model(self) -> list:
        """Every actor's current pass-cost estimates (kind, replica address, points)."""
        out: list = []
        for actor in list(self.actors):
            try:
                out.extend(await actor.cost_model.remote())
            except (RayTaskError, RayActorError):
                continue  # a restarting actor: the next poll asks again
        return out

    async def health(self) -> str | None:
        """None if any actor can serve (the front routes around the others), else the first reason."""
        reasons = []
        for actor in list(self.actors):
            try:
                reason = await actor.health.remote()
            except (RayTaskError, RayActorError):
                reason = "a coordinator actor is restarting"
            if reason is None:
                return None
            reasons.append(reason)
        return reasons[0] if reasons else "no coordinator actor"

    async def model_id(self) -> str:
        try:
            return await self.actors[0].model_id.remote()
        except (RayTaskError, RayActorError) as exc:
            raise _unwrap(exc) from None

    async def stop(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if ray.is_initialized():
            ray.shutdown()
