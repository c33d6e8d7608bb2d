"""Structured output on the engine (no Redis): `response_format` constrains generation batches.

A tiny random-weight model with a real (trained) tokenizer: its text is noise, so whatever parses
does so because of the constraint alone. Every answer that ends on its own validates against its
schema (the `jsonschema` library), matches its regex or its grammar; a constrained row in a batch
gets exactly what it gets alone (greedy, float32), beside free rows that get what they get alone.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import mlx.core as mx
import pytest
from engines import closed_after_test

from mlxq.jobs.errors import InvalidRequest
from mlxq.jobs.schema import GenerateRequest, GenerateResult
from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.engine.generation_batch import Finished, GenerationBatch, generate
from mlxq.worker.engine.sampler import Sampler
from mlxq.worker.engine.sampler_rows import SamplerRows
from mlxq.worker.engine.text_run import TokenSink
from mlxq.worker.modelfiles.tiny_model import write_random_checkpoint

pytest.importorskip("llguidance")

# Nested objects, enums, arrays with bounds, numbers (bounded and free), a pattern.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
        "weight": {"type": "number"},
        "label": {"enum": ["pos", "neg", "neutral"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 6},
            "minItems": 1,
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "score", "label", "tags", "address"],
    "additionalProperties": False,
}
SCORES = {
    "type": "array",
    "items": {"type": "integer", "minimum": 1, "maximum": 5},
    "minItems": 2,
    "maxItems": 4,
}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
# Sums of small numbers, in llguidance's Lark.
SUMS = 'start: num ("+" num)*\nnum: /[1-9][0-9]?/\n'


def json_schema(schema: dict[str, Any], name: str = "answer") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny"), {"max_position_embeddings": 1024})


def _engine(model_dir: Path, **options: Any) -> Engine:
    return closed_after_test(
        Engine.load(str(model_dir), EngineOptions(prefill_chunk=64, dtype="float32", **options))
    )


@pytest.fixture
def engine(model_dir: Path) -> Engine:
    return _engine(model_dir, prefix_cache_bytes=0)


def _request(**fields: Any) -> GenerateRequest:
    return GenerateRequest.model_validate({"max_tokens": 300, **fields})


def _alone(engine: Engine, request: GenerateRequest) -> GenerateResult:
    return generate(engine, request, lambda _text, _ids: None)


def _batch(
    engine: Engine, requests: list[GenerateRequest], join_every: int = 0, seen: dict[str, str] | None = None
) -> list[Finished]:
    """Every request in one batch: all admitted at once, or one every `join_every` steps (joining
    rows that decode); the outcomes in request order. `seen`: each request's streamed text, by key."""
    batch = GenerationBatch(engine, max_sequences=len(requests))
    waiting = list(enumerate(requests))
    done: dict[str, Finished] = {}
    streamed = {} if seen is None else seen

    def sink(key: str) -> TokenSink:
        streamed[key] = ""

        def add(text: str, _ids: list[int]) -> None:
            streamed[key] += text

        return add

    try:
        while waiting or len(batch):
            if waiting and (not join_every or batch.steps % join_every == 0):
                for i, request in waiting if not join_every else waiting[:1]:
                    batch.admit(str(i), request, sink(str(i)), lambda: False)
                waiting = [] if not join_every else waiting[1:]
            for finished in batch.step():
                done[finished.key] = finished
            batch.settle()
    finally:
        batch.close()
    return [done[str(i)] for i in range(len(requests))]


def _result(finished: Finished) -> GenerateResult:
    assert finished.error is None, finished.error
    assert finished.result is not None
    return finished.result


def _sampling(i: int) -> dict[str, Any]:
    """Greedy and sampled rows, some with top-k/top-p/min-p and penalties, each seeded."""
    fields: dict[str, Any] = {"seed": 7 + i, "temperature": [0.0, 0.7, 1.0, 1.5][i % 4]}
    if i % 5 == 3:
        fields.update(top_k=40, top_p=0.9, min_p=0.02, frequency_penalty=0.5, repetition_penalty=1.1)
    return fields


