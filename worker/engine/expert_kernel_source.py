"""The grouped experts' kernel's CUDA source (`expert_kernel` builds and launches it).

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

Both forms take their layout as template constants (`expert_kernel`'s `_launch`): `T`, `K`, `O`, `G`,
`ROW_DIV`, `E`, `MAXR` for the projection, `WARPS`, `TILES` and the form's own.
"""

# One tile's mma for each 16-bit input type (`HEADER`): D = A B + D for a 16 x 8 x 16 tile, A 16 x 16
# (row-major fragments), B 16 x 8, D in float.
_MMA_TYPES = [("__nv_bfloat16", "bf16"), ("__half", "f16")]
_MMA_OVERLOAD = """__device__ __forceinline__ void mlxq_mma(
    float* d, const uint32_t* a, const uint32_t* b, const {ctype}*) {{
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.{ptx}.{ptx}.f32 "
        "{{%0,%1,%2,%3}}, {{%4,%5,%6,%7}}, {{%8,%9}}, {{%0,%1,%2,%3}};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}}
"""

HEADER = (
    """
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
"""
    + "".join(_MMA_OVERLOAD.format(ctype=ctype, ptx=ptx) for ctype, ptx in _MMA_TYPES)
    + """// N consecutive packed words (N of 1, 2, 4 or 8), in one load where the address allows it.
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
)

# The block's expert and its rows, shared by both forms: `slot`-th of the chosen experts (those the
# step's pairs name, in order), `e`; its `n` pairs, in `found` (a block whose slot is past the chosen
# experts, or whose expert has no rows, returns).
FIND_EXPERT = """
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

SCALAR_SOURCE = (
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
    + FIND_EXPERT
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


MMA_SOURCE = (
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
    + FIND_EXPERT
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
