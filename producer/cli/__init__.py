"""The `mlxq` command: submit and follow jobs, show queues and workers; `worker`/`import-gguf` need MLX.

Exit codes: 0 ok, 1 the job failed (or was not found, or timed out; for `score-file` and
`generate-file`: some rows failed), 2 usage or connection errors, 130 interrupted (Ctrl-C during
`mlxq generate` cancels the job; during a `-file` command it stops submitting, cancels outstanding jobs
and keeps what is complete).

Each family of commands adds its own parsers and handlers: `job_commands`, `file_commands`,
`worker_commands` (handed elsewhere before parsing) and the gateway's `gateway.cli`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import redis

from mlxq.jobs import errors

from .. import tenant
from ..client import Client
from ..connection import redact_url
from ..errors import JobNotFound
from ..gateway import cli as gateway_cli
from ..settings import ProducerSettings
from . import file_commands, job_commands, worker_commands
from .rendering import print_failure
from .worker_commands import NEEDS_MLX, run_worker_command, split_worker_command

__all__ = ["NEEDS_MLX", "build_parser", "main"]


def _connection_arguments(p: argparse.ArgumentParser, default: Any) -> None:
    p.add_argument("--redis-url", default=default, help="redis://, rediss:// or unix:// URL [MLXQ_REDIS_URL]")
    p.add_argument(
        "--tenant",
        default=default,
        help="this producer's key space: ids and queues `<tenant>_...` [MLXQ_TENANT]",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlxq", description="Submit and follow mlxq jobs.")
    _connection_arguments(parser, None)
    # The same options after the command (`mlxq status --redis-url ...`); given there, they win.
    after = argparse.ArgumentParser(add_help=False)
    _connection_arguments(after, argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)

    job_commands.add_parsers(sub, after)
    file_commands.add_parsers(sub, after)

    acl = sub.add_parser("tenant-acl", help="print the users.acl line of a tenant's producer user")
    acl.add_argument("name", help="the tenant: 1-32 lowercase letters and digits")
    acl.add_argument("--user", help="the ACL user name [the tenant's name]")

    gateway_cli.add_parsers(sub, after)

    worker_commands.add_parsers(sub)
    return parser


COMMANDS = {**job_commands.COMMANDS, **file_commands.COMMANDS}


def _tenant_acl(args: argparse.Namespace) -> int:
    """Print `user <name> on >CHANGE-ME <rules>` for `deploy/redis/users.acl` (needs Redis 7 or later)."""
    try:
        rules = tenant.acl_rules(args.name)
    except ValueError as e:
        print(f"mlxq: {e}", file=sys.stderr)
        return 2
    print(f"user {args.user or args.name} on >CHANGE-ME {rules}")
    print("mlxq: replace CHANGE-ME with the password (or #<sha256>) before loading it", file=sys.stderr)
    return 0


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that flushing it at exit raises no second BrokenPipeError."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    """Run `mlxq` with `argv` (default: the process's arguments); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    delegated = split_worker_command(argv)
    if delegated is not None:
        return run_worker_command(*delegated)
    args = build_parser().parse_args(argv)
    if args.command == "tenant-acl":
        return _tenant_acl(args)
    given = {"redis_url": args.redis_url, "tenant": args.tenant}
    settings = ProducerSettings(**{k: v for k, v in given.items() if v})
    if args.command in ("serve", "api-key"):  # the gateway's, on connections of its own
        return (gateway_cli.serve if args.command == "serve" else gateway_cli.api_key)(settings, args)
    try:
        with Client(settings=settings) as client:
            return COMMANDS[args.command](client, args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `mlxq status | head`: the reader has all it wanted
        _quiet_stdout()
        return 141  # what a shell reports for a program ended by SIGPIPE
    except (redis.ConnectionError, redis.TimeoutError) as e:
        print(f"mlxq: cannot reach Redis at {redact_url(settings.redis_url)}: {e}", file=sys.stderr)
        return 2
    except errors.InvalidRequest as e:
        print(f"mlxq: {e}", file=sys.stderr)
        return 2
    except errors.JobFailed as e:
        return print_failure(e)
    except (JobNotFound, TimeoutError) as e:
        print(f"mlxq: {e}", file=sys.stderr)
        return 1
