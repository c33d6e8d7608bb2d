"""The `mlxq` command: submit and follow jobs, show queues and workers; `worker`/`import-gguf` need MLX.

Exit codes: 0 ok, 1 the job failed (or was not found, or timed out; for `score-file` and
`generate-file`: some rows failed), 2 usage or connection errors, 130 interrupted (Ctrl-C during
`mlxq generate` cancels the job; during a `-file` command it stops submitting, cancels outstanding jobs
and keeps what is complete).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

import redis

from mlxq.jobs import errors
from mlxq.jobs.schema import DoneEvent, ErrorEvent, GenerateResult, RestartEvent, ScoreResult, TokenEvent

from . import status_report, tenant
from .bulk_files import BulkSummary
from .client import Client, JobHandle
from .connection import redact_url
from .errors import JobFailed, JobNotFound
from .gateway import cli as gateway_cli
from .job_state import CancelOutcome
from .settings import ProducerSettings
from .tail import START_ID, StreamItem

WORKER_COMMANDS = ("worker", "import-gguf", "eval")
NEEDS_MLX = (
    "mlxq: the worker needs MLX: in the mlxq repository (or with its wheel), pip install '.[cpu]' on Linux, "
    "'.[worker]' on macOS (README: Install)"
)


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
    _sampling_arguments(gen)
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
    _sampling_arguments(gen_file)
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


def _sampling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--min-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument(
        "--max-draft-tokens",
        type=int,
        help="speculative decoding: at most this many draft tokens a step (0: off) [the worker's policy]",
    )
    p.add_argument(
        "--logprobs",
        type=int,
        metavar="K",
        help="report each generated token's log-probability with its K likeliest alternatives (0..20) "
        "in the result and the stream",
    )
    p.add_argument(
        "--allow-special-tokens",
        action="store_true",
        default=None,
        help="encode special-token text in a raw prompt as control tokens (default: as plain text)",
    )
    shape = p.add_mutually_exclusive_group()  # a request carries one constraint (`response_format`)
    shape.add_argument(
        "--json-schema",
        dest="response_format",
        type=_json_schema_file,
        metavar="FILE",
        help="constrain the output to JSON valid under this JSON Schema file (or an OpenAI "
        "response_format object of type json_schema)",
    )
    shape.add_argument(
        "--json-object",
        dest="response_format",
        action="store_const",
        const={"type": "json_object"},
        help="constrain the output to a JSON object",
    )
    shape.add_argument(
        "--regex",
        dest="response_format",
        type=lambda r: {"type": "regex", "regex": r},
        metavar="REGEX",
        help="constrain the output to text matching REGEX whole",
    )
    shape.add_argument(
        "--grammar",
        dest="response_format",
        type=_grammar_file,
        metavar="FILE",
        help="constrain the output to this Lark grammar (llguidance's dialect; rule `start`)",
    )


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {e}") from e


def _json_schema_file(path: str) -> dict[str, Any]:
    """A `response_format` from a JSON Schema file (wrapped, named after the file) or from a file
    holding a whole `{"type": "json_schema", "json_schema": {...}}` object."""
    try:
        value = json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{path} is not JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{path} holds no JSON Schema object")
    if value.get("type") == "json_schema":
        return value
    return {
        "type": "json_schema",
        "json_schema": {"name": Path(path).stem[:64] or "response", "schema": value},
    }


def _grammar_file(path: str) -> dict[str, Any]:
    return {"type": "grammar", "grammar": _read_text(path)}


def _bulk_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", required=True, help="JSONL results, in input order (appended to)")
    p.add_argument("--errors", help="JSONL of failed lines and why [default: <output>.errors.jsonl]")
    p.add_argument("--in-flight", type=int, default=64, help="most jobs outstanding at once [64]")
    p.add_argument("--queue", help="queue name [MLXQ_QUEUE, default: default]")
    p.add_argument(
        "--no-retry-errors", action="store_true", help="on a rerun, skip lines already in the errors file"
    )
    p.add_argument("--progress", action="store_true", help="draw progress even when not on a terminal")
    p.add_argument(
        "--format",
        choices=("auto", "mlxq", "openai"),
        default="auto",
        help="mlxq rows, or OpenAI Batch API lines in and OpenAI batch output lines out "
        "[auto: from the input's first line]",
    )


# --- rendering -------------------------------------------------------------------------------------


def format_stats(result: GenerateResult) -> str:
    """One line of figures for a person: finish reason, token counts, ttft, decode speed."""
    u, t = result.usage, result.timings
    ttft = f"{t.ttft_s:.3f}s" if t.ttft_s is not None else "-"
    speed = f"{t.decode_tokens_per_s:.1f}" if t.decode_tokens_per_s is not None else "-"
    drafted = f" draft_tokens={u.draft_tokens} accepted_tokens={u.accepted_tokens}" if u.draft_tokens else ""
    return (
        f"finish={result.finish_reason} prompt_tokens={u.prompt_tokens} "
        f"completion_tokens={u.completion_tokens} cached_tokens={u.cached_tokens}{drafted} "
        f"ttft={ttft} tokens/s={speed} total={t.total_s:.3f}s"
    )


def render_stream(items: Iterable[StreamItem], out: TextIO, err: TextIO) -> StreamItem | None:
    """Write token text to `out` as it arrives, restarts to `err`; return the terminal item, if any."""
    last: StreamItem | None = None
    for item in items:
        last = item
        event = item.event
        if isinstance(event, TokenEvent):
            out.write(event.text)
            out.flush()
        elif isinstance(event, RestartEvent):
            err.write(f"\n[job retried: attempt {event.attempt}, text starts over]\n")
            err.flush()
    if last is not None and last.terminal:
        out.write("\n")
        out.flush()
        return last
    return None


def _print_json(value: Any, out: TextIO) -> None:
    """JSON for a person: objects indented, a list of numbers or strings on one line (token ids)."""
    out.write(_json_text(value, "") + "\n")


def _json_text(value: Any, indent: str) -> str:
    inner = indent + "  "
    if isinstance(value, dict) and value:
        items = (
            f"{inner}{json.dumps(k, ensure_ascii=False)}: {_json_text(v, inner)}" for k, v in value.items()
        )
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(value, list) and any(isinstance(v, dict | list) for v in value):
        return "[\n" + ",\n".join(inner + _json_text(v, inner) for v in value) + "\n" + indent + "]"
    return json.dumps(value, ensure_ascii=False)


# --- commands --------------------------------------------------------------------------------------


def _sampling_params(args: argparse.Namespace) -> dict[str, Any]:
    given = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "seed": args.seed,
        "stop": args.stop,
        "max_draft_tokens": args.max_draft_tokens,
        "logprobs": args.logprobs,
        "allow_special_tokens": args.allow_special_tokens,
        "response_format": args.response_format,
    }
    return {k: v for k, v in given.items() if v is not None}


def _generate_params(args: argparse.Namespace) -> dict[str, Any]:
    params = _sampling_params(args)
    if args.chat or args.system is not None:
        system = [{"role": "system", "content": args.system}] if args.system is not None else []
        params["messages"] = [*system, {"role": "user", "content": args.prompt}]
    else:
        params["prompt"] = args.prompt
    return params


def cmd_generate(client: Client, args: argparse.Namespace) -> int:
    params = _generate_params(args)
    handle = client.submit_generate(queue=args.queue, **params)
    print(f"job {handle.id}", file=sys.stderr)
    try:
        if args.json:
            result = handle.result(timeout=args.timeout)
        else:
            end = render_stream(handle.stream(timeout=args.timeout), sys.stdout, sys.stderr)
            if end is not None and isinstance(end.event, ErrorEvent):
                return _failed(JobFailed(handle.id, end.event.message))
            result = handle.result(timeout=args.timeout)
    except KeyboardInterrupt:
        outcome = handle.cancel()
        print(f"\nmlxq: interrupted; job {handle.id} cancel: {outcome.value}", file=sys.stderr)
        return 130
    except TimeoutError as e:
        outcome = handle.cancel()
        print(f"mlxq: {e}; job cancel: {outcome.value}", file=sys.stderr)
        return 1
    if args.json:
        _print_json(result.model_dump(mode="json"), sys.stdout)
    print(format_stats(result), file=sys.stderr)
    return 0


def cmd_tail(client: Client, args: argparse.Namespace) -> int:
    handle = client.job(args.job_id)
    items = handle.stream(from_id=args.from_id, timeout=args.timeout)
    if args.json:
        for item in items:
            print(json.dumps({"id": item.stream_id, **item.event.model_dump(mode="json")}), flush=True)
            if isinstance(item.event, ErrorEvent):
                return 1
        return 0
    end = render_stream(items, sys.stdout, sys.stderr)
    if end is not None:
        print(f"[last id {end.stream_id}]", file=sys.stderr)
        if isinstance(end.event, ErrorEvent):
            return _failed(JobFailed(handle.id, end.event.message))
        if isinstance(end.event, DoneEvent):
            print(f"finish={end.event.finish_reason} tokens={end.event.completion_tokens}", file=sys.stderr)
    return 0


def cmd_status(client: Client, args: argparse.Namespace) -> int:
    report = client.retry.call(status_report.collect, client.connection, args.queues)
    if args.json:
        _print_json(report.as_dict(), sys.stdout)
    else:
        print(status_report.render(report))
    return 0


def cmd_cancel(client: Client, args: argparse.Namespace) -> int:
    outcome = client.job(args.job_id).cancel()
    messages = {
        CancelOutcome.CANCELED: "canceled before it ran",
        CancelOutcome.REQUESTED: "running: asked the worker to stop it",
        CancelOutcome.ALREADY_OVER: "already over: nothing to cancel",
        CancelOutcome.MISSING: "no such job",
    }
    print(f"job {args.job_id}: {messages[outcome]}")
    return 0 if outcome in (CancelOutcome.CANCELED, CancelOutcome.REQUESTED) else 1


def cmd_result(client: Client, args: argparse.Namespace) -> int:
    handle: JobHandle[GenerateResult | ScoreResult] = client.job(args.job_id)
    _print_json(handle.result(timeout=args.timeout).model_dump(mode="json"), sys.stdout)
    return 0


def cmd_score_file(client: Client, args: argparse.Namespace) -> int:
    """Exit 0 when every row is in the output, 1 when some failed, 130 when stopped by Ctrl-C."""
    return _bulk_run(
        args,
        lambda common: client.score_dataset(
            args.input,
            args.output,
            rows_per_job=args.rows_per_job,
            allow_special_tokens=args.allow_special_tokens,
            max_tokens=args.max_tokens,
            batch_format=args.format,
            **common,
        ),
    )


def cmd_generate_file(client: Client, args: argparse.Namespace) -> int:
    """Exit codes as `score-file`'s."""
    defaults = _sampling_params(args)
    return _bulk_run(
        args,
        lambda common: client.generate_dataset(
            args.input, args.output, batch_format=args.format, **common, **defaults
        ),
    )


