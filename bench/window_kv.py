"""`python -m bench.window_kv`: the KV bytes a long generation holds, by layer kind, against what a
sliding-window model needs (its windowed layers only their last `window` positions).

Runs a tiny random Gemma 3 (windowed layers around global ones) or a given checkpoint on the default
device: a prompt, then greedy decode to `--tokens` positions through the engine's own per-layer caches.
Prints the bytes allocated, the bytes the whole sequence fills, and the bytes the windows need: the
gap is what a rotating buffer for windowed layers would give back to the batch's KV budget.
"""

from __future__ import annotations

import argparse
import tempfile

import mlx.core as mx

from mlxq.worker.engine import Engine, EngineOptions

TINY_GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "num_hidden_layers": 6,
    "head_dim": 32,
    "sliding_window": 16,
    "sliding_window_pattern": 3,
    "query_pre_attn_scalar": 32,
    "max_position_embeddings": 4096,
}


def measure(engine: Engine, prompt_tokens: int, tokens: int) -> dict[str, int]:
    """Prefill `prompt_tokens` ids, decode greedily up to `tokens` positions; the caches' bytes."""
    model = engine.model
    caches = model.make_cache()
    ids = mx.array([[5 + i % 50 for i in range(prompt_tokens)]])
    token = mx.argmax(model(ids, cache=caches)[:, -1:], axis=-1)
    for _ in range(tokens - prompt_tokens):
        token = mx.argmax(model(token, cache=caches)[:, -1:], axis=-1)
        mx.eval(token)
    length = caches[0].offset
    column = [c.keys.shape[1] * c.keys.shape[3] * c.keys.dtype.size * 2 for c in caches]
    windows = model.model.windows
    return {
        "tokens": length,
        "windowed_layers": sum(w is not None for w in windows),
        "layers": len(windows),
        "allocated": sum(c.nbytes for c in caches),
        "filled": sum(b * length for b in column),
        "needed": sum(
            b * (length if w is None else min(length, w)) for b, w in zip(column, windows, strict=True)
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: a tiny random Gemma 3)")
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=500, help="sequence length at the end")
    args = parser.parse_args()
    folder = args.model
    if folder is None:
        from mlxq.worker.modelfiles.tiny_model import write_random_checkpoint

        folder = str(write_random_checkpoint(tempfile.mkdtemp(), TINY_GEMMA3, std=0.2))
    engine = Engine.load(folder, EngineOptions(prefix_cache_bytes=0))
    figures = measure(engine, args.prompt_tokens, args.tokens)
    for key, value in figures.items():
        print(f"{key:>16} {value:>12,}")
    print(f"{'needed/filled':>16} {figures['needed'] / figures['filled']:>12.3f}")


if __name__ == "__main__":
    main()
