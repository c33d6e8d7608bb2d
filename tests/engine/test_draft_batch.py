"""A draft model's rows of one generation batch draft together (`draft_batch.py`).

Their proposals are token for token what each row drafting alone with a batch-1 cache of the draft
model proposes (float32 on the CPU), whatever the rows' prompt lengths, depths, joins and departures,
and whether the batch pads shapes (a GPU's: its forwards of several columns then read whole steps of
the cache, their width a power of two, unless the draft model has windowed layers); a step of B rows
costs depth forwards of the draft model (one more when rows join), not B x depth; rows that leave take
their state with them; and generation drafting so gives plain decoding's output, shapes padded or not.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from drafting import (
    assert_same_results,
    assert_whole_steps,
    joining_and_leaving,
    record_draft_attention,
    record_reads,
    run_drafting,
)
from engines import closed_after_test, count_calls

from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.engine.prefill import prefill
from mlxq.worker.engine.speculation.draft_batch import DraftModelDrafter
from mlxq.worker.engine.speculation.draft_model import DraftModel
from mlxq.worker.engine.speculation.drafter import RowToDraft
from mlxq.worker.engine.speculation.policy import DraftPolicy
from mlxq.worker.engine.text.tokenizer import Tokenizer
from mlxq.worker.modelfiles.tiny_model import write_random_checkpoint

CHUNK = 16  # prompts longer than this are prefilled chunk by chunk


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("target"), {"max_position_embeddings": 512})


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(
        tmp_path_factory.mktemp("draft"), {"max_position_embeddings": 512, "num_hidden_layers": 2}, seed=3
    )


@pytest.fixture(scope="module")
def windowed_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A draft model whose layers slide a window (Mistral's): its forwards read exactly, padded or not."""
    config = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 8}
    return write_random_checkpoint(
        tmp_path_factory.mktemp("windowed"),
        {**config, "max_position_embeddings": 512, "num_hidden_layers": 2},
        seed=4,
    )


def _draft(folder: Path, pad_shapes: bool = False) -> DraftModel:
    return DraftModel.load(folder, Tokenizer.from_dir(folder), prefill_chunk=CHUNK, pad_shapes=pad_shapes)


class AloneDrafter:
    """A row drafting alone, as rows did before they drafted together: a batch-1 cache of the draft
    model caught up with the row's new tokens (`prefill`, in chunks), a forward per drafted token, cut
    back to the drafts the target kept."""

    def __init__(self, draft: DraftModel) -> None:
        self.model, self.chunk = draft.model, draft.prefill_chunk
        self.cache = draft.model.make_cache()

    def propose(self, tokens: list[int], depth: int) -> list[int]:
        logits = prefill(self.model, tokens[self.cache[0].offset :], self.cache, self.chunk)
        out: list[int] = []
        while True:
            out.append(int(mx.argmax(logits, axis=-1).item()))
            if len(out) == depth:
                return out
            logits = self.model(mx.array([[out[-1]]], dtype=mx.int32), cache=self.cache)[:, -1, :]

    def accepted(self, proposed: int, kept: int) -> None:
        for layer in self.cache:
            layer.trim(max(0, proposed - 1 - kept))


class _Row:
    """A simulated request: its tokens (the pending one last), its drafter in the batch and alone."""

    def __init__(self, draft: DraftModel, prompt: list[int]) -> None:
        self.tokens = prompt
        self.batched = DraftModelDrafter(draft)
        self.alone = AloneDrafter(draft)


