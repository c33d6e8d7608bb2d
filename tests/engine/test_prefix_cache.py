"""The prefix cache: longest match, splits, byte budget, LRU eviction, statistics."""

from __future__ import annotations

import gc
import random
from typing import Any

import mlx.core as mx
import pytest

from mlxq.worker.engine.cache.kv_cache import KVCache
from mlxq.worker.engine.cache.prefix_cache import PrefixCache

LAYERS, HEADS, DIM = 2, 2, 4
BYTES_PER_TOKEN = LAYERS * 2 * HEADS * DIM * 4  # keys+values, float32


def _cache_for(tokens: list[int]) -> list[KVCache]:
    """A KV cache whose entries encode the token and its position, so a mix-up shows."""
    caches = []
    for layer in range(LAYERS):
        c = KVCache()
        vals = mx.array([[t * 1000 + p + layer * 0.5] * DIM for p, t in enumerate(tokens)], dtype=mx.float32)
        kv = mx.broadcast_to(vals[None, None], (1, HEADS, len(tokens), DIM))
        c.update_and_fetch(kv, -kv)
        caches.append(c)
    return caches


def _assert_holds(caches: list[KVCache], tokens: list[int]) -> None:
    want = _cache_for(tokens)
    for got, ref in zip(caches, want, strict=True):
        assert got.offset == len(tokens)
        assert mx.array_equal(got.state[0], ref.state[0]) and mx.array_equal(got.state[1], ref.state[1])


def test_longest_prefix_always_leaves_one_token() -> None:
    pc = PrefixCache(budget_bytes=1 << 20)
    a = [1, 2, 3, 4, 5, 6]
    assert pc.offer(a, _cache_for(a)) == 6
    caches, n = pc.begin(a, LAYERS)
    assert n == 5
    _assert_holds(caches, a[:5])
    caches, n = pc.begin([1, 2, 3, 9, 9], LAYERS)
    assert n == 3
    _assert_holds(caches, [1, 2, 3])
    assert pc.begin([7, 8], LAYERS)[1] == 0
    assert pc.stats.lookups == 3 and pc.stats.hits == 2 and pc.stats.hit_tokens == 8


def test_long_spans_match_up_to_the_first_differing_token() -> None:
    """Spans are compared in blocks: a difference at, just before or just after a block's edge, or
    a lookup ending mid-span, gives the same length a token-by-token walk does."""
    pc = PrefixCache(budget_bytes=1 << 24)
    long = [random.Random(7).randrange(50) for _ in range(700)]
    pc.offer(long, _cache_for(long))
    for cut in (0, 1, 255, 256, 257, 511, 512, 699):
        other = [*long[:cut], 99, *long[cut + 1 :]]
        assert pc.peek(other) == cut
    assert pc.peek(long[:300]) == 299  # ends mid-span: all but the last token
    assert pc.peek([*long, 5]) == 700
    caches, n = pc.begin([*long[:257], 99], LAYERS)
    assert n == 257
    _assert_holds(caches, long[:257])


def test_a_prefix_shorter_than_min_tokens_is_not_reused() -> None:
    pc = PrefixCache(budget_bytes=1 << 20)
    a = [1, 2, 3, 4, 5, 6]
    pc.offer(a, _cache_for(a))
    assert (pc.peek([1, 2, 3, 9], min_tokens=4), pc.peek([1, 2, 3, 4, 9], min_tokens=4)) == (0, 4)
    caches, n = pc.begin([1, 2, 3, 9], LAYERS, min_tokens=4)
    assert n == 0 and all(c.offset == 0 for c in caches)
    caches, n = pc.begin([1, 2, 3, 4, 9], LAYERS, min_tokens=4)
    assert n == 4
    _assert_holds(caches, [1, 2, 3, 4])


def test_diverging_offer_splits_and_stores_only_new_tokens() -> None:
    pc = PrefixCache(budget_bytes=1 << 20)
    a, b = [1, 2, 3, 4, 5], [1, 2, 3, 7, 8, 9]
    pc.offer(a, _cache_for(a))
    assert pc.offer(b, _cache_for(b)) == 3
    assert pc.stats.bytes == 8 * BYTES_PER_TOKEN  # 5 + 3 distinct tokens, nothing stored twice
    _assert_holds(pc.begin(b + [0], LAYERS)[0], b)
    _assert_holds(pc.begin(a + [0], LAYERS)[0], a)


