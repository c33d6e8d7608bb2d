"""What the tests of rows drafting together share (`test_draft_batch.py`, `test_mtp_batch.py`,
`test_draft_warm_up.py`): requests run through a generation batch with the draft batches checked at
every step, their results compared with plain decoding's, the key columns each forward through a batch
cache reads, and the shapes of the attentions a draft batch runs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import pytest

from mlxq.jobs.schema import GenerateRequest
from mlxq.worker.engine import Engine
from mlxq.worker.engine.cache.batch_cache import BatchKVCache
from mlxq.worker.engine.generation_batch import Finished, GenerationBatch, generate
from mlxq.worker.engine.speculation.draft_batch import DraftModelBatch
from mlxq.worker.engine.speculation.mtp_batch import MtpBatch

PROMPT = "The capital of France is Paris. "

Read = tuple[int, int, int]  # a forward's columns written, the layer's end after it, key columns read


def record_reads(layers: list[BatchKVCache]) -> list[Read]:
    """Note, for every forward through these batch cache layers, the columns it wrote, the layer's end
    after the write and the key columns attention read (in the batch's numbering: a windowed layer's
    from `base`)."""
    reads: list[Read] = []
    for layer in layers:
        plain = layer.update_and_fetch

        def read(
            keys: mx.array, values: mx.array, plain: Any = plain, layer: BatchKVCache = layer
        ) -> tuple[mx.array, mx.array]:
            k, v = plain(keys, values)
            reads.append((keys.shape[2], layer.end, layer.base + k.shape[2]))
            return k, v

        layer.update_and_fetch = read  # type: ignore[method-assign]
    return reads


Attention = tuple[int, int, int]  # an attention's rows, queries and key columns


def record_draft_attention(monkeypatch: pytest.MonkeyPatch) -> set[Attention]:
    """From now on, note the shape of every attention over several queries that a draft batch
    (`DraftModelBatch`, `MtpBatch`) runs while it proposes: what builds a plan a shape on a GPU (MLX's
    CUDA build; one query's attention builds none)."""
    met: set[Attention] = set()
    proposing = [False]
    attention = mx.fast.scaled_dot_product_attention

    def noted(q: mx.array, k: mx.array, v: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        if proposing[0] and q.shape[2] > 1:
            met.add((q.shape[0], q.shape[2], k.shape[2]))
        return attention(q, k, v, *args, **kwargs)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", noted)
    for batch in (DraftModelBatch, MtpBatch):

        def propose(self: Any, rows: Any, plain: Any = batch.propose) -> list[list[int]]:
            proposing[0] = True
            try:
                return plain(self, rows)  # type: ignore[no-any-return]
            finally:
                proposing[0] = False

        monkeypatch.setattr(batch, "propose", propose)
    return met


def assert_whole_steps(reads: list[Read], whole: bool) -> None:
    """With `whole`, every forward of several columns read whole steps of the cache and its width is a
    power of two, every one-column forward exactly the columns written; else every forward read
    exactly. Some forward fed several columns."""
    assert any(n > 1 for n, _, _ in reads)
    for n, end, columns in reads:
        if whole and n > 1:
            assert columns % BatchKVCache.step == 0 and columns >= end and n & (n - 1) == 0, (n, end, columns)
        else:
            assert columns == end, (n, end, columns)


def run_drafting(
    engine: Engine, requests: list[GenerateRequest], max_sequences: int, cancel: int | None = None
) -> dict[int, Finished]:
    """Admit a request a step as slots free up; run until all end, checking at every step that the draft
    batches hold no row that left. `cancel`: that request is cancelled after its fifth token."""
    batch = GenerationBatch(engine, max_sequences=max_sequences)
    seen: dict[int, int] = {i: 0 for i in range(len(requests))}

    def sink(i: int) -> Callable[[str, list[int]], None]:
        def take(_text: str, ids: list[int]) -> None:
            seen[i] += len(ids)

        return take

    done: dict[int, Finished] = {}
    todo = list(enumerate(requests))
    while todo or len(batch):
        if todo and batch.free_slots > 0:
            i, request = todo.pop(0)
            batch.admit(str(i), request, sink(i), lambda i=i: i == cancel and seen[i] >= 5)
        for f in batch.step():
            done[int(f.key)] = f
        assert batch.drafts.held <= len(batch.decoding)
    batch.close()
    assert batch.drafts.held == 0
    return done


def drafting_requests(engine: Engine, n: int) -> Iterator[GenerateRequest]:
    no_eos = {i: -100.0 for i in engine.tokenizer.eos_ids}
    for i in range(n):
        yield GenerateRequest(
            prompt=PROMPT * (1 + i % 3) + f"#{i}", max_tokens=5 + 6 * i, temperature=0, logit_bias=no_eos
        )


def joining_and_leaving(
    plain: Engine, rows: int
) -> tuple[list[GenerateRequest], int | None, dict[int, Finished]]:
    """`rows` + 1 greedy requests of different prompt lengths, the last ending at a stop string and,
    with more than one row, the second cancelled (`run_drafting`'s `cancel`); and what `plain`
    decoding gives them at `rows` sequences: (requests, cancel, results)."""
    requests = list(drafting_requests(plain, rows + 1))
    stop_at = generate(plain, requests[-1], lambda _t, _ids: None).text[10:13]
    requests[-1] = requests[-1].model_copy(update={"stop": [stop_at], "max_tokens": 40})
    cancel = 1 if rows > 1 else None
    return requests, cancel, run_drafting(plain, requests, rows, cancel)


def assert_same_results(expected: dict[int, Finished], got: dict[int, Finished]) -> None:
    """Every request ended with the same tokens, text and finish reason in both runs."""
    for i in expected:
        a, b = expected[i].result, got[i].result
        assert a is not None and b is not None, (got[i].error, i)
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason), i
