"""Score jobs run on the model: the prepared rows of several jobs scored together, a result per job.

Every row, candidate and token-by-token alike, goes into one prefix tree (`PrefixScorer`, a head per
kind), so a prefix shared across jobs and kinds is computed once; the heads' answers are gathered back
into each job's `ScoreResult`. Out of memory the rows are scored once more with smaller suffix batches.
The `JobScorer` the engine composes owns those batches' KV budget (`score_kv_bytes`) and the seconds
scoring spent in each part (`score_seconds`); the rows come prepared (`score_requests.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from mlxq.jobs.schema import ScoredRow, ScoreResult
from mlxq.worker.engine.cache.prefix_cache import PrefixCache
from mlxq.worker.engine.candidate_head import CandidateHead, candidate_scores
from mlxq.worker.engine.engine_options import EngineOptions
from mlxq.worker.engine.memory_guard import with_memory_retry
from mlxq.worker.engine.models.base import Model
from mlxq.worker.engine.prefix_scorer import SCORE_ENGINE_PHASES, Ahead, PrefixScorer, score_kv_by_default
from mlxq.worker.engine.score_requests import PreparedRow, SeqRow, prompt_logprobs, seq_result
from mlxq.worker.engine.text.tokenizer import Tokenizer
from mlxq.worker.engine.token_scoring import TokenHead


class JobScorer:
    """The score jobs of one engine: its `model`, `tokenizer` and `name` (the results'), its `options`
    (prefill chunk, the suffix batches' KV budget, synced phases), its `pad_shapes` and
    `kv_bytes_per_token`, and `free_memory`, what it calls before scoring once more out of memory."""

    def __init__(
        self,
        model: Model,
        tokenizer: Tokenizer,
        name: str,
        options: EngineOptions,
        pad_shapes: bool,
        kv_bytes_per_token: int,
        free_memory: Callable[[], None],
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.options = options
        self.pad_shapes = pad_shapes
        self.kv_bytes_per_token = kv_bytes_per_token
        self.free_memory = free_memory
        # Bytes a score batch's suffix rows may hold in copies of their shared prefix (`PrefixScorer`).
        self.score_kv_bytes = (
            score_kv_by_default() if options.score_kv_bytes is None else options.score_kv_bytes
        )
        # Seconds scoring spent in each part (`SCORE_ENGINE_PHASES`) since the engine was made: the
        # worker reads them around each score batch.
        self.score_seconds = dict.fromkeys(SCORE_ENGINE_PHASES, 0.0)
        self._ahead: Ahead | None = None  # what `start` queued for the batch scored next

    def start(self, tokens: list[int], prefix_cache: PrefixCache | None, min_new: int = 1) -> int:
        """Queue the keys and values of `tokens` (a batch's shared prefix) into the prefix cache and return
        without waiting for the device (`PrefixScorer.warm`; not where fewer than `min_new` of them are
        not cached yet): the next `score_many`, whichever batch it scores, finds them there, and its
        rows count them as computed, not cached. How many tokens it queued."""
        self._ahead = self._scorer(prefix_cache, self.score_kv_bytes, None).warm(tokens, min_new)
        return 0 if self._ahead is None else len(tokens) - self._ahead.start

    def score_many(
        self,
        jobs: list[list[PreparedRow]],
        prefix_cache: PrefixCache | None,
        interrupt: Callable[[], None] | None = None,
    ) -> list[ScoreResult]:
        """Score the prepared rows (`Engine.score_tokens`) of several jobs together; one result per job.

        All rows, candidate and token-by-token alike, go into one prefix tree (`PrefixScorer`, one head
        per kind), so a prefix shared across jobs and across kinds is computed once. A
        row's `cached_tokens` counts input tokens it did not compute itself (shared, or from the cache).
        Out of memory: caches are emptied and the rows scored once more, their suffix batches holding a
        quarter of the keys and values (`score_kv_bytes`). `interrupt` is called before every forward
        (`PrefixScorer.score`): what it raises ends the scoring (a job's timeout).
        """
        rows = sum(len(j) for j in jobs)
        kv_bytes = [self.score_kv_bytes]
        ahead, self._ahead = self._ahead, None

        def free_and_shrink() -> None:  # the retry's suffix batches: a quarter of the keys and values
            self.free_memory()
            kv_bytes[0] = max(1, (kv_bytes[0] or score_kv_by_default()) // 4)

        return with_memory_retry(
            lambda: self._score_many(jobs, prefix_cache, kv_bytes[0], interrupt, ahead),
            free_and_shrink,
            f"scoring {rows} rows",
        )

    def _score_many(
        self,
        jobs: list[list[PreparedRow]],
        prefix_cache: PrefixCache | None,
        kv_bytes: int,
        interrupt: Callable[[], None] | None,
        ahead: Ahead | None = None,
    ) -> list[ScoreResult]:
        """One pass of `score_many`, its suffix batches holding at most `kv_bytes` of keys and values;
        `ahead`: what `start` queued for it."""
        flat = [row for rows in jobs for row in rows]
        scored: list[ScoredRow | None] = [None] * len(flat)
        cands = [(i, row) for i, row in enumerate(flat) if isinstance(row, tuple)]
        seq_rows = [(i, row) for i, row in enumerate(flat) if isinstance(row, SeqRow)]
        candidates = CandidateHead([prompt for _, (prompt, _) in cands])
        tokens = TokenHead([s for _, row in seq_rows for s in row.seqs])
        scorer = self._scorer(prefix_cache, kv_bytes, interrupt, ahead)
        per_candidate_row, per_seq = scorer.score([candidates, tokens])
        if cands:
            t0 = time.perf_counter()
            scores = candidate_scores(candidates.table(), [c for _, (_, c) in cands])  # every row is filled
            self.score_seconds["unembed"] += time.perf_counter() - t0
            for (i, (prompt, _)), (raw, logprobs), computed in zip(
                cands, scores, per_candidate_row, strict=True
            ):
                scored[i] = ScoredRow(
                    logits=raw,
                    logprobs=logprobs,
                    input_tokens=len(prompt),
                    cached_tokens=len(prompt) - computed,
                )
        at = 0
        for i, row in seq_rows:
            n = len(row.seqs)
            row_scores, row_computed = tokens.scores[at : at + n], per_seq[at : at + n]
            if row.prompt is not None:
                scored[i] = prompt_logprobs(row.prompt, row_scores, row_computed, self.tokenizer)
            else:
                scored[i] = seq_result(row, row_scores, row_computed)
            at += n
        return self._results(jobs, scored)

    def _scorer(
        self,
        prefix_cache: PrefixCache | None,
        kv_bytes: int,
        interrupt: Callable[[], None] | None,
        ahead: Ahead | None = None,
    ) -> PrefixScorer:
        return PrefixScorer(
            self.model,
            prefix_cache=prefix_cache,
            prefill_chunk=self.options.prefill_chunk,
            max_batch_rows=64,
            max_batch_kv_bytes=kv_bytes,
            kv_bytes_per_token=self.kv_bytes_per_token,
            pad_shapes=self.pad_shapes,
            interrupt=interrupt,
            seconds=self.score_seconds,
            sync_phases=self.options.sync_score_phases,
            ahead=ahead,
        )

    def _results(self, jobs: list[list[PreparedRow]], scored: list[ScoredRow | None]) -> list[ScoreResult]:
        """Each job's result from its rows' (`scored`: every job's rows, one job after another)."""
        out, start = [], 0
        for job in jobs:
            mine = [r for r in scored[start : start + len(job)] if r is not None]
            start += len(job)
            out.append(
                ScoreResult(
                    rows=mine,
                    input_tokens=sum(r.input_tokens for r in mine),
                    cached_tokens=sum(r.cached_tokens for r in mine),
                    model=self.name,
                )
            )
        return out
