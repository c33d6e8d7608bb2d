"""Probe (temporary): where a warm one-job repeat's first-token latency goes on its way through Redis.

`python -m bench.probe_queue_latency --redis-url URL [--reps 30] [--gap-ms 0] [--monitor]`

As the bench's `warm_cache` figure: a fresh 2,048-token prefix with a 16-token tail (cold), then the
same prefix with another tail (warm), 4 tokens each, through a real worker (`serve`: `WorkerService`
as `mlxq worker` builds it). `--gap-ms 0` enqueues the warm job as soon as the cold job's `done` is
read (as the figure does); a gap lets the worker go idle (blocked in RQ's dequeue) first.

Every phase is a wrapped function or Redis call, timed with `time.perf_counter` (CLOCK_MONOTONIC:
comparable between the producer's and the worker's process). Printed: the warm job's milestones
(median, p10, p90 over the repetitions, ms from the producer's enqueue call), the time between them,
and every wrapped call on the worker's main thread between the cold job's `done` and the warm job's
first token (median start and duration, calls). `--monitor` lists the Redis commands of one warm job
(Redis MONITOR), in order.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

MARKS: list[tuple[str, str, float, float]] = []  # (thread, name, start, end)


def _mark(name: str, t0: float, t1: float) -> None:
    MARKS.append((threading.current_thread().name, name, t0, t1))


def _wrap(owner: Any, attr: str, name: str, kind: str = "method") -> None:
    if owner is None or not hasattr(owner, attr):  # another tree's code: not there to time
        return
    raw = owner.__dict__.get(attr) if isinstance(owner, type) else None
    fn = getattr(owner, attr)
    if isinstance(raw, classmethod):
        inner = raw.__func__

        @functools.wraps(inner)
        def cwrapper(cls: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(cls, *args, **kwargs)
            finally:
                _mark(name, t0, time.perf_counter())

        setattr(owner, attr, classmethod(cwrapper))
        return

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _mark(name, t0, time.perf_counter())

    setattr(owner, attr, wrapper)


def install_worker_marks() -> None:
    import redis
    import redis.client

    from mlxq.worker import generation_jobs as gj
    from mlxq.worker import job_results, rq_batches, rq_worker
    from mlxq.worker.bounded_job import BoundedJob
    from mlxq.worker.engine import engine as engine_mod
    from mlxq.worker.engine import generation_batch as gb
    from mlxq.worker.engine.batch_prefill import BatchPrefill
    from mlxq.worker.engine.cache import prefix_cache as pc
    from mlxq.worker.engine.decode_batch import DecodeBatch
    from mlxq.worker.engine.generation_clock import GenerationClock
    from mlxq.worker.engine.text_run import TextRun
    from mlxq.worker.finalizer import Finalizer
    from mlxq.worker.job_claim import JobClaimer
    from mlxq.worker.job_results import JobResults
    from mlxq.worker.job_watch import JobWatch
    from mlxq.worker.metrics import StatsPublisher
    from mlxq.worker.stream_writer import StreamWriter

    W = rq_worker.MlxqWorker
    for owner, attr, name in [
        (W, "dequeue_job_and_maintain_ttl", "dequeue"),
        (BoundedJob, "fetch", "dequeue.fetch_job"),
        (W, "heartbeat", "heartbeat"),
        (W, "set_state", "set_state"),
        (W, "check_for_suspension", "check_for_suspension"),
        (W, "execute_job", "execute_job"),
        (W, "_taken_again", "execute_job.taken_again"),
        (gj.GenerationJobs, "run", "run"),
        (JobWatch, "__enter__", "run.watch_enter"),
        (JobWatch, "__exit__", "run.watch_exit"),
        (gj.GenerationJobs, "_admit", "run.admit_jobs"),
        (rq_batches.RqBatches, "start", "run.admit_jobs.rq_start"),
        (JobWatch, "add", "run.admit_jobs.watch_add"),
        (JobResults, "open_streams", "run.admit_jobs.open_streams"),
        (getattr(job_results, "StreamOpening", None), "writers", "run.admit_jobs.open_streams"),
        (gj, "parse_generate", "run.admit_jobs.parse_generate"),
        (gb.GenerationBatch, "admit", "run.admit_jobs.batch_admit"),
        (engine_mod.Engine, "prompt_tokens", "run.admit_jobs.batch_admit.tokenize"),
        (TextRun, "__init__", "run.admit_jobs.batch_admit.text_run"),
        (gj.GenerationJobs, "_claim_between_steps", "run.claim_between_steps"),
        (W, "housekeeping", "run.claim_between_steps.housekeeping"),
        (JobClaimer, "claim", "run.claim_between_steps.claim"),
        (gb.GenerationBatch, "step", "run.step"),
        (BatchPrefill, "step", "run.step.prefill"),
        (pc.PrefixCache, "begin", "run.step.prefill.cache_begin"),
        (pc.PrefixCache, "offer", "cache_offer"),
        (DecodeBatch, "add", "run.step.decode_add"),
        (DecodeBatch, "step_with", "run.step.decode_step"),
        (StreamWriter, "__call__", "run.step.sink"),
        (gj._StreamFlush, "__call__", "run.step.flush_streams"),
        (gb.GenerationBatch, "settle", "run.settle"),
        (gj.GenerationJobs, "_retire_all", "run.retire_all"),
        (JobResults, "finish_generates", "run.retire_all.finish_generates"),
        (Finalizer, "close", "run.finalizer_close"),
        (rq_batches.RqBatches, "succeed_many", "finalizer.succeed_many"),
        (StatsPublisher, "publish", "stats_publish"),
    ]:
        _wrap(owner, attr, name)

    token = GenerationClock.token

    def clock_token(self: Any) -> None:
        if self.first_token is None:
            now = time.perf_counter()
            _mark("FIRST_TOKEN", now, now)
        token(self)

    GenerationClock.token = clock_token  # type: ignore[method-assign]

    execute = redis.Redis.execute_command

    def execute_command(self: Any, *args: Any, **options: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return execute(self, *args, **options)
        finally:
            _mark(f"redis {str(args[0]).split()[0].upper()}", t0, time.perf_counter())

    redis.Redis.execute_command = execute_command  # type: ignore[method-assign]
    pipe_execute = redis.client.Pipeline.execute

    def pipeline_execute(self: Any, *args: Any, **kwargs: Any) -> Any:
        names = [str(c[0][0]).split()[0].upper() for c in self.command_stack]
        t0 = time.perf_counter()
        try:
            return pipe_execute(self, *args, **kwargs)
        finally:
            label = "multi" if self.transaction else "pipe"
            _mark(f"redis {label}[{','.join(names)}]", t0, time.perf_counter())

    redis.client.Pipeline.execute = pipeline_execute  # type: ignore[method-assign]


def serve(args: argparse.Namespace) -> int:
    from mlxq.worker.cli import configure_logging
    from mlxq.worker.settings import WorkerSettings

    install_worker_marks()
    from mlxq.worker.service import WorkerService

    settings = WorkerSettings(
        model=args.model, queues=[args.queue], redis_url=args.redis_url, name=args.queue
    )
    configure_logging(settings.log_level)
    service = WorkerService.start(settings)
    if args.cprofile:
        _profile_jobs(args.cprofile)
    out = open(args.marks, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
    stop = threading.Event()

    def dump() -> None:  # the marks so far, every few ms (the producer matches them by time)
        while not stop.wait(0.005):
            taken = MARKS[:]
            del MARKS[: len(taken)]
            if taken:
                out.write(json.dumps(taken) + "\n")

    threading.Thread(target=dump, name="probe-dump", daemon=True).start()
    Path(args.marks + ".ready").write_text("ready")
    try:
        return service.work()
    finally:
        stop.set()


def _profile_jobs(path: str) -> None:
    """cProfile of each job from its dequeue's BLMOVE reply to the end of its first stream write
    (`execute_job` of the job that follows, cut at its first flush); the last one's stats go to `path`."""
    import cProfile
    import pstats

    import redis

    from mlxq.worker import generation_jobs as gj

    state: dict[str, Any] = {"prof": None}
    execute = redis.Redis.execute_command

    def execute_command(self: Any, *args: Any, **options: Any) -> Any:
        out = execute(self, *args, **options)
        if (
            str(args[0]).upper() == "BLMOVE"
            and out is not None
            and threading.current_thread().name == "MainThread"
        ):
            prof = state["prof"] = cProfile.Profile()
            prof.enable()
        return out

    redis.Redis.execute_command = execute_command  # type: ignore[method-assign]
    flush = gj._StreamFlush.__call__

    def flushed(self: Any) -> None:
        flush(self)
        prof = state["prof"]
        if prof is not None:
            prof.disable()
            state["prof"] = None
            stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
            rows = sorted(stats.items(), key=lambda kv: -kv[1][3])
            with open(path, "w") as f:
                f.write("cumulative us | own us | calls | function\n")
                for (file, line, fn), (_cc, nc, tt, ct, _callers) in rows[:120]:
                    short = "/".join(file.split("/")[-2:])
                    f.write(f"{ct * 1e6:9.0f} | {tt * 1e6:8.0f} | {nc:5d} | {short}:{line}({fn})\n")

    gj._StreamFlush.__call__ = flushed  # type: ignore[method-assign]


