"""KVCache: step growth, trim, state round trip, copies and batch broadcast; chunked prefill is exact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlxq.worker.engine.cache.kv_cache import KVCache, broadcast_batch, copy_cache
from mlxq.worker.engine.models.loader import load_model
from mlxq.worker.modelfiles.tiny_model import write_random_checkpoint

B, H, D = 1, 2, 4


def kv(n: int, start: float = 0.0, batch: int = B) -> tuple[mx.array, mx.array]:
    """Keys numbered by position (so slices are easy to check); values are keys negated."""
    pos = mx.arange(n, dtype=mx.float32) + start
    keys = mx.broadcast_to(pos[None, None, :, None], (batch, H, n, D))
    return keys, -keys


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder: Path = write_random_checkpoint(tmp_path_factory.mktemp("tiny"))
    return load_model(folder, dtype="float32")[0]


def test_grows_in_steps_not_per_token() -> None:
    cache = KVCache()
    assert (cache.offset, cache.nbytes) == (0, 0)
    keys, values = cache.update_and_fetch(*kv(1))
    assert keys.shape == (B, H, 1, D) and cache.keys is not None
    first_buffer = cache.keys.shape[2]
    assert first_buffer == KVCache.step
    for i in range(1, KVCache.step):
        cache.update_and_fetch(*kv(1, start=i))
    assert cache.keys.shape[2] == KVCache.step  # 256 single-token writes, no reallocation
    keys, values = cache.update_and_fetch(*kv(KVCache.step + 10, start=KVCache.step))
    assert cache.offset == 2 * KVCache.step + 10
    assert cache.keys.shape[2] == 3 * KVCache.step
    assert mx.array_equal(keys[0, 0, :, 0], mx.arange(cache.offset, dtype=mx.float32)).item()
    assert mx.array_equal(values, -keys).item()
    assert cache.nbytes == 2 * B * H * 3 * KVCache.step * D * 4


def test_trim_rewinds_and_next_write_overwrites() -> None:
    cache = KVCache()
    cache.update_and_fetch(*kv(10))
    assert cache.trim(3) == 3 and cache.offset == 7
    assert cache.trim(100) == 7 and cache.offset == 0
    cache.update_and_fetch(*kv(10))
    cache.trim(4)
    keys, _ = cache.update_and_fetch(*kv(2, start=100.0))
    assert keys.shape[2] == 8
    assert keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5, 100, 101]


def test_state_round_trip() -> None:
    cache = KVCache()
    cache.update_and_fetch(*kv(5))
    keys, values = cache.state
    assert keys.shape == (B, H, 5, D)
    restored = KVCache.from_state(keys, values)
    assert restored.offset == 5
    out, _ = restored.update_and_fetch(*kv(1, start=5))
    assert out[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5]
    empty = KVCache()
    assert empty.state[0].size == 0  # evaluable even before the first write
    empty.state = (keys, values)
    assert empty.offset == 5


def test_copy_is_independent() -> None:
    cache = KVCache()
    cache.update_and_fetch(*kv(5))
    (copy,) = copy_cache([cache])
    mx.eval(copy.state)
    cache.trim(2)
    cache.update_and_fetch(*kv(2, start=50.0))  # writes into the original's buffer
    copy.update_and_fetch(*kv(1, start=70.0))
    assert cache.state[0][0, 0, :, 0].tolist() == [0, 1, 2, 50, 51]
    assert copy.state[0][0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 70]
    assert copy_cache([KVCache()])[0].offset == 0


def test_broadcast_batch_gives_independent_rows() -> None:
    cache = KVCache()
    cache.update_and_fetch(*kv(3))
    (batch,) = broadcast_batch([cache], 3)
    assert batch.offset == 3 and batch.state[0].shape == (3, H, 3, D)
    keys, _ = batch.update_and_fetch(*kv(1, start=9.0, batch=3))
    assert keys.shape == (3, H, 4, D)
    assert cache.offset == 3 and cache.state[0].shape[0] == 1
    with pytest.raises(ValueError, match="batch-1"):
        broadcast_batch([batch], 2)


def test_chunked_prefill_equals_one_shot(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(KVCache, "step", 4)  # chunks cross several buffer growths
    ids = mx.array([[(7 * i + 3) % 300 for i in range(23)]], dtype=mx.int32)
    one_shot = model(ids)
    cache = model.make_cache()
    chunks = [model(ids[:, a:b], cache=cache) for a, b in ((0, 5), (5, 6), (6, 17), (17, 23))]
    assert mx.allclose(mx.concatenate(chunks, axis=1), one_shot, atol=1e-5).item()
    assert cache[0].offset == 23 and cache[0].keys is not None and cache[0].keys.shape[2] == 24
    full_cache = model.make_cache()
    model(ids, cache=full_cache)
    assert all(
        mx.allclose(a.state[0], b.state[0], atol=1e-6).item() for a, b in zip(cache, full_cache, strict=True)
    )


def test_trim_then_recompute_matches_fresh(model: Any) -> None:
    """A cache trimmed back to a prefix acts like one that only saw the prefix (prefix-cache reuse)."""
    ids = mx.array([[5, 17, 42, 99, 120, 7, 8, 250]], dtype=mx.int32)
    cache = model.make_cache()
    model(ids, cache=cache)
    assert all(c.trim(3) == 3 for c in cache)
    replay = model(ids[:, 5:], cache=cache)
    assert mx.allclose(replay, model(ids)[:, 5:], atol=1e-5).item()
    assert sum(c.nbytes for c in cache) > 0


def test_broadcast_batch_with_room_writes_in_place_and_reads_whole_steps() -> None:
    cache = KVCache()
    cache.update_and_fetch(*kv(3))
    (batch,) = broadcast_batch([cache], 2, room=5)
    assert batch.offset == 3 and batch.keys is not None and batch.keys.shape == (2, H, KVCache.step, D)
    buffer = batch.keys
    keys, _ = batch.update_and_fetch(*kv(5, start=9.0, batch=2), columns=KVCache.step)
    assert batch.keys is buffer  # written in place, no growth
    assert keys.shape == (2, H, KVCache.step, D) and batch.offset == 8
    assert batch.state[0][1, 0, :, 0].tolist() == [0, 1, 2, 9, 10, 11, 12, 13]
