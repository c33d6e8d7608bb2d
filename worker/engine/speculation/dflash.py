"""DFlash: a small drafter that proposes a whole block of tokens in one forward, from the target's own
hidden states ("Block Diffusion for Flash Speculative Decoding", z-lab; reference: the `dflash`
package's `DFlashDraftModel`).

What it reads: the outputs of a few chosen target layers (`target_layer_ids`) for every token the
target was fed, side by side (its context features). A linear map (`fc`) and an RMS norm turn them
into one vector per token, and each draft layer keeps that vector's keys and values in a cache of its
own: the draft's cache holds the row's context, one entry per token the target kept, and nothing
else.

What it proposes: a block of `block_size` positions after the context, the row's latest token (sampled,
not fed to the target yet) then the mask token at every other position, embedded with the target's
own embedding. The draft layers (Qwen3 layers whose queries are the block's and whose keys are the
context's then the block's, every block position seeing every other unless the config says causal)
give each mask position a hidden state, and the target's own output head its logits: the block's
drafts are their argmax, all from one forward. The block's keys are never cached.

How it follows a row: the decode batch hands every forward's tapped layer outputs to the row's drafter
with the position they start at (`DecodeBatch.taps`); the drafter holds them until a proposal needs
them (`held_features.py`: a row the draft gate keeps from drafting pays no draft work), then adds them
to its cache, forgetting first what it holds from that position on (a verify step's rejected drafts,
a forward dropped and fed again). The prompt's features come from the batch's prefill, tapped for a
row with such a drafter (`batch_prefill.py`); only a prompt's prefix the prefix cache gave (never run
here) takes a forward of the drafter's own over it (the target's layers with a cache of their own,
thrown away), the first time the row proposes. A drafter that finds a gap it cannot fill (not
expected) stops proposing: the row decodes on, plainly.

Not implemented (refused when a draft's config asks for them): sliding-window draft layers, DFlash2's
convolutions and candidate selector, taps of the target's last layer.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxq.worker.engine.cache.kv_cache import KVCache
from mlxq.worker.engine.errors import CheckpointError
from mlxq.worker.engine.models import mlp, model_args
from mlxq.worker.engine.models.base import Model
from mlxq.worker.engine.models.layer_taps import LayerTaps
from mlxq.worker.engine.models.loader import load_config, load_module
from mlxq.worker.engine.models.rope import make_rope
from mlxq.worker.engine.speculation.draft_model import DraftMismatch, DraftTarget, register_draft
from mlxq.worker.engine.speculation.held_features import HeldFeatures

log = logging.getLogger(__name__)

ARCHITECTURE = "DFlashDraftModel"  # `architectures[0]` of the package's draft checkpoints

# dflash_config keys naming what only DFlash2 (or a later variant) computes: refused, never ignored
_UNSUPPORTED = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def default_target_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The target layers a draft reads when its config names none (the package's rule): the middle
    layer for a one-layer draft, else one per draft layer spread evenly from layer 1 to the fourth
    from last."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    first, last = 1, num_target_layers - 3
    return [round(first + i * (last - first) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class DFlashConfig:
    """A DFlash draft's config.json (a Qwen3 config plus `num_target_layers` and `dflash_config`;
    a DFlash setting is read from `dflash_config`, else from the top level, as the package does)."""

    args: model_args.ModelArgs
    num_target_layers: int
    target_layers: tuple[int, ...]
    block_size: int
    mask_token_id: int
    causal: bool
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> DFlashConfig:
        extra = config.get("dflash_config") or {}

        def value(name: str, default: Any = None) -> Any:
            return extra.get(name, config.get(name, default))

        unsupported = [k for k in _UNSUPPORTED if value(k)]
        types = config.get("layer_types") or []
        if any(t != "full_attention" for t in types):
            unsupported.append(f"layer_types {types}")
        if unsupported:
            raise CheckpointError(
                f"this DFlash draft needs what mlxq does not implement: {', '.join(unsupported)}"
            )
        try:
            args = model_args.ModelArgs.from_dict({**config, "layer_types": None, "sliding_window": None})
            num_target_layers = int(config["num_target_layers"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"a DFlash draft config lacks or misreads {e}") from e
        args.qk_norm = True  # Qwen3 layers
        layers = value("target_layer_ids") or default_target_layers(num_target_layers, args.num_hidden_layers)
        mask = value("mask_token_id")
        if mask is None:
            raise CheckpointError("a DFlash draft config must name its mask_token_id (dflash_config)")
        softcap = value("final_logit_softcapping")
        causal = config.get("is_causal")
        return cls(
            args=args,
            num_target_layers=num_target_layers,
            target_layers=tuple(int(i) for i in layers),
            block_size=int(value("block_size", 16)),
            mask_token_id=int(mask),
            causal=bool(causal) if causal is not None else False,
            input_embedding_scale=float(value("input_embedding_scale", 1.0)),
            output_multiplier=float(value("output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap else None,
        )


class DFlashAttention(nn.Module):
    """A draft layer's attention: queries from the block, keys and values from the cached context and
    the block (Qwen3's q/k norms, then RoPE at the tokens' positions)."""

    def __init__(self, args: model_args.ModelArgs) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx.nn.Module.__init__ is unannotated
        assert args.head_dim is not None
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.n_kv_heads
        self.head_dim = args.head_dim
        self.scale = args.head_dim**-0.5
        h, bias = args.hidden_size, args.attention_bias
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.rope = make_rope(self.head_dim, args.rope_theta, args.rope_scaling)

    def _keys_values(self, x: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(b, n, self.n_kv_heads, self.head_dim)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, n, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        return self.rope(k, offset=offset), v

    def remember(self, context: mx.array, cache: KVCache) -> None:
        """Cache the keys and values of context vectors (1, S, hidden) at the cache's next positions."""
        k, v = self._keys_values(context, cache.offset)
        cache.update_and_fetch(k, v)

    def __call__(self, x: mx.array, cache: KVCache, causal: bool) -> mx.array:
        """The block's attention output (1, L, hidden); the block starts at the cache's offset."""
        b, n, _ = x.shape
        start = cache.offset
        q = self.q_norm(self.q_proj(x).reshape(b, n, self.n_heads, self.head_dim)).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=start)
        k, v = self._keys_values(x, start)
        if start:
            past_k, past_v = cache.state
            k, v = mx.concatenate([past_k, k], axis=2), mx.concatenate([past_v, v], axis=2)
        mask = None
        if causal and n > 1:
            mask = mx.arange(start + n)[None, :] <= (start + mx.arange(n))[:, None]
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))


