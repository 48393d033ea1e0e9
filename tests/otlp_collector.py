"""A real OTLP/gRPC trace collector for tests: receives spans from every service and keeps them."""

from __future__ import annotations

import threading
from collections import defaultdict
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.lock = threading.Lock()
        self.spans = []  # (service_name, trace_id hex, span name, attributes dict)

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                service = next(
                    (a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"), ""
                )
                for scope in resource_spans.scope_spans:
                    for span in scope.spans:
                        attrs = {a.key: (a.value.string_value or a.value.int_value) for a in span.attributes}
                        self.spans.append((service, span.trace_id.hex(), span.name, attrs))
        return trace_service_pb2.ExportTraceServiceResponse()

    def services_by_trace(self) -> dict[str, set[str]]:
        with self.lock:
            out = defaultdict(set)
            for service, trace_id, _, _ in self.spans:
                out[trace_id].add(service)
            return dict(out)

    def spans_of(self, trace_id: str):
        with self.lock:
            return [s for s in self.spans if s[1] == trace_id]


def start_collector():
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return collector, server, port