# --- the producer's side -----------------------------------------------------------------------------


def _payload(text: str, no_eos: dict[int, float]) -> dict[str, Any]:
    return {
        "prompt": text,
        "max_tokens": 4,
        "temperature": 0.0,
        "logit_bias": {str(k): v for k, v in no_eos.items()},
    }


def run_job(conn: Any, queue: Any, text: str, no_eos: dict[int, float]) -> dict[str, Any]:
    from mlxq.jobs import keys

    t0 = time.perf_counter()
    job = queue.enqueue_call("jobs.generate", args=(_payload(text, no_eos),), timeout=3600, result_ttl=3600)
    t_enq = time.perf_counter()
    key = keys.stream_key(job.id)
    last, first, done, t_call_first = "0-0", None, None, None
    while done is None:
        t_call = time.perf_counter()
        reply = conn.xread({key: last}, block=1000, count=100)
        now = time.perf_counter()
        for _k, entries in reply or []:
            for entry_id, fields in entries:
                last = entry_id
                event = fields[b"event"].decode()
                if event == "token" and first is None:
                    first, t_call_first = now, t_call
                if event in ("done", "error"):
                    done = fields
    if done[b"event"] != b"done":
        raise RuntimeError(f"job failed: {done}")
    return {
        "id": job.id,
        "t0": t0,
        "enqueued": t_enq,
        "xread_call": t_call_first,
        "first": first,
        "done_read": time.perf_counter(),
        "worker_ttft_ms": float(done[b"ttft_s"]) * 1e3,
        "cached": int(done[b"cached_tokens"]),
    }


