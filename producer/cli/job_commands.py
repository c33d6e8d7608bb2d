"""`generate`, `tail`, `cancel` and `result`, one job each; and `status`, the queues and workers jobs go
through."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from mlxq.jobs.schema import DoneEvent, ErrorEvent, GenerateResult, ScoreResult

from .. import status_report
from ..client import Client, JobHandle
from ..errors import JobFailed
from ..job_state import CancelOutcome
from ..tail import START_ID
from .rendering import format_stats, print_failure, print_json, render_stream
from .sampling_options import add_sampling_arguments, sampling_params


def add_parsers(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], after: argparse.ArgumentParser
) -> None:
    """`generate`, `tail`, `status`, `cancel`, `result`; `after`: the connection options."""
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


def _generate_params(args: argparse.Namespace) -> dict[str, Any]:
    params = sampling_params(args)
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
                return print_failure(JobFailed(handle.id, end.event.message))
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
        print_json(result.model_dump(mode="json"), sys.stdout)
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
            return print_failure(JobFailed(handle.id, end.event.message))
        if isinstance(end.event, DoneEvent):
            print(f"finish={end.event.finish_reason} tokens={end.event.completion_tokens}", file=sys.stderr)
    return 0


def cmd_status(client: Client, args: argparse.Namespace) -> int:
    report = client.retry.call(status_report.collect, client.connection, args.queues)
    if args.json:
        print_json(report.as_dict(), sys.stdout)
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
    print_json(handle.result(timeout=args.timeout).model_dump(mode="json"), sys.stdout)
    return 0


COMMANDS = {
    "generate": cmd_generate,
    "tail": cmd_tail,
    "status": cmd_status,
    "cancel": cmd_cancel,
    "result": cmd_result,
}
