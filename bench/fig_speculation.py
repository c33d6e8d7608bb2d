"""Speculative decoding: acceptance and tokens/s with and without drafting, side by side.

The same chat prompts run in the engine's `GenerationBatch` (in this process, no Redis), greedy, once
per way of decoding:
- plain: no drafting;
- prompt lookup: drafts copied from the job's own text (`MLXQ_SPECULATION=prompt_lookup`), under the
  worker's default policy (no drafting above `MLXQ_DRAFT_MAX_BATCH` rows; the draft gate weighs what
  drafting gains the batch against plain decoding and pauses it where it loses): what a user gets,
  judged by the targets (the gate is the engine's, so it has learnt from the turns before);
- prompt lookup, forced: drafting at every batch size, no gate: how often drafts are kept and what a
  verify step costs where the worker would not draft (not judged by the targets);
- 4-bit draft: the model's own 4-bit copy drafts (`draft_model`, default policy; up to 8 jobs; skipped
  for an already quantized model).
- DFlash (random): a DFlash draft with random weights (`speculation/dflash.py`, 5 layers, blocks of 16)
  drafts at every step (the policy never turns it down; the draft computes a whole block each time,
  the row verifies as many of its drafts as its acceptance allows): no trained DFlash weights exist
  for the models benchmarked, so its drafts are hardly ever kept and its row shows what the machinery
  costs (the target's tapped layers, a draft forward per row and step, verify steps), never what
  DFlash gains (not judged by the targets).
- MTP (random) and MTP (random), forced: the target's own multi-token-prediction layer drafts
  (`speculation/mtp.py`; only for a model that has one, as the `deepseek-v3-mtp` and
  `tiny-deepseek-mtp` shapes do; up to 8 jobs), under the worker's default policy and with no gate. No
  trained weights of such a layer exist for a model benchmarked, so its drafts are hardly ever kept:
  the forced row is what the MTP machinery costs (its layer's forward a row and step, verify steps),
  the gated one what a user would get from such a layer (the gate turns it off), never what MTP gains.
- own draft, forced (only when asked, `--speculation-modes self`): the model as its own draft model,
  drafting at every batch size with no gate (up to 8 jobs, as the 4-bit draft): greedy
  drafts the target nearly always keeps, so the row is the draft-model machinery's ceiling and cost.
Each at N jobs at once (`Sizes.speculation_jobs`), on two kinds of prompt: copy-heavy (edit this code,
extract these fields, answer quoting the passage: the answer repeats long runs of the prompt) and open
prose (a story: nothing to copy).

The ways of decoding take turns, in an order rotating from turn to turn, after a first turn that warms
up and is not counted. Reported per row: tokens/s over the whole call (prefill included, median of the
turns), the drafted and kept tokens, the acceptance (kept / drafted) and the speed against plain
decoding of the same prompts (median of the turns' own ratios, and their range). Every run's tokens
are checked against plain decoding's (greedy speculation must not change a token). On the CPU build a
forward of k tokens costs about k times one, so drafting cannot win there: the CPU shows acceptance; the
speed targets (2x at one copy-heavy job, never below 0.97x) are the GPU's.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxq.jobs.schema import GenerateRequest, GenerateResult
from mlxq.worker.engine import Engine
from mlxq.worker.engine.generation_batch import GenerationBatch
from mlxq.worker.engine.speculation.policy import DraftPolicy
from mlxq.worker.engine.speculation.verify_clock import VerifyClock
from mlxq.worker.engine.warm_up import WarmUpShapes, warm_verify_steps
from mlxq.worker.service import draft_policy
from mlxq.worker.settings import WorkerSettings

from .common import Bench, median

FORCED = "prompt lookup, forced"  # drafting at every batch size, no gate: acceptance and raw cost
DFLASH = "DFlash (random)"
SELF = "own draft, forced"  # the model as its own draft model, drafting at every batch size, no gate
MTP = "MTP (random)"  # the target's MTP layer, random weights, the worker's default policy
MTP_FORCED = "MTP (random), forced"
# the modes besides plain (always run), by the short names `--speculation-modes` takes
MODES = {
    "lookup": "prompt lookup",
    "forced": FORCED,
    "draft": "4-bit draft",
    "dflash": DFLASH,
    "self": SELF,
    "mtp": MTP,
    "mtp-forced": MTP_FORCED,
}
# `self` only when asked (a second copy of the model); the MTP modes run only for a model with an MTP layer
DEFAULT_MODES = ("lookup", "forced", "draft", "dflash", "mtp", "mtp-forced")
# modes run up to 8 jobs, the most the worker's policy drafts at (`MLXQ_DRAFT_MAX_BATCH`): a draft model
# (its rows draft together: a forward per drafted token for all), DFlash and MTP (a forward a row and step)
UP_TO_8 = ("4-bit draft", DFLASH, SELF, MTP, MTP_FORCED)

CODE = '''def moving_average(values, window):
    """Average of each run of `window` values."""
    if window <= 0:
        raise ValueError("window must be positive")
    total = 0.0
    out = []
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
'''

PASSAGE = (
    "The lighthouse at Point Reyes was built in 1870 and stands on a rocky headland three hundred feet "
    "above the Pacific. Its first-order Fresnel lens, made in France, was lit every night by keepers who "
    "climbed the 313 steps from their quarters, until the light was automated in 1975. The station "
    "recorded some of the foggiest and windiest weather on the West Coast, with winds above sixty miles "
    "an hour on many winter days."
)

COPY_HEAVY = [
    f"Rename the function `moving_average` to `rolling_mean` and the variable `total` to `running`. "
    f"Reply with the whole code and nothing else.\n\n{CODE}",
    f"From the text below, list every number it gives with the sentence it appears in, quoted word for "
    f"word.\n\n{PASSAGE}",
    f"Answer by quoting the passage exactly: what happened to the lighthouse's light, and when?\n\n{PASSAGE}",
]
PROSE = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Describe, in a few paragraphs, what a morning at a busy fish market feels like.",
    "Write a letter to a friend about a journey by train through the mountains.",
]
KINDS = {"copy-heavy": COPY_HEAVY, "prose": PROSE}


def speculation(b: Bench) -> dict[str, Any]:
    s = b.sizes
    unknown = set(s.speculation_modes) - set(MODES)
    wanted = {MODES[m] for m in s.speculation_modes or DEFAULT_MODES if m in MODES}
    if unknown or not set(s.speculation_kinds) <= set(KINDS):
        raise SystemExit(
            f"speculation modes are {', '.join(MODES)}; kinds {', '.join(KINDS)}; got "
            f"{sorted(unknown)} and {list(s.speculation_kinds)}"
        )
    modes: dict[str, Engine] = {"plain": b.engine}
    if "prompt lookup" in wanted:
        modes["prompt lookup"] = _engine(b, "prompt_lookup")
    if FORCED in wanted:
        modes[FORCED] = _engine(b, "prompt_lookup", forced=True)
    draft = _draft_copy(b) if "4-bit draft" in wanted else None
    if draft is not None:
        modes["4-bit draft"] = _engine(b, "draft_model", str(draft))
    dflash = _dflash_draft(b) if DFLASH in wanted else None
    if dflash is not None:
        always = DraftPolicy(max_batch=1 << 20, min_acceptance=0.0)
        modes[DFLASH] = _engine(b, "draft_model", str(dflash), policy=always)
    if SELF in wanted:
        modes[SELF] = _engine(b, "draft_model", b.model_path, forced=True)
    if _has_mtp(b):
        mtp_modes = [(m, m == MTP_FORCED) for m in (MTP, MTP_FORCED) if m in wanted]
        for mode, forced in mtp_modes:
            modes[mode] = _engine(b, "mtp", forced=forced, mtp_from=modes.get(MTP))
    rows: dict[str, Any] = {}
    try:
        for kind in s.speculation_kinds:
            prompts = KINDS[kind]
            for n in s.speculation_jobs:
                # every prompt of the kind at least once: fewer jobs than prompts run as several
                # batches of n jobs one after another
                count = max(n, len(prompts))
                tokens = s.speculation_tokens
                payloads = [_payload(b, prompts[i % len(prompts)], tokens) for i in range(count)]
                taking = {m: e for m, e in modes.items() if m not in UP_TO_8 or n <= 8}
                runs = _rotating(taking, payloads, n, s.speculation_reps)
                plain_tok_s = median([r["tok_s"] for r in runs["plain"]])
                for mode, rs in runs.items():
                    same = all(r["tokens"] == runs["plain"][0]["tokens"] for r in rs)
                    drafted, kept = rs[-1]["drafted"], rs[-1]["kept"]
                    tok_s = median([r["tok_s"] for r in rs])
                    # each repetition's ratio against the plain run of the same turn
                    ratios = [r["tok_s"] / p["tok_s"] for r, p in zip(rs, runs["plain"], strict=True)]
                    rows[f"{kind}, {n} jobs, {mode}"] = {
                        "kind": kind,
                        "jobs": n,
                        "mode": mode,
                        "tok_s": tok_s,
                        "all_tok_s": [r["tok_s"] for r in rs],
                        "drafted": drafted,
                        "kept": kept,
                        "acceptance": kept / drafted if drafted else None,
                        "vs_plain": tok_s / plain_tok_s if tok_s and plain_tok_s else None,
                        "vs_plain_turns": median(ratios),
                        "vs_plain_range": [min(ratios), max(ratios)],
                        "same_tokens": same,
                        "plain_ms": median([r["plain_ms"] for r in rs]),
                        "verify": _median_parts([r["verify"] for r in rs]),
                    }
    finally:
        for mode, engine in modes.items():
            if mode != "plain":
                engine.close()
        for folder in (draft, dflash):
            if folder is not None:
                shutil.rmtree(folder.parent, ignore_errors=True)
    return {"max_tokens": s.speculation_tokens, "reps": s.speculation_reps, "rows": rows}


Runs = dict[str, list[dict[str, Any]]]


def _median_parts(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each part of a verify step (ms a step, tokens a step), the median over the runs that took one."""
    timed = [r for r in runs if r]
    return {k: median([r[k] for r in timed]) for k in timed[0]} if timed else {}


