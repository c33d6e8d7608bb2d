"""GGUF tensors' values as a Hugging Face checkpoint stores them: Q4_0/Q4_1 blocks as MLX affine 4-bit
arrays (`q4_to_mlx`, `GROUP_SIZE`), float32 as bfloat16 bits (`bf16_bits`), and llama.cpp's Q/K row
order undone (`unpermute_qk`).
"""

from __future__ import annotations

import numpy as np

GROUP_SIZE = 32  # both the Q4_0/Q4_1 block size and the MLX group size written


def unpermute_qk(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: per head, rows (d/2, 2) interleaved back to HF's (2, d/2) halves.

    Works on any array whose first axis is the output rows (float weights, packed 4-bit codes, scales).
    """
    half = rows.shape[0] // n_heads // 2
    return rows.reshape(n_heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def q4_to_mlx(raw: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Turn GGUF Q4_0/Q4_1 rows (uint8, blocks of 32 weights) into MLX affine 4-bit arrays.

    Returns (codes uint32 [rows, cols/8], scales float16 [rows, cols/32], biases float16 [rows, cols/32])
    such that `mx.dequantize(codes, scales, biases, group_size=32, bits=4)` gives the GGUF's weights.
    """
    block_bytes = {"Q4_0": 18, "Q4_1": 20}[qtype]
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, block_bytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    # Q4_0: w = d * (q - 8) = d * q + (-8 d); -8 d is exact in float16 (a power-of-two scaling).
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0] if qtype == "Q4_1" else d * np.float16(-8)
    qs = blocks[..., -16:]
    # GGUF: byte i holds weight i (low nibble) and weight i + 16 (high nibble) of its block.
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, -1, 8).astype(np.uint32)
    # MLX: eight codes per uint32, the first in the lowest nibble.
    packed = (codes << (np.arange(8, dtype=np.uint32) * 4)).sum(axis=-1, dtype=np.uint32)
    return packed, d, m


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest, ties to even) and return the bits as uint16."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    rounded[np.isnan(x)] = 0x7FC0
    return rounded
