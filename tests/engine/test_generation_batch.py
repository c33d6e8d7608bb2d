"""Batched generation on the engine (no Redis): every request's result equals running it alone.

float32 on the CPU: a batched forward is bit-identical per row, so greedy tokens, seeded draws, stop
strings and finish reasons must all be exactly those of the request run alone (`generate`: a batch of
one; the model itself is held against transformers in `test_models.py`), whoever the batch-mates are
and whenever they join or leave.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from engines import closed_after_test

from mlxq.jobs.errors import ContextTooLong, InvalidRequest
from mlxq.jobs.schema import GenerateRequest, GenerateResult
from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.engine.cache.batch_cache import BatchKVCache
from mlxq.worker.engine.cache.kv_cache import KVCache, key_columns
from mlxq.worker.engine.decode_batch import DecodeBatch
from mlxq.worker.engine.generation_batch import Finished, GenerationBatch, generate
from mlxq.worker.engine.models import attention, llama
from mlxq.worker.engine.prefill import prefill, prefill_rows
from mlxq.worker.engine.sampler import Sampler
from mlxq.worker.engine.shapes import padded_size, padded_width
from mlxq.worker.modelfiles.tiny_model import write_random_checkpoint

PROMPT = "The capital of France is Paris. "


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny"), {"max_position_embeddings": 512})


def _engine(model_dir: Path, **options: Any) -> Engine:
    return closed_after_test(Engine.load(str(model_dir), EngineOptions(prefill_chunk=16, **options)))


@pytest.fixture
def engine(model_dir: Path) -> Engine:
    return _engine(model_dir, prefix_cache_bytes=0)


def _no_eos(engine: Engine) -> dict[int, float]:
    return {i: -100.0 for i in engine.tokenizer.eos_ids}


def _requests(engine: Engine, n: int) -> list[GenerateRequest]:
    """Different prompt lengths, token budgets, greedy and seeded sampling, with and without penalties."""
    out = []
    for i in range(n):
        fields: dict[str, Any] = {
            "prompt": PROMPT * (1 + (i * 5) % 7) + f"#{i}",
            "max_tokens": 5 + (i * 11) % 29,
            "logit_bias": _no_eos(engine),
            "temperature": 0.0 if i % 2 == 0 else 1.3,
            "seed": 100 + i,
        }
        if i % 3 == 1:
            fields.update(top_k=20, repetition_penalty=1.2, frequency_penalty=0.3)
        out.append(GenerateRequest.model_validate(fields))
    return out


def _record_rows_forwards(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of prompts of each rows prefill forward the batches make from now on, in order."""
    import mlxq.worker.engine.batch_prefill as batch_prefill

    groups: list[int] = []
    real = batch_prefill.prefill_rows_layers

    def recorded(model: Any, rows: Any, *args: Any) -> Any:
        groups.append(len(rows))
        return real(model, rows, *args)

    monkeypatch.setattr(batch_prefill, "prefill_rows_layers", recorded)
    return groups


def _alone(engine: Engine, request: GenerateRequest) -> tuple[GenerateResult, list[str]]:
    deltas: list[str] = []
    return generate(engine, request, lambda t, _ids: deltas.append(t)), deltas


def _run_batch(
    batch: GenerationBatch,
    requests: list[GenerateRequest],
    *,
    join_every: int = 1,
    cancelled: dict[int, Callable[[], bool]] | None = None,
    sinks: dict[int, Callable[[str, list[int]], None]] | None = None,
    peak: list[int] | None = None,
) -> tuple[dict[int, Finished], dict[int, list[str]]]:
    """Admit `requests` as slots free up, one at most every `join_every` steps; run until all finish.

    `peak[0]` is set to the most requests seen decoding together."""
    peak = peak if peak is not None else [0]
    done: dict[int, Finished] = {}
    deltas: dict[int, list[str]] = {i: [] for i in range(len(requests))}
    todo = list(enumerate(requests))
    while todo or len(batch):
        peak[0] = max(peak[0], len(batch.decoding))
        if todo and batch.free_slots > 0 and batch.steps % join_every == 0:
            i, request = todo.pop(0)
            sink = (sinks or {}).get(i) or (lambda t, _ids, i=i: deltas[i].append(t))
            batch.admit(str(i), request, sink, (cancelled or {}).get(i, lambda: False))
        for f in batch.step():
            done[int(f.key)] = f
    return done, deltas


def test_batch_cache_keeps_each_row_at_its_own_positions() -> None:
    def row(n: int, base: float) -> KVCache:
        keys = mx.broadcast_to((mx.arange(n, dtype=mx.float32) + base)[None, None, :, None], (1, 2, n, 4))
        return KVCache.from_state(keys, -keys)

    cache = BatchKVCache()
    cache.add([row(3, 0.0)])
    cache.add([row(5, 100.0), row(1, 200.0)])  # longer: the first row is padded further
    assert (cache.starts, cache.end, cache.lengths) == ([2, 0, 4], 5, [3, 5, 1])
    assert cache.offset.tolist() == [3, 5, 1]  # type: ignore[union-attr]
    mask = cache.mask()
    assert mask is not None and mask.shape == (3, 1, 1, 6)
    assert mask[:, 0, 0, :].tolist()[2] == [False] * 4 + [True, True]
    cache.update_and_fetch(mx.ones((3, 2, 1, 4)), mx.ones((3, 2, 1, 4)))
    assert cache.offset.tolist() == [4, 6, 2]  # type: ignore[union-attr]
    assert cache.row(0).state[0][0, 0, :, 0].tolist() == [0.0, 1.0, 2.0, 1.0]
    cache.keep([1])  # alone, the longest row holds no padding: a plain int offset, as one sequence has
    assert cache.offset == 6 and cache.mask() is None
    cache = BatchKVCache()
    cache.add([row(4, 0.0), row(6, 100.0), row(2, 200.0)])
    assert cache.capacity == cache.step  # whole steps, so the buffers keep one shape for a while
    cache.keep([0, 2])  # the longest row leaves: less than a step of shared padding stays
    assert (cache.starts, cache.end, cache.lengths, cache.capacity) == ([2, 4], 6, [4, 2], cache.step)
    assert cache.row(1).state[0][0, 0, :, 0].tolist() == [200.0, 201.0]
    cache.keep([])
    assert cache.batch == 0 and cache.keys is None
    cache = BatchKVCache()
    cache.add([row(300, 0.0), row(10, 1000.0), row(20, 2000.0)])
    assert cache.capacity == 2 * cache.step
    cache.keep([1, 2])  # 280 columns of shared padding: the whole step of them goes
    assert (cache.starts, cache.end, cache.lengths, cache.capacity) == ([34, 24], 44, [10, 20], cache.step)
    assert cache.row(0).state[0][0, 0, :, 0].tolist() == [1000.0 + i for i in range(10)]


