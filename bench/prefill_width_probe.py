"""A rows prefill forward's time by rows and padded width, the shapes alternated (`python3 -m
bench.prefill_width_probe`, ~40 s on the H200 with the 1B shape; prints a table). The 130-token prompts
of `bench.batch_generate` pad to 256 columns as powers of two and to 192 with `generate.padded_width`;
8 rows is a forward of one 2,048-token chunk, 64 rows a burst in one forward (`MLXQ_IDLE_PREFILL_TOKENS`)."""

import statistics
import time
from pathlib import Path

import mlx.core as mx

from bench.checkpoints import checkpoint
from worker.engine import Engine


def main() -> None:
    path = checkpoint("llama-1b", Path.home() / ".cache/mlxq/bench-models")
    engine = Engine.load(str(path))
    model = engine.model
    times: dict[tuple[int, int], list[float]] = {}
    shapes = [(8, 192), (8, 256), (64, 192), (64, 256)]
    for rep in range(12):
        for rows, width in shapes:
            ids = mx.zeros((rows, width), dtype=mx.int32)
            mx.eval(ids)
            t = time.perf_counter()
            h = model.hidden(ids, cache=model.make_cache(), last=width - 1)
            mx.eval(model.logits(h[:, -1, :]))
            if rep >= 2:
                times.setdefault((rows, width), []).append(time.perf_counter() - t)
    print("| rows | width | forward ms median (min-max) |\n| --- | --- | --- |")
    for (rows, width), ts in times.items():
        ms = [t * 1e3 for t in ts]
        print(f"| {rows} | {width} | {statistics.median(ms):.2f} ({min(ms):.2f}-{max(ms):.2f}) |")


if __name__ == "__main__":
    main()
