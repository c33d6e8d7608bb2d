"""A thread that launches decode steps while the loop's thread builds the next one.

On a GPU a batched decode step is bound by the host: building its graph in Python and MLX's launch of
its ops (C++ that releases the GIL) each take longer than the device's work (`bench/README.md`).
Done one after the other on one thread, a step costs their sum. `Launcher` runs each launch
(`mx.async_eval`) on a thread of its own, so the loop's thread builds step N+1 on step N's lazy
outputs while step N is being launched: a step then costs about the longer of the two.

MLX ties a stream to the thread that made it, and an op to the stream that was the default when it
was made; the launcher's thread can only evaluate ops of a stream any thread may use
(`mx.new_thread_unsafe_stream`). So a `Launcher` makes such a stream the default of the thread that
creates it (the loop's thread, which must be the one that builds the steps): every op made there,
whatever module makes it (a sampler's bias, a prefill), goes on that one stream, as all went on the
thread's own default stream before. MLX leaves it to the caller that two threads never evaluate on it
at once. The rule here: launches run one at a time, on the launcher's one thread (`launch` waits for
the one before; `launch_behind` queues behind it), and the loop's thread calls `wait()` before it
evaluates, reads back or frees anything itself (a prefill, an offer to the prefix cache, a score
batch, `mx.clear_cache`). Building graphs needs no wait: it only adds nodes that point at the
in-flight step's outputs.

A thread has one default stream, so it has one launcher: engines made on the same thread (a benchmark's
ways of decoding side by side, a test's engines) share it (`acquire`, `release`). Two launchers on one
thread would each make their stream the default, and the first engine's steps would then run on the
second's stream from two launch threads (on CUDA: a graph capture failing with
`cudaStreamEndCapture`).

The launcher's thread needs the GIL twice a launch (to start the call, and to return from it), while
the loop's thread is mostly Python: with Python's default switch interval (5 ms) a waiting thread may
wait that long for the GIL, about a whole step. A `Launcher` lowers the process's interval while it
exists (`switch_interval.py`; `close` lets go of it).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait

import mlx.core as mx

from mlxq.worker.engine import switch_interval
from mlxq.worker.engine.switch_interval import SWITCH_INTERVAL_S

__all__ = ["SWITCH_INTERVAL_S", "Launcher", "acquire", "release"]


class Launcher:
    """Made on the thread that builds the steps; its stream becomes that thread's default."""

    def __init__(self) -> None:
        if not hasattr(mx, "new_thread_unsafe_stream"):
            raise RuntimeError(
                f"decode steps on a thread of their own (MLXQ_DECODE_OVERLAP) need MLX 0.32 or newer, "
                f"this is {mx.__version__}; upgrade MLX or set MLXQ_DECODE_OVERLAP=false"  # type: ignore[attr-defined]
            )
        self.thread = threading.get_ident()
        device = mx.default_device()
        self._previous = mx.default_stream(device)
        self.stream = mx.new_thread_unsafe_stream(device)
        mx.set_default_stream(self.stream)
        switch_interval.lower()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mlxq-launch")
        self._in_flight: list[Future[None]] = []  # launches submitted, run one after another
        self.tokens_launch: Future[None] | None = None  # the launch of the latest `launch_tokens`
        self.then_s = 0.0  # seconds the `then` launches of `launch_tokens` took, summed (its thread's)

    @property
    def here(self) -> bool:
        """Whether the calling thread is the one whose ops go on the launcher's stream."""
        return threading.get_ident() == self.thread

    def launch(self, *arrays: mx.array) -> None:
        """Start launching `arrays` on the launcher's thread, once the launch before it has ended."""
        self.wait()
        self._in_flight = [self._pool.submit(mx.async_eval, *arrays)]

    def launch_behind(self, *arrays: mx.array) -> None:
        """Queue a launch of `arrays` behind those in flight, without waiting for them: the pieces of
        one forward, each built on the lazy outputs of the one before while that one launches
        (`forward_pieces.py`)."""
        self._in_flight.append(self._pool.submit(mx.async_eval, *arrays))

    def launch_tokens(self, tokens: mx.array, *with_them: mx.array, then: mx.array | None = None) -> mx.array:
        """Launch a decode step's sampled `tokens`; returns a copy made in the same launch, to read them
        back from. The tokens themselves are an input of the next step, whose launch is running when
        they are read, and reading an array (MLX's `wait`) changes its state under that launch (it
        crashed the CPU build in tests); nothing later takes the copy as input.

        `then` (a constrained step's forward, fed by the tokens) is launched right behind them, on the
        launcher's thread, while this thread goes on: it must not read the copy before its launch ended
        (`tokens_launch`), and `wait` waits for both."""
        copy = tokens.astype(mx.int32)
        self.launch(tokens, copy, *with_them)
        self.tokens_launch = self._in_flight[0]
        if then is not None:
            self._in_flight.append(self._pool.submit(self._timed_then, then))
        return copy

    def _timed_then(self, array: mx.array) -> None:
        """Launch a `then` forward, adding the time its launch took to `then_s` (on MLX's CUDA build
        a launch returns only while the host is a few ops ahead of the device: a long one means the
        forward was launched at the device's pace)."""
        began = time.perf_counter()
        try:
            mx.async_eval(array)
        finally:
            self.then_s += time.perf_counter() - began

    def wait(self) -> None:
        """Return once no launch is in flight; raises a failed launch's error (once)."""
        in_flight, self._in_flight = self._in_flight, []
        if not in_flight:
            return
        try:
            for launch in in_flight:
                launch.result()
        except BaseException:
            wait(in_flight)  # interrupted, or a launch before another failed: let them all end first
            raise

    @property
    def busy(self) -> bool:
        return bool(self._in_flight)

    def close(self) -> None:
        """Wait for the last launch and stop the thread; on the creating thread, its default stream is
        again the one it had."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            switch_interval.restore()
            if self.here:
                mx.set_default_stream(self._previous)


_SHARED: dict[int, tuple[Launcher, int]] = {}  # creating thread -> its launcher, engines holding it
_SHARED_LOCK = threading.Lock()


def acquire() -> Launcher:
    """The calling thread's launcher, made at its first use; each call must be matched by `release`."""
    with _SHARED_LOCK:
        thread = threading.get_ident()
        launcher, holders = _SHARED.get(thread, (None, 0))
        if launcher is None:
            launcher = Launcher()
        _SHARED[thread] = (launcher, holders + 1)
        return launcher


def release(launcher: Launcher) -> None:
    """Let go of a launcher from `acquire`; the last holder closes it (its thread's default stream is
    then again the one it had)."""
    with _SHARED_LOCK:
        held = _SHARED.get(launcher.thread)
        if held is None or held[0] is not launcher:  # not a shared one: closed by its only holder
            last = True
        else:
            last = held[1] <= 1
            if last:
                del _SHARED[launcher.thread]
            else:
                _SHARED[launcher.thread] = (launcher, held[1] - 1)
    if last:
        launcher.close()
