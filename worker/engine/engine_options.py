"""The options an engine is loaded with (`EngineOptions`; a worker fills them from its settings): the
dtype, the context and the prefill chunk, the prefix cache's and the score batches' bytes, the limits on
a request's size, the device paths (shape padding, decode overlap, masks in place, dense rows) and
speculation (its kind, the draft model, the draft policy: `speculation/draft_choice.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxq.jobs.schema import MAX_STOP_STRINGS
from mlxq.worker.engine.speculation.policy import DraftPolicy


@dataclass(frozen=True)
class EngineOptions:
    dtype: str | None = None  # None: float32 on CPU, the checkpoint's dtype on a GPU
    prefill_chunk: int = 2048
    max_context: int | None = None
    prefix_cache_bytes: int = 1 << 30  # 0 turns the prefix cache off
    max_score_rows: int = 64
    max_score_candidates: int = 26
    pad_shapes: bool | None = None  # None: on a GPU only (see `shapes.padded_size`)
    decode_overlap: bool | None = None  # None: MLX's CUDA build only (`device.overlap_by_default`)
    masks_in_place: bool | None = None  # None: where the device sees host writes (`mask_buffer.py`)
    build_ahead: bool = False  # with masks in place: a constrained step's graphs built before the read-back
    compiled_steps: bool | None = None  # layers through compiled parts; None: `compiled_steps_by_default`
    dense_rows: int | None = None  # quantized layers' dense copies from this many rows (`quantized_rows`)
    idle_prefill_tokens: int | None = None  # None: see `idle_prefill_by_default`
    score_kv_bytes: int | None = (
        None  # score batches' keys and values beside the prefix; None: `score_kv_by_default`
    )
    max_prompt_chars: int | None = None  # a prompt's (or a chat's) characters; None: 32 x the context
    max_stop_chars: int = 4096  # characters of a request's stop strings together
    max_stops: int = MAX_STOP_STRINGS  # stop strings of a request (the wire allows at most 16)
    max_messages: int = 256  # messages of one chat
    speculation: str = "off"  # one of SPECULATION_KINDS (`speculation/draft_choice.py`)
    draft_model: str | None = None  # the draft's folder; None: a `draft/` folder beside the model's files
    draft_policy: DraftPolicy = field(default_factory=DraftPolicy)
    sync_score_phases: bool = False  # debug: wait for each scoring forward and head (`PrefixScorer`)
    # A score batch's shared prefix started before its rows are tokenized (`Engine.start_shared_prefix`);
    # None: on a GPU only (the CPU build computes it before `async_eval` returns: nothing overlaps)
    start_shared_prefix: bool | None = None
