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

The kernel has two forms (`form`), which share the finding of a block's expert and rows.

The scalar form (any input dtype; float32 always): each warp owns a few output columns. A lane takes 32
inputs of each column at a time (one 16-byte load of packed words: a warp's loads are a column's 512
contiguous bytes), dequantizes them once, `scale * q + bias` in float32 with the nibble turned into a
float by its bits (no integer conversion), and multiplies every routed row's 32 inputs by them; one warp
reduction a (row, column) at the end. Dequantizing once for all of an expert's rows, not once a row,
keeps the arithmetic a weight costs from growing with the rows routed to its expert; what it still
costs is a few instructions a weight, for the rows that one load feeds.

The tensor-core form (bfloat16 and float16 inputs, from `MMA_FROM` pairs): a warp computes 16 output
columns by 8 rows at a time with `mma.sync` (m16n8k16, float32 sums). A nibble ORed under a 16-bit
float's exponent bits is exactly that float `M + n` (M = 128 for bfloat16, 1,024 for half), so a word's
eight weights become the tile's operands by four bitwise ops, with no scale applied: the tiles sum
`x (M + n)` over each quantization group, and the group's scale and bias are applied to the sums after,
`s * sum(x (M + n)) + (b - M s) * sum(x)`, with each row's sums of x a group computed once a block. The
inner product's order is free, so each lane's operands are what its own loads hold: in a quad of lanes
(which the tile's layout gives the same rows), lane t takes words t * G / 32 onwards of a row's group,
and its inputs' pairs (0, 4), (1, 5), (2, 6), (3, 7) match the pairs a word's nibbles fall in.

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

# The tensor-core form, for 16-bit inputs from `MMA_FROM` pairs on: a block's warps, of which `KS` share
# each column span (each summing a slice of the groups), a warp's 16-column tiles (`MT`), a pass's
# 8-row tiles (`NT`), column spans a block computes in turn (`TILES`) and groups unrolled in a warp's
# loop (`UNROLL`). `_mma_layout` picks one of the two by a row's groups: rows of many groups are shared
# among warps (each warp's chain of loads shorter), rows of few are not.
_MMA_SHARED = {"WARPS": 8, "KS": 4, "MT": 2, "NT": 1, "TILES": 2, "UNROLL": 2}
_MMA_OWN = {"WARPS": 4, "KS": 1, "MT": 2, "NT": 1, "TILES": 1, "UNROLL": 2}
_SHARED_FROM = 32  # a row's groups from which its span is shared: 8 or more a warp
MMA_FROM = 1

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
// The tensor-core form's helpers (16-bit inputs only): a 4-bit nibble n ORed under a 16-bit float's
// magic bits is exactly the float M + n (M = 128 for bfloat16, 1,024 for half), two a word.
__device__ __forceinline__ uint32_t mlxq_magic_bits(const __nv_bfloat16*) { return 0x43004300u; }
__device__ __forceinline__ uint32_t mlxq_magic_bits(const __half*) { return 0x64006400u; }
__device__ __forceinline__ float mlxq_magic(const __nv_bfloat16*) { return 128.0f; }
__device__ __forceinline__ float mlxq_magic(const __half*) { return 1024.0f; }
// D = A B + D for one 16 x 8 x 16 tile: A 16 x 16 (row-major fragments), B 16 x 8, D in float.
__device__ __forceinline__ void mlxq_mma(
    float* d, const uint32_t* a, const uint32_t* b, const __nv_bfloat16*) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mlxq_mma(
    float* d, const uint32_t* a, const uint32_t* b, const __half*) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// N consecutive packed words (N of 1, 2, 4 or 8), in one load where the address allows it.
template <int N>
__device__ __forceinline__ void mlxq_words(const uint32_t* p, uint32_t* o, bool vector) {
    if (!vector) {
        #pragma unroll
        for (int i = 0; i < N; ++i) o[i] = p[i];
    } else if constexpr (N == 2) {
        const uint2 u = *reinterpret_cast<const uint2*>(p);
        o[0] = u.x; o[1] = u.y;
    } else if constexpr (N % 4 == 0) {
        #pragma unroll
        for (int i = 0; i < N; i += 4) {
            const uint4 u = reinterpret_cast<const uint4*>(p)[i / 4];
            o[i] = u.x; o[i + 1] = u.y; o[i + 2] = u.z; o[i + 3] = u.w;
        }
    } else {
        o[0] = p[0];
    }
}
// Eight consecutive 16-bit inputs as the pairs (0, 4), (1, 5), (2, 6), (3, 7), first in the low half.
template <typename U>
__device__ __forceinline__ void mlxq_pairs(const U* p, uint32_t* o, bool vector) {
    uint32_t v[4];
    if (vector) {
        const uint4 u = *reinterpret_cast<const uint4*>(p);
        v[0] = u.x; v[1] = u.y; v[2] = u.z; v[3] = u.w;
    } else {
        const unsigned short* h = reinterpret_cast<const unsigned short*>(p);
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            v[i] = static_cast<uint32_t>(h[2 * i]) | (static_cast<uint32_t>(h[2 * i + 1]) << 16);
        }
    }
    o[0] = __byte_perm(v[0], v[2], 0x5410);
    o[1] = __byte_perm(v[0], v[2], 0x7632);
    o[2] = __byte_perm(v[1], v[3], 0x5410);
    o[3] = __byte_perm(v[1], v[3], 0x7632);
}
"""

# The block's expert and its rows, shared by both forms: `slot`-th of the chosen experts (those the
# step's pairs name, in order), `e`; its `n` pairs, in `found` (a block whose slot is past the chosen
# experts, or whose expert has no rows, returns).
_FIND_EXPERT = """
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