class DFlashLayer(nn.Module):
    """Pre-norm residual block: `DFlashAttention` then Qwen3's SwiGLU MLP."""

    def __init__(self, args: model_args.ModelArgs) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx.nn.Module.__init__ is unannotated
        self.self_attn = DFlashAttention(args)
        self.mlp = mlp.MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, cache: KVCache, causal: bool) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache, causal)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashModel(nn.Module):
    """The draft's own weights (names as the package's checkpoints have them: `fc`, `hidden_norm`,
    `layers.N...`, `norm`); the embedding and output head are the target's."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx.nn.Module.__init__ is unannotated
        args = config.args
        self.config = config
        self.fc = nn.Linear(len(config.target_layers) * args.hidden_size, args.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.layers = [DFlashLayer(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def remember(self, features: mx.array, cache: list[KVCache]) -> None:
        """Add the context of tokens whose tapped target features (1, S, taps * hidden) are given."""
        context = self.hidden_norm(self.fc(features))
        for layer, c in zip(self.layers, cache, strict=True):
            layer.self_attn.remember(context, c)

    def __call__(self, block: mx.array, cache: list[KVCache]) -> mx.array:
        """Final normed hidden states (1, L, hidden) of an embedded block (1, L, hidden) after the
        cached context; the cache is read, not written."""
        h = block
        for layer, c in zip(self.layers, cache, strict=True):
            h = layer(h, c, self.config.causal)
        return self.norm(h)  # type: ignore[no-any-return]


@dataclass
class DFlashDraft:
    """A loaded DFlash draft bound to its target: what its drafters share."""

    model: DFlashModel
    target: Model
    folder: Path
    prefill_chunk: int = 2048

    @property
    def taps(self) -> tuple[int, ...]:
        """The target layers whose outputs the drafters read."""
        return self.model.config.target_layers

    @property
    def max_depth(self) -> int:
        """Most tokens one proposal holds: the block's positions after the row's latest token."""
        return self.model.config.block_size - 1

    def drafter(self) -> DFlashDrafter:
        """A drafter for one row, with a cache of its own."""
        return DFlashDrafter(self)

    def block_logits(self, token: int, cache: list[KVCache]) -> mx.array:
        """Logits (block_size - 1, vocab) of the block after the cached context that starts with
        `token` (the others mask tokens)."""
        config = self.model.config
        ids = mx.array([[token] + [config.mask_token_id] * (config.block_size - 1)], dtype=mx.int32)
        embed = cast("nn.Embedding", self.target.model.embed_tokens)  # type: ignore[attr-defined]
        block = embed(ids)
        if config.input_embedding_scale != 1.0:
            block = block * config.input_embedding_scale
        hidden = self.model(block, cache)[0, 1:]
        logits = self.target.logits(hidden)
        if config.output_multiplier != 1.0:
            logits = logits * config.output_multiplier
        if config.final_logit_softcapping is not None:
            cap = config.final_logit_softcapping
            logits = mx.tanh(logits / cap) * cap
        return logits

    def features(self, tokens: Sequence[int]) -> list[mx.array]:
        """The tapped target features of `tokens` from position 0 (a forward of the target's own, with a
        cache thrown away), in chunks of at most `prefill_chunk` tokens: a prompt's prefix the prefix
        cache gave."""
        cache = self.target.make_cache()
        chunks: list[mx.array] = []
        for start in range(0, len(tokens), self.prefill_chunk):
            ids = mx.array([list(tokens[start : start + self.prefill_chunk])], dtype=mx.int32)
            taps = LayerTaps(self.taps)
            self.target.hidden(ids, cache=cache, last=ids.shape[1] - 1, taps=taps)
            chunks.append(taps.features())
        return chunks

    @classmethod
    def load(cls, folder: Path, target: DraftTarget) -> DFlashDraft:
        """The draft in `folder` for `target`; `CheckpointError`/`DraftMismatch` naming what does not fit."""
        config = DFlashConfig.from_dict(load_config(folder))
        layers = target.model.args
        n_target = len(target.model.layers)
        if config.num_target_layers != n_target:
            raise DraftMismatch(
                f"the DFlash draft in {folder} was made for a target of {config.num_target_layers} layers; "
                f"this target has {n_target}"
            )
        if any(not 0 <= i < n_target - 1 for i in config.target_layers):
            raise DraftMismatch(
                f"the DFlash draft in {folder} reads target layers {list(config.target_layers)}; mlxq taps "
                f"layers 0..{n_target - 2} (the last layer's output is not tapped)"
            )
        if config.args.vocab_size != layers.vocab_size or not 0 <= config.mask_token_id < layers.vocab_size:
            raise DraftMismatch(
                f"the DFlash draft in {folder} has {config.args.vocab_size} token ids and mask token "
                f"{config.mask_token_id}; the target has {layers.vocab_size} token ids"
            )
        hidden = cast("int", getattr(layers, "hidden_size", config.args.hidden_size))
        if config.args.hidden_size != hidden:
            raise DraftMismatch(
                f"the DFlash draft in {folder} is {config.args.hidden_size} wide; the target {hidden}"
            )
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"the DFlash draft in {folder} has no .safetensors weights")
        dtype = target.model.model.norm.weight.dtype  # the target's compute dtype
        weights: dict[str, mx.array] = {}
        for f in files:
            loaded = cast("dict[str, mx.array]", mx.load(str(f)))
            weights.update({k: v.astype(dtype) for k, v in loaded.items() if "rotary_emb" not in k})
        model = DFlashModel(config)
        load_module(model, weights, f"the DFlash draft in {folder}")
        return cls(model, target.model, folder, target.prefill_chunk)


class DFlashDrafter:
    """A `Drafter` for one row that reads the target's features (`DecodeBatch.taps`): the draft's cache
    holds the row's context up to `cached` tokens, and `held` the features of the next ones, to be
    remembered when a proposal needs them (`held_features.py`). The prompt's come from the batch's
    prefill (`take_features` from position 0); where the prefix cache gave the prompt's first tokens,
    never run by the batch, their context (`unseen`) comes from a forward of the target's own when a
    proposal first needs it: a row the draft gate keeps from drafting pays no draft work, and a feature
    handed over is never evaluated here."""

    def __init__(self, draft: DFlashDraft) -> None:
        self.draft = draft
        self.cache = draft.model.make_cache()
        self.held = HeldFeatures()
        self.unseen = 0
        self.lost = False  # a gap in the features: no more proposals for this row

    @property
    def cached(self) -> int:
        """The row's tokens whose context the cache holds (positions 0..cached - 1)."""
        return self.cache[0].offset

    @property
    def known(self) -> int:
        """The row's tokens whose context the drafter has, cached, to compute or held."""
        return self.cached + self.unseen + len(self.held)

    def take_features(self, position: int, features: mx.array, tokens: Sequence[int]) -> list[mx.array]:
        """A target forward's tapped features (1, W, taps * hidden) of the row's tokens from `position`
        on; `tokens` the row's tokens so far (the prompt's, at least). Held until a proposal remembers
        them; returns what to compute with the forward (`HeldFeatures.add`). The first call comes
        from the row's prefill, with the prompt's features (from the end of a prefix the prefix cache
        gave, if any)."""
        if self.lost:
            return []
        if position < self.known:
            self._forget(self.known - position)
        if position > self.known and not self._catch_up(tokens, position):
            return []
        return self.held.add(features)

    def propose(self, tokens: Sequence[int], depth: int) -> list[int]:
        """The block's drafts after the row's latest token (`tokens[-1]`, not fed to the target yet),
        the context of every token before it known; its first `depth`."""
        if depth <= 0 or not tokens or self.lost:
            return []
        before = len(tokens) - 1
        if self.known > before:  # drafts fed last step and not kept
            self._forget(self.known - before)
        if self.known < before and not self._catch_up(tokens, before):
            return []
        if self.unseen:
            for chunk in self.draft.features(tokens[: self.unseen]):
                self.draft.model.remember(chunk, self.cache)
                mx.eval([c.state for c in self.cache])
            self.unseen = 0
        held = self.held.take(len(self.held))
        if held is not None:
            self.draft.model.remember(held, self.cache)
        logits = self.draft.block_logits(int(tokens[-1]), self.cache)[:depth]
        return [int(t) for t in cast("list[int]", mx.argmax(logits, axis=-1).tolist())]

    def may_propose(self, tokens: Sequence[int]) -> bool:
        """A DFlash draft always has a guess (unless it lost its row)."""
        return not self.lost

    def accepted(self, proposed: int, kept: int) -> None:
        """Nothing to roll back here: the block's keys are never cached, and the features of drafts not
        kept are forgotten when the next forward feeds their positions (`take_features`, `propose`)."""

    def _catch_up(self, tokens: Sequence[int], upto: int) -> bool:
        """Count the context of tokens 0..upto - 1 as unseen (computed by a forward of the target's own
        when a proposal needs it), from an empty drafter (a prompt's prefix the prefix cache gave, which
        the batch's prefill did not run); False, and the drafter stops proposing, where it is not empty
        or the tokens are not known (a gap: not expected)."""
        if self.known or upto > len(tokens):
            log.warning(
                "a DFlash drafter lost its row (features from position %d, %d known, %d tokens): it stops",
                upto,
                self.known,
                len(tokens),
            )
            self.lost = True
            return False
        self.unseen = upto
        return True

    def _forget(self, n: int) -> None:
        """Forget the context of the row's last `n` known tokens (held ones first, then unseen ones)."""
        held = min(n, len(self.held))
        self.held.keep(len(self.held) - held)
        unseen = min(n - held, self.unseen)
        self.unseen -= unseen
        if n - held - unseen > 0:
            for c in self.cache:
                c.trim(n - held - unseen)