@pytest.mark.parametrize(
    "rows, pad_shapes, windowed",
    [
        (1, False, False),
        (3, False, False),
        (8, False, False),
        (1, True, False),
        (8, True, False),
        (3, True, True),
    ],
)
def test_rows_drafting_together_propose_what_each_proposes_alone(
    draft_dir: Path, windowed_draft_dir: Path, rows: int, pad_shapes: bool, windowed: bool
) -> None:
    """Rows of prompts from 3 to 45 tokens (some prefilled in chunks) join at different steps, draft
    0 to 5 tokens a step or are not asked, take plain steps, keep any share of their drafts, leave in
    the middle; every proposal equals the row's alone, and the batch ends empty. With `pad_shapes` the
    forwards of several columns read whole steps of the cache, unless the draft model is windowed."""
    draft = _draft(windowed_draft_dir if windowed else draft_dir, pad_shapes)
    rng = random.Random(rows)
    vocab = draft.model.args.vocab_size
    batch = draft.draft_batch()
    reads = record_reads(batch.cache)
    prompts = [[rng.randrange(vocab) for _ in range(3 + (11 * i) % 43)] for i in range(rows)]
    live: dict[int, _Row] = {}
    compared = 0
    for step in range(14):
        for i in range(rows):  # row i joins at step i % 3; row 1 leaves at step 7
            if step == i % 3:
                live[i] = _Row(draft, prompts[i])
        if step == 7 and 1 in live and rows > 1:
            batch.leave([live.pop(1).batched])
        if step % 5 == 4:  # a plain step: every row takes one token, nobody drafts
            for row in live.values():
                row.tokens = [*row.tokens, rng.randrange(vocab)]
            continue
        depths = {i: rng.choice([0, 1, 2, 3, 5]) for i in live}
        asked = [i for i in live if depths[i] or rng.random() < 0.5]  # some rows are not asked at all
        if not any(depths[i] for i in asked):
            depths[asked[0] if asked else next(iter(live))] = 2
            asked = asked or [next(iter(live))]
        got = batch.propose([RowToDraft(live[i].batched, live[i].tokens, depths[i]) for i in asked])
        for i, drafts in zip(asked, got, strict=True):
            row, depth = live[i], depths[i]
            if not depth:
                assert drafts == []
                row.tokens = [*row.tokens, rng.randrange(vocab)]
                continue
            assert drafts == row.alone.propose(row.tokens, depth), (step, i)
            compared += 1
            kept = rng.randint(0, depth)
            row.batched.accepted(depth, kept)
            row.alone.accepted(depth, kept)
            row.tokens = [*row.tokens, *drafts[:kept], rng.randrange(vocab)]
        for i in live:
            if i not in asked:
                live[i].tokens = [*live[i].tokens, rng.randrange(vocab)]
    assert compared >= 2 * rows
    assert_whole_steps(reads, pad_shapes and not windowed)
    assert all(row.batched.cached < len(row.tokens) for row in live.values())
    batch.leave([row.batched for row in live.values()])
    assert len(batch) == 0 and batch.cache[0].keys is None  # no row's cache outlives it


