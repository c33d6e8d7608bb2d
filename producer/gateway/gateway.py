"""The state one gateway process holds (`Gateway`: its Redis client, live models, API keys, metrics)
and what every route uses of it: the API key check, the JSON body under the size limit, the queue a
model's jobs go to, jobs submitted under the key's limit with a streamed answer's context (one round
trip: `submission`) and their results, a failed job as OpenAI's error; and the process's own probes
(`/health`, `/ready`). The routes live beside it: completions (`completion_routes`) and the Batch API
(`batch_routes`); `app` mounts them.
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlxq.jobs import keys as job_keys
from mlxq.jobs.schema import GenerateRequest, GenerateResult, ScoreRequest, ScoreResult

from .. import payload, rq_wire
from ..aio import AsyncClient
from ..errors import JobFailed, RedisFull
from ..settings import ProducerSettings
from . import api_keys, shapes, translate
from . import metrics as gateway_metrics
from .api_keys import ApiKey
from .catalog import Catalog
from .errors import ApiError, bad_request
from .files import FileStore
from .settings import GatewaySettings
from .submission import Submitter

CONTEXT_PREFIX = "mlxq:gw:stream:"
_CLIENT_ERRORS = ("InvalidRequest", "ContextTooLong", "InvalidCandidate")


def context_key(job_id: str) -> str:
    """The hash a streamed job's chunks are built from (`shapes.Context`), for whichever instance."""
    return CONTEXT_PREFIX + job_id


