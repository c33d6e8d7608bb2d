"""Model architectures, registered by the name in config.json `architectures[0]`.

`build_model(config)` picks the class and its switches from the registry and returns an uninitialised
model (random weights); `loader.load_model` fills it from a checkpoint. A new architecture is a
module with `ModelArgs` (with `from_dict`) and `Model`, plus one `register(...)` line below; the Llama
family's `ModelArgs` is in `model_args.py`, which the others extend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlxq.worker.engine.errors import UnsupportedArchitecture
from mlxq.worker.engine.models import deepseek, gemma3, llama, model_args, moe, phi3
from mlxq.worker.engine.models.base import Model


@dataclass(frozen=True)
class Architecture:
    """How to build one architecture: its module's `ModelArgs` and `Model`, and fixed config switches."""

    args: Any
    model: Callable[[Any], Model]
    switches: dict[str, Any] = field(default_factory=dict)


_REGISTRY: dict[str, Architecture] = {}


def register(name: str, args: Any, model: Callable[[Any], Model], **switches: Any) -> None:
    """Make `name` (a config.json `architectures[0]` value) buildable; `switches` override config keys."""
    _REGISTRY[name] = Architecture(args, model, dict(switches))


def supported_architectures() -> list[str]:
    """Every registered architecture name, sorted."""
    return sorted(_REGISTRY)


def architecture_name(config: dict[str, Any]) -> str:
    """config.json's `architectures[0]` (raises `UnsupportedArchitecture` if absent)."""
    names = config.get("architectures") or []
    if not names:
        raise UnsupportedArchitecture("<none: config.json has no 'architectures'>", supported_architectures())
    return str(names[0])


def build_model(config: dict[str, Any]) -> Model:
    """A randomly initialised model for this config; `UnsupportedArchitecture` if it is not registered."""
    name = architecture_name(config)
    arch = _REGISTRY.get(name)
    if arch is None:
        raise UnsupportedArchitecture(name, supported_architectures())
    return arch.model(arch.args.from_dict({**config, **arch.switches}))


register("LlamaForCausalLM", model_args.ModelArgs, llama.Model)
# Mistral is Llama's layout; its sliding window (when set) narrows every layer's attention (window.py).
register("MistralForCausalLM", model_args.ModelArgs, llama.Model)
register("Qwen2ForCausalLM", model_args.ModelArgs, llama.Model, qkv_bias=True)
register("Qwen3ForCausalLM", model_args.ModelArgs, llama.Model, qk_norm=True)
# Mixtral always renormalises its top-k weights, and its experts are intermediate_size wide.
register(
    "MixtralForCausalLM",
    moe.ModelArgs,
    moe.Model,
    norm_topk_prob=True,
    moe_intermediate_size=None,
    feed_forward_name="block_sparse_moe",
)
register("Qwen3MoeForCausalLM", moe.ModelArgs, moe.Model, qk_norm=True)
register("Phi3ForCausalLM", phi3.ModelArgs, phi3.Model)
register("DeepseekV3ForCausalLM", deepseek.ModelArgs, deepseek.Model)
register("Gemma3ForCausalLM", gemma3.ModelArgs, gemma3.Model)
# Gemma 3 4B and up ship multimodal: their language model alone, images not read (gemma3.py)
register("Gemma3ForConditionalGeneration", gemma3.MultimodalArgs, gemma3.MultimodalModel)

__all__ = ["Architecture", "build_model", "register", "supported_architectures"]
