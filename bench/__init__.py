"""Benchmarks: mlxq's engine and queue against mlx-lm on the same checkpoint (`python -m bench`)."""
