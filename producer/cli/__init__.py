"""The `mlxq` command: submit and follow jobs, show queues and workers; `worker`/`import-gguf` need MLX.

Exit codes: 0 ok, 1 the job failed (or was not found, or timed out; for `score-file` and
`generate-file`: some rows failed), 2 usage or connection errors, 130 interrupted (Ctrl-C during
`mlxq generate` cancels the job; during a `-file` command it stops submitting, cancels outstanding jobs
and keeps what is complete).
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
from ..tail import START_ID
from .file_commands import _bulk_arguments, cmd_generate_file, cmd_score_file
from .job_commands import cmd_cancel, cmd_generate, cmd_result, cmd_status, cmd_tail
from .rendering import print_failure
from .sampling_options import add_sampling_arguments
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

    gen = sub.add_parser("generate", parents=[after], help="submit a generation job and stream its text")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    gen.add_argument("--system", help="system message (implies --chat)")
    add_sampling_arguments(gen)
    gen.add_argument("--queue", help="queue name [MLXQ_QUEUE, default: default]")
    gen.add_argument("--timeout", type=float, help="give up (and cancel the job) after this many seconds")
    gen.add_argument("--json", action="store_true", help="print the final result as JSON, not the text")

    tail = sub.add_parser("tail", parents=[after], help="print a job's stream")
    tail.add_argument("job_id")
    tail.add_argument("--from", dest="from_id", default=START_ID, help="resume after this stream id")
    tail.add_argument("--timeout", type=float)
    tail.add_argument("--json", action="store_true", help="one JSON object per event, with its id")

    status = sub.add_parser("status", parents=[after], help="queues and workers")
    status.add_argument("--queue", action="append", dest="queues", help="only this queue (repeatable)")
    status.add_argument("--json", action="store_true")

    cancel = sub.add_parser(
        "cancel", parents=[after], help="cancel a job (queued: never runs; running: stops)"
    )
    cancel.add_argument("job_id")

    result = sub.add_parser("result", parents=[after], help="wait for a job's result and print it as JSON")
    result.add_argument("job_id")
    result.add_argument("--timeout", type=float)

    score = sub.add_parser(
        "score-file", parents=[after], help="score a JSONL file of rows in bulk (resumable)"
    )
    score.add_argument(
        "input",
        help='JSONL: {"custom_id": ..., "prompt": ..., "candidates": [...]} per line; or OpenAI Batch API '
        "lines of POST /v1/completions with echo/logprobs",
    )
    score.add_argument("--rows-per-job", type=int, default=16, help="rows per score job (1..64) [16]")
    score.add_argument(
        "--max-tokens",
        type=int,
        help="each row's tokens through the model must be 1..N (never truncated) [the model's context]",
    )
    score.add_argument(
        "--allow-special-tokens",
        action="store_true",
        help="encode special-token text in the rows as control tokens (default: as plain text)",
    )
    _bulk_arguments(score)

    gen_file = sub.add_parser(
        "generate-file", parents=[after], help="generate for a JSONL file of prompts in bulk (resumable)"
    )
    gen_file.add_argument(
        "input",
        help='JSONL: {"custom_id": ..., "prompt": ... | "messages": [...], options...} per line; '
        "or OpenAI Batch API request lines; a line's own options win over the flags",
    )
    add_sampling_arguments(gen_file)
    _bulk_arguments(gen_file)

    acl = sub.add_parser("tenant-acl", help="print the users.acl line of a tenant's producer user")
    acl.add_argument("name", help="the tenant: 1-32 lowercase letters and digits")
    acl.add_argument("--user", help="the ACL user name [the tenant's name]")

    gateway_cli.add_parsers(sub, after)

    # Listed for --help only: main() hands these to worker.cli before parsing.
    sub.add_parser("worker", help="run a worker (needs MLX; see `mlxq worker --help`)", add_help=False)
    sub.add_parser("import-gguf", help="convert a GGUF file to a model folder (needs MLX)", add_help=False)
    sub.add_parser(
        "eval",
        help="run lm-evaluation-harness with `--model mlxq` through the queue (the `eval` extra); "
        "every lm-eval flag is passed through",
        add_help=False,
    )
    return parser


COMMANDS = {
    "generate": cmd_generate,
    "tail": cmd_tail,
    "status": cmd_status,
    "cancel": cmd_cancel,
    "result": cmd_result,
    "score-file": cmd_score_file,
    "generate-file": cmd_generate_file,
}


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
