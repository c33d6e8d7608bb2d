"""Scoring: the next-token distributions many rows need, every prefix they share computed once.

Rows (from one job or many, of every kind) go into one radix tree over their model inputs
(`score_tree`). Walking it depth-first with one batch-1 KV cache, each shared span is computed once
(extend the cache, recurse, trim back); where a node's children are rows with nothing more in common,
their suffixes run as one right-padded batch on top of the node's cache, which the rows read in place
(`cache/shared_prefix.py`: no copy of it per row). Right padding needs no mask of its own: a real
token never attends to a pad that sits after it.

What a row reads of the positions it runs through belongs to its head (`ScoreHead`, the seam): the
candidates head here keeps the logits after a prompt's last token (`candidate_scores`); the token head
(`token_scoring`) keeps each token's log-probability after the tokens before it (continuations, rolling
windows, prompt logprobs). Only positions some row needs go through the LM head, at most `head_chunk` at
a time (a long prompt never holds a [T, vocab] float32 block), and a position several rows need (a
question's last context token, before each of its continuations) goes through it once.

This module also turns candidate rows' text into tokens (`candidate_token_ids`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Protocol, cast

import mlx.core as mx

from mlxq.jobs.errors import InvalidCandidate
from mlxq.worker.engine.cache.kv_cache import KVCache, broadcast_batch, key_columns
from mlxq.worker.engine.cache.prefix_cache import PrefixCache
from mlxq.worker.engine.cache.shared_prefix import RowPacks, SharedPrefixRows
from mlxq.worker.engine.models.base import LayerCache, Model
from mlxq.worker.engine.score_tree import _Node, build_tree, computed_per_row
from mlxq.worker.engine.shapes import padded_size
from mlxq.worker.engine.text.tokenizer import Tokenizer

# The parts of a score batch's engine time `PrefixScorer` (and the engine's candidate scoring) times.
SCORE_ENGINE_PHASES = ("tree", "forward", "unembed", "device_wait")

TAIL_TOKENS = 16  # prompt tokens re-encoded with each candidate (see `candidate_token_ids`)


@dataclass(frozen=True)
class RowText:
    """A score row as text: `index` is its number in its own job (for error messages); with
    `split_special` the text of a special token in its prompt or candidates is encoded as ordinary text
    (`Tokenizer.encode`)."""

    prompt: str
    candidates: Sequence[str]
    index: int
    add_special_tokens: bool = True
    split_special: bool = False


RowTokens = tuple[list[int], list[int]]  # prompt tokens, and the one token each candidate adds


def candidate_token_ids(tokenizer: Tokenizer, rows: Sequence[RowText]) -> list[RowTokens | InvalidCandidate]:
    """Per row, its prompt tokens and the one ordinary token each candidate appends, or the row's
    `InvalidCandidate` error (rows of several jobs go together; each job decides what a bad row does).

    Re-encoding a long prompt once per candidate dominated scoring time, so only the prompt's last
    `TAIL_TOKENS` tokens are re-encoded with each candidate when that tail encodes to the same ids on
    its own (checked once per row); otherwise prompt+candidate is encoded whole. The tails, and then
    the tails with their candidates, of all rows go to the tokenizer in one batch call each. A row
    whose special-token text is to be split and that holds some (`_guarded`) is encoded whole, split.
    """
    bases = tokenizer.encode_many(
        [r.prompt for r in rows], [r.add_special_tokens for r in rows], [r.split_special for r in rows]
    )
    guarded = {i for i, row in enumerate(rows) if _guarded(tokenizer, row)}
    tails = _tails(tokenizer, rows, bases, guarded)
    encoded = tokenizer.encode_short_many([t + c for i, t in tails.items() for c in rows[i].candidates])
    # The other rows' prompt+candidate texts, encoded whole: all rows' in one call (not one per candidate).
    whole = [i for i in range(len(rows)) if i not in tails]
    encoded_whole = tokenizer.encode_many(
        [rows[i].prompt + c for i in whole for c in rows[i].candidates],
        [rows[i].add_special_tokens for i in whole for _ in rows[i].candidates],
        [rows[i].split_special for i in whole for _ in rows[i].candidates],
    )
    with_candidates: dict[int, list[list[int]]] = {}
    at = 0
    for i in tails:
        with_candidates[i] = encoded[at : at + len(rows[i].candidates)]
        at += len(rows[i].candidates)
    whole_ids: dict[int, list[list[int]]] = {}
    at = 0
    for i in whole:
        whole_ids[i] = encoded_whole[at : at + len(rows[i].candidates)]
        at += len(rows[i].candidates)
    return [
        _row_tokens(tokenizer, row, base, with_candidates.get(i), whole_ids.get(i, []))
        for i, (row, base) in enumerate(zip(rows, bases, strict=True))
    ]


def _guarded(tokenizer: Tokenizer, row: RowText) -> bool:
    """Whether `row` splits special-token text and holds some: in its prompt, in a candidate, or across
    the two (the prompt's last characters and a candidate's first)."""
    if not row.split_special:
        return False
    end = row.prompt[max(0, len(row.prompt) - tokenizer.longest_special_text + 1) :]
    return tokenizer.has_special_text(row.prompt) or any(
        tokenizer.has_special_text(end + c) for c in row.candidates
    )


def _tails(
    tokenizer: Tokenizer, rows: Sequence[RowText], bases: list[list[int]], guarded: set[int]
) -> dict[int, str]:
    """By row, the text of its prompt's last `TAIL_TOKENS` tokens where that text ends the prompt and
    encodes back to those same ids on its own (tokenizers that add a prefix space, for example, fail
    the check); rows without one, and `guarded` rows, are not in it."""
    long = [i for i, base in enumerate(bases) if len(base) > TAIL_TOKENS and i not in guarded]
    texts = tokenizer.decode_many([bases[i][-TAIL_TOKENS:] for i in long])
    ends = [(i, t) for i, t in zip(long, texts, strict=True) if rows[i].prompt.endswith(t)]
    ids = tokenizer.encode_short_many([t for _, t in ends])
    return {i: text for (i, text), got in zip(ends, ids, strict=True) if got == bases[i][-TAIL_TOKENS:]}


def _row_tokens(
    tokenizer: Tokenizer,
    row: RowText,
    base: list[int],
    tails: list[list[int]] | None,
    whole: list[list[int]],
) -> RowTokens | InvalidCandidate:
    """The row's prompt tokens and each candidate's one token, from its prompt's tail re-encoded with
    each candidate (`tails`) or else from prompt+candidate encoded whole (`whole`)."""
    if not base:
        return InvalidCandidate(f"row {row.index}: the prompt is empty (it encodes to no tokens)")
    for cand in row.candidates:
        if row.split_special and tokenizer.has_special_text(cand):
            return InvalidCandidate(
                f"row {row.index}: candidate {cand!r} holds a special token's text; a candidate adds "
                "exactly one ordinary token"
            )
    # Per candidate: (tokens of prompt+candidate, whether the prompt's own tokens are kept, last id).
    if tails is not None:
        shape = [
            (len(base) - TAIL_TOKENS + len(ids), ids[:TAIL_TOKENS] == base[-TAIL_TOKENS:], ids[-1])
            for ids in tails
        ]
    else:
        shape = [(len(ids), ids[: len(base)] == base, ids[-1] if ids else -1) for ids in whole]
    out = []
    for cand, (n, kept, last) in zip(row.candidates, shape, strict=True):
        if n != len(base) + 1 or not kept:
            return InvalidCandidate(
                f"row {row.index}: candidate {cand!r} does not add exactly one token to the prompt "
                f"(the prompt is {len(base)} tokens, prompt+candidate is {n}"
                + ("" if kept else ", and the prompt's own tokens change")
                + ")"
            )
        if last in tokenizer.special_ids:
            return InvalidCandidate(f"row {row.index}: candidate {cand!r} is a special token (id {last})")
        out.append(last)
    return base, out


def score_kv_by_default() -> int:
    """A score batch's suffix rows may hold an eighth of MLX's memory limit in keys and values
    (`PrefixScorer._kv_bytes`): their own, and where a model's rows copy their shared prefix (DeepSeek's
    latent attention) those copies, which are most of it. The bound scales with the machine's memory
    rather than a row count."""
    return int(mx.get_memory_limit()) // 8


@dataclass(frozen=True)
class Pick:
    """Row `at` of a block of hidden states (or of logits) is the state after position `position` of
    row `row`'s model input."""

    row: int
    position: int
    at: int


