"""The gateway's ASGI app (Starlette): its routes mounted over one `Gateway` (completions:
`completion_routes`; the Batch API: `batch_routes`), each answering its errors in OpenAI's shape and
counted in the metrics, and the lifespan.

Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`, `GET /v1/streams/{id}`
(resume a stream: `Last-Event-ID`), OpenAI's Batch API (`/v1/files`, `/v1/batches`: `batch_routes`,
`batches`, `batch_runner`), `GET /health` (the process answers), `GET /ready` (Redis answers), `GET /metrics`
(Prometheus, with the `metrics` extra). The lifespan runs
the batch runner: every instance takes up open batches nobody runs.
Every `/v1/` route needs an API key (`Authorization: Bearer sk-mlxq-...`); no key, no job.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import redis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..errors import JobNotFound
from ..settings import ProducerSettings
from .batch_routes import BatchRoutes
from .batch_runner import BatchRunner
from .completion_routes import CompletionRoutes
from .errors import ApiError
from .gateway import Gateway
from .metrics import NOT_INSTALLED, GatewayMetrics
from .settings import GatewaySettings

log = logging.getLogger(__name__)


def _answer(handler: Any) -> Any:
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)  # type: ignore[no-any-return]
        except ApiError as e:
            return e.response()
        except JobNotFound as e:
            return ApiError(404, str(e), code="job_not_found").response()
        except (redis.ConnectionError, redis.TimeoutError) as e:
            log.warning("redis unreachable error=%s", e)
            return ApiError(503, f"the queue's Redis is unreachable: {e}", type="server_error").response()

    return endpoint


def _measured(name: str, handler: Any, metrics: GatewayMetrics | None) -> Any:
    """`handler` with errors answered in OpenAI's shape, counted in the metrics as route `name`."""
    endpoint = _answer(handler)
    if metrics is None:
        return endpoint

    async def measured(request: Request) -> Response:
        t0 = time.perf_counter()
        response: Response = await endpoint(request)
        metrics.observe(name, response.status_code, time.perf_counter() - t0)
        return response

    return measured


def create_app(
    settings: GatewaySettings | None = None, producer: ProducerSettings | None = None
) -> Starlette:
    gateway = Gateway(settings or GatewaySettings(), producer or ProducerSettings())
    completion_routes = CompletionRoutes(gateway)
    batch_routes = BatchRoutes(gateway)
    metrics = gateway.metrics

    async def chat(request: Request) -> Response:
        return await completion_routes.generate(request, "chat")

    async def completions(request: Request) -> Response:
        return await completion_routes.generate(request, "completion")

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        runner = BatchRunner(gateway.client, gateway.files, gateway.settings)
        looking = asyncio.create_task(runner.run_forever())
        yield
        looking.cancel()
        await runner.aclose()
        await gateway.aclose()

    async def metrics_page(request: Request) -> Response:
        if metrics is None:
            return JSONResponse(NOT_INSTALLED, status_code=404)
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    def route(path: str, name: str, handler: Any, method: str) -> Route:
        return Route(path, _measured(name, handler, metrics), methods=[method])

    routes = [
        route("/v1/chat/completions", "chat", chat, "POST"),
        route("/v1/completions", "completions", completions, "POST"),
        route("/v1/models", "models", completion_routes.models, "GET"),
        route("/v1/streams/{completion_id}", "resume", completion_routes.resume, "GET"),
        route("/v1/files", "upload", batch_routes.upload, "POST"),
        route("/v1/files", "files", batch_routes.list_files, "GET"),
        route("/v1/files/{file_id}", "delete_file", batch_routes.delete_file, "DELETE"),
        route("/v1/files/{file_id}", "file", batch_routes.file_info, "GET"),
        route("/v1/files/{file_id}/content", "file_content", batch_routes.file_content, "GET"),
        route("/v1/batches", "create_batch", batch_routes.create_batch, "POST"),
        route("/v1/batches", "list_batches", batch_routes.list_batches, "GET"),
        route("/v1/batches/{batch_id}", "batch", batch_routes.get_batch, "GET"),
        route("/v1/batches/{batch_id}/cancel", "cancel_batch", batch_routes.cancel_batch, "POST"),
        Route("/health", gateway.health, methods=["GET"]),
        Route("/ready", gateway.ready, methods=["GET"]),
        Route("/metrics", metrics_page, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.gateway = gateway
    return app
