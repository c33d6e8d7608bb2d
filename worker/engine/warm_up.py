"""Warming a worker's engine up before its first job: the shapes its jobs meet first, run once on dummies.

The first forward of a new input shape builds its kernels (on a GPU many times the forward itself), so
without this a worker's first jobs pay for every shape they meet. `warm_up` runs, on made-up prompts:
one prefill chunk of `prefill_chunk` tokens, a decode step of each batch size a generation batch pads
to (up to `max_sequences`), and a score batch of rows sharing a prefix, scored twice (the second time
its prefix comes from a prefix cache, as a warm job's does).

It leaves nothing behind that changes a result: the engine's prefix cache is set aside while it runs (a
private cache of the same budget stands in, then is dropped), sampling is greedy, and nothing here
knows of Redis. MLX's buffer cache keeps the memory it grew to, as after any job.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from mlxq.jobs.schema import GenerateRequest
from mlxq.worker.engine.cache.prefix_cache import PrefixCache
from mlxq.worker.engine.engine import Engine, PreparedRow
from mlxq.worker.engine.generation_batch import GenerationBatch

log = logging.getLogger(__name__)

_WORD = "warm "  # made-up prompts are repeats of it


@dataclass(frozen=True)
class WarmUpShapes:
    """What to warm: the batch sizes and lengths the worker's settings let its jobs reach."""

    max_sequences: int = 8  # generation jobs decoded together
    score_rows: int = 64  # rows of one score batch (the engine's forwards hold at most 64)
    decode_tokens: int = 3  # decode steps per batch size
    score_prefix: int = 64  # tokens the score rows share
    score_own: int = 8  # tokens each score row has of its own


def batch_sizes(max_sequences: int, padded: bool) -> list[int]:
    """The decode batch sizes to warm: with padded shapes every power of two up to the largest batch
    (each a shape a batch meets as it grows), else one and the largest."""
    sizes = {1, max_sequences}
    if padded:
        n = 1
        while n < max_sequences:
            sizes.add(n)
            n *= 2
    return sorted(sizes)


def warm_up(engine: Engine, shapes: WarmUpShapes) -> float:
    """Run the warm-up shapes on `engine`; seconds it took. The engine's prefix cache is untouched."""
    t0 = time.perf_counter()
    own_cache = engine.prefix_cache
    engine.prefix_cache = PrefixCache(own_cache.budget_bytes) if own_cache is not None else None
    try:
        longest = max(1, min(engine.options.prefill_chunk, engine.context_length - shapes.decode_tokens - 8))
        _generate(engine, [_prompt(engine, longest)], shapes.decode_tokens)
        short = _prompt(engine, min(8, longest))
        for n in batch_sizes(shapes.max_sequences, engine.pad_shapes):
            _generate(engine, [short] * n, shapes.decode_tokens)
        rows = _score_rows(engine, shapes)
        for _ in range(2):  # cold, then its prefix from the (stand-in) cache
            engine.score_many([rows])
    finally:
        engine.prefix_cache = own_cache
    return time.perf_counter() - t0


def _generate(engine: Engine, prompts: list[str], max_tokens: int) -> None:
    """Decode `prompts` together for `max_tokens` steps (greedy; end-of-sequence masked, so every
    sequence decodes every step)."""
    bias = {i: -100.0 for i in engine.tokenizer.eos_ids if i < engine.model.args.vocab_size}
    batch = GenerationBatch(engine, max_sequences=len(prompts))
    try:
        for i, prompt in enumerate(prompts):
            request = GenerateRequest(prompt=prompt, max_tokens=max_tokens, temperature=0.0, logit_bias=bias)
            batch.admit(f"warm-up-{i}", request, lambda text, ids: None, lambda: False)
        while len(batch):
            for done in batch.step():
                if done.error is not None:
                    raise done.error
        batch.settle()
    finally:
        batch.close()


def _prompt(engine: Engine, tokens: int) -> str:
    """Text of at most `tokens` tokens (special tokens included), as close to it as repeats of a word get."""
    words = tokens
    while words > 1:
        n = len(engine.tokenizer.encode(_WORD * words))
        if n <= tokens:
            break
        words = max(1, min(words - 1, words * tokens // n))
    return _WORD * words


def _score_rows(engine: Engine, shapes: WarmUpShapes) -> list[PreparedRow]:
    """Score rows as tokenized jobs bring them: a shared prefix, a few own tokens, two candidates."""
    vocab = engine.model.args.vocab_size
    length = min(shapes.score_prefix + shapes.score_own, engine.context_length - 1)
    prefix = engine.tokenizer.encode(_WORD * shapes.score_prefix)[: max(1, length - shapes.score_own)]
    rows: list[PreparedRow] = []
    for i in range(min(shapes.score_rows, 64)):
        own = [(i * 7 + j + 1) % vocab for j in range(shapes.score_own)]
        rows.append(((prefix + own)[:length], [i % vocab, (i + 1) % vocab]))
    return rows
