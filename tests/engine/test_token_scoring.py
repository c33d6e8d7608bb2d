"""Continuations, rolling loglikelihood and prompt logprobs, proven against transformers (float32), for
Llama and for Gemma 3 with sliding windows.

The reference side tokenizes with transformers' own tokenizer the way lm-evaluation-harness' HF backend
does, and takes log-softmax of transformers' logits over the whole sequence; mlxq's side goes through
`Engine.score` (radix tree, batch-1 shared spans, padded suffix batches, chunked LM head).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from reference import load_hf_model, make_hf_checkpoint

from mlxq.jobs.errors import InvalidRequest
from mlxq.jobs.schema import ScoreRequest
from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.engine.eval_tokens import rolling_windows

FEW_SHOT = "Question: what do queues hold? Answer: jobs.\n" * 4


# Llama, and Gemma 3 with sliding windows far shorter than the prompts (rows over a shared prefix,
# rolling windows: every scoring path's masks narrowed)
CHECKPOINTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", {}),
    "gemma3-window": (
        "Gemma3ForCausalLM",
        {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"], "head_dim": 32},
    ),
}


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, overrides = CHECKPOINTS[request.param]
    return make_hf_checkpoint(tmp_path_factory.mktemp("hf"), arch, max_position_embeddings=128, **overrides)


@pytest.fixture(scope="module")
def hf(checkpoint: Path) -> tuple[Any, Any]:
    return load_hf_model(checkpoint), transformers.AutoTokenizer.from_pretrained(str(checkpoint))


def _logprobs(model: Any, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def _hf_continuation(hf: tuple[Any, Any], context: str, continuation: str) -> tuple[list[float], bool]:
    """lm-eval's HF-backend loglikelihood, written out from its definition."""
    model, tok = hf
    if context == "":
        ctx = [tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id]
        cont = tok.encode(continuation)
    else:
        stripped = context.rstrip()
        continuation = context[len(stripped) :] + continuation
        ctx = tok.encode(stripped)
        cont = tok.encode(stripped + continuation)[len(ctx) :]
    seq = ctx + cont
    lp = _logprobs(model, seq[:-1])[len(ctx) - 1 :]
    token_lp = [float(lp[i, t]) for i, t in enumerate(cont)]
    return token_lp, all(int(lp[i].argmax()) == t for i, t in enumerate(cont))


@pytest.mark.parametrize("options", [{}, {"prefill_chunk": 8}], ids=["plain", "small-chunks"])
def test_continuations_match_transformers(
    checkpoint: Path, hf: tuple[Any, Any], options: dict[str, Any]
) -> None:
    engine = Engine.load(str(checkpoint), EngineOptions(**options))
    rows = [
        {
            "prompt": FEW_SHOT + "Question: what do workers run? Answer:",
            "continuations": [" jobs", " models run", " x"],
        },
        {
            "prompt": FEW_SHOT + "Question: where is Paris? Answer: ",
            "continuations": ["France.", "in the sky"],
        },
        {"prompt": "", "continuations": ["Hello world"]},
        {"prompt": "Short", "continuations": [" one", " one two"]},
    ]
    got = engine.score(ScoreRequest.model_validate({"rows": rows}))
    for row, scored in zip(rows, got.rows, strict=True):
        assert scored.continuations is not None
        for cont, result in zip(row["continuations"], scored.continuations, strict=True):
            want, greedy = _hf_continuation(hf, row["prompt"], cont)
            assert result.token_logprobs == pytest.approx(want, abs=1e-4)
            assert result.logprob == pytest.approx(sum(want), abs=1e-4)
            assert result.is_greedy == greedy
    # The few-shot prefix is computed once: the second question's continuations find it cached.
    assert got.rows[1].cached_tokens > len(FEW_SHOT) // 8
    assert got.input_tokens == sum(r.input_tokens for r in got.rows)


def test_a_greedy_continuation_is_reported_greedy(checkpoint: Path, hf: tuple[Any, Any]) -> None:
    model, tok = hf
    engine = Engine.load(str(checkpoint))
    prompt = "Question: what do queues hold?"
    ids = tok.encode(prompt)
    for _ in range(3):
        ids.append(int(_logprobs(model, ids)[-1].argmax()))
    greedy_text = tok.decode(ids[len(tok.encode(prompt)) :])
    got = engine.score(ScoreRequest(rows=[{"prompt": prompt, "continuations": [greedy_text]}]))  # type: ignore[list-item]
    want, greedy = _hf_continuation(hf, prompt, greedy_text)
    assert got.rows[0].continuations is not None
    assert got.rows[0].continuations[0].is_greedy == greedy
    assert got.rows[0].continuations[0].token_logprobs == pytest.approx(want, abs=1e-4)


