"""A warm prefix (KV) cache shared by every job a worker runs.

A trie over token ids; each node owns the keys/values of its own span of tokens (per layer, batch 1).
`begin(tokens)` finds the longest cached prefix and returns a ready KV cache holding it (always leaving
at least one token to compute, since the caller needs that position's logits); after computing,
`offer(tokens, cache)` stores what the cache holds beyond the match. Eviction is least recently used
among leaves (ties: deepest, then largest, then oldest) until the bytes held fit the budget: only
leaves go, so every node's keys/values stay valid (they depend on all tokens before them). The leaves
wait in a heap in that order, re-entered whenever their place changes (stale entries are skipped when
popped), so an eviction costs a few heap operations, not a walk of the trie with every node's size
summed again: with a few thousand nodes that made every offer into a full cache cost tens of
milliseconds (62 ms at 5,000 nodes on the CPU).

Sliding-window layers: a cache offered holds only a windowed layer's last positions (`kv_cache.py`), and
a node stores what it got, so a node's windowed layers may lack the head of its span (`_Node.held_from`).
A prefix of length p restores exactly when every windowed layer holds its window's last positions
before p (the window - 1 a next query sees), or all of them from 0 on: `begin` reuses the longest such
prefix of the match, and gives those layers only the positions their window needs (from a whole step
on), so a restored prefix far longer than the window costs the window, not the prefix.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlxq.worker.engine.cache.kv_cache import KVCache, key_columns
from mlxq.worker.engine.cache.token_match import common_length

log = logging.getLogger(__name__)


@dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0
    inserted_tokens: int = 0
    evictions: int = 0
    bytes: int = 0
    nodes: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


_serials = itertools.count()

# `PrefixCache._split`: a part of a split node at most this fraction of its span is copied alone, the
# other part keeping views of the node's arrays (the copied part's bytes then held twice while both live).
_VIEW_SHARE = 8


def _nbytes(layers: list[tuple[mx.array, mx.array]]) -> int:
    return sum(int(k.nbytes + v.nbytes) for k, v in layers)


@dataclass(eq=False)
class _Node:
    span: list[int]
    # per layer: keys, values (1, kv_heads, len(span), dim); a windowed layer's may hold only the last
    # columns of the span (its older positions were dropped before it was offered)
    layers: list[tuple[mx.array, mx.array]]
    parent: _Node | None
    depth: int  # tokens before this node's span
    windows: list[int | None] = field(default_factory=list)  # per layer: its sliding window, or None
    children: dict[int, _Node] = field(default_factory=dict)
    last_used: int = 0
    nbytes: int = field(init=False)  # the layers' bytes, counted once (they are set with the node)
    removed: bool = False
    serial: int = field(default_factory=_serials.__next__)  # creation order: the last tie-break
    entry: Any = field(default=None, repr=False)  # its one current entry in the eviction heap

    def __post_init__(self) -> None:
        self.nbytes = _nbytes(self.layers)

    @property
    def held_from(self) -> int:
        """The first position of the span that every layer holds."""
        end = self.depth + len(self.span)
        return max([self.depth, *(end - k.shape[2] for k, _ in self.layers)])

    @property
    def reach(self) -> int:
        """Positions before a query its most far-seeing windowed layer sees (0: no windowed layer)."""
        return max([0, *(w - 1 for w in self.windows if w is not None)])

    @property
    def order(self) -> tuple[int, int, int, int]:
        """Eviction order among leaves: least recently used first, then deepest, then largest, then
        oldest (a split's two parts are touched together)."""
        return (self.last_used, -(self.depth + len(self.span)), -self.nbytes, self.serial)


def _own(layers: list[tuple[mx.array, mx.array]]) -> list[tuple[mx.array, mx.array]]:
    """Copies of per-layer (keys, values) that own their memory, so a slice never keeps a whole job's
    buffer alive. Where every array has one shape and dtype (most models), the copies are views of one
    new (2 * layers, ...) block: one allocation, one concatenate. The copies are queued, not waited on
    (`mx.async_eval`): a decode step already in flight keeps the device busy meanwhile, and nothing
    reads them before later work on the same stream."""
    flat = [a for kv in layers for a in kv]
    if not flat or not any(a.size for a in flat):
        return [(mx.zeros(k.shape, k.dtype), mx.zeros(v.shape, v.dtype)) for k, v in layers]
    if all(a.shape == flat[0].shape and a.dtype == flat[0].dtype for a in flat) and flat[0].shape[0] == 1:
        block = mx.concatenate(flat, axis=0)
        mx.async_eval(block)
        views = [block[i : i + 1] for i in range(len(flat))]
    else:  # a windowed layer's held columns: fewer than a global layer's
        views = [mx.contiguous(a * 1) if a.size else mx.zeros(a.shape, a.dtype) for a in flat]
        mx.async_eval(views)
    return [(views[2 * i], views[2 * i + 1]) for i in range(len(layers))]


def _restorable(path: list[tuple[_Node, int]], use: int) -> int:
    """The longest prefix of at most `use` tokens along `path` whose windowed layers hold what their
    windows see: every position from `reach` before it, or all from 0 (the whole prefix for a model
    with global layers only)."""
    reach = max([0, *(node.reach for node, _ in path)])
    if not reach:
        return use
    runs: list[list[int]] = []  # [first, end) of the stretches every layer holds, in order
    for node, _ in path:
        first, end = node.held_from, node.depth + len(node.span)
        if runs and first == node.depth and runs[-1][1] == node.depth:
            runs[-1][1] = end
        elif first < end:
            runs.append([first, end])
    for first, end in reversed(runs):
        p = min(use, end)
        if p > first and (first == 0 or p - reach >= first):
            return p
    return 0


class PrefixCache:
    """Longest-prefix KV reuse across jobs under a byte budget."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.root = _Node(span=[], layers=[], parent=None, depth=0)
        self.stats = CacheStats()
        self._clock = itertools.count(1)
        # Eviction candidates: (order, entry number, node). Only a node's latest entry counts, and only
        # while it is a leaf; older ones (before a touch, a split, a child) are stale and skipped. A
        # node's order only grows, so its stale entries are popped before its current one: an evicted
        # node leaves none behind to keep its arrays alive.
        self._heap: list[tuple[tuple[int, int, int, int], int, _Node]] = []
        self._entries = itertools.count()

    # --- lookup -----------------------------------------------------------------------------------

    def _match(self, tokens: list[int]) -> tuple[list[tuple[_Node, int]], int]:
        """Nodes along the longest cached prefix of `tokens`, each with how much of its span matches."""
        path: list[tuple[_Node, int]] = []
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            k = common_length(child.span, tokens, i)
            path.append((child, k))
            i += k
            if k < len(child.span):
                break
            node = child
        return path, i

    def peek(self, tokens: list[int], min_tokens: int = 1) -> int:
        """How many tokens `begin` would reuse, without touching the cache."""
        path, matched = self._match(tokens)
        use = _restorable(path, min(matched, len(tokens) - 1))
        return use if use >= max(1, min_tokens) else 0

    def begin(
        self, tokens: list[int], n_layers: int, min_tokens: int = 1, windows: list[int | None] | None = None
    ) -> tuple[list[KVCache], int]:
        """A cache holding the longest cached prefix of `tokens` (at most len-1 tokens) that restores
        exactly (see the module docstring) and its length; an empty one where that prefix is shorter
        than `min_tokens`. `windows`: each layer's sliding window (the caches' kind), all global by
        default."""
        self.stats.lookups += 1
        windows = windows or [None] * n_layers
        path, matched = self._match(tokens)
        use = _restorable(path, min(matched, len(tokens) - 1))
        if use < max(1, min_tokens):
            return [KVCache(w) for w in windows], 0
        now = next(self._clock)
        nodes = []
        for node, _ in path:
            if node.depth >= use:
                break
            self._touch(node, now)
            nodes.append(node)
        # One copy into buffers with room for the rest of the prompt, so its prefill writes in place
        # instead of copying the whole prefix again to grow (an 8k prefix is ~270 MB on a 1B model).
        # A whole number of steps: the size bucketed attention reads (`key_columns`).
        room = key_columns(len(tokens)) - use
        caches = []
        for layer in range(n_layers):
            window = nodes[0].windows[layer] if nodes[0].windows else None
            # A windowed layer takes the positions its window sees from `use` on, from a whole step on
            # where the node holds them (a global layer: all, from 0).
            first = 0 if window is None else max(0, use - (window - 1)) // KVCache.step * KVCache.step
            parts_k: list[mx.array] = []
            parts_v: list[mx.array] = []
            start = use  # the parts hold positions start..use: back from `use` while they run on
            for node in reversed(nodes):
                kk, vv = node.layers[layer]
                held = node.depth + len(node.span) - kk.shape[2]  # the position of its first column
                lo, hi = max(first, held), min(node.depth + len(node.span), use)
                if hi > lo:
                    parts_k.insert(0, kk[:, :, lo - held : hi - held])
                    parts_v.insert(0, vv[:, :, lo - held : hi - held])
                    start = lo
                if lo > node.depth or lo <= first:  # what comes before is not held, or not needed
                    break
            k0, v0 = parts_k[0], parts_v[0]
            spare_k = mx.zeros((*k0.shape[:2], room, k0.shape[3]), k0.dtype)
            spare_v = mx.zeros((*v0.shape[:2], room, v0.shape[3]), v0.dtype)
            cache = KVCache(window)
            cache.keys = mx.concatenate([*parts_k, spare_k], axis=2)
            cache.values = mx.concatenate([*parts_v, spare_v], axis=2)
            cache.base, cache.offset = start, use
            caches.append(cache)
        self.stats.hits += 1
        self.stats.hit_tokens += use
        return caches, use

    # --- insertion --------------------------------------------------------------------------------

    def offer(self, tokens: list[int], cache: list[KVCache]) -> int:
        """Store the KV of `tokens` (the cache's first len(tokens) positions) not cached yet.

        Returns how many new tokens were stored.
        """
        n = min(len(tokens), cache[0].offset if cache else 0)
        if n == 0 or self.budget_bytes <= 0:
            return 0
        tokens = tokens[:n]
        path, matched = self._match(tokens)
        parent = self.root
        if path:
            node, k = path[-1]
            if k < len(node.span):
                node = self._split(node, k)
            parent = node
        if matched >= n:
            return 0
        now = next(self._clock)
        for node, _ in path:
            self._touch(node, now)
        # A windowed layer's cache holds positions from its `base` on: the node keeps those it has.
        first = [max(matched, c.base) - c.base for c in cache]  # the first held column to store
        held = [(c.state, a, max(n - c.base, a)) for c, a in zip(cache, first, strict=True)]
        layers = _own([(k[:, :, a:b], v[:, :, a:b]) for (k, v), a, b in held])
        windows = [c.window for c in cache]
        child = _Node(
            span=tokens[matched:], layers=layers, parent=parent, depth=matched, last_used=now, windows=windows
        )
        parent.children[tokens[matched]] = child
        self._candidate(child)
        self.stats.bytes += child.nbytes
        self.stats.nodes += 1
        self.stats.inserted_tokens += n - matched
        self._evict(keep=child)
        return n - matched

    def _split(self, node: _Node, k: int) -> _Node:
        """Cut `node` after k tokens of its span; return the new upper part (which keeps the position).

        Where one part is at most 1/`_VIEW_SHARE` of the span (a long prompt's prefix cut from the
        short tail it was offered with), only that part is copied: the other keeps views of the node's
        arrays and is charged all of their bytes, so the budget still counts what is held. Copying the
        long part instead cost a copy of its whole prefix before the new prompt's first token."""
        assert node.parent is not None
        # A layer missing the span's first m positions (windowed) keeps its columns from k - m on.
        cut = [max(0, k - (len(node.span) - kk.shape[2])) for kk, _ in node.layers]
        upper = [(kk[:, :, :c], vv[:, :, :c]) for (kk, vv), c in zip(node.layers, cut, strict=True)]
        lower = [(kk[:, :, c:], vv[:, :, c:]) for (kk, vv), c in zip(node.layers, cut, strict=True)]
        before = node.nbytes
        short = min(k, len(node.span) - k)
        view = short * _VIEW_SHARE <= len(node.span)
        view_upper, view_lower = view and k > short, view and k == short
        head = _Node(
            span=node.span[:k],
            parent=node.parent,
            depth=node.depth,
            last_used=node.last_used,
            layers=upper if view_upper else _own(upper),
            windows=node.windows,
        )
        if view_upper:
            head.nbytes = before
        node.parent.children[node.span[0]] = head
        node.span, node.parent, node.depth = node.span[k:], head, node.depth + k
        node.layers = lower if view_lower else _own(lower)
        node.nbytes = before if view_lower else _nbytes(node.layers)
        head.children[node.span[0]] = node
        self._candidate(node)  # deeper and smaller now: its place among the leaves moved
        self.stats.bytes += head.nbytes + node.nbytes - before
        self.stats.nodes += 1
        return head

    # --- eviction ---------------------------------------------------------------------------------

    def _leaves(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                out.append(node)
        return out

    def _touch(self, node: _Node, now: int) -> None:
        node.last_used = now
        self._candidate(node)

    def _candidate(self, node: _Node) -> None:
        """(Re-)enter `node` among the eviction candidates if it is a leaf; its older entries go stale."""
        if node.children or node is self.root:
            return
        node.entry = (node.order, next(self._entries), node)
        heapq.heappush(self._heap, node.entry)
        if len(self._heap) > 4 * self.stats.nodes + 64:  # mostly stale: rebuild from the leaves
            self._heap = []
            for leaf in self._leaves():
                leaf.entry = (leaf.order, next(self._entries), leaf)
                self._heap.append(leaf.entry)
            heapq.heapify(self._heap)

    def _next_leaf(self, keep: _Node | None) -> _Node | None:
        """The leaf to evict first, other than `keep` (None: there is none)."""
        skipped = []
        found = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            node = entry[2]
            if entry is not node.entry or node.removed or node.children or entry[0] != node.order:
                continue  # stale
            if node is keep:
                skipped.append(entry)
                continue
            found = node
            break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return found

    def _evict(self, keep: _Node | None = None) -> None:
        while self.stats.bytes > self.budget_bytes:
            victim = self._next_leaf(keep)
            if victim is None:  # `keep` is the only leaf left: it goes too
                if keep is None or keep.removed or keep.children:
                    return
                self._heap.clear()  # nothing in it but `keep`'s entry and stale ones (which hold arrays)
                victim = keep
            self._remove(victim)

    def _remove(self, node: _Node) -> None:
        assert node.parent is not None
        del node.parent.children[node.span[0]]
        node.removed = True
        # Its keys and values go now, not when Python's cycle collector next runs: the node and its heap
        # entry refer to each other (held in a worker under load: ~2.5 MiB of a 256 KiB budget, tiny model).
        node.layers, node.entry = [], None
        self._candidate(node.parent)  # it may be a leaf now
        self.stats.bytes -= node.nbytes
        self.stats.nodes -= 1
        self.stats.evictions += 1

    def evict_all(self) -> None:
        """Drop everything (e.g. after an allocation failure)."""
        while self.root.children:
            for leaf in self._leaves():
                self._remove(leaf)
        self._heap.clear()
        self.stats.bytes = 0
