"""Probe (temporary, issue 34): does launching a graph wait while the device still runs one of the same shape?

MLX's CUDA backend caches graph executables by their structure and relaunches a cached one after
updating it in place. If a launch of an executable has to wait until its previous launch is done, then
`async_eval` of a graph shaped like one still queued costs the host about that graph's device time.
Measured here: the host time of `async_eval` (a) with the device idle, (b) right behind a same-shaped
graph, (c) right behind a graph of another shape; and each graph's device time.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import mlx.core as mx


def chain(x: mx.array, w: mx.array, n: int) -> mx.array:
    for _ in range(n):
        x = mx.tanh(x @ w) * 0.5
    return x


def main() -> None:
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    reps = 12
    w = mx.random.normal((size, size)).astype(mx.bfloat16) * (1.0 / size**0.5)
    xs = [mx.random.normal((size, size)).astype(mx.bfloat16) for _ in range(4)]
    mx.eval(w, *xs)

    def same(i: int) -> mx.array:
        return chain(xs[i % 4], w, n)

    def other(i: int) -> mx.array:
        return chain(xs[i % 4], w, n + 7)

    for f in (same, other):  # warm both shapes' executables
        for i in range(3):
            mx.eval(f(i))
    keys = ("device_ms", "idle_ms", "behind_same_ms", "behind_other_ms")
    out: dict[str, list[float]] = {k: [] for k in keys}
    for r in range(reps):
        g = same(r)
        mx.synchronize()
        t = time.perf_counter()
        mx.eval(g)
        out["device_ms"].append((time.perf_counter() - t) * 1e3)

        g = same(r + 1)
        mx.synchronize()
        t = time.perf_counter()
        mx.async_eval(g)
        out["idle_ms"].append((time.perf_counter() - t) * 1e3)
        mx.eval(g)

        for key, first in (("behind_same_ms", same), ("behind_other_ms", other)):
            a, b = first(r + 2), same(r + 3)
            mx.synchronize()
            mx.async_eval(a)
            t = time.perf_counter()
            mx.async_eval(b)
            out[key].append((time.perf_counter() - t) * 1e3)
            mx.eval(a, b)
    summary = {
        k: {"median": statistics.median(v[2:]), "min": min(v[2:]), "max": max(v[2:])} for k, v in out.items()
    }
    print(json.dumps({"size": size, "ops_per_graph": 3 * n, "device": str(mx.default_device()), **summary}))


if __name__ == "__main__":
    main()
