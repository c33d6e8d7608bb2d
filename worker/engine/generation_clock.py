"""When a generation started, finished its prefill and produced its first token: the timings of its
result (`GenerateResult.timings`), one clock per request of a generation batch."""

from __future__ import annotations

import time

from mlxq.jobs.schema import Timings


class GenerationClock:
    """When a generation started, finished its prefill and produced its first token."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.prefill_end: float | None = None
        self.first_token: float | None = None

    def prefilled(self) -> None:
        self.prefill_end = time.perf_counter()

    def token(self) -> None:
        if self.first_token is None:
            self.first_token = time.perf_counter()

    def timings(self, prefill_tokens: int, generated: int) -> Timings:
        end = time.perf_counter()
        prefill_end = self.prefill_end if self.prefill_end is not None else end
        first = self.first_token if self.first_token is not None else end
        decode_s = end - first
        return Timings(
            ttft_s=None if self.first_token is None else self.first_token - self.start,
            prefill_s=prefill_end - self.start,
            decode_s=decode_s,
            total_s=end - self.start,
            prefill_tokens_per_s=prefill_tokens / max(prefill_end - self.start, 1e-9),
            decode_tokens_per_s=(generated - 1) / decode_s if generated > 1 and decode_s > 0 else None,
        )