def test_rows_joining_a_padded_batch_are_prefilled_in_a_padded_shape(
    draft_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `pad_shapes` rows that join together are prefilled as the engine's own prompts are: their
    number padded to a power of two, their width to a `padded_width` (a GPU meets a few shapes, not one
    a prompt length); their drafts are what each proposes alone."""
    draft = _draft(draft_dir, pad_shapes=True)
    batch = draft.draft_batch()
    tokens = [[5 + i] * n for i, n in enumerate((5, 9, 11))]
    met = record_draft_attention(monkeypatch)
    got = batch.propose([RowToDraft(DraftModelDrafter(draft), t, 1) for t in tokens])
    assert met == {(4, CHUNK, CHUNK)}  # 3 rows of at most 11 tokens: 4 rows, 16 columns
    assert got == [AloneDrafter(draft).propose(t, 1) for t in tokens]


def test_a_row_asked_again_with_nothing_new_starts_over_from_its_prompt(draft_dir: Path) -> None:
    """Not expected of a generation (each step adds the target's token): a row whose cache already
    holds all of its tokens leaves the batch and joins again, its proposal what it proposes alone."""
    draft = _draft(draft_dir)
    batch = draft.draft_batch()
    rows = [DraftModelDrafter(draft) for _ in range(3)]
    tokens = [[5 + i, 9, 11, 40 + i, 7] for i in range(3)]
    first = batch.propose([RowToDraft(d, t, 4) for d, t in zip(rows, tokens, strict=True)])
    rows[1].accepted(4, 4)  # its cache: its tokens and 3 drafts, as many as `tokens[1]` and more
    tokens[0] = [*tokens[0], *first[0][:2], 3]
    rows[0].accepted(4, 2)
    again = batch.propose([RowToDraft(rows[0], tokens[0], 3), RowToDraft(rows[1], tokens[1], 3)])
    assert again == [AloneDrafter(draft).propose(t, 3) for t in tokens[:2]]
    assert len(batch) == 3 and batch.rows[-1] is rows[1]  # it joined again, last


def test_a_step_of_b_rows_costs_depth_forwards_of_the_draft_not_b_times_depth(draft_dir: Path) -> None:
    draft = _draft(draft_dir)
    calls = count_calls(draft.model.model)  # its decoder stack: every forward goes through it once
    rng = random.Random(5)
    vocab, depth = draft.model.args.vocab_size, 4
    batch = draft.draft_batch()
    tokens = [[rng.randrange(vocab) for _ in range(4 + i)] for i in range(8)]  # each fits a chunk
    drafters = [DraftModelDrafter(draft) for _ in tokens]

    def step(rows: list[int], depths: list[int] | None = None) -> int:
        before = calls[0]
        depths = depths or [depth] * len(rows)
        got = batch.propose(
            [RowToDraft(drafters[i], tokens[i], d) for i, d in zip(rows, depths, strict=True)]
        )
        for i, d, drafts in zip(rows, depths, got, strict=True):
            kept = rng.randint(0, d)
            drafters[i].accepted(d, kept)
            tokens[i] = [*tokens[i], *drafts[:kept], rng.randrange(vocab)]
        return calls[0] - before

    assert step(list(range(7))) == depth  # 7 rows join: their prompts in one forward, then depth - 1
    for _ in range(3):
        assert step(list(range(7))) == depth  # one catch-up forward for all, then depth - 1
    assert step(list(range(8))) == depth + 1  # a row joins mid-batch: its prompt is one forward more
    assert step(list(range(8)), [1, 4, 2, 0, 3, 1, 4, 2]) == depth  # the deepest row's depth
    assert step([0, 2], [1, 1]) == 1  # one token each: the catch-up forward alone
    alone, mine = DraftModelDrafter(draft), tokens[0][:6]  # outside a generation batch: a batch of one
    for _ in range(2):
        before = calls[0]
        drafts = alone.propose(mine, depth)
        assert len(drafts) == depth and calls[0] - before == depth
        alone.accepted(depth, 1)
        mine = [*mine, drafts[0], 7]


def _engine(model: Path, **options: Any) -> Engine:
    return closed_after_test(
        Engine.load(str(model), EngineOptions(prefill_chunk=CHUNK, prefix_cache_bytes=0, **options))
    )


@pytest.mark.parametrize("rows, pad_shapes", [(1, False), (3, False), (8, False), (3, True)])
def test_generation_drafting_together_gives_plain_decodings_output(
    target: Path, draft_dir: Path, rows: int, pad_shapes: bool
) -> None:
    """Greedy rows of different prompt lengths joining one a step and leaving as they end (one at a
    stop string, one cancelled): each gives what plain decoding (shapes not padded) gives, drafted by
    the target itself (every draft kept) or by another model (few kept), shapes padded (a GPU's way:
    the drafts' forwards read whole steps) or not."""
    plain = _engine(target)
    requests, cancel, expected = joining_and_leaving(plain, rows)
    policy = DraftPolicy(min_acceptance=0.0, max_batch=64)
    for draft in (str(target), str(draft_dir)):
        spec = _engine(
            target, speculation="draft_model", draft_model=draft, draft_policy=policy, pad_shapes=pad_shapes
        )
        assert isinstance(spec.draft_choice.draft, DraftModel)
        assert spec.draft_choice.draft.draft_batch().pad_shapes == pad_shapes
        assert spec.draft_choice.draft.model.bucket_keys == pad_shapes  # a long prompt's chunks too
        got = run_drafting(spec, requests, rows, cancel)
        assert_same_results(expected, got)
        assert sum(r.result.usage.draft_tokens for r in got.values() if r.result) > 0
    assert expected[len(requests) - 1].result.finish_reason == "stop"  # type: ignore[union-attr]
    if cancel is not None:
        assert expected[cancel].result.finish_reason == "cancelled"  # type: ignore[union-attr]
