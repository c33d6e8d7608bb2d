"""The Llama family's config: `ModelArgs` (the config.json fields it reads), each layer's sliding window
(`layer_windows`) and RoPE's settings from either layout transformers writes (`rope_settings`).

The other architectures' configs extend this one (`gemma3.py`, `phi3.py`, `moe.py`, `deepseek.py`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from mlxq.worker.engine.errors import CheckpointError, UnsupportedArchitecture


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
