"""The Llama family: Llama 2/3.x, SmolLM, TinyLlama, Mistral, Qwen2 (QKV bias) and Qwen3 (Q/K norm).

These differ only in two switches, so one model holds them all: `qkv_bias` (Qwen2 always has biases on
q/k/v, never on o) and `qk_norm` (Qwen3 RMS-normalises each head of q and k before RoPE). Module
attribute names equal the Hugging Face checkpoint keys, so weights load without a mapping table.
A config's sliding window (Mistral, Phi-3, Qwen2's `layer_types`) narrows the attention of the layers it
applies to (`model_args.layer_windows`, `window.py`); their caches drop what the window no longer sees
(`kv_cache.py`).

This file holds the model itself: the decoder block, the stack of them and the causal LM on top
(`TransformerBlock`, `LlamaModel`, `Model`), which the other architectures extend. Its parts live beside
it: the config (`model_args.py`), the attention (`attention.py`), the SwiGLU feed-forward (`mlp.py`),
projections fused into one matmul (`fused_linear.py`) and the masks a forward hands its layers
(`masks.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn

from mlxq.worker.engine.cache.kv_cache import KVCache
from mlxq.worker.engine.models.attention import Attention
from mlxq.worker.engine.models.base import LayerCache
from mlxq.worker.engine.models.compiled_step import CompiledStep
from mlxq.worker.engine.models.layer_taps import FINAL, LayerSink
from mlxq.worker.engine.models.masks import Mask, additive_mask, bucketed_keys, mask_for_one_query
from mlxq.worker.engine.models.mlp import MLP
from mlxq.worker.engine.models.model_args import ModelArgs
from mlxq.worker.engine.models.window import WindowMasks
from mlxq.worker.engine.ragged_attention import RaggedRows

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
        # Whether attention and feed-forward add the residual to their output themselves (the Llama
        # family's do, in one op with their output projection: `fused_linear.plus`); plain attributes
        self.attention_adds = isinstance(self.self_attn, Attention)
        self.feed_forward_adds = bool(getattr(module, "adds_residual", False))

    def __call__(
        self,
        x: mx.array,
        mask: Mask,
        cache: LayerCache | None,
        last: int | None = None,
        columns: int | None = None,
    ) -> mx.array:
        """The block's output for every position, or with `last` for that position only."""
        residual = x if last is None else x[:, last : last + 1]
        normed = self.input_layernorm(x)
        if self.attention_adds:
            h: mx.array = self.self_attn(normed, mask, cache, last, columns, residual=residual)
        else:
            h = residual + self.self_attn(normed, mask, cache, last, columns)
        if self.feed_forward_adds:
            return self.feed_forward(self.post_attention_layernorm(h), residual=h)  # type: ignore[no-any-return]
        out: mx.array = self.feed_forward(self.post_attention_layernorm(h))
        return h + out

    @property
    def feed_forward(self) -> nn.Module:
        """The block's feed-forward module (dense `MLP` or a mixture of experts)."""
        return self[self.feed_forward_name]  # type: ignore[no-any-return]  # nn.Module is an untyped dict


def _fenced(h: mx.array, queued: mx.array | None) -> mx.array:
    """Queue a layer's output `h` to the device and wait for `queued`, the layer before's: the device
    runs one layer while the host encodes the next, and no further (`LlamaModel.fence_tokens`)."""
    mx.async_eval(h)
    if queued is not None:
        mx.eval(queued)
    return h


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (the checkpoint's `model.` prefix).

    `bucket_keys` (set by the engine on GPUs): a forward of several positions on top of a cached prefix
    reads whole steps of the cache, masked, so attention meets few key shapes (`kv_cache.key_columns`).
    """

    compiled_step: CompiledStep | None = None  # set by `Model.compile_steps`
    # From how many tokens a forward keeps the host at most a layer ahead of the device (`_fenced`;
    # None: never). Set by `Model.fuse` where a layer holds a large transient from some size on (a MoE
    # layer's experts dequantized, 1.2 GB a layer of a 30B-A3B): MLX's CUDA build allocates an op's
    # output when it encodes it, and frees a layer's transients only once the device has run it, so a
    # host that encodes every layer of a long prefill before the device is through the first holds
    # every layer's transients at once (a 32-prompt prefill of a 17 GB model ran out of 80 GB).
    fence_tokens: int | None = None

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
        n = inputs.shape[1] if inputs.ndim == 2 else 1  # (B,): one position a row, kept flat
        layer_mask: Mask = mask
        if isinstance(mask, mx.array) and mask.dtype == mx.bool_:
            layer_mask = additive_mask(mask, h.dtype)
        elif isinstance(mask, mx.array) and mx.issubdtype(mask.dtype, mx.floating) and mask.dtype != h.dtype:
            layer_mask = mask.astype(h.dtype)  # SDPA refuses an additive mask wider than its output
        elif mask is None and n > 1:
            # MLX's "causal" aligns the last query with the last key, so it is right with a cache offset.
            layer_mask = "causal"
        caches: list[LayerCache | None] = list(cache) if cache is not None else [None] * len(self.layers)
        columns = None
        if self.bucket_keys and mask is None and (bucketed := bucketed_keys(inputs, caches, h.dtype)):
            columns, layer_mask = bucketed
        masks = WindowMasks(layer_mask, n, caches[0], self.windows)
        fenced = self.fence_tokens is not None and h.size // h.shape[-1] >= self.fence_tokens
        if self.compiled_step is not None and inputs.ndim == 1 and taps is None and not fenced:
            return self.compiled_step(h, caches, masks, self.windows)
        layers = zip(self.layers[:-1], caches[:-1], self.windows[:-1], strict=True)
        queued: mx.array | None = None
        for i, (layer, c, window) in enumerate(layers):
            h = layer(h, masks(window), c, columns=columns)
            if fenced:
                queued = _fenced(h, queued)
            if taps is not None:
                taps.take(i, h)
        layer_mask = masks(self.windows[-1])
        if last is not None:
            layer_mask = mask_for_one_query(layer_mask, last, n, caches[-1])
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
        """Logits (B, L, vocab) for int32 token ids (B, L); for ids (B,), one position a row, (B, vocab)
        (see `flat_steps`).

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
        """Fuse each layer's q/k/v and gate/up projections (see `fuse_linears`); the output is the same
        up to the order of floating-point sums. The engine does it once the weights are in (a fused
        model's parameters no longer have the checkpoint's names)."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.feed_forward.fuse()
        large = [n for layer in self.layers if (n := getattr(layer.feed_forward, "large_from", None))]
        self.model.fence_tokens = min(large, default=None)

    def compile_steps(self) -> bool:
        """Build flat decode steps through compiled layer parts (`compiled_step.py`) from now on, once
        the weights are in and fused; False, and nothing changed, where the layers do not qualify."""
        self.model.compiled_step = CompiledStep.of(self.layers, self.model.norm)
        return self.model.compiled_step is not None

    @property
    def flat_steps(self) -> bool:
        """Whether a forward of one position a row may take its ids as (B,): every layer then keeps its
        hidden state as (B, hidden), and each matmul is a plain 2-D one, where (B, 1, hidden) costs MLX
        a flatten and an unflatten around each (ops a GPU's decode step, bound by the host's launch of
        its ops, launches 8 a layer). The Llama family's attention keeps either layout (`attention.py`);
        DeepSeek's latent attention does not."""
        return all(isinstance(layer.self_attn, Attention) for layer in self.layers)

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