def test_budget_holds_and_least_recently_used_goes_first() -> None:
    pc = PrefixCache(budget_bytes=10 * BYTES_PER_TOKEN)
    old, new = [1, 1, 1, 1], [2, 2, 2, 2]
    pc.offer(old, _cache_for(old))
    pc.offer(new, _cache_for(new))
    pc.begin(old + [0], LAYERS)  # touch `old`: `new` is now the least recently used
    third = [3, 3, 3, 3]
    pc.offer(third, _cache_for(third))
    assert pc.stats.bytes <= pc.budget_bytes
    assert pc.peek(old + [0]) == 4 and pc.peek(third + [0]) == 4
    assert pc.peek(new + [0]) == 0
    assert pc.stats.evictions == 1


def test_evicted_keys_and_values_are_freed_at_once() -> None:
    """What the budget counts is what MLX holds: an evicted node's arrays go when it is evicted, not
    when Python's cycle collector next runs (off here, as it is most of the time in a worker)."""
    budget = 64 * BYTES_PER_TOKEN
    pc = PrefixCache(budget_bytes=budget)
    gc.collect()
    gc.disable()
    try:
        mx.synchronize()
        base = mx.get_active_memory()
        for i in range(200):  # 8 tokens each, split from the others at the second: many evictions
            tokens = [i % 7, i, *range(6)]
            pc.offer(tokens, _cache_for(tokens))
        mx.synchronize()
        held = mx.get_active_memory() - base
    finally:
        gc.enable()
    assert pc.stats.evictions > 150 and pc.stats.bytes <= budget
    assert held <= budget + (16 << 10), held  # left to the cycle collector: 178 KiB on an 8 KiB budget


@pytest.mark.parametrize("budget", [0, 3 * BYTES_PER_TOKEN])
def test_too_small_a_budget_keeps_nothing_it_cannot_afford(budget: int) -> None:
    pc = PrefixCache(budget_bytes=budget)
    a = [5, 6, 7, 8, 9]
    pc.offer(a, _cache_for(a))
    assert pc.stats.bytes <= budget
    assert pc.stats.bytes == sum(n.nbytes for n in pc._leaves())
    assert not any(node.removed for _, _, node in pc._heap)  # the evicted offer's arrays are let go


def test_offer_never_stores_more_than_the_cache_holds() -> None:
    pc = PrefixCache(budget_bytes=1 << 20)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    assert pc.offer(tokens, _cache_for(tokens[:4])) == 4  # e.g. a prefill cancelled half-way
    assert pc.peek(tokens) == 4


def _walk_evict(pc: PrefixCache, keep: Any = None) -> None:
    """The eviction order by its definition: of all leaves (a walk of the trie), the least recently
    used goes first (ties: deepest, then largest, then oldest), `keep` only when it is the last leaf."""
    while pc.stats.bytes > pc.budget_bytes:
        leaves = [n for n in pc._leaves() if n is not keep] or pc._leaves()
        if not leaves:
            return
        key = lambda n: (n.last_used, -(n.depth + len(n.span)), -n.nbytes, n.serial)  # noqa: E731
        pc._remove(min(leaves, key=key))


