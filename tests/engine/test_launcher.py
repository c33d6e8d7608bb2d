"""`Launcher`: launches on its own thread what the creating thread built, one at a time."""

from __future__ import annotations

import sys
import threading

import mlx.core as mx
import pytest

import mlxq.worker.engine.launcher as launcher_module
from mlxq.worker.engine.forward_pieces import ForwardPieces
from mlxq.worker.engine.launcher import SWITCH_INTERVAL_S, Launcher


class _NotedMx:
    """`mlx.core` for a module under test, noting the thread of each `async_eval` into `threads`."""

    def __init__(self, threads: list[str]) -> None:
        self.threads = threads

    def __getattr__(self, name: str) -> object:
        return getattr(mx, name)

    def async_eval(self, *arrays: mx.array) -> None:
        self.threads.append(threading.current_thread().name)
        mx.async_eval(*arrays)


def test_ops_made_on_the_creating_thread_launch_on_the_launchers_and_close_puts_back_what_it_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    switch = sys.getswitchinterval()
    stream = mx.default_stream(mx.default_device())
    threads: list[str] = []

    monkeypatch.setattr(launcher_module, "mx", _NotedMx(threads))
    launcher = Launcher()
    try:
        assert launcher.here and sys.getswitchinterval() == pytest.approx(min(switch, SWITCH_INTERVAL_S))
        assert mx.default_stream(mx.default_device()) == launcher.stream
        a = mx.arange(8) * 3  # made here: on the launcher's stream, which its thread may evaluate
        launcher.launch(a)
        b = a + 1  # built while `a` may still be launching
        launcher.launch(b)  # waits for `a`'s launch first
        launcher.wait()
        assert not launcher.busy
        assert b.tolist() == [3 * i + 1 for i in range(8)] and a.tolist() == [3 * i for i in range(8)]
        assert len(threads) == 2 and all(name.startswith("mlxq-launch") for name in threads)
        seen: list[bool] = []  # `here` is the creating thread only
        other = threading.Thread(target=lambda: seen.append(launcher.here))
        other.start()
        other.join()
        assert seen == [False]
    finally:
        launcher.close()
    assert sys.getswitchinterval() == pytest.approx(switch)
    assert mx.default_stream(mx.default_device()) == stream


def test_a_failed_launch_raises_at_the_next_wait_once(monkeypatch: pytest.MonkeyPatch) -> None:
    class Failing:
        def __getattr__(self, name: str) -> object:
            return getattr(mx, name)

        def async_eval(self, *arrays: mx.array) -> None:
            if any(a.size == 3 for a in arrays):
                raise RuntimeError("the launch failed")
            mx.async_eval(*arrays)

    monkeypatch.setattr(launcher_module, "mx", Failing())
    launcher = Launcher()
    try:
        launcher.launch(mx.zeros(3))
        with pytest.raises(RuntimeError, match="the launch failed"):
            launcher.wait()
        launcher.wait()  # raised once; nothing is in flight
        ok = mx.ones(4) * 2
        launcher.launch(ok)
        launcher.wait()
        assert ok.tolist() == [2.0] * 4
    finally:
        launcher.close()


def test_a_forward_launched_behind_the_tokens_does_not_hold_the_caller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`launch_tokens(..., then=forward)`: both launches go to the launcher's thread, one after the
    other, and the caller returns before either ends; `tokens_launch` says when the copy may be read,
    `wait` waits for both."""
    started, release = threading.Event(), threading.Event()
    order: list[int] = []

    class Held:
        def __getattr__(self, name: str) -> object:
            return getattr(mx, name)

        def async_eval(self, *arrays: mx.array) -> None:
            order.append(arrays[0].size)
            started.set()
            release.wait(5)
            mx.async_eval(*arrays)

    monkeypatch.setattr(launcher_module, "mx", Held())
    launcher = Launcher()
    try:
        tokens = mx.arange(4)
        forward = mx.concatenate([tokens, tokens[:2]]) * 10  # fed by the tokens
        copy = launcher.launch_tokens(tokens, then=forward)
        assert started.wait(5)  # the tokens' launch runs (held) while the caller goes on
        first = launcher.tokens_launch
        assert first is not None and not first.done() and launcher.busy
        release.set()
        first.result(5)
        assert copy.tolist() == [0, 1, 2, 3]
        launcher.wait()
        assert not launcher.busy and order == [4, 6] and forward.tolist() == [0, 10, 20, 30, 0, 10]
    finally:
        release.set()
        launcher.close()


def test_a_forward_launched_in_pieces_is_built_on_while_each_piece_launches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`ForwardPieces`: every `every` layers the output built so far is queued on the launcher's thread
    and the caller goes on building on it (the first launch is held until the whole forward is
    built); the launches run one at a time, in order, and the result is the forward's."""
    started, release = threading.Event(), threading.Event()
    launched: list[tuple[int, ...]] = []
    running, most = [0], [0]

    class Held:
        def __getattr__(self, name: str) -> object:
            return getattr(mx, name)

        def async_eval(self, *arrays: mx.array) -> None:
            running[0] += 1
            most[0] = max(most[0], running[0])
            launched.append(arrays[0].shape)
            started.set()
            release.wait(5)
            mx.async_eval(*arrays)
            running[0] -= 1

    monkeypatch.setattr(launcher_module, "mx", Held())
    launcher = Launcher()
    try:
        pieces = ForwardPieces(launcher, layers=6, pieces=3)  # pieces end after layers 1 and 3
        h = mx.arange(4, dtype=mx.float32)
        for layer in range(5):  # a forward hands on every layer's output but the last one's
            h = h * 2 + layer
            pieces.take(layer, h)
        assert started.wait(5) and launched == [(4,)]  # the first piece is held; the second queued
        out = (h * 2 + 5).sum()  # the last layer and what is built on it
        pieces.launch(out)
        assert launcher.busy and pieces.launched == 3
        release.set()
        pieces.wait()
        assert launched == [(4,), (4,), ()] and most[0] == 1 and not launcher.busy
        assert out.item() == sum(64 * h0 + 57 for h0 in range(4))  # 57: the sum of i * 2^(5 - i)
    finally:
        release.set()
        launcher.close()


def test_a_forward_without_a_launcher_is_launched_whole_on_the_calling_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import mlxq.worker.engine.forward_pieces as pieces_module

    calls: list[str] = []

    monkeypatch.setattr(pieces_module, "mx", _NotedMx(calls))
    pieces = ForwardPieces(None, layers=4, pieces=4)
    h = mx.ones(3)
    for layer in range(3):
        h = h + layer
        pieces.take(layer, h)
    pieces.launch(h)
    pieces.wait()
    assert calls == [threading.current_thread().name] and h.tolist() == [4.0] * 3


def test_an_mlx_without_thread_unsafe_streams_gets_no_launcher_by_default_and_a_clear_error_if_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import mlxq.worker.engine.device as device_module

    class OldMlx:  # MLX before 0.32
        __version__ = "0.31.1"

        def __getattr__(self, name: str) -> object:
            if name == "new_thread_unsafe_stream":
                raise AttributeError(name)
            return getattr(mx, name)

    monkeypatch.setattr(launcher_module, "mx", OldMlx())
    monkeypatch.setattr(device_module, "mx", OldMlx())
    monkeypatch.setattr(device_module, "on_cuda", lambda: True)
    assert not device_module.overlap_by_default()
    wanted = r"MLX 0\.32 or newer, this is 0\.31\.1.*MLXQ_DECODE_OVERLAP=false"
    with pytest.raises(RuntimeError, match=wanted):
        Launcher()
