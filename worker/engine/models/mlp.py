"""The Llama family's dense feed-forward (`MLP`): SwiGLU, its gate and up projections fused into one
matmul once the weights are in (`fused_linear.py`); Gemma 3's GELU MLP extends it (`gemma3.py`).
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn

from mlxq.worker.engine.models.fused_linear import fuse_linears, fused_outputs, kept_transpose, plus
from mlxq.worker.engine.models.model_args import ModelArgs


@partial(mx.compile, shapeless=True)
def _swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """silu(gate) * up as one compiled op: one kernel launch where two ops would make two."""
    return nn.silu(gate) * up  # type: ignore[no-any-return]  # mlx.nn.silu is unannotated


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    adds_residual = True  # called with `residual`, returns the output plus it (`TransformerBlock`)

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx.nn.Module.__init__ is unannotated
        h, inter, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = nn.Linear(h, inter, bias=bias)
        self.up_proj = nn.Linear(h, inter, bias=bias)
        self.down_proj = nn.Linear(inter, h, bias=bias)
        self.intermediate_size = inter
        self.gate_up_proj: nn.Module | None = None  # set by `fuse`, in place of gate_proj and up_proj

    def fuse(self) -> None:
        """Compute gate and up with one matmul (`fuse_linears`), if their projections are plain; the
        down projection keeps its weight's transpose (`kept_transpose`)."""
        if self.gate_up_proj is None:
            self.gate_up_proj = fuse_linears(self, ["gate_proj", "up_proj"])
        self.down_proj = kept_transpose(self.down_proj)

    def __call__(self, x: mx.array, residual: mx.array | None = None) -> mx.array:
        """The feed-forward of `x`, or with `residual` that plus it (`fused_linear.plus`: one op fewer)."""
        if self.gate_up_proj is not None:
            inter = self.intermediate_size
            gated = self.gated(*fused_outputs(self.gate_up_proj, x, (inter, 2 * inter)))
        else:
            gated = self.gated(self.gate_proj(x), self.up_proj(x))
        if residual is not None:
            return plus(residual, self.down_proj, gated)
        return self.down_proj(gated)

    def gated(self, gate: mx.array, up: mx.array) -> mx.array:
        """The activation of gate times up: SwiGLU's (Gemma's MLP overrides it)."""
        return _swiglu(gate, up)
