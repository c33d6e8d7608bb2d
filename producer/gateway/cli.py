"""`mlxq serve` (run the gateway under uvicorn) and `mlxq api-key` (create, list, revoke keys)."""

from __future__ import annotations

import argparse
import gc
import json
import sys

from ..settings import ProducerSettings
from . import api_keys

# Objects the collector's youngest generation may gain before it runs (CPython's default is 700): a
# submission leaves a few dozen container objects alive for a while (its tasks, futures, the relay's
# read in flight), so at the default the collector runs every few dozen submissions and walks the
# same short-lived objects again and again. Higher costs about as much in all, in longer pauses.
GC_YOUNG_OBJECTS = 10_000

NEEDS_GATEWAY = (
    "mlxq: the gateway needs its extra (starlette, uvicorn): pip install '.[gateway]' in the mlxq repository"
)


def add_parsers(sub: argparse._SubParsersAction, after: argparse.ArgumentParser) -> None:  # type: ignore[type-arg]
    serve = sub.add_parser("serve", parents=[after], help="run the OpenAI-compatible HTTP gateway")
    serve.add_argument("--host", help="address to listen on [MLXQ_GATEWAY_HOST, 127.0.0.1]")
    serve.add_argument("--port", type=int, help="port [MLXQ_GATEWAY_PORT, 8000]")
    serve.add_argument("--max-body-bytes", type=int, help="largest request body (413 above) [4 MiB]")
    serve.add_argument("--max-jobs-per-key", type=int, help="jobs in flight per API key (429 above) [16]")
    serve.add_argument("--log-level", default="info")
    serve.add_argument(
        "--no-access-log",
        dest="access_log",
        action="store_false",
        default=None,
        help="no line per request (a tenth of a submission's CPU; /metrics counts requests) "
        "[MLXQ_GATEWAY_ACCESS_LOG, on]",
    )

    key = sub.add_parser("api-key", parents=[after], help="create, list or revoke the gateway's API keys")
    actions = key.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="create a key; its secret is printed once")
    create.add_argument("name")
    create.add_argument("--model", action="append", dest="models", help="only this model (repeatable)")
    create.add_argument("--queue", action="append", dest="queues", help="only this queue (repeatable)")
    create.add_argument("--max-jobs", type=int, help="jobs in flight at once [the gateway's limit]")
    revoke = actions.add_parser("revoke", help="revoke the key named NAME (on every gateway at once)")
    revoke.add_argument("name")
    actions.add_parser("list", help="the keys' names and limits (never their secrets)")


def api_key(settings: ProducerSettings, args: argparse.Namespace) -> int:
    from ..connection import connect

    conn = connect(settings.redis_url, settings)
    try:
        if args.action == "create":
            try:
                token, key = api_keys.create(
                    conn, args.name, models=args.models, queues=args.queues, max_jobs=args.max_jobs
                )
            except ValueError as e:
                print(f"mlxq: {e}", file=sys.stderr)
                return 2
            print(token)
            print(f"created API key {key.name!r}; its secret above is shown only now", file=sys.stderr)
            return 0
        if args.action == "revoke":
            if not api_keys.revoke(conn, args.name):
                print(f"mlxq: no API key named {args.name!r}", file=sys.stderr)
                return 1
            return 0
        for k in api_keys.listed(conn):
            print(
                json.dumps(
                    {
                        "name": k.name,
                        "models": list(k.models),
                        "queues": list(k.queues),
                        "max_jobs": k.max_jobs,
                        "created": k.created,
                    }
                )
            )
        return 0
    finally:
        conn.close()


def serve(settings: ProducerSettings, args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from .app import create_app
        from .settings import GatewaySettings
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in ("starlette", "uvicorn"):
            raise
        print(NEEDS_GATEWAY, file=sys.stderr)
        return 2
    given = {
        "host": args.host,
        "port": args.port,
        "max_body_bytes": args.max_body_bytes,
        "max_jobs_per_key": args.max_jobs_per_key,
        "access_log": args.access_log,
    }
    gateway = GatewaySettings(**{k: v for k, v in given.items() if v is not None})
    app = create_app(gateway, settings)
    _settle_gc()
    uvicorn.run(
        app,
        host=gateway.host,
        port=gateway.port,
        log_level=args.log_level,
        access_log=gateway.access_log,
        timeout_graceful_shutdown=5,
    )
    return 0


def _settle_gc() -> None:
    """Set the collector for a long-running server: what exists once the app is built (modules, models'
    schemas, the app itself) lives as long as the process, so it is frozen out of every later collection
    (a full one walked all of it again), and the young generation is allowed more objects before each
    collection (`GC_YOUNG_OBJECTS`)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_OBJECTS, *gc.get_threshold()[1:])
