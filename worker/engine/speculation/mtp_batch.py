"""The MTP drafter of one row (`mtp.py` holds the MTP layer and how it is loaded)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import mlx.core as mx

from mlxq.worker.engine.cache.kv_cache import KVCache
from mlxq.worker.engine.speculation.held_features import HeldFeatures

if TYPE_CHECKING:
    from mlxq.worker.engine.speculation.mtp import MtpDraft

log = logging.getLogger(__name__)


class ShiftedCache:
    """A batch-1 `KVCache` whose entries sit one position later (RoPE's offset is one more)."""

    def __init__(self) -> None:
        self.inner = KVCache()

    @property
    def offset(self) -> int:
        return self.inner.offset + 1

    @property
    def entries(self) -> int:
        return self.inner.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self.inner.update_and_fetch(keys, values)

    def trim(self, n: int) -> None:
        self.inner.trim(n)


class MtpDrafter:
    """A `Drafter` for one row reading the target's final hidden states (`FeatureReader`): its cache
    holds `entries` entries (positions 1..entries), `held` the hidden states of the positions after
    them, to be entered when a proposal needs them (`held_features.py`), their next token known by
    then. The prompt's come from the batch's prefill (`take_features` from position 0); where the
    prefix cache gave the prompt's first positions, never run by the batch, their hidden states
    (`unseen`) are computed by a forward of the target's own when a proposal first needs them: a row
    that never drafts costs no MTP work, and a feature handed over is never evaluated here."""

    def __init__(self, draft: MtpDraft) -> None:
        self.draft = draft
        self.cache = ShiftedCache()
        self.held = HeldFeatures()
        self.unseen = 0
        self.lost = False

    @property
    def entries(self) -> int:
        return self.cache.entries

    @property
    def _known(self) -> int:
        """Positions whose hidden states the drafter has (entered, to compute, or held)."""
        return self.entries + self.unseen + len(self.held)

    def take_features(self, position: int, features: mx.array, tokens: Sequence[int]) -> list[mx.array]:
        """The target's final hidden states (1, W, hidden) of the row's positions from `position` on;
        `tokens` the row's tokens so far. Held until a proposal enters them; returns what to compute
        with the forward (`HeldFeatures.add`)."""
        if self.lost:
            return []
        self._forget_from(position)
        if position > self._known and not self._catch_up(tokens, position):
            return []
        return self.held.add(features)

    def propose(self, tokens: Sequence[int], depth: int) -> list[int]:
        """The draft after the row's latest token (`tokens[-1]`, not fed yet): the MTP layer's argmax at
        its position, every entry before it made."""
        if depth <= 0 or len(tokens) < 2 or self.lost:
            return []
        before = len(tokens) - 1  # hidden states of positions 0..before - 1 are needed
        self._forget_from(before)
        if self._known < before and not self._catch_up(tokens, before):
            return []
        if self.unseen:
            self.held.put_first(self.draft.features(tokens[: self.unseen]))
            self.unseen = 0
        out = self._enter(tokens, before)
        if out is None:
            return []
        logits = self.draft.target.logits(out[:, -1])
        return [int(cast("int", mx.argmax(logits, axis=-1).item()))]

    def may_propose(self, tokens: Sequence[int]) -> bool:
        return not self.lost

    def accepted(self, proposed: int, kept: int) -> None:
        """Nothing to roll back: entries are made of kept tokens only, and hidden states of drafts not
        kept are replaced when the next forward feeds their positions."""

    def _enter(self, tokens: Sequence[int], upto: int) -> mx.array | None:
        """Make the entries of positions entries + 1 .. upto (their tokens known, their predecessors'
        hidden states held); the outputs of those made (None for none)."""
        start = self.entries
        hidden = self.held.take(min(upto, self._known) - start)
        if hidden is None:
            return None
        return self.draft.outputs(tokens[start + 1 : start + 1 + hidden.shape[1]], hidden, self.cache)

    def _forget_from(self, position: int) -> None:
        """Forget the hidden states of positions from `position` on, and the entries made of them."""
        if position < self.entries:
            self.cache.trim(self.entries - position)
            self.held.clear()
        elif position < self.entries + self.unseen:
            self.unseen = position - self.entries
            self.held.clear()
        else:
            self.held.keep(position - self.entries - self.unseen)

    def _catch_up(self, tokens: Sequence[int], upto: int) -> bool:
        """Count positions 0..upto - 1 as unseen (their hidden states computed when a proposal needs
        them), from an empty drafter (a prompt's prefix the prefix cache gave, or a prompt not
        prefilled by the batch); False, and the drafter stops, on a gap (not expected)."""
        if self._known or upto > len(tokens):
            log.warning("an MTP drafter lost its row (%d held, %d wanted): it stops", self._known, upto)
            self.lost = True
            return False
        self.unseen = upto
        return True
