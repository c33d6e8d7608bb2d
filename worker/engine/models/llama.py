"""The Llama family: Llama 2/3.x, SmolLM, TinyLlama, Mistral, Qwen2 (QKV bias) and Qwen3 (Q/K norm).

These differ only in two switches, so one file holds them all: `qkv_bias` (Qwen2 always has biases on
q/k/v, never on o) and `qk_norm` (Qwen3 RMS-normalises each head of q and k before RoPE). Module
attribute names equal the Hugging Face checkpoint keys, so weights load without a mapping table.
A config's sliding window (Mistral, Phi-3, Qwen2's `layer_types`) narrows the attention of the layers it
applies to (`layer_windows`, `window.py`); their caches drop what the window no longer sees
(`kv_cache.py`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxq.worker.engine.cache.batch_cache import BatchKVCache
from mlxq.worker.engine.cache.kv_cache import KVCache, key_columns
from mlxq.worker.engine.cache.shared_prefix import SharedPrefixRows
from mlxq.worker.engine.errors import CheckpointError, UnsupportedArchitecture
from mlxq.worker.engine.models.base import LayerCache
from mlxq.worker.engine.models.layer_taps import FINAL, LayerSink
from mlxq.worker.engine.models.quantized_rows import FusedDenseRows, fuse_dense_rows
from mlxq.worker.engine.models.rope import make_rope
from mlxq.worker.engine.models.window import WindowMasks
from mlxq.worker.engine.ragged_attention import RaggedRows, decode_attention

Mask = mx.array | str | RaggedRows | None


@dataclass
class ModelArgs:
    """The config.json fields the Llama family needs; `from_dict` ignores everything else."""

    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    partial_rotary_factor: float = 1.0  # the share of each head's features RoPE rotates (Phi-4-mini: 0.75)
    original_max_position_embeddings: int | None = None  # LongRoPE's original context (Phi-3)
    sliding_window: int | None = None
    use_sliding_window: bool | None = None  # Qwen2/3 write it (False); Mistral's window is on when set
    qkv_bias: bool = False  # set by the registry for Qwen2, not read from config.json
    qk_norm: bool = False  # set by the registry for Qwen3
    layer_types: list[str] | None = None  # per layer "sliding_attention" or "full_attention"
    n_kv_heads: int = field(init=False)
    windows: list[int | None] = field(init=False)  # per layer: its sliding window, None if global

    def __post_init__(self) -> None:
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.n_kv_heads = self.num_key_value_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") in ("longrope", "yarn"):
            # transformers takes the top-level value first; a LongRoPE context past it is refused
            # (`rope.longrope`); YaRN's scaling is the same at every length
            original = int(
                self.original_max_position_embeddings
                or self.rope_scaling.get("original_max_position_embeddings")
                or self.max_position_embeddings
            )
            self.rope_scaling = {
                **self.rope_scaling,
                "original_max_position_embeddings": original,
                "max_position_embeddings": self.max_position_embeddings,
            }
            if self.rope_scaling["rope_type"] == "longrope":
                self.max_position_embeddings = min(self.max_position_embeddings, original)
        if self.hidden_act != "silu":
            raise UnsupportedArchitecture(self.hidden_act, ["silu"], what="hidden_act")
        self.windows = layer_windows(self)

    @property
    def cache_features(self) -> int:
        """Features one token adds to one layer's cache: its keys and values, every KV head."""
        assert self.head_dim is not None  # derived in __post_init__
        return 2 * self.n_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        """Keep known keys; read RoPE as transformers 4 (`rope_theta`, `rope_scaling`) or 5 wrote it."""
        known = inspect.signature(cls).parameters
        args = {k: v for k, v in config.items() if k in known}
        missing = [k for k, p in known.items() if p.default is inspect.Parameter.empty and k not in args]
        if missing:
            raise CheckpointError(
                f"config.json lacks {', '.join(missing)}, needed for {config.get('architectures')}"
            )
        args["rope_theta"], args["rope_scaling"], args["partial_rotary_factor"] = rope_settings(config)
        return cls(**args)