def read_marks(path: Path) -> list[tuple[str, str, float, float]]:
    out: list[tuple[str, str, float, float]] = []
    for line in path.read_text().splitlines():
        if line.strip():
            out.extend(tuple(m) for m in json.loads(line))  # type: ignore[misc]
    return out


MILESTONES = [
    ("enqueue returned", "enqueued"),
    ("worker: BLMOVE returned", "blmove"),
    ("worker: dequeue returned", "dequeue_end"),
    ("worker: execute_job began", "execute_begin"),
    ("worker: RQ start written", "rq_start_end"),
    ("worker: stream opened", "open_end"),
    ("worker: admitted (tokenized)", "admit_end"),
    ("worker: step began", "step_begin"),
    ("worker: first token sampled", "first_token"),
    ("worker: first XADD replied", "flush_end"),
    ("reader: XREAD returned", "first"),
]


def milestones(job: dict[str, Any], marks: list[tuple[str, str, float, float]]) -> dict[str, float]:
    """The warm job's milestones (ms from its enqueue call), from the worker's marks in its window."""
    t0, end = job["t0"], job["first"]
    main = [m for m in marks if m[0] == "MainThread" and m[3] >= t0 - 0.5 and m[2] <= end]

    def first(name: str, after: float = t0, which: int = 3) -> float:
        hits = [m for m in main if m[1] == name and m[2] >= after]
        return hits[0][which] if hits else float("nan")

    blmove = [m for m in main if m[1] == "redis BLMOVE" and m[3] >= t0]
    out = {"enqueued": job["enqueued"], "first": job["first"]}
    out["blmove"] = blmove[0][3] if blmove else float("nan")
    b = out["blmove"] if blmove else t0
    out["dequeue_end"] = first("dequeue", b - 5.0)
    out["execute_begin"] = first("execute_job", b, 2)
    out["rq_start_end"] = first("run.admit_jobs.rq_start", b)
    out["open_end"] = first("run.admit_jobs.open_streams", b)
    out["admit_end"] = first("run.admit_jobs", b)
    out["step_begin"] = first("run.step", b, 2)
    out["first_token"] = first("FIRST_TOKEN", b, 2)
    out["flush_end"] = first("run.step.flush_streams", b)
    return {k: (v - t0) * 1e3 for k, v in out.items()}


