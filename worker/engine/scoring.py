"""Scoring: next-token logits of candidates after many prompts, sharing every common prefix.

Rows (from one job or many) are put in a radix tree over their prompt tokens. Walking it depth-first
with one batch-1 KV cache, each shared span is computed once (extend the cache, recurse, trim back);
where a node's children are rows with nothing more in common, their suffixes run as one right-padded
batch on top of the node's cache. Right padding needs no special mask: a real token never attends to
a pad that sits after it. Only the positions whose logits are needed go through the LM head.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import mlx.core as mx

from mlxq.jobs.errors import InvalidCandidate
from mlxq.worker.engine.cache.kv_cache import KVCache, broadcast_batch, key_columns
from mlxq.worker.engine.cache.prefix_cache import PrefixCache
from mlxq.worker.engine.cache.token_match import common_length
from mlxq.worker.engine.generate import padded_size
from mlxq.worker.engine.models.base import Model
from mlxq.worker.engine.text.tokenizer import Tokenizer


@dataclass
class ScoreStats:
    computed_tokens: int = 0  # prompt tokens that went through the model
    computed_per_row: list[int] = field(default_factory=list)  # see `computed_per_row`


@dataclass
class _Node:
    span: list[int]
    children: dict[int, _Node] = field(default_factory=dict)
    rows: list[int] = field(default_factory=list)  # rows whose prompt ends at this node's last token
    flat: list[_Node] = field(default_factory=list)  # leaves of subtrees not worth sharing (`compact`)

    def below(self) -> list[_Node]:
        return [*self.children.values(), *self.flat]


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
    with_candidates: dict[int, list[list[int]]] = {}
    at = 0
    for i in tails:
        with_candidates[i] = encoded[at : at + len(rows[i].candidates)]
        at += len(rows[i].candidates)
    return [
        _row_tokens(tokenizer, row, base, with_candidates.get(i))
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
    tokenizer: Tokenizer, row: RowText, base: list[int], tails: list[list[int]] | None
) -> RowTokens | InvalidCandidate:
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
        whole = [
            tokenizer.encode(
                row.prompt + c, add_special_tokens=row.add_special_tokens, split_special=row.split_special
            )
            for c in row.candidates
        ]
        shape = [(len(ids), ids[: len(base)] == base, ids[-1]) for ids in whole]
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


def _insert(root: _Node, tokens: list[int], row: int) -> None:
    node, i = root, 0
    while i < len(tokens):
        child = node.children.get(tokens[i])
        if child is None:
            node.children[tokens[i]] = _Node(span=tokens[i:], rows=[row])
            return
        span = child.span
        k = common_length(span, tokens, i)
        if k < len(span):  # split the child at the first difference
            tail = _Node(span=span[k:], children=child.children, rows=child.rows)
            child.span, child.children, child.rows = span[:k], {span[k]: tail}, []
        node, i = child, i + k
    node.rows.append(row)


def build_tree(prompts: Sequence[list[int]], min_shared: int = 0) -> _Node:
    """Radix tree of prompts; identical prompts share one node. See `compact` for `min_shared`."""
    root = _Node(span=[])
    for row, tokens in enumerate(prompts):
        _insert(root, tokens, row)
    if min_shared > 1:
        compact(root, min_shared)
    return root


def _flatten(node: _Node, prefix: list[int]) -> list[_Node]:
    here = prefix + node.span
    out = [_Node(span=here, rows=list(node.rows))] if node.rows else []
    for child in node.below():
        out.extend(_flatten(child, here))
    return out


def compact(node: _Node, min_shared: int) -> None:
    """Fold subtrees whose shared spans are all shorter than `min_shared` into plain leaves.

    A shared span costs a batch-1 forward of its own and splits its rows into separate batches; a few
    tokens common to some rows (a first word, a space) are cheaper to recompute inside one padded batch.
    """
    for key, child in list(node.children.items()):
        compact(child, min_shared)
        if (
            child.below()
            and len(child.span) < min_shared
            and not any(c.below() for c in child.children.values())
        ):
            del node.children[key]
            node.flat.extend(_flatten(child, []))


def score_kv_by_default() -> int:
    """A score batch's suffix rows may hold an eighth of MLX's memory limit in KV copies (`PrefixScorer`).
    Each row copies its shared prefix (rows of 64 tokens on a 2,048-token prefix hold 75 MB each on the
    Llama-3.2-1B shape and 302 MB on an 8B), so the bound scales with the machine's memory rather than
    a row count: a large GPU batches all 64 rows of a 1B, a small Mac few of an 8B."""
    return int(mx.get_memory_limit()) // 8


class PrefixScorer:
    """Computes last-position logits for many prompts, each shared prefix once.

    With a `PrefixCache`, a top-level span starts from the longest cached prefix, and every span
    computed on the batch-1 path is offered back to the cache for later jobs. With `pad_shapes` (GPUs:
    see `generate.padded_size`) spans and suffix batches are padded on the right, and suffix batches to
    a power-of-two number of rows, so the forwards take few distinct shapes.

    A suffix batch runs on a copy of its shared prefix's keys and values per row: with
    `max_batch_kv_bytes` (and the model's `kv_bytes_per_token`) a batch takes only as many rows as
    keep those copies, prefix and suffixes, within that many bytes (`score_kv_by_default`): without,
    64 rows on a 2,048-token prefix held 19 GB at once on an 8B model, which a 32 GB Mac has not got.

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
        pad_shapes: bool = False,
        interrupt: Callable[[], None] | None = None,
    ) -> None:
        self.model = model
        self.pad_shapes = pad_shapes
        self.prefix_cache = prefix_cache
        self.prefill_chunk = prefill_chunk
        self.max_batch_rows = max_batch_rows
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_kv_bytes = max_batch_kv_bytes
        self.kv_bytes_per_token = kv_bytes_per_token
        self.min_shared = min_shared
        self.interrupt = interrupt or (lambda: None)

    def last_logits(self, prompts: Sequence[list[int]], stats: ScoreStats | None = None) -> list[mx.array]:
        """One (vocab,) float32 logits array per prompt: the distribution of the token after it."""
        stats = stats if stats is not None else ScoreStats()
        out: list[mx.array | None] = [None] * len(prompts)
        root = build_tree(prompts, self.min_shared)
        reused: dict[int, int] = {}  # id(node) -> its tokens taken from the prefix cache
        leaves = []
        for child in root.below():
            hit = self.prefix_cache.peek(child.span) if self.prefix_cache is not None else 0
            if not (hit or child.below() or len(child.span) > self.prefill_chunk):
                leaves.append(child)
                continue
            if hit and self.prefix_cache is not None:
                cache, reused[id(child)] = self.prefix_cache.begin(child.span, len(self.model.layers))
            else:
                cache = self.model.make_cache()
            self._extend(child, cache, out, stats, start=reused.get(id(child), 0))
            self._visit(child, child.span, cache, out, stats)
        self._run_leaves(leaves, self.model.make_cache(), out, stats)
        stats.computed_per_row = computed_per_row(root, len(prompts), reused)
        return [o for o in out if o is not None]  # every row is filled by construction

    def _visit(
        self,
        node: _Node,
        prefix: list[int],
        cache: list[KVCache],
        out: list[mx.array | None],
        stats: ScoreStats,
    ) -> None:
        """Offer `prefix` (what `cache` holds) to the prefix cache, then score everything below `node`."""
        if self.prefix_cache is not None:
            self.prefix_cache.offer(prefix, cache)
        leaves = []
        for child in node.below():
            if child.below() or len(child.span) > self.prefill_chunk:
                self._extend(child, cache, out, stats)
                self._visit(child, prefix + child.span, cache, out, stats)
                for c in cache:
                    c.trim(len(child.span))
            else:
                leaves.append(child)
        self._run_leaves(leaves, cache, out, stats)

    def _extend(
        self, node: _Node, cache: list[KVCache], out: list[mx.array | None], stats: ScoreStats, start: int = 0
    ) -> None:
        """Append the node's span (from `start`) to the batch-1 cache; fill rows that end here."""
        ids = mx.array(node.span, dtype=mx.int32)[None]
        stats.computed_tokens += len(node.span) - start
        while len(node.span) - start > self.prefill_chunk:
            self.interrupt()
            self.model(ids[:, start : start + self.prefill_chunk], cache=cache)
            mx.eval([c.state for c in cache])
            start += self.prefill_chunk
        self.interrupt()
        tail = ids[:, start:]
        real = tail.shape[1]
        pad = padded_size(real) - real if self.pad_shapes else 0
        if pad:  # right padding: no real token sees it, and the cache forgets it at once
            tail = mx.concatenate([tail, mx.zeros((1, pad), dtype=mx.int32)], axis=1)
        hidden = self.model.hidden(tail, cache=cache, last=real - 1)  # (1, 1, H)
        for c in cache:
            c.trim(pad)
        if not node.rows:
            mx.eval([c.state for c in cache])
            return
        logits = self.model.logits(hidden[:, -1, :]).astype(mx.float32)[0]
        mx.eval(logits, [c.state for c in cache])
        for row in node.rows:
            out[row] = logits

    def _run_leaves(
        self, leaves: list[_Node], cache: list[KVCache], out: list[mx.array | None], stats: ScoreStats
    ) -> None:
        for group in self._batches(leaves, cache[0].offset if cache else 0):
            self.interrupt()
            width = max(len(n.span) for n in group)
            pad = group[0].span[0]  # any real id; padded positions are never read
            spans = [n.span for n in group]
            if self.pad_shapes:
                width = padded_size(width)
                spans += [[pad]] * (padded_size(len(group), smallest=1) - len(group))
            ids = mx.array([span + [pad] * (width - len(span)) for span in spans], dtype=mx.int32)
            batch_cache = broadcast_batch(cache, len(spans), width) if cache[0].offset else None
            hidden = self.model.hidden(ids, cache=batch_cache or self.model.make_cache())
            last = mx.array([len(n.span) - 1 for n in group])
            picked = hidden[mx.arange(len(group)), last]  # (B, H): only what the LM head needs
            logits = self.model.logits(picked).astype(mx.float32)
            mx.eval(logits)
            stats.computed_tokens += sum(len(n.span) for n in group)
            for i, n in enumerate(group):
                for row in n.rows:
                    out[row] = logits[i]

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
        `prefix`-token cache holds (`broadcast_batch`'s buffers; with `pad_shapes`, its padding too)."""
        if self.pad_shapes:
            rows, width = padded_size(rows, smallest=1), padded_size(width)
        return rows * key_columns(prefix + width) * self.kv_bytes_per_token


def computed_per_row(root: _Node, n_rows: int, reused: dict[int, int] | None = None) -> list[int]:
    """Prompt tokens each row computed itself: a shared span counts for the first row under it.

    `reused` maps id(node) to how many of its tokens came from the prefix cache (computed by no row).
    """
    computed = [0] * n_rows
    reused = reused or {}

    def first_row(node: _Node) -> int:
        firsts = [first_row(c) for c in node.below()] + node.rows
        first = min(firsts)
        computed[first] += len(node.span) - reused.get(id(node), 0)
        return first

    for child in root.below():
        first_row(child)
    return computed


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
