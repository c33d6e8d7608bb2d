"""Two elementwise steps of every layer as one CUDA kernel each: fewer ops for MLX to launch.

A batched decode step on MLX's CUDA build is bound by the host's launch of its ops (~5-11 us each
besides matmuls, `bench/launch_probe.py`), not by the GPU. Each layer adds its attention output to the
residual and normalizes the sum, adds its MLP output and normalizes again (for the next layer or the
final norm), and computes silu(gate) * up: five or six ops that these kernels do in three.

- `add_rms_norm(x, r, weight, eps)`: (x + r, rms_norm(x + r) * weight). The sum is rounded to the
  inputs' dtype first and the norm taken of the rounded sum, as the two separate ops do.
- `swiglu(gate_up)`: silu(gate) * up of a fused gate/up projection's output (gate first).

CUDA only (`available()`), and only where the model is told to (`Model.fused_kernels`, set by the
engine). Elsewhere both compute the same with MLX's own ops, which is what the CPU tests run; on the GPU
the kernels agree with those ops within the dtype's rounding (their sums run in float32 in another
order), checked by `bench/fused_probe.py`.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from . import ragged_attention

_THREADS = 256

_ADD_RMS_NORM = """
    constexpr int NT = 256;
    const int row = blockIdx.x;
    const int tid = threadIdx.x;
    const size_t base = (size_t)row * H;
    float acc = 0.0f;
    for (int i = tid; i < H; i += NT) {
        const T s = static_cast<T>(static_cast<float>(x[base + i]) + static_cast<float>(r[base + i]));
        added[base + i] = s;
        const float f = static_cast<float>(s);
        acc += f * f;
    }
    __shared__ float part[NT / 32];
    #pragma unroll
    for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffff, acc, off);
    if ((tid & 31) == 0) part[tid >> 5] = acc;
    __syncthreads();
    float total = 0.0f;
    #pragma unroll
    for (int k = 0; k < NT / 32; ++k) total += part[k];
    const float inv = rsqrtf(total / H + eps[0]);
    for (int i = tid; i < H; i += NT) {
        const T scaled = static_cast<T>(static_cast<float>(added[base + i]) * inv);
        normed[base + i] = static_cast<T>(static_cast<float>(scaled) * static_cast<float>(w[i]));
    }
"""

_SWIGLU = """
    constexpr int NT = 256;
    constexpr int CHUNKS = (I + NT - 1) / NT;
    const int row = blockIdx.x / CHUNKS;
    const int j = (blockIdx.x % CHUNKS) * NT + threadIdx.x;
    if (j < I) {
        const float g = static_cast<float>(gate_up[(size_t)row * 2 * I + j]);
        const float u = static_cast<float>(gate_up[(size_t)row * 2 * I + I + j]);
        const T s = static_cast<T>(1.0f / (1.0f + __expf(-g)));
        const T a = static_cast<T>(g * static_cast<float>(s));
        out[(size_t)row * I + j] = static_cast<T>(static_cast<float>(a) * u);
    }
"""


def available() -> bool:
    """Whether the kernels can run: MLX's CUDA backend is the default device."""
    return ragged_attention.available()


@cache
def _kernels() -> tuple[Any, Any]:
    add_norm = mx.fast.cuda_kernel(
        name="mlxq_add_rms_norm",
        input_names=["x", "r", "w", "eps"],
        output_names=["added", "normed"],
        source=_ADD_RMS_NORM,
    )
    swiglu_kernel = mx.fast.cuda_kernel(
        name="mlxq_swiglu", input_names=["gate_up"], output_names=["out"], source=_SWIGLU
    )
    return add_norm, swiglu_kernel


@cache
def _eps(eps: float) -> mx.array:
    return mx.array([eps], dtype=mx.float32)


def add_rms_norm(x: mx.array, r: mx.array, norm: nn.RMSNorm, fused: bool) -> tuple[mx.array, mx.array]:
    """(x + r, norm(x + r)) for (..., H) arrays of one dtype; with `fused` (and CUDA) one kernel."""
    if not fused or x.dtype != r.dtype or x.dtype != norm.weight.dtype:
        s = x + r
        return s, norm(s)
    h = x.shape[-1]
    rows = x.size // h
    s, normed = _kernels()[0](
        inputs=[x, r, norm.weight, _eps(float(norm.eps))],
        template=[("T", x.dtype), ("H", h)],
        grid=(rows * _THREADS, 1, 1),
        threadgroup=(_THREADS, 1, 1),
        output_shapes=[x.shape, x.shape],
        output_dtypes=[x.dtype, x.dtype],
    )
    return s, normed


def swiglu(gate_up: mx.array, fused: bool) -> mx.array:
    """silu(gate) * up of (..., 2I) gate_up (gate first); with `fused` (and CUDA) one kernel."""
    inter = gate_up.shape[-1] // 2
    if not fused:
        return nn.silu(gate_up[..., :inter]) * gate_up[..., inter:]
    rows = gate_up.size // (2 * inter)
    chunks = -(-inter // _THREADS)
    (out,) = _kernels()[1](
        inputs=[gate_up],
        template=[("T", gate_up.dtype), ("I", inter)],
        grid=(rows * chunks * _THREADS, 1, 1),
        threadgroup=(_THREADS, 1, 1),
        output_shapes=[(*gate_up.shape[:-1], inter)],
        output_dtypes=[gate_up.dtype],
    )
    return out
