"""The bulk commands `score-file` and `generate-file`: a JSONL file in, results in input order out,
resumable; the first Ctrl-C stops submitting and keeps what is complete."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ..bulk_files import BulkSummary
from ..client import Client
from .sampling_options import add_sampling_arguments, sampling_params


def add_parsers(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], after: argparse.ArgumentParser
) -> None:
    """`score-file` and `generate-file`; `after`: the connection options."""
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
    defaults = sampling_params(args)
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


COMMANDS = {"score-file": cmd_score_file, "generate-file": cmd_generate_file}
