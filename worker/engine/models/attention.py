"""The Llama family's attention (`Attention`): grouped-query attention with RoPE over a layer's cache.

Qwen2's q/k/v biases and Qwen3's per-head q/k norms are switches of its config (`model_args.py`); its
q/k/v projections fuse into one matmul (`fused_linear.py`); Gemma 3's attention extends it (`gemma3.py`).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxq.worker.engine.cache.batch_cache import BatchKVCache
from mlxq.worker.engine.cache.kv_cache import KVCache
from mlxq.worker.engine.cache.shared_prefix import SharedPrefixRows
from mlxq.worker.engine.models.base import LayerCache
from mlxq.worker.engine.models.fused_linear import fuse_linears, fused_outputs, kept_transpose, plus
from mlxq.worker.engine.models.masks import Mask
from mlxq.worker.engine.models.model_args import ModelArgs
from mlxq.worker.engine.models.quantized_rows import FusedDenseRows
from mlxq.worker.engine.models.rope import make_rope
from mlxq.worker.engine.ragged_attention import RaggedRows, decode_attention


def _heads(x: mx.array, b: int, n: int, heads: int, d: int) -> mx.array:
    """(B, L, heads * d), or (B, heads * d) for one position a row (a flat decode step: `llama.py`), as
    (B, heads, L, d). For one position a reshape alone gives the same array: one op fewer, and a GPU's
    decode step is bound by the host's launch of its ops."""
    if n == 1:
        return x.reshape(b, heads, 1, d)
    return x.reshape(b, n, heads, d).transpose(0, 2, 1, 3)


def _merged(out: mx.array, flat: bool) -> mx.array:
    """Attention's (B, heads, L, d) output as (B, L, heads * d), or `flat` (one position a row, as a flat
    decode step's input: `llama.py`) as (B, heads * d); for one position a reshape alone."""
    b, _, n, _ = out.shape
    if flat:
        return out.reshape(b, -1)
    if n == 1:
        return out.reshape(b, 1, -1)
    return out.transpose(0, 2, 1, 3).reshape(b, n, -1)


def _merged_shape(x: mx.array, features: int) -> tuple[int, ...]:
    """The shape `_merged` gives one position a row of attention's output: `x`'s, `features` wide."""
    return (x.shape[0], features) if x.ndim == 2 else (x.shape[0], 1, features)


def _positions(x: mx.array) -> int:
    """Positions a row of `x` holds: (B, L, features), or one for a flat step's (B, features)."""
    return 1 if x.ndim == 2 else x.shape[1]


