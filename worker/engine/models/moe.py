"""Mixtures of experts on the Llama family's attention: Mixtral and Qwen3-MoE.

A sparse layer's feed-forward is a router (`gate`, one logit per expert) and every expert's SwiGLU
stacked into three (experts, outputs, inputs) weights (`switch_mlp`, mlx-community's layout, where
quantized folders keep the stacked weights quantized). Hugging Face checkpoints store one Linear per
expert; `Model.sanitize` stacks them once at load. A forward computes each token's chosen experts with
gathered matmuls (`mx.gather_mm`, `mx.gather_qmm`): one launch per projection whatever the number of
experts, never a loop over them. With many (token, expert) pairs, the pairs are first sorted by expert,
so each expert's weights are read once per forward rather than once per token. On MLX's CUDA build,
whose gathered quantized matmul reads an expert once per pair whatever their order, a forward of up to
64 tokens through 4-bit experts takes mlxq's grouped experts' kernel (`expert_kernel`: each chosen
expert read once), one of up to 256 tokens (or through other quantized layouts) multiplies every token
by every expert (`SwitchGLU.every_expert_outputs`), and a larger forward multiplies the experts
dequantized.

Routing is each model's own rule, from transformers: a softmax over all experts in float32, the top-k
by probability, renormalised to sum to one where the model says so (Mixtral always; Qwen3-MoE by its
`norm_topk_prob`), then cast to the model's dtype. Computed here as the same in fewer ops (`route`):
the top-k by logit (the softmax keeps their order), and renormalised weights as the softmax of the k
logits alone; each softmax in float32. Equal logits are ordered by MLX's sort (lower index first on
the CPU). A tie inside the top-k changes nothing; one that straddles the k-th place transformers
settles by its sort's unspecified order (torch's CPU top-k does not take the lower index), so there
the two agree only where the tied experts are identical, which is what the parity tests hold them to.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxq.worker.engine import expert_kernel
from mlxq.worker.engine.device import on_cuda
from mlxq.worker.engine.errors import CheckpointError
from mlxq.worker.engine.models import llama, mlp, model_args
from mlxq.worker.engine.models.fused_linear import KeptView, kept_transpose, kept_view
from mlxq.worker.engine.models.quantized_rows import with_rows_negated

# From how many (token, expert) pairs a forward sorts them by expert before its gathered matmuls: below,
# a decode step of a few rows, sorting would cost more launches than it saves reads.
SORT_FROM = 64

# From how many (token, expert) pairs a forward on MLX's CUDA build multiplies quantized experts as
# dequantized ones (`SwitchGLU.dense_from`). There a gathered quantized matmul computes each pair on its
# own, a tile of rows for its one row, reading its expert's weights again per pair, whatever the sort
# (`GatherQMM::eval_gpu` ignores it: so below this the pairs are not sorted there either); a plain
# gathered matmul of pairs sorted by expert is one grouped GEMM that reads each expert once.
# Dequantizing a layer's experts costs a pass over them, which many pairs (a prefill, a large batch)
# repay and a decode step of a few rows does not (bench/README, "A MoE layer's experts on CUDA").
DENSE_FROM_ON_CUDA = 2048

# From how many (token, expert) pairs a forward on MLX's CUDA build, short of `DENSE_FROM_ON_CUDA`,
# multiplies every token by every expert, as many pairs as the layer has experts times tokens, and keeps
# each token's own (`SwitchGLU.every_from`), this many times the layer's experts. Each expert is then one
# slice of the gathered quantized matmul with all the tokens as its rows, read once, where the pairs'
# path reads an expert once per pair; that matmul fills a tile of at least 16 rows a slice whatever the
# rows it has (MLX's `qmm_sm80`), so from about as many pairs as experts the unused rows cost less than
# the reads they save. Up to `EVERY_EXPERT_TOKENS_ON_CUDA` tokens (a Qwen3-30B-A3B layer's experts
# timed four ways: every expert ahead of the pairs from 16 tokens to 256, ahead of the dequantized ones
# to 256 and behind them from 512; bench/README, "A MoE layer's experts on CUDA"), and at most as many
# as keep a layer's transients (every expert's gate, up and down outputs for every token) within
# `EVERY_EXPERT_BYTES_ON_CUDA`: MLX's CUDA build allocates them as the host encodes a forward, which it
# may do for every layer before the device has run the first.
EVERY_EXPERT_FROM_ON_CUDA = 1
EVERY_EXPERT_TOKENS_ON_CUDA = 256
EVERY_EXPERT_BYTES_ON_CUDA = 96 << 20

# Whether 4-bit experts on MLX's CUDA build take the grouped experts' kernel (`expert_kernel`) for
# forwards of up to its `MAX_ROWS` tokens, ahead of the paths above.
GROUPED_ON_CUDA = True

# mx.quantize's own group size and bits per mode, for a `to_quantized` called without them.
_QUANT_DEFAULTS = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}


@dataclass
class ModelArgs(model_args.ModelArgs):
    """The Llama family's fields plus the experts'; the registry sets `feed_forward_name` and, for
    Mixtral, `norm_topk_prob` (Mixtral always renormalises; transformers' Qwen3-MoE default is off)."""

    num_local_experts: int = 0  # Mixtral; transformers 5 writes Qwen3-MoE's under this name too
    num_experts: int = 0  # Qwen3-MoE as transformers 4 wrote it
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None  # an expert's width (Qwen3-MoE); else intermediate_size
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    feed_forward_name: str = "mlp"  # the checkpoint's name of a layer's feed-forward
    n_experts: int = field(init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.n_experts = self.num_experts or self.num_local_experts
        if self.n_experts < 1:
            raise CheckpointError(
                "config.json of a mixture of experts sets neither num_experts nor num_local_experts"
            )
        if not 1 <= self.num_experts_per_tok <= self.n_experts:
            raise CheckpointError(
                f"num_experts_per_tok {self.num_experts_per_tok} is not between 1 and the "
                f"{self.n_experts} experts"
            )

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        args = super().from_dict(config)
        assert isinstance(args, ModelArgs)
        return args

    def sparse(self, layer: int) -> bool:
        """Whether `layer` is a mixture of experts (Qwen3-MoE may keep some layers dense)."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


@lru_cache(maxsize=16)
def _every_expert(experts: int) -> tuple[mx.array, mx.array]:
    """uint32 (every expert in turn, zeros): the expert and the input batch of each slice of a gathered
    matmul that multiplies one batch of rows by every expert. Made once per count, as `_pair_rows`."""
    return mx.arange(experts, dtype=mx.uint32), mx.zeros((experts,), dtype=mx.uint32)


@lru_cache(maxsize=64)
def _pair_rows(shape: tuple[int, ...], per: int) -> mx.array:
    """uint32 indices of `shape` counting up by one every `per` entries (in row-major order): the row
    of a gathered matmul's input that each (token, expert) pair reads. Made from host memory once per
    shape (never an op in a forward), where `mx.gather_mm` left without them adds three a call."""
    return mx.array((np.arange(math.prod(shape), dtype=np.uint32) // per).reshape(shape))


class SwitchLinear(nn.Module):
    """Every expert's bias-free Linear stacked: `weight` (experts, outputs, inputs). Called with the
    expert of each input row, it multiplies each row by its own expert's weight in one gathered matmul."""

    _transposed: KeptView | None = None

    def __init__(self, inputs: int, outputs: int, experts: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx.nn.Module.__init__ is unannotated
        bound = inputs**-0.5
        self.weight = mx.random.uniform(-bound, bound, (experts, outputs, inputs))

    def __call__(
        self, x: mx.array, experts: mx.array, rows: mx.array | None, sorted_experts: bool = False
    ) -> mx.array:
        """Row `rows[i]` of x (..., 1, inputs) by expert `experts[i]` (rows None: x's own rows in turn):
        experts.shape + (1, outputs). The weight's transpose is a view made once (as
        `TransposedWeightLinear`'s), not an op a forward."""
        self._transposed = kept_view(self._transposed, self["weight"], lambda w: w.swapaxes(-1, -2))
        return mx.gather_mm(
            x, self._transposed.view, lhs_indices=rows, rhs_indices=experts, sorted_indices=sorted_experts
        )

    def to_quantized(
        self, group_size: int | None = None, bits: int | None = None, mode: str = "affine", **_: Any
    ) -> QuantizedSwitchLinear:
        """This layer quantized (what `nn.quantize` calls; mlx-community's stacked quantized experts)."""
        return QuantizedSwitchLinear(self.weight, group_size, bits, mode)


class QuantizedSwitchLinear(nn.Module):
    """`SwitchLinear` with its stacked weight quantized as `mx.quantize` does each expert's (per output row,
    in groups along the inputs), multiplied by `mx.gather_qmm` without dequantizing."""

    def __init__(
        self, weight: mx.array, group_size: int | None, bits: int | None, mode: str = "affine"
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx.nn.Module.__init__ is unannotated
        if group_size is None or bits is None:
            default_group, default_bits = _QUANT_DEFAULTS.get(mode, (64, 4))
            group_size, bits = group_size or default_group, bits or default_bits
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.weight, self.scales, *biases = mx.quantize(weight, group_size, bits, mode=mode)
        if biases:
            self.biases = biases[0]
        self.freeze()

    def __call__(
        self, x: mx.array, experts: mx.array, rows: mx.array | None, sorted_experts: bool = False
    ) -> mx.array:
        return mx.gather_qmm(
            x,
            self.weight,
            self.scales,
            self.get("biases"),
            lhs_indices=rows,
            rhs_indices=experts,
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
            sorted_indices=sorted_experts,
        )

    def dense(self, after: mx.array) -> SwitchLinear:
        """The same experts dequantized to the scales' dtype, built in the forward that calls it and
        given back when it is done with them. Dequantized only once `after` (the projection's input) is
        computed: nothing else orders them, and MLX could otherwise make every layer's at once."""
        plain = SwitchLinear.__new__(SwitchLinear)
        nn.Module.__init__(plain)
        weight = mx.depends(self.weight, after)
        assert isinstance(weight, mx.array)
        plain.weight = mx.dequantize(
            weight, self.scales, self.get("biases"), self.group_size, self.bits, mode=self.mode
        )
        return plain


def _side_by_side(parts: list[nn.Module]) -> nn.Module | None:
    """Stacked projections of one input as one, their outputs concatenated (gate and up: one gathered
    matmul where two would launch); None if they are not all plain, or all quantized alike."""
    if all(type(p) is SwitchLinear for p in parts):
        fused = SwitchLinear(1, 1, 1)
        fused.weight = mx.concatenate([p.weight for p in parts], axis=1)
        return fused
    if not all(type(p) is QuantizedSwitchLinear for p in parts):
        return None
    if len({(p.group_size, p.bits, p.mode, "biases" in p) for p in parts}) != 1:
        return None
    first = parts[0]
    quantized = QuantizedSwitchLinear.__new__(QuantizedSwitchLinear)
    nn.Module.__init__(quantized)
    quantized.group_size, quantized.bits, quantized.mode = first.group_size, first.bits, first.mode
    for name in ("weight", "scales", "biases"):
        if name in first:
            setattr(quantized, name, mx.concatenate([p[name] for p in parts], axis=1))
    quantized.freeze()
    return quantized


@partial(mx.compile, shapeless=True)
def _swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return nn.silu(gate) * up  # type: ignore[no-any-return]  # mlx.nn.silu is unannotated


class SwitchGLU(nn.Module):
    """The experts' SwiGLUs stacked (mlx-community's `switch_mlp`): gate, up and down projections.

    A decode step on a GPU is bound by the host's launch of each op (`fused_linear.py`), so a token's
    pass through its experts is built of as few as it takes: the gathered matmuls are given the input
    row of each (token, expert) pair (`_pair_rows`) rather than let MLX make them, gate and up are one
    matmul read apart by one split (`fuse`), and the experts' outputs are weighted and summed by one
    matmul (`weighted`)."""

    def __init__(self, hidden: int, width: int, experts: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx.nn.Module.__init__ is unannotated
        self.gate_proj = SwitchLinear(hidden, width, experts)
        self.up_proj = SwitchLinear(hidden, width, experts)
        self.down_proj = SwitchLinear(width, hidden, experts)
        self.width = width
        self.gate_up_proj: nn.Module | None = None  # set by `fuse`, in place of gate_proj and up_proj
        # From how many (token, expert) pairs quantized experts are multiplied dequantized (None:
        # never; `fuse` sets `DENSE_FROM_ON_CUDA` for quantized experts on MLX's CUDA build). Pairs are
        # sorted by expert from there too, else from `SORT_FROM` (`expert_outputs`).
        self.dense_from: int | None = None
        # From how many pairs (short of `dense_from`) up to how many tokens every token is multiplied
        # by every expert (None: never; `fuse` sets them for quantized experts on MLX's CUDA build):
        # `every_expert_outputs`.
        self.every_from: int | None = None
        self.every_tokens = 0
        self.experts = experts
        # Whether forwards of up to `expert_kernel.MAX_ROWS` tokens take the grouped experts' kernel
        # (`fuse` sets it on MLX's CUDA build for 4-bit experts the kernel computes): `grouped_outputs`.
        self.grouped = False

    def dense_tokens(self, k: int) -> int | None:
        """From how many tokens, each routed to `k` experts, a forward multiplies these experts
        dequantized (None: never)."""
        return None if self.dense_from is None else -(-self.dense_from // k)

    def fuse(self, top_k: int | None = None) -> None:
        """Gate and up in one (`_side_by_side`); on MLX's CUDA build, quantized experts' paths by size
        (`dense_from`, `every_from`), and for tokens routed to `top_k` experts each (the layer's
        router), the grouped experts' kernel where it computes these experts (`grouped`)."""
        if self.gate_up_proj is None and (fused := _side_by_side([self.gate_proj, self.up_proj])) is not None:
            mx.eval(fused.parameters())
            self.gate_up_proj = fused
            del self.gate_proj, self.up_proj
        if on_cuda() and isinstance(self.down_proj, QuantizedSwitchLinear):
            self.dense_from = DENSE_FROM_ON_CUDA
            self.every_from = EVERY_EXPERT_FROM_ON_CUDA * self.experts
            self.every_tokens = every_expert_tokens(self.down_proj, self.width)
            if GROUPED_ON_CUDA and top_k is not None and expert_kernel.available():
                self.grouped = self._kernel_fits(top_k)

    def _kernel_fits(self, k: int) -> bool:
        """Whether every projection is one the grouped experts' kernel computes, for tokens routed to
        `k` experts each, and the kernel agrees with MLX's matmul there (`expert_kernel.agrees`)."""
        gated = [self.gate_up_proj] if self.gate_up_proj is not None else [self.gate_proj, self.up_proj]
        for proj, per_row in [*((p, k) for p in gated), (self.down_proj, 1)]:
            if not isinstance(proj, QuantizedSwitchLinear) or "biases" not in proj:
                return False
            inputs, outputs = proj.scales.shape[2] * proj.group_size, proj.scales.shape[1]
            shape = (inputs, outputs, proj.group_size)
            if not expert_kernel.fits(*shape, proj.bits, proj.mode, biased=True):
                return False
            if not expert_kernel.agrees(proj.scales.dtype, *shape, per_row):
                return False
        return True

    def __call__(self, x: mx.array, experts: mx.array) -> mx.array:
        """Each row of x (N, hidden) through each of its k experts (N, k): (N, k, hidden)."""
        return self.expert_outputs(x[:, None, :], experts)

    def weighted(
        self, x: mx.array, experts: mx.array, weights: mx.array, residual: mx.array | None = None
    ) -> mx.array:
        """Each token of x (N, 1, hidden) through its k experts (N, 1, k), their outputs summed weighted
        by `weights` (N, 1, k; in x's dtype): (N, 1, hidden); plus `residual` (N, 1, hidden) where given,
        in the same matmul (`mx.addmm`: one op fewer)."""
        out = self.expert_outputs(x, experts)
        weights = weights.astype(out.dtype)  # no op where the router gave the experts' dtype
        return weights @ out if residual is None else mx.addmm(residual, weights, out)

    def expert_outputs(self, x: mx.array, experts: mx.array) -> mx.array:
        """Each token of x (N, 1, hidden) through each of its k experts (N, ..., k): (N, k, hidden).
        From `SORT_FROM` (token, expert) pairs on, or from `dense_from` where it is set (the quantized
        matmuls that sort serves ignore it), the pairs are sorted by expert first, so each expert's
        weights are read once per forward rather than once per token. Where `grouped` is set, up to
        `expert_kernel.MAX_ROWS` tokens take the grouped experts' kernel (`grouped_outputs`); else
        where `every_from` is set, a forward of as many pairs, short of `dense_from`, and at most
        `every_tokens` tokens multiplies every token by every expert (`every_expert_outputs`)."""
        n, k, pairs = x.shape[0], experts.shape[-1], experts.size
        if self.grouped and n <= expert_kernel.MAX_ROWS:
            return self.grouped_outputs(x, experts.reshape(n, k))
        every = self.every_from is not None and pairs >= self.every_from and n <= self.every_tokens
        if every and (self.dense_from is None or pairs < self.dense_from):
            return self.every_expert_outputs(x, experts.reshape(n, k))
        if pairs < (SORT_FROM if self.dense_from is None else self.dense_from):
            hidden = self._gated(x, experts, _pair_rows(experts.shape, k), False)
            out = self.down_proj(hidden, experts, _pair_rows(experts.shape, 1))
            return out.reshape(n, k, out.shape[-1])
        flat = experts.flatten()
        order = mx.argsort(flat)
        by_expert = mx.take_along_axis(flat, order, axis=0)
        # The rows themselves in the experts' order: MLX takes `sorted_experts` at its word only where a
        # gathered matmul is given no rows of its own (`lhs_indices`).
        x = mx.take(x, mx.take_along_axis(_pair_rows((pairs,), k), order, axis=0), axis=0)
        dense = self.dense_from is not None and pairs >= self.dense_from
        hidden = self._gated(x, by_expert, None, True, dense)
        down = _dense(self.down_proj, hidden) if dense else self.down_proj
        by_pair: mx.array = down(hidden, by_expert, None, True)
        return by_pair[mx.argsort(order).reshape(n, k)].reshape(n, k, by_pair.shape[-1])

    def grouped_outputs(self, x: mx.array, experts: mx.array) -> mx.array:
        """Each token of x (N, 1, hidden) through each of its k experts (N, k): (N, k, hidden), by the
        grouped experts' kernel (`expert_kernel`: each chosen expert read once, unchosen ones never)."""
        n, k = experts.shape
        pairs, tokens = experts.reshape(n * k), x.reshape(n, x.shape[-1])

        def through(proj: nn.Module, rows: mx.array, per_row: int) -> mx.array:
            assert isinstance(proj, QuantizedSwitchLinear)
            return expert_kernel.expert_matmul(
                rows, proj.weight, proj.scales, proj["biases"], pairs, proj.group_size, per_row
            )

        if self.gate_up_proj is not None:
            gate, up = mx.split(through(self.gate_up_proj, tokens, k), [self.width], axis=-1)
        else:
            gate, up = through(self.gate_proj, tokens, k), through(self.up_proj, tokens, k)
        out = through(self.down_proj, _swiglu(gate, up), 1)
        return out.reshape(n, k, out.shape[-1])

    def every_expert_outputs(self, x: mx.array, experts: mx.array) -> mx.array:
        """Each token of x (N, 1, hidden) through each of its k experts (N, k): (N, k, hidden), computed
        as every token through every expert, then each token's own taken (`every_from`). The gathered
        matmuls' slices are the experts, each with all N tokens as its rows: each expert is read once,
        at the price of the rows of experts a token did not choose."""
        n, hidden = x.shape[0], x.shape[-1]
        each, first = _every_expert(self.experts)
        gated = self._gated(x.reshape(1, n, hidden), each, first, False)  # (experts, N, width)
        out = self.down_proj(gated, each, each, False)  # (experts, N, hidden)
        return mx.take_along_axis(out.swapaxes(0, 1), experts[..., None], axis=1)

    def _gated(
        self, x: mx.array, experts: mx.array, rows: mx.array | None, sorted_experts: bool, dense: bool = False
    ) -> mx.array:
        """silu(gate) * up of x's batch `rows[i]` (rows None: x's own batches) by expert `experts[i]`:
        experts.shape + x's rows + (width,); `dense`: quantized experts multiplied dequantized."""
        if self.gate_up_proj is not None:
            gate_up = _dense(self.gate_up_proj, x) if dense else self.gate_up_proj
            gate, up = mx.split(gate_up(x, experts, rows, sorted_experts), [self.width], axis=-1)
        else:
            gate_proj = _dense(self.gate_proj, x) if dense else self.gate_proj
            up_proj = _dense(self.up_proj, x) if dense else self.up_proj
            gate, up = gate_proj(x, experts, rows, sorted_experts), up_proj(x, experts, rows, sorted_experts)
        return _swiglu(gate, up)


def every_expert_tokens(down: QuantizedSwitchLinear, width: int) -> int:
    """Up to how many tokens a layer of these experts (down: their down projection; width: an expert's)
    multiplies every token by every expert on MLX's CUDA build (`EVERY_EXPERT_TOKENS_ON_CUDA`, and
    what `EVERY_EXPERT_BYTES_ON_CUDA` holds of a token's outputs through every expert)."""
    experts, hidden = down.scales.shape[0], down.scales.shape[1]
    a_token = experts * (3 * width + hidden) * down.scales.dtype.size  # gate and up, gated, down
    return min(EVERY_EXPERT_TOKENS_ON_CUDA, EVERY_EXPERT_BYTES_ON_CUDA // a_token)


def _dense(proj: nn.Module, after: mx.array) -> nn.Module:
    """A quantized projection's experts dequantized for this forward once `after` is computed (a plain
    projection as it is)."""
    return proj.dense(after) if isinstance(proj, QuantizedSwitchLinear) else proj


def route(
    logits: mx.array, k: int, renormalize: bool, negated: mx.array | None = None
) -> tuple[mx.array, mx.array]:
    """(weights, experts), each (..., k), from router logits (..., experts): the k largest logits (the
    most probable experts; equal ones lower index first) and their softmax probabilities, computed in
    float32 and given in the logits' dtype; renormalised to sum to one where asked, which is the
    softmax of those k logits alone (the one op where a softmax over all, a sum and a division were).
    `negated`: the logits negated, where the router computed them beside the logits (`SparseMoeBlock`),
    sorted in place of a negation of the logits."""
    experts = mx.argsort(-logits if negated is None else negated, axis=-1)[..., :k]
    if renormalize:
        return mx.softmax(mx.take_along_axis(logits, experts, axis=-1), axis=-1, precise=True), experts
    return mx.take_along_axis(mx.softmax(logits, axis=-1, precise=True), experts, axis=-1), experts


class SparseMoeBlock(nn.Module):
    """A router and the stacked experts: each token's output is its top-k experts' outputs, weighted."""

    adds_residual = True  # called with `residual`, returns the output plus it (`TransformerBlock`)

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx.nn.Module.__init__ is unannotated
        width = args.moe_intermediate_size or args.intermediate_size
        self.gate: nn.Module = nn.Linear(args.hidden_size, args.n_experts, bias=False)
        self.switch_mlp = SwitchGLU(args.hidden_size, width, args.n_experts)
        self.top_k = args.num_experts_per_tok
        self.renormalize = args.norm_topk_prob
        self.signed = False  # the router computes its logits' negations beside them (`fuse`)

    def fuse(self) -> None:
        """The experts' gate and up in one (`SwitchGLU.fuse`), and a router that computes its logits
        and their negations side by side (`_signed_router`): routing sorts the negations, where it
        negated the logits, an op a layer fewer in a decode step that a GPU's host time bounds."""
        if not self.signed and (signed := _signed_router(self.gate)) is not None:
            self.gate, self.signed = signed, True
        if type(self.gate) is nn.Linear:
            self.gate = kept_transpose(self.gate)
        self.switch_mlp.fuse(self.top_k)

    @property
    def large_from(self) -> int | None:
        """From how many tokens a forward of this layer holds a large transient: its experts dequantized
        (`SwitchGLU.dense_from`; `LlamaModel.fence_tokens`)."""
        return self.switch_mlp.dense_tokens(self.top_k)

    def __call__(self, x: mx.array, residual: mx.array | None = None) -> mx.array:
        """The layer's output for x (..., hidden), or with `residual` (x's shape) that plus it, added
        by the experts' weighted sum (`SwitchGLU.weighted`: one op fewer)."""
        hidden = x.shape[-1]
        tokens = x.reshape(x.size // hidden, 1, hidden)  # what a decode step's x already is: no op
        logits = self.gate(tokens)
        if self.signed:  # logits, then their negations (`fuse`): two views
            n = logits.shape[-1] // 2
            weights, experts = route(logits[..., :n], self.top_k, self.renormalize, logits[..., n:])
        else:
            weights, experts = route(logits, self.top_k, self.renormalize)
        added = None if residual is None else residual.reshape(tokens.shape)
        return self.switch_mlp.weighted(tokens, experts, weights, added).reshape(x.shape)


def _signed_router(gate: nn.Module) -> nn.Module | None:
    """A bias-free router (plain or quantized) whose outputs are its logits, then the same negated (its
    rows stacked again below, negated): exact negations of the same products. None where the router is
    of another kind (it then routes as it is)."""
    if type(gate) is nn.Linear and "bias" not in gate:
        signed = nn.Linear(gate.weight.shape[1], 2 * gate.weight.shape[0], bias=False)
        signed.weight = mx.concatenate([gate.weight, -gate.weight])
        mx.eval(signed.weight)
        return signed
    return with_rows_negated(gate)


def _feed_forward(args: ModelArgs, layer: int) -> tuple[str, nn.Module]:
    if args.sparse(layer):
        return args.feed_forward_name, SparseMoeBlock(args)
    return args.feed_forward_name, mlp.MLP(args)


# One expert's projection as transformers and the original checkpoints name it, and its stacked name.
_EXPERT_KEY = re.compile(
    r"^(.*)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.(weight|scales|biases)$"
)
_STACKED_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class Model(llama.Model):
    """A Llama-family model whose (sparse) layers' feed-forward is a `SparseMoeBlock`."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, partial(_feed_forward, args))
        self.n_experts = args.n_experts

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """The Llama family's, with per-expert weights stacked into `switch_mlp` (once, at load): one
        Linear per expert (`experts.<i>.w1` or `.gate_proj`), or transformers 5's fused in-memory layout
        (`experts.gate_up_proj`, `experts.down_proj`). mlx-community's stacked weights pass unchanged."""
        weights = super().sanitize(weights)
        groups: dict[tuple[str, str, str], dict[int, mx.array]] = defaultdict(dict)
        out: dict[str, mx.array] = {}
        for key, value in weights.items():
            if m := _EXPERT_KEY.match(key):
                prefix, index, proj, kind = m.groups()
                groups[(prefix, _STACKED_NAMES.get(proj, proj), kind)][int(index)] = value
            elif key.endswith(".experts.gate_up_proj"):
                prefix = key[: -len(".experts.gate_up_proj")]
                gate, up = mx.split(value, 2, axis=1)
                out[f"{prefix}.switch_mlp.gate_proj.weight"] = gate
                out[f"{prefix}.switch_mlp.up_proj.weight"] = up
            elif key.endswith(".experts.down_proj"):
                out[f"{key[: -len('.experts.down_proj')]}.switch_mlp.down_proj.weight"] = value
            else:
                out[key] = value
        for (prefix, proj, kind), by_index in groups.items():
            if sorted(by_index) != list(range(self.n_experts)):
                missing = sorted(set(range(self.n_experts)) - set(by_index))
                raise CheckpointError(
                    f"{prefix}: the checkpoint has {proj}.{kind} of {len(by_index)} experts where "
                    f"config.json says {self.n_experts} (missing or out of range: "
                    f"{missing[:8] or sorted(by_index)[-1:]})"
                )
            out[f"{prefix}.switch_mlp.{proj}.{kind}"] = mx.stack([by_index[i] for i in range(self.n_experts)])
        return out
