"""The MTP rows of one generation batch draft together (`mtp_batch.py`).

Their proposals are token for token what each row drafting alone proposes with a batch-1 cache of the
MTP layer (float32 on the CPU), whatever the rows' prompt lengths, joins, departures, steps not
drafted and drafts kept, and whether the batch pads shapes (a GPU's: its forwards of several columns
then read whole steps of the cache, their width a power of two); a step's proposals for all the
batch's rows cost one forward of the MTP layer (and one a chunk of prompt for all the rows that join
together); a row that forgot entries it made joins again; and generation drafting so gives plain
decoding's output at several batch sizes, shapes padded or not.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

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
from mlxq.worker.engine.cache.kv_cache import KVCache
from mlxq.worker.engine.speculation.drafter import RowToDraft
from mlxq.worker.engine.speculation.mtp import MtpDraft, MtpLayer
from mlxq.worker.engine.speculation.mtp_batch import MtpBatch, MtpDrafter, ShiftedCache
from mlxq.worker.engine.speculation.policy import DraftPolicy

CHUNK = 16  # prompts longer than this enter chunk by chunk


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from bench.checkpoints import checkpoint

    return checkpoint("tiny-deepseek-mtp", tmp_path_factory.mktemp("mtp"))


@pytest.fixture(scope="module", params=[-100.0, 100.0], ids=["kept", "rejected"])
def narrowed(
    mtp_model: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Path:
    """The checkpoint with the target's final norm and the MTP layer's narrowed to one feature (as in
    `test_mtp.py`): both pick one of the same two tokens, the MTP layer's sign making it agree with the
    target (drafts kept) or not (drafts rejected)."""
    name = "kept" if request.param < 0 else "rejected"
    folder = tmp_path_factory.mktemp(name) / "model"
    shutil.copytree(mtp_model, folder)
    path = str(folder / "model.safetensors")
    weights = cast("dict[str, mx.array]", mx.load(path))
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    for key, scale in (
        ("model.norm.weight", 100.0),
        (f"model.layers.{layers}.shared_head.norm.weight", request.param),
    ):
        weights[key] = mx.zeros_like(weights[key]).at[5].add(scale)
    mx.save_safetensors(path, weights, metadata={"format": "pt"})
    return folder


def _engine(model: Path, **options: Any) -> Engine:
    settings: dict[str, Any] = {"prefill_chunk": CHUNK, "prefix_cache_bytes": 0, "dtype": "float32"}
    return closed_after_test(Engine.load(str(model), EngineOptions(**settings, **options)))


@pytest.fixture(scope="module")
def draft(mtp_model: Path) -> Iterator[MtpDraft]:
    """The checkpoint's MTP layer, as an engine drafting with it loads it."""
    engine = Engine.load(
        str(mtp_model), EngineOptions(prefill_chunk=CHUNK, speculation="mtp", dtype="float32")
    )
    assert isinstance(engine.draft_choice.draft, MtpDraft)
    yield engine.draft_choice.draft
    engine.close()


class AloneMtp:
    """A row drafting alone, as MTP rows did before they drafted together: a batch-1 cache of the MTP
    layer, entered (chunk by chunk, as the batch enters a prompt) with the row's positions up to its
    latest token at each proposal, from the target's hidden states of its tokens."""

    def __init__(self, draft: MtpDraft) -> None:
        self.draft = draft
        self.inner = KVCache()
        self.cache = ShiftedCache(self.inner)

    def propose(self, tokens: list[int], features: mx.array) -> list[int]:
        start, before = self.inner.offset, len(tokens) - 1
        out = None
        for s in range(start, before, CHUNK):
            e = min(s + CHUNK, before)
            out = self.draft.outputs(tokens[s + 1 : e + 1], features[:, s:e], self.cache)
        assert out is not None
        return [int(mx.argmax(self.draft.target.logits(out[0, -1])).item())]


