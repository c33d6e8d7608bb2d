"""A request in a generation batch (`GenerationBatch`): its record from admission to its end, and what
it leaves the batch with. The batch and its parts (`BatchPrefill`, `BatchDrafts`) read and note on it;
only the batch creates one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mlxq.jobs.schema import GenerateResult
from mlxq.worker.engine.cache.kv_cache import KVCache
from mlxq.worker.engine.generation_clock import GenerationClock
from mlxq.worker.engine.prefill import ChunkedPrefill
from mlxq.worker.engine.sampler import Sampler
from mlxq.worker.engine.speculation.drafter import FeatureReader
from mlxq.worker.engine.speculation.policy import RowSpeculation
from mlxq.worker.engine.text_run import TextRun


@dataclass
class Finished:
    """A request that left the batch: its result, or the exception that ended it."""

    key: str
    result: GenerateResult | None = None
    error: BaseException | None = None


@dataclass(eq=False)
class _Sequence:
    key: str
    prompt: list[int]
    max_tokens: int
    sampler: Sampler
    run: TextRun
    cancelled: Callable[[], bool]
    clock: GenerationClock = field(default_factory=GenerationClock)
    cache: list[KVCache] | None = None
    n_cached: int = 0
    prefill: ChunkedPrefill | None = None
    speculation: RowSpeculation | None = None  # its drafter, where it decodes speculatively
    depth: int = 0  # tokens it may draft at this step
    proposed: int = 0  # tokens its drafter proposed at this step
    reader: FeatureReader | None = None  # its drafter, where it reads the target's hidden states
    ahead: int = 0  # tokens it is ahead of the batch's slowest row (the draft gate's progress)

    @property
    def budget(self) -> int:
        """Tokens it may still generate after its pending one."""
        return self.max_tokens - len(self.run.ids) - 1

    @property
    def longest(self) -> int:
        """Tokens its cache may reach: prompt plus every token it may generate."""
        return len(self.prompt) + self.max_tokens
