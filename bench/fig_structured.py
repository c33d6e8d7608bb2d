"""Structured output: decode tokens/s of N constrained generation jobs against the same N unconstrained.

For each N (`Sizes.structured_jobs`), in turns each repetition, the same N prompts run in the engine's
`GenerationBatch` (in this process, no Redis: what the constraint costs is the engine's) twice:
- free: greedy, EOS masked, `batch_tokens` tokens each (as the `batch` figure's engine path);
- constrained: the same, each job under a JSON schema (an array of records: an enum, bounded and free
  numbers, strings, a nested object) whose `minItems` no job reaches within its budget, so every job
  decodes its whole budget under a live mask, as a long extraction does.

"decode tok/s" counts the tokens that arrived once every job had its first one (the steady batched
decode: the mask's host work and the split step are there); "tok/s" is all tokens over the call,
prefill and admission (compiling the schema) included. The target: constrained decode at 64 jobs at
least 90% of the free one.

"host ms/step" (constrained rows) is the decode batch's own timing of its constrained steps
(`worker/engine/critical_path.py`), the median over repetitions. "serial" is the loop thread's work a
step (all its parts but the waits for the device): where the device waits on the host, a step lasts
at least that. "critical" is the host's time from reading a step's tokens back to the launch of the
next draw and the forward it feeds, which the device may wait on; "take" (the grammars), "draw" (the
draw's graph; in the plain order with the masks), "forward" (its graph), "join" (where the masks are
written in place, `worker/engine/mask_buffer.py`: the wait for the mask thread past the graphs) and
"launch" are its parts, "launch" being, with a launcher (a GPU), the wait for the forward before to be
launched and the draw's own launch (the forward's launch runs on while the loop goes on). "handle"
(the tokens' text, stop strings and sinks) follows the launch; "read" is the wait for the tokens (the
device still computing); "masks beside" is the mask thread's own time; "forward launch" (with a
launcher) is how long the launcher's thread took to launch the forward behind each draw (MLX's CUDA
build returns from a launch only while the host is a few ops ahead of the device: about a forward's
device time means it was launched at the device's pace). On the CPU `async_eval`
returns only once much of the step is computed, so "launch" holds compute there.
"""

from __future__ import annotations

from typing import Any

from .common import Bench, median
from .fig_batch import Run
from .fig_batch import _engine as engine_run
from .fig_generate import gen_payload

FREE, CONSTRAINED = "unconstrained", "json_schema"

RECORDS = {
    "type": "array",
    "minItems": 1000,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0},
            "label": {"enum": ["positive", "negative", "neutral", "mixed"]},
            "score": {"type": "number"},
            "quote": {"type": "string", "maxLength": 24},
            "where": {
                "type": "object",
                "properties": {"page": {"type": "integer"}, "line": {"type": "integer"}},
                "required": ["page", "line"],
            },
        },
        "required": ["id", "label", "score", "quote", "where"],
        "additionalProperties": False,
    },
}


def _constrained(payload: dict[str, Any]) -> dict[str, Any]:
    schema = {"type": "json_schema", "json_schema": {"name": "records", "schema": RECORDS}}
    return {**payload, "response_format": schema}


def structured(b: Bench) -> dict[str, Any]:
    s = b.sizes
    runs: dict[tuple[int, str], list[Run]] = {}
    for rep in range(s.batch_reps + 1):  # the first round warms up
        for n in s.structured_jobs:
            free = [gen_payload(b, b.maker.prompt(s.gen_prompt), s.batch_tokens) for _ in range(n)]
            for name, payloads in ((FREE, free), (CONSTRAINED, [_constrained(p) for p in free])):
                result = engine_run(b, payloads)
                if rep:
                    runs.setdefault((n, name), []).append(result)
    rows: dict[str, Any] = {}
    for (n, name), rs in runs.items():
        decode = [r.window_tokens / r.window_s if r.window_s else None for r in rs]
        base = [r.window_tokens / r.window_s if r.window_s else None for r in runs[n, FREE]]
        ratios = [d / f if d and f else None for d, f in zip(decode, base, strict=True)]
        rows[f"{n} jobs, {name}"] = {
            "jobs": n,
            "tok_s": median([r.tokens / r.wall_s for r in rs]),
            "decode_tok_s": median(decode),
            "all_decode_tok_s": decode,
            "vs_unconstrained": median(ratios),
            "tokens": rs[-1].tokens,
            "host_ms_per_step": _host_ms(rs),
        }
    return {"prompt_tokens": s.gen_prompt, "max_tokens": s.batch_tokens, "reps": s.batch_reps, "rows": rows}


def _host_ms(runs: list[Run]) -> dict[str, float | None]:
    """Each part of the critical path (ms a step), the median over the runs that timed it."""
    parts = [r.phases for r in runs if r.phases]
    return {k: median([p[k] for p in parts]) for k in parts[0]} if parts else {}
