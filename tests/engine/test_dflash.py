"""The DFlash drafter against the `dflash` package's torch reference, and end to end in generation batches.

A tiny random Qwen3 target (transformers) and a tiny random DFlash draft written by the package's own
`DFlashDraftModel`: the block logits the MLX drafter computes from its cache match the package's forward
(float32, 1e-4), from a prompt and again after more tokens' features arrived, and its greedy proposal is
the package's. In a generation batch the drafter leaves greedy output as plain decoding gives it, alone
and beside rows of other prompts, and sampled output follows plain decoding's distribution.

Random weights rarely agree: the final norms of target and draft are narrowed to one feature (the
draft's with the sign that makes the two agree more often than not, and large, so sampled draws keep
near those tokens too), so both pick one of the same two tokens at every greedy position and drafts are
often kept (the paths that keep and roll back are both taken).

The reference is installed with `pip install --no-deps dflash==0.1.0` (its pins on datasets, requests and
tqdm would replace the project's); without it these tests are skipped.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from engines import assert_same_draws, closed_after_test, run_requests
from reference import load_hf_model, make_hf_checkpoint, randomize
from safetensors.numpy import load_file, save_file

from mlxq.jobs.schema import GenerateRequest, GenerateResult
from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.engine.errors import CheckpointError
from mlxq.worker.engine.models.loader import load_model
from mlxq.worker.engine.speculation.dflash import (
    DFlashDraft,
    DFlashDrafter,
    default_target_layers,
    write_random_draft,
)
from mlxq.worker.engine.speculation.draft_model import DraftMismatch, DraftTarget, load_draft
from mlxq.worker.engine.speculation.policy import DraftPolicy
from mlxq.worker.engine.text.tokenizer import Tokenizer

try:  # the reference: the parity tests need it; the batch tests run without it
    import dflash.model as dflash_model
except ImportError:
    dflash_model = None
needs_package = pytest.mark.skipif(dflash_model is None, reason="the dflash package is not installed")

TARGET_LAYERS = 4
TAPS = [0, 2]
BLOCK = 6
PROMPT = "The capital of France is Paris. "


def _write_draft(out: Path, target: Path, **dflash: Any) -> Path:
    """A random DFlash draft for `target`, written by the package's `DFlashDraftModel`."""
    target_config = json.loads((target / "config.json").read_text())
    mask = target_config["vocab_size"] - 1
    config = transformers.Qwen3Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=target_config["vocab_size"],
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        num_target_layers=TARGET_LAYERS,
        dflash_config={"target_layer_ids": TAPS, "mask_token_id": mask, "block_size": BLOCK, **dflash},
    )
    config.architectures = ["DFlashDraftModel"]
    torch.manual_seed(7)
    model = dflash_model.DFlashDraftModel(config)
    randomize(model)
    model.to(torch.float32).save_pretrained(out)
    return out


