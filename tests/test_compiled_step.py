"""The compiled decode step (`worker/compiled_step.py`) decodes what the uncompiled step decodes, and
replays its trace: a new trace only for a new number of rows or buffer capacity."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from worker.compiled_step import CompiledStep
from worker.engine import Engine, EngineOptions
from worker.generate import DecodeBatch, prefill
from worker.sampler import Sampler
from worker.tiny_model import write_random_checkpoint

PROMPT = "The capital of France is Paris. "


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = write_random_checkpoint(tmp_path_factory.mktemp("tiny"), {"max_position_embeddings": 1024})
    return Engine.load(str(path), EngineOptions(prefix_cache_bytes=0))


class _CountingStep(CompiledStep):
    """Counts the traces: Python runs `_forward` only while `mx.compile` traces it."""

    def __init__(self, model: object) -> None:
        self.traces: list[tuple[int, int]] = []
        super().__init__(model)

    def _forward(
        self, tokens: mx.array, end: mx.array, starts: mx.array, *buffers: mx.array
    ) -> list[mx.array]:
        self.traces.append((tokens.shape[0], buffers[0].shape[2]))
        return super()._forward(tokens, end, starts, *buffers)


@pytest.mark.parametrize("pad_shapes", [False, True])
def test_the_compiled_step_decodes_what_the_uncompiled_step_decodes(engine: Engine, pad_shapes: bool) -> None:
    """Rows of different lengths joining (into idle rows and by growing the buffers) and leaving, the
    buffers growing past 256 and 512 columns, sampled rows beside greedy ones: the same tokens at every
    step (float32 on the CPU), and one trace per (rows, capacity) met."""
    model = engine.model
    ids = engine.tokenizer.encode(PROMPT * 80)
    prompts = [ids[: 30 + 37 * k] for k in range(6)]
    compiled = _CountingStep(model)

    def join(batch: DecodeBatch, rows: list[list[int]], seed: int) -> None:
        caches = [model.make_cache() for _ in rows]
        logits = [prefill(model, p, c, chunk=64) for p, c in zip(rows, caches, strict=True)]
        samplers = [
            Sampler(model.args.vocab_size, temperature=0.0 if i % 2 else 0.9, top_p=0.9, seed=seed + i)
            for i in range(len(rows))
        ]
        batch.add(caches, mx.concatenate(logits), samplers)

    plain = DecodeBatch(model, pad_shapes=pad_shapes)
    fast = DecodeBatch(model, pad_shapes=pad_shapes, compiled=compiled)
    for b in (plain, fast):
        join(b, prompts[:3], 0)
    steps = [(plain.step(), fast.step()) for _ in range(40)]
    for b in (plain, fast):
        b.remove([1])
        join(b, prompts[3:5], 10)
    steps += [(plain.step(), fast.step()) for _ in range(30)]
    for b in (plain, fast):
        b.remove([0, 2])
        join(b, prompts[5:], 20)
    steps += [(plain.step(), fast.step()) for _ in range(300)]
    assert fast.cache[0].capacity > 512
    bad = [i for i, (a, b) in enumerate(steps) if a != b]
    assert not bad, (bad[:3], [steps[i] for i in bad[:3]])
    assert len(compiled.traces) == len(set(compiled.traces)) < 10, compiled.traces
    (want,), (got,) = plain.remove([0]), fast.remove([0])  # a leaving row's cache: its own tokens
    for x, y in zip(want, got, strict=True):
        assert x.offset == y.offset and all(map(mx.array_equal, x.state, y.state))


def test_the_engine_compiles_decode_steps_where_told(engine: Engine, tmp_path: Path) -> None:
    """`compile_decode`: off by default (measured slower on CUDA, `compiled_step.py`), on when told."""
    assert engine.decode_step is None
    on = Engine(
        engine.model, engine.tokenizer, engine.config, engine.name, EngineOptions(compile_decode=True)
    )
    assert isinstance(on.decode_step, CompiledStep)