class _Row:
    """A simulated request: its tokens drawn in advance (`known` of them so far, the pending one last)
    and their hidden states; its drafter in the batch and alone."""

    def __init__(self, draft: MtpDraft, tokens: list[int], prompt: int) -> None:
        self.tokens, self.known = tokens, prompt + 1
        self.features = draft.features(tokens)
        self.batched = MtpDrafter(draft)
        self.alone = AloneMtp(draft)
        self.batched.take_features(0, self.features[:, :prompt], tokens[:prompt])  # the batch's prefill

    @property
    def now(self) -> list[int]:
        return self.tokens[: self.known]

    def forward(self, drafts: int, kept: int) -> None:
        """A forward feeding the pending token and `drafts` drafts, of which the target kept `kept`:
        the hidden states of the rejected columns are junk (another token's), replaced later."""
        p = self.known - 1
        fed = self.features[:, p : p + 1 + kept]
        if drafts > kept:
            fed = mx.concatenate([fed, mx.full((1, drafts - kept, fed.shape[-1]), 3.0)], axis=1)
        self.batched.take_features(p, fed, self.now)
        self.known += kept + 1


@pytest.mark.parametrize("rows, pad_shapes", [(1, False), (3, False), (8, False), (1, True), (8, True)])
def test_rows_drafting_together_propose_what_each_proposes_alone(
    draft: MtpDraft, rows: int, pad_shapes: bool
) -> None:
    """Rows of prompts from 3 to 45 tokens (some entered in chunks) join at different steps, draft or
    not, take plain steps, keep their draft or not, leave in the middle; every proposal equals the
    row's alone, and the batch ends empty. With `pad_shapes` its forwards of several columns read
    whole steps of the cache."""
    rng = random.Random(rows)
    vocab = draft.target.args.vocab_size
    batch = MtpBatch(draft, pad_shapes)
    reads = record_reads([batch.cache])
    live: dict[int, _Row] = {}
    compared = 0
    for step in range(14):
        for i in range(rows):  # row i joins at step i % 3; row 1 leaves at step 7
            if step == i % 3:
                prompt = 3 + (11 * i) % 43
                live[i] = _Row(draft, [rng.randrange(vocab) for _ in range(prompt + 40)], prompt)
        if step == 7 and 1 in live and rows > 1:
            batch.leave([live.pop(1).batched])
        if step % 5 == 4:  # a plain step: every row takes one token, nobody drafts
            for row in live.values():
                row.forward(0, 0)
            continue
        depths = {i: rng.choice([0, 1, 1, 3]) for i in live}
        asked = [i for i in live if depths[i] or rng.random() < 0.7]  # some rows are not asked at all
        if not any(depths[i] for i in asked):
            asked = asked or [next(iter(live))]
            depths[asked[0]] = 1
        got = batch.propose([RowToDraft(live[i].batched, live[i].now, depths[i]) for i in asked])
        for i, drafts in zip(asked, got, strict=True):
            row = live[i]
            if not depths[i]:
                assert drafts == []
                row.forward(0, 0)
                continue
            assert drafts == row.alone.propose(row.now, row.features), (step, i)
            compared += 1
            row.forward(1, rng.randint(0, 1))
        for i in live:
            if i not in asked:
                live[i].forward(0, 0)
    assert compared >= 2 * rows
    assert_whole_steps(reads, pad_shapes)
    assert len(batch) == len(live)
    batch.leave([row.batched for row in live.values()])
    assert len(batch) == 0 and batch.cache.keys is None  # no row's entries outlive it