class Gateway:
    """The state one gateway process holds: its Redis client and a short-lived cache of live models.
    Everything else is read from Redis per request, so instances are interchangeable."""

    def __init__(self, settings: GatewaySettings, producer: ProducerSettings) -> None:
        self.settings = settings
        if producer.redis_max_connections is None:
            producer = producer.model_copy(update={"redis_max_connections": settings.redis_connections})
        self.producer = producer
        self._client: AsyncClient | None = None
        self._catalog: Catalog | None = None
        self._submitter: Submitter | None = None
        self.keys = api_keys.KeyCache(settings.key_cache_s)
        self.metrics = gateway_metrics.create()

    @property
    def client(self) -> AsyncClient:
        if self._client is None:
            self._client = AsyncClient(settings=self.producer)
        return self._client

    @property
    def submitter(self) -> Submitter:
        if self._submitter is None:
            self._submitter = Submitter(self.client)
        return self._submitter

    @property
    def catalog(self) -> Catalog:
        if self._catalog is None:
            self._catalog = Catalog(self.client.connection, self.settings.models_cache_s)
        return self._catalog

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    # --- request parts ---------------------------------------------------------------------------

    async def authorize(self, request: Request) -> ApiKey:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(
                401,
                "no API key: send `Authorization: Bearer <key>` (create one with `mlxq api-key create NAME`)",
                code="invalid_api_key",
            )
        key = await self.keys.lookup(self.client.connection, token.strip())
        if key is None:
            raise ApiError(401, "this API key is not valid (unknown or revoked)", code="invalid_api_key")
        return key

    async def body(self, request: Request) -> dict[str, Any]:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        data = bytearray()
        async for part in request.stream():
            data.extend(part)
            if len(data) > limit:
                raise _too_large(limit)
        try:
            body = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad_request(f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise bad_request("the body must be a JSON object")
        return body

    async def route(self, key: ApiKey, model: str) -> str:
        """The queue a request for `model` goes to, among those the key may use."""
        served = await self.catalog.models()
        if model not in served:
            known = ", ".join(sorted(served)) or "none (no live worker)"
            raise ApiError(
                404,
                f"the model {model!r} is not served by any live worker; known models: {known}",
                param="model",
                code="model_not_found",
            )
        if not key.allows_model(model):
            raise ApiError(
                403,
                f"API key {key.name!r} may not use model {model!r}",
                param="model",
                type="permission_error",
                code="model_not_allowed",
            )
        queues = [q for q in served[model].queues if key.allows_queue(q)]
        if not queues:
            raise ApiError(
                403,
                f"API key {key.name!r} may not use the queues that serve {model!r} "
                f"({', '.join(served[model].queues)})",
                param="model",
                type="permission_error",
            )
        if len(queues) == 1:
            return queues[0]
        async with self.client.connection.pipeline(transaction=False) as pipe:
            for q in queues:  # the shortest backlog among the queues that serve it
                pipe.llen(job_keys.rq_queue_key(q))
            lengths = await pipe.execute()
        return queues[lengths.index(min(lengths))]

    async def submit(self, key: ApiKey, t: translate.Translated) -> shapes.Context:
        """Enqueue a job per choice, each counted against the key's limit, with the answer's context (for
        any instance that resumes its stream): one round trip (`submission`)."""
        queue = await self.route(key, t.model)
        jobs = [self._job(key, job_keys.GENERATE_FUNC, r, queue) for r in translate.choice_requests(t)]
        ctx = shapes.Context(
            t.kind,
            jobs[0].id,
            t.model,
            int(time.time()),
            t.include_usage,
            key.digest,
            siblings=tuple(job.id for job in jobs[1:]),
            per_prompt=t.n,
            prompt_chars=tuple(c for c in t.prompt_chars for _ in range(t.n)),
        )
        await self._submit(key, jobs, ctx)
        if self.metrics is not None:
            self.metrics.submitted(t.model, t.kind)
        return ctx

    def _job(
        self, key: ApiKey, func_name: str, request: GenerateRequest | ScoreRequest, queue: str
    ) -> rq_wire.WireJob:
        options = self.client.settings.job_options(meta={"api_key": key.name})
        return self.client.wire_job(func_name, payload.wire_payload(request), options, queue)

    async def _submit(self, key: ApiKey, jobs: list[rq_wire.WireJob], ctx: shapes.Context | None) -> None:
        """Claim and enqueue `jobs`, or answer 429 (the key's limit) or 503 (Redis is full)."""
        limit = key.max_jobs or self.settings.max_jobs_per_key
        where, fields = ("", None) if ctx is None else (context_key(ctx.job_id), ctx.fields())
        try:
            busy = await self.submitter.submit(
                key.digest, limit, jobs, where, fields, self.settings.stream_ttl_s
            )
        except RedisFull as e:
            raise ApiError(503, str(e), type="server_error", code="redis_full") from None
        if busy is not None:
            raise ApiError(
                429,
                f"API key {key.name!r} has {busy} jobs in flight, its limit is {limit}: wait for one to end",
                type="rate_limit_error",
                code="too_many_jobs",
            )

    async def result(self, job_id: str) -> GenerateResult | ScoreResult:
        """A job's result, its failure as OpenAI's error (400 for the request's fault, else 500)."""
        try:
            return await self.client.job(job_id).result(timeout=self.settings.job_timeout_s)
        except JobFailed as e:
            client_error = any(name in e.details for name in _CLIENT_ERRORS)
            raise ApiError(
                400 if client_error else 500,
                str(e),
                type="invalid_request_error" if client_error else "server_error",
                code="job_failed",
                retry=False,  # the job ran and failed: the SDK's automatic retry would run it again
            ) from None
        except TimeoutError as e:
            raise ApiError(
                504,
                f"{e} (the job goes on: its id is {job_id})",
                type="server_error",
                code="timeout",
                retry=False,
            ) from None

    async def scored(self, key: ApiKey, model: str, request: ScoreRequest) -> tuple[str, ScoreResult]:
        """A score job run to its end, counted against the key's jobs in flight."""
        job = self._job(key, job_keys.SCORE_FUNC, request, await self.route(key, model))
        job_id = job.id
        await self._submit(key, [job], None)
        if self.metrics is not None:
            self.metrics.submitted(model, "completion")
        result = await self.result(job_id)
        if not isinstance(result, ScoreResult):
            raise ApiError(500, f"job {job_id} returned no score result", type="server_error")
        return job_id, result

    @property
    def files(self) -> FileStore:
        return FileStore(self.client.connection, self.settings.data_dir)

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        try:
            await self.client.connection.ping()
            served = await self.catalog.models()
        except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
            return JSONResponse({"status": "unavailable", "redis": str(e)}, status_code=503)
        return JSONResponse({"status": "ready", "models": sorted(served)})


def _too_large(limit: int) -> ApiError:
    return ApiError(
        413, f"the request body is over this gateway's limit of {limit} bytes", code="request_too_large"
    )
