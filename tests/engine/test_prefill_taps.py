"""A drafter reading the target's hidden states gets its prompt's features from the batch's prefill.

The features a prefill taps (alone in chunks, or several prompts in one forward, shapes padded or not)
are those the drafter's own forward over the prompt computes (float32, 1e-5), and its logits are
plain prefill's. In a generation batch, a row prefilled by the batch makes no target forward of its
own at its first proposal, whether its prompt went in one forward with others or alone in chunks; a
row whose prompt the prefix cache gave in part computes the features of that part only (the cached
prefix was never run here); greedy output is plain decoding's throughout.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from engines import closed_after_test, run_requests

from mlxq.jobs.schema import GenerateRequest
from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.engine.models.layer_taps import LayerTaps
from mlxq.worker.engine.prefill import ChunkedPrefill, prefill, prefill_rows_layers
from mlxq.worker.engine.speculation.dflash import DFlashDraft, DFlashDrafter, write_random_draft
from mlxq.worker.engine.speculation.mtp import MtpDraft
from mlxq.worker.engine.speculation.mtp_batch import MtpDrafter
from mlxq.worker.engine.speculation.policy import DraftPolicy
from mlxq.worker.modelfiles.tiny_model import write_random_checkpoint

CHUNK = 16
PROMPT = "The capital of France is Paris. "


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from bench.checkpoints import checkpoint

    return checkpoint("tiny-deepseek-mtp", tmp_path_factory.mktemp("mtp"))


@pytest.fixture(scope="module")
def dflash_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama target with a random DFlash draft in `draft/` beside it."""
    import json

    folder = write_random_checkpoint(tmp_path_factory.mktemp("dflash") / "model", {"num_hidden_layers": 4})
    config = json.loads((folder / "config.json").read_text())
    write_random_draft(folder / "draft", config, layers=1, block_size=4, seed=3, target_layers=[0, 2])
    return folder


def _engine(model: Path, **options: Any) -> Engine:
    settings: dict[str, Any] = {
        "prefill_chunk": CHUNK,
        "prefix_cache_bytes": 0,
        "dtype": "float32",
        **options,
    }
    return closed_after_test(Engine.load(str(model), EngineOptions(**settings)))


def _drafting(model: Path, kind: str, **options: Any) -> Engine:
    policy = DraftPolicy(min_acceptance=0.0, max_batch=64, only_likely=False)
    speculation = "mtp" if kind == "mtp" else "draft_model"
    return _engine(model, speculation=speculation, draft_policy=policy, **options)


@pytest.fixture(params=["mtp", "dflash"])
def drafting(request: pytest.FixtureRequest, mtp_model: Path, dflash_model: Path) -> tuple[str, Path]:
    return request.param, mtp_model if request.param == "mtp" else dflash_model


def _own_features(draft: MtpDraft | DFlashDraft, tokens: Sequence[int]) -> np.ndarray:
    """What the drafter's own forward over `tokens` computes (1, L, features)."""
    out = draft.features(list(tokens))
    return np.array(out if isinstance(out, mx.array) else mx.concatenate(out, axis=1))


@pytest.mark.parametrize("pad_shapes", [False, True], ids=["exact", "padded"])
def test_a_tapped_prefill_hands_the_features_the_drafters_own_forward_computes(
    drafting: tuple[str, Path], pad_shapes: bool
) -> None:
    """Alone in chunks (a prompt over two chunks long) and several prompts in one forward: each
    prompt's tapped features are the drafter's own forward's, and the logits plain prefill's."""
    kind, model = drafting
    engine = _drafting(model, kind)
    draft = engine.draft_choice.draft
    assert isinstance(draft, MtpDraft | DFlashDraft)
    target, taps = engine.model, engine.draft_taps
    prompts = [list(range(3, 3 + n)) for n in (2 * CHUNK + 5, 7, 12)]

    run = ChunkedPrefill(target, prompts[0], target.make_cache(), CHUNK, pad_shapes, taps=taps)
    parts = []
    while (logits := run.advance()) is None:
        assert run.tapped is not None and run.tapped_from == len(parts) * CHUNK
        parts.append(run.tapped)
    assert run.tapped is not None
    parts.append(run.tapped)
    got = np.array(mx.concatenate(parts, axis=1))
    np.testing.assert_allclose(got, _own_features(draft, prompts[0]), atol=1e-5, rtol=1e-5)
    plain = prefill(target, prompts[0], target.make_cache(), CHUNK, pad_shapes)
    np.testing.assert_allclose(np.array(logits), np.array(plain), atol=1e-5, rtol=1e-5)

    short = prompts[1:]
    tapped = LayerTaps(taps)
    _, logits = prefill_rows_layers(target, [(p, target.make_cache()) for p in short], pad_shapes, tapped)
    features = tapped.features()
    _, plain = prefill_rows_layers(target, [(p, target.make_cache()) for p in short], pad_shapes)
    np.testing.assert_allclose(np.array(logits), np.array(plain), atol=1e-5, rtol=1e-5)
    for i, p in enumerate(short):
        row = np.array(features[i : i + 1, -len(p) :])
        np.testing.assert_allclose(row, _own_features(draft, p), atol=1e-5, rtol=1e-5)


