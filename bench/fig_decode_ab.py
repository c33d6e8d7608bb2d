"""The rotating decode A/B: the decode paths of one job taking turns, many repetitions, in a changing order.

Paths: mlx-lm's `generate_step`, the engine's `generate` (a generation batch of one, the path every job
takes) with a no-op sink and with a Redis `StreamWriter` sink, and a job through the queue; where the
engine's decode steps go through compiled layer parts (`compiled_steps`), also its `generate` with
plain steps (the compiled parts set aside for that path's turns: what they give, in the same turns).
Rotating
who goes first makes slow drifts of the host's speed fall on every path alike, so this judges the
decode target more surely than `generation`'s few repetitions.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from mlxq.jobs.schema import GenerateRequest
from mlxq.worker.engine.generation_batch import generate
from mlxq.worker.stream_writer import StreamOptions, StreamWriter

from .common import Bench, median
from .fig_generate import _queue_run, gap_rate, gen_payload, rate
from .queue_client import cleanup

REPS = 12  # the issue asks at least 10 rotating repetitions
Arrivals = list[tuple[float, int]]


def decode_ab(b: Bench) -> dict[str, Any]:
    s = b.sizes
    n = s.gen_tokens
    engine = b.engine
    b.worker()

    def mlx_lm(text: str) -> Arrivals:
        _t0, times = b.mlxlm.generate_times(engine.tokenizer.encode(text), n)
        return [(t, 1) for t in times]

    def in_process(to_redis: bool) -> Callable[[str], Arrivals]:
        def run(text: str) -> Arrivals:
            arrivals: Arrivals = []
            job_id = f"bench-ab-{time.time_ns()}"
            writer = StreamWriter(b.conn, job_id, StreamOptions()) if to_redis else None
            if writer is not None:
                writer.open(attempt=1)

            def sink(delta: str, ids: list[int]) -> None:
                arrivals.append((time.perf_counter(), len(ids)))
                if writer is not None:
                    writer(delta, ids)

            generate(engine, GenerateRequest.model_validate(gen_payload(b, text, n)), sink)
            if writer is not None:
                writer.flush()
                cleanup(b.conn, [job_id])
            return arrivals

        return run

    def plain_steps(text: str) -> Arrivals:
        """The engine's `generate` (no-op sink) with its compiled step set aside for this turn."""
        net = engine.model.model
        step, net.compiled_step = net.compiled_step, None
        try:
            return in_process(False)(text)
        finally:
            net.compiled_step = step

    paths: dict[str, Callable[[str], Arrivals]] = {
        "mlx-lm generate_step": mlx_lm,
        "mlxq engine.generate, no-op sink": in_process(False),
        "mlxq engine.generate, Redis StreamWriter sink": in_process(True),
    }
    if getattr(engine.model.model, "compiled_step", None) is not None:
        paths["mlxq engine.generate, no-op sink, plain steps (compiled_steps off)"] = plain_steps
    names = list(paths)
    results: dict[str, list[tuple[float | None, float | None]]] = {k: [] for k in names}
    queue_rates: list[tuple[float | None, float | None]] = []
    for rep in range(REPS + 1):  # the first warms up
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
    out: dict[str, Any] = {"reps": REPS, "tokens": n, "rows": rows}
    plain = rows.get("mlxq engine.generate, no-op sink, plain steps (compiled_steps off)")
    if plain is not None:  # each turn's compiled rate over its plain one: the compiled parts' share
        pairs = zip(rows["mlxq engine.generate, no-op sink"]["all"], plain["all"], strict=True)
        turns = sorted(c / p for c, p in pairs if c and p)
        out["compiled_over_plain"] = {"median": median(turns), "min": turns[0], "max": turns[-1]}
    return out
