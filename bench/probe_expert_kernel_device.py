# ruff: noqa
"""Probe (temporary): the grouped experts' kernel's device time, not the host's: 20 gate/up projections
(Qwen3-30B-A3B, 128 x 2,048 -> 1,536, top 8, 4-bit group 64, bf16) on 20 inputs in one evaluation,
per projection, against its previous source and MLX's gather_qmm; median of 15 after 3."""

import importlib.util
import statistics
import sys
import time

import mlx.core as mx

sys.path.insert(0, ".")
from bench import probe_old_expert_kernel as old
from mlxq.worker.engine import expert_kernel as new


def _variant(name: str, **attrs: int):
    spec = importlib.util.spec_from_file_location(name, new.__file__)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for k, v in attrs.items():
        setattr(mod, k, v)
    return mod


t1 = _variant("t1", _TILES_FROM=1 << 30)
t2 = _variant("t2", _TILES=2)
rb8 = _variant("rb8", _ROWS=8)


def main() -> None:
    mx.random.seed(0)
    gu = mx.quantize((mx.random.normal((128, 1536, 2048)) * 2048**-0.5).astype(mx.bfloat16), 64, 4)
    mx.eval(gu)
    print(
        "| tokens | new (rb4 t4) us | t1 us | t2 us | rb8 t4 us | old us | gather_qmm us | experts read | GB/s (new) |"
    )
    for tokens in [1, 4, 8, 16, 32, 64]:
        xs = [mx.random.normal((tokens, 2048)).astype(mx.bfloat16) for _ in range(20)]
        pairs = mx.argsort(mx.random.uniform(shape=(tokens, 128)), axis=-1)[:, :8].reshape(-1)
        pairs = pairs.astype(mx.uint32)
        mx.eval(xs, pairs)
        chosen = len(set(pairs.tolist()))
        res = {}
        for name, f in [("new", new.expert_matmul), ("t1", t1.expert_matmul), ("t2", t2.expert_matmul),
                        ("rb8", rb8.expert_matmul), ("old", old.expert_matmul), ("pairs", new._gathered)]:  # fmt: skip
            ts = []
            for i in range(18):
                t = time.perf_counter()
                mx.eval([f(x, *gu, pairs, 64, 8) for x in xs])
                if i >= 3:
                    ts.append((time.perf_counter() - t) * 1e6 / 20)
            res[name] = statistics.median(ts)
        gbs = chosen * 1536 * (1024 + 2 * 2 * 32) / (res["new"] * 1e3)
        print(f"| {tokens} | {res['new']:.1f} | {res['t1']:.1f} | {res['t2']:.1f} | {res['rb8']:.1f} | {res['old']:.1f} | {res['pairs']:.1f} | "
              f"{chosen} | {gbs:.0f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
