"""A real mlxq worker process for benchmarks: `WorkerService` as `mlxq worker` builds it, plus timers.

Run as `python -m bench.worker_proc --model PATH --queue Q --records FILE [--burst] [--cprofile FILE]`.
Settings come from `MLXQ_*` environment variables exactly as for `mlxq worker`. The only addition is a
timer around the engine's and executor's entry points: each call appends one JSON line to `--records`
(what ran, when, how long, MLX peak memory during it), so the benchmark can split a job's wall time into
engine (MLX) time and everything else (RQ, Redis, pydantic, logging) without guessing.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import json
import os
import pstats
import time
from collections.abc import Callable
from typing import Any, TextIO

import mlx.core as mx

import worker
import worker.generation_jobs as batch_loop_module
from worker.cli import configure_logging
from worker.engine.cache.prefix_cache import PrefixCache
from worker.engine.generate import DecodeBatch
from worker.engine.generation_batch import GenerationBatch
from worker.engine.launcher import Launcher
from worker.engine.scoring import PrefixScorer
from worker.rq_worker import MlxqWorker
from worker.service import WorkerService
from worker.settings import WorkerSettings
from worker.stream_writer import StreamWriter


class Recorder:
    """Appends one JSON object per line to a file, flushed at once (the benchmark reads it live)."""

    def __init__(self, path: str) -> None:
        self._f: TextIO = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record) + "\n")


# Inside a score batch: how the prefix tree was cut (batch-1 shared spans vs batched suffix groups).
_SCORER_PARTS = {"extend": "_extend", "leaf_batches": "_run_leaves"}
_parts: dict[str, float] = {}


def _count_scorer_parts() -> None:
    for key, attr in _SCORER_PARTS.items():
        original = getattr(PrefixScorer, attr)

        def counted(*args: Any, _fn: Any = original, _key: str = key, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                _parts[_key] = _parts.get(_key, 0) + 1
                _parts[_key + "_s"] = _parts.get(_key + "_s", 0.0) + time.perf_counter() - t0

        setattr(PrefixScorer, attr, counted)


# Inside a generation batch (`execute_job` of the batch's first job runs the whole batch): seconds and
# calls of each phase, added up and attached to that `execute_job` record. Nested: `batch_step` holds
# `prefill` (which holds `decode_add`) and `decode_step`; `decode_step` holds `forward`
# (DecodeBatch.step_with: graph building, the launch, the step's `stream_write`, the read-back of the
# step in flight, and the rows' token handling) and rows leaving (`depart`: DecodeBatch.remove, and
# `finish`: each one's result; since `settle` their prefix-cache `offer`s come after `retire`, and
# `offer` counts prefills' offers too, inside `prefill`); `stream_flush` is a sink's own Redis write (since
# `a2c9dc7` only non-deferred writers, and `finish` inside `retire`); `claim` holds `admit` (one call
# per round of claimed jobs, streams opened together). `retire` is the jobs a step ended: their done
# events in one transaction, then RQ's end of each. `stream_write` is `flush_streams`, the step's
# background work (inside `batch_step`): all jobs' due tokens in one pipeline; `stream_entries` counts
# the XADDs it sent (writers whose buffer it took). `graph` (the model's and the sampler's calls:
# building graphs, prefill's too) and `launch` (`async_eval` in `worker.engine.generate`) are inside `forward`
# and `prefill`; `gc` is the garbage collector's time. With a launcher (a GPU) decode steps launch on its
# thread instead: `launcher_launch` is that thread's time in `async_eval` (beside the loop's thread), and
# `launch_wait` the loop thread's waits for it (`Launcher.wait`: inside `forward`, or before a prefill,
# an offer or a score batch); a loop thread that rarely waits is the step's bound, not the launch.
_BATCH_PARTS = {
    "batch_step": (GenerationBatch, "step"),
    "prefill": (GenerationBatch, "_prefill"),
    "decode_add": (DecodeBatch, "add"),
    "decode_step": (GenerationBatch, "_decode_step"),
    "forward": (DecodeBatch, "step_with"),
    "depart": (DecodeBatch, "remove"),
    "finish": (GenerationBatch, "_finish"),
    "settle": (GenerationBatch, "settle"),
    "offer": (PrefixCache, "offer"),
    "stream_flush": (StreamWriter, "flush"),
    "claim": (MlxqWorker, "_claim_between_steps"),
    "admit": (MlxqWorker, "_admit"),
    "retire": (MlxqWorker, "_retire_all"),
    "launch_wait": (Launcher, "wait"),
}
_batch: dict[str, float] = {}


def _time_batch_parts() -> None:
    for key, (owner, attr) in _BATCH_PARTS.items():
        original = getattr(owner, attr)

        def timed(*args: Any, _fn: Any = original, _key: str = key, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                _batch[_key + "_s"] = _batch.get(_key + "_s", 0.0) + time.perf_counter() - t0
                _batch[_key] = _batch.get(_key, 0) + 1

        setattr(owner, attr, timed)

    original_flush = batch_loop_module.flush_streams  # the batch loop's name for it (imported by name)

    def timed_flush(conn: Any, writers: list[StreamWriter], options: Any) -> None:
        t0, mono = time.perf_counter(), time.monotonic()
        try:
            original_flush(conn, writers, options)
        finally:
            _batch["stream_write_s"] = _batch.get("stream_write_s", 0.0) + time.perf_counter() - t0
            _batch["stream_write"] = _batch.get("stream_write", 0) + 1
            taken = sum(1 for w in writers if w._last_flush >= mono)  # `_take` stamps the writers it emptied
            _batch["stream_entries"] = _batch.get("stream_entries", 0) + taken

    batch_loop_module.flush_streams = timed_flush  # type: ignore[assignment]


class _TimedMx:
    """`mlx.core` as `worker.engine.generate` sees it, with `async_eval` timed: inside `forward`, the host's
    launch of a decode step (`launch`), apart from its graph building (`graph`, the model's and the
    sampler's calls) and the wait for the step before it (the rest). As `worker.engine.launcher` sees it, the
    launcher thread's launches (`launcher_launch`)."""

    def __init__(self, module: Any, key: str = "launch") -> None:
        self._module = module
        self._key = key

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def async_eval(self, *args: Any) -> None:
        t0 = time.perf_counter()
        try:
            self._module.async_eval(*args)
        finally:
            _batch[self._key + "_s"] = _batch.get(self._key + "_s", 0.0) + time.perf_counter() - t0
            _batch[self._key] = _batch.get(self._key, 0) + 1


def _time_gc() -> None:
    """Seconds the garbage collector ran (all generations) while a generation batch ran (`gc`)."""
    started: list[float] = []

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            _batch["gc_s"] = _batch.get("gc_s", 0.0) + time.perf_counter() - started.pop()
            _batch["gc"] = _batch.get("gc", 0) + 1

    gc.callbacks.append(callback)


def _time_decode_anatomy(model: Any) -> None:
    """Split `DecodeBatch.step` (and a batched prefill's graph) into graph building and launch."""
    import worker.engine.generate as generate_module
    import worker.engine.launcher as launcher_module
    from worker.engine.sampler import SamplerRows

    for owner, attr in ((type(model), "__call__"), (SamplerRows, "sample")):
        original = getattr(owner, attr)

        def timed(*args: Any, _fn: Any = original, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                _batch["graph_s"] = _batch.get("graph_s", 0.0) + time.perf_counter() - t0
                _batch["graph"] = _batch.get("graph", 0) + 1

        setattr(owner, attr, timed)
    generate_module.mx = _TimedMx(mx)  # type: ignore[assignment]
    launcher_module.mx = _TimedMx(mx, "launcher_launch")  # type: ignore[assignment]


def _timed(recorder: Recorder, name: str, fn: Callable[..., Any], *, memory: bool) -> Callable[..., Any]:
    """`fn` wrapped: wall time (and, for engine calls, MLX peak memory) of each call is recorded."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        active = mx.get_active_memory() if memory else 0
        if memory:
            mx.reset_peak_memory()
        start, t0 = time.time(), time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            rec: dict[str, Any] = {"fn": name, "start": start, "s": time.perf_counter() - t0}
            if memory:
                rec["peak"], rec["active0"] = mx.get_peak_memory(), active
            if name == "score_many":
                rec["jobs"] = len(args[0])
                rec["rows"] = sum(len(rows) for rows in args[0])
                rec.update(_parts)
                _parts.clear()
            if name == "execute_job" and _batch:
                rec["batch"] = dict(_batch)
                _batch.clear()
            recorder.write(rec)

    return wrapper


def instrument(service: WorkerService, recorder: Recorder) -> None:
    """Put timers on the instance methods the worker calls (instance attributes shadow the class's)."""
    engine, executor, worker = service.engine, service.executor, service.worker
    for name in ("generate", "score_tokens_many", "score_many"):
        setattr(engine, name, _timed(recorder, name, getattr(engine, name), memory=True))
    _count_scorer_parts()
    _time_batch_parts()
    _time_decode_anatomy(engine.model)
    _time_gc()
    executor.finish_score = _timed(recorder, "finish_score", executor.finish_score, memory=False)  # type: ignore[method-assign]
    # A score batch ends its jobs with one `finish_scores` call: timed under the same name.
    executor.finish_scores = _timed(recorder, "finish_score", executor.finish_scores, memory=False)  # type: ignore[method-assign]
    worker.execute_job = _timed(recorder, "execute_job", worker.execute_job, memory=False)  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.worker_proc")
    p.add_argument("--model", required=True)
    p.add_argument("--queue", required=True)
    p.add_argument("--redis-url", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--records", required=True, help="JSON-lines file the timers append to")
    p.add_argument("--burst", action="store_true")
    p.add_argument("--cprofile", help="profile the work loop; write the top functions to this file")
    args = p.parse_args(argv)

    settings = WorkerSettings(model=args.model, queues=[args.queue], redis_url=args.redis_url, name=args.name)
    configure_logging(settings.log_level)
    recorder = Recorder(args.records)
    t0 = time.perf_counter()
    service = WorkerService.start(settings)
    instrument(service, recorder)
    recorder.write(
        {
            "event": "ready",
            "start": time.time(),
            "load_s": time.perf_counter() - t0,
            "pid": os.getpid(),
            "device": str(mx.default_device()),
            "worker_src": os.path.dirname(worker.__file__ or ""),
        }
    )
    profiler = cProfile.Profile() if args.cprofile else None
    if profiler is not None:
        profiler.enable()
    try:
        code = service.work(burst=args.burst)
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.cprofile + ".prof")  # for pstats/snakeviz, beside the text
            with open(args.cprofile, "w") as f:
                stats = pstats.Stats(profiler, stream=f)
                stats.sort_stats("tottime").print_stats(25)
                stats.sort_stats("cumulative").print_stats(r"(rq|worker|jobs|redis)/.*\.py", 45)
        cache = service.engine.prefix_cache
        recorder.write(
            {
                "event": "exit",
                "start": time.time(),
                "prefix_cache": cache.stats.as_dict() if cache is not None else None,
            }
        )
    return code


if __name__ == "__main__":
    raise SystemExit(main())