@pytest.mark.parametrize(("pad_shapes", "overlap"), [(False, False), (True, False), (True, True)])
def test_results_are_identical_to_running_alone_whatever_joins_and_leaves(
    engine: Engine, model_dir: Path, pad_shapes: bool, overlap: bool
) -> None:
    """With `pad_shapes` too: prompts padded, decode batches padded to 4, 8, 16 rows; and with the
    steps launched on the launcher's thread, as on a GPU."""
    requests = _requests(engine, 9)
    alone = [_alone(engine, r) for r in requests]
    batched = _engine(model_dir, prefix_cache_bytes=0, pad_shapes=pad_shapes, decode_overlap=overlap)
    assert batched.decode_overlap == overlap
    for max_sequences, join_every in ((3, 2), (9, 1)):
        batch = GenerationBatch(batched, max_sequences=max_sequences)
        peak = [0]
        done, deltas = _run_batch(batch, requests, join_every=join_every, peak=peak)
        assert peak[0] >= 3
        for i, (want, want_deltas) in enumerate(alone):
            got = done[i].result
            assert got is not None, done[i].error
            assert got.token_ids == want.token_ids, f"request {i}"
            assert (got.text, got.finish_reason, got.usage) == (want.text, want.finish_reason, want.usage)
            assert "".join(deltas[i]) == "".join(want_deltas) == got.text


def test_finish_reasons_stop_strings_and_eos_match_running_alone(engine: Engine) -> None:
    free = _alone(
        engine, GenerateRequest(prompt=PROMPT, max_tokens=30, temperature=0, logit_bias=_no_eos(engine))
    )
    stop = free[0].text[8:11]
    eos = min(engine.tokenizer.eos_ids)
    requests = [
        GenerateRequest(prompt=PROMPT, max_tokens=30, temperature=0, logit_bias=_no_eos(engine), stop=[stop]),
        GenerateRequest(prompt=PROMPT * 3, max_tokens=7, temperature=0, logit_bias=_no_eos(engine)),
        GenerateRequest(prompt="hi", max_tokens=50, temperature=0, logit_bias={eos: 100.0}),
        GenerateRequest(prompt=PROMPT * 2, max_tokens=1000, temperature=0, logit_bias=_no_eos(engine)),
    ]
    done, _ = _run_batch(GenerationBatch(engine, max_sequences=4), requests)
    reasons = [done[i].result.finish_reason for i in range(4)]  # type: ignore[union-attr]
    assert reasons == ["stop", "length", "stop", "length"]
    for i, request in enumerate(requests):
        assert done[i].result == _alone(engine, request)[0].model_copy(
            update={"timings": done[i].result.timings}
        )  # type: ignore[union-attr]
    assert stop not in done[0].result.text  # type: ignore[union-attr]
    assert done[2].result.token_ids == []  # type: ignore[union-attr]
    n = len(engine.tokenizer.encode(PROMPT * 2))
    assert done[3].result.usage.completion_tokens == engine.context_length - n  # type: ignore[union-attr]


def test_seeded_sampling_does_not_depend_on_batch_mates(engine: Engine) -> None:
    sampled = GenerateRequest(
        prompt=PROMPT, max_tokens=20, temperature=1.5, seed=7, logit_bias=_no_eos(engine)
    )
    runs = []
    for mates in (0, 2, 5):
        requests = [sampled, *_requests(engine, mates)]
        done, _ = _run_batch(GenerationBatch(engine, max_sequences=6), requests[::-1])
        runs.append(done[len(requests) - 1].result.token_ids)  # type: ignore[union-attr]
    assert runs[0] == runs[1] == runs[2] == _alone(engine, sampled)[0].token_ids


def test_one_cancelled_or_failing_sequence_leaves_the_others_untouched(engine: Engine) -> None:
    requests = _requests(engine, 4)
    seen: list[str] = []

    def broken_sink(text: str, _ids: list[int]) -> None:
        seen.append(text)
        if len(seen) == 3:
            raise ConnectionError("stream write failed")

    done, _ = _run_batch(
        GenerationBatch(engine, max_sequences=4),
        requests,
        cancelled={1: lambda: len(seen) >= 2},
        sinks={2: broken_sink},
    )
    assert done[1].result is not None and done[1].result.finish_reason == "cancelled"
    assert isinstance(done[2].error, ConnectionError) and done[2].result is None
    for i in (0, 3):
        assert done[i].result.token_ids == _alone(engine, requests[i])[0].token_ids  # type: ignore[union-attr]


class _Launches:
    """`mlx.core` as `worker.engine.launcher` sees it: each launch's thread noted; `fail_next`: the next
    launch fails."""

    def __init__(self) -> None:
        self.threads: list[str] = []
        self.fail_next = False

    def __getattr__(self, name: str) -> Any:
        return getattr(mx, name)

    def async_eval(self, *args: Any) -> None:
        self.threads.append(threading.current_thread().name)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("the launch failed")
        mx.async_eval(*args)