def phases(job: dict[str, Any], marks: list[tuple[str, str, float, float]], since: float) -> dict[str, Any]:
    """Every wrapped call on any thread from `since` (the cold job's `done` read) to the warm job's first
    token read: start (ms from the enqueue call), summed duration, calls."""
    t0, end = job["t0"], job["first"]
    out: dict[str, Any] = {}
    for thread, name, a, b in sorted(marks, key=lambda m: m[2]):
        if b < since or a > end:
            continue
        key = name if thread == "MainThread" else f"[{thread}] {name}"
        row = out.setdefault(key, {"at": (a - t0) * 1e3, "ms": 0.0, "calls": 0})
        row["ms"] += (min(b, end) - max(a, since)) * 1e3
        row["calls"] += 1
    return out


def timeline(job: dict[str, Any], marks: list[tuple[str, str, float, float]], since: float) -> list[str]:
    """Every wrapped call from `since` to the warm job's first token read, in order of start (ms from
    the enqueue call), with its thread and duration."""
    t0, end = job["t0"], job["first"]
    rows = [m for m in marks if m[3] >= since and m[2] <= end]
    out = [f"{(since - t0) * 1e3:8.2f} ---------- cold done read"]
    for thread, name, a, b in sorted(rows, key=lambda m: m[2]):
        where = "" if thread == "MainThread" else f"[{thread}] "
        out.append(f"{(a - t0) * 1e3:8.2f} {(b - a) * 1e3:7.2f} {where}{name}")
    out += [
        f"{0.0:8.2f} ---------- warm enqueue call",
        f"{(end - t0) * 1e3:8.2f} ---------- first token read",
    ]
    return sorted(out, key=lambda line: float(line.split()[0]))


def _q(values: list[float]) -> str:
    v = sorted(x for x in values if x == x)
    if not v:
        return "- | - | -"
    return f"{statistics.median(v):.2f} | {v[len(v) // 10]:.2f} | {v[(9 * len(v)) // 10]:.2f}"


def report(runs: list[dict[str, Any]]) -> None:
    print("\n### warm job: milestones, ms from the enqueue call (median | p10 | p90)")
    print("| milestone | at | p10 | p90 | since the one before (median | p10 | p90) |")
    print("| --- | --- | --- | --- | --- |")
    prev = None
    for label, key in MILESTONES:
        at = [r["ms"][key] for r in runs]
        since = [r["ms"][key] - r["ms"][prev] for r in runs] if prev else [r["ms"][key] for r in runs]
        print(f"| {label} | {_q(at)} | {_q(since)} |")
        prev = key
    print(f"worker TTFT (its own clock): {_q([r['worker_ttft_ms'] for r in runs])}")
    print(f"cold done read -> warm enqueue: {_q([r['gap_ms'] for r in runs])}")
    names: dict[str, float] = {}
    for r in runs:
        for n, row in r["phases"].items():
            names.setdefault(n, row["at"])
    print("\n### every wrapped call from the cold job's done read to the warm job's first token read")
    print("| call | at (median) | ms (median) | p10 | p90 | calls (median) | in reps |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    order = sorted(
        names, key=lambda n: statistics.median([r["phases"][n]["at"] for r in runs if n in r["phases"]])
    )
    for n in order:
        rows = [r["phases"][n] for r in runs if n in r["phases"]]
        at = statistics.median([x["at"] for x in rows])
        ms = [x["ms"] for x in rows] + [0.0] * (len(runs) - len(rows))
        calls = statistics.median([x["calls"] for x in rows])
        print(f"| {n} | {at:.2f} | {_q(ms).replace(' | ', ' | ', 2)} | {calls:g} | {len(rows)} |")


