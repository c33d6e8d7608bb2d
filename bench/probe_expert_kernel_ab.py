# ruff: noqa
"""Probe (temporary): one Qwen3-30B-A3B sparse layer's experts (128 x 2,048 -> 768, top 8, 4-bit group 64,
bf16) through the grouped experts' kernel as it is now against its previous source (bench/
probe_old_expert_kernel.py) and MLX's gather_qmm, rotating turns; median ms of a turn's evaluations."""

import importlib.util
import statistics
import sys
import time

import mlx.core as mx

sys.path.insert(0, ".")
from bench import probe_old_expert_kernel as old
from mlxq.worker.engine import expert_kernel as new

_spec = importlib.util.spec_from_file_location("rb4", new.__file__)
rb4 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rb4)
rb4._ROWS = 4


def layer(mod, x, gu, down, pairs):
    n = x.shape[0]
    h = mod.expert_matmul(x, *gu, pairs, 64, 8)
    g, u = mx.split(h, [768], axis=-1)
    a = (g * mx.sigmoid(g) * u).astype(x.dtype)
    return mod.expert_matmul(a, *down, pairs, 64, 1).reshape(n, 8, -1)


def pairs_path(x, gu, down, pairs):
    return layer(type("M", (), {"expert_matmul": staticmethod(new._gathered)}), x, gu, down, pairs)


def main() -> None:
    mx.random.seed(0)
    gu = mx.quantize((mx.random.normal((128, 1536, 2048)) * 2048**-0.5).astype(mx.bfloat16), 64, 4)
    down = mx.quantize((mx.random.normal((128, 2048, 768)) * 768**-0.5).astype(mx.bfloat16), 64, 4)
    mx.eval(gu, down)
    print(
        "| tokens | new kernel ms | old kernel ms | gather_qmm ms | old / new (turns' range) | max |new - old| |"
    )
    for tokens in [1, 4, 8, 16, 32, 64]:
        x = mx.random.normal((tokens, 2048)).astype(mx.bfloat16)
        pairs = (
            mx.argsort(mx.random.uniform(shape=(tokens, 128)), axis=-1)[:, :8].reshape(-1).astype(mx.uint32)
        )
        paths = {
            "new": lambda: layer(new, x, gu, down, pairs),
            "old": lambda: layer(old, x, gu, down, pairs),
            "rb4": lambda: layer(rb4, x, gu, down, pairs),
            "pairs": lambda: pairs_path(x, gu, down, pairs),
        }
        diff = mx.abs(paths["new"]().astype(mx.float32) - paths["old"]().astype(mx.float32)).max().item()
        med: dict[str, list[float]] = {k: [] for k in paths}
        for turn in range(10):
            for name in list(paths) if turn % 2 else list(reversed(paths)):
                f = paths[name]
                for _ in range(3):
                    mx.eval(f())
                ts = []
                for _ in range(20):
                    t = time.perf_counter()
                    mx.eval(f())
                    ts.append((time.perf_counter() - t) * 1e3)
                if turn >= 2:
                    med[name].append(statistics.median(ts))
        ratio = [o / n for o, n in zip(med["old"], med["new"], strict=False)]
        print(
            f"| {tokens} | {statistics.median(med['new']):.3f} | {statistics.median(med['old']):.3f} | "
            f"{statistics.median(med['pairs']):.3f} | rb4 {statistics.median(med['rb4']):.3f} | {statistics.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f}) | {diff:.3g} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