LAYER_TYPES = ("sliding_attention", "full_attention")


def layer_windows(args: ModelArgs) -> list[int | None]:
    """Each layer's sliding window (None: global attention), as transformers applies `sliding_window`:
    on the layers `layer_types` names sliding, or on every layer where there are none (Mistral, Mixtral,
    Phi-3); off where `use_sliding_window` is false (Qwen2/3) or the window covers the whole context."""
    n = args.num_hidden_layers
    window = args.sliding_window if args.use_sliding_window is not False else None
    if not window or window >= args.max_position_embeddings:
        return [None] * n
    types = args.layer_types
    if types is None:
        if args.use_sliding_window:  # Qwen2's older configs: windows from `max_window_layers` on
            raise UnsupportedArchitecture(
                "use_sliding_window without layer_types",
                ["layer_types naming each layer's attention"],
                what="sliding-window layout",
                why="which layers slide is read from layer_types (transformers 5 writes it)",
            )
        return [window] * n
    if len(types) != n or any(t not in LAYER_TYPES for t in types):
        raise CheckpointError(f"layer_types {types} is not one of {LAYER_TYPES} for each of {n} layers")
    return [window if t == "sliding_attention" else None for t in types]


def rope_settings(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """(theta, scaling dict with a `rope_type` key or None, partial rotary factor) from either
    config.json layout."""
    params = config.get("rope_parameters")  # transformers 5: one dict with theta and scaling together
    if not isinstance(params, dict):
        params = {**(config.get("rope_scaling") or {}), "rope_theta": config.get("rope_theta", 10000.0)}
    params = dict(params)
    theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    partial = float(params.pop("partial_rotary_factor", None) or config.get("partial_rotary_factor") or 1.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"  # "type": old v4
    if rope_type == "default":
        return theta, None, partial
    return theta, {**params, "rope_type": rope_type}, partial


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
        rotated = int(self.head_dim * args.partial_rotary_factor)
        self.rope = make_rope(rotated, args.rope_theta, args.rope_scaling)
        self.qkv_proj: nn.Module | None = None  # set by `fuse`, in place of q_proj, k_proj and v_proj

    def fuse(self) -> None:
        """Compute q, k and v with one matmul (`_fuse_linears`), if their projections are plain."""
        if self.qkv_proj is None:
            self.qkv_proj = _fuse_linears(self, ["q_proj", "k_proj", "v_proj"])

    def __call__(
        self,
        x: mx.array,
        mask: Mask,
        cache: LayerCache | None,
        last: int | None = None,
        columns: int | None = None,
    ) -> mx.array:
        """Attention output for every position, or with `last` for that position only (keys and values of
        every position still go into the cache). `columns`: read that many cache columns (the mask
        hides the ones past each query; see `kv_cache.key_columns`)."""
        b = x.shape[0]
        if isinstance(mask, RaggedRows) and self._one_matmul(x):
            assert isinstance(cache, BatchKVCache) and last is None
            return self._ragged_step(x, mask, cache)
        offset: int | mx.array = 0
        if isinstance(mask, RaggedRows):  # a decode step of left-padded rows: see ragged_attention.py
            offset = mask.positions
        elif cache is not None:
            offset = cache.offset
        if last is None and self._one_matmul(x):
            qk, v = self._rotated(x, offset)
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
            if cache is not None and columns is None:  # other cache kinds take no `columns`
                k, v = cache.update_and_fetch(k, v)
            elif cache is not None:
                assert isinstance(cache, KVCache)  # `columns` come with batch-1 caches (`_bucketed_keys`)
                k, v = cache.update_and_fetch(k, v, columns)
            if isinstance(mask, mx.array) and mask.shape[-1] < k.shape[2]:  # a window's band (`window.py`)
                k, v = k[..., -mask.shape[-1] :, :], v[..., -mask.shape[-1] :, :]
            elif isinstance(mask, mx.array) and mask.shape[-1] > k.shape[2]:
                # A windowed cache's buffers start past position 0 (`kv_cache.py`): masks are built over
                # every position, and both end at the last one.
                mask = mask[..., -k.shape[2] :]
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, q.shape[2], -1))

    def _projected(self, x: mx.array, last: int | None) -> tuple[mx.array, mx.array, mx.array]:
        """q (of position `last` alone, if given), k and v as (B, heads, L, head_dim), not rotated."""
        b, n, _ = x.shape
        xq = x if last is None else x[:, last : last + 1]
        if self.qkv_proj is not None:  # fused (`fuse`): one matmul, then views of its columns
            nq, nkv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
            q, k, v = _fused_outputs(self.qkv_proj, x, (nq, nq + nkv, nq + 2 * nkv))
            if last is not None:
                q = q[:, last : last + 1]
        else:
            q, k, v = self.q_proj(xq), self.k_proj(x), self.v_proj(x)
        q = q.reshape(b, xq.shape[1], self.n_heads, self.head_dim)
        k = k.reshape(b, n, self.n_kv_heads, self.head_dim)
        v = v.reshape(b, n, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v

    def _one_matmul(self, x: mx.array) -> bool:
        """Whether q, k and v come out of one array here (`fuse`d, no per-head norms between)."""
        proj = self.qkv_proj
        apart = isinstance(proj, FusedDenseRows) and proj.apart(x)
        return proj is not None and not self.qk_norm and not apart

    def _rotated(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array]:
        """Every position's q and k heads side by side, (B, heads + kv heads, L, head_dim), rotated by
        one RoPE where two would launch twice (a GPU's decode and verify steps are bound by the host's
        launch of their ops), and v; from one matmul (`_one_matmul`)."""
        assert self.qkv_proj is not None
        b, n, _ = x.shape
        h, hkv, d = self.n_heads, self.n_kv_heads, self.head_dim
        out = self.qkv_proj(x)
        qk = out[..., : (h + hkv) * d].reshape(b, n, h + hkv, d).transpose(0, 2, 1, 3)
        v = out[..., (h + hkv) * d :].reshape(b, n, hkv, d).transpose(0, 2, 1, 3)
        return self.rope(qk, offset=offset), v

    def _ragged_step(self, x: mx.array, rows: RaggedRows, cache: BatchKVCache) -> mx.array:
        """A decode step of left-padded rows (`ragged_attention.py`) with q and k rotated together
        (`_rotated`); the kernel reads the queries from the same array."""
        b, n, _ = x.shape
        h = self.n_heads
        qk, v = self._rotated(x, rows.positions)
        cache.write(qk[:, h:], v)  # the kernel reads the buffers themselves
        assert cache.keys is not None and cache.values is not None
        placed = rows.placed(cache.base, cache.capacity)
        attn = decode_attention(qk, cache.keys, cache.values, placed, self.scale, heads=h)
        return self.o_proj(attn.transpose(0, 2, 1, 3).reshape(b, n, -1))


@partial(mx.compile, shapeless=True)
def _swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """silu(gate) * up as one compiled op: one kernel launch where two ops would make two."""
    return nn.silu(gate) * up  # type: ignore[no-any-return]  # mlx.nn.silu is unannotated


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx.nn.Module.__init__ is unannotated
        h, inter, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = nn.Linear(h, inter, bias=bias)
        self.up_proj = nn.Linear(h, inter, bias=bias)
        self.down_proj = nn.Linear(inter, h, bias=bias)
        self.intermediate_size = inter
        self.gate_up_proj: nn.Module | None = None  # set by `fuse`, in place of gate_proj and up_proj

    def fuse(self) -> None:
        """Compute gate and up with one matmul (`_fuse_linears`), if their projections are plain."""
        if self.gate_up_proj is None:
            self.gate_up_proj = _fuse_linears(self, ["gate_proj", "up_proj"])

    def __call__(self, x: mx.array) -> mx.array:
        if self.gate_up_proj is not None:
            inter = self.intermediate_size
            gate, up = _fused_outputs(self.gate_up_proj, x, (inter, 2 * inter))
            return self.down_proj(self.gated(gate, up))
        return self.down_proj(self.gated(self.gate_proj(x), self.up_proj(x)))

    def gated(self, gate: mx.array, up: mx.array) -> mx.array:
        """The activation of gate times up: SwiGLU's (Gemma's MLP overrides it)."""
        return _swiglu(gate, up)


def _fused_outputs(proj: nn.Module, x: mx.array, ends: tuple[int, ...]) -> list[mx.array]:
    """A fused projection's outputs (`_fuse_linears`), each ending at its column in `ends`: views of one
    matmul's columns, or for few rows a dense-rows one's parts apart (a lone step launches no
    concatenation). On the decode path: no more Python than the slices themselves."""
    if isinstance(proj, FusedDenseRows) and proj.apart(x):
        return [part(x) for part in proj.parts]
    out = proj(x)
    return [out[..., a:b] for a, b in zip((0, *ends[:-1]), ends, strict=True)]


def _fuse_linears(module: nn.Module, names: list[str]) -> nn.Module | None:
    """One `nn.Linear` computing the named projections of `module` side by side (weights, and biases if
    they have them, concatenated along the outputs), which it then drops; None, and nothing changed,
    if any of them is not a plain `nn.Linear` (quantized) or only some have a bias.

    A decode step on a GPU is bound by the host's launch of each op, a matmul's the dearest
    (`bench/README.md`, what the engine's defaults rest on): fusing q/k/v and gate/up saves three of a
    layer's seven.
    Quantized projections with dense copies (`quantized_rows.use_dense_rows`) fuse those copies."""
    parts = [getattr(module, name) for name in names]
    if (dense := fuse_dense_rows(parts)) is not None:
        for name in names:
            delattr(module, name)
        return dense
    if any(type(p) is not nn.Linear for p in parts):
        return None
    biased = ["bias" in p for p in parts]
    if any(biased) and not all(biased):
        return None
    weight = mx.concatenate([p.weight for p in parts], axis=0)
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=all(biased))
    fused.weight = weight
    if all(biased):
        fused.bias = mx.concatenate([p.bias for p in parts])
    mx.eval(fused.parameters())
    for name in names:
        delattr(module, name)
    return fused


