"""Bulk runs: a JSONL dataset in, one result line per row out, through many pipelined jobs.

Scoring: consecutive rows go into score jobs of `rows_per_job` rows (neighbours often share a prefix,
and the worker also batches across queued jobs). Generation: one job per row (a worker decodes many
queued generation jobs together). The submit/collect loop is `bulk_run`'s part; what a row and a job are
is `bulk_kinds`'; files, order and resuming are `bulk_files`'. The clients call in here with a
`BulkTarget`; nothing here imports a client.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from os import PathLike
from pathlib import Path
from typing import Any, TextIO

from .bulk_files import (
    BulkSource,
    BulkSummary,
    OrderedOutput,
    RowReader,
    default_errors_path,
    load_resume,
    restore_order,
)
from .bulk_kinds import BulkKind, GenerateKind, ScoreKind
from .bulk_progress import ProgressLine
from .bulk_run import BulkOptions, BulkRun, BulkTarget

__all__ = ["BulkOptions", "BulkTarget", "generate_dataset", "in_thread", "run_dataset", "score_dataset"]

log = logging.getLogger(__name__)


def run_dataset(
    target: BulkTarget,
    kind: BulkKind,
    source: BulkSource,
    out_path: str | Path,
    errors_path: str | Path | None = None,
    options: BulkOptions | None = None,
    *,
    progress: TextIO | None = None,
    stop: threading.Event | None = None,
) -> BulkSummary:
    """Run every row of `source` as `kind` says into `out_path` (JSONL, input order); failed lines to
    `errors_path`.

    Rerunning with the same output skips rows already in it. Setting `stop` (from another thread or a
    signal handler) ends the run early: outstanding jobs are cancelled, the output stays a clean prefix.
    `progress` is a stream (a terminal) to draw a progress line on.
    """
    options = options or BulkOptions()
    out, errors = _run_paths(source, out_path, errors_path)
    if not 1 <= options.rows_per_job <= kind.max_rows_per_job:
        raise ValueError(f"rows_per_job must be 1..{kind.max_rows_per_job}, got {options.rows_per_job}")
    started = time.monotonic()
    reader = RowReader(source, kind)  # opens the input first: a missing file fails before anything is written
    resume = load_resume(out, errors, options.retry_errors)
    bar = ProgressLine(progress, reader.total)
    rows = (resume.mark(slot) for slot in reader)
    fresh = not out.exists()
    try:
        with open(out, "a", encoding="utf-8") as out_file:
            output = OrderedOutput(out_file, errors, kind)
            run = BulkRun(target, kind, options, rows, output, bar, stop or threading.Event())
            try:
                completed = run.run()
            finally:
                rows.close()
                output.close()
                bar.close(output.counts)
    except BaseException:
        if fresh and out.exists() and out.stat().st_size == 0:
            out.unlink()  # a run that failed before its first row (Redis unreachable) leaves no empty file
        raise
    if completed and resume.done and output.counts.succeeded:
        restore_order(out, reader.first_line)
    c = output.counts
    summary = BulkSummary(
        rows=reader.read if completed or reader.total is None else max(reader.total, reader.read),
        succeeded=c.succeeded,
        failed=c.failed,
        skipped=c.skipped,
        input_tokens=c.input_tokens,
        cached_tokens=c.cached_tokens,
        generated_tokens=c.generated_tokens,
        jobs=run.jobs,
        wall_s=time.monotonic() - started,
        interrupted=not completed,
        out_path=out,
        errors_path=errors,
    )
    _log_done(kind, summary)
    return summary


def _log_done(kind: BulkKind, s: BulkSummary) -> None:
    log.info(
        "bulk done kind=%s rows=%d succeeded=%d failed=%d jobs=%d wall_s=%.2f stopped=%s",
        *(kind.name, s.rows, s.succeeded, s.failed, s.jobs, s.wall_s, s.interrupted),
    )


def _run_paths(source: BulkSource, out_path: str | Path, errors_path: str | Path | None) -> tuple[Path, Path]:
    """The output and errors paths (errors by default beside the output); the input must be neither."""
    out = Path(out_path)
    errors = Path(errors_path) if errors_path is not None else default_errors_path(out)
    paths = [errors.resolve(), out.resolve()]
    if paths[0] == paths[1] or (isinstance(source, str | PathLike) and Path(source).resolve() in paths):
        raise ValueError(f"input, output and errors files must differ (output {out}, errors {errors})")
    return out, errors


def score_dataset(
    target: BulkTarget,
    source: BulkSource,
    out_path: str | Path,
    errors_path: str | Path | None = None,
    options: BulkOptions | None = None,
    *,
    add_special_tokens: bool = True,
    allow_special_tokens: bool = False,
    max_tokens: int | None = None,
    progress: TextIO | None = None,
    stop: threading.Event | None = None,
    batch_format: str = "auto",
) -> BulkSummary:
    """Score rows `{custom_id, prompt, candidates | continuations | rolling | prompt_logprobs}`
    (`run_dataset` with a `ScoreKind`), or OpenAI Batch API lines of completions with `echo`/`logprobs`
    (`batch_format`: `auto` tells them from the file's first line, see `bulk_openai`)."""
    score = ScoreKind(
        add_special_tokens=add_special_tokens,
        allow_special_tokens=allow_special_tokens,
        max_tokens=max_tokens,
    )
    kind: BulkKind = score
    if _openai(source, batch_format):
        from .bulk_openai import OpenAIScoreKind

        kind = OpenAIScoreKind(score)
    return run_dataset(target, kind, source, out_path, errors_path, options, progress=progress, stop=stop)


def _openai(source: BulkSource, batch_format: str) -> bool:
    from .bulk_openai import detect

    return detect(source, batch_format) == "openai"


def generate_dataset(
    target: BulkTarget,
    source: BulkSource,
    out_path: str | Path,
    errors_path: str | Path | None = None,
    options: BulkOptions | None = None,
    *,
    defaults: Mapping[str, Any] | None = None,
    progress: TextIO | None = None,
    stop: threading.Event | None = None,
    batch_format: str = "auto",
) -> BulkSummary:
    """Generate for rows `{custom_id, prompt | messages, ...options}`, one job each (`run_dataset` with
    a `GenerateKind`; `defaults` are options for rows that do not set them), or for OpenAI Batch API
    lines, answered in OpenAI's batch output format (`batch_format`, as for `score_dataset`)."""
    generate = GenerateKind(defaults=dict(defaults or {}))
    kind: BulkKind = generate
    if _openai(source, batch_format):
        from .bulk_openai import OpenAIGenerateKind

        kind = OpenAIGenerateKind(generate)
    options = replace(options or BulkOptions(), rows_per_job=1)
    return run_dataset(target, kind, source, out_path, errors_path, options, progress=progress, stop=stop)


async def in_thread(
    run: Callable[[threading.Event], BulkSummary], stop: threading.Event | None = None
) -> BulkSummary:
    """`run(stop)` (a bulk run: file I/O on a sync connection) in a thread; cancelling the task stops the
    run as `stop` does and waits for it to cancel its outstanding jobs."""
    stop = stop or threading.Event()
    task = asyncio.ensure_future(asyncio.to_thread(run, stop))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        stop.set()
        await asyncio.wait({task})
        if not task.cancelled() and task.exception() is not None:
            log.warning("bulk run failed while stopping error=%s", task.exception())
        raise
