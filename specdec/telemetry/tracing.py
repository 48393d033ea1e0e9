"""OpenTelemetry set-up: on when OTEL_EXPORTER_OTLP_ENDPOINT is set, off (no-op) otherwise.

Each process calls :func:`init_tracing` once with its default service name (OTEL_SERVICE_NAME
overrides it). gRPC hops are traced by the OpenTelemetry gRPC instrumentation (W3C trace context
travels in gRPC metadata); the step spans (propose / verify / commit) are ours.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

_enabled = False


def tracing_enabled() -> bool:
    return _enabled


def init_tracing(default_service_name: str) -> bool:
    """Install an OTLP exporter if OTEL_EXPORTER_OTLP_ENDPOINT is set. Idempotent."""
    global _enabled  # noqa: PLW0603 - the process-wide switch, set once at start-up
    if _enabled or not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return _enabled
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    name = os.environ.get("OTEL_SERVICE_NAME") or default_service_name
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))  # OTEL_BSP_* env vars apply
    trace.set_tracer_provider(provider)
    atexit.register(provider.shutdown)  # flush what is buffered on a clean exit
    _enabled = True
    return True


def flush() -> None:
    provider = trace.get_tracer_provider()
    if hasattr(provider, "force_flush"):
        provider.force_flush()


def tracer() -> trace.Tracer:
    return trace.get_tracer("specdec")


def server_interceptors() -> list:
    if not _enabled:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor()]


def client_interceptors() -> list:
    if not _enabled:
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return list(aio_client_interceptors())


def inject_context() -> dict[str, str]:
    """The current trace context as W3C headers (to carry across a Ray call)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def start_span(name: str, carrier: Mapping[str, str] | None = None, attributes: dict | None = None) -> trace.Span:
    """A span that is NOT made current (use :func:`span_as_current` around each piece of work):
    async generators must not keep a context attached across a yield."""
    parent = propagate.extract(dict(carrier)) if carrier else None
    return tracer().start_span(name, context=parent, attributes=attributes or {})


@contextmanager
def span_as_current(span: trace.Span) -> Iterator[None]:
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        yield
    finally:
        otel_context.detach(token)
