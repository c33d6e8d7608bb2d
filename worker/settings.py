"""Worker settings: `MLXQ_` environment variables and `.env`, overridden by command-line flags."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from mlxq.jobs import MAX_NESTING_DEPTH
from mlxq.jobs.schema import MAX_STOP_STRINGS


class WorkerSettings(BaseSettings):
    """Everything a worker process can be told. Environment: `MLXQ_<NAME>`, e.g. `MLXQ_REDIS_URL`."""

    model_config = SettingsConfigDict(env_prefix="MLXQ_", env_file=".env", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    model: str = Field(default="", description="model folder (Hugging Face layout) or a Hub repo id")
    queues: list[str] = Field(default_factory=lambda: ["default"])
    queue_order: Literal["priority", "round_robin", "random"] = Field(
        default="priority",
        description="which queue RQ takes the next job from: the first with jobs (the order given), "
        "the next after the last one served (fair between queues, e.g. tenants), or any",
    )
    name: str | None = Field(default=None, description="worker name; RQ makes one if unset")

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    prefill_chunk: int = Field(default=2048, ge=16)
    max_context: int | None = Field(default=None, ge=16, description="cap below the model's own context")

    prefix_cache_bytes: int = Field(
        default=1 << 30, ge=0, description="KV bytes the prefix cache may hold; 0: off"
    )
    score_batch_rows: int = Field(
        default=256, ge=0, description="rows of queued score jobs per batch; 0: one job"
    )
    score_batch_jobs: int = Field(default=64, ge=1)
    score_pipeline: bool = Field(
        default=True,
        description="claim and start the next score batch while one runs, RQ's end of a batch on a "
        "thread; off: each batch claimed, run and ended in turn, back to RQ's dequeue after it",
    )
    max_batch_sequences: int = Field(
        default=8,
        ge=1,
        description="generation jobs decoded together in one running batch; 1: one job at a time",
    )
    batch_kv_bytes: int | None = Field(
        default=None,
        ge=0,
        description="padded KV bytes a generation batch may grow to; 0: no limit; unset: a quarter of "
        "MLX's memory limit",
    )
    batch_admit_every: int = Field(
        default=4, ge=1, description="decode steps between looks at the queue for jobs to admit"
    )
    batch_empty_wait_s: float = Field(
        default=0.05,
        ge=0.0,
        description="after a look at the queue that claimed nothing, the least time a running generation "
        "batch waits before looking again (each look is a Redis round trip)",
    )
    batch_min_join: int = Field(
        default=1,
        ge=1,
        description="free rows a generation batch at least half full waits for (16 steps at most) before "
        "claiming more generation jobs, so they prefill together; 1: claim as soon as a row is free",
    )
    warm_up: bool | None = Field(
        default=None,
        description="before the first job, run a prefill chunk, a decode step of each batch size and a "
        "score batch on made-up prompts, so that the first jobs do not pay for building kernels; off: start "
        "at once; unset: on a GPU (Metal, CUDA), off on the CPU build (no kernels to build there, and the "
        "warm-up's forwards would cost what a job's do)",
    )
    decode_overlap: bool | None = Field(
        default=None,
        description="launch decode steps on a second thread while the tokens before are handled, streams "
        "written and the next step built; unset: with MLX's CUDA build only",
    )
    masks_in_place: bool | None = Field(
        default=None,
        description="a constrained batch (response_format) computes the grammars' masks on a thread of "
        "their own, into the draw's input, while the step's draw and forward are built; needs the device "
        "to see what the host writes into its arrays' memory; unset: where a check at start-up finds it "
        "does",
    )
    build_ahead: bool = Field(
        default=False,
        description="with masks in place: a constrained batch builds each step's draw and forward before "
        "the step before's tokens are read back, and only the masks after (off: the masks beside the "
        "build, after the read-back)",
    )
    compiled_steps: bool | None = Field(
        default=None,
        description="a decode step of the Llama family's models (dense, quantized, mixtures of experts) "
        "builds each layer's norms, projections, RoPE and feed-forward as compiled functions (the cache "
        "writes and the attention outside them), where the host's build of a step's graph bounds the "
        "decode; Gemma 3 and DeepSeek-V3: no effect; unset: with MLX's CUDA build only",
    )
    dense_rows: int | None = Field(
        default=None,
        ge=0,
        description="a quantized model's layers also keep their weights dequantized and use them for "
        "forwards of at least this many rows (batches, prompts); 0: off; unset: 8 on CUDA if the copies "
        "take at most a quarter of MLX's memory limit, else off",
    )
    idle_prefill_tokens: int | None = Field(
        default=None,
        ge=0,
        description="prompt tokens one step of a generation batch may prefill while none of its jobs "
        "decodes (a burst of new jobs), in one forward where the prompts allow; at most prefill_chunk: one "
        "chunk a step, as while jobs decode; unset: 8 x prefill_chunk on a GPU, prefill_chunk on the CPU",
    )
    score_kv_bytes: int | None = Field(
        default=None,
        ge=0,
        description="bytes of keys and values a score batch's suffix rows may hold beside the prefix "
        "they share (their own, a layer's copy of the prefix per pack of rows; on a model whose rows "
        "copy the prefix, those copies); more rows go in further batches; 0: no bound; unset: an "
        "eighth of MLX's memory limit",
    )
    sync_score_phases: bool = Field(
        default=False,
        description="debug: wait for the device after each scoring forward and LM head, so that the score "
        "phases forward and unembed hold their device time (else the waits are one phase, device_wait); "
        "slows scoring",
    )
    max_score_rows: int = Field(default=64, ge=1, description="rows one score job may have")
    max_score_candidates: int = Field(default=26, ge=1, description="candidates one score row may have")
    max_prompt_chars: int | None = Field(
        default=None, ge=1, description="characters of a prompt or a chat; unset: 32 x the context length"
    )
    max_stop_chars: int = Field(default=4096, ge=1, description="characters of a request's stop strings")
    max_stops: int = Field(
        default=MAX_STOP_STRINGS, ge=0, le=MAX_STOP_STRINGS, description="stop strings of a request (0: none)"
    )
    max_messages: int = Field(default=256, ge=1, description="messages of one chat")

    speculation: Literal["off", "prompt_lookup", "draft_model", "mtp"] = Field(
        default="off",
        description="speculative decoding: draft tokens that one forward verifies (output unchanged); "
        "prompt_lookup copies them from earlier in the request's own text, draft_model has a draft guess "
        "them (a small model with the target's tokenizer, or a DFlash draft reading the target's hidden "
        "states: the draft folder's architectures[0] says which), mtp the model's own multi-token "
        "prediction layer (DeepSeek-V3's num_nextn_predict_layers)",
    )
    draft_model: str | None = Field(
        default=None, description="the draft model's folder; unset: a draft/ folder beside the model's files"
    )
    draft_max_tokens: int = Field(default=8, ge=0, le=64, description="most draft tokens a row takes a step")
    draft_step_tokens: int = Field(
        default=31,
        ge=0,
        le=64,
        description="most tokens prompt lookup drafts a step while its drafts keep being kept whole "
        "(a copied run grows past draft_max_tokens)",
    )
    draft_max_batch: int = Field(
        default=8, ge=0, description="no drafting in steps with more decoding rows than this (compute-bound)"
    )
    draft_min_acceptance: float = Field(
        default=0.3, ge=0.0, le=1.0, description="a row whose drafts are kept less often stops drafting"
    )
    draft_gate: bool = Field(
        default=True,
        description="a batch measures what drafting gains it against plain decoding and drafts only while "
        "that pays (off: the acceptance policy alone decides)",
    )
    max_nesting_depth: int = Field(
        default=MAX_NESTING_DEPTH,
        ge=3,
        le=256,
        description="levels of nested objects and lists in a request (itself the first), checked before it "
        "is validated",
    )
    max_payload_bytes: int = Field(
        default=16 << 20, ge=1024, description="a job's stored payload, and what it inflates to (zlib)"
    )

    stream_maxlen: int = Field(default=10_000, ge=10, description="approximate cap on a stream's entries")
    stream_ttl_s: int = Field(default=3600, ge=1)
    stream_flush_tokens: int = Field(default=8, ge=1, description="flush after this many tokens...")
    stream_flush_ms: float = Field(default=20.0, ge=0.0, description="...or after this many milliseconds")
    result_ttl_s: int = Field(default=86_400, ge=1)
    job_timeout_s: int = Field(default=3600, ge=1, description="default for jobs enqueued without one")
    max_job_timeout_s: int = Field(
        default=86_400, ge=-1, description="the longest timeout a job may ask for; -1: any, none included"
    )
    heartbeat_s: float = Field(default=10.0, gt=0.0, description="how often a busy worker proves it lives")
    cancel_poll_s: float = Field(default=0.1, gt=0.0)
    worker_ttl_s: int = Field(default=60, ge=20, description="an idle worker's registration lifetime")
    maintenance_interval_s: int = Field(
        default=15,
        ge=1,
        description="how often a worker looks for dead workers' jobs (retried, failed, or ended finished "
        "if they wrote their result); an idle worker wakes at least this often to do so",
    )

    redis_retry_attempts: int = Field(default=8, ge=1)
    redis_retry_max_wait_s: float = Field(default=5.0, gt=0.0)
    replica_acks: int | None = Field(
        default=None,
        ge=0,
        description="replicas that must hold a job's streams, results and RQ records before the worker "
        "goes on (WAIT; written again on a shortfall, as after a failover); unset: 1 through Sentinel, "
        "else 0",
    )
    redis_full_wait_s: float | None = Field(
        default=None,
        gt=0.0,
        description="how long a write waits while Redis is full (OOM replies) before the job fails; "
        "unset: until memory frees (the worker keeps its jobs and says so in its log and metrics)",
    )

    metrics_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="serve Prometheus metrics here (0: any free port); unset: off",
    )
    metrics_addr: str = Field(default="127.0.0.1", description="address the metrics endpoint binds")

    mlx_cache_limit_bytes: int | None = Field(
        default=None,
        ge=0,
        description="freed MLX buffers kept for reuse; bounds memory under varied shapes; unset: an eighth "
        "of MLX's memory limit on a CUDA GPU, 1 GiB elsewhere (`engine.device.buffer_cache_limit`)",
    )

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