def _rotating(modes: dict[str, Engine], payloads: list[dict[str, Any]], n: int, reps: int) -> Runs:
    """Each mode's runs of `payloads` (`n` jobs at once), `reps` turns in which every mode runs once, the
    order rotating from turn to turn (a host whose speed drifts falls on all modes alike); a first turn
    warms up every mode's shapes and is not counted."""
    names = list(modes)
    runs: Runs = {name: [] for name in names}
    for turn in range(reps + 1):
        order = names[turn % len(names) :] + names[: turn % len(names)]
        for name in order:
            result = _run(modes[name], payloads, n)
            if turn:
                runs[name].append(result)
    return runs


def _engine(
    b: Bench,
    kind: str,
    draft: str | None = None,
    forced: bool = False,
    policy: DraftPolicy | None = None,
    mtp_from: Engine | None = None,
) -> Engine:
    """The bench engine's model with speculation of `kind` (a second engine sharing its weights), under
    `policy`, else the worker's default policy (its draft gate on), or `forced`: drafting at every batch
    size, no gate (what verify steps cost and how often drafts are kept where the worker would not
    draft). `mtp_from`: an engine whose MTP layer this one shares (a large checkpoint is read once)."""
    if policy is None:
        policy = DraftPolicy(max_batch=1 << 20) if forced else draft_policy(WorkerSettings())
    options = dataclasses.replace(b.engine.options, speculation=kind, draft_model=draft, draft_policy=policy)
    engine = Engine(b.engine.model, b.engine.tokenizer, b.engine.config, b.engine.name, options)
    if kind == "draft_model":
        engine.load_draft(Path(b.model_path))
    elif kind == "mtp" and mtp_from is not None:
        engine.draft_choice.draft = mtp_from.draft_choice.draft
    elif kind == "mtp":
        engine.draft_choice.load(Path(b.model_path))  # the target checkpoint's own MTP layer
    # as a worker's warm-up does: the verify steps' shapes met before the first job (on a GPU)
    warm_verify_steps(engine, WarmUpShapes(max_sequences=max(b.sizes.speculation_jobs)))
    return engine