def test_rows_joining_a_padded_batch_enter_in_a_padded_number_of_rows(
    draft: MtpDraft, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `pad_shapes` rows that join together enter their positions beside rows entering nothing,
    up to a power of two (a GPU meets a few shapes, not one a number of rows), their width a power of
    two, reading a whole step; their drafts are what each proposes alone, and only they join."""
    rng = random.Random(3)
    vocab = draft.target.args.vocab_size
    rows = [_Row(draft, [rng.randrange(vocab) for _ in range(20)], p) for p in (5, 9, 11)]
    batch = MtpBatch(draft, pad_shapes=True)
    met = record_draft_attention(monkeypatch)
    got = batch.propose([RowToDraft(r.batched, r.now, 1) for r in rows])
    assert met == {(4, 16, 256)}  # 3 rows of at most 11 positions
    assert got == [r.alone.propose(r.now, r.features) for r in rows]
    assert len(batch) == batch.cache.batch == 3 and batch.cache.lengths == [5, 9, 11]


def test_a_row_handed_features_again_from_before_its_entries_joins_again(draft: MtpDraft) -> None:
    """Not expected of a generation: features handed from a position the row's entries cover make it
    leave the batch before its next forward and join again, its entries made afresh from the target's
    hidden states of its tokens; its proposals are still its alone."""
    rng = random.Random(7)
    vocab = draft.target.args.vocab_size
    batch = draft.draft_batch()
    rows = [_Row(draft, [rng.randrange(vocab) for _ in range(30)], 6 + i) for i in range(3)]
    for _ in range(2):
        got = batch.propose([RowToDraft(r.batched, r.now, 1) for r in rows])
        assert got == [r.alone.propose(r.now, r.features) for r in rows]
        for r in rows:
            r.forward(1, 1)
    again = rows[1]
    entries = again.batched.entries
    again.batched.take_features(entries - 2, again.features[:, entries - 2 : again.known - 1], again.now)
    assert again.batched.entries == 0 and again.batched.unseen == entries - 2
    again.alone = AloneMtp(draft)
    got = batch.propose([RowToDraft(r.batched, r.now, 1) for r in rows])
    assert got == [r.alone.propose(r.now, r.features) for r in rows]
    assert batch.rows[-1] is again.batched and again.batched.entries == again.known - 1


def test_a_step_of_b_rows_costs_one_forward_of_the_mtp_layer(draft: MtpDraft) -> None:
    rng = random.Random(5)
    vocab = draft.target.args.vocab_size
    batch = draft.draft_batch()
    prompts = [4, 5, 6, CHUNK + 4, 8, 9, 10, 11]  # one longer than a chunk
    rows = [_Row(draft, [rng.randrange(vocab) for _ in range(60)], p) for p in prompts]
    calls = count_calls(draft.layer)
    try:

        def step(members: list[int], depths: list[int] | None = None) -> int:
            before = calls[0]
            depths = depths or [1] * len(members)
            asked = [
                RowToDraft(rows[i].batched, rows[i].now, d) for i, d in zip(members, depths, strict=True)
            ]
            got = batch.propose(asked)
            for i, d, drafts in zip(members, depths, got, strict=True):
                assert len(drafts) == min(d, 1)
                rows[i].forward(len(drafts), rng.randint(0, len(drafts)))
            return calls[0] - before

        assert step(list(range(7))) == 2  # 7 rows join: one forward a chunk of the longest prompt
        for _ in range(3):
            assert step(list(range(7))) == 1  # one forward for all
        assert step(list(range(8))) == 2  # a row joins: its prompt (one chunk) is one forward more
        assert step(list(range(8)), [1, 0, 1, 0, 3, 1, 0, 1]) == 1  # some draft nothing
        assert step([0, 2], [0, 0]) == 0  # nobody drafts: no forward
        assert step(list(range(8))) == 1
    finally:
        draft.layer.__class__ = MtpLayer


@pytest.mark.parametrize("rows, pad_shapes", [(1, False), (3, False), (8, False), (3, True)])
def test_generation_drafting_together_gives_plain_decodings_output(
    narrowed: Path, rows: int, pad_shapes: bool
) -> None:
    """Greedy rows of different prompt lengths joining one a step and leaving as they end (one at a
    stop string, one cancelled), their drafts kept or rejected: each gives what plain decoding (shapes
    not padded) gives, shapes padded (a GPU's way: the MTP forwards read whole steps) or not, and the
    draft batch holds no row that left."""
    plain = _engine(narrowed)
    requests, cancel, expected = joining_and_leaving(plain, rows)
    policy = DraftPolicy(min_acceptance=0.0, max_batch=64, only_likely=False)
    spec = _engine(narrowed, speculation="mtp", draft_policy=policy, pad_shapes=pad_shapes)
    assert isinstance(spec.draft_choice.draft, MtpDraft)
    assert spec.draft_choice.draft.draft_batch().pad_shapes == pad_shapes
    got = run_drafting(spec, requests, rows, cancel)
    assert_same_results(expected, got)
    usage = [r.result.usage for r in got.values() if r.result]
    drafted, kept = sum(u.draft_tokens for u in usage), sum(u.accepted_tokens for u in usage)
    assert expected[len(requests) - 1].result.finish_reason == "stop"  # type: ignore[union-attr]
    assert drafted > 0 and (kept > 0 if "kept" in narrowed.parent.name else kept < drafted)