FeedForward = Callable[[int], tuple[str, nn.Module]]  # layer index -> (checkpoint name, module)
AttentionFactory = Callable[[int], nn.Module]  # layer index -> an attention taking `Attention`'s call


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention then a feed-forward, by default the dense SwiGLU `MLP` under
    the checkpoint name `mlp`; a mixture of experts (`moe.py`) brings its own module and name."""

    def __init__(
        self,
        args: ModelArgs,
        feed_forward: tuple[str, nn.Module] | None = None,
        attention: nn.Module | None = None,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx.nn.Module.__init__ is unannotated
        self.self_attn = attention if attention is not None else Attention(args)
        name, module = feed_forward if feed_forward is not None else ("mlp", MLP(args))
        setattr(self, name, module)
        self.feed_forward_name = name  # a str: a plain attribute, not a parameter
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(
        self,
        x: mx.array,
        mask: Mask,
        cache: LayerCache | None,
        last: int | None = None,
        columns: int | None = None,
    ) -> mx.array:
        """The block's output for every position, or with `last` for that position only."""
        attn: mx.array = self.self_attn(self.input_layernorm(x), mask, cache, last, columns)
        h = (x if last is None else x[:, last : last + 1]) + attn
        out: mx.array = self.feed_forward(self.post_attention_layernorm(h))
        return h + out

    @property
    def feed_forward(self) -> nn.Module:
        """The block's feed-forward module (dense `MLP` or a mixture of experts)."""
        return self[self.feed_forward_name]  # type: ignore[no-any-return]  # nn.Module is an untyped dict


