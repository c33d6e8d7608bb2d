"""lm-evaluation-harness' model `mlxq`: an evaluation's requests go through the queue as score and
generation jobs, so any number of workers on any hosts serve one evaluation (the `eval` extra).

lm-eval calls a model with lists of requests; this owns turning them into jobs and the results back:

- `loglikelihood`: (context, continuation) pairs, grouped by context into `continuations` rows, so a
  question's context is one row whose continuations share it (and the worker shares a few-shot prefix
  across rows and jobs). The worker tokenizes exactly as lm-eval's Hugging Face backend does.
- `loglikelihood_rolling`: one `rolling` row per text (windows of `max_length`, default the model's
  context).
- `generate_until`: one generation job per request; `until` strings are stop strings.

Nothing is truncated: a request longer than the model's context fails its job (lm-eval's `hf` backend
would drop the context's first tokens instead), and the evaluation stops with the worker's message.

Every job is submitted before any result is awaited, then results are collected in order with a
progress bar. The producer side only: nothing here needs MLX.

`mlxq eval ...` (`run_eval`) runs lm-eval's own command line with this model registered first:
lm-eval 0.4 knows only the models in its own registry, and has no plugin discovery.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from mlxq.jobs.schema import MAX_STOP_STRINGS, ScoreResult
from mlxq.producer.client import Client, JobHandle
from mlxq.producer.settings import ProducerSettings


def _flag(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


@register_model("mlxq")
class MlxqLM(LM):  # type: ignore[misc]
    """`--model mlxq --model_args queue=...,redis_url=...,rows_per_job=...,max_length=...`.

    `redis_url` and `queue` default to the producer's settings (MLXQ_REDIS_URL, MLXQ_QUEUE);
    `add_special_tokens` (default true: the tokenizer's own BOS/EOS, as lm-eval's HF backend encodes);
    `job_timeout` is each job's deadline in seconds.
    """

    def __init__(
        self,
        redis_url: str | None = None,
        queue: str | None = None,
        rows_per_job: int = 16,
        max_length: int | None = None,
        add_special_tokens: bool | str = True,
        job_timeout: int | None = None,
        max_gen_toks: int = 256,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        kwargs.pop("batch_size", None), kwargs.pop("max_batch_size", None), kwargs.pop("device", None)
        if kwargs:
            raise ValueError(f"the mlxq model takes no argument(s) {', '.join(sorted(kwargs))}")
        settings = ProducerSettings(redis_url=redis_url) if redis_url else ProducerSettings()
        self.client = Client(settings=settings, queue=queue)
        self.rows_per_job = int(rows_per_job)
        self.max_length = int(max_length) if max_length else None
        self.add_special_tokens = _flag(add_special_tokens)
        self.job_timeout = int(job_timeout) if job_timeout else None
        self.max_gen_toks = int(max_gen_toks)

    @classmethod
    def create_from_arg_string(
        cls, arg_string: str, additional_config: dict[str, Any] | None = None
    ) -> MlxqLM:
        from lm_eval.utils import simple_parse_args_string

        args = simple_parse_args_string(arg_string)
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**args, **extra)

    def _submit_rows(self, rows: list[dict[str, Any]]) -> list[JobHandle[ScoreResult]]:
        params: dict[str, Any] = {"add_special_tokens": self.add_special_tokens}
        return [
            self.client.submit_score(rows[i : i + self.rows_per_job], job_timeout=self.job_timeout, **params)
            for i in range(0, len(rows), self.rows_per_job)
        ]

    def _results(self, handles: Sequence[JobHandle[ScoreResult]], what: str, total: int) -> list[Any]:
        rows: list[Any] = []
        with tqdm(total=total, desc=f"mlxq {what}", disable=not sys.stderr.isatty()) as bar:
            for handle in handles:
                result = handle.result()
                rows.extend(result.rows)
                bar.update(len(result.rows))
        return rows

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        by_context: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            context, _ = request.args
            by_context.setdefault(context, []).append(i)
        rows, order = [], []
        for context, members in by_context.items():
            for start in range(0, len(members), 26):  # a worker's default MLXQ_MAX_SCORE_CANDIDATES
                part = members[start : start + 26]
                rows.append({"prompt": context, "continuations": [requests[i].args[1] for i in part]})
                order.append(part)
        scored = self._results(self._submit_rows(rows), "loglikelihood", len(rows))
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        for members, row in zip(order, scored, strict=True):
            for i, cont in zip(members, row.continuations, strict=True):
                out[i] = (cont.logprob, cont.is_greedy)
                self.cache_hook.add_partial("loglikelihood", requests[i].args, out[i])
        return [o for o in out if o is not None]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        rows = [
            {
                "prompt": request.args[0],
                "rolling": True,
                **({"window": self.max_length} if self.max_length else {}),
            }
            for request in requests
        ]
        scored = self._results(self._submit_rows(rows), "loglikelihood_rolling", len(rows))
        out = []
        for request, row in zip(requests, scored, strict=True):
            out.append(row.rolling.logprob)
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, row.rolling.logprob)
        return out

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        handles = []
        for request in requests:
            context, gen_kwargs = request.args
            kwargs = dict(gen_kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            if len(until) > MAX_STOP_STRINGS:
                raise ValueError(
                    f"{len(until)} `until` strings; a generation job takes at most {MAX_STOP_STRINGS}"
                )
            params: dict[str, Any] = {
                "max_tokens": int(kwargs.pop("max_gen_toks", self.max_gen_toks)),
                "stop": until,
                "add_special_tokens": self.add_special_tokens,
            }
            do_sample = _flag(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 1.0 if do_sample else 0.0))
            params["temperature"] = temperature if do_sample or temperature > 0 else 0.0
            for name in ("top_p", "top_k", "seed"):
                if name in kwargs:
                    params[name] = kwargs.pop(name)
            if kwargs:
                raise ValueError(f"generation options mlxq does not implement: {', '.join(sorted(kwargs))}")
            handles.append(self.client.submit_generate(context, job_timeout=self.job_timeout, **params))
        out = []
        with tqdm(total=len(handles), desc="mlxq generate_until", disable=not sys.stderr.isatty()) as bar:
            for request, handle in zip(requests, handles, strict=True):
                text = handle.result().text
                out.append(text)
                self.cache_hook.add_partial("generate_until", request.args, text)
                bar.update(1)
        return out


def run_eval(argv: list[str]) -> int:
    """lm-eval's own command line (`lm-eval run ...`) with `argv`, the `mlxq` model registered."""
    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv
    sys.argv = ["lm-eval", *(argv if argv and argv[0] in ("run", "ls", "validate") else ["run", *argv])]
    try:
        cli_evaluate()
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    finally:
        sys.argv = saved
    return 0
