"""A real mlxq worker process for benchmarks: `WorkerService` started as `mlxq worker` starts it, plus timers.

Run as `python -m bench.worker_proc --model PATH --queue Q --redis-url URL --name N --records FILE
[--burst] [--cprofile FILE]`. Settings come from `MLXQ_*` environment variables as for `mlxq worker`.

Timers sit on the engine's entry points and on the stream writes only, never inside the service (which
may be rebuilt freely): one JSON line per call of `Engine.generate`, `Engine.score_tokens_many`,
`Engine.score_many` and `stream_writer.finish_streams` goes to `--records`, so the benchmark can split a
job's wall time into MLX time and the rest (RQ, Redis, pydantic, logging). Calls made once per decode
step (`GenerationBatch.step` and `admit`, `flush_streams`) and `PrefixScorer.score` are added up
and attached to the next `finish_streams` or `score_many` record, so a long batch writes no line per
step. Records of engine calls and of `finish_streams` carry MLX's peak memory since the last such record.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import os
import pstats
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

import mlx.core as mx
from redis.connection import AbstractConnection

from mlxq import worker
from mlxq.worker import stream_scripts, stream_writer
from mlxq.worker.cli import configure_logging
from mlxq.worker.engine import Engine
from mlxq.worker.engine.generation_batch import GenerationBatch
from mlxq.worker.engine.scoring import PrefixScorer
from mlxq.worker.settings import WorkerSettings


class Recorder:
    """Appends one JSON object per line to a file, flushed at once (the benchmark reads it live)."""

    def __init__(self, path: str) -> None:
        self._f: TextIO = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
        self.summed: dict[str, float] = {}  # per-step calls, added up until the next record
        self.active0 = 0

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record) + "\n")

    def reset_peak(self) -> None:
        mx.reset_peak_memory()
        self.active0 = mx.get_active_memory()


def _timed(recorder: Recorder, name: str, fn: Callable[..., Any], attach: bool) -> Callable[..., Any]:
    """`fn` wrapped: each call's wall time, MLX peak memory and the per-step sums go to one record."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start, t0 = time.time(), time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            rec: dict[str, Any] = {"fn": name, "start": start, "s": time.perf_counter() - t0}
            rec["peak"], rec["active0"] = mx.get_peak_memory(), recorder.active0
            if name == "score_many":
                rec["jobs"], rec["rows"] = len(args[1]), sum(len(rows) for rows in args[1])
            if name == "finish_streams":
                rec["jobs"] = len(args[1])
            if attach and recorder.summed:
                rec["phases"], recorder.summed = recorder.summed, {}
            recorder.write(rec)
            recorder.reset_peak()

    return wrapper


