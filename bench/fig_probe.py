"""Focused probes for what the headline figures left open (run with `--only decode_ab,shape_jit`).

- decode_ab: decode rate of mlx-lm, the bare mlxq loop, engine.generate (no-op sink, Redis sink) and
  the queue, many repetitions in a rotating order, so slow drifts (clocks, other processes) fall on
  every path alike;
- shape_jit: time to first token for prompt lengths never seen before in this process, then the same
  lengths again: what a first-seen shape costs (kernels built for it) on this device.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from jobs.schema import GenerateRequest
from worker.engine.generate import prefill
from worker.engine.sampler import Sampler
from worker.stream_writer import StreamOptions, StreamWriter

from .common import Bench, median
from .fig_diagnose import _mlxq_loop
from .fig_generate import _queue_run, gap_rate, gen_payload, rate
from .queue_client import cleanup

REPS = 8


def decode_ab(b: Bench) -> dict[str, Any]:
    s = b.sizes
    n = s.gen_tokens
    engine = b.engine
    mq = engine.model
    b.worker()

    def mlx_lm(text: str) -> list[tuple[float, int]]:
        _t0, times = b.mlxlm.generate_times(engine.tokenizer.encode(text), n)
        return [(t, 1) for t in times]

    def bare(text: str) -> list[tuple[float, int]]:
        sampler = Sampler(mq.args.vocab_size, temperature=0.0, logit_bias=b.no_eos)
        return [(t, 1) for t in _mlxq_loop(mq, mq.make_cache, engine.tokenizer.encode(text), n, sampler)]

    def generate(sink_for: Callable[[str], Any] | None) -> Callable[[str], list[tuple[float, int]]]:
        def run(text: str) -> list[tuple[float, int]]:
            arrivals: list[tuple[float, int]] = []
            job_id = f"bench-ab-{time.time_ns()}"
            writer = sink_for(job_id) if sink_for is not None else None

            def sink(delta: str, ids: list[int]) -> None:
                arrivals.append((time.perf_counter(), len(ids)))
                if writer is not None:
                    writer(delta, ids)

            engine.generate(GenerateRequest.model_validate(gen_payload(b, text, n)), sink)
            if writer is not None:
                writer.flush()
                cleanup(b.conn, [job_id])
            return arrivals

        return run

    def redis_writer(job_id: str) -> StreamWriter:
        writer = StreamWriter(b.conn, job_id, StreamOptions())
        writer.open(attempt=1)
        return writer

    paths: dict[str, Callable[[str], list[tuple[float, int]]]] = {
        "mlx-lm generate_step": mlx_lm,
        "mlxq decode loop + engine Sampler (logit_bias)": bare,
        "mlxq engine.generate, no-op sink": generate(None),
        "mlxq engine.generate, Redis StreamWriter sink": generate(redis_writer),
    }
    names = list(paths)
    results: dict[str, list[tuple[float | None, float | None]]] = {k: [] for k in names}
    queue_rates: list[tuple[float | None, float | None]] = []
    for rep in range(REPS + 1):
        text = b.maker.prompt(s.gen_prompt)
        order = names[rep % len(names) :] + names[: rep % len(names)]  # rotate who goes first
        for name in order:
            times = paths[name](text)
            if rep:
                results[name].append((rate(times), gap_rate(times)))
        _job, row = _queue_run(b, text, n)
        if rep:
            queue_rates.append((row["worker_decode_tok_s"], row["decode_tok_s"]))
    rows = {
        k: {
            "decode_tok_s": median([r for r, _ in v]),
            "decode_median_gap_tok_s": median([g for _, g in v]),
            "all": [r for r, _ in v],
        }
        for k, v in results.items()
    }
    rows["mlxq via Redis: worker-reported rate (client-side rate)"] = {
        "decode_tok_s": median([w for w, _ in queue_rates]),
        "decode_median_gap_tok_s": median([c for _, c in queue_rates]),
        "all": [w for w, _ in queue_rates],
    }
    base = rows["mlx-lm generate_step"]
    for row in rows.values():
        row["vs_mlx_lm"] = (row["decode_tok_s"] or 0.0) / (base["decode_tok_s"] or 1.0)
        gap = row["decode_median_gap_tok_s"] or 0.0
        row["median_gap_vs_mlx_lm"] = gap / (base["decode_median_gap_tok_s"] or 1.0)
    return {"reps": REPS, "tokens": n, "rows": rows}


def shape_jit(b: Bench) -> dict[str, Any]:
    """Prefill+first token for new prompt lengths, then the same lengths again (ms)."""
    model = b.engine.model
    out: dict[str, Any] = {}
    vocab = model.args.vocab_size
    for base in (3000, 200):
        lengths = [base + i for i in range(4)]
        for label in ("first time", "again"):
            times = []
            for n in lengths:
                ids = [(7 * i + n) % (vocab - 10) + 5 for i in range(n)]
                t0 = time.perf_counter()
                logits = prefill(model, ids, model.make_cache(), 2048)
                mx.argmax(logits, axis=-1).item()
                times.append(round(1000 * (time.perf_counter() - t0), 2))
            out[f"{lengths[0]}..{lengths[-1]} tokens, {label}"] = times
    return out
