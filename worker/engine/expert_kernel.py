"""A few tokens' gathered matmuls through 4-bit experts, as one CUDA kernel that reads each expert once.

A sparse layer multiplies each (token, expert) pair's row by its expert's weight. MLX's CUDA
`gather_qmm` computes every pair on its own, a tile of rows for its one row, reading the pair's expert
again each time (bench/README, "A MoE layer's experts on CUDA"): at 32 tokens of top-8 that is 256
expert reads a projection where ~110 experts are chosen, and each read fills a tensor-core tile for one
row. This kernel turns it around: one thread block per (chosen expert, tile of output columns) finds
its expert (the n-th of those the step's few hundred expert ids name) and the pairs routed to it, reads
its tile of the expert's packed weights once, and multiplies every such pair's row by it. Blocks are
launched for as many experts as there are pairs at most, so a token's step launches a block per
expert it chose, and unchosen experts are never read. From `_TILES_FROM` pairs on a block computes
`_TILES` column tiles in turn, so that finding its expert and rows is paid once for more columns.

Inside a block each warp owns a few output columns. A lane takes 32 inputs of each column at a time (one
16-byte load of packed words: a warp's loads are a column's 512 contiguous bytes), dequantizes them
once, `scale * q + bias` in float32 with the nibble turned into a float by its bits (no integer
conversion), and multiplies every routed row's 32 inputs by them; one warp reduction a (row, column)
at the end. Dequantizing once for all of an expert's rows, not once a row, keeps the arithmetic a
weight costs from growing with the rows routed to its expert.

Affine 4-bit experts with biases only (mlx-community's default), inputs a multiple of 256, groups of a
multiple of 32, outputs of 32, at most `MAX_ROWS` rows routed to one expert (a token chooses an expert
once: at most that many tokens). CUDA only (`available()`); elsewhere, and for any other layout,
`SwitchGLU` keeps MLX's gathered matmuls. Its results against MLX's within bf16 rounding:
`tests/engine/test_expert_kernel.py`, run on the GPU. A worker also checks each shape it will run once,
when the model loads (`agrees`): a kernel that fails to build or disagrees with MLX's matmul under some
MLX release is logged and left unused.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

import mlx.core as mx
import numpy as np

from mlxq.worker.engine.device import on_cuda

log = logging.getLogger(__name__)

# Rows one expert may be given in one call: the shared list of a block's pairs.
MAX_ROWS = 64

_WARPS = 8  # a block's warps: 256 threads
_COLUMNS = 4  # output columns a warp computes at once (their packed words, scales, biases in registers)
_ROWS = 4  # rows a warp multiplies in one pass over its columns (their sums in registers)
_TILES = 4  # column tiles a block computes in turn, from `_TILES_FROM` pairs on (`_tiles`)
_TILES_FROM = 32

_HEADER = """
// Eight consecutive inputs as floats: one 16-byte load for 16-bit types (two for float) where the
// address allows it, else one load an input.
__device__ __forceinline__ void mlxq_inputs8(const float* p, float* o, bool vector) {
    if (vector) {
        const float4 a = reinterpret_cast<const float4*>(p)[0];
        const float4 b = reinterpret_cast<const float4*>(p)[1];
        o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w; o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
    } else {
        #pragma unroll
        for (int j = 0; j < 8; ++j) o[j] = p[j];
    }
}
__device__ __forceinline__ void mlxq_inputs8(const __nv_bfloat16* p, float* o, bool vector) {
    if (vector) {
        const uint4 u = *reinterpret_cast<const uint4*>(p);
        const uint32_t v[4] = {u.x, u.y, u.z, u.w};
        #pragma unroll
        for (int j = 0; j < 4; ++j) {  // a bfloat16 is a float's high half
            o[2 * j] = __uint_as_float(v[j] << 16);
            o[2 * j + 1] = __uint_as_float(v[j] & 0xffff0000u);
        }
    } else {
        #pragma unroll
        for (int j = 0; j < 8; ++j) o[j] = __bfloat162float(p[j]);
    }
}
__device__ __forceinline__ void mlxq_inputs8(const __half* p, float* o, bool vector) {
    if (vector) {
        const uint4 u = *reinterpret_cast<const uint4*>(p);
        const __half2* h = reinterpret_cast<const __half2*>(&u);
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float2 f = __half22float2(h[j]);
            o[2 * j] = f.x;
            o[2 * j + 1] = f.y;
        }
    } else {
        #pragma unroll
        for (int j = 0; j < 8; ++j) o[j] = __half2float(p[j]);
    }
}
"""

_SOURCE = """
    constexpr int WARP = 32;
    constexpr int KW = K / 8;  // packed words of a weight row
    constexpr int KV = KW / 4;  // 16-byte vectors of a weight row: 32 inputs each, in one group
    constexpr int KG = K / G;  // groups of a weight row
    constexpr int BLOCK_COLS = WARPS * CPW;
    const int spans = O / (BLOCK_COLS * TILES);  // a block's columns: TILES tiles of BLOCK_COLS
    const int slot = blockIdx.x / spans;  // this block's expert: the slot-th of those chosen, in order
    const int warp = threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    const int pairs = experts_shape[0];
    // 16-byte loads where the inputs' and weights' first addresses allow them (always, for arrays MLX
    // allocated: a view at an odd offset takes the loads one word or input at a time)
    const bool vector = ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w)) & 15) == 0;

    __shared__ unsigned char chosen[E];
    __shared__ int found[MAXR];
    __shared__ int count;
    __shared__ int mine;
    for (int t = threadIdx.x; t < E; t += blockDim.x) chosen[t] = 0;
    if (threadIdx.x == 0) {
        count = 0;
        mine = -1;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) chosen[experts[p]] = 1;
    __syncthreads();
    if (warp == 0) {  // the slot-th chosen expert: each lane counts a run of flags, a scan across lanes
        constexpr int PER = (E + WARP - 1) / WARP;
        int mine_count = 0;
        #pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int t = lane * PER + i;
            if (t < E) mine_count += chosen[t];
        }
        int through = mine_count;
        #pragma unroll
        for (int off = 1; off < WARP; off *= 2) {
            const int y = __shfl_up_sync(0xffffffff, through, off);
            if (lane >= off) through += y;
        }
        if (slot >= through - mine_count && slot < through) {
            int left = slot - (through - mine_count);
            for (int i = 0; i < PER; ++i) {
                const int t = lane * PER + i;
                if (t < E && chosen[t]) {
                    if (left == 0) {
                        mine = t;
                        break;
                    }
                    --left;
                }
            }
        }
    }
    __syncthreads();
    const int e = mine;
    if (e < 0) return;  // fewer experts chosen than blocks' slots
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        if (static_cast<int>(experts[p]) == e) {
            const int slot = atomicAdd(&count, 1);
            if (slot < MAXR) found[slot] = p;
        }
    }
    __syncthreads();
    const int n = count < MAXR ? count : MAXR;
    if (n == 0) return;

    for (int tile = 0; tile < TILES; ++tile) {
        const int c0 = ((blockIdx.x % spans) * TILES + tile) * BLOCK_COLS + warp * CPW;
        for (int r0 = 0; r0 < n; r0 += RB) {
            const int rn = n - r0 < RB ? n - r0 : RB;
            const T* xr[RB];  // the pass's rows (a pass short of RB rows repeats its last: never read)
            #pragma unroll
            for (int r = 0; r < RB; ++r) {
                xr[r] = x + static_cast<size_t>(found[r0 + (r < rn ? r : rn - 1)] / ROW_DIV) * K;
            }
            float acc[RB][CPW];
            #pragma unroll
            for (int r = 0; r < RB; ++r) {
                #pragma unroll
                for (int c = 0; c < CPW; ++c) acc[r][c] = 0.0f;
            }
            for (int v = lane; v < KV; v += WARP) {  // this lane's inputs: 32 * v .. 32 * v + 31
                const int g = (v * 32) / G;
                uint32_t q[CPW][4];
                float s[CPW];
                float b[CPW];
                #pragma unroll
                for (int c = 0; c < CPW; ++c) {
                    const size_t row = static_cast<size_t>(e) * O + c0 + c;
                    const uint32_t* wp = w + row * KW + 4 * v;
                    if (vector) {
                        const uint4 u = *reinterpret_cast<const uint4*>(wp);
                        q[c][0] = u.x; q[c][1] = u.y; q[c][2] = u.z; q[c][3] = u.w;
                    } else {
                        #pragma unroll
                        for (int i = 0; i < 4; ++i) q[c][i] = wp[i];
                    }
                    s[c] = static_cast<float>(scales[row * KG + g]);
                    b[c] = static_cast<float>(biases[row * KG + g]);
                }
                #pragma unroll
                for (int i = 0; i < 4; ++i) {
                    // the word's eight weights dequantized once for every row: a nibble n as a float by
                    // its bits under 2^23's (exact), then scale * n + bias
                    float d[CPW][8];
                    #pragma unroll
                    for (int c = 0; c < CPW; ++c) {
                        #pragma unroll
                        for (int j = 0; j < 8; ++j) {
                            const uint32_t bits = 0x4b000000u | ((q[c][i] >> (4 * j)) & 15u);
                            const float nib = __uint_as_float(bits) - 8388608.0f;
                            d[c][j] = fmaf(s[c], nib, b[c]);
                        }
                    }
                    #pragma unroll
                    for (int r = 0; r < RB; ++r) {
                        if (r < rn) {
                            float xv[8];
                            mlxq_inputs8(xr[r] + 32 * v + 8 * i, xv, vector);
                            #pragma unroll
                            for (int c = 0; c < CPW; ++c) {
                                #pragma unroll
                                for (int j = 0; j < 8; ++j) acc[r][c] = fmaf(d[c][j], xv[j], acc[r][c]);
                            }
                        }
                    }
                }
            }
            #pragma unroll
            for (int r = 0; r < RB; ++r) {
                if (r < rn) {
                    #pragma unroll
                    for (int c = 0; c < CPW; ++c) {
                        float v = acc[r][c];
                        #pragma unroll
                        for (int off = WARP / 2; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffff, v, off);
                        const size_t at = static_cast<size_t>(found[r0 + r]) * O + c0 + c;
                        if (lane == 0) out[at] = static_cast<T>(v);
                    }
                }
            }
        }
    }