def _narrow_final_norm(folder: Path, key: str, scale: float) -> None:
    """A checkpoint's final norm zero but for one feature (`scale`): its argmax is one of two tokens."""
    path = folder / "model.safetensors"
    weights = load_file(str(path))
    norm = np.zeros_like(weights[key])
    norm[5] = scale
    weights[key] = norm
    save_file(weights, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint(
        tmp_path_factory.mktemp("target"), "Qwen3ForCausalLM", num_hidden_layers=TARGET_LAYERS
    )


@pytest.fixture(scope="module", params=["package", "mlxq"])
def draft(target: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """A random DFlash draft written by the package's classes, or by mlxq's `write_random_draft` (the
    benchmark's: the package reads it as its own)."""
    out = tmp_path_factory.mktemp(f"draft-{request.param}")
    if request.param == "package":
        if dflash_model is None:
            pytest.skip("the dflash package is not installed")
        return _write_draft(out, target)
    config = json.loads((target / "config.json").read_text())
    return write_random_draft(out, config, layers=2, block_size=BLOCK, seed=3, target_layers=TAPS, std=0.2)


@pytest.fixture(scope="module")
def agreeing(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A target with its DFlash draft in `draft/` beside it, both final norms narrowed to one feature."""
    folder = tmp_path_factory.mktemp("agreeing") / "model"
    shutil.copytree(target, folder)
    _narrow_final_norm(folder, "model.norm.weight", 100.0)
    config = json.loads((target / "config.json").read_text())
    write_random_draft(
        folder / "draft", config, layers=2, block_size=BLOCK, seed=7, target_layers=TAPS, std=0.2
    )
    _narrow_final_norm(folder / "draft", "norm.weight", 100.0)
    return folder


def _mlx_draft(target: Path, draft: Path) -> DFlashDraft:
    model, _ = load_model(target, dtype="float32")
    loaded = load_draft(draft, DraftTarget(model, Tokenizer.from_dir(target), "float32", prefill_chunk=5))
    assert isinstance(loaded, DFlashDraft)
    return loaded


def _package_block_logits(
    hf: Any, pkg: Any, ids: list[int], start: int, context: tuple[int, int], cache: Any
) -> np.ndarray:
    """The package's draft logits for the block at `start` (its token ids[start], then mask tokens),
    fed the target's features of positions context[0]..context[1] - 1 (as `dflash_generate` does)."""
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
        features = dflash_model.extract_context_feature(out.hidden_states, pkg.target_layer_ids)
        target_hidden = features[:, context[0] : context[1]]
        block = torch.tensor([[ids[start]] + [pkg.mask_token_id] * (BLOCK - 1)])
        noise = hf.get_input_embeddings()(block)
        positions = torch.arange(context[0], start + BLOCK)[None]
        hidden = pkg(
            target_hidden=target_hidden,
            noise_embedding=noise,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        )[:, 1 - BLOCK :, :]
        dflash_model._crop_to(cache, start)  # as `dflash_generate` keeps the context only
        return pkg.compute_logits(hidden, hf.lm_head)[0].numpy()


@needs_package
def test_block_logits_and_proposals_match_the_package(target: Path, draft: Path) -> None:
    hf = load_hf_model(target)
    pkg = dflash_model.DFlashDraftModel.from_pretrained(str(draft), dtype=torch.float32).eval()
    ours = _mlx_draft(target, draft)
    assert ours.taps == tuple(TAPS) and ours.max_depth == BLOCK - 1
    tokenizer = Tokenizer.from_dir(target)
    ids = tokenizer.encode(PROMPT * 2)
    n = len(ids) - 4
    cache = dflash_model._make_cache(pkg.config)

    # from a prompt: its context by the drafter's own forward (in chunks of 5), then the block
    expected = _package_block_logits(hf, pkg, ids[: n + 1], n, (0, n), cache)
    drafter = ours.drafter()
    proposal = drafter.propose(ids[: n + 1], BLOCK - 1)
    got = np.array(ours.block_logits(ids[n], drafter.cache))
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)
    assert proposal == expected.argmax(-1).tolist()
    assert drafter.propose(ids[: n + 1], 2) == proposal[:2]

    # three more tokens' features, as a decode forward hands them (junk past them, forgotten first)
    junk = mx.zeros((1, 2, len(TAPS) * 64))
    drafter.take_features(n, junk, ids)
    features = mx.concatenate(ours.features(ids), axis=1)
    drafter.take_features(n, features[:, n : n + 3], ids)
    # held, not remembered, until a proposal needs them: a row kept from drafting pays no draft work
    assert (drafter.cached, drafter.known) == (n, n + 3)
    expected = _package_block_logits(hf, pkg, ids, n + 3, (n, n + 3), cache)
    assert drafter.propose(ids, BLOCK - 1) == expected.argmax(-1).tolist()
    assert drafter.cached == n + 3
    got = np.array(ours.block_logits(ids[n + 3], drafter.cache))
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)


@needs_package
def test_the_default_target_layers_are_the_packages() -> None:
    for layers, draft_layers in [(36, 5), (28, 1), (4, 2), (64, 8)]:
        assert default_target_layers(layers, draft_layers) == dflash_model.build_target_layer_ids(
            layers, draft_layers
        )


def test_a_draft_that_does_not_fit_or_asks_for_more_is_refused_clearly(
    target: Path, draft: Path, tmp_path: Path
) -> None:
    model, _ = load_model(target, dtype="float32")
    bound = DraftTarget(model, Tokenizer.from_dir(target))
    config = json.loads((draft / "config.json").read_text())

    def edited(**changes: Any) -> Path:
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        shutil.copytree(draft, folder)
        (folder / "config.json").write_text(json.dumps({**config, **changes}))
        return folder

    with pytest.raises(DraftMismatch, match="made for a target of 6 layers"):
        load_draft(edited(num_target_layers=6), bound)
    taps_last = {**config["dflash_config"], "target_layer_ids": [0, 3]}
    with pytest.raises(DraftMismatch, match=r"reads target layers \[0, 3\]"):
        load_draft(edited(dflash_config=taps_last), bound)
    two = {**config["dflash_config"], "conv_kernel_size": 4, "selector_rank": 8}
    with pytest.raises(CheckpointError, match="conv_kernel_size, selector_rank"):
        load_draft(edited(dflash_config=two), bound)
    with pytest.raises(CheckpointError, match="layer_types"):
        load_draft(edited(layer_types=["sliding_attention", "full_attention"], sliding_window=4), bound)
    with pytest.raises(DraftMismatch, match=r"cannot draft with; supported: .*DFlashDraftModel"):
        load_draft(edited(architectures=["DFlash2DraftModel"]), bound)


def _engine(model: Path, **options: Any) -> Engine:
    settings: dict[str, Any] = {"prefill_chunk": 16, "prefix_cache_bytes": 0, "dtype": "float32", **options}
    return closed_after_test(Engine.load(str(model), EngineOptions(**settings)))


def _drafting(model: Path, **options: Any) -> Engine:
    policy = DraftPolicy(min_acceptance=0.0, max_batch=64, only_likely=False)
    return _engine(model, speculation="draft_model", draft_policy=policy, **options)


def _run(engine: Engine, requests: list[GenerateRequest], max_sequences: int) -> list[GenerateResult]:
    return run_requests(engine, requests, max_sequences)


def _no_eos(engine: Engine) -> dict[int, float]:
    return {i: -100.0 for i in engine.tokenizer.eos_ids}


def _greedy(engine: Engine) -> list[GenerateRequest]:
    return [
        GenerateRequest(
            prompt=PROMPT * (1 + i % 2) + f"#{i}",
            max_tokens=9 + 7 * i,
            temperature=0,
            logit_bias=_no_eos(engine),
        )
        for i in range(4)
    ]


def test_greedy_generation_with_the_dflash_drafter_is_plain_decodings_alone_and_in_a_batch(
    agreeing: Path,
) -> None:
    plain = _engine(agreeing)
    requests = _greedy(plain)
    spec = _drafting(agreeing)  # the draft/ folder beside the target
    assert spec.draft_taps == tuple(TAPS)
    # with the prefix cache, prompts prefill from cached prefixes (the drafter's context still whole)
    cached = _drafting(agreeing, prefix_cache_bytes=1 << 26)
    for rows, engine in ((1, spec), (3, spec), (3, cached)):
        expected = _run(plain, requests, max_sequences=rows)
        got = _run(engine, requests, max_sequences=rows)
        for a, b in zip(expected, got, strict=True):
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        drafted = sum(r.usage.draft_tokens for r in got)
        kept = sum(r.usage.accepted_tokens for r in got)
        assert 0 < kept < drafted  # drafts kept and drafts rolled back


def test_a_dflash_draft_named_by_the_setting_with_the_real_weights_leaves_output_unchanged(
    target: Path, draft: Path
) -> None:
    """The draft as the package wrote it (random: its drafts are seldom kept), a job that turns drafting
    off beside drafting rows: greedy output as plain decoding's."""
    plain = _engine(target)
    requests = _greedy(plain)
    requests[1] = requests[1].model_copy(update={"max_draft_tokens": 0})
    spec = _drafting(target, draft_model=str(draft))
    expected = _run(plain, requests, max_sequences=4)
    got = _run(spec, requests, max_sequences=4)
    for a, b in zip(expected, got, strict=True):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
    assert got[1].usage.draft_tokens == 0 and got[0].usage.draft_tokens > 0


def test_sampled_generation_with_the_dflash_drafter_follows_plain_decodings_distribution(
    agreeing: Path,
) -> None:
    """The first tokens of many seeded draws, with and without the drafter, come from one distribution
    (a two-sample chi-square test), and drafts were kept."""
    plain = _engine(agreeing)
    spec = _drafting(agreeing)
    n, tokens = 160, 4
    base = dict(prompt=PROMPT, max_tokens=tokens, temperature=1.0, logit_bias=_no_eos(plain))
    requests = [GenerateRequest.model_validate({**base, "seed": s}) for s in range(n)]
    runs, accepted = [], 0
    for engine in (plain, spec):
        results = _run(engine, requests, max_sequences=32)
        runs.append([r.token_ids for r in results])
        accepted = sum(r.usage.accepted_tokens for r in results)
    assert accepted > n // 4
    assert_same_draws(runs, tokens)


GPU_WAYS = {"decode_overlap": True, "pad_shapes": True}  # steps launched on a thread, shapes padded


@pytest.mark.parametrize("ways", [{}, GPU_WAYS], ids=["plain", "gpu-ways"])
def test_the_features_a_batch_hands_its_rows_are_those_of_the_rows_tokens(
    agreeing: Path, monkeypatch: pytest.MonkeyPatch, ways: dict[str, Any]
) -> None:
    """At every proposal in a batch (rows joining and leaving, plain steps while more than two rows
    decode, verify steps keeping some drafts, a constrained row's forwards launched ahead; with steps
    launched on a thread of their own and shapes padded as on a GPU), the drafter's context gives the
    block logits that the row's tokens' features computed afresh give: the features it was handed are
    its row's. Every row's output is plain decoding's."""
    plain = _engine(agreeing, **ways)
    spec = _engine(
        agreeing,
        speculation="draft_model",
        draft_policy=DraftPolicy(min_acceptance=0.0, max_batch=2, only_likely=False),
        **ways,
    )
    assert isinstance(spec.draft_choice.draft, DFlashDraft)
    draft = spec.draft_choice.draft
    checked: list[int] = []
    propose = DFlashDrafter.propose

    def checking(self: DFlashDrafter, tokens: Sequence[int], depth: int) -> list[int]:
        out = propose(self, tokens, depth)
        fresh = draft.drafter()
        propose(fresh, list(tokens), 1)  # its context from a forward over the row's tokens
        np.testing.assert_allclose(
            np.array(draft.block_logits(tokens[-1], self.cache)),
            np.array(draft.block_logits(tokens[-1], fresh.cache)),
            atol=1e-4,
            rtol=1e-4,
        )
        checked.append(len(tokens))
        return out

    regex = {"type": "regex", "regex": "[a-z ]{12}"}
    requests = [
        *_greedy(spec),
        GenerateRequest(prompt=PROMPT, max_tokens=20, temperature=0, response_format=regex),
    ]
    expected = _run(plain, requests, max_sequences=3)
    monkeypatch.setattr(DFlashDrafter, "propose", checking)
    got = _run(spec, requests, max_sequences=3)
    for a, b in zip(expected, got, strict=True):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
    assert sum(r.usage.accepted_tokens for r in got) > 0
    assert len(checked) >= 8 and max(checked) > min(checked) + 20
