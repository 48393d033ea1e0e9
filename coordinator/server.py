"""The public gRPC front: specdec.v1.Coordinator (Generate, GenerateStream), plus the standard
health and reflection services, on a grpc.aio server. Requests are handed to a backend: Ray
actors running :class:`CoordinatorCore` (the product), or a core in this process (tests).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from specdec.runtime import grpc_server as srv
from specdec.telemetry import tracing
from specdec.runtime import wire
from specdec.telemetry import metrics
from specdec.runtime.grpc_server import grpc_method, status_of
from specdec.v1 import coordinator_pb2_grpc

from specdec.loop.policy import StepCost

from specdec.runtime.coordination import CoordinatorConfig, CoordinatorCore

log = logging.getLogger("specdec.coordinator")
SERVICE = "specdec.v1.Coordinator"


class LocalBackend:
    """The core in this process (no Ray): for tests of the core and for debugging."""

    def __init__(self, config: CoordinatorConfig):
        self.core = CoordinatorCore(config)

    async def start(self) -> None:
        await self.core.setup()

    async def generate(self, request, carrier):
        async for chunk in self.core.generate(request, carrier):
            yield chunk

    async def stop(self) -> None:
        await self.core.close()


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, backend):
        self.backend = backend

    async def _chunks(self, request):
        """The backend's chunks, recorded in the Prometheus metrics as they pass."""
        recorder = metrics.RequestRecorder()
        try:
            async for chunk in self.backend.generate(request, tracing.inject_context()):
                recorder.chunk(chunk)
                yield chunk
        except Exception as exc:
            recorder.error(status_of(exc).name)
            raise

    @grpc_method
    async def Generate(self, request, context):
        from specdec.v1 import coordinator_pb2

        response = coordinator_pb2.GenerateResponse()
        async for chunk in self._chunks(request):
            wire.add_chunk(response, chunk)
        return response

    @grpc_method
    async def GenerateStream(self, request, context):
        # Written as `async def ... yield` (not context.write): see design.md §7 on the OTel bug.
        async for chunk in self._chunks(request):
            yield chunk


def _step_cost(text: str) -> StepCost:
    try:
        return StepCost.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis", default=None, help="Redis URL for the replica registry and the session log "
                                                 "(default: REDIS_URL)")
    p.add_argument("--target", default=None, help="a static target address HOST:PORT (besides the registry)")
    p.add_argument("--draft", default=None, help="a static draft address HOST:PORT (besides the registry)")
    p.add_argument("--output-ttl", type=float, default=3600.0, help="seconds a request's output stays resumable")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--tokenizer", default=None, help="tokenizer model spec (default: the target's model)")
    p.add_argument("--num-speculative-tokens", type=int, default=4,
                   help="default k: the tokens a draft block proposes")
    p.add_argument("--fixed-k", action="store_true",
                   help="requests that do not say propose k tokens every step (default for draft models: "
                        "adaptive, target-only steps while the request's blocks do not pay; see specdec/loop/policy.py)")
    p.add_argument("--step-cost", default=None, metavar="FIXED,PER_TOKEN", type=_step_cost,
                   help="the adaptive policy's cost of a step proposing k tokens, 1 + FIXED + PER_TOKEN * k "
                        "target-only steps (default: 0.17,0.19, measured on a 2-core CPU)")
    p.add_argument("--max-speculative-tokens", type=int, default=16, help="largest k a request may ask for")
    p.add_argument("--default-max-new-tokens", type=int, default=128)
    p.add_argument("--max-new-tokens-limit", type=int, default=4096)
    p.add_argument("--max-concurrent-requests", type=int, default=64, help="per coordinator replica")
    p.add_argument("--draft-timeout", type=float, default=5.0, help="seconds before a draft call is abandoned")
    p.add_argument("--default-method", default="draft_model", choices=["draft_model", "ngram", "none"])
    p.add_argument("--replicas", type=int, default=1, help="coordinator Ray actors")
    p.add_argument("--ray-address", default=None, help="join this Ray cluster (default: RAY_ADDRESS or a local one)")
    p.add_argument("--no-ray", action="store_true", help="run the core in the front process (debugging only)")
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus /metrics on this port (0 = off)")


def config_from_args(args) -> CoordinatorConfig:
    import os

    redis_url = args.redis or os.environ.get("REDIS_URL")
    if not redis_url and not args.target:
        raise SystemExit("specdec coordinator: give --target HOST:PORT, or --redis / REDIS_URL for the registry")
    return CoordinatorConfig(
        target_address=args.target, draft_address=args.draft, redis_url=redis_url, tokenizer=args.tokenizer,
        output_ttl_s=args.output_ttl,
        default_k=args.num_speculative_tokens, max_k=args.max_speculative_tokens,
        default_max_new_tokens=args.default_max_new_tokens, max_new_tokens_limit=args.max_new_tokens_limit,
        max_concurrent_requests=args.max_concurrent_requests, draft_timeout_s=args.draft_timeout,
        default_method=args.default_method, default_adaptive=not args.fixed_k,
        step_cost=args.step_cost or StepCost(),
    )


async def serve(args) -> None:
    config = config_from_args(args)
    if args.no_ray:
        backend = LocalBackend(config)
    else:
        from coordinator.ray_backend import RayBackend

        backend = RayBackend(config, replicas=args.replicas, address=args.ray_address)
    print("[specdec] coordinator: connecting to the target and draft...", file=sys.stderr, flush=True)
    await backend.start()
    server = srv.create_server()
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(backend), server)
    health = srv.add_health_and_reflection(server, [SERVICE])
    bound = server.add_insecure_port(f"{args.host}:{args.port}")
    if bound == 0:
        raise SystemExit(f"specdec coordinator: cannot listen on {args.host}:{args.port}")
    await server.start()
    metrics.serve_metrics(args.metrics_port)
    await srv.set_serving(health, [SERVICE], True)
    print(f"[specdec] coordinator service SERVING on {args.host}:{bound}", file=sys.stderr, flush=True)
    await srv.serve_until_signal(server, health, [SERVICE], 10.0, backend.stop)


def main(args) -> int:
    logging.basicConfig(level=logging.INFO, format="[specdec coordinator] %(levelname)s %(message)s")
    tracing.init_tracing("specdec-coordinator")
    asyncio.run(serve(args))
    return 0
