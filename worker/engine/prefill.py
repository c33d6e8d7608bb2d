"""Prefill: a prompt's keys and values computed into its cache, in chunks, alone or several rows at once.

A long prompt goes in chunks (`ChunkedPrefill`: other work runs between them, and no forward builds a
huge graph); prompts that fit one chunk each go together in one forward (`prefill_rows_layers`), each
row's result what it gets alone. The decode loop that follows lives in `decode_batch.py`.

Given layer taps (a row whose drafter reads the target's hidden states: `layer_taps.py`), a prefill
also collects those layers' outputs for the prompt's positions, so the drafter starts from them instead
of running the target over the prompt again; tapping the final norm's output (`FINAL`) makes the last
layer compute every position, not only the last. Given none, a prefill does what it did before.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from mlxq.worker.engine.cache.kv_cache import KVCache
from mlxq.worker.engine.cache.prefill_rows_cache import PrefillRowsCache, prefill_mask
from mlxq.worker.engine.models.base import Model
from mlxq.worker.engine.models.layer_taps import FINAL, LayerTaps
from mlxq.worker.engine.shapes import padded_size, padded_width


def prefill(
    model: Model,
    tokens: Sequence[int],
    cache: list[KVCache],
    chunk: int,
    pad_shapes: bool = False,
) -> mx.array:
    """Run `tokens` through the model into `cache` in chunks; return the last position's logits (1, V).

    The cache state is evaluated after every chunk so a long prompt never builds one huge graph.
    `pad_shapes`: see `ChunkedPrefill`.
    """
    run = ChunkedPrefill(model, tokens, cache, chunk, pad_shapes)
    while (logits := run.advance()) is None:
        pass
    return logits


class ChunkedPrefill:
    """A prompt's prefill, one chunk per `advance`, so other work (a batch's decode steps) runs between.

    With `pad_shapes` the last chunk is padded on the right to a `padded_width`, and the padding's keys
    and values are trimmed off the cache afterwards: causal attention never lets a real token see a
    later one, so the result is the same while the forward's shape is one of a few.

    With `taps` (layer indices: `layer_taps.py`), each `advance` leaves the chunk's tapped features in
    `tapped` (1, chunk's tokens, features; those of a chunk before the last evaluated with its cache),
    starting at token `tapped_from` of `tokens`; without, `tapped` stays None.
    """

    def __init__(
        self,
        model: Model,
        tokens: Sequence[int],
        cache: list[KVCache],
        chunk: int,
        pad_shapes: bool = False,
        taps: Sequence[int] = (),
    ) -> None:
        if not tokens:
            raise ValueError("prefill needs at least one token")
        self.model = model
        self.cache = cache
        self.chunk = chunk
        self.pad_shapes = pad_shapes
        self.taps = tuple(taps)
        self._ids = mx.array(list(tokens), dtype=mx.int32)[None]
        self.done = 0  # tokens in the cache so far
        self.tapped: mx.array | None = None
        self.tapped_from = 0

    def advance(self) -> mx.array | None:
        """Compute the next chunk; after the last one, return the last position's logits (1, V)."""
        n = self._ids.shape[1]
        taps = LayerTaps(self.taps) if self.taps else None
        self.tapped_from = self.done
        if n - self.done > self.chunk:
            ids = self._ids[:, self.done : self.done + self.chunk]
            if taps is None:
                self.model(ids, cache=self.cache)
                mx.eval([c.state for c in self.cache])
            else:
                self.model.hidden(ids, cache=self.cache, taps=taps)
                self.tapped = taps.features()
                mx.eval([c.state for c in self.cache], self.tapped)
            self.done += self.chunk
            return None
        last = self._ids[:, self.done :]
        real = last.shape[1]
        pad = padded_width(real) - real if self.pad_shapes else 0
        if pad:
            last = mx.concatenate([last, mx.zeros((1, pad), dtype=mx.int32)], axis=1)
        # The final layer computes only the last real position (all positions' keys/values), unless
        # its every position's output is tapped.
        every = taps is not None and FINAL in taps.wanted
        hidden = self.model.hidden(last, cache=self.cache, last=None if every else real - 1, taps=taps)
        for layer in self.cache:
            layer.trim(pad)
        self.done = n
        if taps is not None:
            self.tapped = taps.features()[:, :real]
        return self.model.logits(hidden[:, real - 1 if every else -1, :])


def prefill_rows(
    model: Model, rows: Sequence[tuple[Sequence[int], list[KVCache]]], pad_shapes: bool = False
) -> tuple[list[list[KVCache]], mx.array]:
    """`prefill_rows_layers`, with each row's batch-1 cache (`PrefillRowsCache.row_cache`)."""
    layers, logits = prefill_rows_layers(model, rows, pad_shapes)
    return [[layer.row_cache(i) for layer in layers] for i in range(len(rows))], logits


def prefill_rows_layers(
    model: Model,
    rows: Sequence[tuple[Sequence[int], list[KVCache]]],
    pad_shapes: bool = False,
    taps: LayerTaps | None = None,
) -> tuple[list[PrefillRowsCache], mx.array]:
    """Prefill several prompts in one forward: each row is its new tokens and its batch-1 cache (a
    cached prefix, or empty). Returns the forward's caches, one per layer, holding every row's prefix
    and new tokens (`PrefillRowsCache.row_cache` gives a row's own), and the
    (B, vocab) logits of each row's last token. A row's result is what `prefill` gives it alone (the
    layout and masking are in `PrefillRowsCache`). Meant for prompts that fit one chunk each.

    `pad_shapes`: the forward's rows and cached columns are each rounded up to a `padded_size`, its width
    to a `padded_width` (rows of padding, masked columns), so a GPU meets few shapes.

    `taps`: filled with the tapped layers' outputs (rows, width, hidden), each row's new tokens its
    last columns (rows of padding after the real ones)."""
    if not rows or any(not tokens for tokens, _ in rows):
        raise ValueError("prefill_rows needs rows with at least one new token each")
    new = [len(tokens) for tokens, _ in rows]
    caches_in = [cache for _, cache in rows]
    width, end = max(new), max(c[0].offset if c else 0 for c in caches_in)
    if pad_shapes:
        width, end = padded_width(width), padded_size(end) if end else 0
        extra = padded_size(len(rows), smallest=1) - len(rows)
        new += [1] * extra  # a padding row: one token that sees only itself
        caches_in += [model.make_cache() for _ in range(extra)]
    layers = [
        PrefillRowsCache([cache[n] for cache in caches_in], new, width, end) for n in range(len(model.layers))
    ]
    padded = [[0] * (width - len(t)) + list(t) for t, _ in rows]
    padded += [[0] * width for _ in range(len(new) - len(rows))]
    ids = mx.array(padded, dtype=mx.int32)
    every = taps is not None and FINAL in taps.wanted  # the final layer computes every position
    hidden = model.hidden(
        ids, cache=layers, mask=prefill_mask(layers[0]), last=None if every else width - 1, taps=taps
    )
    logits = model.logits(hidden[: len(rows), -1, :])
    return layers, logits
