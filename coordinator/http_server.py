"""The HTTP API's server: uvicorn on the coordinator's own event loop, beside the grpc.aio server
(the process's signals stay the coordinator's: it stops both)."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import sys

import uvicorn

from coordinator.front import CoordinatorFront
from coordinator.http_api import OpenAIApp
from specdec.runtime.security import Security
from specdec.telemetry import metrics


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the coordinator handles SIGTERM / SIGINT for both servers
        yield


class HttpServer:
    def __init__(self, server: _Server, task: asyncio.Task):
        self.server, self.task = server, task

    @classmethod
    async def start(
        cls,
        front: CoordinatorFront,
        model_name: str,
        host: str,
        port: int,
        tls: Security | None = None,
    ) -> HttpServer:
        """Serve the API on ``host``:``port``: HTTPS when ``tls`` has a certificate (the same
        SPECDEC_TLS_* files as the public gRPC port, client certificates required only with the
        public client CA), else plain HTTP -- never plain HTTP beside a TLS gRPC port."""
        from prometheus_client import generate_latest

        app = OpenAIApp(front, model_name, lambda: generate_latest(metrics.REGISTRY)).app
        options: dict = {}
        if tls is not None and tls.server_tls:
            options = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key}
            client_ca = tls.client_ca(public=True)
            if client_ca:
                options.update(ssl_ca_certs=client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", access_log=False, lifespan="off", **options
        )
        server = _Server(config)
        task = asyncio.ensure_future(server.serve())
        while not server.started:
            if task.done():  # it could not listen
                task.result()
                raise SystemExit(f"specdec coordinator: the HTTP API cannot listen on {host}:{port}")
            await asyncio.sleep(0.05)
        scheme = "https" if options else "http"
        print(
            f"[specdec] OpenAI-compatible HTTP API on {scheme}://{host}:{port}/v1 (model {model_name!r})",
            file=sys.stderr,
            flush=True,
        )
        return cls(server, task)

    async def stop(self) -> None:
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.task, 10.0)
