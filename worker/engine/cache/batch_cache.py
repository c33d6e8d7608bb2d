"""One layer's keys/values for a batch of sequences of different lengths, decoded together.

Layout: left padding. Row i holds its own sequence in columns `start[i] .. end-1` of a shared
(B, n_kv_heads, capacity, head_dim) buffer; columns before `start[i]` are padding (zeros, or the
keys of a rows prefill's padding tokens: `adopt`) that a boolean mask hides. Every row ends at the
same column, so one decode step writes all rows' new keys with one slice assignment (no per-row
scatter), and the model's attention is unchanged.

Positions stay per row: `offset` is an array of each row's own length, which the model passes straight
to `mx.fast.rope` (it takes a vector of per-row offsets). So a row is rotated exactly as it would be
alone; with float32 on the CPU, masked columns add exact zeros to attention, and every matmul is row by
row, so a row's logits are bit-identical to running it alone (the batch tests check this).

Why not right padding with masks (rows start at column 0)? Then each row writes its new token at its
own column: a scatter per step, and a mask per step anyway. Left padding costs memory instead: the
buffer is as long as the longest row. Rows that join are padded to the current end (or, when longer,
everyone else is padded further), or written into a free row of the buffers (`put`); rows that leave
are dropped and the common left padding is trimmed in whole steps, so the waste is bounded by the
spread of the current rows' lengths plus a step.
A verify step of speculative decoding (`trim_rows`) writes several columns for every row and each row
keeps as many as the target accepted of them: the batch ends where the row that kept most ends, and
the columns another row did not keep become holes of that row (hidden by the mask like padding, not
counted in its position). Nothing moves: holes cost a few columns per verify step until the row leaves
or the buffers are copied for a membership change (`row` then gives the row without its holes).
Membership changes copy the buffer once (like one step's attention reads it); steps never do. The
buffers always hold a whole number of steps (256 columns), spare room kept across membership changes:
on a GPU every new buffer shape may cost kernel building, and rows leaving one by one made a new shape
at almost every departure.
A sliding-window layer's batch (`window` set) drops its oldest columns as its batch-1 cache does
(`kv_cache.py`): the buffers start at column `base`, every other column number (`starts`, `end`,
holes, masks) stays the batch's, the same in every layer, so one mask or one `RaggedRows` serves
global and windowed layers alike (attention right-aligns a mask to the keys; `RaggedRows.placed`
moves the kernel's columns). What is dropped before a write is what no row's next queries see: every
row's last window - 1 own columns lie within the last window - 1 + its holes columns, and `ROLLBACK`
more stay for a verify step's trim. The invariant every membership change keeps: each row's own
columns from `base` on are all held. A row that joins with dropped positions has held its last
window - 1 + `ROLLBACK` at least, so `base` moves up to where the latest joining row's held columns
begin (what the others lose there is out of their windows too); `put` refuses such a row where its
held columns begin after `base` (`add` then copies). A row that leaves takes its held columns (`row`,
with `base` its dropped positions).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import cast

import mlx.core as mx
import numpy as np

from mlxq.worker.engine.cache.kv_cache import KVCache, drop_oldest, key_columns, pad_columns, slide_base
from mlxq.worker.engine.cache.prefill_rows_cache import PrefillRowsCache
from mlxq.worker.engine.cache.squeeze_plan import SqueezePlan


class BatchKVCache:
    """Keys and values of one attention layer for B left-padded rows ending at the same column."""

    step = 256

    def __init__(self, window: int | None = None) -> None:
        self.window = window  # a sliding-window layer's window: older columns are dropped
        self.base = 0  # columns dropped: the buffers' column 0 is the batch's column `base`
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.starts: list[int] = []  # per row: first column it owns
        self.end = 0  # columns written (the same for every row)
        self._starts = mx.zeros((0,), dtype=mx.int32)
        self._aligned = True
        self.holes: list[int] = []  # per row: columns after its start it does not own (`trim_rows`)
        self._most_holes = 0
        # (B, width <= end) bool, True at holes; None: no holes. Kept on the host: it is made from host
        # ints, and reading it back from the device (a copy squeezing holes out) would wait for the step
        # in flight, once a layer
        self._hidden: np.ndarray | None = None
        self._holes = mx.zeros((0,), dtype=mx.int32)
        # A forward that reads whole steps of columns (`read_whole_steps`): the columns it reads
        self.read_to: int | None = None
        # A forward's RoPE offsets, made once for all the batch's layers (`one_offset`)
        self._offset: mx.array | int | None = None
        # The latest plan for squeezing holes out (`_squeezed`), which the batch's other layers reuse
        self._plan: SqueezePlan | None = None

    @classmethod
    def of_empty_rows(cls, rows: int) -> BatchKVCache:
        """`rows` rows holding no tokens yet, entering their first ones together (`trim_rows` keeps each
        row's count); their first write makes the buffers, of its keys' and values' shapes."""
        cache = cls()
        cache._set([0] * rows, 0)
        return cache

    @property
    def batch(self) -> int:
        return len(self.starts)

    @property
    def lengths(self) -> list[int]:
        """Tokens each row holds."""
        return [self.end - s - h for s, h in zip(self.starts, self.holes, strict=True)]

    @property
    def offset(self) -> mx.array | int:
        """Per-row position of the next token (the row's own length): RoPE's offset vector; a plain int
        when no row is padded (all rows the same length: RoPE's scalar path, as for one sequence)."""
        if self._offset is not None:
            return self._offset
        if self._aligned:
            return self.end
        if self._hidden is None:
            return self.end - self._starts
        return self.end - self._starts - self._holes

    @property
    def has_holes(self) -> bool:
        """Whether some row has holes (`trim_rows`): attention then needs the mask, not the ragged kernel."""
        return self._hidden is not None

    def mask(self, n: int = 1, columns: int | None = None) -> mx.array | None:
        """Boolean (B, 1, n, end + n) attention mask for `n` new tokens per row (causal among them);
        None if no row is padded or has holes (plain causal attention is exact then). With `columns`
        (at least end + n: a forward reading whole steps, `read_whole_steps`) the mask is that wide,
        the columns past the new tokens hidden, and never None."""
        if columns is None and not any(self.starts) and self._hidden is None:
            return None
        total = self.end + n if columns is None else columns
        if total < self.end + n:
            raise ValueError(f"a mask of {n} new tokens needs {self.end + n} columns or more, got {total}")
        columns_at = mx.arange(total, dtype=mx.int32)
        visible = columns_at[None, :] >= self._starts[:, None]
        if self._hidden is not None:
            hidden = self._hidden
            visible = visible & ~mx.array(np.pad(hidden, [(0, 0), (0, total - hidden.shape[1])]))
        if n == 1 and columns is None:
            return visible[:, None, None, :]
        causal = columns_at[None, :] <= mx.arange(self.end, self.end + n, dtype=mx.int32)[:, None]
        return (visible[:, None, :] & causal[None])[:, None, :, :]

    def read_whole_steps(self, n: int) -> int:
        """Before a forward of `n` new tokens per row: make its attention read the buffers up to a whole
        number of steps (`key_columns`) instead of exactly to the new end, and return that many columns
        (the forward's mask must hide the ones past each query: `mask(n, columns)`). On MLX's CUDA build
        attention over several queries builds a plan per key length, many times the step's cost; a
        verify step's end moves every step, whole steps move it once per 256 columns. A windowed layer
        keeps exact reads (its buffers start at `base`). `read_exactly` undoes it. Rows holding no
        tokens yet (`of_empty_rows`) have no buffers to make room in: the forward's write makes them,
        as wide as the columns read."""
        if self.window is not None:
            raise ValueError("a windowed layer's reads follow its window: it reads exactly")
        columns = key_columns(self.end + n)
        if self.keys is not None:
            self.reserve(columns - self.end)
        self.read_to = columns
        return columns

    def read_exactly(self) -> None:
        """Back to reading exactly the columns written (after the forward of `read_whole_steps`)."""
        self.read_to = None

    def trim_rows(self, written: int, kept: list[int]) -> None:
        """After a forward that wrote `written` columns for every row, row i keeps the first `kept[i]`
        of them: the batch ends where the longest kept ends, each shorter row's other columns become
        its holes (the columns past every row's kept ones are simply forgotten)."""
        if len(kept) != self.batch or any(not 0 <= k <= written for k in kept):
            raise ValueError(
                f"trim_rows needs 0..{written} kept columns for each of {self.batch} rows, got {kept}"
            )
        first, most = self.end - written, max(kept)
        self.end = first + most
        if all(k == most for k in kept):
            return
        columns = np.arange(self.end, dtype=np.int32)[None, :]
        new = columns >= first + np.array(kept, dtype=np.int32)[:, None]
        if self._hidden is not None:
            new = new | np.pad(self._hidden, [(0, 0), (0, self.end - self._hidden.shape[1])])
        self._hidden = new
        self.holes = [h + most - k for h, k in zip(self.holes, kept, strict=True)]
        self._most_holes = max(self.holes)
        self._holes = mx.array(self.holes, dtype=mx.int32)
        self._aligned = False

    def reserve(self, n: int) -> None:
        """Make room for `n` more columns (whole steps at a time), so the next writes grow nothing. The
        buffers must exist: rows holding no tokens yet (`of_empty_rows`) have none, and their shape
        (heads, features) comes with their first write's keys, which makes them (`write`)."""
        assert self.batch, "add rows before decoding"
        assert self.keys is not None and self.values is not None, "rows holding no tokens have no buffers"
        if self.end + n - self.base > self.keys.shape[2]:
            extra = -(-(self.end + n - self.base - self.keys.shape[2]) // self.step) * self.step
            self.keys = pad_columns(self.keys, 0, extra)
            self.values = pad_columns(self.values, 0, extra)

    @property
    def capacity(self) -> int:
        """Columns the buffers hold (written or not)."""
        return 0 if self.keys is None else self.keys.shape[2]

    def write(self, keys: mx.array, values: mx.array) -> None:
        """Append (B, n_kv_heads, L, head_dim) at column `end` for every row."""
        self._slide()
        start, n = self.end, keys.shape[2]
        if self.keys is None:  # rows holding no tokens yet (`of_empty_rows`): buffers of whole steps
            columns = key_columns(max(start + n, self.read_to or 0))
            (_, heads, _, k_dim), v_dim = keys.shape, values.shape[3]
            self.keys = mx.zeros((self.batch, heads, columns, k_dim), keys.dtype)
            self.values = mx.zeros((self.batch, heads, columns, v_dim), values.dtype)
        self.reserve(n)
        assert self.keys is not None and self.values is not None
        self.end = start + n
        self.keys[:, :, start - self.base : self.end - self.base] = keys
        self.values[:, :, start - self.base : self.end - self.base] = values

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """`write`, then return all columns held (a windowed layer's from `base` on), or with
        `read_whole_steps` the columns up to `read_to` (those past `end` hidden by the mask)."""
        self.write(keys, values)
        assert self.keys is not None and self.values is not None
        stop = max(self.end, self.read_to or 0) - self.base
        return self.keys[..., :stop, :], self.values[..., :stop, :]

    def _slide(self) -> None:
        """A windowed layer: drop the whole steps of oldest columns no row's next queries see (a row's
        last window - 1 own columns lie within window - 1 + its holes columns before `end`), in one
        copy; the buffers keep their shape unless it is far more than the held columns need."""
        if self.window is None or self.keys is None or self.values is None or not self.starts:
            return
        base = slide_base(self.base, self.end - self._most_holes, self.window, self.step)
        if base == self.base:
            return
        self.keys, self.values = drop_oldest(
            self.keys, self.values, base - self.base, self.end - self.base, self.step
        )
        self.base = base

    # --- membership -----------------------------------------------------------------------------

    def add(self, rows: list[KVCache]) -> None:
        """Append batch-1 caches (e.g. freshly prefilled prompts) as new rows, left-padded to fit.

        A lone row joining an empty batch hands over its buffers when they hold whole steps (a prefill
        wrote them in place, e.g. into the prefix cache's copy of a long cached prefix): no copy; that
        row's cache is left empty, so no two caches share a buffer (see `kv_cache.py`)."""
        if not rows or self._take_buffers(rows):
            return
        new_end = max(self.end, *(r.offset for r in rows))
        grow = new_end - self.end
        # Where each part with dropped positions (a windowed layer's) holds its columns from, in the new
        # numbering: the buffers start at the latest, so every row's own columns past it are held.
        held = [self.base + grow] if self.keys is not None and self.base else []
        held += [new_end - r.offset + r.base for r in rows if r.base]
        base = max([0, *held])
        spare = key_columns(new_end - base + 1) - (new_end - base)  # whole steps, room for the next token
        parts_k, parts_v = [], []

        def part(a: mx.array, first: int) -> mx.array:
            """Columns of a part whose column 0 is the batch's `first`, from `base` to `new_end`."""
            return pad_columns(a[..., max(base - first, 0) :, :], max(first - base, 0), spare)

        if self.keys is not None and self.values is not None:
            parts_k.append(part(self.keys[..., : self.end - self.base, :], self.base + grow))
            parts_v.append(part(self.values[..., : self.end - self.base, :], self.base + grow))
        starts = [s + grow for s in self.starts]
        for row in rows:
            keys, values = row.state
            if keys.shape[0] != 1:
                raise ValueError(f"rows join a batch one at a time, got a batch-{keys.shape[0]} cache")
            pad = new_end - row.offset
            parts_k.append(part(keys, pad + row.base))
            parts_v.append(part(values, pad + row.base))
            starts.append(pad)
        self.base = base
        self.keys = mx.concatenate(parts_k, axis=0)
        self.values = mx.concatenate(parts_v, axis=0)
        hidden = self._hidden
        if hidden is not None:  # the rows there keep their holes, shifted by the new left padding
            hidden = np.pad(hidden, [(0, len(rows)), (grow, new_end - grow - hidden.shape[1])])
        self._set(starts, new_end, [*self.holes, *([0] * len(rows))], hidden)

    def _take_buffers(self, rows: list[KVCache]) -> bool:
        """`add`'s lone row joining an empty batch: take its buffers, when they hold whole steps, and
        leave its cache empty. False (nothing taken) otherwise."""
        row = rows[0]
        if (
            self.keys is None
            and len(rows) == 1
            and row.keys is not None
            and row.values is not None
            and row.keys.shape[0] == 1
            and row.offset > 0
            and row.keys.shape[2] % self.step == 0
        ):
            self.keys, self.values, self.base = row.keys, row.values, row.base
            self._set([0], row.offset)
            row.keys = row.values = None
            row.offset = row.base = 0
            return True
        return False

    def adopt(self, prefilled: PrefillRowsCache, rows: int) -> bool:
        """Take over the buffers of a rows prefill (`prefill_rows_layers`) as an empty batch's: its
        first `rows` rows become this batch's rows, any after them padding rows. No copy of the rows:
        with no cached parts, each row's tokens already end at the last column, left-padded (the
        padding columns hold the keys of padding tokens, not zeros: the mask hides them all the
        same); spare columns to a whole step are appended. False (nothing taken) where the rows had
        cached parts (a gap between those and the new tokens) or this batch is not empty."""
        if self.keys is not None or prefilled.end or prefilled.keys is None or prefilled.values is None:
            return False
        width = prefilled.width
        spare = key_columns(width + 1) - width
        self.base = 0
        self.keys = pad_columns(prefilled.keys, 0, spare)
        self.values = pad_columns(prefilled.values, 0, spare)
        padding = len(prefilled.new) - rows
        self._set([width - n for n in prefilled.new[:rows]] + [width] * padding, width)
        return True

    def put(self, slots: list[int], rows: list[KVCache]) -> bool:
        """Write batch-1 caches into rows `slots` (padding or rows that left), each ending at column
        `end` like every row: no copy of the buffers. False (nothing written) where a cache is longer
        than `end`: then every row needs more left padding, which `add` does."""
        if not self.can_put(rows):
            return False
        assert self.keys is not None and self.values is not None
        # One write per buffer: the rows' held columns from `base` on (a windowed layer's older ones
        # are out of every window), left-padded to one width.
        held = [max(self.end - r.offset + r.base, self.base) for r in rows]  # first column written
        width = self.end - min(held)
        index = mx.array(slots, dtype=mx.int32)
        for i, buffer in enumerate((self.keys, self.values)):
            block = mx.concatenate(
                [
                    pad_columns(
                        r.state[i][:, :, h - (self.end - r.offset + r.base) :], h - (self.end - width), 0
                    )
                    for r, h in zip(rows, held, strict=True)
                ]
            )
            buffer[index, :, self.end - self.base - width : self.end - self.base, :] = block
        starts, holes = list(self.starts), list(self.holes)
        hidden = None if self._hidden is None else self._hidden.copy()
        for slot, row in zip(slots, rows, strict=True):
            starts[slot], holes[slot] = self.end - row.offset, 0
        if hidden is not None:
            hidden[slots] = False
        self._set(starts, self.end, holes, hidden)
        return True

    def can_put(self, rows: list[KVCache]) -> bool:
        """Whether `put` takes these caches: none longer than `end`, and none holding its columns from
        after `base` on (a windowed row's dropped positions there would be missing)."""
        if self.keys is None or any(r.offset > self.end for r in rows):
            return False
        return all(not r.base or self.end - r.offset + r.base <= self.base for r in rows)

    def add_padding(self, n: int) -> None:
        """Append `n` rows that hold no tokens (all columns masked): they keep the batch at a padded
        size. A padding row's query sees only its own new column, so it stays finite."""
        if n <= 0:
            return
        assert self.keys is not None and self.values is not None, "add real rows first"
        self.keys, self.values = (
            mx.concatenate([a, mx.zeros((n, *a.shape[1:]), a.dtype)]) for a in (self.keys, self.values)
        )
        hidden = None if self._hidden is None else np.pad(self._hidden, [(0, n), (0, 0)])
        self._set([*self.starts, *([self.end] * n)], self.end, [*self.holes, *([0] * n)], hidden)

    def row(self, i: int) -> KVCache:
        """Row `i` alone, as a batch-1 cache holding exactly its own tokens (its holes left out)."""
        assert self.keys is not None and self.values is not None
        s = self.starts[i]
        lo = max(s, self.base)  # a windowed layer's own columns before `base` are dropped
        keys = self.keys[i : i + 1, :, lo - self.base : self.end - self.base, :]
        values = self.values[i : i + 1, :, lo - self.base : self.end - self.base, :]
        dropped = lo - s
        if self.holes[i] and self._hidden is not None:
            hidden = cast("list[bool]", self._hidden[i].tolist())  # numpy: no evaluation
            dropped -= sum(hidden[s : min(lo, len(hidden))])
            own = mx.array(
                [c - lo for c in range(lo, self.end) if c >= len(hidden) or not hidden[c]], dtype=mx.int32
            )
            keys, values = keys[:, :, own, :], values[:, :, own, :]
        return KVCache.from_state(keys, values, base=dropped, window=self.window)

    def keep(
        self, rows: list[int], padding: list[int] | None = None, like: BatchKVCache | None = None
    ) -> None:
        """Keep only `rows` (in this order), then the rows `padding` as padding rows (their tokens masked,
        as `add_padding`'s: reusing rows saves a copy); trim the whole steps of left padding `rows` all
        share. `like`: another layer of the same batch that just kept the same rows, whose plan for
        squeezing holes out this one reuses (the layers of a batch hold the same columns; worked out
        once, not once a layer)."""
        padding = padding or []
        if not rows:
            self.keys = self.values = None
            self.base = 0
            self._set([], 0)
            return
        assert self.keys is not None and self.values is not None
        index = mx.array([*rows, *padding], dtype=mx.int32)
        if any(self.holes[i] for i in rows):  # copied anyway: the rows' holes squeezed out on the way
            self.keys, self.values, starts, self.base = self._squeezed(index, len(rows), like)
            padding_starts = starts[len(rows) :]
            starts = starts[: len(rows)]
            trim = min(starts) // self.step * self.step
            cut = max(trim - self.base, 0)  # buffer columns before the new first one
            self.keys, self.values = self.keys[:, :, cut:, :], self.values[:, :, cut:, :]
        else:
            padding_starts = [self.end] * len(padding)
            starts = [self.starts[i] for i in rows]
            trim = min(starts) // self.step * self.step
            cut = max(trim - self.base, 0)
            self.keys = self.keys[index, :, cut:, :]
            self.values = self.values[index, :, cut:, :]
        self.base = max(self.base, trim) - trim
        end = self.end - trim
        self._set([*(s - trim for s in starts), *(s - trim for s in padding_starts)], end)

    def _squeezed(
        self, index: mx.array, live: int, like: BatchKVCache | None = None
    ) -> tuple[mx.array, mx.array, list[int], int]:
        """Buffers holding the rows `index` (the first `live` of them rows, the rest padding) with every
        row's own columns right-aligned at `end`, its holes gone (one gather), spare room to a whole
        step after `end`; each row's first column; and the buffers' first column.

        A windowed layer's row may have dropped its oldest own columns: its held ones, right-aligned,
        then begin after its start, and the buffers begin where the latest such row's held columns
        do (no row's columns past the buffers' first are then missing; every row keeps at least its
        window and a rollback: each held that many own columns from `base` on)."""
        assert self.keys is not None and self.values is not None and self._hidden is not None
        picked = cast("list[int]", index.tolist())
        key = (tuple(picked), live, self.end, self.base)
        plan = like._plan if like is not None and self.window is None and like.window is None else None
        if plan is None or plan.made_for != key:
            plan = SqueezePlan(self._hidden, self.starts, self.end, self.base, picked, live)
        self._plan = plan
        return plan.squeezed(self.keys, index), plan.squeezed(self.values, index), plan.starts, plan.base

    def _set(
        self, starts: list[int], end: int, holes: list[int] | None = None, hidden: np.ndarray | None = None
    ) -> None:
        """The rows' first columns and the common end; `holes` (each row's count) with `hidden`, the
        (B, width) mask of where they are; none by default."""
        self.starts, self.end = starts, end
        self._starts = mx.array(starts, dtype=mx.int32)
        self.holes = holes if holes is not None and any(holes) else [0] * len(starts)
        self._most_holes = max(self.holes, default=0)  # a windowed layer's `_slide` reads it every write
        self._hidden = hidden if any(self.holes) else None
        self._holes = mx.array(self.holes, dtype=mx.int32)
        self._aligned = not any(starts) and self._hidden is None

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return int(self.keys.nbytes + self.values.nbytes)

    def __repr__(self) -> str:
        return f"BatchKVCache(batch={self.batch}, end={self.end}, starts={self.starts})"


@contextmanager
def one_offset(layers: Sequence[BatchKVCache]) -> Iterator[None]:
    """Within, every layer of a batch reads the first one's RoPE offsets (the rows' lengths, the same in
    every layer) as one array, where each layer would subtract its own: a kernel a layer on a GPU. For
    one forward: each layer reads them before it writes its columns."""
    offset = layers[0].offset
    for layer in layers:
        layer._offset = offset
    try:
        yield
    finally:
        for layer in layers:
            layer._offset = None


@contextmanager
def whole_steps(layers: Sequence[BatchKVCache], n: int, on: bool) -> Iterator[int | None]:
    """For one forward of `n` new tokens per row: with `on` and `n` over 1, every layer reads whole steps
    of its columns (`read_whole_steps`) and the key columns read are yielded, for the forward's mask
    (`mask(n, columns)`); else None (exact reads, as without it). Reads are exact again after it,
    whatever happens within (`read_exactly`). A windowed layer cannot read so: its batch passes `on`
    False."""
    columns = None
    try:
        if on and n > 1:
            columns = layers[0].read_whole_steps(n)
            for layer in layers[1:]:
                layer.read_whole_steps(n)
        yield columns
    finally:
        for layer in layers:
            layer.read_exactly()