def write_random_draft(
    out: Path,
    target_config: dict[str, Any],
    layers: int = 5,
    block_size: int = 16,
    seed: int = 0,
    dtype: mx.Dtype = mx.float32,
    target_layers: Sequence[int] | None = None,
    std: float = 0.02,
) -> Path:
    """A DFlash draft with random weights for the target whose config.json is `target_config`, written
    to `out` as the package writes one (a Qwen3 config.json with `num_target_layers` and
    `dflash_config`, its weights under the package's names): its drafts are noise, so it shows what
    the machinery costs (a benchmark's), never what DFlash gains. `layers` draft layers read
    `target_layers` (default: the package's choice, as many as the draft has layers); weights are
    normal with `std`, norms one; the mask token is the vocabulary's last id."""
    target_args = model_args.ModelArgs.from_dict(target_config)
    n_target = target_args.num_hidden_layers
    taps = list(target_layers) if target_layers is not None else default_target_layers(n_target, layers)
    if any(not 0 <= i < n_target - 1 for i in taps):
        raise ValueError(f"a target of {n_target} layers is too shallow for a {layers}-layer DFlash draft")
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": target_args.hidden_size,
        "intermediate_size": target_args.intermediate_size,
        "num_hidden_layers": layers,
        "num_attention_heads": target_args.num_attention_heads,
        "num_key_value_heads": target_args.n_kv_heads,
        "head_dim": target_args.head_dim,
        "vocab_size": target_args.vocab_size,
        "max_position_embeddings": target_args.max_position_embeddings,
        "rms_norm_eps": target_args.rms_norm_eps,
        "rope_theta": target_args.rope_theta,
        "rope_scaling": target_args.rope_scaling,
        "tie_word_embeddings": False,
        "num_target_layers": n_target,
        "dflash_config": {
            "target_layer_ids": taps,
            "mask_token_id": target_args.vocab_size - 1,
            "block_size": block_size,
        },
    }
    model = DFlashModel(DFlashConfig.from_dict(config))
    key = mx.random.key(seed)
    weights: dict[str, mx.array] = {}
    params: dict[str, mx.array] = dict(tree_flatten(model.parameters()))  # type: ignore[no-untyped-call]
    for name, value in params.items():
        key, draw = mx.random.split(key)
        if name.endswith("norm.weight"):
            weights[name] = mx.ones(value.shape, dtype)
        else:
            weights[name] = (std * mx.random.normal(value.shape, key=draw)).astype(dtype)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


register_draft(ARCHITECTURE, DFlashDraft.load)
