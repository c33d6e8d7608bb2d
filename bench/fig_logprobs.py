"""Figure 8: prompt logprobs of one long prompt (issue 28): peak memory and time of mlxq's scorer, whose
LM head runs on a few hundred positions at a time, against the whole [T, vocab] float32 logits block."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlxq.worker.engine.score_requests import SeqRow
from mlxq.worker.engine.token_scoring import TokenSeq

from .common import Bench, mem_fields, memory

TOP_K = 5

SCORER = "mlxq Engine.score_many (prompt_logprobs, top-5; LM head in chunks)"
FULL = "chunked prefill, then the full [T, vocab] float32 logits"
PLAIN = "one plain forward, full [T, vocab] float32 logits"


def _from_logits(logits: mx.array, ids: list[int]) -> tuple[mx.array, mx.array]:
    """Each position's logprob of the next prompt token, and its top-k ids: the naive way, over the
    whole (T, vocab) block at once."""
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    picked = mx.take_along_axis(logprobs, mx.array(ids[1:])[:, None], axis=-1)[:, 0]
    part = mx.argpartition(-logprobs, kth=TOP_K - 1, axis=-1)[:, :TOP_K]
    order = mx.argsort(-mx.take_along_axis(logprobs, part, axis=-1), axis=-1)
    return picked, mx.take_along_axis(part, order, axis=-1)


def _full(b: Bench, ids: list[int]) -> tuple[list[float], list[int]]:
    model, chunk = b.engine.model, b.engine.options.prefill_chunk
    cache = model.make_cache()
    hidden = []
    inputs = mx.array(ids[:-1], dtype=mx.int32)[None]
    for start in range(0, inputs.shape[1], chunk):
        h = model.hidden(inputs[:, start : start + chunk], cache=cache)
        mx.eval(h, [c.state for c in cache])
        hidden.append(h[0])
    picked, top = _from_logits(model.logits(mx.concatenate(hidden)), ids)
    mx.eval(picked, top)
    return picked.tolist(), top[:, 0].tolist()  # type: ignore[return-value]


def _plain(b: Bench, ids: list[int]) -> tuple[list[float], list[int]]:
    model = b.engine.model
    logits = model(mx.array(ids[:-1], dtype=mx.int32)[None], cache=model.make_cache())[0]
    picked, top = _from_logits(logits, ids)
    mx.eval(picked, top)
    return picked.tolist(), top[:, 0].tolist()  # type: ignore[return-value]


def _scorer(b: Bench, ids: list[int]) -> tuple[list[float], list[int]]:
    (result,) = b.engine.score_many([[SeqRow("prompt_logprobs", [TokenSeq(ids, 1, TOP_K)])]])
    got = result.rows[0].prompt_logprobs
    assert got is not None
    return got.token_logprobs, [top[0].id for top in got.top_logprobs]


def prompt_logprobs(b: Bench) -> dict[str, Any]:
    """Each path on the same prompt of `logprob_prompt` tokens, in turns, cold (the prefix cache emptied
    before every run); the first turn warms up and is dropped when there are several."""
    n = min(b.sizes.logprob_prompt, b.engine.context_length)
    ids = b.engine.tokenizer.encode(b.maker.prompt(n))[:n]
    vocab = b.engine.model.args.vocab_size
    paths: dict[str, Callable[[Bench, list[int]], tuple[list[float], list[int]]]] = {
        SCORER: _scorer,
        FULL: _full,
        PLAIN: _plain,
    }
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in paths}
    answers: dict[str, tuple[list[float], list[int]]] = {}
    for _ in range(b.sizes.logprob_reps):
        for name, fn in paths.items():
            b.engine.free_memory()
            with memory() as mem:
                t0 = time.perf_counter()
                answers[name] = fn(b, ids)
                seconds = time.perf_counter() - t0
            runs[name].append({"s": seconds, **mem_fields(mem["peak"], mem["active0"])})
            print(f"    {name}: {seconds:.1f} s, {runs[name][-1]['peak_mib']:,.0f} MiB peak", flush=True)
    rows: dict[str, dict[str, Any]] = {}
    full_s = None
    for name, all_runs in runs.items():
        kept = all_runs[1:] if len(all_runs) > 1 else all_runs
        best = min(kept, key=lambda r: r["s"])
        full_s = full_s if name != FULL else best["s"]
        rows[name] = {**best, "tok_s": (n - 1) / best["s"], "runs": all_runs}
    ref_lp, ref_top = answers[PLAIN]
    for name, row in rows.items():
        row["vs_full_logits"] = row["s"] / full_s if full_s else None
        lp, top = answers[name]
        row["max_abs_logprob_diff"] = max(abs(x - y) for x, y in zip(lp, ref_lp, strict=True))
        row["top1_same"] = sum(x == y for x, y in zip(top, ref_top, strict=True)) / len(top)
    return {
        "prompt_tokens": n,
        "top_k": TOP_K,
        "vocab": vocab,
        "block_mib": round((n - 1) * vocab * 4 / 2**20, 1),
        "reps": b.sizes.logprob_reps,
        "rows": rows,
    }