def test_every_answer_of_a_batch_validates_against_its_schema(engine: Engine) -> None:
    schemas = [PERSON, SCORES]
    requests = [
        _request(
            prompt=f"Row {i}: answer in JSON.",
            response_format=json_schema(schemas[i % 2]),
            **_sampling(i),
        )
        for i in range(24)
    ]
    for i, finished in enumerate(_batch(engine, requests)):
        result = _result(finished)
        assert result.finish_reason == "stop", result.text
        jsonschema.validate(json.loads(result.text), schemas[i % 2])


def test_regex_and_grammar_answers_match(engine: Engine) -> None:
    requests = [
        _request(prompt=f"Date {i}:", response_format={"type": "regex", "regex": DATE}, **_sampling(i))
        for i in range(6)
    ] + [
        _request(prompt=f"Sum {i}:", response_format={"type": "grammar", "grammar": SUMS}, **_sampling(i))
        for i in range(6)
    ]
    results = [_result(f) for f in _batch(engine, requests)]
    for result in results[:6]:
        assert result.finish_reason == "stop" and re.fullmatch(DATE, result.text), result.text
    for result in results[6:]:
        assert result.finish_reason in ("stop", "length"), result.text
        text = result.text if result.finish_reason == "stop" else result.text.rstrip("+")
        assert re.fullmatch(r"[1-9][0-9]?(\+[1-9][0-9]?)*", text), result.text


def test_json_object_gives_a_json_object(engine: Engine) -> None:
    result = _alone(
        engine, _request(prompt="{", response_format={"type": "json_object"}, temperature=1.0, seed=3)
    )
    if result.finish_reason == "stop":  # an object may go on past the budget; one that ended parses
        assert isinstance(json.loads(result.text), dict)
    else:
        assert result.text.startswith("{")


@pytest.mark.parametrize(("pad_shapes", "overlap", "join_every"), [(False, False, 0), (True, True, 3)])
def test_a_mixed_batch_gives_each_row_what_it_gets_alone(
    engine: Engine, model_dir: Path, pad_shapes: bool, overlap: bool, join_every: int
) -> None:
    """All rows at once; and joining one by one into padded buffers, with the steps launched on the
    launcher's thread (as on a GPU)."""
    no_eos = {i: -100.0 for i in engine.tokenizer.eos_ids}
    constrained = [
        # Greedy on noise repeats a digit of a free number until the budget: a penalty ends it.
        _request(
            prompt="Person:", response_format=json_schema(PERSON), temperature=0.0, frequency_penalty=1.0
        ),
        _request(prompt="A date:", response_format={"type": "regex", "regex": DATE}, temperature=0.0),
        _request(prompt="Scores, seeded:", response_format=json_schema(SCORES), temperature=1.0, seed=11),
    ]
    free = [
        _request(prompt="Free text one", max_tokens=40, temperature=0.0, logit_bias=no_eos),
        _request(prompt="Free text two, sampled", max_tokens=25, temperature=1.0, seed=5, logit_bias=no_eos),
    ]
    mixed = [free[0], constrained[0], constrained[1], free[1], constrained[2]]
    batched = _engine(model_dir, prefix_cache_bytes=0, pad_shapes=pad_shapes, decode_overlap=overlap)
    together = [_result(f) for f in _batch(batched, mixed, join_every)]
    for request, got in zip(mixed, together, strict=True):
        alone = _alone(engine, request)
        assert (got.text, got.token_ids, got.finish_reason) == (
            alone.text,
            alone.token_ids,
            alone.finish_reason,
        )
    # The free rows are not constrained by their batch-mates: they run to their budgets.
    assert [len(together[i].token_ids) for i in (0, 3)] == [40, 25]
    assert [together[i].finish_reason for i in (1, 2, 4)] == ["stop"] * 3, [
        together[i].text for i in (1, 2, 4)
    ]
    jsonschema.validate(json.loads(together[1].text), PERSON)
    assert re.fullmatch(DATE, together[2].text)
    jsonschema.validate(json.loads(together[4].text), SCORES)


def test_a_constraint_that_cannot_be_compiled_fails_before_any_token(engine: Engine) -> None:
    bad = {
        "json_schema": json_schema({"type": "strin"}),
        "regex": {"type": "regex", "regex": "[0-9"},
        "grammar": {"type": "grammar", "grammar": "start: missing_rule\n"},
    }
    for what, response_format in bad.items():
        texts: list[str] = []
        request = _request(prompt="x", response_format=response_format)
        with pytest.raises(InvalidRequest, match=f"response_format: the {what}.* cannot be compiled"):
            generate(engine, request, lambda text, _ids, texts=texts: texts.append(text))
        assert texts == []
    with pytest.raises(InvalidRequest, match="strin"):
        _alone(engine, _request(prompt="x", response_format=bad["json_schema"]))


