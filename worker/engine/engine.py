"""The engine: one loaded model with its tokenizer, turning requests into tokens, text and scores.

It loads the model and holds what every request shares (the prefix cache, the launcher, the
context length, the device's defaults); the rest is in parts it composes: a generation request's
prompt tokens, limits and sampler are prepared by its `GenerateRequests` (`generate_requests.py`), a
score request's rows by its `ScoreRequests` (`score_requests.py`), score jobs are run by its
`JobScorer` (`job_scorer.py`), and its speculation (the draft loaded, each request's drafter) is its
`DraftChoice` (`speculation/draft_choice.py`). It knows nothing of Redis or RQ. A generation reports
progress through a `TokenSink` (`text_run.py`: the stream writer in a worker, a list in tests) and
checks a `cancelled` callable between prefill chunks and tokens (`generation_batch.py` drives it).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxq.jobs.errors import InvalidRequest
from mlxq.jobs.schema import (
    FinishReason,
    GenerateRequest,
    GenerateResult,
    ScoreRequest,
    ScoreResult,
    Usage,
)
from mlxq.worker.engine import launcher as launchers
from mlxq.worker.engine.cache.kv_cache import KVCache, held_columns
from mlxq.worker.engine.cache.prefix_cache import PrefixCache
from mlxq.worker.engine.constraint import ConstraintCompiler
from mlxq.worker.engine.device import (
    compiled_steps_by_default,
    idle_prefill_by_default,
    memory_figures,
    on_gpu,
    overlap_by_default,
    pad_shapes_by_default,
)
from mlxq.worker.engine.engine_options import EngineOptions
from mlxq.worker.engine.generate_requests import GenerateRequests
from mlxq.worker.engine.generation_clock import GenerationClock
from mlxq.worker.engine.job_scorer import JobScorer
from mlxq.worker.engine.launcher import Launcher
from mlxq.worker.engine.mask_buffer import host_writes_seen
from mlxq.worker.engine.models import llama
from mlxq.worker.engine.models.base import Model
from mlxq.worker.engine.models.loader import default_dtype, load_model, parse_dtype, resolve_model_path
from mlxq.worker.engine.models.quantized_rows import default_max_bytes, dense_rows_by_default, use_dense_rows
from mlxq.worker.engine.sampler import Sampler
from mlxq.worker.engine.score_requests import PreparedRow, ScoreRequests
from mlxq.worker.engine.speculation.draft_choice import DraftChoice
from mlxq.worker.engine.speculation.draft_gate import DraftGate
from mlxq.worker.engine.speculation.draft_model import DraftTarget
from mlxq.worker.engine.speculation.policy import RowSpeculation
from mlxq.worker.engine.text.tokenizer import Tokenizer
from mlxq.worker.engine.text_run import TextRun
from mlxq.worker.engine.token_logprobs import TokenLogprob

log = logging.getLogger(__name__)

# From how many shared prompt tokens not cached yet a score batch's prefix is started ahead of its rows'
# tokenizing (`Engine.start_shared_prefix`): fewer are computed too fast to hide much of the tokenizer.
START_FROM = 256


class Engine:
    """A model, its tokenizer and the policies (context length, chunking) that run requests on it."""

    def __init__(
        self, model: Model, tokenizer: Tokenizer, config: dict[str, Any], name: str, options: EngineOptions
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.name = name
        self.options = options
        # Whether it pads shapes (a GPU's default: `shapes.py`), its draft's batched forwards too
        self.pad_shapes = pad_shapes_by_default() if options.pad_shapes is None else options.pad_shapes
        # Its speculation: the kind checked, its draft (loaded by `load`), each request's drafter
        target = DraftTarget(model, tokenizer, options.dtype, options.prefill_chunk, self.pad_shapes)
        self.draft_choice = DraftChoice(
            options.speculation, options.draft_policy, options.draft_model, target
        )
        own = model.args.max_position_embeddings  # config.json's, or less where the model says (LongRoPE)
        self.context_length = min(own, options.max_context) if options.max_context else own
        self.prefix_cache = (
            PrefixCache(options.prefix_cache_bytes) if options.prefix_cache_bytes > 0 else None
        )
        self.on_gpu = on_gpu()  # kernels are built on first use there: the worker warms up (`warm_up.py`)
        start = options.start_shared_prefix  # where the device runs beside the host: a GPU's default
        self.starts_shared_prefix = self.on_gpu if start is None else start
        model.bucket_keys = self.pad_shapes  # attention over a cached prefix: few key shapes too
        # Prompt tokens a generation batch's step may prefill while no request decodes (`GenerationBatch`).
        self.idle_prefill_tokens = (
            idle_prefill_by_default(options.prefill_chunk)
            if options.idle_prefill_tokens is None
            else options.idle_prefill_tokens
        )
        self._choose_decode_launch(options)
        # Structured output (`response_format`): the grammar library's tokenizer, built at first use.
        self.constraints = ConstraintCompiler(tokenizer.backend, model.args.vocab_size, tokenizer.eos_ids)
        # What drafting gains this engine's batches against plain decoding (`draft_gate.py`), where it
        # drafts and the policy asks for it: learnt across the generation batches it runs, one after another.
        drafting = options.speculation != "off" and options.draft_policy.gate
        self.draft_gate = DraftGate() if drafting else None
        # The verify steps' shapes (rows, width, key columns) this engine's forwards met, in any of its
        # batches or its warm-up (`warm_up.py`): on a GPU the first forward of a shape builds kernels,
        # so its time says nothing of the steps of that shape to come (`VerifyStep.read_columns`).
        self.verify_shapes: set[tuple[int, int, int]] = set()
        self._make_request_parts(model, tokenizer, name, options)

    def _choose_decode_launch(self, options: EngineOptions) -> None:
        """How decode steps launch (`__init__`'s part): `decode_overlap` (on a thread of their own, the
        launcher taken here), `masks_in_place` and `build_ahead` (a constrained step's)."""
        # Whether decode steps launch on a thread of their own (`launcher.py`). The launcher is made here,
        # on the thread that loads the engine (the one that generates, in a worker), so every array that
        # thread makes from now on is on the launcher's stream.
        overlap = options.decode_overlap
        self.decode_overlap = overlap_by_default() if overlap is None else overlap
        self._launcher: Launcher | None = launchers.acquire() if self.decode_overlap else None
        # Whether a constrained step's draw and forward are built before its tokens are read back, the
        # masks then written into the draw's input (`mask_buffer.py`): checked on this device once.
        if options.masks_in_place is None:
            if self._launcher is not None:
                self._launcher.wait()  # the check evaluates on this thread's stream
            self.masks_in_place = host_writes_seen()
        else:
            self.masks_in_place = options.masks_in_place
        # With masks in place, whether a constrained step's next draw and forward are built before its
        # tokens are read back (`ForwardAhead.prepare`) rather than beside the masks after it.
        self.build_ahead = options.build_ahead and self.masks_in_place

    def _make_request_parts(
        self, model: Model, tokenizer: Tokenizer, name: str, options: EngineOptions
    ) -> None:
        """The parts that prepare requests and run score jobs (`__init__`'s part): `generate_requests`,
        `score_requests`, `scorer` and its `score_seconds`."""
        # Generation requests' sizes checked, their prompts tokenized, their samplers built
        # (`generate_requests.py`).
        self.generate_requests = GenerateRequests(
            tokenizer, options, self.context_length, model.args.vocab_size, self.constraints
        )
        # Score requests' limits checked and their rows tokenized (`score_requests.py`): no model needed.
        self.score_requests = ScoreRequests(
            tokenizer,
            options,
            self.context_length,
            self.generate_requests.max_prompt_chars,
            model.args.vocab_size,
        )
        # Score jobs run on the model (`job_scorer.py`); the worker reads `score_seconds` around each
        # score batch.
        self.scorer = JobScorer(
            model, tokenizer, name, options, self.pad_shapes, self.kv_bytes_per_token, self.free_memory
        )
        self.score_seconds = self.scorer.score_seconds

    @classmethod
    def load(cls, model: str, options: EngineOptions | None = None) -> Engine:
        """Load a model folder (Hugging Face layout) or Hub repo id."""
        options = options or EngineOptions()
        path = resolve_model_path(model)
        t0 = time.perf_counter()
        net, config = load_model(path, dtype=options.dtype)
        if config.get("quantization"):  # see `quantized_rows.py`
            assert isinstance(net, nn.Module)  # every architecture is one (`models/base.py`)
            dtype = parse_dtype(options.dtype) if options.dtype else default_dtype(config)
            if options.dense_rows is None and dense_rows_by_default():
                use_dense_rows(net, dense_rows_by_default(), dtype, default_max_bytes())
            elif options.dense_rows:  # set: kept whatever they take
                use_dense_rows(net, options.dense_rows, dtype)
        net.fuse()  # fewer matmuls per layer (see `models.fused_linear.fuse_linears`)
        compiled = compiled_steps_by_default() if options.compiled_steps is None else options.compiled_steps
        if compiled and isinstance(net, llama.Model):
            net.compile_steps()
        else:  # other models: the option does nothing
            compiled = False
        tokenizer = Tokenizer.from_dir(path)
        engine = cls(net, tokenizer, config, Path(model).name if Path(model).exists() else model, options)
        engine.draft_choice.load(path)
        log.info(
            "model loaded path=%s arch=%s device=%s seconds=%.2f pad_shapes=%s decode_overlap=%s "
            "masks_in_place=%s compiled_steps=%s idle_prefill_tokens=%d score_kv_bytes=%d",
            path,
            config["architectures"][0],
            mx.default_device(),
            time.perf_counter() - t0,
            engine.pad_shapes,
            engine.decode_overlap,
            engine.masks_in_place,
            compiled,
            engine.idle_prefill_tokens,
            engine.scorer.score_kv_bytes,
        )
        return engine

    # --- prompts --------------------------------------------------------------------------------

    def launcher(self) -> Launcher | None:
        """The launcher of decode steps where `decode_overlap` is on (made when the engine was, or on the
        first call after `close` or after the overlap was turned on); None on any thread but the one
        that made it: there decode steps launch on the calling thread."""
        if not self.decode_overlap:
            return None
        if self._launcher is None:
            self._launcher = launchers.acquire()
        if not self._launcher.here:
            log.debug("decode steps off the launcher's thread launch on their own thread")
            return None
        return self._launcher

    def status(self) -> dict[str, Any]:
        """Live figures for the worker's published stats: device, MLX memory, the prefix cache's."""
        figures: dict[str, Any] = dict(memory_figures())
        cache = self.prefix_cache
        if cache is not None:
            figures.update({f"cache_{k}": v for k, v in cache.stats.as_dict().items()})
            figures["cache_budget_bytes"] = cache.budget_bytes
        return figures

    def cache_log_fields(self) -> str:
        """The prefix cache's figures as ` key=value` pairs for a finished job's log line ('' if off)."""
        cache = self.prefix_cache
        if cache is None:
            return ""
        s = cache.stats
        return f" cache_hits={s.hits}/{s.lookups} cache_hit_tokens={s.hit_tokens} cache_bytes={s.bytes}"

    def close(self) -> None:
        """Let go of the launcher, if one was taken (the last engine of its thread stops it: see
        `launchers.release`), and stop the mask thread; a later batch takes them again."""
        held, self._launcher = self._launcher, None
        if held is not None:
            launchers.release(held)
        self.constraints.close()

    def begin_cache(self, prompt: list[int], min_reuse: int = 1) -> tuple[list[KVCache], int]:
        """A KV cache for `prompt`: the longest cached prefix already in it (none if shorter than
        `min_reuse` tokens), and that prefix's length."""
        if self.prefix_cache is None:
            return self.model.make_cache(), 0
        return self.prefix_cache.begin(prompt, len(self.model.layers), min_reuse, self.model.model.windows)

    # --- scoring --------------------------------------------------------------------------------

    def score_tokens(self, request: ScoreRequest) -> list[PreparedRow]:
        """Per row: its tokens, validated (`ScoreRequests.score_tokens`)."""
        return self.score_requests.score_tokens(request)

    def score_tokens_many(
        self, requests: Sequence[ScoreRequest], tokenizer: Tokenizer | None = None
    ) -> list[list[PreparedRow] | InvalidRequest]:
        """`score_tokens` of several jobs, a bad job's error in its place (`ScoreRequests.score_tokens_many`:
        another thread may call it with a `tokenizer` of its own)."""
        return self.score_requests.score_tokens_many(requests, tokenizer)

    def start_shared_prefix(self, requests: Sequence[ScoreRequest]) -> int:
        """Queue the prompt prefix that a score batch's first rows share into the prefix cache and return
        without waiting for the device, which computes it while the host tokenizes the rest of the
        batch (`ScoreRequests.shared_start`, `JobScorer.start`): tokenizing is then off a batch's
        critical path where it would otherwise come before any forward. How many tokens it queued (0:
        off, as on a CPU by default: `EngineOptions.start_shared_prefix`; no prefix cache; or fewer than
        `START_FROM` shared tokens not cached yet). On the engine's thread only: it tokenizes with the
        engine's tokenizer."""
        if self.prefix_cache is None or not self.starts_shared_prefix:
            return 0
        tokens = self.score_requests.shared_start(requests)
        if len(tokens) < START_FROM:
            return 0
        return self.scorer.start(tokens, self.prefix_cache, START_FROM)

    def score(self, request: ScoreRequest) -> ScoreResult:
        """Score one request's rows (shared prefixes computed once)."""
        return self.score_many([self.score_tokens(request)])[0]

    def score_many(
        self, jobs: list[list[PreparedRow]], interrupt: Callable[[], None] | None = None
    ) -> list[ScoreResult]:
        """Score the prepared rows (`score_tokens`) of several jobs together; one result per job
        (`JobScorer.score_many`: out of memory, once more with smaller suffix batches). `interrupt` is
        called before every forward: what it raises ends the scoring (a job's timeout)."""
        return self.scorer.score_many(jobs, self.prefix_cache, interrupt)

    # --- generation -----------------------------------------------------------------------------

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of keys and values one token adds to a sequence's cache (all layers), as long as no
        sliding-window layer has reached its window (`kv_bytes` counts those)."""
        return len(self.model.layers) * self._layer_bytes_per_token

    @property
    def _layer_bytes_per_token(self) -> int:
        itemsize = self.model.model.norm.weight.dtype.size  # floating weights are in the compute dtype
        return self.model.args.cache_features * itemsize

    def kv_bytes(self, columns: int) -> int:
        """Bytes of keys and values one row of a decode batch holds at `columns` columns: a global
        layer's every column, a sliding-window layer's at most its window and slack (`held_columns`)."""
        held = sum(held_columns(columns, window) for window in self.model.model.windows)
        return held * self._layer_bytes_per_token

    def prompt_tokens(self, request: GenerateRequest) -> list[int]:
        """Token ids for a request's prompt (`GenerateRequests.prompt_tokens`)."""
        return self.generate_requests.prompt_tokens(request)

    def prepare_generation(self, request: GenerateRequest) -> tuple[list[int], int, Sampler]:
        """Prompt tokens, the token budget and the sampler of a request; `InvalidRequest` if it is bad
        (`GenerateRequests.prepare_generation`)."""
        return self.generate_requests.prepare_generation(request)

    def load_draft(self, target: Path) -> None:
        """Load the draft model speculation "draft_model" drafts with (`DraftChoice.load_draft`)."""
        self.draft_choice.load_draft(target)

    @property
    def draft_taps(self) -> tuple[int, ...]:
        """The target layers whose outputs this worker's drafters read (`DraftChoice.taps`)."""
        return self.draft_choice.taps

    def speculation_for(self, request: GenerateRequest, sampler: Sampler) -> RowSpeculation | None:
        """A request's drafter and its depth cap, or None where it decodes plainly
        (`DraftChoice.speculation_for`)."""
        return self.draft_choice.speculation_for(request, sampler)

    def finish_reason_after(
        self, run: TextRun, token: int, cancelled: Callable[[], bool], logprob: TokenLogprob | None = None
    ) -> FinishReason | None:
        """Take one generated token; the reason to stop now (EOS, a stop string, a cancel) or None."""
        if token in self.tokenizer.eos_ids:
            return "stop"
        if run.add(token, logprob):
            return "stop"
        if cancelled():
            return "cancelled"
        return None

    def free_memory(self) -> None:
        """Give back what can be rebuilt: the prefix cache and MLX's pool of freed buffers."""
        if self.prefix_cache is not None:
            self.prefix_cache.evict_all()
        gc.collect()
        mx.clear_cache()

    def generate_result(
        self, run: TextRun, finish: FinishReason, prompt: list[int], n_cached: int, clock: GenerationClock
    ) -> GenerateResult:
        """The result of a finished generation (timings from `clock`, up to now)."""
        return GenerateResult(
            text=run.text,
            finish_reason=finish,
            token_ids=run.ids,
            model=self.name,
            usage=Usage(prompt_tokens=len(prompt), completion_tokens=len(run.ids), cached_tokens=n_cached),
            timings=clock.timings(len(prompt) - n_cached, len(run.ids)),
            logprobs=run.logprobs,
        )
