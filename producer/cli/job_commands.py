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
from .rendering import format_stats, print_failure, print_json, render_stream
from .sampling_options import sampling_params


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