def test_max_tokens_cutting_a_constrained_answer_says_length(engine: Engine) -> None:
    result = _alone(engine, _request(prompt="Person:", max_tokens=8, response_format=json_schema(PERSON)))
    assert result.finish_reason == "length" and len(result.token_ids) == 8
    with pytest.raises(json.JSONDecodeError):
        json.loads(result.text)


def test_a_stop_string_ends_a_constrained_answer(engine: Engine) -> None:
    request = _request(prompt="Person:", temperature=0.0, response_format=json_schema(PERSON))
    whole = _alone(engine, request).text
    stop = '"age":'
    assert stop in whole
    cut = _alone(engine, request.model_copy(update={"stop": [stop]}))
    assert (cut.finish_reason, cut.text) == ("stop", whole[: whole.index(stop)])


def test_a_cached_prompt_gives_the_same_constrained_answer(model_dir: Path) -> None:
    engine = _engine(model_dir, prefix_cache_bytes=64 << 20)
    prompt = "A long shared system prompt that the prefix cache keeps. " * 6 + "Person:"
    request = _request(prompt=prompt, temperature=1.0, seed=2, response_format=json_schema(PERSON))
    first, second = _alone(engine, request), _alone(engine, request)
    assert second.usage.cached_tokens > 0 and first.usage.cached_tokens == 0
    assert (second.text, second.token_ids) == (first.text, first.token_ids)
    jsonschema.validate(json.loads(second.text), PERSON)


def test_the_wire_carries_one_response_format() -> None:
    request = _request(prompt="x", response_format=json_schema(PERSON, "person"))
    wire = request.model_dump(mode="json", exclude_defaults=True)
    assert wire["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON},
    }
    assert GenerateRequest.model_validate(wire) == request
    for bad in ({"type": "xml"}, {"type": "regex"}, {"type": "json_schema", "json_schema": {"name": "n"}}):
        with pytest.raises(ValueError, match="response_format"):
            _request(prompt="x", response_format=bad)


def test_the_mask_keeps_exactly_the_allowed_tokens_of_a_vocabulary_wider_than_the_tokenizer(
    tmp_path: Path,
) -> None:
    """A model whose embedding has more rows than its tokenizer has tokens (400 > 384, not a multiple
    of 32): the padding ids are never allowed, and a constrained row's greedy token is the best one
    its grammar allows, whatever its logits say elsewhere; its free batch-mate is untouched."""
    import mlx.core as mx

    from mlxq.jobs.schema import RegexFormat
    from mlxq.worker.engine.sampler import Sampler
    from mlxq.worker.engine.sampler_rows import SamplerRows

    engine = _engine(write_random_checkpoint(tmp_path, {"vocab_size": 400}), prefix_cache_bytes=0)
    assert engine.tokenizer.vocab_size < 400 == engine.model.args.vocab_size
    digits = {
        i for text, i in engine.tokenizer.backend.get_vocab().items() if text.isascii() and text.isdigit()
    }
    constraint = engine.constraints.compile(RegexFormat(type="regex", regex="[0-9]+"))
    samplers = [Sampler(400, temperature=0.0, constraint=constraint), Sampler(400, temperature=0.0)]
    logits = mx.random.normal((2, 400), key=mx.random.key(0))
    logits[:, 399] = 100.0  # a padding id, the best logit of both rows
    best_digit = max(digits, key=lambda t: logits[0, t].item())
    tokens = SamplerRows(samplers, 400).sample(logits).tolist()
    assert tokens == [best_digit, 399]
    with pytest.raises(ValueError, match="SamplerRows"):
        samplers[0](logits[:1])
    result = _alone(
        engine,
        _request(
            prompt="n:",
            temperature=1.0,
            seed=1,
            max_tokens=12,
            response_format={"type": "regex", "regex": "[0-9]{1,8}"},
        ),
    )
    assert re.fullmatch("[0-9]{1,8}", result.text) and max(result.token_ids) < engine.tokenizer.vocab_size