"""


def available() -> bool:
    """Whether the kernel can run: MLX's CUDA backend is the default device (not Metal, not the CPU)."""
    return on_cuda() and hasattr(mx.fast, "cuda_kernel")


def fits(inputs: int, outputs: int, group_size: int, bits: int, mode: str, biased: bool) -> bool:
    """Whether a projection of these experts is one the kernel computes (`available()` aside)."""
    # a lane's 32 inputs lie in one group; a row's 16-byte vectors split evenly enough among the lanes
    whole_words = inputs % 256 == 0 and group_size % 32 == 0 and inputs % group_size == 0
    return mode == "affine" and bits == 4 and biased and whole_words and outputs % (_WARPS * _COLUMNS) == 0


@cache
def _kernel() -> Any:
    return mx.fast.cuda_kernel(
        name="mlxq_grouped_expert_qmv",
        input_names=["x", "w", "scales", "biases", "experts"],
        output_names=["out"],
        source=_SOURCE,
        header=_HEADER,
    )


def expert_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    experts: mx.array,
    group_size: int,
    per_row: int,
) -> mx.array:
    """Each pair p's row of x by expert `experts[p]`'s weight: (pairs, outputs) in x's dtype.

    x: (rows, inputs), pair p reading row `p // per_row` (the tokens of a top-k routing: `per_row` k;
    each pair its own row: 1); w, scales, biases: the experts' 4-bit affine quantization as
    `mx.quantize` makes it, (experts, outputs, inputs / 8) uint32 and (experts, outputs, inputs /
    group_size); experts: (pairs,) uint32, at most `MAX_ROWS` pairs an expert (the kernel leaves a
    further pair's output unwritten: callers keep to `MAX_ROWS` tokens, each choosing an expert once).
    Where the kernel cannot run (`available()`), MLX's gathered quantized matmul computes the same."""
    outputs = w.shape[1]
    if not available():
        return _gathered(x, w, scales, biases, experts, group_size, per_row)
    tiles = _tiles(outputs, experts.size)
    template = _template(x.dtype, x.shape[-1], outputs, group_size, per_row, w.shape[0], tiles)
    # a slot for each expert that can be chosen (no more than the pairs), a block a slot and column span
    blocks = min(w.shape[0], experts.size) * (outputs // (_WARPS * _COLUMNS * tiles))
    out: mx.array  # MLX types a custom kernel as `object`
    (out,) = _kernel()(
        inputs=[x, w, scales, biases, experts],
        template=template,
        grid=(blocks * _WARPS * 32, 1, 1),
        threadgroup=(_WARPS * 32, 1, 1),
        output_shapes=[(experts.size, outputs)],
        output_dtypes=[x.dtype],
    )
    return out


def _tiles(outputs: int, pairs: int) -> int:
    """Column tiles a block computes one after another: one for a few pairs (a token's experts each a
    block a tile, to spread over the device's multiprocessors), `_TILES` from `_TILES_FROM` pairs on, so
    that a block's finding of its expert and rows is paid once for more columns."""
    per = _WARPS * _COLUMNS
    return _TILES if pairs >= _TILES_FROM and outputs % (per * _TILES) == 0 else 1


@cache
def _template(
    dtype: mx.Dtype, inputs: int, outputs: int, group_size: int, per_row: int, experts: int, tiles: int
) -> list[tuple[str, Any]]:
    """The kernel's template constants for a projection (made once per projection's shape: a step
    without compiled parts calls the kernel a few times a layer)."""
    return [
        ("T", dtype), ("K", inputs), ("O", outputs), ("G", group_size), ("ROW_DIV", per_row),
        ("E", experts), ("MAXR", MAX_ROWS), ("WARPS", _WARPS), ("CPW", _COLUMNS), ("RB", _ROWS),
        ("TILES", tiles),
    ]  # fmt: skip


def _gathered(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    experts: mx.array,
    group_size: int,
    per_row: int,
) -> mx.array:
    """What `expert_matmul` computes, by MLX's gathered quantized matmul."""
    rows = mx.arange(experts.size, dtype=mx.uint32) // per_row
    gathered = mx.gather_qmm(
        x[:, None, :], w, scales, biases, lhs_indices=rows, rhs_indices=experts,
        transpose=True, group_size=group_size, bits=4,
    )  # fmt: skip
    return gathered.reshape(experts.size, w.shape[1])


@cache
def agrees(dtype: mx.Dtype, inputs: int, outputs: int, group_size: int, per_row: int) -> bool:
    """Whether the kernel, built for these template constants, gives MLX's gathered quantized matmul's
    results (within the dtype's rounding) on made-up experts: checked once per process and shape, when
    a model's sparse layers are fused; a failure to build or run counts as no, and is logged."""
    try:
        first, second = mx.random.split(mx.random.key(0))  # the global random state left as it is
        experts = per_row + 1
        w = (mx.random.normal((experts, outputs, inputs), key=first) * inputs**-0.5).astype(dtype)
        qw, scales, biases = mx.quantize(w, group_size, 4)
        pairs = mx.array([(i + j) % experts for i in range(3) for j in range(per_row)], dtype=mx.uint32)
        x = mx.random.normal((pairs.size // per_row, inputs), key=second).astype(dtype)
        want = _gathered(x, qw, scales, biases, pairs, group_size, per_row)
        got = expert_matmul(x, qw, scales, biases, pairs, group_size, per_row)
        tolerance = 1e-4 if dtype == mx.float32 else 5e-2
        error = np.abs(np.array(got.astype(mx.float32)) - np.array(want.astype(mx.float32))).max()
        scale = np.abs(np.array(want.astype(mx.float32))).max()
    except Exception as e:  # any failure means: do not use it
        log.warning("grouped experts' kernel unavailable for %s x %d -> %d: %s", dtype, inputs, outputs, e)
        return False
    if not error <= tolerance * max(1.0, scale):
        log.warning(
            "grouped experts' kernel unused for %s x %d -> %d: off MLX's matmul by %.3g (scale %.3g)",
            dtype, inputs, outputs, error, scale,
        )  # fmt: skip
        return False
    return True
