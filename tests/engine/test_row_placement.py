"""A decode batch's row placement on its own: which buffer row holds each live row as rows join and
leave, over real batch caches whose every column says whose token it is."""

from __future__ import annotations

import mlx.core as mx

from mlxq.worker.engine.cache.batch_cache import BatchKVCache
from mlxq.worker.engine.cache.kv_cache import KVCache
from mlxq.worker.engine.row_placement import RowPlacement


def _rows(owners: list[int], length: dict[int, int]) -> list[list[KVCache]]:
    """Each owner's prefilled batch-1 caches, two layers: the key at position t is 100 * owner + t."""
    out = []
    for owner in owners:
        n = length[owner]
        a = (100 * owner + mx.arange(n, dtype=mx.float32))[None, None, :, None] * mx.ones((1, 2, n, 4))
        out.append([KVCache.from_state(a, a + 0.5) for _ in range(2)])
    return out


def _held(placement: RowPlacement) -> list[list[list[float]]]:
    """Each live row's keys in each layer, read from its buffer row, in row order."""
    return [
        [layer.row(slot).state[0][0, 0, :, 0].tolist() for layer in placement.cache]
        for slot in placement.slots
    ]


def _own(owners: list[int], length: dict[int, int]) -> list[list[list[float]]]:
    return [[[100.0 * o + t for t in range(length[o])]] * 2 for o in owners]


def test_rows_that_leave_stay_idle_until_the_buffers_can_shrink_and_newcomers_take_their_rows() -> None:
    length = {o: 3 + o % 4 for o in range(8)}
    length[7] = 40  # longer than every row: it cannot be written into an idle row
    placement = RowPlacement([BatchKVCache(), BatchKVCache()], pad_shapes=True)
    placement.join(_rows([0, 1, 2, 3, 4, 5], length))
    assert (placement.placed, placement.cache[0].batch, placement.idle, placement.index) == (6, 8, 2, None)
    live = [0, 1, 2, 3, 4, 5]

    placement.keep([0, 2, 3, 4, 5])  # row 1 leaves: 5 rows still need 8, its buffer row idles
    live = [0, 2, 3, 4, 5]
    assert (placement.slots, placement.idle_rows(), placement.cache[1].batch) == (
        [0, 2, 3, 4, 5],
        [1, 6, 7],
        8,
    )
    assert placement.index is not None and placement.index.tolist() == [0, 2, 3, 4, 5]
    assert _held(placement) == _own(live, length)

    keys = placement.cache[0].keys
    placement.join(_rows([6], length))  # written into the first idle row: the buffers not copied
    live.append(6)
    assert placement.slots == [0, 2, 3, 4, 5, 1] and placement.cache[0].keys is keys
    assert _held(placement) == _own(live, length)

    fed = mx.arange(1, 7, dtype=mx.int32)[:, None]  # a forward's input, one token per live row
    spread = placement.spread(fed)
    assert spread[:, 0].tolist() == [1, 6, 2, 3, 4, 5, 0, 0]  # each at its buffer row, idle rows fed 0
    assert placement.live(spread).tolist() == fed.tolist()

    placement.keep([0, 1, 3])  # 3 live rows fit 4: one copy, live rows first in row order
    live = [0, 2, 4]
    assert (placement.slots, placement.index, placement.cache[0].batch) == ([0, 1, 2], None, 4)
    assert _held(placement) == _own(live, length)

    placement.join(_rows([7], length))  # too long for the idle row: the buffers are copied with it
    live.append(7)
    assert (placement.slots, placement.idle, placement.cache[1].batch) == ([0, 1, 2, 3], 0, 4)
    assert _held(placement) == _own(live, length)


def test_without_padding_the_buffers_hold_exactly_the_live_rows() -> None:
    length = {0: 3, 1: 5, 2: 4}
    placement = RowPlacement([BatchKVCache(), BatchKVCache()], pad_shapes=False)
    placement.join(_rows([0, 1, 2], length))
    assert (placement.cache[0].batch, placement.idle) == (3, 0)
    placement.keep([0, 2])
    assert (placement.slots, placement.cache[0].batch, placement.index) == ([0, 1], 2, None)
    assert _held(placement) == _own([0, 2], length)
    assert placement.spread(mx.array([[7], [8]], dtype=mx.int32)).tolist() == [[7], [8]]