def _allowed_greedy(engine: Engine, prompt: list[int], regex: str, steps: int) -> list[int]:
    """The greedy answer of a regex constraint computed the slow, plain way: at every step the whole
    sequence prefilled afresh, the grammar's mask applied, the best allowed token taken."""
    import mlx.core as mx
    import numpy as np

    from mlxq.jobs.schema import RegexFormat
    from mlxq.worker.engine.constraint import fill_masks
    from mlxq.worker.engine.prefill import prefill

    constraint = engine.constraints.compile(RegexFormat(type="regex", regex=regex))
    assert constraint is not None
    vocab = engine.model.args.vocab_size
    out: list[int] = []
    for _ in range(steps):
        if constraint.stopped:
            break
        logits = prefill(engine.model, prompt + out, engine.model.make_cache(), 64)[0]
        words = fill_masks([constraint], engine.constraints.words)[0].view(np.uint32)
        allowed = (words[np.arange(vocab) >> 5] >> (np.arange(vocab) & 31)) & 1
        best = int(mx.argmax(mx.where(mx.array(allowed.astype(bool)), logits, float("-inf"))).item())
        out.append(best)
        if best in engine.tokenizer.eos_ids:
            break
        constraint.take(best)
    return out


def test_a_constrained_greedy_answer_is_the_best_allowed_token_at_every_step(
    engine: Engine, model_dir: Path
) -> None:
    """The decode batch keeps a forward ahead of a constrained row's draw (the draw waits for the mask,
    the forward does not): its tokens are those of the plain way, alone and in a batch with free rows
    and rows joining later, steps launched on the launcher's thread."""
    regex = r"[a-z]{2,9}( [a-z]{1,9}){0,4}\."
    prompts = [engine.tokenizer.encode(f"Words {i}:") for i in range(3)]
    expected = [_allowed_greedy(engine, p, regex, 80) for p in prompts]
    requests = [
        _request(
            prompt_ids=p, max_tokens=80, temperature=0.0, response_format={"type": "regex", "regex": regex}
        )
        for p in prompts
    ]
    free = _request(prompt="Free text", max_tokens=30, temperature=0.0)
    overlapped = _engine(model_dir, prefix_cache_bytes=0, pad_shapes=True, decode_overlap=True)
    for eng, join_every in ((engine, 0), (overlapped, 2)):
        finished = _batch(eng, [requests[0], free, requests[1], requests[2]], join_every)
        got = [_result(finished[i]) for i in (0, 2, 3)]
        for want, result in zip(expected, got, strict=True):
            assert list(result.token_ids) == want
            assert result.finish_reason == "stop" and re.fullmatch(regex, result.text), result.text
        assert eng is engine or _result(finished[1]).token_ids == _alone(engine, free).token_ids


