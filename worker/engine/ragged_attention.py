"""One decode step's attention for rows of different lengths, as one CUDA kernel.

A `DecodeBatch` keeps its rows left-padded in one buffer (`batch_cache.py`), so each row attends to its
own columns `start[row] .. end-1` only. MLX's fast attention takes no per-row mask when decoding on
CUDA: with a mask it falls back to unfused ops, several times the fused attention's time and about
half a decode step (`bench/README.md`, what the engine's defaults rest on). This
kernel reads each row's columns straight from the cache buffer: one thread block per (row, kv head),
one warp per query head of that group, the lanes splitting the row's keys with an online softmax in
float32, then one warp reduction.

That layout keeps a whole query and output row in each lane's registers, which fits narrow heads only:
from `WIDE_FROM` dimensions on (Gemma 3's 256) the registers would spill to memory, so wide heads take a
second kernel (`_WIDE_SOURCE`) that splits each row's dimensions across the lanes instead (a key's score
is a warp reduction) and its keys across several warps per query head, whose partial softmax sums meet
in shared memory.

CUDA only (`available()`): a decode batch uses it there by default and MLX's masked attention
elsewhere. On other devices `decode_attention` computes the same thing with MLX's masked attention, so
the batch's use of it is tested on the CPU; the kernel's results equal MLX's masked attention within
bf16 rounding (its sums run in float32 in another order): `tests/engine/test_ragged_kernel.py`, run on
the GPU.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx

from mlxq.worker.engine.device import on_cuda

_SOURCE = """
    constexpr int WARP = 32;
    constexpr int PACK = 16 / sizeof(T);  // elements per 16-byte load
    const int block = blockIdx.x;
    const int b = block / HKV;
    const int hk = block % HKV;
    const int lane = threadIdx.x % WARP;
    const int h = hk * REP + threadIdx.x / WARP;
    const int end = meta[0];
    const int capacity = meta[1];
    const int start = starts[b];

    const T* qp = q + (size_t)(b * QH + h) * D;  // QH: heads per row of q (keys' heads may follow)
    const float sc = rsqrtf((float)D);
    float qr[D];
    #pragma unroll
    for (int d = 0; d < D; ++d) qr[d] = static_cast<float>(qp[d]) * sc;

    const size_t base = (size_t)(b * HKV + hk) * capacity * D;
    float m = -INFINITY;
    float l = 0.0f;
    float o[D];
    #pragma unroll
    for (int d = 0; d < D; ++d) o[d] = 0.0f;
    for (int j = start + lane; j < end; j += WARP) {
        const uint4* kr = reinterpret_cast<const uint4*>(keys + base + (size_t)j * D);
        float s = 0.0f;
        #pragma unroll
        for (int c = 0; c < D / PACK; ++c) {
            const uint4 u = __ldg(kr + c);
            const T* e = reinterpret_cast<const T*>(&u);
            #pragma unroll
            for (int i = 0; i < PACK; ++i) s += qr[c * PACK + i] * static_cast<float>(e[i]);
        }
        const float m_new = fmaxf(m, s);
        const float keep = __expf(m - m_new);
        const float p = __expf(s - m_new);
        l = l * keep + p;
        const uint4* vr = reinterpret_cast<const uint4*>(values + base + (size_t)j * D);
        #pragma unroll
        for (int c = 0; c < D / PACK; ++c) {
            const uint4 u = __ldg(vr + c);
            const T* e = reinterpret_cast<const T*>(&u);
            #pragma unroll
            for (int i = 0; i < PACK; ++i) {
                o[c * PACK + i] = o[c * PACK + i] * keep + p * static_cast<float>(e[i]);
            }
        }
        m = m_new;
    }

    float top = m;
    #pragma unroll
    for (int off = WARP / 2; off > 0; off /= 2) top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, off));
    const float f = (m == -INFINITY) ? 0.0f : __expf(m - top);
    l *= f;
    #pragma unroll
    for (int off = WARP / 2; off > 0; off /= 2) l += __shfl_xor_sync(0xffffffff, l, off);
    T* op = out + (size_t)(b * HKV * REP + h) * D;
    #pragma unroll
    for (int d = 0; d < D; ++d) {
        float x = o[d] * f;
        #pragma unroll
        for (int off = WARP / 2; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffff, x, off);
        if (d % WARP == lane) op[d] = static_cast<T>(x / l);
    }