"""

_SCALAR_SOURCE = (
    """
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

"""
    + _FIND_EXPERT
    + """
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
)


_MMA_SOURCE = (
    """
    constexpr int WARP = 32;
    constexpr int KW = K / 8;  // packed words of a weight row
    constexpr int KG = K / G;  // groups of a weight row
    constexpr int WPL = G / 32;  // words of a row's group a lane takes: a quad's 4 lanes take them all
    constexpr int WC = WARPS / KS;  // warps with columns of their own: KS warps share each one's
    constexpr int BLOCK_COLS = WC * MT * 16;
    constexpr int RP = NT * 8;  // rows a pass: NT tiles of 8
    const int spans = O / (BLOCK_COLS * TILES);  // a block's columns: TILES tiles of BLOCK_COLS
    const int slot = blockIdx.x / spans;  // this block's expert: the slot-th of those chosen, in order
    const int warp = threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    const int wc = warp % WC;  // the warp's columns
    const int ks = warp / WC;  // and its slice of the groups: KG / KS of them
    const int gq = lane / 4;  // the lane's A rows (output columns) gq and gq + 8, its B column (row) gq
    const int tq = lane % 4;  // its place in its quad
    const int pairs = experts_shape[0];
    const bool vector = ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w)) & 15) == 0;
    const uint32_t magic_bits = mlxq_magic_bits(x);  // a nibble n under them is the 16-bit float M + n
    const float magic = mlxq_magic(x);
"""
    + _FIND_EXPERT
    + """
    __shared__ float xs[RP][KG];  // the pass's rows' sums a group (the bias's share, and M's)
    for (int r0 = 0; r0 < n; r0 += RP) {
        const int rn = n - r0 < RP ? n - r0 : RP;
        __syncthreads();  // the pass before has read its sums
        // a warp's lanes take 8 consecutive inputs each (one row: K / 8 is a multiple of 32), the G / 8
        // lanes of a group summing theirs by shuffles
        for (int i = threadIdx.x; i < RP * (K / 8); i += blockDim.x) {
            const int r = i / (K / 8);
            const int k8 = i % (K / 8);
            float sum = 0.0f;
            if (r < rn) {
                float v[8];
                mlxq_inputs8(x + static_cast<size_t>(found[r0 + r] / ROW_DIV) * K + 8 * k8, v, vector);
                sum = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
            }
            #pragma unroll
            for (int off = 1; off < G / 8; off *= 2) sum += __shfl_xor_sync(0xffffffff, sum, off);
            if (k8 % (G / 8) == 0) xs[r][k8 / (G / 8)] = sum;
        }
        __syncthreads();
        // the lane's B rows: tile t's row gq (a row past the pass's reads row 0 and is never written)
        const T* xb[NT];
        #pragma unroll
        for (int t = 0; t < NT; ++t) {
            const int r = t * 8 + gq;
            xb[t] = x + static_cast<size_t>(found[r0 + (r < rn ? r : 0)] / ROW_DIV) * K;
        }
        for (int tile = 0; tile < TILES; ++tile) {
            const int c0 = ((blockIdx.x % spans) * TILES + tile) * BLOCK_COLS + wc * MT * 16;
            float acc[NT][MT][4];
            #pragma unroll
            for (int t = 0; t < NT; ++t) {
                #pragma unroll
                for (int m = 0; m < MT; ++m) {
                    #pragma unroll
                    for (int i = 0; i < 4; ++i) acc[t][m][i] = 0.0f;
                }
            }
            #pragma unroll UNROLL
            for (int g = ks * (KG / KS); g < (ks + 1) * (KG / KS); ++g) {
                // the A words: m-tile m's rows gq and gq + 8, this lane's WPL words of group g
                uint32_t q[MT][2][WPL];
                float s[MT][2];
                float b[MT][2];
                #pragma unroll
                for (int m = 0; m < MT; ++m) {
                    #pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const size_t row = static_cast<size_t>(e) * O + c0 + m * 16 + gq + 8 * h;
                        mlxq_words<WPL>(w + row * KW + g * (G / 8) + tq * WPL, q[m][h], vector);
                        s[m][h] = static_cast<float>(scales[row * KG + g]);
                        b[m][h] = static_cast<float>(biases[row * KG + g]) - magic * s[m][h];
                    }
                }
                float c[NT][MT][4];
                #pragma unroll
                for (int t = 0; t < NT; ++t) {
                    #pragma unroll
                    for (int m = 0; m < MT; ++m) {
                        #pragma unroll
                        for (int i = 0; i < 4; ++i) c[t][m][i] = 0.0f;
                    }
                }
                #pragma unroll
                for (int j = 0; j < WPL; ++j) {
                    // the B pairs of this word's 8 inputs: (0, 4), (1, 5) for its first mma, (2, 6),
                    // (3, 7) for its second, as a word's nibbles pair under the magic bits
                    uint32_t bx[NT][4];
                    #pragma unroll
                    for (int t = 0; t < NT; ++t) {
                        mlxq_pairs(xb[t] + g * G + 8 * (tq * WPL + j), bx[t], vector);
                    }
                    #pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        #pragma unroll
                        for (int m = 0; m < MT; ++m) {
                            const uint32_t a[4] = {
                                ((q[m][0][j] >> (8 * half)) & 0x000f000fu) | magic_bits,
                                ((q[m][1][j] >> (8 * half)) & 0x000f000fu) | magic_bits,
                                ((q[m][0][j] >> (8 * half + 4)) & 0x000f000fu) | magic_bits,
                                ((q[m][1][j] >> (8 * half + 4)) & 0x000f000fu) | magic_bits,
                            };
                            #pragma unroll
                            for (int t = 0; t < NT; ++t) mlxq_mma(c[t][m], a, bx[t] + 2 * half, x);
                        }
                    }
                }
                // the group's scale and bias: s * sum(x (M + n)) + (b - M s) * sum(x) = sum(x (s n + b))
                #pragma unroll
                for (int t = 0; t < NT; ++t) {
                    const float x0 = xs[t * 8 + 2 * tq][g];
                    const float x1 = xs[t * 8 + 2 * tq + 1][g];
                    #pragma unroll
                    for (int m = 0; m < MT; ++m) {
                        acc[t][m][0] = fmaf(s[m][0], c[t][m][0], fmaf(b[m][0], x0, acc[t][m][0]));
                        acc[t][m][1] = fmaf(s[m][0], c[t][m][1], fmaf(b[m][0], x1, acc[t][m][1]));
                        acc[t][m][2] = fmaf(s[m][1], c[t][m][2], fmaf(b[m][1], x0, acc[t][m][2]));
                        acc[t][m][3] = fmaf(s[m][1], c[t][m][3], fmaf(b[m][1], x1, acc[t][m][3]));
                    }
                }
            }
            if constexpr (KS > 1) {  // the slices' sums added into the first slice's warp
                __shared__ float part[KS > 1 ? KS - 1 : 1][WC][NT * MT * 4][WARP];
                if (ks > 0) {
                    #pragma unroll
                    for (int t = 0; t < NT; ++t) {
                        #pragma unroll
                        for (int m = 0; m < MT; ++m) {
                            #pragma unroll
                            for (int i = 0; i < 4; ++i) {
                                part[ks - 1][wc][4 * (t * MT + m) + i][lane] = acc[t][m][i];
                            }
                        }
                    }
                }
                __syncthreads();
                if (ks == 0) {
                    #pragma unroll
                    for (int j = 0; j < KS - 1; ++j) {
                        #pragma unroll
                        for (int t = 0; t < NT; ++t) {
                            #pragma unroll
                            for (int m = 0; m < MT; ++m) {
                                #pragma unroll
                                for (int i = 0; i < 4; ++i) {
                                    acc[t][m][i] += part[j][wc][4 * (t * MT + m) + i][lane];
                                }
                            }
                        }
                    }
                }
                __syncthreads();  // read before the next tile writes
                if (ks > 0) continue;
            }
            #pragma unroll
            for (int t = 0; t < NT; ++t) {
                #pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int r = t * 8 + 2 * tq + (i & 1);
                    if (r < rn) {
                        #pragma unroll
                        for (int m = 0; m < MT; ++m) {
                            const int col = c0 + m * 16 + gq + 8 * (i >> 1);
                            out[static_cast<size_t>(found[r0 + r]) * O + col] = static_cast<T>(acc[t][m][i]);
                        }
                    }
                }
            }
        }
    }
"""
)


