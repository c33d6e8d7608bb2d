"""A row's tokens as a drafter reads them: its prompt, what it generated, and maybe its pending token,
seen as one sequence without copying them (a drafter takes only what it has not seen yet, so a step
costs host work for the new tokens, not for the whole row)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload


class RowTokens(Sequence[int]):
    """`prompt` then `generated` then `pending` (if any), read-only; slices come back as lists."""

    def __init__(self, prompt: Sequence[int], generated: Sequence[int], pending: int | None = None) -> None:
        self._parts = (prompt, generated, () if pending is None else (pending,))
        self._len = sum(len(p) for p in self._parts)

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._len)
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            out: list[int] = []
            offset = 0
            for part in self._parts:
                lo, hi = max(start - offset, 0), min(stop - offset, len(part))
                if lo < hi:
                    out.extend(part[lo:hi])
                offset += len(part)
            return out
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(index)
        for part in self._parts:
            if index < len(part):
                return int(part[index])
            index -= len(part)
        raise AssertionError("unreachable")