def test_evictions_follow_the_lru_order_of_all_leaves_whatever_the_splits_and_touches() -> None:
    """The heap of leaves evicts exactly what a walk of every leaf would, through random offers
    (sharing prefixes, so nodes split), lookups (touches) and a budget that keeps evicting."""
    rng = random.Random(7)
    fast = PrefixCache(budget_bytes=40 * BYTES_PER_TOKEN)
    walked = PrefixCache(budget_bytes=40 * BYTES_PER_TOKEN)
    walked._evict = lambda keep=None: _walk_evict(walked, keep)  # type: ignore[method-assign]
    seen: list[list[int]] = []
    for step in range(300):
        if seen and rng.random() < 0.3:  # a lookup: touches the path it reuses
            tokens = rng.choice(seen) + [99]
            assert fast.begin(tokens, LAYERS)[1] == walked.begin(tokens, LAYERS)[1], step
            continue
        base = rng.choice(seen)[: rng.randrange(0, 6)] if seen and rng.random() < 0.7 else []
        tokens = base + [rng.randrange(1, 6) for _ in range(rng.randrange(1, 8))]
        assert fast.offer(tokens, _cache_for(tokens)) == walked.offer(tokens, _cache_for(tokens)), step
        seen.append(tokens)
        assert fast.stats.as_dict() == walked.stats.as_dict(), step
        assert [fast.peek(t + [99]) for t in seen] == [walked.peek(t + [99]) for t in seen], step
        assert not any(node.removed for _, _, node in fast._heap), step  # no evicted arrays kept alive
    assert fast.stats.evictions > 50 and fast.stats.bytes == sum(n.nbytes for n in _nodes(fast))
    assert len(fast._heap) <= 4 * fast.stats.nodes + 64


def _nodes(pc: PrefixCache) -> list[Any]:
    out, stack = [], list(pc.root.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def test_a_long_prefix_split_from_a_short_tail_is_not_copied() -> None:
    """A prompt repeating a long cached prefix with a new tail splits the node it was offered as: the
    short tail alone is copied, the prefix keeps its arrays (no copy of it before the new prompt's first
    token) and is charged all of their bytes. Both branches restore exactly, before and after the old
    tail is evicted, and the budget counts what MLX holds."""
    prefix = [random.Random(3).randrange(1, 50) for _ in range(2048)]
    first, second = [*prefix, 60, 61, 62, 63], [*prefix, 70, 71, 72, 73]
    pc = PrefixCache(budget_bytes=1 << 24)
    pc.offer(first, _cache_for(first))
    cache = _cache_for(second)
    mx.eval([c.state for c in cache])
    gc.collect()
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    assert pc.offer(second, cache) == 4
    mx.synchronize()
    grown = mx.get_peak_memory() - base
    assert grown < 64 * BYTES_PER_TOKEN, grown  # the new tail, and the old one's copy: not the prefix
    # The old tail's 4 tokens are held twice (in the prefix's arrays and in their copy), and counted so
    assert pc.stats.bytes == (len(first) + 4 + 4) * BYTES_PER_TOKEN
    assert pc.stats.bytes == sum(n.nbytes for n in _nodes(pc))
    _assert_holds(pc.begin([*first, 0], LAYERS)[0], first)
    _assert_holds(pc.begin([*second, 0], LAYERS)[0], second)
    for leaf in [n for n in pc._leaves() if n.span[0] == 60]:
        pc._remove(leaf)  # the old tail goes; the prefix still restores, charged all its arrays
    assert pc.stats.bytes == (len(first) + 4) * BYTES_PER_TOKEN
    _assert_holds(pc.begin([*prefix, 99], LAYERS)[0], prefix)
    _assert_holds(pc.begin([*second, 0], LAYERS)[0], second)
    pc.evict_all()
    assert pc.stats.bytes == 0 and pc.stats.nodes == 0


def test_a_split_near_the_start_of_a_span_copies_the_short_head_only() -> None:
    """The other way round: a prompt sharing only a few tokens of a long span copies those few (the
    new upper node), the long rest keeps its arrays; both restore exactly."""
    long = [1, 2, *range(10, 200)]
    other = [1, 2, 7, 7]
    pc = PrefixCache(budget_bytes=1 << 24)
    pc.offer(long, _cache_for(long))
    assert pc.offer(other, _cache_for(other)) == 2
    assert pc.stats.bytes == (len(long) + 2 + 2) * BYTES_PER_TOKEN
    assert pc.stats.bytes == sum(n.nbytes for n in _nodes(pc))
    _assert_holds(pc.begin([*long, 0], LAYERS)[0], long)
    _assert_holds(pc.begin([*other, 0], LAYERS)[0], other)
    pc.evict_all()
    assert pc.stats.bytes == 0
