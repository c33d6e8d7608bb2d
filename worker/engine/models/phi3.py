"""Phi-3, Phi-3.5 and Phi-4 (`Phi3ForCausalLM`): the Llama layout, with q/k/v and gate/up stored fused.

The checkpoint's `self_attn.qkv_proj` and `mlp.gate_up_proj` (plain, or quantized in mlx-community's
folders: a quantized weight's rows are its outputs, so they split like a plain one's) are split at load
into the Llama family's projections, which the engine fuses again (`llama.Model.fuse`). Its RoPE: the
default, a partial rotary factor (Phi-4-mini), or LongRoPE (`rope.longrope`; configs that call it
"su" or "yarn", as early Phi-3 ones do, mean the same, as transformers reads them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlxq.worker.engine.errors import CheckpointError
from mlxq.worker.engine.models import llama, model_args


@dataclass
class ModelArgs(model_args.ModelArgs):
    """The Llama family's fields; Phi-3's old RoPE type names read as LongRoPE."""

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelArgs:
        config = dict(config)
        for key in ("rope_parameters", "rope_scaling"):
            rope = config.get(key)
            if isinstance(rope, dict) and (rope.get("rope_type") or rope.get("type")) in ("su", "yarn"):
                config[key] = {**{k: v for k, v in rope.items() if k != "type"}, "rope_type": "longrope"}
        args = super().from_dict(config)
        assert isinstance(args, ModelArgs)
        return args


class Model(llama.Model):
    """`llama.Model` reading Phi-3's fused projections."""

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """The Llama family's, with `qkv_proj` split into q/k/v and `gate_up_proj` into gate/up (weights,
        and quantization scales and biases, by output rows)."""
        args = self.args
        assert args.head_dim is not None
        q, kv = args.num_attention_heads * args.head_dim, args.n_kv_heads * args.head_dim
        out: dict[str, mx.array] = {}
        for key, value in super().sanitize(weights).items():
            if ".self_attn.qkv_proj." in key:
                if value.shape[0] != q + 2 * kv:
                    raise CheckpointError(
                        f"{key} has {value.shape[0]} rows where the config's heads make {q + 2 * kv}"
                    )
                parts = mx.split(value, [q, q + kv], axis=0)
                for name, part in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True):
                    out[key.replace(".qkv_proj.", f".{name}.")] = part
            elif ".mlp.gate_up_proj." in key:
                gate, up = mx.split(value, 2, axis=0)
                out[key.replace(".gate_up_proj.", ".gate_proj.")] = gate
                out[key.replace(".gate_up_proj.", ".up_proj.")] = up
            else:
                out[key] = value
        return out
