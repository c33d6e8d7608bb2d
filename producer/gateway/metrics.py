"""The gateway's own Prometheus metrics (`GET /metrics`), beside the workers' (`worker/metrics.py`).

Requests answered by route and status, the time to answer (to the headers, for a stream), and jobs
enqueued by model and kind. Served when prometheus-client (the `metrics` extra) is installed; each app
keeps its own registry, so several apps in one process (tests) never share counters.
"""

from __future__ import annotations

from typing import Any


class GatewayMetrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter(
            "mlxq_gateway_requests", "HTTP requests answered", ["route", "status"], registry=self.registry
        )
        self.seconds = Histogram(
            "mlxq_gateway_request_seconds",
            "seconds to answer a request (to the response headers, for a stream)",
            ["route"],
            buckets=(0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0, 30.0),
            registry=self.registry,
        )
        self.jobs = Counter(
            "mlxq_gateway_jobs_submitted",
            "jobs enqueued by this gateway",
            ["model", "kind"],
            registry=self.registry,
        )

    def observe(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route, str(status)).inc()
        self.seconds.labels(route).observe(seconds)

    def submitted(self, model: str, kind: str) -> None:
        self.jobs.labels(model, kind).inc()

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def create() -> GatewayMetrics | None:
    """Metrics if prometheus-client is installed, else None (then `/metrics` says how to get them)."""
    try:
        import prometheus_client  # noqa: F401
    except ModuleNotFoundError:
        return None
    return GatewayMetrics()


NOT_INSTALLED: dict[str, Any] = {
    "error": {
        "message": "metrics need prometheus-client: pip install prometheus-client",
        "type": "not_found",
        "param": None,
        "code": None,
    }
}