def available() -> bool:
    """Whether the kernel can run: MLX's CUDA backend is the default device (not Metal, not the CPU)."""
    return on_cuda() and hasattr(mx.fast, "cuda_kernel")


def fits(inputs: int, outputs: int, group_size: int, bits: int, mode: str, biased: bool) -> bool:
    """Whether a projection of these experts is one the kernel computes (`available()` aside)."""
    # a lane's 32 inputs lie in one group; a row's 16-byte vectors split evenly enough among the lanes
    whole_words = inputs % 256 == 0 and group_size % 32 == 0 and inputs % group_size == 0
    return mode == "affine" and bits == 4 and biased and whole_words and outputs % (_WARPS * _COLUMNS) == 0


@cache
def _kernel(form: str) -> Any:
    return mx.fast.cuda_kernel(
        name=f"mlxq_grouped_expert_{form}",
        input_names=["x", "w", "scales", "biases", "experts"],
        output_names=["out"],
        source=_MMA_SOURCE if form == "mma" else _SCALAR_SOURCE,
        header=_HEADER,
    )


def form(dtype: mx.Dtype, inputs: int, outputs: int, group_size: int, pairs: int) -> str:
    """Which of the kernel's forms computes a projection (one `fits`): "mma", tensor-core tiles of 16
    columns by 8 rows, for 16-bit inputs from `MMA_FROM` pairs on where the outputs split into its
    blocks' columns (`_mma_layout`); else "scalar", each lane's own multiply-adds."""
    sixteen = dtype in (mx.bfloat16, mx.float16)
    if not (sixteen and pairs >= MMA_FROM and group_size in (32, 64, 128, 256)):
        return "scalar"
    layout = _mma_layout(inputs, group_size)
    columns = layout["WARPS"] // layout["KS"] * layout["MT"] * 16 * layout["TILES"]
    return "mma" if outputs % columns == 0 else "scalar"


