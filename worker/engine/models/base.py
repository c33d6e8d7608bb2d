"""What the engine needs of a model architecture, and what an architecture may expect of a layer's cache.

Every architecture (and, later, a draft model) fills `Model`; `register` in `models/__init__.py` takes
only classes whose instances do, so mypy checks each architecture where it is registered. The members
are what the engine, generation, scoring and the loader use today, nothing more. An architecture is
also an `nn.Module` (the loader quantizes and loads it as one); Python's types cannot say both at once,
so the loader narrows with `isinstance` where it needs the module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn

from mlxq.worker.engine.cache.kv_cache import KVCache
from mlxq.worker.engine.models.layer_taps import LayerSink
from mlxq.worker.engine.ragged_attention import RaggedRows


class LayerCache(Protocol):
    """One attention layer's keys and values as a forward writes and reads them: a sequence's `KVCache`,
    a decode batch's `BatchKVCache` or a rows prefill's `PrefillRowsCache`."""

    @property
    def offset(self) -> int | mx.array:
        """RoPE position of the next token: one for every row, or one per row."""
        ...

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append (B, n_kv_heads, L, head_dim) keys/values; return the columns attention reads."""
        ...


class ModelConfig(Protocol):
    """The fields of a model's `args` the engine reads."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_position_embeddings(self) -> int: ...

    @property
    def n_kv_heads(self) -> int: ...

    @property
    def cache_features(self) -> int:
        """Features one token adds to one layer's cache, keys and values together (what the engine
        budgets cache memory by: an architecture caching something other than full keys and values,
        as MLA's latent, says so here)."""
        ...

    @property
    def head_dim(self) -> int | None:
        """None only before the architecture derives it (`hidden_size // num_attention_heads`)."""
        ...


class Weighted(Protocol):
    """A layer with a `weight`; the final norm's gives the engine the compute dtype."""

    @property
    def weight(self) -> mx.array: ...


class Backbone(Protocol):
    """The decoder stack under the LM head (the checkpoint's `model.` prefix)."""

    @property
    def norm(self) -> Weighted: ...

    @property
    def windows(self) -> list[int | None]:
        """Each layer's sliding window, None for global attention (`window.py`)."""
        ...


class Model(Protocol):
    """A causal LM as the engine drives it: logits, or hidden states and logits apart, over caches."""

    bucket_keys: bool  # set by the engine: bucketed key columns over a cached prefix (see `llama.py`)

    @property
    def args(self) -> ModelConfig: ...

    @property
    def model(self) -> Backbone: ...

    @property
    def layers(self) -> Sequence[nn.Module]:
        """The decoder layers: one cache per layer."""
        ...

    def __call__(
        self,
        inputs: mx.array,
        cache: Sequence[LayerCache],
        mask: mx.array | RaggedRows | None = None,
        taps: LayerSink | None = None,
    ) -> mx.array:
        """Logits (B, L, vocab) for int32 token ids (B, L), writing their keys/values into `cache`;
        `taps` is handed each decoder layer's output as it is built (`layer_taps.py`)."""
        ...

    def hidden(
        self,
        inputs: mx.array,
        cache: Sequence[LayerCache],
        mask: mx.array | None = None,
        last: int | None = None,
        taps: LayerSink | None = None,
    ) -> mx.array:
        """Final normed hidden states (B, L, hidden), or with `last` that position's only (B, 1, hidden)."""
        ...

    def logits(self, hidden: mx.array) -> mx.array:
        """Vocabulary logits (..., vocab) of hidden states (..., hidden)."""
        ...

    @property
    def flat_steps(self) -> bool:
        """Whether a forward of one position a row takes its ids as (B,) and gives (B, vocab) logits
        (no position axis: fewer ops a decode step)."""
        ...

    @property
    def reads_shared_prefix(self) -> bool:
        """Whether score rows may read their shared prefix's keys and values in place
        (`cache.shared_prefix`) rather than from a copy each (`kv_cache.broadcast_batch`)."""
        ...

    def make_cache(self) -> list[KVCache]:
        """One empty batch-1 cache per layer."""
        ...

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """A checkpoint's weights with what the model computes itself dropped."""
        ...

    def fuse(self) -> None:
        """Fuse projections once the weights are in (same outputs up to the order of sums)."""
        ...
