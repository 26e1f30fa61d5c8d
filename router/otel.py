"""Request traces exported through OpenTelemetry (OTLP over gRPC), when configured.

``OtelSink`` is a ``TraceSink``: each finished request's ``RequestTrace`` becomes
one OpenTelemetry trace, a root span with one child per phase, timestamped with
the trace's own marks (the spans are written after the fact, so their times are
the request's, not the export's)::

    splitserve.request            admitted -> finished   request id, outcome, tokens, workers, KV bytes
      splitserve.queue            admitted -> prefill_started
      splitserve.prefill          ... on the prefill worker (or the decode worker, when local)
      splitserve.kv_transfer      ... the decode worker's pull (backend, bytes, pull ms)
      splitserve.decode           ... to the last token, on the decode worker

A failed request's root span has status ERROR with its gRPC code. The spans go
through the SDK's ``BatchSpanProcessor``: ``record`` only queues them (it runs on
the router's loop and must not block); a background thread exports, and an
unreachable collector costs dropped spans, never a request.

The OpenTelemetry packages are an optional dependency (``pip install
splitserve[otel]``), imported only when an endpoint is configured.
"""

from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING

from splitserve.router.trace import RequestTrace

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

INSTALL_HINT = "OpenTelemetry export needs its packages: pip install 'splitserve[otel]'"


def otlp_exporter(endpoint: str, insecure: bool = True) -> SpanExporter:
    """The OTLP/gRPC span exporter for ``endpoint`` (``host:port`` of a collector)."""
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError as e:
        raise ValueError(f"{INSTALL_HINT} ({e})") from e
    return OTLPSpanExporter(endpoint=endpoint, insecure=insecure)


@functools.cache
def _fork_safe_provider() -> type[TracerProvider]:
    """The SDK's ``TracerProvider`` without its resource re-detection in forked
    children. From opentelemetry-sdk 1.45 a provider re-detects its process's resource
    in every child a fork makes, on a thread pool it joins right there; in a child of
    a threaded process (``subprocess`` with a ``preexec_fn``: how Ray starts its
    processes) that join can spin forever, and the parent waits on the child's
    ``exec``. The router's resource is fixed at construction, so the child only needs
    the fresh lock the SDK gives it."""
    from opentelemetry.sdk.trace import TracerProvider

    class ForkSafeTracerProvider(TracerProvider):
        def _handle_fork(self) -> None:  # the SDK's at-fork hook (1.45+); older SDKs never call it
            self._tracers_lock = threading.Lock()

    return ForkSafeTracerProvider


def _ns(t: float) -> int:
    return int(t * 1e9)


class OtelSink:
    """Exports every finished request's trace as OpenTelemetry spans (see the module docstring)."""

    def __init__(self, exporter: SpanExporter, service_name: str = "splitserve", transfer_backend: str = ""):
        try:
            from opentelemetry import trace as api
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace import StatusCode

            provider = _fork_safe_provider()
        except ImportError as e:
            raise ValueError(f"{INSTALL_HINT} ({e})") from e
        self._api, self._error = api, StatusCode.ERROR
        self.transfer_backend = transfer_backend
        self.provider: TracerProvider = provider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self.provider.get_tracer("splitserve.router")

    def record(self, trace: RequestTrace) -> None:
        api = self._api
        root = self._tracer.start_span(
            "splitserve.request",
            context=api.set_span_in_context(api.INVALID_SPAN),  # a new trace, whatever is current
            start_time=_ns(trace.admitted),
            attributes={
                "splitserve.request_id": trace.request_id,
                "splitserve.outcome": trace.outcome,
                "splitserve.prompt_tokens": trace.prompt_tokens,
                "splitserve.cached_prompt_tokens": trace.cached_prompt_tokens,
                "splitserve.output_tokens": trace.output_tokens,
                "splitserve.prefill_worker": trace.prefill_worker,
                "splitserve.decode_worker": trace.decode_worker,
                "splitserve.kv_bytes": trace.kv_bytes,
            },
        )
        if not trace.ok:
            root.set_status(self._error, trace.outcome)
        parent = api.set_span_in_context(root)
        for span in trace.spans:
            attributes: dict[str, str | int | float] = {"splitserve.worker": span.worker}
            if span.name == "kv_transfer":
                attributes.update(
                    {
                        "splitserve.kv_bytes": trace.kv_bytes,
                        "splitserve.kv_pull_ms": trace.kv_pull_s * 1000,
                        "splitserve.transfer_backend": self.transfer_backend,
                    }
                )
            child = self._tracer.start_span(
                f"splitserve.{span.name}", context=parent, start_time=_ns(span.start), attributes=attributes
            )
            child.end(end_time=_ns(span.end))
        root.end(end_time=_ns(trace.finished))

    def shutdown(self) -> None:
        """Export what is queued (bounded by the SDK's own timeout) and stop the thread."""
        self.provider.shutdown()
