"""Probe (temporary): where a warm prefix-cache repeat's time to first token goes, phase by phase.

`python -m bench.probe_warm_phases --tokens 2048,8192 --redis-url URL [--cprofile DIR] [--sync]`

For each prompt length: a cold prompt, then the same prefix with a new 16-token tail (warm), first in
the engine alone (this process), then through Redis (a worker subprocess: `serve`). Each phase is a
wrapped function whose calls are timed (`time.perf_counter`, CLOCK_MONOTONIC on Linux: comparable
between the producer's and the worker's process). Printed: each phase's first start after the job's
t0 and its summed time, cold and warm. `--sync` evaluates the restored cache right after
`PrefixCache.begin`, so the restore's device time is its own phase rather than the prefill's.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

MARKS: list[tuple[str, float, float]] = []


def _wrap(owner: Any, attr: str, name: str) -> None:
    fn = getattr(owner, attr)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            MARKS.append((name, t0, time.perf_counter()))

    setattr(owner, attr, wrapper)


def install_engine_marks(sync: bool) -> None:
    import mlx.core as mx

    from mlxq.worker.engine import engine as engine_mod
    from mlxq.worker.engine import generation_batch as gb
    from mlxq.worker.engine import prefill as prefill_mod
    from mlxq.worker.engine.cache import prefix_cache as pc
    from mlxq.worker.engine.decode_batch import DecodeBatch
    from mlxq.worker.engine.prefill_plan import PrefillPlan
    from mlxq.worker.engine.sampler import Sampler
    from mlxq.worker.engine.text import shared_encoding, tokenizer
    from mlxq.worker.engine.text_run import TextRun

    E = engine_mod.Engine
    for owner, attr, name in [
        (gb.GenerationBatch, "admit", "admit"),
        (E, "check_sizes", "admit.check_sizes"),
        (E, "prompt_tokens", "admit.tokenize"),
        (tokenizer.Tokenizer, "has_special_text", "admit.tokenize.special_scan"),
        (shared_encoding.SharedPrefixEncoder, "_cut_for", "admit.tokenize.find_cut"),
        (shared_encoding, "encode_plain", "admit.tokenize.encode_rest"),
        (shared_encoding.SharedPrefixEncoder, "_whole", "admit.tokenize.encode_whole"),
        (Sampler, "from_request", "admit.sampler"),
        (TextRun, "__init__", "admit.text_run"),
        (gb.GenerationBatch, "step", "step"),
        (gb.GenerationBatch, "settle", "step.settle"),
        (PrefillPlan, "next_group", "step.plan"),
        (pc.PrefixCache, "peek", "step.plan.peek"),
        (pc.PrefixCache, "_match", "cache.match"),
        (pc.PrefixCache, "begin", "step.restore(begin)"),
        (prefill_mod.ChunkedPrefill, "__init__", "step.prefill_init"),
        (prefill_mod.ChunkedPrefill, "advance", "step.prefill_graph"),
        (gb.GenerationBatch, "_advance_prefill", "step.advance_prefill(all)"),
        (pc.PrefixCache, "offer", "step.offer"),
        (pc, "_own", "step.offer.own_copies"),
        (gb.GenerationBatch, "_launch_group", "step.rows_launch"),
        (gb, "prefill_rows_layers", "step.rows_launch.graph"),
        (gb.GenerationBatch, "_join_launched", "step.rows_join"),
        (gb.GenerationBatch, "_join", "step.join"),
        (DecodeBatch, "add", "step.decode_add"),
        (DecodeBatch, "step_with", "step.decode_step"),
        (DecodeBatch, "quiet", "step.decode_quiet"),
    ]:
        _wrap(owner, attr, name)
    if sync:
        begin = pc.PrefixCache.begin

        def synced(self: Any, *args: Any, **kwargs: Any) -> Any:
            caches, n = begin(self, *args, **kwargs)
            t0 = time.perf_counter()
            mx.eval([c.state for c in caches])
            MARKS.append(("step.restore_eval(sync)", t0, time.perf_counter()))
            return caches, n

        pc.PrefixCache.begin = synced  # type: ignore[method-assign]


def install_worker_marks() -> None:
    from mlxq.worker import generation_jobs as gj
    from mlxq.worker import rq_batches, rq_worker
    from mlxq.worker.bounded_job import BoundedJob
    from mlxq.worker.job_claim import JobClaimer
    from mlxq.worker.job_results import JobResults
    from mlxq.worker.job_watch import JobWatch
    from mlxq.worker.stream_writer import StreamWriter

    W = rq_worker.MlxqWorker
    for owner, attr, name in [
        (W, "dequeue_job_and_maintain_ttl", "w.dequeue"),
        (BoundedJob, "restore", "w.dequeue.job_restore"),
        (W, "execute_job", "w.execute_job"),
        (gj.GenerationJobs, "run", "w.run"),
        (gj.GenerationJobs, "_admit", "w.admit_jobs"),
        (rq_batches.RqBatches, "start", "w.rq_start"),
        (JobWatch, "__enter__", "w.watch_enter"),
        (JobResults, "open_streams", "w.open_streams"),
        (gj, "parse_generate", "w.parse_generate"),
        (gj.GenerationJobs, "_claim_between_steps", "w.claim_between_steps"),
        (JobClaimer, "claim", "w.claim_between_steps.claim"),
        (StreamWriter, "__call__", "w.sink"),
        (gj, "flush_streams", "w.flush_streams"),
        (JobResults, "finish_generates", "w.finish_generates"),
    ]:
        _wrap(owner, attr, name)


def take_marks() -> list[tuple[str, float, float]]:
    out = list(MARKS)
    MARKS.clear()
    return out


def summarize(marks: list[tuple[str, float, float]], t0: float, first_token: float) -> dict[str, Any]:
    """Per phase: its first start after `t0` (ms), its summed time and calls up to `first_token`."""
    out: dict[str, Any] = {}
    for name, a, b in sorted(marks, key=lambda m: m[1]):
        if a > first_token:
            continue
        row = out.setdefault(name, {"at_ms": (a - t0) * 1e3, "ms": 0.0, "calls": 0})
        row["ms"] += (min(b, first_token) - a) * 1e3
        row["calls"] += 1
    return out


# --- the worker subprocess ---------------------------------------------------------------------------


def serve(args: argparse.Namespace) -> int:
    from mlxq.worker.cli import configure_logging
    from mlxq.worker.settings import WorkerSettings

    install_engine_marks(args.sync)
    install_worker_marks()
    from mlxq.worker import rq_worker
    from mlxq.worker.service import WorkerService

    execute = rq_worker.MlxqWorker.execute_job
    out = open(args.marks, "a", buffering=1)  # noqa: SIM115 - lives as long as the process

    def execute_job(self: Any, job: Any, queue: Any) -> None:
        prof = cProfile.Profile() if args.cprofile else None
        if prof is not None:
            prof.enable()
        try:
            execute(self, job, queue)
        finally:
            if prof is not None:
                prof.disable()
                with open(Path(args.cprofile) / f"worker-{job.id}.txt", "w") as f:
                    stats = pstats.Stats(prof, stream=f)
                    stats.sort_stats("cumulative").print_stats(70)
                    stats.sort_stats("tottime").print_stats(40)
            out.write(json.dumps({"job": job.id, "marks": take_marks()}) + "\n")

    rq_worker.MlxqWorker.execute_job = execute_job  # type: ignore[method-assign]
    settings = WorkerSettings(
        model=args.model, queues=[args.queue], redis_url=args.redis_url, name=args.queue
    )
    configure_logging("WARNING")
    service = WorkerService.start(settings)
    take_marks()  # the warm-up's
    Path(args.marks + ".ready").write_text("ready")
    return service.work()


# --- the producer's side -----------------------------------------------------------------------------


def _payload(text: str, no_eos: dict[int, float]) -> dict[str, Any]:
    return {
        "prompt": text,
        "max_tokens": 4,
        "temperature": 0.0,
        "logit_bias": {str(k): v for k, v in no_eos.items()},
    }


def engine_run(engine: Any, text: str, no_eos: dict[int, float]) -> dict[str, Any]:
    from mlxq.jobs.schema import GenerateRequest
    from mlxq.worker.engine.generation_batch import generate

    arrivals: list[float] = []
    take_marks()
    t0 = time.perf_counter()
    request = GenerateRequest.model_validate(_payload(text, no_eos))
    MARKS.append(("validate_request", t0, time.perf_counter()))
    result = generate(engine, request, lambda _t, _ids: arrivals.append(time.perf_counter()))
    phases = summarize(take_marks(), t0, arrivals[0])
    return {"ttft_ms": (arrivals[0] - t0) * 1e3, "cached": result.usage.cached_tokens, "phases": phases}


def queue_run(conn: Any, queue: Any, marks_path: Path, text: str, no_eos: dict[int, float]) -> dict[str, Any]:
    from mlxq.jobs import keys

    t0 = time.perf_counter()
    job = queue.enqueue_call("jobs.generate", args=(_payload(text, no_eos),), timeout=3600, result_ttl=3600)
    t_enq = time.perf_counter()
    key = keys.stream_key(job.id)
    last, first, done = "0-0", None, None
    t_read0 = None
    while done is None:
        t_call = time.perf_counter()
        reply = conn.xread({key: last}, block=1000, count=100)
        now = time.perf_counter()
        for _k, entries in reply or []:
            for entry_id, fields in entries:
                last = entry_id
                event = fields[b"event"].decode()
                if event == "token" and first is None:
                    first, t_read0 = now, t_call
                if event in ("done", "error"):
                    done = fields
    if done[b"event"] != b"done":
        raise RuntimeError(f"job failed: {done}")
    while True:  # the worker writes its marks once the job's execute_job returned
        lines = [json.loads(s) for s in marks_path.read_text().splitlines() if s.strip()]
        rec = next((r for r in lines if r["job"] == job.id), None)
        if rec is not None:
            break
        time.sleep(0.005)
    assert first is not None
    marks = [tuple(m) for m in rec["marks"]]
    marks.append(("p.enqueue", t0, t_enq))
    marks.append(("p.xread_returning_first", t_read0 or t0, first))
    phases = summarize(marks, t0, first)  # type: ignore[arg-type]
    return {
        "ttft_ms": (first - t0) * 1e3,
        "cached": int(done[b"cached_tokens"]),
        "worker_ttft_ms": float(done[b"ttft_s"]) * 1e3,
        "phases": phases,
    }


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ranked = sorted(runs, key=lambda r: r["ttft_ms"])
    best = ranked[len(ranked) // 2]
    best = {**best, "all_ttft_ms": [round(r["ttft_ms"], 2) for r in runs]}
    names = {n for r in runs for n in r["phases"]}
    best["median_ms"] = {
        n: statistics.median([r["phases"].get(n, {}).get("ms", 0.0) for r in runs]) for n in names
    }
    return best


def print_table(title: str, cold: dict[str, Any], warm: dict[str, Any]) -> None:
    print(f"\n### {title}")
    print(f"TTFT cold {cold['ttft_ms']:.2f} ms (all {cold['all_ttft_ms']}), cached {cold['cached']}")
    print(f"TTFT warm {warm['ttft_ms']:.2f} ms (all {warm['all_ttft_ms']}), cached {warm['cached']}")
    if "worker_ttft_ms" in warm:
        own = (cold["worker_ttft_ms"], warm["worker_ttft_ms"])
        print(f"worker's own ttft: cold {own[0]:.2f} ms, warm {own[1]:.2f} ms")
    names = sorted(
        {*cold["phases"], *warm["phases"]},
        key=lambda n: warm["phases"].get(n, cold["phases"].get(n, {})).get("at_ms", 1e9),
    )
    print("| phase | cold at ms | cold ms (median) | warm at ms | warm ms (median) | warm calls |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n in names:
        c, w = cold["phases"].get(n, {}), warm["phases"].get(n, {})
        print(
            f"| {n} | {c.get('at_ms', float('nan')):.2f} | {cold['median_ms'].get(n, 0):.2f} | "
            f"{w.get('at_ms', float('nan')):.2f} | {warm['median_ms'].get(n, 0):.2f} | {w.get('calls', 0)} |"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probe_warm_phases")
    sub = p.add_subparsers(dest="cmd")
    s = sub.add_parser("serve")
    s.add_argument("--model", required=True)
    s.add_argument("--queue", required=True)
    s.add_argument("--redis-url", required=True)
    s.add_argument("--marks", required=True)
    s.add_argument("--cprofile")
    s.add_argument("--sync", action="store_true")
    p.add_argument("--tokens", default="2048,8192")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6391/5")
    p.add_argument("--cprofile", help="a folder: the warm runs' profiles go there")
    p.add_argument("--sync", action="store_true")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--skip-queue", action="store_true")
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "mlxq" / "bench-models"))
    args = p.parse_args(argv)
    if args.cmd == "serve":
        return serve(args)

    import redis
    from rq import Queue
    from rq.serializers import JSONSerializer

    from mlxq.worker.engine import Engine, EngineOptions

    from .checkpoints import checkpoint
    from .prompts import PromptMaker

    install_engine_marks(args.sync)
    model = str(checkpoint("tiny", Path(args.cache_dir)))
    engine = Engine.load(model, EngineOptions())
    maker = PromptMaker(engine.tokenizer, seed=7)
    no_eos = {i: -100.0 for i in engine.tokenizer.eos_ids}
    if args.cprofile:
        Path(args.cprofile).mkdir(parents=True, exist_ok=True)
    lengths = [int(n) for n in args.tokens.split(",")]

    def pairs(n: int) -> list[tuple[str, str]]:
        out = []
        for _ in range(args.reps + 1):  # the first warms up
            prefix = maker.pieces(n - maker.special)
            out.append((prefix + maker.pieces(16), prefix + maker.pieces(16)))
        return out

    if not args.skip_engine:
        for n in lengths:
            colds, warms = [], []
            for rep, (a, b) in enumerate(pairs(n)):
                cold = engine_run(engine, a, no_eos)
                prof = cProfile.Profile() if args.cprofile and rep == args.reps else None
                if prof is not None:
                    prof.enable()
                warm = engine_run(engine, b, no_eos)
                if prof is not None:
                    prof.disable()
                    with open(Path(args.cprofile) / f"engine-{n}.txt", "w") as f:
                        st = pstats.Stats(prof, stream=f)
                        st.sort_stats("cumulative").print_stats(60)
                        st.sort_stats("tottime").print_stats(30)
                if rep:
                    colds.append(cold)
                    warms.append(warm)
            print_table(f"engine alone, {n} tokens", _median_run(colds), _median_run(warms))

    if args.skip_queue:
        return 0
    conn = redis.Redis.from_url(args.redis_url)
    qname = f"probe-{uuid.uuid4().hex[:8]}"
    marks_path = Path(f"/tmp/probe-marks-{qname}.jsonl")
    marks_path.write_text("")
    cmd = [sys.executable, "-m", "bench.probe_warm_phases", "serve", "--model", model, "--queue", qname]
    cmd += ["--redis-url", args.redis_url, "--marks", str(marks_path)]
    if args.cprofile:
        cmd += ["--cprofile", args.cprofile]
    if args.sync:
        cmd.append("--sync")
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    log = open(f"/tmp/probe-worker-{qname}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        ready = Path(str(marks_path) + ".ready")
        deadline = time.monotonic() + 300
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker did not start; see {log.name}")
            time.sleep(0.1)
        queue = Queue(qname, connection=conn, serializer=JSONSerializer)
        for n in lengths:
            colds, warms = [], []
            for rep, (a, b) in enumerate(pairs(n)):
                cold = queue_run(conn, queue, marks_path, a, no_eos)
                warm = queue_run(conn, queue, marks_path, b, no_eos)
                if rep:
                    colds.append(cold)
                    warms.append(warm)
            print_table(f"through Redis, {n} tokens", _median_run(colds), _median_run(warms))
    finally:
        proc.terminate()
        proc.wait(30)
        conn.flushdb()  # db 5 of this helper's own server
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
