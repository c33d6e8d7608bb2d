"""Which MLX backend runs this process's arrays."""

from __future__ import annotations

import mlx.core as mx


def on_cuda() -> bool:
    """Whether MLX's CUDA backend is the default device (not Metal, not the CPU)."""
    cuda = getattr(mx, "cuda", None)
    return mx.default_device().type == mx.DeviceType.gpu and cuda is not None and cuda.is_available()


def on_gpu() -> bool:
    """Whether the default device is a GPU (Metal or CUDA): kernels there are built on first use."""
    return bool(mx.default_device().type == mx.DeviceType.gpu)


def buffer_cache_limit(setting: int | None) -> int:
    """Bytes of freed buffers MLX keeps for reuse (`MLXQ_MLX_CACHE_LIMIT_BYTES`; None: the default).

    On MLX's CUDA build a buffer the cache cannot keep is given back with a call that waits for the
    device, and a new one faults its pages in on first use, so a cache smaller than what a batch turns
    over (a decode batch copies its KV whenever its membership or length changes) costs every step that
    frees (`bench/README.md` has the measurements). So the default there is an eighth of MLX's memory
    limit; elsewhere (unified memory, shared with the system) 1 GiB.
    """
    if setting is not None:
        return setting
    if on_cuda():
        return max(1 << 30, mx.get_memory_limit() // 8)
    return 1 << 30


def limit_buffer_cache(setting: int | None) -> None:
    """Bound MLX's pool of freed buffers: varied prompt and batch shapes would otherwise grow it without
    end (see `buffer_cache_limit`)."""
    mx.set_cache_limit(buffer_cache_limit(setting))


def memory_figures() -> dict[str, int | str]:
    """This process's device, MLX version and MLX memory now, for the worker's published stats."""
    return {
        "device": str(mx.default_device()),
        "mlx_version": mx.__version__,  # type: ignore[attr-defined]  # not in MLX's stubs
        "memory_bytes": mx.get_active_memory(),
        "peak_memory_bytes": mx.get_peak_memory(),
        "memory_cache_bytes": mx.get_cache_memory(),
    }


def pad_shapes_by_default() -> bool:
    """Whether to pad shapes (`padded_size`): on a GPU yes; on a CPU a new shape costs nothing, padding
    would only add work."""
    return mx.default_device().type == mx.DeviceType.gpu


def idle_prefill_by_default(chunk: int) -> int:
    """Prompt tokens a generation batch's step may prefill while none of its requests decodes (a burst of new
    jobs; `BatchPrefill.step`). On a GPU 8 chunks: one forward of many rows costs far less per token
    than several of a chunk each (`bench/README.md`), and nothing streams meanwhile. On a CPU one chunk, as
    while requests decode: the forward is bound by arithmetic there, and the first prompts' tokens come
    sooner."""
    return 8 * chunk if mx.default_device().type == mx.DeviceType.gpu else chunk


def compiled_steps_by_default() -> bool:
    """Whether a decode step of a Llama-family model (dense, quantized or a mixture of experts) builds
    its layers through compiled parts (`models/compiled_step.py`) unless set: with MLX's CUDA build,
    where the host's build of a step's graph bounds a decode step of few rows and a batched one, and
    the compiled parts take much of it off, their outputs the same (their tests pass there). Also on
    the CPU build: a small model's step is bound by its build there too, and a larger one's arithmetic
    hides the traces (`bench/README.md`, what the engine's defaults rest on). Not on Metal (not
    measured there)."""
    return mx.default_device().type == mx.DeviceType.cpu or on_cuda()


def overlap_by_default() -> bool:
    """Whether a decode batch's steps launch on a thread of their own (`DecodeBatch`'s `launcher`): on a
    GPU, where the launch is host work (with the GIL released) and a batched step is bound by it. Not
    on the CPU: there `async_eval` returns only when the step is nearly computed, and a second thread
    made steps slower (`bench/README.md`, what the engine's defaults rest on). Not on Metal by default
    either: not measured there, and MLX's launch is cheaper. It needs MLX 0.32
    (`mx.new_thread_unsafe_stream`)."""
    return on_cuda() and hasattr(mx, "new_thread_unsafe_stream")
