"""Warming a worker's engine up before its first job: the shapes its jobs meet first, run once on dummies.

The first forward of a new input shape builds its kernels (on a GPU many times the forward itself), so
without this a worker's first jobs pay for every shape they meet. `warm_up` runs, on made-up prompts:
- a prefill of each width a prompt chunk is padded to (`shapes.padded_width`, up to `prefill_chunk`;
  without padding, a short prompt and a whole chunk), each prompt its own so none is a cached prefix of
  another;
- one sequence decoding past the KV cache's first steps (with padding: attention reads whole cache steps,
  each a shape of its own, `cache.kv_cache.key_columns`);
- a few decode steps of each batch size a generation batch pads to (up to `max_sequences`);
- a score batch of rows sharing a prefix, scored twice (the second time its prefix comes from a prefix
  cache, as a warm job's does), and a lone score row with several candidates at each prefill width;
- with speculative decoding and padded shapes, the verify steps' shapes (`VerifyStep`): each batch size
  that may draft, each padded width a step may feed (a row's pending token and its drafts), each number
  of key columns up to `verify_columns` (verify forwards read whole cache steps), a plain step after
  each. The shapes are noted as met (`Engine.verify_shapes`), so the draft gate judges those steps by
  their time;
- with a draft model or an MTP layer and padded shapes, its rows' batched forwards (`draft_warm_up.py`):
  rows entering their prompts together, and catching up with what the target took, at each number of
  rows that may draft and the key columns the verify steps are warmed up to.

It leaves nothing behind that changes a result: the engine's prefix cache is set aside while it runs (a
private cache of the same budget stands in, then is dropped), sampling is greedy, and nothing here
knows of Redis. MLX's buffer cache keeps the memory it grew to, as after any job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

from mlxq.jobs.schema import FinishReason, GenerateRequest
from mlxq.worker.engine.cache.kv_cache import KVCache
from mlxq.worker.engine.cache.prefix_cache import PrefixCache
from mlxq.worker.engine.draft_warm_up import drafts_to_warm, warm_drafts
from mlxq.worker.engine.engine import Engine
from mlxq.worker.engine.generation_batch import GenerationBatch
from mlxq.worker.engine.score_requests import PreparedRow
from mlxq.worker.engine.shapes import padded_size, padded_width

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
    decode_positions: int = 2 * KVCache.step + 16  # a lone sequence decodes past this many positions
    lone_row_candidates: int = 8  # candidates of the lone score row
    verify_columns: int = 4 * KVCache.step  # key columns up to which verify steps are warmed


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


def prefill_widths(chunk: int, padded: bool) -> list[int]:
    """The prompt widths to prefill once: with padding every width a chunk of up to `chunk` tokens is
    padded to (`padded_width`), else a short prompt and a whole chunk."""
    if not padded:
        return sorted({min(8, chunk), chunk})
    widths, n = set(), 1
    while n <= chunk:
        width = padded_width(n)
        widths.add(min(width, chunk))
        n = width + 1
    return sorted(widths)


def warm_up(engine: Engine, shapes: WarmUpShapes) -> dict[str, float]:
    """Run the warm-up shapes on `engine`; the seconds each part took (`prefill`, `decode`, `batches`,
    `score`, and with speculative decoding on a GPU `verify`, and `drafts` where a draft model or an
    MTP layer drafts). The engine's prefix cache is untouched."""
    seconds: dict[str, float] = {}
    with _stand_in_prefix_cache(engine):
        room = shapes.decode_tokens + 8
        chunk = max(1, min(engine.options.prefill_chunk, engine.context_length - room))
        salt = iter(range(1_000_000))
        widths = prefill_widths(chunk, engine.pad_shapes)
        with _timed(seconds, "prefill"):
            for width in widths:
                _generate(engine, [_prompt(engine, width, next(salt))], 1)
        with _timed(seconds, "decode"):
            steps = shapes.decode_positions if engine.pad_shapes else shapes.decode_tokens
            steps = max(1, min(steps, engine.context_length - 16))
            _generate(engine, [_prompt(engine, 8, next(salt))], steps)
        with _timed(seconds, "batches"):
            for n in batch_sizes(shapes.max_sequences, engine.pad_shapes):
                _generate(engine, [_prompt(engine, 8, next(salt)) for _ in range(n)], shapes.decode_tokens)
        with _timed(seconds, "score"):
            rows = _score_rows(engine, shapes)
            for _ in range(2):  # cold, then its prefix from the (stand-in) cache
                engine.score_many([rows])
            for width in widths:  # a lone row's forward goes through the scorer's own masks and gathers
                engine.score_many([[_lone_row(engine, width, shapes.lone_row_candidates, next(salt))]])
        if engine.options.speculation != "off" and engine.pad_shapes:
            with _timed(seconds, "verify"):
                _verify_steps(engine, shapes, salt)
        if drafts_to_warm(engine) is not None:
            with _timed(seconds, "drafts"):
                warm_drafts(engine, shapes.max_sequences, shapes.verify_columns)
    return seconds