class Attention(nn.Module):
    """Grouped-query attention with RoPE; positions continue from the layer's cache offset."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx.nn.Module.__init__ is unannotated
        assert args.head_dim is not None
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        self.scale = args.head_dim**-0.5
        h, qkv_bias = args.hidden_size, args.attention_bias or args.qkv_bias
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=args.attention_bias)
        if args.qk_norm:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.qk_norm = args.qk_norm
        # q and k normalised side by side (`_qk_normed`; set by `fuse` where both norms are plain ones)
        self.qk_together = False
        self._qk_scale: tuple[mx.array, mx.array, mx.array] | None = None  # q's and k's weights, stacked
        rotated = int(self.head_dim * args.partial_rotary_factor)
        self.rope = make_rope(rotated, args.rope_theta, args.rope_scaling)
        self.qkv_proj: nn.Module | None = None  # set by `fuse`, in place of q_proj, k_proj and v_proj

    def fuse(self) -> None:
        """Compute q, k and v with one matmul (`fuse_linears`), if their projections are plain; the
        output projection keeps its weight's transpose (`kept_transpose`)."""
        if self.qkv_proj is None:
            self.qkv_proj = fuse_linears(self, ["q_proj", "k_proj", "v_proj"])
        self.o_proj = kept_transpose(self.o_proj)
        if self.qk_norm:
            norms = (self.q_norm, self.k_norm)
            self.qk_together = all(type(n) is nn.RMSNorm for n in norms) and norms[0].eps == norms[1].eps

    def __call__(
        self,
        x: mx.array,
        mask: Mask,
        cache: LayerCache | None,
        last: int | None = None,
        columns: int | None = None,
        residual: mx.array | None = None,
    ) -> mx.array:
        """Attention output for every position, or with `last` for that position only (keys and values of
        every position still go into the cache). `columns`: read that many cache columns (the mask
        hides the ones past each query; see `kv_cache.key_columns`). `residual`: the output plus it
        (`fused_linear.plus`: one op fewer)."""
        if isinstance(mask, RaggedRows) and self._one_matmul(x):
            assert isinstance(cache, BatchKVCache) and last is None
            return self._ragged_step(x, mask, cache, residual)
        offset: int | mx.array = 0
        if isinstance(mask, RaggedRows):  # a decode step of left-padded rows: see ragged_attention.py
            offset = mask.positions
        elif cache is not None:
            offset = cache.offset
        if last is None and self._one_matmul(x):
            qk, v = self.rotated(x, offset)
            q, k = qk[:, : self.n_heads], qk[:, self.n_heads :]
        else:
            q, k, v = self._projected(x, last)
            q = self.rope(q, offset=offset if last is None else offset + last)
            k = self.rope(k, offset=offset)
        if isinstance(mask, RaggedRows):
            assert isinstance(cache, BatchKVCache) and last is None
            cache.write(k, v)  # the kernel reads the buffers themselves
            assert cache.keys is not None and cache.values is not None
            rows = mask.placed(cache.base, cache.capacity)
            out = decode_attention(q, cache.keys, cache.values, rows, self.scale)
        elif isinstance(cache, SharedPrefixRows):  # score rows reading one prefix in place
            out = cache.attend(q, k, v, self.scale)
        else:
            out = self.cached_attention(q, k, v, mask, cache, columns)
        return self.projected_out(_merged(out, x.ndim == 2), residual)

    def cached_attention(
        self,
        q: mx.array,
        k: mx.array,
        v: mx.array,
        mask: mx.array | str | None,
        cache: LayerCache | None,
        columns: int | None = None,
    ) -> mx.array:
        """MLX's attention of rotated q over the cache's keys and values once k and v are in it:
        (B, heads, L, head_dim)."""
        if cache is not None and columns is None:  # other cache kinds take no `columns`
            k, v = cache.update_and_fetch(k, v)
        elif cache is not None:
            assert isinstance(cache, KVCache)  # `columns` come with batch-1 caches (`bucketed_keys`)
            k, v = cache.update_and_fetch(k, v, columns)
        if isinstance(mask, mx.array) and mask.shape[-1] < k.shape[2]:  # a window's band (`window.py`)
            k, v = k[..., -mask.shape[-1] :, :], v[..., -mask.shape[-1] :, :]
        elif isinstance(mask, mx.array) and mask.shape[-1] > k.shape[2]:
            # A windowed cache's buffers start past position 0 (`kv_cache.py`): masks are built over
            # every position, and both end at the last one.
            mask = mask[..., -k.shape[2] :]
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)

    def projected_out(self, merged: mx.array, residual: mx.array | None) -> mx.array:
        """The output projection of the heads' merged output, plus `residual` where given."""
        if residual is not None:
            return plus(residual, self.o_proj, merged)
        return self.o_proj(merged)

    def _projected(self, x: mx.array, last: int | None) -> tuple[mx.array, mx.array, mx.array]:
        """q (of position `last` alone, if given), k and v as (B, heads, L, head_dim), not rotated."""
        b, n = x.shape[0], _positions(x)
        nq = n if last is None else 1
        xq = x if last is None else x[:, last : last + 1]
        if self.qkv_proj is not None:  # fused (`fuse`): one matmul, then views of its columns
            sizes = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
            q, k, v = fused_outputs(self.qkv_proj, x, (sizes[0], sum(sizes), sizes[0] + 2 * sizes[1]))
            if last is not None:
                q = q[:, last : last + 1]
        else:
            q, k, v = self.q_proj(xq), self.k_proj(x), self.v_proj(x)
        if n == 1:  # one position a row: each a reshape (`_heads`)
            q = _heads(q, b, 1, self.n_heads, self.head_dim)
            k = _heads(k, b, 1, self.n_kv_heads, self.head_dim)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            return q, k, _heads(v, b, 1, self.n_kv_heads, self.head_dim)
        q = q.reshape(b, nq, self.n_heads, self.head_dim)
        k = k.reshape(b, n, self.n_kv_heads, self.head_dim)
        v = v.reshape(b, n, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v

    def _one_matmul(self, x: mx.array) -> bool:
        """Whether q, k and v come out of one array here (`fuse`d, per-head norms if any normalising q
        and k side by side)."""
        proj = self.qkv_proj
        apart = isinstance(proj, FusedDenseRows) and proj.apart(x)
        return proj is not None and (not self.qk_norm or self.qk_together) and not apart

    def _qk_normed(self, qk: mx.array) -> mx.array:
        """q and k heads side by side, (B, heads + kv heads, L, head_dim), each head RMS-normalised and
        scaled by its own norm's weight (Qwen3's per-head norms): one norm and one product for both,
        where each had a norm of its own, so that one RoPE rotates both after (`rotated`). The product
        rounds the normalised heads to their dtype first, as transformers' Qwen3 norm does."""
        if not self.qk_norm:
            return qk
        return mx.fast.rms_norm(qk, None, self.q_norm.eps) * self.qk_scale()

    def qk_scale(self) -> mx.array:
        """The q norm's weight for each q head and the k norm's for each k head, (heads + kv heads, 1,
        head_dim): kept, made again if either weight is replaced."""
        q_weight, k_weight = self.q_norm["weight"], self.k_norm["weight"]
        kept = self._qk_scale
        if kept is None or kept[0] is not q_weight or kept[1] is not k_weight:
            h, hkv, d = self.n_heads, self.n_kv_heads, self.head_dim
            scale = mx.concatenate(
                [mx.broadcast_to(q_weight, (h, 1, d)), mx.broadcast_to(k_weight, (hkv, 1, d))]
            )
            kept = self._qk_scale = (q_weight, k_weight, scale)
        return kept[2]

    def rotated(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array]:
        """Every position's q and k heads side by side, (B, heads + kv heads, L, head_dim), rotated by
        one RoPE where two would launch twice (a GPU's decode and verify steps are bound by the host's
        launch of their ops), and v; from one matmul (`_one_matmul`)."""
        assert self.qkv_proj is not None
        b, n = x.shape[0], _positions(x)
        h, hkv, d = self.n_heads, self.n_kv_heads, self.head_dim
        if n == 1:  # every head at once by one reshape, then q and k apart from v: two ops, not three
            qk, v = mx.split(self.qkv_proj(x).reshape(b, h + 2 * hkv, 1, d), [h + hkv], axis=1)
            return self.rope(self._qk_normed(qk), offset=offset), v
        qk, v = mx.split(self.qkv_proj(x), [(h + hkv) * d], axis=-1)
        return self.rope(self._qk_normed(_heads(qk, b, n, h + hkv, d)), offset=offset), _heads(
            v, b, n, hkv, d
        )

    def _ragged_step(
        self, x: mx.array, rows: RaggedRows, cache: BatchKVCache, residual: mx.array | None
    ) -> mx.array:
        """A decode step of left-padded rows (`ragged_attention.py`) with q and k rotated together
        (`rotated`); the kernel reads the queries from the same array."""
        qk, v = self.rotated(x, rows.positions)
        shape = _merged_shape(x, self.n_heads * self.head_dim) if _positions(x) == 1 else None
        attn = self.ragged_attention(qk, v, rows, cache, shape)
        return self.projected_out(attn if shape is not None else _merged(attn, x.ndim == 2), residual)

    def ragged_attention(
        self,
        qk: mx.array,
        v: mx.array,
        rows: RaggedRows,
        cache: BatchKVCache,
        shape: tuple[int, ...] | None,
    ) -> mx.array:
        """The ragged kernel's attention (`decode_attention`) of rotated q and k heads side by side
        (`rotated`) once k and v are written into the cache's buffers; in `shape` where given."""
        h = self.n_heads
        cache.write(qk[:, h:], v)  # the kernel reads the buffers themselves
        assert cache.keys is not None and cache.values is not None
        placed = rows.placed(cache.base, cache.capacity)
        return decode_attention(qk, cache.keys, cache.values, placed, self.scale, heads=h, shape=shape)