def _mma_layout(inputs: int, group_size: int) -> dict[str, int]:
    """The tensor-core form's layout for rows of `inputs`: `_MMA_SHARED` where a row has at least
    `_SHARED_FROM` groups and its warps divide them evenly, else `_MMA_OWN`."""
    groups = inputs // group_size
    shared = groups >= _SHARED_FROM and groups % _MMA_SHARED["KS"] == 0
    return _MMA_SHARED if shared else _MMA_OWN


def expert_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    experts: mx.array,
    group_size: int,
    per_row: int,
    use: str | None = None,
) -> mx.array:
    """Each pair p's row of x by expert `experts[p]`'s weight: (pairs, outputs) in x's dtype.

    x: (rows, inputs), pair p reading row `p // per_row` (the tokens of a top-k routing: `per_row` k;
    each pair its own row: 1); w, scales, biases: the experts' 4-bit affine quantization as
    `mx.quantize` makes it, (experts, outputs, inputs / 8) uint32 and (experts, outputs, inputs /
    group_size); experts: (pairs,) uint32, at most `MAX_ROWS` pairs an expert (the kernel leaves a
    further pair's output unwritten: callers keep to `MAX_ROWS` tokens, each choosing an expert once).
    `use` names the path: the kernel's "scalar" or "mma" form (`form` chooses where it is None) or
    MLX's "gather_qmm", which also computes it where the kernel cannot run (`available()`)."""
    if not available() or use == "gather_qmm":
        return _gathered(x, w, scales, biases, experts, group_size, per_row)
    use = use or form(x.dtype, x.shape[-1], w.shape[1], group_size, experts.size)
    if use == "mma":
        layout = _mma_layout(x.shape[-1], group_size)
        return _launch(x, w, scales, biases, experts, group_size, per_row, "mma", **layout)
    tiles = _tiles(w.shape[1], experts.size)
    return _launch(
        x, w, scales, biases, experts, group_size, per_row, "scalar",
        WARPS=_WARPS, CPW=_COLUMNS, RB=_ROWS, TILES=tiles,
    )  # fmt: skip


