"""The MTP drafter against transformers' `MtpModel`, and end to end in generation batches.

A tiny random DeepSeek-V3 (transformers) with one MTP layer, its weights written into the checkpoint as
DeepSeek-V3's are (`model.layers.N.enorm`, `.hnorm`, `.eh_proj`, `.shared_head.norm`, the decoder
layer's own): the MLX drafter's logits match `MtpModel`'s forward (float32, 1e-4) from a prompt and
again after more tokens, its proposal is their argmax, and in a generation batch greedy output is plain
decoding's while drafts are kept and rolled back.

Random weights rarely agree: the final norms of target and MTP layer are narrowed to one feature (as in
`test_dflash.py`), so both pick one of the same two tokens and drafts are often kept.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from engines import assert_same_draws, closed_after_test, run_requests
from reference import load_hf_model, make_hf_checkpoint
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3ForCausalLM
from transformers.cache_utils import MtpCache
from transformers.modeling_layers import MtpModel

from mlxq.jobs.schema import GenerateRequest, GenerateResult
from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.engine.errors import CheckpointError
from mlxq.worker.engine.models.loader import load_model
from mlxq.worker.engine.speculation.drafter import RowToDraft
from mlxq.worker.engine.speculation.mtp import MtpDraft
from mlxq.worker.engine.speculation.mtp_batch import MtpBatch, ShiftedCache
from mlxq.worker.engine.speculation.policy import DraftPolicy
from mlxq.worker.engine.text.tokenizer import Tokenizer
from mlxq.worker.modelfiles.tiny_model import write_random_checkpoint
from tests.engine.test_models import DEEPSEEK_V3

PROMPT = "The capital of France is Paris. "


def _write_mtp(folder: Path, main: Any) -> Any:
    """A random MTP layer for `main`, written into its checkpoint as DeepSeek-V3's; returns the
    reference `MtpModel` holding the same weights."""
    ref = MtpModel(main, 1).eval()
    torch.manual_seed(11)
    with torch.no_grad():
        for name, p in [*ref.named_parameters(), *ref.named_buffers()]:
            if not name.startswith("layers."):
                continue  # the target's embedding and head
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "e_score_correction_bias" in name:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    n = main.config.num_hidden_layers
    path = folder / "model.safetensors"
    weights = load_file(str(path))
    for name, p in ref.state_dict().items():
        if not name.startswith("layers.0."):
            continue
        rest = name[len("layers.0.") :].removeprefix("mtp_block.").replace("post_norm.", "shared_head.norm.")
        value = p.detach().clone().contiguous()
        if rest == "mlp.experts.gate_up_proj":  # (experts, 2 * inter, hidden), stored per expert
            inter = value.shape[1] // 2
            for e in range(value.shape[0]):
                weights[f"model.layers.{n}.mlp.experts.{e}.gate_proj.weight"] = value[e, :inter].contiguous()
                weights[f"model.layers.{n}.mlp.experts.{e}.up_proj.weight"] = value[e, inter:].contiguous()
        elif rest == "mlp.experts.down_proj":
            for e in range(value.shape[0]):
                weights[f"model.layers.{n}.mlp.experts.{e}.down_proj.weight"] = value[e].contiguous()
        else:
            weights[f"model.layers.{n}.{rest}"] = value
    save_file(weights, str(path), metadata={"format": "pt"})
    return ref


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """(checkpoint folder with an MTP layer, transformers' model, its `MtpModel`)."""
    folder = make_hf_checkpoint(
        tmp_path_factory.mktemp("deepseek"), "DeepseekV3ForCausalLM", **DEEPSEEK_V3, num_mtp_layers=1
    )
    main = load_hf_model(folder)
    return folder, main, _write_mtp(folder, main)


def _ref_logits(main: Any, ref: Any, ids: list[int], lo: int, hi: int, cache: Any) -> np.ndarray:
    """`MtpModel`'s logits at position hi - 1, fed tokens lo..hi - 1 with the hidden states before them."""
    with torch.no_grad():
        hidden = main(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1]
        _, logits, _ = ref(
            input_ids=torch.tensor([ids[lo:hi]]),
            last_hidden_states=hidden[:, lo - 1 : hi - 1],
            attention_mask=None,
            position_ids=torch.arange(lo, hi)[None],
            mtp_cache=cache,
        )
    return logits[0, -1].float().numpy()


def test_the_mtp_weights_as_written_are_what_transformers_loads(
    reference: tuple[Path, Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The test checkpoint's MTP layout is the one transformers reads (`MtpModel.from_pretrained`; its
    DeepSeek-V3 finds MTP weights by a pattern naming layer 61, the real model's, pointed here at this
    model's layer)."""
    folder, main, ref = reference
    layer = main.config.num_hidden_layers
    monkeypatch.setattr(
        DeepseekV3ForCausalLM, "_keys_to_ignore_on_load_unexpected", [rf"model\.layers\.{layer}\..*"]
    )
    loaded = MtpModel.from_pretrained(load_hf_model(folder)).state_dict()
    written = ref.state_dict()
    assert set(loaded) == set(written)
    assert all(torch.equal(loaded[k], written[k]) for k in written)


def test_mtp_logits_and_proposals_match_transformers(reference: tuple[Path, Any, Any]) -> None:
    folder, main, ref = reference
    model, _ = load_model(folder, dtype="float32")
    draft = MtpDraft.load(folder, model, prefill_chunk=5)
    ids = Tokenizer.from_dir(folder).encode(PROMPT * 2)
    n = len(ids) - 3
    cache = MtpCache(config=main.config.get_mtp_config())

    # from a prompt: every entry made at once from the drafter's own forward (chunks of 5)
    expected = _ref_logits(main, ref, ids[:n], 1, n, cache)
    out = draft.outputs(ids[1:n], draft.features(ids[: n - 1]), ShiftedCache())
    np.testing.assert_allclose(np.array(model.logits(out[0, -1])), expected, atol=1e-4, rtol=1e-4)
    drafter = draft.drafter()
    assert drafter.propose(ids[:n], 4) == [int(expected.argmax())]

    # three more tokens' hidden states, as a decode forward hands them (junk past them forgotten first)
    drafter.take_features(n - 1, draft.features(ids)[:, n - 1 :] * 0 + 5, ids[:n])
    drafter.take_features(n - 1, draft.features(ids)[:, n - 1 : n + 2], ids[: n + 2])
    # held, not entered, until a proposal needs them: a row kept from drafting pays no MTP forward
    assert drafter.entries == n - 1 and len(drafter.held) == 3
    expected = _ref_logits(main, ref, ids, n, n + 3, cache)
    assert drafter.propose(ids, 1) == [int(expected.argmax())]
    fresh = draft.outputs(ids[1:], draft.features(ids[:-1]), ShiftedCache())
    np.testing.assert_allclose(np.array(model.logits(fresh[0, -1])), expected, atol=1e-4, rtol=1e-4)


def _narrow(folder: Path, key: str, scale: float) -> None:
    path = folder / "model.safetensors"
    weights = load_file(str(path))
    norm = torch.zeros_like(weights[key])
    norm[5] = scale
    weights[key] = norm
    save_file(weights, str(path), metadata={"format": "pt"})


def _narrowed(reference: tuple[Path, Any, Any], out: Path, sign: float) -> Path:
    """The checkpoint with both final norms narrowed to one feature, the MTP's with `sign`."""
    folder = out / "model"
    shutil.copytree(reference[0], folder)
    _narrow(folder, "model.norm.weight", 100.0)
    layers = reference[1].config.num_hidden_layers
    _narrow(folder, f"model.layers.{layers}.shared_head.norm.weight", sign)
    return folder


@pytest.fixture(scope="module", params=[100.0, -100.0], ids=["agreeing", "disagreeing"])
def narrowed(
    reference: tuple[Path, Any, Any], tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Path:
    """Narrowed with the sign that makes MTP and target agree more often than not, or the other."""
    return _narrowed(reference, tmp_path_factory.mktemp("narrowed"), request.param)


@pytest.fixture(scope="module")
def agreeing(reference: tuple[Path, Any, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _narrowed(reference, tmp_path_factory.mktemp("agreeing"), 100.0)


def _engine(model: Path, **options: Any) -> Engine:
    settings: dict[str, Any] = {"prefill_chunk": 16, "prefix_cache_bytes": 0, "dtype": "float32", **options}
    return closed_after_test(Engine.load(str(model), EngineOptions(**settings)))


def _run(engine: Engine, requests: list[GenerateRequest], max_sequences: int) -> list[GenerateResult]:
    return run_requests(engine, requests, max_sequences)


GPU_WAYS = {"decode_overlap": True, "pad_shapes": True}  # steps launched on a thread, shapes padded


@pytest.mark.parametrize("ways", [{}, GPU_WAYS], ids=["plain", "gpu-ways"])
def test_greedy_generation_with_the_mtp_drafter_is_plain_decodings_and_its_context_is_its_rows(
    narrowed: Path, monkeypatch: pytest.MonkeyPatch, ways: dict[str, Any]
) -> None:
    """Rows joining and leaving, plain steps while more than two rows decode, verify steps (also with
    steps launched on a thread of their own and GPU shapes): greedy output is plain decoding's, and at
    every proposal of the rows drafting together each row's draft is what its tokens computed afresh
    give."""
    plain = _engine(narrowed, **ways)
    no_eos = {i: -100.0 for i in plain.tokenizer.eos_ids}
    requests = [
        GenerateRequest(
            prompt=PROMPT * (1 + i % 2) + f"#{i}", max_tokens=9 + 7 * i, temperature=0, logit_bias=no_eos
        )
        for i in range(4)
    ]
    policy = DraftPolicy(min_acceptance=0.0, max_batch=2, only_likely=False)
    spec = _engine(narrowed, speculation="mtp", draft_policy=policy, **ways)
    assert isinstance(spec.draft_choice.draft, MtpDraft) and spec.draft_taps == (-1,)
    draft = spec.draft_choice.draft
    checked: list[int] = []
    propose = MtpBatch.propose

    def checking(self: MtpBatch, rows: Sequence[RowToDraft]) -> list[list[int]]:
        out = propose(self, rows)
        for row, drafts in zip(rows, out, strict=True):
            if row.depth <= 0:
                assert drafts == []
                continue
            tokens = list(row.tokens)
            fresh = draft.outputs(tokens[1:], draft.features(tokens[:-1]), ShiftedCache())
            assert drafts == [int(np.array(draft.target.logits(fresh[0, -1])).argmax())]
            checked.append(len(tokens))
        return out

    monkeypatch.setattr(MtpBatch, "propose", checking)
    for rows in (1, 3):
        expected = _run(plain, requests, max_sequences=rows)
        got = _run(spec, requests, max_sequences=rows)
        for a, b in zip(expected, got, strict=True):
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        drafted = sum(r.usage.draft_tokens for r in got)
        kept = sum(r.usage.accepted_tokens for r in got)
        assert 0 < kept < drafted
    assert len(checked) > 10


def test_sampled_generation_with_the_mtp_drafter_follows_plain_decodings_distribution(agreeing: Path) -> None:
    """The first tokens of many seeded draws, with and without the drafter, come from one distribution
    (a two-sample chi-square test over the plain draws' three commonest tokens and the rest)."""
    plain = _engine(agreeing)
    spec = _engine(agreeing, speculation="mtp", draft_policy=DraftPolicy(min_acceptance=0.0, max_batch=64))
    n, tokens = 160, 4
    no_eos = {i: -100.0 for i in plain.tokenizer.eos_ids}
    base = dict(prompt=PROMPT, max_tokens=tokens, temperature=1.0, logit_bias=no_eos)
    requests = [GenerateRequest.model_validate({**base, "seed": s}) for s in range(n)]
    runs, drafted, kept = [], 0, 0
    for engine in (plain, spec):
        results = _run(engine, requests, max_sequences=32)
        runs.append([r.token_ids for r in results])
        drafted = sum(r.usage.draft_tokens for r in results)
        kept = sum(r.usage.accepted_tokens for r in results)
    assert drafted > n and kept > n // 4, (drafted, kept)  # drafts tested, and often kept
    assert_same_draws(runs, tokens)


def test_a_target_without_an_mtp_layer_it_can_draft_with_is_refused_clearly(
    reference: tuple[Path, Any, Any], tmp_path: Path
) -> None:
    folder = tmp_path / "model"
    shutil.copytree(reference[0], folder)
    weights = load_file(str(folder / "model.safetensors"))
    layers = reference[1].config.num_hidden_layers
    kept = {k: v for k, v in weights.items() if not k.startswith(f"model.layers.{layers}.eh_proj")}
    save_file(kept, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"MTP layer .* lacks weights it needs"):
        _engine(folder, speculation="mtp")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(CheckpointError, match="has no MTP layer"):
        _engine(folder, speculation="mtp")
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 2}))
    with pytest.raises(CheckpointError, match="has 2 MTP layers; mlxq drafts with one"):
        _engine(folder, speculation="mtp")
    llama = write_random_checkpoint(tmp_path / "llama", {"num_nextn_predict_layers": 1})
    with pytest.raises(CheckpointError, match="implemented for DeepSeek-V3's layers"):
        _engine(llama, speculation="mtp")


def test_the_benchmarks_mtp_shape_is_drawn_with_a_layer_the_engine_drafts_with(tmp_path: Path) -> None:
    """The speculation figure's MTP rows run on a DeepSeek-V3-layout checkpoint drawn from the model's
    own tensors plus its MTP layer's (`bench.checkpoints.draw_checkpoint`): it loads, its MTP layer
    drafts, and greedy output is plain decoding's."""
    from bench.checkpoints import checkpoint

    folder = checkpoint("tiny-deepseek-mtp", tmp_path)
    plain = _engine(folder)
    policy = DraftPolicy(min_acceptance=0.0, max_batch=4, only_likely=False)
    spec = _engine(folder, speculation="mtp", draft_policy=policy)
    assert isinstance(spec.draft_choice.draft, MtpDraft)
    no_eos = {i: -100.0 for i in plain.tokenizer.eos_ids}
    requests = [
        GenerateRequest(prompt=PROMPT * (1 + i), max_tokens=10, temperature=0, logit_bias=no_eos)
        for i in range(2)
    ]
    expected, got = _run(plain, requests, max_sequences=2), _run(spec, requests, max_sequences=2)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert sum(r.usage.draft_tokens for r in got) > 0