def monitor(url: str, stop: threading.Event, out: list[tuple[float, str]]) -> None:
    import redis

    conn = redis.Redis.from_url(url)
    with conn.monitor() as m:
        for cmd in m.listen():
            out.append((float(cmd["time"]), str(cmd["command"])[:140]))
            if stop.is_set():
                return


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probe_queue_latency")
    sub = p.add_subparsers(dest="cmd")
    s = sub.add_parser("serve")
    s.add_argument("--model", required=True)
    s.add_argument("--queue", required=True)
    s.add_argument("--redis-url", required=True)
    s.add_argument("--marks", required=True)
    s.add_argument("--cprofile")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument(
        "--gap-ms", type=float, default=0.0, help="idle time between the cold done and the warm job"
    )
    p.add_argument("--prefix", type=int, default=2048)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6393/5")
    p.add_argument("--monitor", action="store_true", help="list one warm job's Redis commands")
    p.add_argument("--cprofile", help="a file: the last warm job's profile, BLMOVE reply to first write")
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "mlxq" / "bench-models"))
    args = p.parse_args(argv)
    if args.cmd == "serve":
        return serve(args)

    import redis
    from rq import Queue
    from rq.serializers import JSONSerializer

    from mlxq.worker.engine.text.tokenizer import Tokenizer

    from .checkpoints import checkpoint
    from .prompts import PromptMaker

    model = str(checkpoint("tiny", Path(args.cache_dir)))
    tokenizer = Tokenizer.from_dir(model)
    maker = PromptMaker(tokenizer, seed=11)
    no_eos = {i: -100.0 for i in tokenizer.eos_ids}
    conn = redis.Redis.from_url(args.redis_url)
    qname = f"probe-{uuid.uuid4().hex[:8]}"
    marks_path = Path(f"/tmp/probe-marks-{qname}.jsonl")
    marks_path.write_text("")
    cmd = [sys.executable, "-m", "bench.probe_queue_latency", "serve", "--model", model, "--queue", qname]
    cmd += ["--redis-url", args.redis_url, "--marks", str(marks_path)]
    if args.cprofile:
        cmd += ["--cprofile", args.cprofile]
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    log = open(f"/tmp/probe-worker-{qname}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    runs: list[dict[str, Any]] = []
    try:
        ready = Path(str(marks_path) + ".ready")
        deadline = time.monotonic() + 300
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker did not start; see {log.name}")
            time.sleep(0.1)
        queue = Queue(qname, connection=conn, serializer=JSONSerializer)
        load0 = os.getloadavg()
        for rep in range(args.reps + 2):  # the first two warm up
            prefix = maker.pieces(args.prefix - maker.special)
            cold = run_job(conn, queue, prefix + maker.pieces(16), no_eos)
            if args.gap_ms:
                time.sleep(args.gap_ms / 1e3)
            watch: list[tuple[float, str]] = []
            stop = threading.Event()
            mon = None
            if args.monitor and rep == args.reps + 1:
                mon = threading.Thread(target=monitor, args=(args.redis_url, stop, watch), daemon=True)
                mon.start()
                time.sleep(0.2)
            gap = time.perf_counter() - cold["done_read"]
            warm = run_job(conn, queue, prefix + maker.pieces(16), no_eos)
            time.sleep(0.05)  # the worker's marks reach the file
            if mon is not None:
                stop.set()
                conn.ping()
                mon.join(2)
                print("\n### Redis commands (MONITOR), from the warm enqueue on")
                for t, c in watch:
                    print(f"{t:.6f} {c}")
            if warm["cached"] < args.prefix:
                raise RuntimeError(f"warm job not warm: cached {warm['cached']}")
            marks = read_marks(marks_path)
            if rep >= 2:
                runs.append(
                    {
                        "ms": milestones(warm, marks),
                        "phases": phases(warm, marks, cold["done_read"]),
                        "worker_ttft_ms": warm["worker_ttft_ms"],
                        "gap_ms": gap * 1e3,
                        "timeline": timeline(warm, marks, cold["done_read"]),
                    }
                )
        load1 = os.getloadavg()
        print(f"reps={args.reps} gap_ms={args.gap_ms} prefix={args.prefix} load {load0} -> {load1}")
        report(runs)
        median_run = sorted(runs, key=lambda r: r["ms"]["first"])[len(runs) // 2]
        print("\n### the median repetition's calls in order: start (ms from the enqueue call), ms, call")
        print("\n".join(median_run["timeline"]))
    finally:
        proc.terminate()
        proc.wait(30)
        conn.flushdb()  # the probe's own database
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
