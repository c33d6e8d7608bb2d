"""Probe: the MLX graphs the decode loop hands MLX, to compare before and after a refactor.

For a tiny random Llama and a 4-bit Qwen3-MoE: `engine_step_ops` at 1 and 8 rows, with and without
`pad_shapes`; then generation batches run end to end (plain decoding, prompt-lookup verify steps,
constrained rows, with and without a launcher), every `mx.eval`/`mx.async_eval` noted with the
primitives of the graph it evaluates (per thread, in order), plus the tokens and the engine's
attributes. Writes one JSON file; compare two runs with `diff`.

    python bench/probe_step_graph.py OUT.json
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.step_ops import count_ops, engine_step_ops
from mlxq.jobs.schema import GenerateRequest
from mlxq.worker.engine import Engine
from mlxq.worker.engine import launcher as launchers
from mlxq.worker.engine.decode_batch import DecodeBatch
from mlxq.worker.engine.engine_options import EngineOptions
from mlxq.worker.engine.generation_batch import GenerationBatch
from mlxq.worker.engine.models.loader import load_model, save_quantized
from mlxq.worker.engine.prefill import prefill
from mlxq.worker.engine.sampler import Sampler
from mlxq.worker.engine.speculation.policy import DraftPolicy
from tests.reference import make_hf_checkpoint

QWEN3_MOE = {"num_experts": 5, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True}
TRACE: dict[str, list[str]] = {}
_eval, _async_eval = mx.eval, mx.async_eval


def _note(kind: str, args: tuple[Any, ...]) -> None:
    arrays = [a for _, a in tree_flatten(list(args)) if isinstance(a, mx.array)]
    ops = count_ops(*arrays) if arrays else {}
    line = f"{kind} n={len(arrays)} " + " ".join(f"{k}={v}" for k, v in sorted(ops.items()))
    TRACE.setdefault("main" if threading.current_thread() is threading.main_thread() else "other", []).append(
        line
    )


def _traced_eval(*args: Any) -> Any:
    _note("eval", args)
    return _eval(*args)


def _traced_async_eval(*args: Any) -> Any:
    _note("async_eval", args)
    return _async_eval(*args)


def _attributes(engine: Engine) -> dict[str, str]:
    return {
        k: type(v).__name__ + (f"={v}" if isinstance(v, (bool, int, str, type(None))) else "")
        for k, v in vars(engine).items()
    }


def _run(engine: Engine, requests: list[GenerateRequest], rows: int) -> dict[str, Any]:
    TRACE.clear()
    mx.eval, mx.async_eval = _traced_eval, _traced_async_eval
    try:
        batch = GenerationBatch(engine, max_sequences=rows)
        done: dict[str, Any] = {}
        todo = list(enumerate(requests))
        steps = 0
        while todo or len(batch):
            while todo and batch.free_slots > 0:
                i, request = todo.pop(0)
                batch.admit(str(i), request, lambda _t, _ids: None, lambda: False)
            for f in batch.step():
                done[f.key] = f.result.token_ids if f.result else str(f.error)
            steps += 1
        batch.close()
    finally:
        mx.eval, mx.async_eval = _eval, _async_eval
    trace = {k: v for k, v in TRACE.items()}
    text = json.dumps(trace, sort_keys=True)
    return {
        "steps": steps,
        "tokens": done,
        "evals": {k: len(v) for k, v in trace.items()},
        "trace_sha": hashlib.sha256(text.encode()).hexdigest()[:16],
        "verify_shapes": sorted(engine.verify_shapes),
        "trace": trace,
    }


def _direct(engine: Engine, rows: int, overlap: bool) -> dict[str, Any]:
    """A `DecodeBatch` driven by hand: plain steps, verify steps drafting the greedy continuation (some
    drafts spoilt, some rows drafting nothing), a verify step with no drafts at all, a row removed."""
    model = engine.model
    vocab = model.args.vocab_size
    held = launchers.acquire() if overlap else None

    def batch() -> DecodeBatch:
        caches = [model.make_cache() for _ in range(rows)]
        logits = [
            prefill(model, [(7 * r + i) % (vocab - 1) + 1 for i in range(8 + r % 3)], c, chunk=10)
            for r, c in enumerate(caches)
        ]
        b = DecodeBatch(model, engine.pad_shapes, launcher=held)
        b.add(caches, mx.concatenate(logits), [Sampler(vocab, temperature=0) for _ in range(rows)])
        return b

    plain = batch()
    ref: list[list[int]] = [[] for _ in range(rows)]
    for _ in range(40):
        for r, t in enumerate(plain.step()):
            ref[r].append(t)
    plain.quiet()
    TRACE.clear()
    mx.eval, mx.async_eval = _traced_eval, _traced_async_eval
    got: list[Any] = []
    try:
        b = batch()
        live = list(range(rows))
        pos = [0] * rows
        n = [0]

        def handle(out: list[list[int]]) -> list[list[int]]:
            for i, ts in enumerate(out):
                pos[live[i]] += len(ts)
            got.append(out)
            return out

        def drafts_for(tokens: list[int]) -> list[list[int]]:
            n[0] += 1
            out = []
            for i in range(len(tokens)):
                r = live[i]
                d = list(ref[r][pos[r] + 1 : pos[r] + 1 + (r + n[0]) % 4])
                if d and r % 4 == 3:
                    d[-1] = (d[-1] + 1) % vocab
                out.append(d)
            return out

        nothing = lambda tokens: [[] for _ in tokens]  # noqa: E731
        single = lambda out: handle([[t] for t in out])  # noqa: E731
        for kind in "svvsnssv" + ("r" if rows > 1 else "") + "vsvs":
            if kind == "s":
                b.step_with(single, ends_all=lambda _o: False)
            elif kind == "v":
                b.verify_with(drafts_for, handle, meanwhile=lambda: None)
            elif kind == "n":
                b.verify_with(nothing, handle)
            else:
                b.remove([0])
                live.pop(0)
        b.quiet()
    finally:
        mx.eval, mx.async_eval = _eval, _async_eval
        if held is not None:
            launchers.release(held)
    trace = {k: v for k, v in TRACE.items()}
    text = json.dumps(trace, sort_keys=True)
    return {
        "handled": got,
        "evals": {k: len(v) for k, v in trace.items()},
        "trace_sha": hashlib.sha256(text.encode()).hexdigest()[:16],
        "trace": trace,
    }


def main(out: str) -> None:
    mx.random.seed(0)
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        llama = make_hf_checkpoint(Path(tmp) / "llama", max_position_embeddings=512)
        moe_src = make_hf_checkpoint(
            Path(tmp) / "moe", "Qwen3MoeForCausalLM", max_position_embeddings=512, **QWEN3_MOE
        )
        model, config = load_model(moe_src)
        moe = save_quantized(model, config, Path(tmp) / "moe_q4", bits=4, group_size=32, copy_from=moe_src)
        prompt = "The capital of France is Paris. The capital of France is"
        plain = [
            GenerateRequest(prompt=prompt * (1 + i % 2), max_tokens=10, temperature=0.0) for i in range(5)
        ]
        seeded = [GenerateRequest(prompt=prompt, max_tokens=8, temperature=0.8, seed=3 + i) for i in range(3)]
        regex = {"type": "regex", "regex": r"20[0-9]{2}-(0[1-9]|1[0-2])"}
        constrained = [GenerateRequest(prompt="Date:", max_tokens=8, temperature=0.0, response_format=regex)]
        policy = DraftPolicy(min_acceptance=0.0, only_likely=False)
        for name, folder in (("llama", llama), ("qwen3moe_q4", moe)):
            for pad in (False, True):
                base = EngineOptions(prefill_chunk=16, prefix_cache_bytes=0, pad_shapes=pad)
                engine = Engine.load(str(folder), base)
                for rows in (1, 8):
                    ops = engine_step_ops(engine, rows)
                    report[f"{name} step_ops rows={rows} pad={pad}"] = {
                        "total": sum(ops.values()),
                        "by_name": ops,
                    }
                report[f"{name} attrs pad={pad}"] = _attributes(engine)
                for rows in (1, 8):
                    for overlap in (False, True):
                        report[f"{name} direct rows={rows} pad={pad} overlap={overlap}"] = _direct(
                            engine, rows, overlap
                        )
                report[f"{name} plain pad={pad}"] = _run(engine, plain + seeded + constrained, 4)
                engine.close()
                for overlap in (False, True):
                    opts = EngineOptions(
                        prefill_chunk=16,
                        prefix_cache_bytes=0,
                        pad_shapes=pad,
                        decode_overlap=overlap,
                        speculation="prompt_lookup",
                        draft_policy=policy,
                    )
                    engine = Engine.load(str(folder), opts)
                    report[f"{name} attrs lookup pad={pad} overlap={overlap}"] = _attributes(engine)
                    report[f"{name} lookup pad={pad} overlap={overlap}"] = _run(
                        engine, plain + constrained, 4
                    )
                    engine.close()
    Path(out).write_text(json.dumps(report, indent=1, sort_keys=True, default=str))
    for key, value in report.items():
        if "step_ops" in key:
            print(key, value["total"])
        elif "attrs" not in key:
            print(key, "steps", value.get("steps"), "evals", value["evals"], "sha", value["trace_sha"])


if __name__ == "__main__":
    main(sys.argv[1])