def _launch(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    experts: mx.array,
    group_size: int,
    per_row: int,
    use: str,
    **layout: int,
) -> mx.array:
    """One launch of a form with its layout's template constants (`WARPS`, `TILES` and the form's own):
    a block for each expert slot (no more slots than pairs) and span of its columns."""
    outputs = w.shape[1]
    template = _template(
        x.dtype, x.shape[-1], outputs, group_size, per_row, w.shape[0], tuple(layout.items())
    )
    warps = layout["WARPS"] // layout.get("KS", 1)  # warps with columns of their own
    columns = warps * layout["TILES"] * (layout["MT"] * 16 if use == "mma" else layout["CPW"])
    blocks = min(w.shape[0], experts.size) * (outputs // columns)
    out: mx.array  # MLX types a custom kernel as `object`
    (out,) = _kernel(use)(
        inputs=[x, w, scales, biases, experts],
        template=template,
        grid=(blocks * layout["WARPS"] * 32, 1, 1),
        threadgroup=(layout["WARPS"] * 32, 1, 1),
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
    dtype: mx.Dtype,
    inputs: int,
    outputs: int,
    group_size: int,
    per_row: int,
    experts: int,
    layout: tuple[tuple[str, int], ...],
) -> list[tuple[str, Any]]:
    """The kernel's template constants for a projection and layout (made once per shape: a step
    without compiled parts calls the kernel a few times a layer)."""
    return [
        ("T", dtype), ("K", inputs), ("O", outputs), ("G", group_size), ("ROW_DIV", per_row),
        ("E", experts), ("MAXR", MAX_ROWS), *layout,
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
    results (within the dtype's rounding) on made-up experts, in each form the projection may take
    (`form`): checked once per process and shape, when a model's sparse layers are fused; a failure to
    build or run, or either form's disagreement, counts as no (the layer keeps MLX's matmuls), and is
    logged."""
    forms = ["scalar", *(["mma"] if form(dtype, inputs, outputs, group_size, MMA_FROM) == "mma" else [])]
    try:
        first, second = mx.random.split(mx.random.key(0))  # the global random state left as it is
        experts = per_row + 1
        w = (mx.random.normal((experts, outputs, inputs), key=first) * inputs**-0.5).astype(dtype)
        qw, scales, biases = mx.quantize(w, group_size, 4)
        pairs = mx.array([(i + j) % experts for i in range(3) for j in range(per_row)], dtype=mx.uint32)
        x = mx.random.normal((pairs.size // per_row, inputs), key=second).astype(dtype)
        want = np.array(_gathered(x, qw, scales, biases, pairs, group_size, per_row).astype(mx.float32))
        tolerance = (1e-4 if dtype == mx.float32 else 5e-2) * max(1.0, float(np.abs(want).max()))
        errors = {
            use: float(np.abs(np.array(got.astype(mx.float32)) - want).max())
            for use in forms
            for got in [expert_matmul(x, qw, scales, biases, pairs, group_size, per_row, use)]
        }
    except Exception as e:  # any failure means: do not use it
        log.warning("grouped experts' kernel unavailable for %s x %d -> %d: %s", dtype, inputs, outputs, e)
        return False
    if off := {use: error for use, error in errors.items() if not error <= tolerance}:
        log.warning(
            "grouped experts' kernel unused for %s x %d -> %d: off MLX's matmul by %s (tolerance %.3g)",
            dtype, inputs, outputs, off, tolerance,
        )  # fmt: skip
        return False
    return True
