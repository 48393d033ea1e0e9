"""The coordinator as a Ray Serve application, for KubeRay's RayService (deploy/).

Locally, ``specdec coordinator`` serves the front (``coordinator.front``) on its own grpc.aio
server (docs/architecture.md, "One front, two hosts", says why). On Kubernetes, KubeRay manages
Ray Serve applications, so the same front is served here as a Serve deployment behind Serve's gRPC
ingress:

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
          args: {num_speculative_tokens: 4, metrics_port: 9090, ...}   # coordinator/settings.py

The args are the settings of ``specdec coordinator`` (its flags without the dashes); REDIS_URL
comes from the environment. The standard ``grpc.health.v1.Health/Check`` on the public port is
answered by the deployment itself (Serve routes it like any method): NOT_SERVING until the
request path has found a target, as on the grpc.aio front, and never blocking a probe; so is the
HTTP API's GET /health (503 meanwhile). Neither is a Kubernetes probe of the head pod: KubeRay
deploys this application only once the head is Ready (deploy/README.md, "Probes"). Errors are
returned with their status code and message (``set_code``/``set_details`` before raising: Serve
then sends that code and those details, never the Ray traceback).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from grpc_health.v1 import health_pb2
from ray import serve

from coordinator import api_keys, settings
from coordinator.front import CoordinatorFront, LocalBackend, authorization_of, trace_headers
from specdec.runtime.grpc_server import failure_status
from specdec.telemetry import metrics, tracing

# How long a health check (gRPC Check, HTTP GET /health) waits for the front's start before it
# answers from what is known: a probe never blocks.
HEALTH_WAIT_S = 0.5


def serve_config(values: dict[str, Any]) -> settings.CoordinatorConfig:
    """The request path's config in a replica. The Serve coordinator needs the registry, so
    ``redis`` or REDIS_URL must be set; it is read here, in the replica, because REDIS_URL usually
    comes from the replica's runtime environment, not the process that builds the application."""
    config = settings.config_from(values)
    if not config.redis_url:
        raise ValueError("the Serve coordinator needs REDIS_URL (the registry finds the draft and target replicas)")
    return config


def _fail(grpc_context, exc: BaseException, method: str) -> None:
    code, details = failure_status(exc, method)
    grpc_context.set_code(code)
    grpc_context.set_details(details)


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=64)
class CoordinatorDeployment:
    def __init__(self, values: dict[str, Any]):
        tracing.init_tracing("specdec-coordinator")
        port = {**settings.values_from_env(), **values}.get("metrics_port", 0)  # SPECDEC_METRICS_PORT too
        config = serve_config(values)
        # in a Serve pod the metrics are scraped over the pod network (deploy/'s NetworkPolicy bounds who)
        self.front = CoordinatorFront(
            LocalBackend(config),
            port,
            keys=api_keys.from_env(),
            metrics_host="0.0.0.0",
            report_unscoped_cached_tokens=config.report_unscoped_cached_tokens,
        )
        self._starting: asyncio.Future | None = None
        self._http: Any = None  # the OpenAI-compatible HTTP API, made on the first HTTP request

    def _start(self) -> asyncio.Future:
        """The front's start-up, begun on first use and begun again after a failure."""
        failed = self._starting is not None and self._starting.done() and self._starting.exception() is not None
        if self._starting is None or failed:
            self._starting = asyncio.ensure_future(self.front.start())
        return self._starting

    async def Generate(self, request, grpc_context):
        try:
            with metrics.rpc_timer("Generate"):
                metadata = grpc_context.invocation_metadata()
                key = self.front.authenticate(authorization_of(metadata))
                await self._start()
                return await self.front.unary(request, trace_headers(metadata), key)
        except Exception as exc:
            _fail(grpc_context, exc, "Generate")
            raise

    async def GenerateStream(self, request, grpc_context):
        try:
            with metrics.rpc_timer("GenerateStream"):
                metadata = grpc_context.invocation_metadata()
                key = self.front.authenticate(authorization_of(metadata))
                await self._start()
                async for chunk in self.front.stream_to_reader(request, trace_headers(metadata), key):
                    yield chunk
        except Exception as exc:
            _fail(grpc_context, exc, "GenerateStream")
            raise

    async def _settle(self) -> None:
        """The front's start begun (or seen through) for at most HEALTH_WAIT_S: a health check
        answers from what is known now, never after the start's own wait for a target."""
        starting = self._start()
        with contextlib.suppress(asyncio.TimeoutError, Exception):  # not ready (or failed): NOT_SERVING now
            await asyncio.wait_for(asyncio.shield(starting), timeout=HEALTH_WAIT_S)

    async def __call__(self, request):
        """Serve's HTTP proxy: the OpenAI-compatible HTTP API (coordinator.http_api) on the
        same front as the gRPC methods."""
        from prometheus_client import generate_latest

        from coordinator.http_api import OpenAIApp, error_response, health_response

        if request.method == "GET" and request.url.path.strip("/") == "health":
            await self._settle()  # as Check: 503 at once while no target or Redis answers
            return health_response(self.front)
        try:
            await self._start()
        except Exception as exc:  # noqa: BLE001 - no target yet: 503, not a traceback
            return error_response(exc)
        if self._http is None:
            self._http = OpenAIApp(self.front, self.front.model_name, lambda: generate_latest(metrics.REGISTRY))
        return await self._http.dispatch(request)

    async def Check(self, request, grpc_context=None):
        await self._settle()
        ready = self.front.serving
        return health_pb2.HealthCheckResponse(
            status=health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        )


def build_app(args: dict[str, Any] | None):
    """Serve application builder (``import_path: coordinator.serve_app:build_app``); a bad arg is
    a ValueError naming it, here, before any replica starts."""
    return CoordinatorDeployment.bind(settings.parse_values(dict(args or {})))  # type: ignore[attr-defined]