@contextmanager
def _counting_own_forwards(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, int]]]:
    """At each proposal: the drafter's tokens, the positions it took from the batch, the tokens its own
    target forwards fed (the target's `hidden` counted while the drafter proposes) and whether the
    features it holds are its own forward's (checked outside the count)."""
    draft = engine.draft_choice.draft
    assert isinstance(draft, MtpDraft | DFlashDraft)
    model_class = type(engine.model)
    hidden = model_class.hidden
    fed: list[int] = []
    inside = [False]

    def counting(self: Any, inputs: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        if inside[0]:
            fed.append(int(inputs.shape[1]))
        return hidden(self, inputs, *args, **kwargs)

    proposals: list[dict[str, int]] = []
    # an MTP row's features are prepared by its drafter (`to_enter`) for the rows drafting together
    drafter_class: Any = MtpDrafter if isinstance(draft, MtpDraft) else DFlashDrafter
    method = "to_enter" if isinstance(draft, MtpDraft) else "propose"
    propose = getattr(drafter_class, method)

    def watched(self: Any, tokens: Sequence[int], *depth: int) -> Any:
        first = (self.entries if isinstance(self, MtpDrafter) else self.cached) == 0
        if first and (not depth or depth[0] > 0) and not self.lost:
            held = self.held.take(len(self.held))
            if held is not None:  # the features the batch handed are those of the row's own forward
                self.held.put_first(held)
                n = min(held.shape[1], len(tokens) - 1 - self.unseen)  # positions fed and kept
                want = _own_features(draft, list(tokens)[: self.unseen + n])[:, self.unseen :]
                np.testing.assert_allclose(np.array(held[:, :n]), want, atol=1e-5, rtol=1e-5)
            unseen, before = self.unseen, len(fed)
            inside[0] = True
            try:
                out = propose(self, tokens, *depth)
            finally:
                inside[0] = False
            taken = held.shape[1] if held is not None else 0
            proposals.append(
                {"prompt": len(tokens), "unseen": unseen, "taken": taken, "own": sum(fed[before:])}
            )
            return out
        return propose(self, tokens, *depth)

    monkeypatch.setattr(model_class, "hidden", counting)
    monkeypatch.setattr(drafter_class, method, watched)
    yield proposals


def _requests(engine: Engine) -> list[GenerateRequest]:
    """Prompts of one forward together and prompts over a chunk long (prefilled alone, in chunks)."""
    no_eos = {i: -100.0 for i in engine.tokenizer.eos_ids}
    prompts = [PROMPT + "#0", PROMPT * 4 + "#1", "Hi #2", PROMPT * 3 + "#3"]
    return [GenerateRequest(prompt=p, max_tokens=8, temperature=0, logit_bias=no_eos) for p in prompts]


def test_a_row_prefilled_by_the_batch_makes_no_target_forward_of_its_own(
    drafting: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    kind, model = drafting
    plain = _engine(model)
    requests = _requests(plain)
    lengths = [len(plain.tokenizer.encode(r.prompt)) for r in requests]
    assert max(lengths) > 2 * CHUNK and min(lengths) < CHUNK
    spec = _drafting(model, kind)
    expected = run_requests(plain, requests, 4)
    with _counting_own_forwards(spec, monkeypatch) as proposals:
        got = run_requests(spec, requests, 4)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert len(proposals) == len(requests)  # each row's first proposal
    for p in proposals:
        assert p["own"] == 0 and p["unseen"] == 0 and p["taken"] >= p["prompt"] - 1


def test_a_row_restored_from_the_prefix_cache_computes_only_what_was_not_prefilled(
    drafting: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second of two jobs with one long prompt finds most of it in the prefix cache: its drafter's
    own forward feeds that cached prefix only, the batch's prefill handing it the rest."""
    kind, model = drafting
    plain = _engine(model)
    request = _requests(plain)[1]
    spec = _drafting(model, kind, prefix_cache_bytes=1 << 26)
    expected = run_requests(plain, [request], 1)
    with _counting_own_forwards(spec, monkeypatch) as proposals:
        first = run_requests(spec, [request], 1)
        second = run_requests(spec, [request], 1)
    assert first[0].token_ids == second[0].token_ids == expected[0].token_ids
    assert len(proposals) == 2
    assert proposals[0]["own"] == 0 and proposals[0]["unseen"] == 0
    restored = proposals[1]
    assert restored["unseen"] > 0 and restored["taken"] > 0
    assert restored["unseen"] + restored["taken"] >= restored["prompt"] - 1
    assert restored["own"] == restored["unseen"]
