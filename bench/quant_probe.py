"""What a quantized projection costs against the same projection in dense weights, by number of rows.

MLX's quantized matmul is fast for one row (decode alone reads 4x fewer weight bytes) but on CUDA it
was measured far slower than a dense matmul for many rows (a 64-row decode batch of the 1B shape in
4-bit: 262 tok/s against 13.8k in bf16, `shared/gpu/README.md`). This times, for the Llama-3.2-1B
shapes, `quantized_matmul` against a matmul with the dequantized weight kept beside it, and against
dequantizing for each call, at 1 to 2,048 rows: where the lines cross is where a worker should switch.

    python -m bench.quant_probe [--bits 4] [--group-size 64] [--rows 1,8,64] [--repeats 20]

Prints a table; no JSON (a probe, like `bench.launch_probe`).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import mlx.core as mx

# (name, outputs, inputs) of the Llama-3.2-1B projections, q/k/v and gate/up fused as the engine runs them.
SHAPES_1B = [
    ("qkv", 3072, 2048),
    ("o", 2048, 2048),
    ("gate_up", 16384, 2048),
    ("down", 2048, 8192),
    ("lm_head", 128256, 2048),
]


def _median_ms(fn: Callable[[], mx.array], repeats: int) -> float:
    mx.eval(fn())  # the first call builds kernels
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128,512,2048")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args(argv)
    dtype = getattr(mx, args.dtype)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"device={mx.default_device()} mlx={mx.__version__} bits={args.bits} group={args.group_size}")
    print(
        "| projection | rows | quantized ms | quantized (rows, 1, K) ms | dense ms | dequantize+dense ms "
        "| quantized / dense |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, n_out, n_in in SHAPES_1B:
        for m, t_q, t_q3, t_d, t_dd in _time_shape(n_out, n_in, rows, dtype, args):
            print(
                f"| {name} {n_out}x{n_in} | {m} | {t_q:.3f} | {t_q3:.3f} | {t_d:.3f} | {t_dd:.3f} "
                f"| {t_q / t_d:.2f} |"
            )
        mx.clear_cache()


def _time_shape(
    n_out: int, n_in: int, rows: list[int], dtype: mx.Dtype, args: argparse.Namespace
) -> list[tuple[int, float, float, float, float]]:
    """(rows, quantized ms, the same with rows as (rows, 1, K), dense ms, dequantize+dense ms) for one
    projection at each row count."""
    q = dict(group_size=args.group_size, bits=args.bits)
    w = (mx.random.normal((n_out, n_in)) * 0.02).astype(dtype)
    wq, scales, biases = mx.quantize(w, **q)
    dense = mx.dequantize(wq, scales, biases, **q)
    mx.eval(wq, scales, biases, dense)
    out = []
    for m in rows:
        x = mx.random.normal((m, n_in)).astype(dtype)
        mx.eval(x)

        def quantized(x: mx.array = x) -> mx.array:
            return mx.quantized_matmul(x, wq, scales, biases, transpose=True, **q)

        def quantized_3d(x: mx.array = x[:, None, :]) -> mx.array:  # as a decode step's (rows, 1, K)
            return mx.quantized_matmul(x, wq, scales, biases, transpose=True, **q)

        def dequantized(x: mx.array = x) -> mx.array:
            return x @ mx.dequantize(wq, scales, biases, **q).T

        def plain(x: mx.array = x) -> mx.array:
            return x @ dense.T

        timed = (quantized, quantized_3d, plain, dequantized)
        out.append((m, *(_median_ms(fn, args.repeats) for fn in timed)))
    return out


if __name__ == "__main__":
    main()
