"""The CUDA decode-attention kernels against MLX's masked attention: run where MLX's CUDA build is the
default device (the lent GPU), skipped elsewhere (the CPU computes `decode_attention` with MLX itself,
which the batch tests cover)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxq.worker.engine import ragged_attention
from mlxq.worker.engine.ragged_attention import RaggedRows, decode_attention

pytestmark = pytest.mark.skipif(not ragged_attention.available(), reason="the kernels run on CUDA only")


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize(("d", "heads", "kv_heads"), [(64, 32, 8), (128, 32, 8), (256, 8, 4), (256, 4, 4)])
def test_the_kernels_attend_as_masked_attention_does(
    d: int, heads: int, kv_heads: int, dtype: mx.Dtype
) -> None:
    """Rows starting at different columns (one at the buffer's first, one with a single key), the
    narrow kernel below `WIDE_FROM` dimensions and the wide one from there, extra heads in q ignored."""
    rows, capacity, end = 5, 320, 300
    mx.random.seed(d + heads)
    q = mx.random.normal((rows, heads + kv_heads, 1, d)).astype(dtype)  # the new keys' heads follow
    keys = mx.random.normal((rows, kv_heads, capacity, d)).astype(dtype)
    values = mx.random.normal((rows, kv_heads, capacity, d)).astype(dtype)
    ragged = RaggedRows(mx.array([0, 17, 299, 120, 3], dtype=mx.int32), end, capacity)
    got = decode_attention(q, keys, values, ragged, d**-0.5, heads=heads)
    want = ragged_attention._masked(q[:, :heads], keys, values, ragged, d**-0.5)
    tolerance = 1e-4 if dtype == mx.float32 else 2e-2
    np.testing.assert_allclose(
        np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=tolerance, rtol=tolerance
    )
    window = ragged.window(64)  # a sliding-window layer's view of the same step
    got = decode_attention(q, keys, values, window, d**-0.5, heads=heads)
    want = ragged_attention._masked(q[:, :heads], keys, values, window, d**-0.5)
    np.testing.assert_allclose(
        np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=tolerance, rtol=tolerance
    )


@pytest.mark.parametrize(("d", "heads", "kv_heads"), [(64, 32, 8), (256, 8, 4)])
def test_the_kernels_write_the_merged_shape_asked_for(d: int, heads: int, kv_heads: int) -> None:
    """`shape`: the output with the heads merged, (B, H * D), the same elements as (B, H, 1, D)."""
    rows, capacity, end = 3, 64, 60
    mx.random.seed(d)
    q = mx.random.normal((rows, heads + kv_heads, 1, d)).astype(mx.bfloat16)
    keys = mx.random.normal((rows, kv_heads, capacity, d)).astype(mx.bfloat16)
    values = mx.random.normal((rows, kv_heads, capacity, d)).astype(mx.bfloat16)
    ragged = RaggedRows(mx.array([0, 5, 59], dtype=mx.int32), end, capacity)
    plain = decode_attention(q, keys, values, ragged, d**-0.5, heads=heads)
    merged = decode_attention(q, keys, values, ragged, d**-0.5, heads=heads, shape=(rows, heads * d))
    assert merged.shape == (rows, heads * d)
    np.testing.assert_array_equal(
        np.array(merged.astype(mx.float32)), np.array(plain.reshape(rows, heads * d).astype(mx.float32))
    )
