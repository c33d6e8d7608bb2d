"""The few shapes a GPU meets: prompt chunks, batch sizes and key lengths rounded up to a small set.

On a GPU (MLX's CUDA build above all) the first forward of a new input shape builds its kernels, many
times the forward itself (`bench/README.md`, what the engine's defaults rest on). Rounding shapes up to
a few sizes makes a worker meet each once in its life, not once per prompt length or batch size.
"""

from __future__ import annotations


def padded_size(n: int, smallest: int = 16) -> int:
    """`n` rounded up to one of a few sizes: powers of two from `smallest` to 512, then multiples of 512.

    On a GPU (MLX's CUDA build above all) the first forward of a new input shape builds its kernels, many
    times the forward itself (`bench/README.md`, what the engine's defaults rest on). Padding prompt
    chunks and batch sizes to a few sizes makes a worker meet each shape once in its life, not once per
    prompt length.
    """
    if n <= smallest:
        return smallest
    if n <= 512:
        return 1 << (n - 1).bit_length()
    return -(-n // 512) * 512


def padded_width(n: int) -> int:
    """A prompt chunk's width rounded up as `padded_size` does, with 192 and 384 also allowed: a forward's
    compute grows with its width, and halfway sizes pad a 130-token prompt to 192 instead of 256 columns
    (two shapes more for a worker to meet once; below 128 columns a forward costs its launch more than
    its width)."""
    size = padded_size(n)
    if 128 < n <= 384 and 4 * n <= 3 * size:
        return 3 * size // 4
    return size
