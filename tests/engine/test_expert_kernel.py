"""The grouped experts' CUDA kernel (`expert_kernel`) against MLX's gathered quantized matmul: run where
MLX's CUDA build is the default device (the lent GPU), skipped elsewhere (there `expert_matmul` is
MLX's matmul itself, and `SwitchGLU`'s use of it is tested on the CPU in `test_moe.py`)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxq.worker.engine import expert_kernel
from mlxq.worker.engine.models import moe

pytestmark = pytest.mark.skipif(not expert_kernel.available(), reason="the kernel runs on CUDA only")


def _routed(tokens: int, experts: int, k: int, seed: int) -> mx.array:
    """Each token's k distinct experts, (tokens * k,) uint32."""
    mx.random.seed(seed)
    return (
        mx.argsort(mx.random.uniform(shape=(tokens, experts)), axis=-1)[:, :k].reshape(-1).astype(mx.uint32)
    )


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize(
    ("inputs", "outputs", "group", "tokens", "k", "per_row"),
    [
        (2048, 1536, 64, 1, 8, 8),  # one token's gate and up (Qwen3-30B-A3B's shape)
        (2048, 1536, 64, 32, 8, 8),  # 32 tokens: ~110 experts chosen, a few rows each
        (768, 2048, 64, 32, 8, 1),  # their down projection: each pair its own row
        (256, 96, 32, 64, 2, 2),  # 64 tokens over 3 experts: more rows an expert than a pass holds
        (512, 64, 128, 5, 1, 1),  # one expert a token, groups of 128
    ],
)
def test_the_kernel_multiplies_each_pair_as_gather_qmm_does(
    inputs: int, outputs: int, group: int, tokens: int, k: int, per_row: int, dtype: mx.Dtype
) -> None:
    experts = 128 if outputs > 100 else 3
    mx.random.seed(inputs + tokens)
    w = (mx.random.normal((experts, outputs, inputs)) * inputs**-0.5).astype(dtype)
    qw, scales, biases = mx.quantize(w, group, 4)
    pairs = _routed(tokens, experts, k, seed=tokens)
    x = mx.random.normal((tokens * k // per_row, inputs)).astype(dtype)
    got = expert_kernel.expert_matmul(x, qw, scales, biases, pairs, group, per_row)
    rows = mx.arange(pairs.size, dtype=mx.uint32) // per_row
    want = mx.gather_qmm(
        x[:, None, :],
        qw,
        scales,
        biases,
        lhs_indices=rows,
        rhs_indices=pairs,
        transpose=True,
        group_size=group,
    ).reshape(pairs.size, outputs)
    assert got.shape == want.shape and got.dtype == dtype
    tolerance = 1e-4 if dtype == mx.float32 else 3e-2
    np.testing.assert_allclose(
        np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=tolerance, rtol=tolerance
    )


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize(
    ("inputs", "outputs", "group", "tokens", "k", "per_row"),
    [
        (2048, 1536, 64, 2, 8, 8),  # two tokens' gate and up, each expert a row or two
        (2048, 1536, 64, 32, 8, 8),  # 32 tokens: ~110 experts chosen, a few rows each
        (768, 2048, 64, 32, 8, 1),  # their down projection: each pair its own row
        (256, 128, 32, 64, 2, 2),  # 64 tokens over 3 experts: passes of 8 rows, the last short
        (512, 256, 128, 20, 1, 1),  # groups of 128: 4 words a lane
        (512, 128, 256, 9, 3, 3),  # groups of 256: 8 words a lane
    ],
)
def test_the_tensor_core_form_multiplies_each_pair_as_gather_qmm_does(
    inputs: int, outputs: int, group: int, tokens: int, k: int, per_row: int, dtype: mx.Dtype
) -> None:
    """The "mma" form (`expert_kernel.form`: 16-bit inputs from `MMA_FROM` pairs) against MLX's
    gathered quantized matmul, at shapes its blocks' passes and groups' words split differently."""
    experts = 128 if outputs > 1000 else 3
    mx.random.seed(inputs + tokens + group)
    w = (mx.random.normal((experts, outputs, inputs)) * inputs**-0.5).astype(dtype)
    qw, scales, biases = mx.quantize(w, group, 4)
    pairs = _routed(tokens, experts, k, seed=tokens)
    x = mx.random.normal((tokens * k // per_row, inputs)).astype(dtype)
    got = expert_kernel.expert_matmul(x, qw, scales, biases, pairs, group, per_row, "mma")
    want = expert_kernel.expert_matmul(x, qw, scales, biases, pairs, group, per_row, "gather_qmm")
    assert got.shape == want.shape and got.dtype == dtype
    np.testing.assert_allclose(
        np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=3e-2, rtol=3e-2
    )


@pytest.mark.parametrize("tokens", [1, 8, 32, 64])
def test_a_sparse_layer_through_the_kernel_equals_the_pairs_path(tokens: int) -> None:
    """`SwitchGLU` of 4-bit experts takes the kernel on CUDA up to `MAX_ROWS` tokens (`grouped`): its
    outputs against the same layer's pairs through MLX's gathered matmuls, bf16."""
    mx.random.seed(tokens)
    block = moe.SwitchGLU(2048, 768, 128)
    block.set_dtype(mx.bfloat16)
    nn.quantize(block, 64, 4, class_predicate=lambda _p, m: isinstance(m, moe.SwitchLinear))
    block.fuse(top_k=8)
    assert block.grouped
    x = mx.random.normal((tokens, 1, 2048)).astype(mx.bfloat16)
    experts = _routed(tokens, 128, 8, seed=tokens + 1).reshape(tokens, 8)
    got = block.expert_outputs(x, experts)
    block.grouped, block.every_from, block.dense_from = False, None, None
    want = block.expert_outputs(x, experts)
    np.testing.assert_allclose(
        np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=3e-2, rtol=3e-2
    )


def test_the_kernel_inside_a_compiled_function_gives_the_eager_outputs() -> None:
    """A compiled decode step's layer parts (`compiled_step._LayerParts`) trace a sparse layer with the
    kernel in it: the eager layer's outputs within bf16's rounding (a compiled function may fuse the
    SwiGLU between the kernels differently, so the bits themselves may differ)."""
    mx.random.seed(2)
    block = moe.SwitchGLU(2048, 768, 128)
    block.set_dtype(mx.bfloat16)
    nn.quantize(block, 64, 4, class_predicate=lambda _p, m: isinstance(m, moe.SwitchLinear))
    block.fuse(top_k=8)
    x = mx.random.normal((16, 1, 2048)).astype(mx.bfloat16)
    experts = _routed(16, 128, 8, seed=3).reshape(16, 8)
    eager = block.expert_outputs(x, experts)
    got = mx.compile(block.expert_outputs)(x, experts)
    assert got.shape == eager.shape
    np.testing.assert_allclose(
        np.array(got.astype(mx.float32)), np.array(eager.astype(mx.float32)), atol=3e-2, rtol=3e-2
    )


@pytest.mark.parametrize(
    ("dtype", "use"),
    [
        (mx.float32, "scalar"),
        (mx.bfloat16, "scalar"),
        (mx.float16, "scalar"),
        (mx.bfloat16, "mma"),
        (mx.float16, "mma"),
    ],
)
def test_inputs_off_a_16_byte_boundary_are_read_one_at_a_time(dtype: mx.Dtype, use: str) -> None:
    """The kernel's 16-byte loads need the inputs' first address on a 16-byte boundary: a view one
    element into a buffer (MLX passes its address as it is) takes the loads one input at a time, with
    the same results as the same rows where they are aligned."""
    mx.random.seed(4)
    inputs, outputs, tokens, k = 512, 128, 6, 2
    w = (mx.random.normal((5, outputs, inputs)) * inputs**-0.5).astype(dtype)
    qw, scales, biases = mx.quantize(w, 64, 4)
    pairs = _routed(tokens, 5, k, seed=5)
    flat = mx.random.normal((tokens * inputs + 1,)).astype(dtype)
    mx.eval(flat)
    shifted = flat[1:].reshape(tokens, inputs)  # a row-contiguous view at one element's offset
    aligned = mx.array(np.array(shifted.astype(mx.float32))).astype(dtype)
    got = expert_kernel.expert_matmul(shifted, qw, scales, biases, pairs, 64, k, use)
    want = expert_kernel.expert_matmul(aligned, qw, scales, biases, pairs, 64, k, use)
    np.testing.assert_array_equal(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)))