def _has_mtp(b: Bench) -> bool:
    """Whether the benchmarked checkpoint carries an MTP layer (`num_nextn_predict_layers`)."""
    from mlxq.worker.engine.models.loader import load_config

    return bool(load_config(Path(b.model_path)).get("num_nextn_predict_layers"))


def _draft_copy(b: Bench) -> Path | None:
    """The model quantized to 4 bits in a scratch folder (with its tokenizer), or None when it is
    quantized already."""
    from mlxq.worker.engine.models.loader import load_config, load_model, save_quantized

    src = Path(b.model_path)
    if load_config(src).get("quantization"):
        return None
    out = b.workdir / "draft-4bit" / "draft"
    model, config = load_model(src)
    save_quantized(model, config, out, bits=4, group_size=32, copy_from=src)
    return out


def _dflash_draft(b: Bench) -> Path | None:
    """A random-weight DFlash draft for the model in a scratch folder (its dtype), or None for a model
    too shallow for a 5-layer draft's taps."""
    from mlxq.worker.engine.models.loader import load_config
    from mlxq.worker.engine.speculation.dflash import write_random_draft

    config = load_config(Path(b.model_path))
    if int(config.get("num_hidden_layers", 0)) < 8:
        return None
    out = b.workdir / "dflash-random" / "draft"
    return write_random_draft(out, config, dtype=b.engine.model.model.norm.weight.dtype)


