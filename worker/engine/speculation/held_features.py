"""Target features a row's drafter was handed and has not used yet.

A drafter that reads the target's features (MTP, DFlash) turns them into entries of its cache (an MTP
row's: its row of the batch's, `mtp_batch.py`) only when it next proposes. While the draft gate keeps
a batch from drafting, a row's features wait here instead of costing a draft forward every step, and
are entered by one forward when drafting resumes: a drafter that is never asked costs its row a slice
of the target's output a step, nothing more.

Each step's piece is a lazy slice of the batch's forward output, which keeps that output alive; every
`fold_every` pieces are folded into one array, handed back to be computed with the step's forward, so
neither the graph nor the forward outputs held grow with the wait.
"""

from __future__ import annotations

import mlx.core as mx


class HeldFeatures:
    """Per-position features (1, W, F) of consecutive positions, oldest first."""

    def __init__(self, fold_every: int = 32) -> None:
        self.fold_every = fold_every
        self._parts: list[mx.array] = []
        self._loose = 0  # trailing parts not folded yet
        self._length = 0

    def __len__(self) -> int:
        return self._length

    def add(self, features: mx.array) -> list[mx.array]:
        """Hold `features` after what is held; the arrays to compute with the step (a fold), if any."""
        self._parts.append(features)
        self._length += features.shape[1]
        self._loose += 1
        if self._loose < self.fold_every:
            return []
        folded = mx.concatenate(self._parts[-self._loose :], axis=1)
        self._parts[-self._loose :] = [folded]
        self._loose = 0
        return [folded]

    def put_first(self, features: mx.array) -> None:
        """Hold `features` before what is held (positions that came earlier)."""
        self._set([features, *self._parts])

    def take(self, n: int) -> mx.array | None:
        """The first `n` positions held (None for none), no longer held."""
        n = min(n, self._length)
        if n <= 0:
            return None
        whole = self._whole()
        head, rest = whole[:, :n], whole[:, n:]
        self._set([rest] if rest.shape[1] else [])
        return head

    def keep(self, n: int) -> None:
        """Hold only the first `n` positions."""
        if n >= self._length:
            return
        self._set([self._whole()[:, :n]] if n > 0 else [])

    def clear(self) -> None:
        self._set([])

    def _whole(self) -> mx.array:
        return self._parts[0] if len(self._parts) == 1 else mx.concatenate(self._parts, axis=1)

    def _set(self, parts: list[mx.array]) -> None:
        self._parts = parts
        self._loose = len(parts)
        self._length = sum(p.shape[1] for p in parts)
