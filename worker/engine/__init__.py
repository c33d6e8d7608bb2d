"""The engine: everything that runs MLX, and nothing that knows Redis, RQ or the queue service.

Sub-packages show the parts: `models/` (the architecture registry, loading, RoPE, quantized layers),
`cache/` (per-layer KV caches, the batch cache, the prefix cache), `text/` (tokenizer, chat templates,
detokenizer, stop strings), `speculation/` (drafters, the engine's choice of them). The modules here
drive them: `engine` (a loaded model and its request policies; `engine_options` what it is loaded with,
`generate_requests` its generation requests prepared, `job_scorer` its score jobs run), `prefill` and
`decode_batch` (prefill and decode steps; `row_placement` which buffer row holds each decoding row,
`pending_tokens` the tokens a step hands the next, `verify_step` a verify step's parts),
`generation_batch` (continuous batching; `batch_prefill` its waiting requests and prefill,
`batch_sequence` a request's record, `text_run` and `generation_clock` a request's text and timings),
`score_requests` (score requests' rows prepared), `prefix_scorer` (score rows of every kind grouped by
shared prefix; `score_tree` the tree, `score_head` the seam to the heads, `candidate_head` and
`token_scoring` the heads, `candidate_tokens` candidate rows' tokens; `scoring` re-exports them),
`sampler`, and the device-side helpers (`launcher`, `ragged_attention`, `memory_guard`, `device`). The
queue service above (`worker/`) hands work in and takes tokens out; nothing here imports it.
"""

from __future__ import annotations

from mlxq.worker.engine.engine import Engine
from mlxq.worker.engine.engine_options import EngineOptions

__all__ = ["Engine", "EngineOptions"]
