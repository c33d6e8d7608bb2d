"""`python -m bench.window_kv`: the KV bytes a long sequence holds in the engine's caches, against what a
sliding-window model needs (its global layers every position, its windowed layers their last
`window`), and the rows a generation batch's KV budget seats.

Runs a tiny random Gemma 3 (five windowed layers to one global one, as Gemma 3 4B's 29 to 5, with its
1,024-token window) or a given checkpoint on the default device: for each length, a prompt prefilled
in chunks, then greedy decode steps (a windowed cache drops columns as it goes: `kv_cache.py`), alone
(`KVCache`) and as a decode batch's row (`BatchKVCache`). Prints the bytes allocated, the bytes the
whole sequence would fill, the bytes the windows need, and allocated / needed; then what a generation
batch's KV budget counts for a row that long (`Engine.kv_bytes`) against every layer's every column
(what it counted before windowed caches dropped columns): the ratio of rows it seats.
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

import mlx.core as mx

from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.engine.cache.batch_cache import BatchKVCache
from mlxq.worker.engine.cache.kv_cache import key_columns
from mlxq.worker.engine.generate import DecodeBatch, prefill
from mlxq.worker.engine.sampler import Sampler

TINY_GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "num_hidden_layers": 6,
    "head_dim": 32,
    "sliding_window": 1024,
    "sliding_window_pattern": 6,
    "query_pre_attn_scalar": 32,
    "max_position_embeddings": 32768,
}


def _bytes(caches: list[Any]) -> int:
    return sum(int(c.nbytes) for c in caches)


def measure(engine: Engine, length: int, decode: int, chunk: int) -> dict[str, int]:
    """Prefill `length - decode` ids in `chunk`s, decode `decode` greedy steps alone and as a batch row;
    the caches' bytes and what the sequence fills and needs."""
    model = engine.model
    ids = [5 + i % 50 for i in range(length - decode)]
    alone = model.make_cache()
    logits = prefill(model, ids, alone, chunk)
    for _ in range(decode):
        token = mx.argmax(logits, axis=-1)
        logits = model(token.reshape(1, 1), cache=alone)[:, -1, :]
        mx.eval(logits)
    cache = model.make_cache()
    batch = DecodeBatch(model)
    batch.add([cache], prefill(model, ids, cache, chunk), [Sampler(model.args.vocab_size, temperature=0.0)])
    for _ in range(decode):
        batch.step()
    column = [c.keys.shape[1] * c.keys.shape[3] * c.keys.dtype.size * 2 for c in alone]
    windows = model.model.windows
    return {
        "tokens": alone[0].offset,
        "windowed_layers": sum(w is not None for w in windows),
        "layers": len(windows),
        "allocated": _bytes(alone),
        "batch_allocated": _bytes(batch.cache),
        "filled": sum(b * length for b in column),
        "needed": sum(
            b * (length if w is None else min(length, w)) for b, w in zip(column, windows, strict=True)
        ),
        # What a generation batch's budget counts for a row this long (`GenerationBatch._fits`), and
        # what it counted when every layer was taken to hold every column.
        "budget_per_row": engine.kv_bytes(key_columns(length + BatchKVCache.step)),
        "full_per_row": engine.kv_bytes_per_token * key_columns(length + BatchKVCache.step),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: a tiny random Gemma 3)")
    parser.add_argument("--lengths", default="1024,2048,4096,8192", help="sequence lengths at the end")
    parser.add_argument("--decode", type=int, default=300, help="decode steps ending each sequence")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk")
    args = parser.parse_args()
    folder = args.model
    if folder is None:
        from mlxq.worker.modelfiles.tiny_model import write_random_checkpoint

        folder = str(write_random_checkpoint(tempfile.mkdtemp(), TINY_GEMMA3, std=0.2))
    engine = Engine.load(folder, EngineOptions(prefix_cache_bytes=0))
    keys = ["tokens", "allocated", "batch_allocated", "filled", "needed", "budget_per_row", "full_per_row"]
    print(" ".join(f"{k:>15}" for k in [*keys, "alloc/needed", "batch/needed", "full/budget"]))
    for length in (int(n) for n in args.lengths.split(",")):
        f = measure(engine, length, args.decode, args.chunk)
        ratios = [f["allocated"] / f["needed"], f["batch_allocated"] / f["needed"]]
        ratios.append(f["full_per_row"] / f["budget_per_row"])
        print(" ".join(f"{f[k]:>15,}" for k in keys) + " " + " ".join(f"{r:>15.3f}" for r in ratios))
    print(f"windowed layers {f['windowed_layers']} of {f['layers']}")


if __name__ == "__main__":
    main()
