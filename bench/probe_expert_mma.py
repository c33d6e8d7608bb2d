# ruff: noqa
"""Probe (temporary): the grouped experts' kernel's tensor-core form against its scalar form and MLX's
gather_qmm, device time of 20 projections on 20 inputs in one evaluation, per projection, rotating the
variants each repetition (median of 12 after 3); Qwen3-30B-A3B's gate/up (128 x 2,048 -> 1,536, top 8)
and down (768 -> 2,048, a row a pair), 4-bit group 64, bf16. Each variant's largest error against
gather_qmm is printed first."""

import statistics
import sys
import time

import mlx.core as mx
import numpy as np

sys.path.insert(0, ".")
from mlxq.worker.engine import expert_kernel as ek

MMA = {
    "w4m2": dict(WARPS=4, KS=1, MT=2, NT=1, TILES=1, UNROLL=2),
    "w8k4m2": dict(WARPS=8, KS=4, MT=2, NT=1, TILES=1, UNROLL=2),
    "w4k2m2": dict(WARPS=4, KS=2, MT=2, NT=1, TILES=1, UNROLL=2),
    "w4k4m2": dict(WARPS=4, KS=4, MT=2, NT=1, TILES=1, UNROLL=2),
    "w4k4m1": dict(WARPS=4, KS=4, MT=1, NT=1, TILES=1, UNROLL=2),
    "w8k2m2": dict(WARPS=8, KS=2, MT=2, NT=1, TILES=1, UNROLL=2),
    "w8k4m2u1": dict(WARPS=8, KS=4, MT=2, NT=1, TILES=1, UNROLL=1),
    "w8k4m2t2": dict(WARPS=8, KS=4, MT=2, NT=1, TILES=2, UNROLL=2),
    "w8k4m1": dict(WARPS=8, KS=4, MT=1, NT=1, TILES=1, UNROLL=2),
}


def variants(per_row):
    out = {"scalar": lambda x, w, pairs: ek.expert_matmul(x, *w, pairs, 64, per_row, "scalar")}
    for name, layout in MMA.items():
        out[name] = lambda x, w, pairs, layout=layout: ek._launch(x, *w, pairs, 64, per_row, "mma", **layout)
    out["gather_qmm"] = lambda x, w, pairs: ek._gathered(x, *w, pairs, 64, per_row)
    return out


def main() -> None:
    mx.random.seed(0)
    projections = {
        "gate/up": (
            mx.quantize((mx.random.normal((128, 1536, 2048)) * 2048**-0.5).astype(mx.bfloat16), 64, 4),
            8,
        ),
        "down": (mx.quantize((mx.random.normal((128, 2048, 768)) * 768**-0.5).astype(mx.bfloat16), 64, 4), 1),
    }
    for name, (w, per_row) in projections.items():
        mx.eval(w)
        fs = variants(per_row)
        print(f"\n{name}: us a projection (median of 12, range)")
        print("| tokens | experts | " + " | ".join(fs) + " |")
        for tokens in [1, 2, 4, 8, 16, 32, 64]:
            pairs = (
                mx.argsort(mx.random.uniform(shape=(tokens, 128)), axis=-1)[:, :8]
                .reshape(-1)
                .astype(mx.uint32)
            )
            inputs = w[0].shape[-1] * 8
            xs = [mx.random.normal((pairs.size // per_row, inputs)).astype(mx.bfloat16) for _ in range(20)]
            mx.eval(xs, pairs)
            want = np.array(fs["gather_qmm"](xs[0], w, pairs).astype(mx.float32))
            errs = {
                k: float(np.abs(np.array(f(xs[0], w, pairs).astype(mx.float32)) - want).max())
                for k, f in fs.items()
            }
            bad = {
                k: round(v, 4) for k, v in errs.items() if not v <= 3e-2 * max(1.0, float(np.abs(want).max()))
            }
            if bad:
                print(f"  tokens {tokens}: OFF gather_qmm: {bad} (scale {float(np.abs(want).max()):.3g})")
            ts = {k: [] for k in fs}
            for i in range(15):
                order = list(fs)[i % len(fs) :] + list(fs)[: i % len(fs)]
                for k in order:
                    t = time.perf_counter()
                    mx.eval([fs[k](x, w, pairs) for x in xs])
                    if i >= 3:
                        ts[k].append((time.perf_counter() - t) * 1e6 / 20)
            cells = " | ".join(f"{statistics.median(v):.1f}" for v in ts.values())
            print(f"| {tokens} | {len(set(pairs.tolist()))} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