def warm_verify_steps(engine: Engine, shapes: WarmUpShapes) -> float:
    """Only the speculation's part of `warm_up` (a drafting engine beside warmed ones): its verify
    steps and its drafter's batched forwards; its seconds."""
    started = time.perf_counter()
    if engine.options.speculation != "off" and engine.pad_shapes:
        with _stand_in_prefix_cache(engine):
            _verify_steps(engine, shapes, iter(range(1_000_000)))
        warm_drafts(engine, shapes.max_sequences, shapes.verify_columns)
    return time.perf_counter() - started


@contextmanager
def _stand_in_prefix_cache(engine: Engine) -> Iterator[None]:
    """The engine's prefix cache set aside while warming up: a private one of the same budget stands
    in (the warm-up's prompts are offered to it), then is dropped."""
    own_cache = engine.prefix_cache
    engine.prefix_cache = PrefixCache(own_cache.budget_bytes) if own_cache is not None else None
    try:
        yield
    finally:
        engine.prefix_cache = own_cache


@contextmanager
def _timed(seconds: dict[str, float], part: str) -> Iterator[None]:
    started = time.perf_counter()
    yield
    seconds[part] = time.perf_counter() - started


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


def verify_widths(engine: Engine) -> list[int]:
    """The padded widths a verify step of this engine may feed: a row's pending token and its drafts,
    up to the policy's most drafted tokens (a prompt lookup run may grow to `max_run`)."""
    policy = engine.options.draft_policy
    lookup = engine.options.speculation == "prompt_lookup"
    most = max(policy.max_depth, policy.max_run) if lookup else policy.max_depth
    widest = padded_size(1 + most, smallest=1)
    return [w for w in (1 << i for i in range(1, widest.bit_length())) if w <= widest]


def _verify_steps(engine: Engine, shapes: WarmUpShapes, salt: Iterator[int]) -> None:
    """Verify steps of every shape a drafting batch meets first (see the module docstring): for each
    batch size and number of key columns, a batch of that many rows whose prompts end in that cache
    step, then a verify step of each width (every row drafting its pending token again) and a plain
    step after it. The batch's rows never take these tokens: it is dropped after."""
    sizes = batch_sizes(min(shapes.max_sequences, engine.options.draft_policy.max_batch), padded=True)
    widths = verify_widths(engine)
    bias = {i: -100.0 for i in engine.tokenizer.eos_ids if i < engine.model.args.vocab_size}
    for n in sizes if widths else []:
        # the prompts end that far before their cache step's end: the rows' decode steps while the
        # batch admits them, and every verify step keeping all its drafts, stay inside the step
        margin = n + sum(widths) + len(widths) + widths[-1] + 8
        for steps in range(1, shapes.verify_columns // KVCache.step + 1):
            length = steps * KVCache.step - margin
            if length <= (steps - 1) * KVCache.step or steps * KVCache.step + margin > engine.context_length:
                continue
            batch = GenerationBatch(engine, max_sequences=n)
            try:
                for i in range(n):
                    request = GenerateRequest(
                        prompt=_prompt(engine, length, next(salt)),
                        max_tokens=margin,
                        temperature=0.0,
                        logit_bias=bias,
                    )
                    batch.admit(f"warm-up-{i}", request, lambda text, ids: None, lambda: False)
                while len(batch) and len(batch.decoding) < n:
                    for done in batch.step():
                        if done.error is not None:
                            raise done.error
                if len(batch.decoding) < n:  # rows ended before all started (the KV budget): not this shape
                    continue
                for width in widths:
                    batch.decode.verify_with(partial(_repeats, width - 1), _none)
                    batch.decode.step_with(_none, ends_all=lambda out: False)
            finally:
                batch.close()


def _repeats(count: int, tokens: list[int]) -> list[list[int]]:
    """Each row's drafts at a warm-up verify step: its pending token `count` times."""
    return [[t] * count for t in tokens]


def _none(tokens: list[Any]) -> list[tuple[int, FinishReason | BaseException]]:
    """A warm-up step's handling of its tokens: nobody takes them, no row ends."""
    return []


def _prompt(engine: Engine, tokens: int, salt: int) -> str:
    """Text of at most `tokens` tokens (special tokens included), as close to it as repeats of a word
    get, opened by `salt` so that no two warm-up prompts share a prefix (a cached one would skip the
    prefill whose shape is to be warmed)."""
    opening = f"{salt} "
    words = tokens
    while words > 1:
        n = len(engine.tokenizer.encode(opening + _WORD * words))
        if n <= tokens:
            break
        words = max(1, min(words - 1, words * tokens // n))
    return opening + _WORD * words


def _lone_row(engine: Engine, tokens: int, candidates: int, salt: int) -> PreparedRow:
    """One score row of about `tokens` tokens with `candidates` one-token candidates."""
    vocab = engine.model.args.vocab_size
    prompt = engine.tokenizer.encode(_prompt(engine, max(1, tokens - 1), salt))
    return (prompt, [(salt + i) % vocab for i in range(candidates)])


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
