"""Multi-token prediction (MTP): the layer some checkpoints carry past their last one, which drafts the
token after next from the target's own final hidden state (DeepSeek-V3's `num_nextn_predict_layers`;
reference: transformers' `MtpModel`, used by `generate(use_mtp=True)`).

What it computes: for each position j of the row it pairs the target's final (normed) hidden state of
position j - 1 with the embedding of token j (each through an RMS norm, side by side, then `eh_proj`),
runs a decoder layer of the target's own kind over them (DeepSeek-V3: latent attention and experts)
with a cache of its own, then a norm (`shared_head.norm`) and the target's LM head: its argmax at the
row's latest position j (the pending token, not fed to the target yet, whose predecessor's hidden state
is known) is the draft for position j + 1. One MTP layer drafts one token a step.

Where it lives: in the target's own checkpoint, as layer `num_hidden_layers` (`model.layers.N.enorm`,
`.hnorm`, `.eh_proj`, `.shared_head.norm`, and the decoder layer's own weights there; `shared_head.head`
and `embed_tokens` repeat the target's and are not read). Chosen by the worker's setting
(`speculation` "mtp"), not by a draft folder.

How it follows a row: the decode batch hands every forward's final hidden states to the row's drafter
with their position (`DecodeBatch.taps` with `layer_taps.FINAL`); they are held until a proposal
needs them (`held_features.py`: a row the draft gate keeps from drafting pays no MTP forward), then
entered into the MTP cache as far as their tokens are known, and features from a position on replace
what the drafter held from there (a verify step's rejected columns). The prompt's come from the
batch's prefill, tapped for a row with such a drafter (`batch_prefill.py`); only a prompt's prefix the
prefix cache gave (never run here) takes a forward of the target's own over it, the first time it
proposes (as for DFlash). Entries sit at RoPE positions 1, 2, ... (the first token has no predecessor).

How a batch's rows draft: together (`mtp_batch.py`). One batch cache of the MTP layer holds every
drafting row's entries (`MtpBatch`, the generation batch's one per draft: `MtpDraft` is the source of
its rows' drafters, `MtpDrafter`), so a step's proposals for all rows cost one forward of the layer over
a right-padded block of each row's newly known positions and one read of every row's argmax. Where
the engine pads shapes (a GPU) that forward reads whole steps of the batch cache (`MtpBatch`).

Not implemented (refused): more than one MTP layer, architectures other than DeepSeek-V3's, quantized
MTP weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import mlx.core as mx
import mlx.nn as nn

from mlxq.worker.engine.errors import CheckpointError
from mlxq.worker.engine.models import deepseek, llama, model_args, moe
from mlxq.worker.engine.models.base import Model
from mlxq.worker.engine.models.layer_taps import FINAL
from mlxq.worker.engine.models.loader import load_config, load_module
from mlxq.worker.engine.models.masks import Mask
from mlxq.worker.engine.speculation.mtp_batch import MtpBatch, MtpDrafter, ShiftedCache


class SharedHead(nn.Module):
    """The checkpoint's `shared_head`: its norm (its head is the target's LM head)."""

    def __init__(self, args: model_args.ModelArgs) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx.nn.Module.__init__ is unannotated
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class MtpLayer(nn.Module):
    """`enorm`, `hnorm`, `eh_proj`, the decoder layer (`block`) and `shared_head.norm`."""

    def __init__(self, args: deepseek.ModelArgs) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx.nn.Module.__init__ is unannotated
        h = args.hidden_size
        self.enorm = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.hnorm = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = llama.TransformerBlock(
            args, ("mlp", deepseek.DeepseekMoE(args)), deepseek.LatentAttention(args)
        )
        self.shared_head = SharedHead(args)

    def __call__(
        self, embeds: mx.array, hidden: mx.array, cache: ShiftedCache, mask: Mask = None
    ) -> mx.array:
        """Normed outputs (B, L, hidden) for token embeddings and their predecessors' hidden states;
        `mask` a batch cache's (None: causal over the cache and these L)."""
        x = self.eh_proj(mx.concatenate([self.enorm(embeds), self.hnorm(hidden)], axis=-1))
        if mask is None and x.shape[1] > 1:
            mask = "causal"
        x = self.block(x, mask, cache)
        return self.shared_head.norm(x)  # type: ignore[no-any-return]