def _payload(b: Bench, prompt: str, max_tokens: int) -> dict[str, Any]:
    chat = b.engine.tokenizer.has_chat_template
    text = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    return {**text, "max_tokens": max_tokens, "temperature": 0, "logit_bias": b.no_eos}


def _run(engine: Engine, payloads: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """The payloads `n` at a time: each `n` admitted at once into one generation batch, stepped until
    every job ends, then the next `n`."""
    mx.synchronize()
    t0 = time.perf_counter()
    results: dict[str, GenerateResult] = {}
    verify, steps = VerifyClock(), 0
    for first in range(0, len(payloads), n):
        batch = GenerationBatch(engine, n)
        for i, p in enumerate(payloads[first : first + n], start=first):
            batch.admit(str(i), GenerateRequest.model_validate(p), lambda _t, _ids: None, lambda: False)
        while len(batch):
            for done in batch.step():
                if done.error is not None:
                    raise done.error
                assert done.result is not None
                results[done.key] = done.result
        steps += batch.decode._steps
        for f in dataclasses.fields(verify):
            setattr(verify, f.name, getattr(verify, f.name) + getattr(batch.decode.verify_step.clock, f.name))
        batch.close()
    wall = time.perf_counter() - t0
    res = [results[str(i)] for i in range(len(payloads))]
    return {
        "tok_s": sum(r.usage.completion_tokens for r in res) / wall,
        "drafted": sum(r.usage.draft_tokens for r in res),
        "kept": sum(r.usage.accepted_tokens for r in res),
        "tokens": [list(r.token_ids) for r in res],
        # where a verify step's time goes, and what a plain step costs beside it (the run's wall time
        # less its verify steps, over its other steps: prefill and admission included)
        "verify": verify.per_step_ms(),
        "plain_ms": 1e3 * (wall - verify.total_s) / max(1, steps - verify.steps),
        "plain_steps": steps - verify.steps,
    }