"""

# Each lane owns D / 32 dimensions of its query head; warp w of a block handles query head w % REP of
# the block's kv head and every SPLIT-th key from the row's start (w / REP: its share); the SPLIT
# partial (max, sum, output) of a head are then combined by its first warp.
_WIDE_SOURCE = """
    constexpr int WARP = 32;
    constexpr int E = D / WARP;  // dimensions per lane
    const int block = blockIdx.x;
    const int b = block / HKV;
    const int hk = block % HKV;
    const int warp = threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    const int r = warp % REP;
    const int share = warp / REP;
    const int h = hk * REP + r;
    const int end = meta[0];
    const int capacity = meta[1];
    const int start = starts[b];

    const T* qp = q + (size_t)(b * QH + h) * D + lane * E;
    const float sc = rsqrtf((float)D);
    float qr[E];
    #pragma unroll
    for (int e = 0; e < E; ++e) qr[e] = static_cast<float>(qp[e]) * sc;

    const size_t base = (size_t)(b * HKV + hk) * capacity * D + lane * E;
    float m = -INFINITY;
    float l = 0.0f;
    float o[E];
    #pragma unroll
    for (int e = 0; e < E; ++e) o[e] = 0.0f;
    for (int j = start + share; j < end; j += SPLIT) {
        const T* kr = keys + base + (size_t)j * D;
        float s = 0.0f;
        #pragma unroll
        for (int e = 0; e < E; ++e) s += qr[e] * static_cast<float>(kr[e]);
        #pragma unroll
        for (int off = WARP / 2; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffff, s, off);
        const float m_new = fmaxf(m, s);
        const float keep = __expf(m - m_new);
        const float p = __expf(s - m_new);
        l = l * keep + p;
        const T* vr = values + base + (size_t)j * D;
        #pragma unroll
        for (int e = 0; e < E; ++e) o[e] = o[e] * keep + p * static_cast<float>(vr[e]);
        m = m_new;
    }

    __shared__ float part_m[REP * SPLIT];
    __shared__ float part_l[REP * SPLIT];
    __shared__ float part_o[REP * SPLIT * D];
    if (lane == 0) {
        part_m[warp] = m;
        part_l[warp] = l;
    }
    #pragma unroll
    for (int e = 0; e < E; ++e) part_o[warp * D + lane * E + e] = o[e];
    __syncthreads();
    if (share == 0) {
        float top = -INFINITY;
        for (int t = 0; t < SPLIT; ++t) top = fmaxf(top, part_m[t * REP + r]);
        float total = 0.0f;
        float acc[E];
        #pragma unroll
        for (int e = 0; e < E; ++e) acc[e] = 0.0f;
        for (int t = 0; t < SPLIT; ++t) {
            const int w = t * REP + r;
            const float f = (part_m[w] == -INFINITY) ? 0.0f : __expf(part_m[w] - top);
            total += part_l[w] * f;
            #pragma unroll
            for (int e = 0; e < E; ++e) acc[e] += part_o[w * D + lane * E + e] * f;
        }
        T* op = out + (size_t)(b * HKV * REP + h) * D + lane * E;
        #pragma unroll
        for (int e = 0; e < E; ++e) op[e] = static_cast<T>(acc[e] / total);
    }
"""

# Head dimensions from which the wide kernel runs: a narrow kernel's lane holds 2 x D floats.
WIDE_FROM = 128
# Warps of a wide block at most (REP x SPLIT): 512 threads, and 32 KiB of shared partial outputs at D=256.
_WIDE_WARPS = 16


def available() -> bool:
    """Whether the kernel can run: MLX's CUDA backend is the default device (not Metal, not the CPU)."""
    return on_cuda() and hasattr(mx.fast, "cuda_kernel")


@cache
def _kernel(wide: bool = False) -> Any:
    return mx.fast.cuda_kernel(
        name="mlxq_ragged_decode_attention_wide" if wide else "mlxq_ragged_decode_attention",
        input_names=["q", "keys", "values", "starts", "meta"],
        output_names=["out"],
        source=_WIDE_SOURCE if wide else _SOURCE,
    )