def test_a_constrained_row_that_leaves_hands_the_prefix_cache_exactly_its_tokens(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row cut by a stop string or its budget leaves after the forward ahead fed it one token more:
    its cache leaves without it (never longer than its prompt and tokens), so a prompt continuing the
    answer reuses it and gets what it gets uncached."""
    lengths: list[tuple[int, int]] = []  # (prompt and tokens, cache) of each finished request
    finish = GenerationBatch._finish

    def recording(batch: GenerationBatch, seq: Any, reason: Any, cache: Any) -> Finished:
        if cache is not None:
            lengths.append((len(seq.prompt) + len(seq.run.ids), cache[0].offset))
        return finish(batch, seq, reason, cache)

    monkeypatch.setattr(GenerationBatch, "_finish", recording)
    cached = _engine(model_dir, prefix_cache_bytes=64 << 20)
    plain = _engine(model_dir, prefix_cache_bytes=0)
    prompt = "Some people are described below, one a line, as JSON. " * 3 + "Person:"
    request = _request(prompt=prompt, temperature=0.0, response_format=json_schema(PERSON))
    whole = _alone(plain, request).text
    for cut in (
        request.model_copy(update={"stop": ['"age":']}),
        request.model_copy(update={"max_tokens": 9}),
    ):
        first = _alone(cached, cut)
        assert first.finish_reason in ("stop", "length") and whole.startswith(first.text)
        ids = [*cached.prompt_tokens(cut), *first.token_ids]
        follow = _request(prompt_ids=ids, max_tokens=12, temperature=0.0)
        again = _alone(cached, follow)
        assert again.usage.cached_tokens == len(ids) - 1  # all its tokens reused (one is recomputed)
        assert again.token_ids == _alone(plain, follow).token_ids
    assert lengths and all(tokens - 1 <= offset <= tokens for tokens, offset in lengths), lengths


@pytest.mark.parametrize("overlap", [False, True])
def test_the_critical_path_is_timed_on_constrained_steps_only(model_dir: Path, overlap: bool) -> None:
    """A constrained batch times the host's stretch between a step's read-back and the next launch
    (`CriticalPath`, which the structured benchmark reports); a free batch takes no such step."""
    engine = _engine(model_dir, prefix_cache_bytes=0, decode_overlap=overlap)
    constrained = _request(prompt="Scores:", max_tokens=40, response_format=json_schema(SCORES))
    free = _request(prompt="Free text", max_tokens=40, temperature=0.0)
    for requests, timed in (([constrained, constrained], True), ([free, free], False)):
        batch = GenerationBatch(engine, max_sequences=2)
        for i, request in enumerate(requests):
            batch.admit(str(i), request, lambda _text, _ids: None, lambda: False)
        decode, steps = batch.decode, 0
        while len(batch):
            batch.step()
            steps += 1
        batch.close()
        times = decode.ahead.critical.per_step_ms()
        if not timed:
            assert decode.ahead.critical.steps == 0 and times == {}
            continue
        assert 0 < decode.ahead.critical.steps < steps
        parts = times["take_ms"] + times["draw_ms"] + times["forward_ms"] + times["join_ms"]
        parts += times["launch_ms"]
        assert engine.masks_in_place and times["forward_ms"] > 0 and times["masks_ms"] > 0
        assert 0 < parts <= times["critical_ms"] * 1.001 + 1e-6
        parts += times["handle_ms"]  # after the launch
        # with a launcher the forward behind each draw is launched on its thread, and timed there
        assert (times["forward_launch_ms"] > 0) == overlap
        assert times["host_ms"] == pytest.approx(parts)


# A free number in a schema: greedy on noise repeats a digit, so prompt lookup drafts and some drafts are
# kept; the enum, the bounded integers and the keys cut drafts the grammar does not allow.
READING = {
    "type": "object",
    "properties": {
        "label": {"enum": ["pos", "neg", "neutral"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "value": {"type": "number"},
    },
    "required": ["label", "count", "value"],
    "additionalProperties": False,
}


def _speculating(model_dir: Path, kind: str = "prompt_lookup", **options: Any) -> Engine:
    from mlxq.worker.engine.speculation.policy import DraftPolicy

    policy = DraftPolicy(min_acceptance=0.0, max_batch=64, only_likely=False)
    return _engine(model_dir, prefix_cache_bytes=0, speculation=kind, draft_policy=policy, **options)


def _spec_requests(engine: Engine) -> list[GenerateRequest]:
    """Constrained rows (a schema, a regex; greedy and one sampled) beside free ones."""
    example = '{"label":"pos","count":12,"value":1.5} {"label":"neg","count":3,"value":7.25} '
    no_eos = {i: -100.0 for i in engine.tokenizer.eos_ids}
    return [
        _request(prompt=example * 2, max_tokens=60, temperature=0.0, response_format=json_schema(READING)),
        _request(prompt="Free " * 8, max_tokens=30, temperature=0.0, logit_bias=no_eos),
        _request(prompt=example, max_tokens=40, temperature=0.0, response_format=json_schema(PERSON)),
        _request(
            prompt="2024-01-02 2024-01-02 ", temperature=0.0, response_format={"type": "regex", "regex": DATE}
        ),
        _request(
            prompt=example, max_tokens=60, temperature=0.8, seed=4, response_format=json_schema(READING)
        ),
    ]


def _check_valid(engine: Engine, requests: list[GenerateRequest], results: list[GenerateResult]) -> None:
    """Every constrained answer is one its grammar allows token by token (a fresh one), and each that
    ended on its own validates against its schema or matches its regex."""
    for i in (0, 2, 3, 4):
        constraint = engine.constraints.compile(requests[i].response_format)
        assert constraint is not None
        ids = list(results[i].token_ids)
        assert constraint.valid_prefix(ids) == len(ids), results[i].text
    for i, schema in ((0, READING), (2, PERSON), (4, READING)):
        if results[i].finish_reason == "stop":
            jsonschema.validate(json.loads(results[i].text), schema)
    assert results[3].finish_reason == "stop" and re.fullmatch(DATE, results[3].text), results[3].text


@pytest.mark.parametrize(("pad_shapes", "overlap", "join_every"), [(False, False, 0), (True, True, 2)])
def test_speculation_checks_drafts_against_the_grammar_and_changes_no_greedy_token(
    engine: Engine, model_dir: Path, pad_shapes: bool, overlap: bool, join_every: int
) -> None:
    """Prompt lookup drafts for constrained rows: each row's drafts are cut where its grammar stops
    allowing them, each position is masked by the grammar after the drafts before it, and the grammar
    takes what was kept. Greedy rows get exactly what plain steps give them; every answer is valid."""
    requests = _spec_requests(engine)
    plain = [_result(f) for f in _batch(engine, requests)]
    spec = _speculating(model_dir, pad_shapes=pad_shapes, decode_overlap=overlap)
    got = [_result(f) for f in _batch(spec, requests, join_every)]
    for i in range(4):  # the greedy ones
        assert (got[i].token_ids, got[i].text, got[i].finish_reason) == (
            plain[i].token_ids,
            plain[i].text,
            plain[i].finish_reason,
        ), i
    _check_valid(spec, requests, got)
    assert plain[0].usage.draft_tokens == 0
    drafted = sum(got[i].usage.draft_tokens for i in (0, 2, 3, 4))
    kept = sum(got[i].usage.accepted_tokens for i in (0, 2, 3, 4))
    assert 0 < kept < drafted  # drafts were checked: some kept, some cut or rejected


def test_a_draft_model_drafting_for_constrained_rows_leaves_their_answers_unchanged(
    engine: Engine, model_dir: Path, tmp_path: Path
) -> None:
    """The target as its own draft: its drafts follow the target's unconstrained greedy choice, so
    they hold until the grammar forbids one; cut there, the answers are plain decoding's."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    shutil.copytree(model_dir, model / "draft")
    spec = _speculating(model, "draft_model")
    requests = _spec_requests(engine)
    plain = [_result(f) for f in _batch(engine, requests)]
    got = [_result(f) for f in _batch(spec, requests)]
    for i in range(4):
        assert (got[i].token_ids, got[i].finish_reason) == (plain[i].token_ids, plain[i].finish_reason), i
    _check_valid(spec, requests, got)
    assert sum(got[i].usage.accepted_tokens for i in (0, 2, 3, 4)) > 0


# Masks written in place (`mask_buffer.py`): a constrained step's masks computed beside the build of its
# draw and forward, or (`build_ahead`) the draw and forward built before its tokens are read back. The
# tokens must be those of the plain order, whatever the batch does.


def _both_orders(
    model_dir: Path, requests: list[GenerateRequest], join_every: int = 0, **options: Any
) -> list[GenerateResult]:
    """The requests in one batch with the masks computed as the draw is built, written in place beside
    the build after the read-back, and written in place after a build before the read-back
    (`build_ahead`): the same tokens, text, finish reasons and logprobs, row by row; returns the results
    of the last."""
    got = []
    for in_place, ahead in ((False, False), (True, False), (True, True)):
        engine = _engine(
            model_dir, prefix_cache_bytes=0, masks_in_place=in_place, build_ahead=ahead, **options
        )
        assert engine.masks_in_place is in_place and engine.build_ahead is ahead
        got.append([_result(f) for f in _batch(engine, requests, join_every)])
        engine.close()
    for plain, *others in zip(*got, strict=True):
        for other in others:
            assert (other.token_ids, other.text, other.finish_reason) == (
                plain.token_ids,
                plain.text,
                plain.finish_reason,
            )
            assert other.logprobs == plain.logprobs
    return got[-1]


def _mixed(engine: Engine) -> list[GenerateRequest]:
    """Constrained rows (greedy, seeded, with filters and penalties, one with a stop string, one asking
    logprobs) among free ones (one asking logprobs), of several lengths: rows leave at different steps."""
    no_eos = {i: -100.0 for i in engine.tokenizer.eos_ids}
    out = []
    for i in range(9):
        fields = _sampling(i)
        if i % 3 == 2:
            out.append(_request(prompt=f"Free {i}", max_tokens=12 + 5 * i, logit_bias=no_eos, **fields))
            continue
        fmt = [json_schema(PERSON), json_schema(SCORES), {"type": "regex", "regex": DATE}][i % 3 + (i % 2)]
        out.append(_request(prompt=f"Row {i}:", max_tokens=20 + 7 * i, response_format=fmt, **fields))
    out[6] = out[6].model_copy(update={"stop": ['"age"']})  # cuts its object after the name
    out[4] = out[4].model_copy(update={"logprobs": 3, "temperature": 0.0})
    out[5] = out[5].model_copy(update={"logprobs": 2})
    return out


@pytest.mark.parametrize(
    ("pad_shapes", "overlap", "join_every"), [(False, False, 0), (True, True, 2), (False, False, 3)]
)
def test_masks_written_in_place_change_no_token(
    engine: Engine, model_dir: Path, pad_shapes: bool, overlap: bool, join_every: int
) -> None:
    """Mixed constrained and free rows, greedy and seeded, stop strings and logprobs: all at once, and
    joining one every few steps while others leave (padded buffers and the launcher's thread, as on a
    GPU)."""
    got = _both_orders(model_dir, _mixed(engine), join_every, pad_shapes=pad_shapes, decode_overlap=overlap)
    assert got[6].finish_reason == "stop" and got[6].text.startswith('{"name"'), got[6].text
    assert got[4].logprobs and got[5].logprobs  # a constrained and a free row asked for them


@pytest.mark.parametrize("overlap", [False, True])
def test_masks_written_in_place_with_verify_steps_change_no_token(
    engine: Engine, model_dir: Path, overlap: bool
) -> None:
    """Constrained rows that draft (prompt lookup): verify steps between steps built ahead."""
    from mlxq.worker.engine.speculation.policy import DraftPolicy

    policy = DraftPolicy(min_acceptance=0.0, max_batch=64, only_likely=False)
    requests = _spec_requests(engine)
    _both_orders(
        model_dir,
        requests,
        2,
        speculation="prompt_lookup",
        draft_policy=policy,
        pad_shapes=overlap,
        decode_overlap=overlap,
    )


def test_with_masks_in_place_the_masks_are_computed_beside_the_graphs(model_dir: Path) -> None:
    """In place, the mask thread computes the masks (timed apart: `masks`) while the draw and the
    forward are built, and the loop thread waits for it past them (`join`); in the plain order the
    masks are computed within the draw. Either way the tokens are handled after the launch."""
    requests = [_request(prompt="Scores:", max_tokens=40, response_format=json_schema(SCORES))] * 2
    for in_place in (False, True):
        engine = _engine(model_dir, prefix_cache_bytes=0, masks_in_place=in_place)
        batch = GenerationBatch(engine, max_sequences=2)
        for i, request in enumerate(requests):
            batch.admit(str(i), request, lambda _text, _ids: None, lambda: False)
        while len(batch):
            batch.step()
        batch.close()
        times = batch.decode.ahead.critical.per_step_ms()
        assert batch.decode.ahead.critical.steps > 0
        assert times["handle_ms"] > 0 and times["forward_ms"] > 0
        critical = times["take_ms"] + times["draw_ms"] + times["forward_ms"] + times["join_ms"]
        critical += times["launch_ms"]
        if in_place:
            assert times["masks_ms"] > 0
        else:
            assert times["join_ms"] == 0.0 and times["masks_ms"] == 0.0
        assert critical <= times["critical_ms"] * 1.001 + 1e-6


def test_without_a_launcher_the_forward_ahead_is_evaluated_apart_from_the_tokens_it_follows(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLX marks the arrays of one `async_eval` ready together: a constrained step evaluating its drawn
    tokens with the forward ahead could read them back only once that forward had computed. Without
    a launcher (the CPU) each evaluation of a forward ahead holds it alone, and the answers are the
    schema's."""
    import mlxq.worker.engine.pending_tokens as pending_module

    calls: list[list[mx.array]] = []

    class Noted:
        def __getattr__(self, name: str) -> object:
            return getattr(mx, name)

        def async_eval(self, *arrays: mx.array) -> None:
            calls.append(list(arrays))
            mx.async_eval(*arrays)

    monkeypatch.setattr(pending_module, "mx", Noted())
    engine = _engine(model_dir, prefix_cache_bytes=0, decode_overlap=False)
    request = _request(prompt="Scores:", max_tokens=60, temperature=0, response_format=json_schema(SCORES))
    finished = _batch(engine, [request, request.model_copy(update={"prompt": "Marks:"})])
    aheads = [c for c in calls if any(a.ndim == 2 for a in c)]  # a forward's (rows, vocab) logits
    assert aheads and all(len(c) == 1 for c in aheads)
    for f in finished:
        jsonschema.validate(json.loads(_result(f).text), SCORES)


def test_the_engine_checks_once_whether_masks_can_be_written_in_place(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unset, the engine asks `host_writes_seen`: true where a graph built before a host write sees
    it (this CPU build), and a failed or raising check falls back to the plain order."""
    from mlxq.worker.engine import mask_buffer

    mask_buffer.host_writes_seen.cache_clear()
    try:
        assert _engine(model_dir).masks_in_place is True
        assert mask_buffer._check()
        for broken in (lambda: False, lambda: 1 / 0):
            mask_buffer.host_writes_seen.cache_clear()
            monkeypatch.setattr(mask_buffer, "_check", broken)
            assert _engine(model_dir).masks_in_place is False
        assert _engine(model_dir, masks_in_place=True).masks_in_place is True  # forced
    finally:
        mask_buffer.host_writes_seen.cache_clear()


def test_a_draw_built_before_its_masks_draws_what_a_draw_built_after_them_does(engine: Engine) -> None:
    """`SamplerRows` alone: a draw built with `masks_later`, then its rows taking the tokens before,
    then the masks written, gives the tokens of a draw built with its masks; also after rows left
    and joined as many (a free row where a constrained one was, and the other way round)."""
    vocab = engine.model.args.vocab_size
    formats = {"scores": json_schema(SCORES), "date": {"type": "regex", "regex": DATE}, "free": None}

    def samplers(*kinds: str) -> list[Sampler]:
        compile = engine.constraints.compile
        fmt = {k: _request(prompt="x", response_format=f).response_format for k, f in formats.items()}
        return [Sampler(vocab, temperature=0.0, constraint=compile(fmt[k])) for k in kinds]

    plain = SamplerRows(samplers("scores", "free", "date"), vocab)
    later = SamplerRows(samplers("scores", "free", "date"), vocab)
    before: list[int] | None = None
    for step in range(6):
        if step == 3:  # the first row leaves and a free one joins: [free, date, free]
            for rows in (plain, later):
                rows.select([1, 2])
                rows.extend(SamplerRows(samplers("free"), vocab))
        logits = mx.random.normal((3, vocab), key=mx.random.key(step))
        drawn_later = later.sample(logits, masks_later=True)
        if before is not None:
            plain.take(before)
            later.take(before)
        drawn = plain.sample(logits)
        later.write_masks()
        before = [int(t) for t in drawn.tolist()]
        assert [int(t) for t in drawn_later.tolist()] == before, step


def test_built_ahead_a_constrained_step_builds_its_graphs_before_the_read_back(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `build_ahead` every constrained step's draw and forward are built before its tokens are
    read back (`ForwardAhead.prepare`) and only the masks after (`fill`): never `build`. The graphs'
    time is counted apart from the critical path (take, masks joined, launch)."""
    from mlxq.worker.engine.forward_ahead import ForwardAhead

    built_after: list[int] = []
    original = ForwardAhead.build

    def counted(self: ForwardAhead, *args: Any, **kwargs: Any) -> Any:
        built_after.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ForwardAhead, "build", counted)
    engine = _engine(model_dir, prefix_cache_bytes=0, masks_in_place=True, build_ahead=True)
    batch = GenerationBatch(engine, max_sequences=2)
    for i in range(2):
        request = _request(prompt=f"Scores {i}:", max_tokens=30, response_format=json_schema(SCORES))
        batch.admit(str(i), request, lambda _text, _ids: None, lambda: False)
    while len(batch):
        batch.step()
    batch.close()
    critical = batch.decode.ahead.critical
    times = critical.per_step_ms()
    assert critical.steps > 0 and not built_after
    assert times["draw_ms"] > 0 and times["forward_ms"] > 0 and times["masks_ms"] > 0
    assert times["take_ms"] + times["join_ms"] + times["launch_ms"] <= times["critical_ms"] * 1.001 + 1e-6