class ScoreHead(Protocol):
    """One kind of score row as `PrefixScorer` sees it: each row's model input, the positions of it
    whose next-token distribution the row needs, and what is kept of those distributions."""

    @property
    def inputs(self) -> Sequence[list[int]]:
        """The rows' model inputs, in order."""
        ...

    def needed(self, row: int) -> range:
        """The positions of row `row`'s input whose next-token distributions it needs (never empty)."""
        ...

    def take(self, logits: mx.array, picks: Sequence[Pick]) -> None:
        """Keep what the picks' rows need: `logits` is (m, vocab) float32, and row `pick.at` of it
        the distribution after position `pick.position` of row `pick.row`'s input."""
        ...


class CandidateHead:
    """Candidate rows: the logits (vocab,) after each prompt's last token, kept for `candidate_scores`."""

    def __init__(self, prompts: Sequence[list[int]]) -> None:
        self.inputs = prompts
        self.logits: list[mx.array | None] = [None] * len(prompts)

    def needed(self, row: int) -> range:
        n = len(self.inputs[row])
        return range(n - 1, n)

    def take(self, logits: mx.array, picks: Sequence[Pick]) -> None:
        mine = logits[mx.array([p.at for p in picks])]  # a copy: a kept row holds no other row's block
        mx.eval(mine)
        for i, p in enumerate(picks):
            self.logits[p.row] = mine[i]


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
    ) -> None:
        self.model = model
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
            if hit and self.prefix_cache is not None:
                cache, reused[id(child)] = self.prefix_cache.begin(
                    known, len(self.model.layers), windows=self.model.model.windows
                )
            else:
                cache = self.model.make_cache()
            self._extend(child, cache, 0, reused.get(id(child), 0))
            for c in cache:  # every branch below goes back here: a windowed layer keeps what that needs
                c.pinned = len(child.span)
            self._visit(child, child.span, cache)
        self._run_leaves(leaves, self.model.make_cache(), 0)
        out: list[list[int]] = [[] for _ in heads]
        for (k, _), n in zip(self._owner, computed_per_row(root, len(self._owner), reused), strict=True):
            out[k].append(n)
        return out

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
            chunk, real = ids[:, start:end], end - start
            pad = padded_size(real) - real if self.pad_shapes and end == len(node.span) else 0
            if pad:  # right padding: no real token sees it, and the cache forgets it at once
                chunk = mx.concatenate([chunk, mx.zeros((1, pad), dtype=mx.int32)], axis=1)
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


def candidate_scores(
    logits: list[mx.array], candidate_ids: list[list[int]]
) -> list[tuple[list[float], list[float]]]:
    """Per row: the candidates' raw logits and full-vocabulary log-probabilities (one device sync)."""
    table = mx.stack(logits)  # (rows, vocab)
    rows = mx.array([r for r, cands in enumerate(candidate_ids) for _ in cands])
    cols = mx.array([c for cands in candidate_ids for c in cands])
    picked = table[rows, cols]
    lse = mx.logsumexp(table, axis=-1)[rows]
    # 1-D float arrays: lists of floats (MLX types `tolist` as any nesting)
    raw, logprobs = cast("list[float]", picked.tolist()), cast("list[float]", (picked - lse).tolist())
    out, start = [], 0
    for cands in candidate_ids:
        end = start + len(cands)
        out.append((raw[start:end], logprobs[start:end]))
        start = end
    return out
