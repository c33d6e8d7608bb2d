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

The kernel has two forms (`form`): a scalar one for any input dtype and a tensor-core one for
16-bit inputs; their CUDA source and how each multiplies are `expert_kernel_source`'s.

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

from mlxq.worker.engine import expert_kernel_source as source
from mlxq.worker.engine.device import on_cuda

log = logging.getLogger(__name__)

# Rows one expert may be given in one call: the shared list of a block's pairs.
MAX_ROWS = 64

# The scalar form's layout.
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
        source=source.MMA_SOURCE if form == "mma" else source.SCALAR_SOURCE,
        header=source.HEADER,
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


@cache
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
    inputs = [x, w, scales, biases, experts]
    if use == "mma":
        return _launch(inputs, group_size, per_row, "mma", **_mma_layout(x.shape[-1], group_size))
    tiles = _tiles(w.shape[1], experts.size)
    return _launch(inputs, group_size, per_row, "scalar", WARPS=_WARPS, CPW=_COLUMNS, RB=_ROWS, TILES=tiles)


def _launch(inputs: list[mx.array], group_size: int, per_row: int, use: str, **layout: int) -> mx.array:
    """One launch of a form, `inputs` as `expert_matmul` takes them (x, w, scales, biases, experts),
    with its layout's template constants (`WARPS`, `TILES` and the form's own): a block for each
    expert slot (no more slots than pairs) and span of its columns."""
    x, w, experts = inputs[0], inputs[1], inputs[4]
    outputs = w.shape[1]
    template = _template(
        x.dtype, x.shape[-1], outputs, group_size, per_row, w.shape[0], tuple(layout.items())
    )
    warps = layout["WARPS"] // layout.get("KS", 1)  # warps with columns of their own
    columns = warps * layout["TILES"] * (layout["MT"] * 16 if use == "mma" else layout["CPW"])
    blocks = min(w.shape[0], experts.size) * (outputs // columns)
    out: mx.array  # MLX types a custom kernel as `object`
    (out,) = _kernel(use)(
        inputs=inputs,
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
