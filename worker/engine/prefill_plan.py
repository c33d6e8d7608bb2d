"""Which waiting requests of a generation batch start prefilling at a step, and which of them together.

A request starts once the decode batch's buffers have room for it under the KV budget (`fits`: every
row at its longest, padding rows included). Short prompts are prefilled together in one forward of
about a chunk of tokens (`next_group`); a long prompt, or one whose cached prefix is longer than a
chunk, is prefilled alone, chunk by chunk; a prompt sharing a long uncached prefix with one in the
group waits for the next forward, which finds that prefix in the prefix cache. The plan only decides:
`GenerationBatch` launches the forwards and joins the prefilled rows to its decode batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

import mlx.core as mx

from mlxq.worker.engine.cache.batch_cache import BatchKVCache
from mlxq.worker.engine.cache.kv_cache import key_columns
from mlxq.worker.engine.cache.token_match import common_length
from mlxq.worker.engine.engine import Engine
from mlxq.worker.engine.shapes import padded_size, padded_width

# Prompts sharing at least this many uncached tokens are not prefilled in one forward (see `next_group`);
# prompts prefilled together reuse a cached prefix only from this many tokens on: splicing a prefix into
# a rows forward (left-padded cached parts, a mask instead of plain causal attention) costs more than
# computing a short one (`bench/README.md`, what the engine's defaults rest on).
SHARED_MIN = 32


class Prompted(Protocol):
    """A request as the plan reads it: its prompt, and the tokens its cache may reach."""

    @property
    def prompt(self) -> list[int]: ...

    @property
    def longest(self) -> int: ...


P = TypeVar("P", bound=Prompted)


def batch_kv_by_default() -> int:
    """A generation batch's buffers may hold a quarter of MLX's memory limit in keys and values. The bound
    scales with the machine, not with a fixed size: a model's KV per token spans ~30x across the
    families served (Gemma 3 4B's 34 layers of 256-wide heads hold 4x a Llama-3.2-1B's per token), so a
    fixed budget that admits 64 rows of one model would admit a quarter of them of another on the same
    GPU, and newcomers would wait for seats while memory sits free."""
    return int(mx.get_memory_limit()) // 4


class PrefillPlan:
    """The starts of one generation batch's requests: the KV budget's room and the prefill groups.
    `kv_budget_bytes`: 0 for no limit."""

    def __init__(self, engine: Engine, kv_budget_bytes: int = 0) -> None:
        self.engine = engine
        self.kv_budget_bytes = kv_budget_bytes  # 0: no limit

    def fits(self, seq: Prompted, active: Sequence[Prompted]) -> bool:
        """Whether `seq` may start beside `active` (the requests decoding or prefilling, and those
        starting with it): the decode batch's buffers at the rows' longest stay within the budget
        (padding rows, less than a step of shared left padding and the spare room to a whole step
        included: see `batch_cache.py`; a sliding-window layer's buffers hold at most its window and
        slack, however long the rows)."""
        if not active or self.kv_budget_bytes <= 0:
            return True
        rows = [*active, seq]
        n = padded_size(len(rows), smallest=1) if self.engine.pad_shapes else len(rows)  # padding rows too
        columns = key_columns(max(s.longest for s in rows) + BatchKVCache.step)
        need = n * self.engine.kv_bytes(columns)  # sliding-window layers: their window's columns
        return need <= self.kv_budget_bytes

    def cached(self, seq: Prompted) -> int:
        """Prompt tokens of `seq` the prefix cache would give it now."""
        if self.engine.prefix_cache is None:
            return 0
        return self.engine.prefix_cache.peek(seq.prompt, SHARED_MIN)

    def next_group(
        self, waiting: list[P], active: Sequence[Prompted], joining: Sequence[Prompted], limit: int
    ) -> tuple[list[P], int, P | None]:
        """Waiting prompts to prefill together in one forward of at most `limit` tokens (taken off
        `waiting`), beside `active` (decoding or prefilling) and `joining` (prefilled this step, not
        decoding yet); the tokens that forward computes; and, when the group would be the step's first
        and the next prompt prefills alone, that prompt instead (taken off `waiting`)."""
        chunk = self.engine.options.prefill_chunk
        group: list[P] = []
        group_cached: list[int] = []
        width = 0
        while waiting and self.fits(waiting[0], [*active, *joining, *group]):
            seq = waiting[0]
            cached = self.cached(seq)
            new = len(seq.prompt) - cached
            # A long prompt goes alone, one chunk per step; so does one with a long cached prefix: its
            # prefill then writes into the cache the prefix cache gave it, where a rows forward would
            # copy that prefix three times (stacked, extended, split back) to add a few tokens.
            if new > chunk or cached > chunk:
                if not group and not joining:
                    return [], 0, waiting.pop(0)
                break
            if group and self.prefill_cost(len(group) + 1, max(width, new)) > limit:
                break
            # A prompt sharing a long uncached prefix with a batch-mate waits for the next forward: it
            # then finds that prefix in the prefix cache instead of computing it again.
            if any(
                common_length(seq.prompt, m.prompt) >= max(cached, c) + SHARED_MIN
                for m, c in zip(group, group_cached, strict=True)
            ):
                break
            group.append(waiting.pop(0))
            group_cached.append(cached)
            width = max(width, new)
        return group, self.prefill_cost(len(group), width), None

    def prefill_cost(self, rows: int, width: int) -> int:
        """Tokens a forward of `rows` prompts of `width` new tokens computes (with shape padding)."""
        if self.engine.pad_shapes:
            return padded_size(rows, smallest=1) * padded_width(width)
        return rows * width
