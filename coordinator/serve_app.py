"""The coordinator as a Ray Serve application, for KubeRay's RayService (deploy/).

Locally, ``specdec coordinator`` runs a grpc.aio front dispatching to Ray actors (see README for
why). On Kubernetes, KubeRay manages Ray Serve applications, so the same :class:`CoordinatorCore`
is wrapped here as a Serve deployment behind Serve's gRPC ingress:

    serveConfigV2:
      grpc_options:
        port: 9000
        grpc_servicer_functions:
          - specdec.v1.coordinator_pb2_grpc.add_CoordinatorServicer_to_server
          - grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server
      applications:
        - name: specdec
          route_prefix: /            # required: without it Serve's proxy never routes gRPC
          import_path: coordinator.serve_app:build_app
          args: {num_speculative_tokens: 4, ...}   # REDIS_URL comes from the environment

The standard ``grpc.health.v1.Health/Check`` on the public port is answered by the deployment
itself (Serve routes it like any method), so Kubernetes gRPC probes work. Errors are returned
with their status code and message (``set_code``/``set_details`` before raising: Serve then
sends that code and those details, never the Ray traceback).
"""
from __future__ import annotations

import os

from ray import serve

from specdec.telemetry import tracing
from specdec.errors import SpecdecError
from specdec.runtime.grpc_server import status_of

from specdec.loop.policy import StepCost

from specdec.runtime.coordination import CoordinatorConfig, CoordinatorCore

CONFIG_ARGS = {
    "num_speculative_tokens": ("default_k", int),
    "adaptive": ("default_adaptive", lambda v: _boolean("adaptive", v)),
    "step_cost": ("step_cost", lambda v: StepCost.parse(str(v))),
    "max_speculative_tokens": ("max_k", int),
    "default_max_new_tokens": ("default_max_new_tokens", int),
    "max_new_tokens_limit": ("max_new_tokens_limit", int),
    "max_concurrent_requests": ("max_concurrent_requests", int),
    "draft_timeout": ("draft_timeout_s", float),
    "default_method": ("default_method", str),
    "output_ttl": ("output_ttl_s", float),
    "tokenizer": ("tokenizer", str),
}


def _boolean(name: str, value) -> bool:
    """A YAML boolean, or its spelling as a string (bool("false") would be True)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "yes", "on", "1"):
        return True
    if text in ("false", "no", "off", "0"):
        return False
    raise ValueError(f"coordinator arg {name!r} must be true or false, got {value!r}")


def config_from_args(args: dict) -> CoordinatorConfig:
    unknown = set(args) - set(CONFIG_ARGS) - {"redis_url"}
    if unknown:
        raise ValueError(f"unknown coordinator args {sorted(unknown)}; known: {sorted(CONFIG_ARGS)}")
    redis_url = args.get("redis_url") or os.environ.get("REDIS_URL")
    if not redis_url:
        raise ValueError("the Serve coordinator needs REDIS_URL (the registry finds the draft and target replicas)")
    kwargs = {CONFIG_ARGS[k][0]: CONFIG_ARGS[k][1](v) for k, v in args.items() if k in CONFIG_ARGS}
    return CoordinatorConfig(redis_url=redis_url, **kwargs)


def _carrier(grpc_context) -> dict:
    try:
        return {k: v for k, v in grpc_context.invocation_metadata() if k in ("traceparent", "tracestate")}
    except Exception:  # noqa: BLE001 - tracing is best effort
        return {}


def _fail(grpc_context, exc: BaseException) -> None:
    grpc_context.set_code(status_of(exc))
    grpc_context.set_details(str(exc) if isinstance(exc, SpecdecError) else f"internal error: {type(exc).__name__}")


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=64)
class CoordinatorDeployment:
    def __init__(self, config: CoordinatorConfig):
        tracing.init_tracing("specdec-coordinator")
        self.core = CoordinatorCore(config)
        self._ready = False

    async def _setup(self) -> None:
        if not self._ready:
            await self.core.setup()
            self._ready = True

    async def Generate(self, request, grpc_context):
        try:
            await self._setup()
            return await self.core.generate_unary(request, _carrier(grpc_context))
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            _fail(grpc_context, exc)
            raise

    async def GenerateStream(self, request, grpc_context):
        try:
            await self._setup()
            async for chunk in self.core.generate(request, _carrier(grpc_context)):
                yield chunk
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            _fail(grpc_context, exc)
            raise

    async def Check(self, request, grpc_context=None):
        from grpc_health.v1 import health_pb2

        try:
            await self._setup()
            status = health_pb2.HealthCheckResponse.SERVING
        except Exception:  # noqa: BLE001 - no target reachable yet
            status = health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)


def build_app(args: dict):
    """Serve application builder (``import_path: coordinator.serve_app:build_app``)."""
    return CoordinatorDeployment.bind(config_from_args(dict(args or {})))