def _bulk_run(args: argparse.Namespace, run: Callable[[dict[str, Any]], BulkSummary]) -> int:
    """A `-file` command: the first Ctrl-C stops it cleanly; the summary goes to stderr."""
    stop = threading.Event()
    progress = sys.stderr if args.progress or sys.stderr.isatty() else None
    common = {
        "errors_path": args.errors,
        "queue": args.queue,
        "in_flight": args.in_flight,
        "retry_errors": not args.no_retry_errors,
        "progress": progress,
        "stop": stop,
    }
    with _first_sigint_stops(stop):
        try:
            summary = run(common)
        except (OSError, ValueError) as e:
            print(f"mlxq: {e}", file=sys.stderr)
            return 2
    print(summary.render(), file=sys.stderr)
    if summary.interrupted:
        return 130
    return 1 if summary.failed else 0


@contextlib.contextmanager
def _first_sigint_stops(stop: threading.Event) -> Iterator[None]:
    """While inside, the first Ctrl-C sets `stop` (a clean stop); the second one interrupts at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigint(signum: int, frame: object) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        print("\nmlxq: stopping: cancelling outstanding jobs (Ctrl-C again to quit now)", file=sys.stderr)

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


COMMANDS = {
    "generate": cmd_generate,
    "tail": cmd_tail,
    "status": cmd_status,
    "cancel": cmd_cancel,
    "result": cmd_result,
    "score-file": cmd_score_file,
    "generate-file": cmd_generate_file,
}


# --- entry point -----------------------------------------------------------------------------------


def _failed(e: errors.JobFailed) -> int:
    print(f"mlxq: job {e.job_id} failed: {e.reason}", file=sys.stderr)
    return 1


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


def _split_worker_command(argv: list[str]) -> tuple[list[str], str | None] | None:
    """`[worker|import-gguf, ...]` and the global --redis-url, if argv runs one of those; else None."""
    i, redis_url = 0, None
    while i < len(argv) and argv[i].startswith("-"):
        if argv[i] == "--redis-url" and i + 1 < len(argv):
            redis_url, i = argv[i + 1], i + 2
            continue
        if argv[i].startswith("--redis-url="):
            redis_url = argv[i].split("=", 1)[1]
        i += 1
    if i < len(argv) and argv[i] in WORKER_COMMANDS:
        return argv[i:], redis_url
    return None


def run_eval_command(argv: list[str], redis_url: str | None) -> int:
    """Hand `mlxq eval ...` to lm-eval's command line with the `mlxq` model registered
    (`producer.lm_eval_model`); the global --redis-url is the model's default Redis."""
    if redis_url is not None:
        os.environ["MLXQ_REDIS_URL"] = redis_url
    try:
        module = importlib.import_module("mlxq.producer.lm_eval_model")
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "lm_eval":
            raise
        print(
            "mlxq: `mlxq eval` needs lm-evaluation-harness: pip install lm-eval==0.4.13 (or, in the mlxq "
            "repository, pip install '.[eval]')",
            file=sys.stderr,
        )
        return 2
    return int(module.run_eval(argv[1:]))


def run_worker_command(argv: list[str], redis_url: str | None) -> int:
    """Hand `mlxq worker ...`/`mlxq import-gguf ...` to `worker.cli`, imported only now (it needs MLX)."""
    if argv[0] == "eval":
        return run_eval_command(argv, redis_url)
    if redis_url is not None and argv[0] == "worker" and "--redis-url" not in argv:
        argv = [*argv, "--redis-url", redis_url]
    try:
        module = importlib.import_module("mlxq.worker.cli")
        return int(module.main(argv))
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "mlx":
            raise
        print(NEEDS_MLX, file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """Run `mlxq` with `argv` (default: the process's arguments); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    delegated = _split_worker_command(argv)
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
        return _failed(e)
    except (JobNotFound, TimeoutError) as e:
        print(f"mlxq: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
