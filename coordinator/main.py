"""``specdec coordinator``: the front (``coordinator.front``) on a grpc.aio server with the
standard health and reflection services, its request path in Ray actors (or, with ``--no-ray``,
in this process, for debugging).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from coordinator import api_keys, settings
from coordinator.config import CoordinatorConfig
from coordinator.front import (
    SERVICE,
    STALL_TIMEOUT_S,
    Backend,
    CoordinatorFront,
    CoordinatorServicer,
    LocalBackend,
)
from specdec.runtime import grpc_server as srv
from specdec.runtime import security
from specdec.telemetry import logs, tracing
from specdec.v1 import coordinator_pb2_grpc


def add_arguments(p: argparse.ArgumentParser) -> None:
    settings.add_arguments(p)
    security.add_arguments(p)
    security.add_public_arguments(p)
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0: every interface)")
    p.add_argument("--replicas", type=int, default=1, help="coordinator Ray actors")
    p.add_argument("--ray-address", default=None, help="join this Ray cluster (default: RAY_ADDRESS or a local one)")
    p.add_argument("--no-ray", action="store_true", help="run the request path in the front process (debugging only)")
    p.add_argument(
        "--http-port",
        type=int,
        default=0,
        help="serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, ...) on this port "
        "(0 = off; `specdec serve` turns it on at 8000)",
    )
    p.add_argument(
        "--stall-timeout",
        "--http-stall-timeout",  # its name before gRPC streams had it too
        dest="stall_timeout",
        type=float,
        default=STALL_TIMEOUT_S,
        help="seconds a streaming client (HTTP or gRPC GenerateStream) may read nothing before its generation is "
        "stopped and its sessions freed",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=4 << 20,
        help="largest request message the public gRPC port accepts (larger: RESOURCE_EXHAUSTED)",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        help=f"file of API keys the public APIs require, one 'KEY [NAME [MAX_CONCURRENT]]' per line "
        f"(env {api_keys.API_KEY_FILE_ENV}; default: no key needed)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help=f"one API key the public APIs require (env {api_keys.API_KEY_ENV}; a file or the environment "
        "keeps it out of the process list)",
    )
    p.add_argument(
        "--max-concurrent-per-key",
        type=int,
        default=api_keys.DEFAULT_MAX_CONCURRENT_PER_KEY,
        help="requests in flight per API key at this coordinator, for keys whose line sets none",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model name the HTTP API lists and accepts (default: the target's model as it reports it)",
    )


def config_from_args(args: argparse.Namespace) -> CoordinatorConfig:
    config = settings.config_from(settings.values_from_namespace(args))
    if not config.redis_url and not config.target_address:
        raise SystemExit("specdec coordinator: give --target HOST:PORT, or --redis / REDIS_URL for the registry")
    return config


async def serve(args: argparse.Namespace) -> None:
    config = config_from_args(args)
    backend: Backend
    if args.no_ray:
        backend = LocalBackend(config)
    else:
        from coordinator.ray_backend import RayBackend

        backend = RayBackend(config, replicas=args.replicas, address=args.ray_address)
    try:
        keys = api_keys.from_env(default_max_concurrent=args.max_concurrent_per_key)
    except ValueError as exc:
        raise SystemExit(f"specdec coordinator: {exc}") from None
    front = CoordinatorFront(
        backend,
        metrics_port=args.metrics_port or 0,
        model_name=args.served_model_name,
        keys=keys,
        metrics_host=args.host,
        stall_timeout=args.stall_timeout,
        report_unscoped_cached_tokens=config.report_unscoped_cached_tokens,
    )
    print("[specdec] coordinator: connecting to the target and draft...", file=sys.stderr, flush=True)
    await front.start()
    server = srv.create_server(max_receive_bytes=args.max_request_bytes)
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(front), server)
    health = srv.add_health_and_reflection(server, [SERVICE])
    bound = security.bind(server, f"{args.host}:{args.port}", public=True)
    if bound == 0:
        raise SystemExit(f"specdec coordinator: cannot listen on {args.host}:{args.port}")
    http = None
    if args.http_port:
        from coordinator.http_server import HttpServer

        http = await HttpServer.start(front, front.model_name, args.host, args.http_port, security.current())
    await server.start()
    await srv.set_serving(health, [SERVICE], front.serving)
    front.on_health_change.append(lambda serving: srv.set_serving(health, [SERVICE], serving))
    how = "TLS" if security.current().server_tls else "plaintext"
    how += f", {len(keys.keys)} API key(s)" if keys.enabled else ", no API key needed"
    print(f"[specdec] coordinator service SERVING on {args.host}:{bound} ({how})", file=sys.stderr, flush=True)

    async def stop() -> None:
        if http is not None:
            await http.stop()
        await front.stop()

    await srv.serve_until_signal(server, health, [SERVICE], 10.0, stop)


def main(args: argparse.Namespace) -> int:
    logs.configure("coordinator")
    security.apply_arguments(args)  # before Ray starts: its actors inherit the environment
    if args.api_key_file:
        os.environ[api_keys.API_KEY_FILE_ENV] = str(Path(args.api_key_file).resolve())
    if args.api_key:
        os.environ[api_keys.API_KEY_ENV] = args.api_key
    tracing.init_tracing("specdec-coordinator")
    asyncio.run(serve(args))
    return 0
