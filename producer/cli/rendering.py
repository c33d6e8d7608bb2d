"""What the `mlxq` commands show a person: a generation's figures, a stream's text, JSON, a failed job."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from typing import Any, TextIO

from mlxq.jobs import errors
from mlxq.jobs.schema import GenerateResult, RestartEvent, TokenEvent

from ..tail import StreamItem


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


def print_json(value: Any, out: TextIO) -> None:
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


def print_failure(e: errors.JobFailed) -> int:
    """Say why a job failed; its exit code, 1."""
    print(f"mlxq: job {e.job_id} failed: {e.reason}", file=sys.stderr)
    return 1
