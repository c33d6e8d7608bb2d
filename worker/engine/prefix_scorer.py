"""`PrefixScorer`: the one scorer. It walks the radix tree of all score rows (`score_tree`) with one
batch-1 KV cache, computing each shared span once (extend the cache, recurse, trim back); where a node's
children are rows with nothing more in common, their suffixes run as one right-padded batch on top of the
node's cache, which the rows read in place (`cache/shared_prefix.py`: no copy of it per row). Right
padding needs no mask of its own: a real token never attends to a pad that sits after it.

Only positions some row needs go through the LM head, at most `head_chunk` at a time, and a position
several rows need goes through it once; the rows' heads (`score_head.ScoreHead`) keep what they need.
It also owns its suffix batches' budgets (`score_kv_by_default`) and the parts of its time it counts
(`SCORE_ENGINE_PHASES`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from time import perf_counter

import mlx.core as mx

from mlxq.worker.engine.cache.kv_cache import KVCache, broadcast_batch, key_columns
from mlxq.worker.engine.cache.prefix_cache import PrefixCache
from mlxq.worker.engine.cache.shared_prefix import RowPacks, SharedPrefixRows
from mlxq.worker.engine.cache.token_match import common_length
from mlxq.worker.engine.models.base import LayerCache, Model
from mlxq.worker.engine.score_head import Pick, ScoreHead
from mlxq.worker.engine.score_tree import _Node, build_tree, computed_per_row
from mlxq.worker.engine.shapes import padded_size

# The parts of a score batch's engine time `PrefixScorer` (and the engine's candidate scoring) times.
SCORE_ENGINE_PHASES = ("tree", "forward", "unembed", "device_wait")


class Ahead:
    """A span `PrefixScorer.warm` started into the prefix cache for the batch scored next: `tokens`, of
    which those from `start` on it computed (the rest were cached already)."""

    def __init__(self, tokens: list[int], start: int) -> None:
        self.tokens = tokens
        self.start = start

    def computed(self, known: list[int], hit: int) -> int:
        """How many of the first `hit` tokens of `known`, which the prefix cache gave back, were computed
        for this batch (warmed), not cached before it."""
        shared = common_length(self.tokens, known)
        return max(0, min(hit, shared) - self.start)


def score_kv_by_default() -> int:
    """A score batch's suffix rows may hold an eighth of MLX's memory limit in keys and values
    (`PrefixScorer._kv_bytes`): their own, and where a model's rows copy their shared prefix (DeepSeek's
    latent attention) those copies, which are most of it. The bound scales with the machine's memory
    rather than a row count."""
    return int(mx.get_memory_limit()) // 8


class PrefixScorer:
    """Computes the next-token distributions the rows of every `ScoreHead` need, each shared prefix
    once: one tree for all heads, so rows of different kinds share their prefixes too.

    With a `PrefixCache`, a top-level span starts from the longest cached prefix that ends before any
    position a row under it needs, and every span computed on the batch-1 path is offered back to the
    cache for later jobs. With `pad_shapes` (GPUs: see `shapes.padded_size`) spans and suffix batches
    are padded on the right, and suffix batches to a power-of-two number of rows, so the forwards take
    few distinct shapes.

    A suffix batch reads its shared prefix's keys and values where they are (`shared_prefix.py`; a
    model whose attention cannot, a copy per row: `_batch_cache`): with `max_batch_kv_bytes` (and the
    model's `kv_bytes_per_token`) a batch takes only as many rows as keep the keys and values it holds
    beside the prefix's cache within that many bytes (`_kv_bytes`, `score_kv_by_default`).

    `interrupt` is called before every forward (each prefill chunk of a span, each suffix batch):
    whatever it raises ends the scoring there (a job's timeout); what was computed so far stays in the
    prefix cache.

    `warm` starts a span's keys and values into the prefix cache without waiting for them (a batch's
    shared prefix, queued while the host tokenizes its rows); `ahead` names what it started for the
    batch scored next, whose rows then count those tokens as computed, not cached.
    """

    def __init__(
        self,
        model: Model,
        *,
        prefix_cache: PrefixCache | None = None,
        prefill_chunk: int = 2048,
        max_batch_rows: int = 32,
        max_batch_tokens: int = 8192,
        max_batch_kv_bytes: int = 0,
        kv_bytes_per_token: int = 0,
        min_shared: int = 32,
        head_chunk: int = 256,
        pad_shapes: bool = False,
        interrupt: Callable[[], None] | None = None,
        seconds: dict[str, float] | None = None,
        sync_phases: bool = False,
        ahead: Ahead | None = None,
    ) -> None:
        self.model = model
        self.ahead = ahead
        # Where scoring's host time goes, added to `seconds` (see `SCORE_ENGINE_PHASES`): building the
        # tree, building forwards, building the LM head's work, and waiting for the device (forwards
        # and heads run lazily, so a wait holds the device time of both). `sync_phases` (a debug
        # setting: one more wait a forward) evaluates each forward as it is built, so its device time
        # counts as `forward` and the head's as `unembed`.
        self.seconds = seconds if seconds is not None else dict.fromkeys(SCORE_ENGINE_PHASES, 0.0)
        self.sync_phases = sync_phases
        self.pad_shapes = pad_shapes
        self.prefix_cache = prefix_cache
        self.prefill_chunk = prefill_chunk
        self.max_batch_rows = max_batch_rows
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_kv_bytes = max_batch_kv_bytes
        self.kv_bytes_per_token = kv_bytes_per_token
        self.min_shared = min_shared
        self.head_chunk = head_chunk
        self.interrupt = interrupt or (lambda: None)

    def score(self, heads: Sequence[ScoreHead]) -> list[list[int]]:
        """Fill every head's rows; per head, the input tokens each of its rows computed itself (a span
        shared by several rows counts for the first of them: `computed_per_row`)."""
        t0 = perf_counter()
        self._heads = heads
        self._owner = [(k, r) for k, head in enumerate(heads) for r in range(len(head.inputs))]
        self._needed = [heads[k].needed(r) for k, r in self._owner]
        root = build_tree([heads[k].inputs[r] for k, r in self._owner], self.min_shared)
        self._below: dict[int, list[int]] = {}
        self._index_below(root)
        self.seconds["tree"] += perf_counter() - t0
        reused: dict[int, int] = {}  # id(node) -> its tokens taken from the prefix cache
        leaves = []
        for child in root.below():
            first = min(self._needed[i].start for i in self._below[id(child)])
            known = child.span[: first + 1]  # the cache gives at most all but its last token
            hit = self.prefix_cache.peek(known) if self.prefix_cache is not None else 0
            if not (hit or child.below() or len(child.span) > self.prefill_chunk):
                leaves.append(child)
                continue
            start = 0
            if hit and self.prefix_cache is not None:
                cache, start = self.prefix_cache.begin(
                    known, len(self.model.layers), windows=self.model.model.windows
                )
                reused[id(child)] = start - (self.ahead.computed(known, start) if self.ahead else 0)
            else:
                cache = self.model.make_cache()
            self._extend(child, cache, 0, start)
            for c in cache:  # every branch below goes back here: a windowed layer keeps what that needs
                c.pinned = len(child.span)
            self._visit(child, child.span, cache)
        self._run_leaves(leaves, self.model.make_cache(), 0)
        out: list[list[int]] = [[] for _ in heads]
        for (k, _), n in zip(self._owner, computed_per_row(root, len(self._owner), reused), strict=True):
            out[k].append(n)
        return out

    def warm(self, tokens: list[int], min_new: int = 1) -> Ahead | None:
        """Queue the keys and values of `tokens` not in the prefix cache yet and offer them to it, without
        waiting for the device: a later forward that needs them waits for them there. What it started
        (None: nothing, fewer than `min_new` tokens of it not cached, or no cache)."""
        if self.prefix_cache is None or not tokens:
            return None
        probe = [*tokens, -1]  # the cache gives at most all but a prompt's last token
        if len(tokens) - self.prefix_cache.peek(probe) < max(min_new, 1):
            return None
        cache, start = self.prefix_cache.begin(
            probe, len(self.model.layers), windows=self.model.model.windows
        )
        if not start:
            cache = self.model.make_cache()
        ids = mx.array(tokens, dtype=mx.int32)[None]
        t0 = perf_counter()
        for lo in range(start, len(tokens), self.prefill_chunk):
            hi = min(lo + self.prefill_chunk, len(tokens))
            chunk, real, pad = self._chunk(ids, lo, hi)  # the shapes the scorer's own spans take
            self.model.hidden(chunk, cache=cache, last=real - 1)  # only the keys and values are kept
            for c in cache:
                c.trim(pad)
            mx.async_eval([c.state for c in cache])
        self.prefix_cache.offer(tokens, cache)
        self.seconds["forward"] += perf_counter() - t0
        return Ahead(tokens, start)

    def _index_below(self, node: _Node) -> list[int]:
        below = list(node.rows)
        for child in node.below():
            below += self._index_below(child)
        self._below[id(node)] = below
        return below

    def _wanted(self, row: int, lo: int, hi: int) -> range:
        """The positions in [lo, hi) that row `row` needs."""
        need = self._needed[row]
        return range(max(lo, need.start), min(hi, need.stop))

    def _visit(self, node: _Node, prefix: list[int], cache: list[KVCache]) -> None:
        """Offer `prefix` (what `cache` holds) to the prefix cache, then score everything below `node`."""
        if self.prefix_cache is not None:
            self.prefix_cache.offer(prefix, cache)
        leaves = []
        for child in node.below():
            if child.below() or len(child.span) > self.prefill_chunk:
                self._extend(child, cache, len(prefix))
                self._visit(child, prefix + child.span, cache)
                for c in cache:
                    c.trim(len(child.span))
            else:
                leaves.append(child)
        self._run_leaves(leaves, cache, len(prefix))

    def _extend(self, node: _Node, cache: list[KVCache], depth: int, start: int = 0) -> None:
        """Append the node's span (from `start`) to the batch-1 cache a chunk at a time, scoring the
        positions in each that rows under the node need; `depth` is the cache's length before the span."""
        ids = mx.array(node.span, dtype=mx.int32)[None]
        while start < len(node.span):
            end = min(start + self.prefill_chunk, len(node.span))
            self.interrupt()
            picks = [
                Pick(i, p, p - depth - start)
                for i in self._below[id(node)]
                for p in self._wanted(i, depth + start, depth + end)
            ]
            chunk, real, pad = self._chunk(ids, start, end)
            t0 = perf_counter()
            if all(p.at == real - 1 for p in picks):  # only the last position (or none): skip the rest
                hidden = self.model.hidden(chunk, cache=cache, last=real - 1)[0]
                picks = [Pick(p.row, p.position, 0) for p in picks]
            else:
                hidden = self.model.hidden(chunk, cache=cache)[0]
            for c in cache:
                c.trim(pad)
            self._forward_built(hidden, t0)
            self._score(hidden, picks)
            t0 = perf_counter()
            mx.eval([c.state for c in cache])
            self.seconds["device_wait"] += perf_counter() - t0
            start = end

    def _chunk(self, ids: mx.array, lo: int, hi: int) -> tuple[mx.array, int, int]:
        """Positions lo..hi of a span's ids (1, n), and how many of them are real and how many pad: with
        `pad_shapes` the span's last chunk is padded on the right to `padded_size` (no real token
        sees the pad, and the cache forgets it at once: the caller trims it)."""
        chunk, real = ids[:, lo:hi], hi - lo
        pad = padded_size(real) - real if self.pad_shapes and hi == ids.shape[1] else 0
        if pad:
            chunk = mx.concatenate([chunk, mx.zeros((1, pad), dtype=mx.int32)], axis=1)
        return chunk, real, pad

    def _forward_built(self, hidden: mx.array, t0: float) -> None:
        """Count the host time since `t0` as building a forward (with `sync_phases`, and its run)."""
        if self.sync_phases:
            mx.eval(hidden)
        self.seconds["forward"] += perf_counter() - t0

    def _run_leaves(self, leaves: list[_Node], cache: list[KVCache], depth: int) -> None:
        for group in self._batches(leaves, depth):
            self.interrupt()
            width = max(len(n.span) for n in group)
            pad = group[0].span[0]  # any real id; padded positions are never read
            spans = [n.span for n in group]
            if self.pad_shapes:
                width = padded_size(width)
                spans += [[pad]] * (padded_size(len(group), smallest=1) - len(group))
            ids = mx.array([span + [pad] * (width - len(span)) for span in spans], dtype=mx.int32)
            t0 = perf_counter()
            hidden = self.model.hidden(ids, cache=self._batch_cache(cache, len(spans), width))
            self._forward_built(hidden, t0)
            picks = [
                Pick(i, p, b * width + p - depth)
                for b, n in enumerate(group)
                for i in self._below[id(n)]
                for p in self._wanted(i, depth, depth + len(n.span))
            ]
            self._score(hidden.reshape(-1, hidden.shape[-1]), picks)

    def _batch_cache(self, cache: list[KVCache], rows: int, width: int) -> Sequence[LayerCache]:
        """The caches a suffix batch of `rows` rows of `width` tokens runs on over the batch-1 `cache`:
        fresh ones where there is no prefix; where there is, the prefix read in place
        (`shared_prefix.SharedPrefixRows`), or for a model whose attention cannot (DeepSeek's latent
        attention) a copy of it per row (`broadcast_batch`)."""
        prefix = cache[0].offset
        if not prefix:
            return self.model.make_cache()
        if not self.model.reads_shared_prefix:
            return broadcast_batch(cache, rows, width)
        packs = RowPacks(rows, width, prefix, bucket=self.model.bucket_keys)
        return [SharedPrefixRows(c, packs) for c in cache]

    def _batches(self, leaves: list[_Node], prefix: int) -> list[list[_Node]]:
        """Group leaf suffixes (similar lengths together) under the row, padded-token and KV budgets;
        `prefix` is the length of the cache they share."""
        groups: list[list[_Node]] = []
        current: list[_Node] = []
        for n in sorted(leaves, key=lambda n: len(n.span)):
            width = len(n.span)  # sorted ascending: the newest is the widest
            if current and (
                len(current) >= self.max_batch_rows
                or width * (len(current) + 1) > self.max_batch_tokens
                or self._kv_bytes(len(current) + 1, prefix, width) > self.max_batch_kv_bytes > 0
            ):
                groups.append(current)
                current = []
            current.append(n)
        if current:
            groups.append(current)
        return groups

    def _kv_bytes(self, rows: int, prefix: int, width: int) -> int:
        """Bytes of keys and values a suffix batch of `rows` suffixes of up to `width` tokens on a
        `prefix`-token cache holds beside that cache (with `pad_shapes`, its padding too): the rows' own
        and, packed, for one layer at a time each pack's copy of the prefix joined to them (`RowPacks`;
        cascaded, none); or where the prefix is copied per row, `broadcast_batch`'s buffers."""
        if self.pad_shapes:
            rows, width = padded_size(rows, smallest=1), padded_size(width)
        if not prefix or not self.model.reads_shared_prefix:
            return rows * key_columns(prefix + width) * self.kv_bytes_per_token
        packs = RowPacks(rows, width, prefix, bucket=self.model.bucket_keys)
        layer_copies = packs.packs * packs.columns(prefix) // len(self.model.layers) if packs.fused else 0
        return (rows * width + layer_copies) * self.kv_bytes_per_token

    def _score(self, hidden: mx.array, picks: list[Pick]) -> None:
        """Each row of `hidden` (N, H) that a pick reads goes through the LM head once, at most
        `head_chunk` rows at a time; each head takes its rows' distributions."""
        by_at: dict[int, list[Pick]] = defaultdict(list)
        for pick in picks:
            by_at[pick.at].append(pick)
        ats = sorted(by_at)
        for c in range(0, len(ats), self.head_chunk):
            t0 = perf_counter()
            chunk = ats[c : c + self.head_chunk]
            logits = self.model.logits(hidden[mx.array(chunk)]).astype(mx.float32)  # (m, vocab)
            if self.sync_phases:
                mx.eval(logits)
            by_head: dict[int, list[Pick]] = defaultdict(list)
            for j, at in enumerate(chunk):
                for pick in by_at[at]:
                    k, row = self._owner[pick.row]
                    by_head[k].append(Pick(row, pick.position, j))
            t1 = perf_counter()
            self.seconds["unembed"] += t1 - t0
            for k, mine in by_head.items():  # a head keeps its rows' part: the wait for the device
                self._heads[k].take(logits, mine)
            self.seconds["device_wait"] += perf_counter() - t1
