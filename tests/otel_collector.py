"""A minimal OpenTelemetry collector for tests: a real gRPC server speaking OTLP's
``TraceService``, which keeps every span it receives. It stands in for the
collector only, so that the exporter under test (the SDK's real OTLP exporter
over real gRPC) is what the tests exercise."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    trace_id: bytes
    span_id: bytes
    parent_span_id: bytes
    name: str
    start_ns: int
    end_ns: int
    attributes: dict
    status_code: int
    service_name: str


def _value(v):
    return getattr(v, v.WhichOneof("value"))


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"127.0.0.1:{self.port}"

    def Export(self, request, context):  # noqa: N802 (the OTLP method's name)
        got = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        ReceivedSpan(
                            s.trace_id,
                            s.span_id,
                            s.parent_span_id,
                            s.name,
                            s.start_time_unix_nano,
                            s.end_time_unix_nano,
                            {a.key: _value(a.value) for a in s.attributes},
                            s.status.code,
                            resource.get("service.name", ""),
                        )
                    )
        with self._lock:
            self.spans.extend(got)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace_of(self, request_id: str, deadline_s: float = 60.0) -> list[ReceivedSpan]:
        """All spans of the request's trace (root first), once its root and phases arrived."""
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            with self._lock:
                roots = [s for s in self.spans if s.attributes.get("splitserve.request_id") == request_id]
                if roots:
                    spans = [s for s in self.spans if s.trace_id == roots[0].trace_id]
                    if len(spans) > 1:
                        return sorted(spans, key=lambda s: (s.parent_span_id != b"", s.start_ns))
            time.sleep(0.05)
        raise TimeoutError(f"no trace for request {request_id} reached the collector in {deadline_s} s")

    def __enter__(self) -> Collector:
        self._server.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop(grace=None)
