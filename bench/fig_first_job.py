"""Figure: a fresh worker's first jobs against its warm ones, with the warm-up on and off (issue 29).

A worker's first forward of each shape builds kernels; the warm-up (`worker/engine/warm_up.py`) runs the
common shapes before the worker takes a job. Here fresh workers, one with the warm-up and one without,
each get a lone generation job and a lone score job as soon as they listen (RQ registered them: the
warm-up is done), then the same kinds of job again several times; each first is compared with the
median of its repeats. Job times are the client's: enqueue to `done`, the worker idle and listening.
"""

from __future__ import annotations

import time
from typing import Any

from .common import Bench, median
from .queue_client import BenchWorker, cleanup, enqueue, follow

REPEATS = 5


def first_job(b: Bench) -> dict[str, Any]:
    s = b.sizes
    rows: dict[str, Any] = {}
    for label, env in (("warm-up on", {"MLXQ_WARM_UP": "1"}), ("warm-up off", {"MLXQ_WARM_UP": "0"})):
        w = BenchWorker(b.model_path, b.redis_url, b.workdir, f"first-{len(rows)}", env=env).start()
        try:
            w.wait_ready()
            listening_s = _wait_listening(b, w, s.timeout_s)
            gen = [_generation(b, w) for _ in range(REPEATS + 1)]
            score = [_score(b, w) for _ in range(REPEATS + 1)]
        finally:
            w.stop()
        warm_gen = {k: median([r[k] for r in gen[1:]]) for k in gen[0]}
        warm_score = median([r["job_s"] for r in score[1:]])
        rows[label] = {
            "start_to_listening_s": listening_s,
            "first_gen_job_s": gen[0]["job_s"],
            "warm_gen_job_s": warm_gen["job_s"],
            "first_gen_vs_warm": gen[0]["job_s"] / warm_gen["job_s"],
            "first_ttft_s": gen[0]["ttft_s"],
            "warm_ttft_s": warm_gen["ttft_s"],
            "first_decode_tok_s": gen[0]["decode_tok_s"],
            "warm_decode_tok_s": warm_gen["decode_tok_s"],
            "first_score_job_s": score[0]["job_s"],
            "warm_score_job_s": warm_score,
            "first_score_vs_warm": score[0]["job_s"] / warm_score,
            "repeats": REPEATS,
        }
    return {"prompt_tokens": s.gen_prompt, "max_tokens": s.gen_tokens, "rows": rows}


def _wait_listening(b: Bench, w: BenchWorker, timeout: float) -> float:
    """Seconds from the worker's start until RQ registered it (after its warm-up, if any)."""
    ready = w.event("ready")
    deadline = time.monotonic() + timeout
    while not b.conn.exists(f"rq:worker:{w.name}"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker {w.label} not listening after {timeout}s:\n{w.log_tail()}")
        time.sleep(0.01)
    return time.time() - (ready["start"] if ready else time.time())


def _generation(b: Bench, w: BenchWorker) -> dict[str, float]:
    from .fig_generate import gen_payload

    t0 = time.perf_counter()
    payload = gen_payload(b, b.maker.prompt(b.sizes.gen_prompt), b.sizes.gen_tokens)
    job_id = enqueue(w.queue, "jobs.generate", payload)
    trace = follow(b.conn, [job_id], t0, b.sizes.timeout_s)[job_id]
    done = trace.done or {}
    if done.get("event") != "done":
        raise RuntimeError(f"generation job failed: {done}")
    cleanup(b.conn, [job_id])
    return {
        "job_s": trace.entries[-1][0] - t0,  # enqueue to `done`
        "ttft_s": trace.ttft_s() or 0.0,
        "decode_tok_s": trace.decode_tokens_per_s() or 0.0,
    }


def _score(b: Bench, w: BenchWorker) -> dict[str, float]:
    prompt = b.maker.prompt(b.sizes.gen_prompt)
    payload = {"rows": [{"prompt": prompt, "candidates": b.maker.candidates(prompt, 8)}]}
    t0 = time.perf_counter()
    job_id = enqueue(w.queue, "jobs.score", payload)
    trace = follow(b.conn, [job_id], t0, b.sizes.timeout_s)[job_id]
    done = trace.done or {}
    job_s = trace.entries[-1][0] - t0  # enqueue to `done`
    if done.get("event") != "done":
        raise RuntimeError(f"score job failed: {done}")
    cleanup(b.conn, [job_id])
    return {"job_s": job_s}