def _mask_for_one_query(mask: Mask, last: int, n: int, cache: LayerCache | None) -> Mask:
    """The mask of query `last` alone (of `n` new positions): its row of an explicit mask; for causal
    attention nothing when it is the last position (it sees every key), else the keys up to its own."""
    if isinstance(mask, mx.array):
        return mask[..., last : last + 1, :] if mask.shape[-2] == n else mask
    if last == n - 1:
        return None
    offset = cache.offset if cache is not None else 0
    if not isinstance(offset, int):
        raise ValueError("a causal one-query mask needs one offset for every row")
    return mx.arange(offset + n) <= offset + last


def _bucketed_keys(
    inputs: mx.array, caches: Sequence[LayerCache | None], dtype: mx.Dtype
) -> tuple[int, mx.array] | None:
    """For L new positions on top of a cached prefix: the cache columns to read (`key_columns`) and the
    additive (1, 1, L, columns) causal mask hiding the columns past each query; None when the exact
    key count is already a whole number of steps (or there is no cached prefix to bucket)."""
    cache, n = caches[0], inputs.shape[1]
    if n <= 1 or type(cache) is not KVCache or not cache.offset:
        return None
    offset = cache.offset
    columns = key_columns(offset + n)
    if columns == offset + n:
        return None
    visible = mx.arange(columns)[None, :] <= mx.arange(offset, offset + n)[:, None]
    return columns, additive_mask(visible, dtype)[None, None]