def _summed(recorder: Recorder, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` wrapped: seconds and calls added to `recorder.summed[name + "_s"]` and `[name]`."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sums = recorder.summed
            sums[name + "_s"] = sums.get(name + "_s", 0.0) + time.perf_counter() - t0
            sums[name] = sums.get(name, 0) + 1

    return wrapper


class SentCommands:
    """Redis commands the worker process sends, by name, counted at the client: a script call counts
    one (the server's `INFO commandstats` counts it and every command it runs), a pipeline's commands
    one each. redis-py sends a single command through `send_command` and a pipeline's through
    `pack_commands`; both are wrapped on the connection class."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, args: Any) -> None:
        name = args[0].decode() if isinstance(args[0], bytes) else str(args[0])
        name = name.split()[0].lower()  # "SCRIPT LOAD" is sent as one argument by some calls
        with self._lock:
            self.counts[name] = self.counts.get(name, 0) + 1

    def install(self) -> None:
        send, pack = AbstractConnection.send_command, AbstractConnection.pack_commands

        def send_command(conn: Any, *args: Any, **kwargs: Any) -> Any:
            self.add(args)
            return send(conn, *args, **kwargs)

        def pack_commands(conn: Any, commands: Any) -> Any:
            commands = list(commands)
            for cmd in commands:
                self.add(cmd)
            return pack(conn, commands)

        AbstractConnection.send_command = send_command  # type: ignore[method-assign]
        AbstractConnection.pack_commands = pack_commands  # type: ignore[method-assign]


def instrument(recorder: Recorder) -> None:
    """Put the timers on the engine's classes and the stream writer's functions.

    Must run before `worker.service` is imported: the service's modules import `flush_streams` and
    `finish_streams` by name, so they take whatever `worker.stream_writer` holds at that moment.
    """
    for name in ("score_tokens_many", "score_many"):
        setattr(Engine, name, _timed(recorder, name, getattr(Engine, name), attach=name == "score_many"))
    GenerationBatch.step = _summed(recorder, "batch_step", GenerationBatch.step)  # type: ignore[method-assign]
    GenerationBatch.admit = _summed(recorder, "admit", GenerationBatch.admit)  # type: ignore[method-assign]
    PrefixScorer.score = _summed(recorder, "scorer", PrefixScorer.score)  # type: ignore[method-assign]
    streams = stream_writer
    streams.flush_streams = _summed(recorder, "flush_streams", streams.flush_streams)  # type: ignore[assignment]
    streams.finish_streams = _timed(recorder, "finish_streams", streams.finish_streams, attach=True)  # type: ignore[assignment]
    # Score jobs end their streams by one script call a batch: timed as the same kind of write.
    stream_scripts.finish_score_streams = _timed(  # type: ignore[assignment]
        recorder, "finish_streams", stream_scripts.finish_score_streams, attach=True
    )


class ThreadProfiles:
    """cProfile of the threads the worker starts (the score pipeline's helper, the finalizer): a
    profiler enables itself on the thread it is called on only, so each new thread gets its own, and
    their stats are merged by the thread's name (numbered suffixes dropped)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._profiles: dict[str, list[cProfile.Profile]] = {}

    def install(self) -> None:
        run = threading.Thread.run
        profiles = self

        def profiled_run(thread: threading.Thread) -> None:
            profiler = cProfile.Profile()
            name = thread.name.rstrip("0123456789_").rstrip("-") or thread.name
            with profiles._lock:
                profiles._profiles.setdefault(name, []).append(profiler)
            profiler.enable()
            try:
                run(thread)
            finally:
                profiler.disable()

        threading.Thread.run = profiled_run  # type: ignore[method-assign]

    def stats(self, stream: TextIO) -> dict[str, pstats.Stats]:
        out: dict[str, pstats.Stats] = {}
        with self._lock:
            for name, profilers in self._profiles.items():
                for profiler in profilers:
                    profiler.disable()  # a thread still running (daemon) stops counting here
                    if name in out:
                        out[name].add(profiler)
                    else:
                        out[name] = pstats.Stats(profiler, stream=stream)
        return out


def _print_profile(stats: pstats.Stats) -> None:
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(r"(rq|worker|jobs|redis|tokenizers|pydantic)/.*\.py", 45)


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
    instrument(recorder)
    sent = SentCommands()
    sent.install()
    from mlxq.worker.service import WorkerService  # after `instrument`: see there

    t0 = time.perf_counter()
    service = WorkerService.start(settings)
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
    recorder.reset_peak()
    profiler = cProfile.Profile() if args.cprofile else None
    threads = ThreadProfiles() if args.cprofile else None
    if profiler is not None and threads is not None:
        threads.install()
        profiler.enable()
    try:
        return service.work(burst=args.burst)
    finally:
        if profiler is not None and threads is not None:
            profiler.disable()
            with open(args.cprofile, "w") as f:
                main_stats = pstats.Stats(profiler, stream=f)
                f.write("=== thread: main (the batch's path) ===\n")
                _print_profile(main_stats)
                by_thread = threads.stats(f)
                for name, stats in by_thread.items():
                    f.write(f"\n=== thread: {name} ===\n")
                    _print_profile(stats)
                # Raw stats a thread, for pstats by hand: MLXQ_BENCH_PROFILE_DIR names the folder.
                dump_dir = os.environ.get("MLXQ_BENCH_PROFILE_DIR")
                if dump_dir:
                    os.makedirs(dump_dir, exist_ok=True)
                    for name, stats in {"main": main_stats, **by_thread}.items():
                        stats.dump_stats(os.path.join(dump_dir, f"{name}.prof"))
        # The worker's last stats snapshot: its own per-phase times of score batches, among others.
        recorder.write(
            {"event": "exit", "start": time.time(), "stats": dict(service.stats.latest), "sent": sent.counts}
        )


if __name__ == "__main__":
    raise SystemExit(main())