def test_with_a_launcher_steps_launch_on_its_thread_and_tokens_are_handled_here(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the overlap on, each decode step is launched on the launcher's thread while sinks and the
    step's background work run on the stepping thread, once per step (also in steps with no decode);
    tokens are those of running alone; a background error ends the decoding requests with it, none is
    lost."""
    import mlxq.worker.engine.launcher as launcher_module

    launches = _Launches()
    monkeypatch.setattr(launcher_module, "mx", launches)
    engine = _engine(model_dir, prefix_cache_bytes=0, decode_overlap=True)
    requests = _requests(engine, 3)
    requests[0] = requests[0].model_copy(update={"prompt": PROMPT * 6})  # chunks of prefill first
    sink_threads: set[str] = set()
    background: list[str] = []

    def sink(i: int) -> Callable[[str, list[int]], None]:
        return lambda _t, _ids: sink_threads.add(threading.current_thread().name)

    batch = GenerationBatch(engine, max_sequences=3)
    for i, request in enumerate(requests):
        batch.admit(str(i), request, sink(i), lambda: False)
    done: dict[str, Finished] = {}
    steps = 0
    while len(batch):
        ended = batch.step(lambda: background.append(threading.current_thread().name))
        done.update((f.key, f) for f in ended)
        steps += 1
    launcher = engine.launcher()
    assert launcher is not None and not launcher.busy  # the last rows leaving waited for their launch
    here = threading.current_thread().name
    assert len(background) == steps and set(background) == {here}
    assert sink_threads == {here}
    assert len(launches.threads) >= 20 and all(n.startswith("mlxq-launch") for n in launches.threads)
    assert len(engine.tokenizer.encode(requests[0].prompt or "")) > engine.options.prefill_chunk
    for i, request in enumerate(requests):
        assert done[str(i)].result.token_ids == _alone(engine, request)[0].token_ids  # type: ignore[union-attr]

    def broken() -> None:
        raise ConnectionError("redis went away")

    for prefilled in (0, 1):  # failing in a step that decodes nothing, and beside a decode step
        batch = GenerationBatch(engine, max_sequences=3)
        for i, request in enumerate(requests):
            batch.admit(str(i), request, lambda _t, _ids: None, lambda: False)
        while prefilled and not batch.decoding:
            assert not batch.step()
        decoding = {s.key for s in batch.decoding} if prefilled else {"0", "1", "2"}
        ended = batch.step(broken)
        assert {f.key for f in ended} == decoding and len(ended) == len(decoding)
        assert all(isinstance(f.error, ConnectionError) for f in ended)
        rest = [f for _ in range(200) if len(batch) for f in batch.step()]  # the others go on
        assert {f.key for f in rest} == {"0", "1", "2"} - decoding and all(f.result for f in rest)
        batch.close()


def test_a_lone_generation_with_a_launcher_gives_the_same_tokens_and_leaves_nothing_launching(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lone generation (`generate`, a batch of one) launches its decode steps on the launcher's
    thread: the same results as without it, also stopped early by a stop string, and no launch is in
    flight once it returns."""
    import mlxq.worker.engine.launcher as launcher_module

    launches = _Launches()
    monkeypatch.setattr(launcher_module, "mx", launches)
    plain = _engine(model_dir, prefix_cache_bytes=0)
    engine = _engine(model_dir, prefix_cache_bytes=0, decode_overlap=True)
    launcher = engine.launcher()
    assert launcher is not None and plain.launcher() is None
    requests = _requests(engine, 6)
    free = _alone(plain, requests[2])[0]  # greedy, 27 tokens
    assert len(free.text) > 12
    requests.append(requests[2].model_copy(update={"stop": [free.text[8:11]]}))  # ends early
    for request in requests:
        before = len(launches.threads)
        want, want_deltas = _alone(plain, request)
        got, deltas = _alone(engine, request)
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
        assert deltas == want_deltas
        assert len(launches.threads) - before >= len(got.token_ids) - 2
        assert not launcher.busy
    assert got.finish_reason == "stop" and len(got.token_ids) < len(free.token_ids)
    assert all(name.startswith("mlxq-launch") for name in launches.threads)


@pytest.mark.parametrize("seen_by", ["the next step", "quiet"])
def test_a_launch_that_fails_on_the_launchers_thread_ends_the_decoding_requests(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, seen_by: str
) -> None:
    """A step's launch fails on the launcher's thread after `step` returned: the next step, or a
    `quiet()` before other work (a score batch between steps), waits for it and every decoding
    request ends with its error, returned by the next step; none is lost, and the batch goes on."""
    import mlxq.worker.engine.launcher as launcher_module

    launches = _Launches()
    monkeypatch.setattr(launcher_module, "mx", launches)
    engine = _engine(model_dir, prefix_cache_bytes=0, decode_overlap=True)
    batch = GenerationBatch(engine, max_sequences=3)
    requests = _requests(engine, 3)
    for i, request in enumerate(requests[:2]):
        request = request.model_copy(update={"max_tokens": 30})
        batch.admit(str(i), request, lambda _t, _ids: None, lambda: False)
    while len(batch.decoding) < 2:
        assert not batch.step()
    assert not batch.step()  # a step whose launch is fine
    batch.quiet()
    launches.fail_next = True
    assert not batch.step()  # its launch fails on the other thread: seen later
    if seen_by == "quiet":
        batch.quiet()
        assert len(batch) == 2 and not batch.decoding
    batch.admit("2", requests[2], lambda _t, _ids: None, lambda: False)
    ended = batch.step()
    assert sorted(f.key for f in ended) == ["0", "1"]
    assert all(isinstance(f.error, RuntimeError) and "launch failed" in str(f.error) for f in ended)
    rest = [f for _ in range(200) if len(batch) for f in batch.step()]
    assert [f.key for f in rest] == ["2"] and rest[0].result is not None
    assert rest[0].result.token_ids == _alone(engine, requests[2])[0].token_ids
    batch.close()


def test_new_rows_first_tokens_reach_their_sinks_before_the_next_step_and_a_1_token_job_takes_none(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the overlap thread (the CPU) a new row's first token is handled before the next step is
    built (on the CPU a lone row's launch computes most of its step before it returns); later tokens
    after the next step's launch, as the device computes it meanwhile. A step whose tokens end every
    row takes no next step: a lone 1-token job computes no decode step at all."""
    assert not engine.decode_overlap
    steps = [0]
    real = DecodeBatch._next_step

    def counted(self: DecodeBatch, pending: mx.array) -> mx.array:
        steps[0] += 1
        return real(self, pending)

    monkeypatch.setattr(DecodeBatch, "_next_step", counted)
    seen: dict[int, list[int]] = {0: [], 1: []}  # per request: steps computed when each token arrived
    budgets = {0: 1, 1: 4}
    requests = [
        GenerateRequest(
            prompt=PROMPT + f"#{i}", max_tokens=budgets[i], temperature=0.0, logit_bias=_no_eos(engine)
        )
        for i in budgets
    ]
    batch = GenerationBatch(engine, max_sequences=2)
    for i, request in enumerate(requests):
        batch.admit(
            str(i), request, lambda _t, ids, i=i: seen[i].extend([steps[0]] * len(ids)), lambda: False
        )
    done = {f.key: f for _ in range(10) if len(batch) for f in batch.step()}
    assert seen == {0: [0], 1: [0, 2, 3, 4]} and steps[0] == 4
    for i, request in enumerate(requests):
        assert done[str(i)].result.token_ids == _alone(engine, request)[0].token_ids  # type: ignore[union-attr]

    steps[0] = 0
    batch = GenerationBatch(engine, max_sequences=1)
    batch.admit("lone", requests[0], lambda _t, _ids: None, lambda: False)
    assert [f.key for f in batch.step()] == ["lone"] and len(batch) == 0 and steps[0] == 0


def test_bad_requests_are_refused_at_admission(engine: Engine) -> None:
    batch = GenerationBatch(engine, max_sequences=2)
    with pytest.raises(InvalidRequest, match="logit_bias"):
        batch.admit(
            "a", GenerateRequest(prompt="hi", logit_bias={10**6: 1.0}), lambda t, i: None, lambda: False
        )
    with pytest.raises(ContextTooLong):
        batch.admit("b", GenerateRequest(prompt="word " * 600), lambda t, i: None, lambda: False)
    assert len(batch) == 0


def test_kv_budget_holds_newcomers_back_and_the_prefix_cache_is_shared(model_dir: Path) -> None:
    engine = _engine(model_dir)
    one = GenerateRequest(prompt=PROMPT * 4, max_tokens=12, temperature=0, logit_bias=_no_eos(engine))
    per_sequence = (len(engine.prompt_tokens(one)) + 12) * engine.kv_bytes_per_token
    batch = GenerationBatch(engine, max_sequences=3, kv_budget_bytes=per_sequence)  # room for one
    for i in range(3):
        batch.admit(str(i), one, lambda t, ids: None, lambda: False)
    done: list[Finished] = []
    while len(batch):
        assert len(batch.decoding) + (batch.prefilling is not None) <= 1
        done.extend(batch.step())
    results = [f.result for f in done]
    assert all(r is not None and r.token_ids == results[0].token_ids for r in results)  # type: ignore[union-attr]
    n = len(engine.prompt_tokens(one))
    assert [r.usage.cached_tokens for r in results] == [0, n - 1, n - 1]  # type: ignore[union-attr]


@pytest.mark.parametrize("pad_shapes", [False, True])
def test_a_prompt_with_a_long_cached_prefix_prefills_alone_into_the_cached_buffers(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, pad_shapes: bool
) -> None:
    """A cached prefix longer than a chunk is not spliced into a rows forward: the prompt prefills
    alone into the prefix cache's copy, and, joining an empty batch, hands those buffers to it."""
    import mlxq.worker.engine.cache.batch_cache as batch_cache

    engine = _engine(model_dir, pad_shapes=pad_shapes)
    rows_forwards = _record_rows_forwards(monkeypatch)
    history = GenerateRequest(prompt=PROMPT * 5, max_tokens=6, temperature=0, logit_bias=_no_eos(engine))
    follow_up = history.model_copy(update={"prompt": PROMPT * 5 + "And Berlin?", "max_tokens": 9})
    fresh = _engine(model_dir, prefix_cache_bytes=0, pad_shapes=pad_shapes)
    copies: list[int] = []
    pad = batch_cache.pad_columns

    def counted_pad(*args: Any) -> mx.array:
        copies.append(1)
        return pad(*args)

    for request in (history, follow_up):
        batch = GenerationBatch(engine, max_sequences=2)
        batch.admit("a", request, lambda _t, _ids: None, lambda: False)
        if request is follow_up:  # its few new tokens: prefilled and decoding in the first step, in
            monkeypatch.setattr(batch_cache, "pad_columns", counted_pad)  # the prefix cache's buffers,
            assert not batch.step() and len(batch.decoding) == 1  # which the batch takes over uncopied
            monkeypatch.setattr(batch_cache, "pad_columns", pad)
            assert copies == []
            assert batch.decode.cache[0].capacity == key_columns(len(engine.prompt_tokens(request)))
        done = [f for _ in range(50) if len(batch) for f in batch.step()]
        got = done[0].result
        assert got is not None and got.token_ids == _alone(fresh, request)[0].token_ids
    assert got.usage.cached_tokens > engine.options.prefill_chunk
    assert rows_forwards == []  # neither prompt went through a rows forward: both are long


def test_a_lone_row_hands_its_whole_step_buffers_to_an_empty_batch() -> None:
    row = KVCache()
    keys = mx.broadcast_to(mx.arange(3, dtype=mx.float32)[None, None, :, None], (1, 2, 3, 4))
    row.update_and_fetch(keys, -keys)  # a 256-column buffer holding 3 tokens
    buffer = row.keys
    cache = BatchKVCache()
    cache.add([row])
    assert cache.keys is buffer and row.keys is None and row.offset == 0  # taken over, not shared
    assert (cache.starts, cache.end, cache.capacity) == ([0], 3, cache.step)
    cache.add([KVCache.from_state(keys[:, :, :2], -keys[:, :, :2])])  # a second row: copied in, padded
    assert (cache.starts, cache.end, cache.lengths) == ([0, 1], 3, [3, 2])
    assert cache.row(0).state[0][0, 0, :, 0].tolist() == [0.0, 1.0, 2.0]
    assert cache.row(1).state[1][0, 0, :, 0].tolist() == [-0.0, -1.0]


@pytest.mark.parametrize("pad_shapes", [False, True])
def test_prompts_prefilled_together_equal_each_prefilled_alone(engine: Engine, pad_shapes: bool) -> None:
    """`prefill_rows`: ragged rows (different cached prefixes and new lengths) give each row exactly the
    logits and cache it gets alone, with or without rows, columns and cached columns padded."""
    model = engine.model
    prompts = [engine.tokenizer.encode(PROMPT * k + f"#{k}") for k in (1, 3, 2, 1)]
    cached = [0, 9, 4, 0]

    def cache_of(prompt: list[int], n: int) -> list[KVCache]:
        cache = model.make_cache()
        if n:
            prefill(model, prompt[:n], cache, chunk=64)
        return cache

    together, logits = prefill_rows(
        model, [(p[n:], cache_of(p, n)) for p, n in zip(prompts, cached, strict=True)], pad_shapes
    )
    assert logits.shape[0] == len(prompts)
    for i, (p, n) in enumerate(zip(prompts, cached, strict=True)):
        alone_cache = cache_of(p, n)
        alone_logits = prefill(model, p[n:], alone_cache, chunk=64, pad_shapes=pad_shapes)
        assert mx.array_equal(logits[i : i + 1], alone_logits), f"row {i}"
        for got, want in zip(together[i], alone_cache, strict=True):
            assert got.offset == want.offset == len(p)
            assert mx.array_equal(got.state[0], want.state[0]) and mx.array_equal(got.state[1], want.state[1])


@pytest.mark.parametrize("pad_shapes", [False, True])
def test_short_prompts_start_together_and_a_shared_prefix_is_computed_once(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, pad_shapes: bool
) -> None:
    groups = _record_rows_forwards(monkeypatch)
    engine = Engine.load(str(model_dir), EngineOptions(prefill_chunk=256, pad_shapes=pad_shapes))
    system = "You are a careful assistant who answers in one short sentence. " * 2
    prompts = [f"question {i} " * (1 + i % 4) for i in range(6)] + [system + f"ask {i}" for i in range(4)]
    requests = [
        GenerateRequest(
            prompt=p,
            max_tokens=6 + i % 5,
            logit_bias=_no_eos(engine),
            temperature=0.0 if i % 3 else 0.9,
            seed=i,
            repetition_penalty=1.3 if i % 4 == 1 else 1.0,
        )
        for i, p in enumerate(prompts)
    ]
    batch = GenerationBatch(engine, max_sequences=len(requests))
    for i, request in enumerate(requests):  # all waiting before the first step
        batch.admit(str(i), request, lambda t, ids: None, lambda: False)
    done = {int(f.key): f for _ in range(100) for f in batch.step()}
    assert len(batch) == 0
    assert max(groups) >= 6, groups  # the short distinct prompts started in one forward
    n_system = len(engine.tokenizer.encode(system))
    shared = [done[i].result.usage.cached_tokens for i in range(6, 10)]  # type: ignore[union-attr]
    assert shared[0] < n_system and all(c >= n_system - 1 for c in shared[1:]), shared
    alone_engine = Engine.load(str(model_dir), EngineOptions(prefill_chunk=256, prefix_cache_bytes=0))
    for i, request in enumerate(requests):
        want = _alone(alone_engine, request)[0]
        got = done[i].result
        assert got is not None, done[i].error
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)


def test_prompts_prefilled_together_reuse_a_cached_prefix_only_from_32_tokens(model_dir: Path) -> None:
    """Splicing a short cached prefix into a rows forward costs more than computing it (see
    `prefill_plan.SHARED_MIN`): a prompt sharing a few cached tokens starts from scratch, one sharing a long
    prefix reuses it; both generate what they generate alone."""
    engine = _engine(model_dir, prefix_cache_bytes=1 << 24)
    first = PROMPT * 12
    batch = GenerationBatch(engine, max_sequences=2)
    batch.admit("first", GenerateRequest(prompt=first, max_tokens=2), lambda t, ids: None, lambda: False)
    while len(batch):
        batch.step()
    ids = engine.tokenizer.encode(first)
    short, long = engine.tokenizer.decode(ids[:4]), engine.tokenizer.decode(ids[:48])
    assert engine.tokenizer.encode(long) == ids[:48]
    requests = {
        "short": GenerateRequest(
            prompt=short + " and Rome is in Italy.", max_tokens=4, temperature=0, logit_bias=_no_eos(engine)
        ),
        "long": GenerateRequest(
            prompt=long + " and Rome is in Italy.", max_tokens=4, temperature=0, logit_bias=_no_eos(engine)
        ),
    }
    for key, request in requests.items():
        batch.admit(key, request, lambda t, ids: None, lambda: False)
    done = {f.key: f for _ in range(20) for f in batch.step()}
    results = {key: done[key].result for key in requests}
    assert results["short"] is not None and results["short"].usage.cached_tokens == 0
    assert results["long"] is not None and results["long"].usage.cached_tokens >= 32
    alone = _engine(model_dir, prefix_cache_bytes=0)
    for key, request in requests.items():
        assert results[key].token_ids == _alone(alone, request)[0].token_ids  # type: ignore[union-attr]


@pytest.mark.parametrize("chunk", [16, 512])
def test_a_prompt_padded_to_a_common_length_prefills_exactly_as_unpadded(engine: Engine, chunk: int) -> None:
    """Chunks of 16 (the last one short, padded to 16), and one chunk padded to a halfway width."""
    model = engine.model
    tokens = engine.tokenizer.encode(PROMPT * 10)
    assert len(tokens) % 16 != 0
    if chunk > len(tokens):
        assert padded_width(len(tokens)) == 192 < padded_size(len(tokens)), len(tokens)
    plain, padded = model.make_cache(), model.make_cache()
    want = prefill(model, tokens, plain, chunk=chunk)
    got = prefill(model, tokens, padded, chunk=chunk, pad_shapes=True)
    assert mx.array_equal(got, want)
    for a, b in zip(padded, plain, strict=True):
        assert a.offset == b.offset == len(tokens)
        assert mx.array_equal(a.state[0], b.state[0]) and mx.array_equal(a.state[1], b.state[1])


def test_a_padded_decode_batch_runs_power_of_two_rows_and_decodes_the_same(engine: Engine) -> None:
    model = engine.model
    prompts = [engine.tokenizer.encode(PROMPT * k) for k in (1, 2, 3)]

    def start(pad: bool) -> DecodeBatch:
        batch = DecodeBatch(model, pad_shapes=pad)
        caches = [model.make_cache() for _ in prompts]
        logits = [prefill(model, p, c, chunk=64) for p, c in zip(prompts, caches, strict=True)]
        batch.add(
            caches, mx.concatenate(logits), [Sampler(model.args.vocab_size, temperature=0) for _ in prompts]
        )
        return batch

    plain, padded = start(False), start(True)
    assert (plain.cache[0].batch, padded.cache[0].batch) == (3, 4)
    steps = [(plain.step(), padded.step()) for _ in range(3)]
    plain.remove([1])
    padded.remove([1])
    assert (len(padded), padded.cache[0].batch) == (2, 2)  # the padding row went with it
    steps += [(plain.step(), padded.step()) for _ in range(3)]
    assert all(a == b for a, b in steps), steps


def test_rows_that_leave_a_padded_batch_stay_idle_until_it_can_shrink(engine: Engine) -> None:
    """A padded batch keeps a departed row's buffer row as an idle row (no copy of the buffers) while
    the live rows still need that many; it compacts once they fit half. A row joining is written into
    an idle row when one is free, else the buffers grow. The tokens are those of a batch that compacts
    at every departure and appends every newcomer (`pad_shapes` off)."""
    model = engine.model
    ids = engine.tokenizer.encode(PROMPT * 8)
    prompts = [ids[: 20 + 7 * k] for k in range(8)]

    def join(batch: DecodeBatch, rows: list[list[int]]) -> None:
        caches = [model.make_cache() for _ in rows]
        logits = [prefill(model, p, c, chunk=64) for p, c in zip(rows, caches, strict=True)]
        samplers = [Sampler(model.args.vocab_size, temperature=0) for _ in rows]
        batch.add(caches, mx.concatenate(logits), samplers)

    plain, padded = DecodeBatch(model, pad_shapes=False), DecodeBatch(model, pad_shapes=True)
    for b in (plain, padded):
        join(b, prompts[:6])
    steps = [(plain.step(), padded.step()) for _ in range(2)]
    left = [(plain.remove([1]), padded.remove([1]))]
    assert (len(padded), padded.cache[0].batch, padded.placement.slots) == (5, 8, [0, 2, 3, 4, 5])
    steps += [(plain.step(), padded.step()) for _ in range(2)]
    left.append((plain.remove([3]), padded.remove([3])))  # 4 live rows fit 4: compacted
    assert (len(padded), padded.cache[0].batch, padded.placement.slots) == (4, 4, [0, 1, 2, 3])
    steps += [(plain.step(), padded.step()) for _ in range(2)]
    left.append((plain.remove([2]), padded.remove([2])))
    assert (padded.cache[0].batch, padded.placement.slots) == (4, [0, 1, 3])
    steps += [(plain.step(), padded.step()) for _ in range(2)]
    keys_before = padded.cache[0].keys
    for b in (plain, padded):
        join(b, prompts[:1])  # fits the idle row: written there, the buffers not copied
    assert (len(padded), padded.cache[0].batch, padded.placement.slots) == (4, 4, [0, 1, 3, 2])
    assert padded.cache[0].keys.shape == keys_before.shape  # type: ignore[union-attr]
    steps += [(plain.step(), padded.step()) for _ in range(2)]
    for b in (plain, padded):
        join(b, prompts[6:])  # no idle row left: the buffers grow to 8 rows, in row order
    assert (len(padded), padded.cache[0].batch, padded.placement.slots) == (6, 8, [0, 1, 2, 3, 4, 5])
    steps += [(plain.step(), padded.step()) for _ in range(3)]
    bad = [i for i, (a, b) in enumerate(steps) if a != b]
    assert not bad, (bad, [steps[i] for i in bad])
    for want, got in left:  # each departed row's cache holds exactly its own tokens
        for a, b in zip(want, got, strict=True):
            assert [x.offset for x in a] == [x.offset for x in b]
            assert all(mx.array_equal(x.state[0], y.state[0]) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("pad", [False, True])
def test_the_ragged_attention_path_decodes_what_the_mask_path_decodes(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, pad: bool
) -> None:
    """With `ragged_kernel` the model gets each row's first column instead of a mask (on a GPU the
    CUDA kernel reads the buffers; here `decode_attention` computes the same with MLX): same tokens,
    across a growth of the buffers (rows near 256 columns) and with padding rows. The fused model
    rotates q and k together and hands attention both (`Attention._ragged_step`)."""
    model = engine.model
    ids = engine.tokenizer.encode(PROMPT * 60)
    prompts = [ids[:n] for n in (40, 120, 250)]
    calls = []
    original = attention.decode_attention

    def counted(*a: Any, **k: Any) -> mx.array:  # (heads in the array handed over, query heads)
        calls.append((a[0].shape[1], k["heads"]))
        return original(*a, **k)

    monkeypatch.setattr(attention, "decode_attention", counted)

    def start(kernel: bool) -> DecodeBatch:
        batch = DecodeBatch(model, pad_shapes=pad, ragged_kernel=kernel)
        caches = [model.make_cache() for _ in prompts]
        logits = [prefill(model, p, c, chunk=64) for p, c in zip(prompts, caches, strict=True)]
        samplers = [Sampler(model.args.vocab_size, temperature=0) for _ in prompts]
        batch.add(caches, mx.concatenate(logits), samplers)
        return batch

    masked, ragged = start(False), start(True)
    steps = [(masked.step(), ragged.step()) for _ in range(12)]  # the longest row passes 256 columns
    assert ragged.cache[0].capacity > 256
    masked.remove([0])
    ragged.remove([0])
    steps += [(masked.step(), ragged.step()) for _ in range(3)]
    assert all(a == b for a, b in steps), steps
    assert calls and len(calls) == 15 * len(model.layers)
    args = model.args
    assert set(calls) == {(args.num_attention_heads + args.n_kv_heads, args.num_attention_heads)}


def _burst_requests(engine: Engine, system: str) -> list[GenerateRequest]:
    prompts = [f"question {i} " * (1 + i % 4) for i in range(8)] + [system + f"ask {i}" for i in range(4)]
    return [
        GenerateRequest(
            prompt=p,
            max_tokens=4 + i % 5,
            logit_bias=_no_eos(engine),
            temperature=0.0 if i % 3 else 0.9,
            seed=i,
        )
        for i, p in enumerate(prompts)
    ]


@pytest.mark.parametrize("pad_shapes", [False, True])
def test_a_burst_of_new_requests_prefills_in_one_step_in_as_few_forwards_as_it_can(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, pad_shapes: bool
) -> None:
    """With no request decoding, a step prefills up to `idle_prefill_tokens` (in one forward where the
    prompts allow, one wait); a prompt sharing a batch-mate's long prefix waits for the step's next
    forward and takes that prefix from the prefix cache. Results are what each request gives alone."""
    groups = _record_rows_forwards(monkeypatch)
    started: list[bool] = []  # DecodeBatch.start: rows taken straight from a forward's buffers
    real_start = DecodeBatch.start
    monkeypatch.setattr(DecodeBatch, "start", lambda *a: started.append(real_start(*a)) or started[-1])
    system = "You are a careful assistant who answers in one short sentence. " * 2
    alone_engine = Engine.load(str(model_dir), EngineOptions(prefill_chunk=256, prefix_cache_bytes=0))
    requests = _burst_requests(alone_engine, system)
    per_step: dict[int, list[int]] = {}
    for idle in (0, 4096):  # 0: one chunk a step, as while requests decode
        engine = Engine.load(
            str(model_dir), EngineOptions(prefill_chunk=256, pad_shapes=pad_shapes, idle_prefill_tokens=idle)
        )
        batch = GenerationBatch(engine, max_sequences=len(requests))
        for i, request in enumerate(requests):  # all waiting before the first step
            batch.admit(str(i), request, lambda t, ids: None, lambda: False)
        groups.clear()
        started.clear()
        first = batch.step()
        per_step[idle] = list(groups)
        assert started == [True]  # the first forward hands an empty batch its buffers, the next ones join it
        assert not first and len(batch.decoding) == sum(groups)
        done = {int(f.key): f for _ in range(100) for f in batch.step()}
        assert len(batch) == 0 and len(done) == len(requests)
        n_system = len(engine.tokenizer.encode(system))
        shared = [done[i].result.usage.cached_tokens for i in range(8, 12)]  # type: ignore[union-attr]
        assert shared[0] < n_system and all(c >= n_system - 1 for c in shared[1:]), shared
        for i, request in enumerate(requests):
            want = _alone(alone_engine, request)[0]
            got = done[i].result
            assert got is not None, done[i].error
            assert (got.token_ids, got.text) == (want.token_ids, want.text), f"request {i}"
            assert got.finish_reason == want.finish_reason
    assert len(per_step[0]) == 1 and per_step[0][0] < len(requests)  # one forward of at most a chunk
    assert per_step[4096] == [9, 3], per_step  # every prompt: the shared prefix once, then its sharers


def test_a_burst_whose_wait_fails_fails_its_requests_alone_and_the_batch_goes_on(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one wait after a burst's forwards runs out of memory: each of its requests fails with a
    message that says so (none is lost), and the batch serves the next requests."""
    import mlxq.worker.engine.batch_prefill as batch_prefill

    class FailingWait:
        failures = 1

        def __getattr__(self, name: str) -> Any:
            return getattr(mx, name)

        def eval(self, *args: Any) -> None:
            if self.failures and isinstance(args[0], list):  # the wait after a burst
                self.failures -= 1
                raise RuntimeError("[malloc] Unable to allocate 1073741824 bytes")
            mx.eval(*args)

    monkeypatch.setattr(batch_prefill, "mx", FailingWait())
    engine = Engine.load(
        str(model_dir), EngineOptions(prefill_chunk=256, prefix_cache_bytes=0, idle_prefill_tokens=4096)
    )
    requests = _burst_requests(engine, "A shared system prompt. ")
    batch = GenerationBatch(engine, max_sequences=len(requests))
    for i, request in enumerate(requests):
        batch.admit(str(i), request, lambda t, ids: None, lambda: False)
    failed = batch.step()
    assert len(failed) == len(requests) and len(batch) == 0
    assert all(f.result is None and "out of memory" in str(f.error) for f in failed)
    batch.admit("next", requests[0], lambda t, ids: None, lambda: False)
    done = [f for _ in range(20) for f in batch.step()]
    assert [f.key for f in done] == ["next"] and done[0].result is not None
    assert done[0].result.token_ids == _alone(engine, requests[0])[0].token_ids


def test_finished_requests_reach_the_prefix_cache_after_their_results(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A finished request's cache is offered by `settle` (the worker's, after it wrote the results; or
    the next step's), not before its result is returned; an offer that fails costs nothing but the
    cache entry."""
    engine = _engine(model_dir, prefix_cache_bytes=1 << 24)
    assert engine.prefix_cache is not None
    request = GenerateRequest(prompt=PROMPT * 3, max_tokens=5, temperature=0, logit_bias=_no_eos(engine))
    prompt = engine.prompt_tokens(request)
    batch = GenerationBatch(engine, max_sequences=2)
    batch.admit("a", request, lambda t, ids: None, lambda: False)
    done: list[Finished] = []
    while not done:
        done = batch.step()
    result = done[0].result
    assert result is not None and len(result.token_ids) == 5
    tokens = prompt + result.token_ids
    assert engine.prefix_cache.peek(tokens) == len(prompt)  # the prompt, offered when it was prefilled
    batch.settle()
    assert engine.prefix_cache.peek(tokens) == len(tokens) - 1  # the last token was never fed

    def fail(*args: Any) -> int:
        raise RuntimeError("[malloc] Unable to allocate 4096 bytes")

    batch.admit("b", request.model_copy(update={"prompt": "Rome. " * 9}), lambda t, ids: None, lambda: False)
    done = []
    while not done:
        done = batch.step()
    with monkeypatch.context() as patched:
        patched.setattr(engine.prefix_cache, "offer", fail)
        batch.settle()
    assert done[0].result is not None and "could not go to the prefix cache" in caplog.text
    batch.admit("c", request, lambda t, ids: None, lambda: False)
    done = [f for _ in range(20) for f in batch.step()]
    assert done[0].result is not None and done[0].result.token_ids == result.token_ids


# --- a request's check between every piece of its work (a job's deadline) ---------------------------


class _PastDeadline(Exception):
    pass


@pytest.fixture
def forwards(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The shape of every model forward run from now on (prefill chunks, prefill rows, decode steps),
    as (rows, width): a flat decode step's ids (rows,) are one column wide (`Model.flat_steps`)."""
    shapes: list[tuple[int, ...]] = []
    forward = llama.LlamaModel.__call__

    def counted(self: llama.LlamaModel, inputs: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        shapes.append(tuple(inputs.shape) if inputs.ndim == 2 else (inputs.shape[0], 1))
        return forward(self, inputs, *args, **kwargs)

    monkeypatch.setattr(llama.LlamaModel, "__call__", counted)
    return shapes


def _past_after(forwards: list[tuple[int, ...]], n: int) -> Callable[[], bool]:
    """A request's check whose deadline passes once `n` forwards have run."""

    def check() -> bool:
        if len(forwards) >= n:
            raise _PastDeadline(f"past its deadline after {n} forwards")
        return False

    return check


def test_admitting_calls_the_check_after_tokenizing_and_compiling_stops(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, forwards: list[tuple[int, ...]]
) -> None:
    events: list[str] = []
    encode = engine.tokenizer.encode
    monkeypatch.setattr(
        engine.tokenizer, "encode", lambda *a, **k: events.append("encode") or encode(*a, **k)
    )

    def check() -> bool:
        events.append("check")
        raise _PastDeadline("the prompt took the job's time")

    batch = GenerationBatch(engine, max_sequences=2)
    with pytest.raises(_PastDeadline):
        batch.admit("late", GenerateRequest(prompt=PROMPT, stop=["xyz"]), lambda _t, _i: None, check)
    assert events == ["encode", "check"] and len(batch) == 0 and forwards == []


def test_a_deadline_stops_a_long_prefill_between_chunks_and_the_batch_goes_on(
    engine: Engine, forwards: list[tuple[int, ...]]
) -> None:
    long = GenerateRequest(prompt=PROMPT * 12, max_tokens=4, logit_bias=_no_eos(engine))
    canary = GenerateRequest(prompt="hi", max_tokens=4, temperature=0, logit_bias=_no_eos(engine))
    chunks = -(-len(engine.prompt_tokens(long)) // engine.options.prefill_chunk)
    assert chunks >= 6
    batch = GenerationBatch(engine, max_sequences=2)
    batch.admit("0", long, lambda _t, _i: None, _past_after(forwards, 3))
    batch.admit("1", canary, lambda _t, _i: None, lambda: False)
    done: dict[str, Finished] = {}
    at_end: dict[str, int] = {}
    while len(batch):
        for f in batch.step():
            done[f.key], at_end[f.key] = f, len(forwards)
    assert isinstance(done["0"].error, _PastDeadline) and at_end["0"] == 3 < chunks
    assert done["1"].result is not None
    assert done["1"].result.token_ids == _alone(engine, canary)[0].token_ids


def test_a_deadline_is_checked_before_each_forward_of_a_burst_of_prompts(
    model_dir: Path, forwards: list[tuple[int, ...]]
) -> None:
    """While nothing decodes a step prefills several forwards of short prompts; a prompt whose deadline
    passed during the step's first forward fails before its own, the others go on."""
    engine = _engine(model_dir, prefix_cache_bytes=0, idle_prefill_tokens=64)
    prompts = [f"{PROMPT}#{i}" for i in range(6)]
    requests = [GenerateRequest(prompt=p, max_tokens=2, temperature=0) for p in prompts]
    assert all(8 < len(engine.prompt_tokens(r)) <= 16 for r in requests)
    batch = GenerationBatch(engine, max_sequences=6)
    for i, request in enumerate(requests):
        check = _past_after(forwards, 1) if i == 4 else (lambda: False)
        batch.admit(str(i), request, lambda _t, _i: None, check)
    first = batch.step()
    groups = [shape for shape in forwards if shape[1] > 1]  # prefill forwards (decode steps: width 1)
    assert groups == [(4, groups[0][1])]  # the first four together; the fifth's forward never ran
    assert [f.key for f in first if f.error is not None] == ["4"]
    assert isinstance(first[0].error, _PastDeadline)
    done = {f.key: f for f in first}
    while len(batch):
        done.update((f.key, f) for f in batch.step())
    assert all(done[str(i)].result is not None for i in (0, 1, 2, 3, 5))


def test_engines_made_on_one_thread_share_its_launcher_and_each_decodes_as_a_plain_engine(
    model_dir: Path,
) -> None:
    """A thread has one default stream: a second engine with its own launcher made its stream the
    default, and the first engine's steps then ran on it from two launch threads (a CUDA graph capture
    failed: a benchmark's side-by-side engines). Now both hold the thread's one launcher; the first to
    close leaves it to the other, the last puts the thread's own stream back."""
    stream = mx.default_stream(mx.default_device())
    plain = _engine(model_dir, prefix_cache_bytes=0)
    a = _engine(model_dir, prefix_cache_bytes=0, decode_overlap=True)
    b = _engine(model_dir, prefix_cache_bytes=0, decode_overlap=True)
    shared = a.launcher()
    assert shared is not None and b.launcher() is shared
    requests = _requests(plain, 4)
    for request in requests:  # the two engines take turns on the one launcher
        want = _alone(plain, request)[0].token_ids
        assert _alone(a, request)[0].token_ids == want
        assert _alone(b, request)[0].token_ids == want
    a.close()
    assert (
        b.launcher() is shared
        and _alone(b, requests[0])[0].token_ids == _alone(plain, requests[0])[0].token_ids
    )
    b.close()
    assert mx.default_stream(mx.default_device()) == stream
