"""Probe: what storing a finished row in the prefix cache costs (`PrefixCache.offer`).

    python -m bench.offer_probe [--model llama-1b|tiny|PATH] [--rows 64] [--tokens 256] [--full-rows N]
        [--nodes 100,1000,5000]

A decode batch of `--rows` rows of `--tokens` tokens is built (random keys/values in the model's cache
shape), and each row is offered to a fresh prefix cache the way a finished row is (`DecodeBatch.remove`
gives a view of the batch buffers). Per offer, milliseconds: on the host (the call returns; copies
queued) and between device syncs (the copies done), for the cache's copy as it is and for variants:
one copy per array instead of one block, and no copy at all (views kept: not usable, the floor).
Then the cache's copy as it is into a full cache: a budget of `--full-rows` rows (default a quarter of
`--rows`), filled by the first ones untimed, so every timed offer evicts one, as in a worker whose cache
has filled (on the H200 the
workers' offers cost ~0.65 ms each while their cache filled, 1.3-2 ms once it was full:
`bench/HISTORY.md`); and into a full cache of `--nodes` small nodes (16 tokens each), host time only:
what eviction costs as the trie grows. Prints a table; writes nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from .checkpoints import checkpoint


def _batch(model: Any, rows: int, tokens: int) -> Any:
    from worker.engine.cache.batch_cache import BatchKVCache
    from worker.engine.cache.kv_cache import KVCache

    layers = []
    shape = (rows, model.args.n_kv_heads, tokens, model.args.head_dim)
    for _ in model.layers:
        keys = mx.random.normal(shape).astype(mx.bfloat16)
        values = mx.random.normal(shape).astype(mx.bfloat16)
        cache = BatchKVCache()
        cache.add([KVCache.from_state(keys[i : i + 1], values[i : i + 1]) for i in range(rows)])
        layers.append(cache)
    mx.eval([(c.keys, c.values) for c in layers])
    return layers


def _offers(
    layers: list[Any], rows: int, tokens: int, sync: bool, budget: int = 8 << 30, fill: int = 0
) -> float:
    """Median ms per offer of each row's tokens into a fresh cache of `budget` bytes; the first `fill`
    rows are offered untimed (to fill it), the first timed one is left out (first-seen shapes)."""
    from worker.engine.cache.prefix_cache import PrefixCache

    cache = PrefixCache(budget)
    times = []
    for i in range(rows):
        row = [layer.row(i) for layer in layers]
        ids = [i + 1, *range(1000, 1000 + tokens - 1)]  # distinct first token: no shared prefix
        if sync:
            mx.synchronize()
        t0 = time.perf_counter()
        cache.offer(ids, row)
        if sync:
            mx.synchronize()
        if i >= fill:
            times.append((time.perf_counter() - t0) * 1000)
    mx.synchronize()
    return statistics.median(times[1:])


def _into_many_nodes(layers: list[Any], rows: int, tokens: int, nodes: int, token_bytes: int) -> float:
    """Median ms per offer of each row into a cache full of `nodes` nodes of 16 tokens (each offer
    evicts several)."""
    from worker.engine.cache.prefix_cache import PrefixCache

    cache = PrefixCache(nodes * 16 * token_bytes)
    short = [layer.row(0) for layer in layers]
    for j in range(nodes):
        cache.offer([10**6 + j, *range(1, 16)], short)
    mx.synchronize()
    times = []
    for i in range(rows):
        row = [layer.row(i) for layer in layers]
        t0 = time.perf_counter()
        cache.offer([i + 1, *range(1000, 1000 + tokens - 1)], row)
        times.append((time.perf_counter() - t0) * 1000)
    mx.synchronize()
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.offer_probe")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--full-rows", type=int, help="rows the full cache's budget holds [rows / 4]")
    ap.add_argument(
        "--nodes", default="100,1000,5000", help="sizes of a full cache of 16-token nodes [100,1000,5000]"
    )
    args = ap.parse_args(argv)
    from worker.engine.cache import prefix_cache
    from worker.engine.models.loader import load_model

    model, _ = load_model(str(checkpoint(args.model, Path.home() / ".cache/mlxq/bench-models")))
    layers = _batch(model, args.rows, args.tokens)
    as_is = prefix_cache._own

    def per_array(pairs: list[tuple[mx.array, mx.array]]) -> list[tuple[mx.array, mx.array]]:
        out = [(mx.contiguous(k * 1), mx.contiguous(v * 1)) for k, v in pairs]
        mx.async_eval(out)
        return out

    variants = {"one block (as is)": as_is, "one copy per array": per_array, "no copy (views)": lambda p: p}
    print(f"model={args.model} rows={args.rows} tokens={args.tokens} layers={len(layers)}")
    print(f"device={mx.default_device()}\n")
    print("| offer | host ms | synced ms |\n| --- | --- | --- |")
    for name, own in variants.items():
        prefix_cache._own = own  # type: ignore[assignment]
        _offers(layers, args.rows, args.tokens, True)  # warm-up: first-seen shapes
        host = _offers(layers, args.rows, args.tokens, False)
        synced = _offers(layers, args.rows, args.tokens, True)
        print(f"| {name} | {host:.3f} | {synced:.3f} |")
    prefix_cache._own = as_is  # type: ignore[assignment]
    full_rows = min(args.full_rows or max(1, args.rows // 4), args.rows - 2)
    row_bytes = sum(int(c.keys.nbytes + c.values.nbytes) for c in layers) // args.rows
    budget = int(full_rows * row_bytes * args.tokens / layers[0].capacity)  # the rows' tokens, not the spare
    host = _offers(layers, args.rows, args.tokens, False, budget, fill=full_rows)
    synced = _offers(layers, args.rows, args.tokens, True, budget, fill=full_rows)
    print(
        f"| one block (as is), into a full cache ({full_rows} rows: every later offer evicts) | {host:.3f} "
        f"| {synced:.3f} |"
    )
    token_bytes = row_bytes // layers[0].capacity
    for nodes in (int(n) for n in args.nodes.split(",") if n.strip()):
        host = _into_many_nodes(layers, args.rows, args.tokens, nodes, token_bytes)
        print(f"| one block (as is), into a full cache of {nodes:,} 16-token nodes | {host:.3f} | - |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
