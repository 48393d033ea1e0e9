"""What every specdec gRPC server shares: error -> status mapping, health, reflection, tracing
interceptors, message size limits, and graceful shutdown on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import signal
import uuid
from collections.abc import Awaitable, Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.errors import SpecdecError
from specdec.runtime import security
from specdec.telemetry import metrics, tracing

log = logging.getLogger("specdec.runtime.grpc_server")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # both directions, on servers and on our clients
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


# Redis refusing a write (out of memory, a read-only replica, a failed snapshot, still loading) is
# the session store being unavailable for now, not a bug in the request: retryable.
REDIS_REFUSALS = frozenset({"OOM", "READONLY", "MISCONF", "LOADING", "MASTERDOWN", "BUSY", "NOREPLICAS"})
# What a client is told of it: no address, no errno (redis-py's own message names both; the log has it).
SESSION_LOG_UNAVAILABLE = "the session log (Redis) is unavailable or refusing writes; retry"


def redis_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis unreachable or refusing writes (see REDIS_REFUSALS)."""
    try:
        import redis.exceptions as rx
    except ImportError:  # pragma: no cover - redis is a dependency
        return False
    refusals = (rx.OutOfMemoryError, rx.ReadOnlyError, rx.BusyLoadingError, rx.MasterDownError, rx.TryAgainError)
    if isinstance(exc, (rx.ConnectionError, rx.TimeoutError, *refusals)):
        return True
    return isinstance(exc, rx.ResponseError) and str(exc).split(" ", 1)[0] in REDIS_REFUSALS


def status_of(exc: BaseException) -> grpc.StatusCode:
    """The one mapping from our exceptions to gRPC status codes."""
    if isinstance(exc, SpecdecError):
        return getattr(grpc.StatusCode, exc.code, grpc.StatusCode.INTERNAL)
    if redis_unavailable(exc):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


def failure_status(exc: BaseException, method: str) -> tuple[grpc.StatusCode, str]:
    """The status and details a failed call answers with: a SpecdecError's own code and message
    (it names the problem); Redis unavailable, UNAVAILABLE saying so; anything else INTERNAL with
    a generic message and an error id, the traceback logged here under that id -- a client never
    sees a traceback, a path, a pid or an address. Every front maps failures through this."""
    code = status_of(exc)
    if isinstance(exc, SpecdecError) and code != grpc.StatusCode.INTERNAL:
        return code, str(exc)
    if code == grpc.StatusCode.UNAVAILABLE:
        log.warning("%s: the session log is unavailable: %s: %s", method, type(exc).__name__, exc)
        return code, f"{method}: {SESSION_LOG_UNAVAILABLE}"
    error_id = uuid.uuid4().hex[:12]
    log.error("%s failed (error id %s)", method, error_id, exc_info=exc)
    return code, f"internal error in {method} (error id {error_id}; the server's log has the details)"


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, method: str):
    await context.abort(*failure_status(exc, method))


def grpc_method(fn: Callable) -> Callable:
    """Wrap a servicer method so a SpecdecError becomes its status (message included) and any other
    exception becomes INTERNAL with a log line; never a stack trace to the client. Works for unary
    methods and for server-streaming methods written as ``async def ... yield``."""
    name = fn.__qualname__
    method = fn.__name__
    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def stream_wrapper(self, request, context):
            try:
                with metrics.rpc_timer(method):
                    async for item in fn(self, request, context):
                        yield item
            except (asyncio.CancelledError, GeneratorExit):
                raise
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - mapped to a status
                await _abort(context, exc, name)

        return stream_wrapper

    @functools.wraps(fn)
    async def unary_wrapper(self, request, context):
        try:
            with metrics.rpc_timer(method):
                return await fn(self, request, context)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            await _abort(context, exc, name)

    return unary_wrapper


def create_server(max_receive_bytes: int | None = None, token: str | None = None) -> grpc.aio.Server:
    """A grpc.aio server; ``max_receive_bytes`` bounds a request message (a public port takes
    far less than the internal services' MAX_MESSAGE_BYTES, which carry features). With
    ``token``, every call but health and reflection must carry it (specdec.runtime.security)."""
    options = CHANNEL_OPTIONS
    if max_receive_bytes is not None:
        options = [o for o in CHANNEL_OPTIONS if o[0] != "grpc.max_receive_message_length"]
        options.append(("grpc.max_receive_message_length", max_receive_bytes))
    checks = [security.TokenCheck(token)] if token else []
    return grpc.aio.server(interceptors=checks + tracing.server_interceptors(), options=options)


# The health service name a process answers for its liveness alone (Kubernetes' gRPC liveness probe
# asks it): SERVING while the process itself is sound, whatever it depends on. The standard ""
# and the service's own name stay its readiness: able to serve now.
LIVENESS_SERVICE = "liveness"


def add_health_and_reflection(server: grpc.aio.Server, service_full_names: Iterable[str]) -> health.aio.HealthServicer:
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = list(service_full_names)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return servicer


async def set_serving(servicer: health.aio.HealthServicer, service_full_names: Iterable[str], serving: bool) -> None:
    """Readiness: "" and each of ``service_full_names`` (never LIVENESS_SERVICE)."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_full_names]:
        await servicer.set(name, status)


async def set_live(servicer: health.aio.HealthServicer, live: bool) -> None:
    """Liveness: LIVENESS_SERVICE alone."""
    status = health_pb2.HealthCheckResponse.SERVING if live else health_pb2.HealthCheckResponse.NOT_SERVING
    await servicer.set(LIVENESS_SERVICE, status)


def client_channel(address: str, settings: security.Security | None = None) -> grpc.aio.Channel:
    """An aio channel to a specdec port: TLS (mutual, with a certificate) and the shared token
    when this process is configured for them (specdec.runtime.security), plaintext otherwise."""
    settings = settings or security.current()
    interceptors = security.client_interceptors(settings) + tracing.client_interceptors()
    credentials = settings.channel_credentials()
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=interceptors)
    options = CHANNEL_OPTIONS + settings.channel_options()
    return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)


def sync_channel(address: str, settings: security.Security | None = None) -> grpc.Channel:
    """A blocking channel (the CLI client, launchers' probes): TLS as :func:`client_channel`, no
    token -- they talk to the coordinator's public port and to health checks, which need none."""
    settings = settings or security.current()
    credentials = settings.channel_credentials()
    if credentials is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS + settings.channel_options())


async def serve_until_signal(
    server: grpc.aio.Server,
    health_servicer,
    service_full_names: list[str],
    grace_seconds: float = 10.0,
    on_stop: Callable[[], Awaitable[None]] | None = None,
    drain: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT, then: ``drain`` (while still serving), health NOT_SERVING, stop
    accepting, let in-flight RPCs finish for ``grace_seconds``, run ``on_stop``."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if drain is not None:
        await drain()
    log.info("shutting down (grace %.0fs)", grace_seconds)
    await set_serving(health_servicer, service_full_names, False)
    await server.stop(grace_seconds)
    if on_stop is not None:
        await on_stop()
    tracing.flush()


async def wait_for_health(address: str, timeout: float = 60.0, service: str = "") -> None:
    """Block until ``address`` answers SERVING on the standard health service (for launchers/tests)."""
    deadline = asyncio.get_running_loop().time() + timeout
    last_error = "no answer"
    async with client_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while asyncio.get_running_loop().time() < deadline:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last_error = f"status {reply.status}"
            except grpc.aio.AioRpcError as exc:
                last_error = exc.code().name
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{address} not SERVING after {timeout:.0f}s ({last_error})")
