"""Probe: what one batched decode step costs, and what a prefill shape seen for the first time costs.

    python -m bench.batch_step [--model tiny|llama-1b|PATH] [--rows 64] [--context 128] [--steps 64]
        [--dense-rows N]

Per-step milliseconds, B rows at about `--context` tokens, each path warmed up first:
- hand loop: the model with a plain batch `KVCache`, rows of equal length, one argmax (the floor);
- mlx-lm's model in the same hand loop (its own cache);
- `DecodeBatch`, rows of equal length (no mask), greedy samplers;
- `DecodeBatch`, ragged rows (left padding: the boolean mask), greedy samplers;
- the same with a logit bias on every row (the benchmarks' EOS mask);
and for the last one, the Python time to build a step's graph (no evaluation); then one `DecodeBatch` step
split between device syncs: graph building, the launch (`async_eval` with the device idle: host work
alone), what the device still runs after the launch, and reading the tokens back (host-bound when the
launch dominates; `MLX_MAX_OPS_PER_BUFFER` large makes "device after launch" the whole device time).
Then `prefill_rows` for (rows, width) shapes seen for the first time and again.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from worker.engine import ragged_attention

from .checkpoints import checkpoint


def _time_steps(step: Any, steps: int) -> float:
    for _ in range(4):
        step()
    mx.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    mx.synchronize()
    return (time.perf_counter() - t0) / steps * 1000


def _hand_loop(model: Any, cache: list[Any], rows: int, context: int) -> Any:
    ids = mx.array([[random.randrange(100, 1000) for _ in range(context)] for _ in range(rows)])
    logits = model(ids, cache=cache)[:, -1, :]
    state = {"tok": mx.argmax(logits, axis=-1)}
    mx.eval(state["tok"])

    def step() -> None:
        nxt = mx.argmax(model(state["tok"][:, None], cache=cache)[:, -1, :], axis=-1)
        mx.async_eval(nxt)
        state["tok"].tolist()
        state["tok"] = nxt

    return step


def _decode_batch(
    engine: Any, rows: int, context: int, ragged: bool, bias: bool, kernel: bool | None = False
) -> Any:
    from worker.engine.generate import DecodeBatch, prefill
    from worker.engine.sampler import Sampler

    random.seed(rows * 1000 + context)
    vocab = engine.model.args.vocab_size
    batch = DecodeBatch(engine.model, ragged_kernel=kernel)
    caches, logits, samplers = [], [], []
    for i in range(rows):
        n = context - (i * 7) % 48 if ragged else context
        cache = engine.model.make_cache()
        logits.append(prefill(engine.model, [random.randrange(100, 1000) for _ in range(n)], cache, 4096))
        caches.append(cache)
        samplers.append(Sampler(vocab, temperature=0.0, logit_bias={0: -100.0} if bias else None))
    batch.add(caches, mx.concatenate(logits), samplers)
    return batch.step, batch


_PARTS = ("graph", "launch", "device", "read")


class _SyncedMx:
    """`mlx.core` as `worker.engine.generate` sees it, with `async_eval` run between device syncs and timed:
    what the host spends launching a step, and what the device still has to do once it is launched."""

    def __init__(self, parts: dict[str, list[float]]) -> None:
        self._parts = parts
        self.mark = 0.0  # when the step began (set by the caller)

    def __getattr__(self, name: str) -> Any:
        return getattr(mx, name)

    def async_eval(self, *args: Any) -> None:
        t0 = time.perf_counter()
        mx.synchronize()  # the step before, if still running, is not this step's launch
        t1 = time.perf_counter()
        mx.async_eval(*args)
        t2 = time.perf_counter()
        mx.synchronize()
        t3 = time.perf_counter()
        self._parts["graph"].append((t0 - self.mark) * 1000)
        self._parts["launch"].append((t2 - t1) * 1000)
        self._parts["device"].append((t3 - t2) * 1000)
        self.mark = t3  # what follows is reading the tokens back


def _anatomy(engine: Any, rows: int, context: int, steps: int) -> dict[str, list[float]]:
    """A `DecodeBatch` step split into graph building, launch and device time (see `_SyncedMx`)."""
    import worker.engine.generate as generate_module

    step, _ = _decode_batch(engine, rows, context, True, True, None)
    for _ in range(4):
        step()
    parts: dict[str, list[float]] = {k: [] for k in _PARTS}
    synced = _SyncedMx(parts)
    generate_module.mx = synced  # type: ignore[assignment]
    try:
        for _ in range(steps):
            synced.mark = time.perf_counter()
            step()
            parts["read"].append((time.perf_counter() - synced.mark) * 1000)
    finally:
        generate_module.mx = mx
    return parts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.batch_step")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--dense-rows", type=int, help="EngineOptions.dense_rows (a quantized model) [default]")
    args = ap.parse_args(argv)
    random.seed(0)
    from worker.engine.engine import Engine, EngineOptions

    path = checkpoint(args.model, Path.home() / ".cache/mlxq/bench-models")
    engine = Engine.load(str(path), EngineOptions(dense_rows=args.dense_rows))
    b, n, steps = args.rows, args.context, args.steps
    out: list[tuple[str, float]] = []
    out.append(
        (
            "hand loop, mlxq model",
            _time_steps(_hand_loop(engine.model, engine.model.make_cache(), b, n), steps),
        )
    )
    try:
        from mlx_lm import load as mlx_lm_load
        from mlx_lm.models.cache import make_prompt_cache

        ref, _ = mlx_lm_load(str(path))
        out.append(
            ("hand loop, mlx-lm model", _time_steps(_hand_loop(ref, make_prompt_cache(ref), b, n), steps))
        )
        del ref
    except ImportError:
        pass
    for name, ragged, bias, kernel in (
        ("DecodeBatch, equal rows", False, False, False),
        ("DecodeBatch, ragged rows (mask)", True, False, False),
        ("DecodeBatch, ragged rows, logit bias", True, True, False),
        ("DecodeBatch, ragged rows, ragged-attention kernel", True, False, None),
    ):
        step, batch = _decode_batch(engine, b, n, ragged, bias, kernel)
        out.append((name, _time_steps(step, steps)))
    if ragged_attention.available():  # the kernel's tokens against the masked path's, same prompts
        runs = []
        for kernel in (False, True):
            step, _ = _decode_batch(engine, b, n, True, False, kernel)
            runs.append([step() for _ in range(32)])
        same = sum(all(a[r] == k[r] for a, k in zip(*runs, strict=True)) for r in range(b))
        print(f"ragged-attention kernel vs masked attention: {same}/{b} rows give the same 32 greedy tokens")
    anatomy = _anatomy(engine, b, n, steps)
    t0 = time.perf_counter()
    for _ in range(steps):
        mask = batch.cache[0].mask()
        logits = batch.model(batch._pending[:, None], cache=batch.cache, mask=mask)[:, -1, :]
        assert batch.rows is not None
        batch.rows.sample(logits)
        for layer in batch.cache:  # undo the column the unevaluated graph appended
            layer.end -= 1
    out.append(("graph building only (ragged, bias), no eval", (time.perf_counter() - t0) / steps * 1000))
    print(f"model={args.model} rows={b} context~{n} steps={steps} device={mx.default_device()}")
    print("| path | ms/step | tok/s |\n| --- | --- | --- |")
    for name, ms in out:
        print(f"| {name} | {ms:.2f} | {b / ms * 1000:,.0f} |")
    print(
        "\nDecodeBatch step (ragged rows, logit bias, default attention), each part between device syncs, "
        "median ms:\n\n| graph building | launch (async_eval, device idle) | device after launch | "
        "read back |\n| --- | --- | --- | --- |"
    )
    print("| " + " | ".join(f"{statistics.median(anatomy[k]):.2f}" for k in _PARTS) + " |")
    from worker.engine.generate import prefill_rows

    print("\n| prefill_rows (rows x width) | padded | first ms | again ms |\n| --- | --- | --- | --- |")
    for pad in (True, False):
        for rows, width in ((16, 127), (13, 121), (16, 128), (7, 99)):
            times = []
            for _ in range(2):
                mx.synchronize()
                t0 = time.perf_counter()
                rows_in = [
                    ([random.randrange(100, 1000) for _ in range(width - (i % 3))], engine.model.make_cache())
                    for i in range(rows)
                ]
                _, logits = prefill_rows(engine.model, rows_in, pad)
                mx.eval(logits)
                times.append((time.perf_counter() - t0) * 1000)
            print(f"| {rows} x {width} | {pad} | {times[0]:.1f} | {times[1]:.1f} |")
    print("\n| DecodeBatch rows (new count) | first step ms | next steps ms |\n| --- | --- | --- |")
    for rows in (33, 35, 37):
        step, _ = _decode_batch(engine, rows, n, True, True)
        mx.synchronize()
        t0 = time.perf_counter()
        step()
        step()
        mx.synchronize()
        first = (time.perf_counter() - t0) * 1000
        print(f"| {rows} | {first:.1f} | {_time_steps(step, 8):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