@dataclass(eq=False)
class MtpDraft:
    """A target's MTP layer, loaded from its checkpoint: what the rows' drafters share, and the
    `DraftBatchSource` of their rows (a generation batch keeps one `MtpBatch` per draft: compared by
    identity)."""

    layer: MtpLayer
    target: Model
    folder: Path
    prefill_chunk: int = 2048
    pad_shapes: bool = False  # the engine's: its batches' forwards read whole steps (`MtpBatch`)

    taps: tuple[int, ...] = (FINAL,)  # the target's final hidden states
    max_depth: int | None = 1  # one MTP layer: one draft a step

    def drafter(self) -> MtpDrafter:
        return MtpDrafter(self)

    def draft_batch(self) -> MtpBatch:
        """A new, empty batch of this layer's rows."""
        return MtpBatch(self, self.pad_shapes)

    def outputs(
        self, tokens: Sequence[int] | mx.array, hidden: mx.array, cache: ShiftedCache, mask: Mask = None
    ) -> mx.array:
        """Add entries for `tokens` (ids of positions j.., or (B, L) ids of a batch's rows) with `hidden`
        (B, L, hidden: positions j - 1..) to `cache`; their normed outputs (B, L, hidden). `mask`: a
        batch cache's for L new entries (None: causal)."""
        embed = cast("nn.Embedding", self.target.model.embed_tokens)  # type: ignore[attr-defined]
        ids = tokens if isinstance(tokens, mx.array) else mx.array([list(tokens)], dtype=mx.int32)
        return self.layer(embed(ids), hidden, cache, mask)

    def features(self, tokens: Sequence[int]) -> mx.array:
        """The target's final hidden states (1, L, hidden) of `tokens` from position 0 (a forward of the
        target's own, in chunks, its cache thrown away): a prompt's prefix the prefix cache gave."""
        cache = self.target.make_cache()
        chunks = []
        for start in range(0, len(tokens), self.prefill_chunk):
            ids = mx.array([list(tokens[start : start + self.prefill_chunk])], dtype=mx.int32)
            chunks.append(self.target.hidden(ids, cache=cache))
            mx.eval(chunks[-1])
        return chunks[0] if len(chunks) == 1 else mx.concatenate(chunks, axis=1)

    @classmethod
    def load(
        cls, folder: Path, target: Model, prefill_chunk: int = 2048, pad_shapes: bool = False
    ) -> MtpDraft:
        """The MTP layer in the target checkpoint `folder`; `CheckpointError` naming what is missing or
        not implemented."""
        config = load_config(folder)
        layers = int(config.get("num_nextn_predict_layers") or config.get("num_mtp_layers") or 0)
        if layers == 0:
            raise CheckpointError(f"the model in {folder} has no MTP layer (num_nextn_predict_layers)")
        if layers > 1:
            raise CheckpointError(f"the model in {folder} has {layers} MTP layers; mlxq drafts with one")
        if not isinstance(target, deepseek.Model):
            raise CheckpointError(
                f"MTP drafting is implemented for DeepSeek-V3's layers; {folder} holds "
                f"{config.get('architectures')}"
            )
        args = cast("deepseek.ModelArgs", target.args)
        n = len(target.layers)
        prefix = f"model.layers.{n}."
        weights: dict[str, mx.array] = {}
        for f in sorted(folder.glob("*.safetensors")):
            loaded = cast("dict[str, mx.array]", mx.load(str(f)))
            weights.update({k: v for k, v in loaded.items() if k.startswith(prefix)})
        if any(k.endswith(".scales") for k in weights):
            raise CheckpointError(
                f"the MTP layer in {folder} is quantized; mlxq reads float MTP weights only"
            )
        weights = moe.Model.sanitize(target, weights)  # experts stacked as the target's are
        own = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
        renamed: dict[str, mx.array] = {}
        dtype = target.model.norm.weight.dtype
        for key, value in weights.items():
            rest = key[len(prefix) :]
            if rest.startswith(("shared_head.head.", "embed_tokens.")):
                continue  # the target's own head and embedding
            name = rest if rest.startswith(own) else f"block.{rest}"
            renamed[name] = value.astype(dtype) if mx.issubdtype(value.dtype, mx.floating) else value
        layer = MtpLayer(args)
        load_module(layer, renamed, f"the MTP layer in {folder} ({prefix}*)")
        return cls(layer, target, folder, prefill_chunk, pad_shapes)