def test_rolling_windows_are_lm_evals() -> None:
    utils = pytest.importorskip("lm_eval.utils")
    for n, window in [(1, 4), (5, 4), (4, 4), (17, 4), (30, 7), (9, 1)]:
        tokens = list(range(100, 100 + n))
        want = [
            utils.make_disjoint_window(w)
            for w in utils.get_rolling_token_windows(
                tokens, prefix_token=7, max_seq_len=window, context_len=1
            )
        ]
        assert list(rolling_windows(tokens, 7, window)) == want


def test_rolling_loglikelihood_matches_transformers(checkpoint: Path, hf: tuple[Any, Any]) -> None:
    model, tok = hf
    engine = Engine.load(str(checkpoint))
    text = "Queues hold jobs and workers run them, one after another, all day long. " * 6
    tokens = tok.encode(text)
    window = 32
    assert len(tokens) > 2 * window
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    want = 0.0
    for ctx, pred in rolling_windows(tokens, prefix, window):
        lp = _logprobs(model, (ctx + pred)[:-1])[len(ctx) - 1 :]
        want += sum(float(lp[i, t]) for i, t in enumerate(pred))
    got = engine.score(ScoreRequest(rows=[{"prompt": text, "rolling": True, "window": window}]))  # type: ignore[list-item]
    rolling = got.rows[0].rolling
    assert rolling is not None
    assert rolling.tokens == len(tokens)
    assert rolling.windows == -(-len(tokens) // window)
    assert rolling.logprob == pytest.approx(want, abs=1e-3)


def test_prompt_logprobs_with_top_k_and_chosen_ids(
    checkpoint: Path, hf: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tok = hf
    engine = Engine.load(str(checkpoint))
    import mlxq.worker.engine.token_scoring as ts

    original = ts.TokenScorer.__init__

    def small_head(self: ts.TokenScorer, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **{**kwargs, "head_chunk": 3})  # the LM head runs on 3 positions at a time

    head_rows: list[int] = []
    logits = engine.model.logits

    def recorded(hidden: Any) -> Any:
        head_rows.append(int(hidden.shape[0]))
        return logits(hidden)

    monkeypatch.setattr(ts.TokenScorer, "__init__", small_head)
    monkeypatch.setattr(engine.model, "logits", recorded)
    prompt = "Workers keep a model loaded and score rows by shared prefix."
    got = engine.score(
        ScoreRequest(
            rows=[{"prompt": prompt, "prompt_logprobs": True, "top_logprobs": 3, "token_ids": [5, 9]}]
        )  # type: ignore[list-item]
    ).rows[0]
    # Never a [prompt, vocab] block: every LM-head call saw at most a chunk of positions, all of them once.
    assert max(head_rows) == 3 and sum(head_rows) == len(tok.encode(prompt)) - 1
    ids = tok.encode(prompt)
    lp = _logprobs(model, ids)
    assert got.prompt_logprobs is not None
    assert got.prompt_logprobs.tokens == ids[1:]
    assert got.prompt_logprobs.token_logprobs == pytest.approx(
        [lp[i, t] for i, t in enumerate(ids[1:])], abs=1e-4
    )
    for i, top in enumerate(got.prompt_logprobs.top_logprobs):
        order = np.argsort(-lp[i])[:3]
        assert [t.id for t in top] == [int(t) for t in order]
        assert [t.logprob for t in top] == pytest.approx([lp[i, t] for t in order], abs=1e-4)
    assert got.prompt_logprobs.chosen_logprobs == [
        pytest.approx([lp[i, 5], lp[i, 9]], abs=1e-4) for i in range(len(ids) - 1)
    ]
    assert got.input_tokens == len(ids) - 1


def test_max_tokens_bounds_each_row_and_names_it(checkpoint: Path) -> None:
    engine = Engine.load(str(checkpoint))
    rows = [{"prompt": "Short", "prompt_logprobs": True}, {"prompt": FEW_SHOT, "continuations": [" yes"]}]
    n = len(engine.tokenizer.encode(FEW_SHOT + " yes"))
    with pytest.raises(InvalidRequest, match=rf"row 1: .* {n - 1} tokens .* max_tokens=10"):
        engine.score_tokens(ScoreRequest.model_validate({"rows": rows, "max_tokens": 10}))
    ok = engine.score(ScoreRequest.model_validate({"rows": rows, "max_tokens": n - 1}))
    assert ok.rows[1].continuations is not None
    with pytest.raises(InvalidRequest, match="more than the model's context of 128"):
        engine.score_tokens(ScoreRequest.model_validate({"rows": rows, "max_tokens": 129}))


def test_a_row_asks_exactly_one_thing() -> None:
    with pytest.raises(ValueError, match="exactly one of"):
        ScoreRequest.model_validate({"rows": [{"prompt": "a", "candidates": ["b"], "continuations": ["c"]}]})
    with pytest.raises(ValueError, match="exactly one of"):
        ScoreRequest.model_validate({"rows": [{"prompt": "a"}]})
    with pytest.raises(ValueError, match="belong to a `prompt_logprobs` row"):
        ScoreRequest.model_validate({"rows": [{"prompt": "a", "rolling": True, "top_logprobs": 2}]})


def test_a_kv_budget_splits_suffix_batches_and_changes_no_score(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlxq.worker.engine.token_scoring as ts

    sizes: list[int] = []
    original = ts.TokenScorer._batches

    def recorded(self: ts.TokenScorer, leaves: list[Any], prefix: int) -> list[list[Any]]:
        groups = original(self, leaves, prefix)
        sizes.extend(len(g) for g in groups)
        return groups

    monkeypatch.setattr(ts.TokenScorer, "_batches", recorded)
    rows = [
        {
            "prompt": FEW_SHOT + f"Question {i}: what do workers run? Answer:",
            "continuations": [" jobs", " models"],
        }
        for i in range(6)
    ]
    request = ScoreRequest.model_validate({"rows": rows})
    free = Engine.load(str(checkpoint), EngineOptions(prefix_cache_bytes=0)).score(request)
    free_sizes = list(sizes)
    sizes.clear()
    tight = Engine.load(str(checkpoint), EngineOptions(prefix_cache_bytes=0, score_kv_bytes=1)).score(request)
    assert max(free_sizes) > 1 and max(sizes) == 1
    for a, b in zip(free.rows, tight.rows, strict=True):
        assert a.continuations is not None and b.continuations is not None
        for x, y in zip(a.continuations, b.continuations, strict=True):
            assert x.token_logprobs == pytest.approx(y.token_logprobs, abs=1e-5)
    assert free.cached_tokens == tight.cached_tokens > 0


def test_an_empty_rolling_text_scores_nothing_and_an_empty_logprob_prompt_fails(checkpoint: Path) -> None:
    engine = Engine.load(str(checkpoint))
    got = engine.score(ScoreRequest.model_validate({"rows": [{"prompt": "", "rolling": True}]}))
    assert got.rows[0].rolling is not None
    assert (got.rows[0].rolling.logprob, got.rows[0].rolling.tokens, got.rows[0].rolling.windows) == (
        0.0,
        0,
        0,
    )
    with pytest.raises(InvalidRequest, match="row 0: the prompt is empty"):
        engine.score_tokens(ScoreRequest.model_validate({"rows": [{"prompt": "", "prompt_logprobs": True}]}))


def test_a_few_shot_prefix_is_shared_across_jobs_and_reused_from_the_prefix_cache(checkpoint: Path) -> None:
    engine = Engine.load(str(checkpoint))

    def job(i: int) -> ScoreRequest:
        prompt = FEW_SHOT + f"Question {i}: what runs? Answer:"
        return ScoreRequest.model_validate(
            {"rows": [{"prompt": prompt, "continuations": [" jobs", " models"]}]}
        )

    first, second = engine.score_many([engine.score_tokens(job(1)), engine.score_tokens(job(2))])
    shared = len(engine.tokenizer.encode(FEW_SHOT)) - 2  # its last tokens may merge with what follows
    assert first.cached_tokens >= shared  # its second continuation reuses what its first computed
    assert second.cached_tokens >= 2 * shared  # both continuations: the first job computed the prefix
    (again,) = engine.score_many([engine.score_tokens(job(3))])  # a later batch: the prefix cache has it
    assert again.cached_tokens >= 2 * shared
    alone = Engine.load(str(checkpoint), EngineOptions(prefix_cache_bytes=0)).score(job(3))
    assert alone.cached_tokens < again.cached_tokens
    for a, b in zip(again.rows[0].continuations or [], alone.rows[0].continuations or [], strict=True):
        assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-5)


def test_prompt_ids_token_texts_and_the_next_token(checkpoint: Path, hf: tuple[Any, Any]) -> None:
    """OpenAI's `echo` with `logprobs` asks this of a row: a prompt given as token ids (scored as they
    are), each token's text and offset, and the likeliest tokens after the prompt."""
    model, tok = hf
    engine = Engine.load(str(checkpoint))
    prompt = "Queues hold jobs, é and 🙂 too."
    ids = tok.encode(prompt)
    lp = _logprobs(model, ids)
    as_text = {"prompt": prompt, "prompt_logprobs": True, "top_logprobs": 2}
    as_ids = {
        "prompt_ids": ids,
        "prompt_logprobs": True,
        "top_logprobs": 2,
        "token_texts": True,
        "next_token": True,
    }
    request = ScoreRequest.model_validate({"rows": [as_text, as_ids], "add_special_tokens": True})
    text_row, ids_row = (r.prompt_logprobs for r in engine.score(request).rows)
    assert text_row is not None and ids_row is not None
    assert ids_row.tokens == text_row.tokens == ids[1:]
    assert ids_row.token_logprobs == pytest.approx(text_row.token_logprobs, abs=1e-5)
    assert ids_row.token_logprobs == pytest.approx([lp[i, t] for i, t in enumerate(ids[1:])], abs=1e-4)
    assert ids_row.first_token == ids[0] and text_row.first_token is None and text_row.texts is None
    assert ids_row.texts is not None and ids_row.offsets is not None
    assert "".join(ids_row.texts) == tok.decode(ids) and len(ids_row.texts) == len(ids)
    assert ids_row.offsets == [len("".join(ids_row.texts[:i])) for i in range(len(ids))]
    for top in ids_row.top_logprobs:
        assert all(t.text == tok.decode([t.id]) for t in top)
    assert all(t.text is None for top in text_row.top_logprobs for t in top)
    # The next token: the prompt's last position's alternatives, which the reference's full forward gives.
    with torch.no_grad():
        last = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1).numpy()
    assert ids_row.next_top is not None and len(ids_row.next_top) == 2
    assert ids_row.next_ends == (ids_row.next_top[0].id in engine.tokenizer.eos_ids)
    assert [t.id for t in ids_row.next_top] == [int(t) for t in np.argsort(-last)[:2]]
    assert [t.logprob for t in ids_row.next_top] == pytest.approx(
        [last[t.id] for t in ids_row.next_top], abs=1e-4
    )
    assert len(ids_row.top_logprobs) == len(ids) - 1  # the placeholder after the prompt is not a prompt token
    # What an older reader never asked for never reaches it: no new keys in a plain row's JSON.
    plain = engine.score(ScoreRequest.model_validate({"rows": [as_text]})).rows[0].model_dump(mode="json")
    assert set(plain["prompt_logprobs"]) == {"tokens", "token_logprobs", "top_logprobs", "chosen_logprobs"}
    assert set(plain["prompt_logprobs"]["top_logprobs"][0][0]) == {"id", "logprob"}


def test_prompt_ids_are_checked_and_belong_to_prompt_logprobs_rows(checkpoint: Path) -> None:
    engine = Engine.load(str(checkpoint))
    vocab = engine.model.args.vocab_size
    with pytest.raises(InvalidRequest, match=f"row 0: prompt token id {vocab} is not in the vocabulary"):
        engine.score_tokens(
            ScoreRequest.model_validate({"rows": [{"prompt_ids": [1, vocab], "prompt_logprobs": True}]})
        )
    with pytest.raises(ValueError, match="give the prompt once"):
        ScoreRequest.model_validate(
            {"rows": [{"prompt": "a", "prompt_ids": [1, 2], "prompt_logprobs": True}]}
        )
    with pytest.raises(ValueError, match="belong to a `prompt_logprobs` row"):
        ScoreRequest.model_validate({"rows": [{"prompt_ids": [1, 2], "continuations": ["b"]}]})
    one = engine.score(
        ScoreRequest.model_validate(
            {"rows": [{"prompt_ids": [5], "prompt_logprobs": True, "next_token": True}]}
        )
    )
    got = one.rows[0].prompt_logprobs
    assert got is not None and got.tokens == [] and got.next_top is not None and len(got.next_top) == 1
    assert one.rows[0].input_tokens == 1