class RaggedRows:
    """What a decode step's attention needs to know of a left-padded batch, built once per step and
    passed to the model in place of a mask: each row's first column, the columns written, and each
    row's RoPE position of the new token (one array for every layer, not one per layer)."""

    def __init__(self, starts: mx.array, end: int, capacity: int) -> None:
        self.starts = starts  # (B,) int32
        self.end = end  # columns written, this step's new one included
        self.meta = mx.array([end, capacity], dtype=mx.int32)
        self.positions = (end - 1) - starts  # (B,) int32: each row's length before the new token
        self.capacity = capacity
        self._placed: dict[tuple[int, int], RaggedRows] = {}

    def window(self, window: int) -> RaggedRows:
        """The same step for a sliding-window layer: each row's first visible column moves up to the
        last `window` columns (the new token's own included); positions are unchanged."""
        return self._moved(mx.maximum(self.starts, self.end - window), self.end, self.capacity, self.meta)

    def placed(self, base: int, capacity: int) -> RaggedRows:
        """The same step over a layer's buffers that start at column `base` of the batch (a windowed
        layer's cache drops its oldest columns: `batch_cache.py`) and hold `capacity` columns: every
        column moved down by `base`. Made once per (base, capacity): every windowed layer of a forward
        holds the same columns."""
        if base == 0 and capacity == self.capacity:
            return self
        key = (base, capacity)
        if key not in self._placed:
            meta = mx.array([self.end - base, capacity], dtype=mx.int32)
            self._placed[key] = self._moved(self.starts - base, self.end - base, capacity, meta)
        return self._placed[key]

    def _moved(self, starts: mx.array, end: int, capacity: int, meta: mx.array) -> RaggedRows:
        """The same step's positions over other columns (no op for the positions)."""
        rows = RaggedRows.__new__(RaggedRows)
        rows.starts, rows.end, rows.capacity, rows.meta = starts, end, capacity, meta
        rows.positions, rows._placed = self.positions, {}
        return rows


def decode_attention(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    rows: RaggedRows,
    scale: float,
    heads: int | None = None,
    shape: tuple[int, ...] | None = None,
) -> mx.array:
    """Attention of (B, H, 1, D) queries over each row's columns `starts[b] .. end-1` of the
    (B, H_kv, capacity, D) cache buffers; returns (B, H, 1, D) in the queries' dtype.

    `heads`: the queries are q's first `heads` heads (the rest, e.g. the new keys that shared their
    RoPE with them, are not read): the kernel takes q whole, where a slice of it would be copied.
    `shape`: the output in that shape instead, of the same elements in the same order (the heads
    merged for the output projection, as (B, H * D)): the kernel writes it so, where a reshape after
    it would be one more op to launch."""
    b, qh, _, d = q.shape
    h = qh if heads is None else heads
    hkv = keys.shape[1]
    if not available() or abs(scale - d**-0.5) > 1e-9 or (d * q.dtype.size) % 16:
        masked = _masked(q[:, :h] if h < qh else q, keys, values, rows, scale)
        return masked if shape is None else masked.reshape(shape)
    rep = h // hkv
    template = [("T", q.dtype), ("D", d), ("HKV", hkv), ("REP", rep), ("QH", qh)]
    wide = d >= WIDE_FROM and d % 32 == 0 and rep <= _WIDE_WARPS
    split = max(1, _WIDE_WARPS // rep) if wide else 1
    out: mx.array  # MLX types a custom kernel as `object`
    (out,) = _kernel(wide)(
        inputs=[q, keys, values, rows.starts, rows.meta],
        template=[*template, ("SPLIT", split)] if wide else template,
        grid=(b * hkv * rep * split * 32, 1, 1),
        threadgroup=(rep * split * 32, 1, 1),
        output_shapes=[shape if shape is not None else (b, h, 1, d)],
        output_dtypes=[q.dtype],
    )
    return out


def _masked(q: mx.array, keys: mx.array, values: mx.array, rows: RaggedRows, scale: float) -> mx.array:
    """The same attention through MLX: each row's columns before its start masked."""
    visible = mx.arange(rows.end)[None, :] >= rows.starts[:, None]
    k, v = keys[..., : rows.end, :], values[..., : rows.end, :]
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=visible[:, None, None, :])