def additive_mask(visible: mx.array, dtype: mx.Dtype) -> mx.array:
    """A boolean mask (True: attend) as the additive one attention takes: 0 where it attends, -inf
    elsewhere, in `dtype`. MLX's fused attention on CUDA takes no boolean mask: given one, it converts it
    in every layer (a kernel, and its launch, each), where a forward converts it once here."""
    return mx.where(visible, mx.array(0, dtype), mx.array(-mx.inf, dtype))


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (the checkpoint's `model.` prefix).

    `bucket_keys` (set by the engine on GPUs): a forward of several positions on top of a cached prefix
    reads whole steps of the cache, masked, so attention meets few key shapes (`kv_cache.key_columns`).
    """

    def __init__(
        self,
        args: ModelArgs,
        feed_forward: FeedForward | None = None,
        attention: AttentionFactory | None = None,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx.nn.Module.__init__ is unannotated
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [
            TransformerBlock(
                args,
                feed_forward(i) if feed_forward is not None else None,
                attention(i) if attention is not None else None,
            )
            for i in range(args.num_hidden_layers)
        ]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.bucket_keys = False
        self.windows = args.windows  # per layer: its sliding window (`window.py`), None if global

    def __call__(
        self,
        inputs: mx.array,
        cache: Sequence[LayerCache] | None = None,
        mask: mx.array | RaggedRows | None = None,
        last: int | None = None,
        taps: LayerSink | None = None,
    ) -> mx.array:
        h = self.embed(inputs)
        layer_mask: Mask = mask
        if isinstance(mask, mx.array) and mask.dtype == mx.bool_:
            layer_mask = additive_mask(mask, h.dtype)
        elif isinstance(mask, mx.array) and mx.issubdtype(mask.dtype, mx.floating) and mask.dtype != h.dtype:
            layer_mask = mask.astype(h.dtype)  # SDPA refuses an additive mask wider than its output
        elif mask is None and inputs.shape[1] > 1:
            # MLX's "causal" aligns the last query with the last key, so it is right with a cache offset.
            layer_mask = "causal"
        caches: list[LayerCache | None] = list(cache) if cache is not None else [None] * len(self.layers)
        columns = None
        if self.bucket_keys and mask is None and (bucketed := _bucketed_keys(inputs, caches, h.dtype)):
            columns, layer_mask = bucketed
        masks = WindowMasks(layer_mask, inputs.shape[1], caches[0], self.windows)
        layers = zip(self.layers[:-1], caches[:-1], self.windows[:-1], strict=True)
        for i, (layer, c, window) in enumerate(layers):
            h = layer(h, masks(window), c, columns=columns)
            if taps is not None:
                taps.take(i, h)
        layer_mask = masks(self.windows[-1])
        if last is not None:
            layer_mask = _mask_for_one_query(layer_mask, last, inputs.shape[1], caches[-1])
        h = self.layers[-1](h, layer_mask, caches[-1], last, columns)
        out: mx.array = self.norm(h)
        if taps is not None and last is None:
            taps.take(FINAL, out)
        return out

    def embed(self, inputs: mx.array) -> mx.array:
        """The input embeddings of token ids (B, L)."""
        return self.embed_tokens(inputs)  # type: ignore[no-any-return]  # mlx.nn.Embedding is unannotated


class Model(nn.Module):
    """A causal LM: `model(inputs, cache, mask) -> logits`, or `hidden` and `logits` separately.

    `feed_forward` (layer index -> (checkpoint name, module)) replaces the dense `MLP` of some or all
    layers, `attention` the attention: how the mixture-of-experts architectures (`moe.py`) and
    DeepSeek-V3's latent attention (`deepseek.py`) reuse everything else here."""

    def __init__(
        self,
        args: ModelArgs,
        feed_forward: FeedForward | None = None,
        attention: AttentionFactory | None = None,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx.nn.Module.__init__ is unannotated
        self.args = args
        self.model = LlamaModel(args, feed_forward, attention)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(
        self,
        inputs: mx.array,
        cache: Sequence[LayerCache] | None = None,
        mask: mx.array | RaggedRows | None = None,
        taps: LayerSink | None = None,
    ) -> mx.array:
        """Logits (B, L, vocab) for int32 token ids (B, L).

        `mask=None` is causal over the cache's positions plus these L; an explicit mask (boolean, True =
        attend, or additive) must broadcast to (B, heads, L, offset + L). `taps` is handed the
        output of every layer but the last as it is built (`layer_taps.py`).
        """
        return self.logits(self.hidden(inputs, cache=cache, mask=mask, taps=taps))

    def hidden(
        self,
        inputs: mx.array,
        cache: Sequence[LayerCache] | None = None,
        mask: mx.array | RaggedRows | None = None,
        last: int | None = None,
        taps: LayerSink | None = None,
    ) -> mx.array:
        """Final normed hidden states (B, L, hidden_size); same arguments as `__call__`.

        `last`: only position `last`'s, (B, 1, hidden_size). Every layer still writes every position's
        keys and values into the cache, but the final layer computes attention and MLP for that one
        position: what a prefill needs, and a whole layer's work saved on the rest.
        """
        return self.model(inputs, cache=cache, mask=mask, last=last, taps=taps)

    def logits(self, hidden: mx.array) -> mx.array:
        """Project hidden states (..., hidden_size) to vocabulary logits (..., vocab)."""
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(hidden)  # type: ignore[no-any-return]  # unannotated in MLX
        return self.lm_head(hidden)

    @property
    def bucket_keys(self) -> bool:
        """Whether multi-position forwards on a cached prefix read bucketed key columns (`LlamaModel`)."""
        return self.model.bucket_keys

    @bucket_keys.setter
    def bucket_keys(self, on: bool) -> None:
        self.model.bucket_keys = on

    @property
    def layers(self) -> list[TransformerBlock]:
        return self.model.layers

    def fuse(self) -> None:
        """Fuse each layer's q/k/v and gate/up projections (see `_fuse_linears`); the output is the same
        up to the order of floating-point sums. The engine does it once the weights are in (a fused
        model's parameters no longer have the checkpoint's names)."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.feed_forward.fuse()

    @property
    def reads_shared_prefix(self) -> bool:
        """Whether every layer's attention reads a score batch's shared prefix in place
        (`shared_prefix.SharedPrefixRows`); DeepSeek's latent attention does not."""
        return all(isinstance(layer.self_attn, Attention) for layer in self.layers)

    def make_cache(self) -> list[KVCache]:
        """One empty `KVCache` per layer; a sliding-window layer's drops what its window no longer sees."""
        return [KVCache(window) for window in self.model.windows]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Drop what a checkpoint may carry but the model computes itself (RoPE tables, a tied lm_head)."""
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
        return weights
