"""Probe (temporary): the host's build of one decode step's graph, compiled layer parts against plain,
for a tiny MoE of Qwen3-30B-A3B's layout (48 layers, 128 experts, 8 a token), 4-bit group 32, bf16.

python -m bench.probe_step_build [rows ...]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from bench.step_ops import PROMPT, count_ops
from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.engine.decode_batch import DecodeBatch
from mlxq.worker.engine.models.loader import load_model, save_quantized
from mlxq.worker.engine.prefill import prefill
from mlxq.worker.engine.sampler import Sampler
from mlxq.worker.modelfiles.tiny_model import write_random_checkpoint

CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "num_hidden_layers": 48,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 64,
    "intermediate_size": 256,
    "norm_topk_prob": True,
}


def builds(engine: Engine, rows: int, n: int = 60) -> tuple[list[float], int]:
    model = engine.model
    vocab = model.args.vocab_size
    caches = [model.make_cache() for _ in range(rows)]
    logits = [
        prefill(model, [(7 * r + i) % (vocab - 1) + 1 for i in range(PROMPT + r % 3)], c, chunk=PROMPT + 2)
        for r, c in enumerate(caches)
    ]
    batch = DecodeBatch(model, engine.pad_shapes)
    batch.add(caches, mx.concatenate(logits), [Sampler(vocab, temperature=0) for _ in range(rows)])
    batch.step()
    times, ops = [], 0
    for i in range(n):
        assert batch.pending.tokens is not None
        began = time.perf_counter()
        out = batch._next_step(batch.pending.tokens)
        times.append(time.perf_counter() - began)
        buffers = [a for c in batch.cache for a in (c.keys, c.values) if a is not None]
        if i == n - 1:
            ops = sum(count_ops(out, *buffers).values())
        mx.eval(out, *buffers)
    return times[10:], ops


def main() -> None:
    sizes = [int(a) for a in sys.argv[1:]] or [1, 32]
    with tempfile.TemporaryDirectory() as tmp:
        src = write_random_checkpoint(Path(tmp) / "src", CONFIG, dtype="bfloat16")
        model, config = load_model(src)
        folder = save_quantized(model, config, Path(tmp) / "q4", bits=4, group_size=32, copy_from=src)
        del model
        options = {c: EngineOptions(prefill_chunk=16, prefix_cache_bytes=0, compiled_steps=c) for c in (0, 1)}
        engines = {bool(c): Engine.load(str(folder), o) for c, o in options.items()}
        for rows in sizes:
            for turn in range(3):
                for compiled, engine in engines.items():
                    t, ops = builds(engine, rows)
                    print(
                        f"rows {rows} turn {turn} compiled {compiled}: build median "
                        f"{1e3 * statistics.median(t):.2f} ms, p10 {1e3 * sorted(t)[len(t) // 10]:.2f}, "
                        f"primitives {ops}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
