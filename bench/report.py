"""Tables for the terminal and the README, target verdicts, and the run's metadata."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlxq import worker


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return str(v)


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A GitHub-flavoured markdown table (readable as plain text too)."""
    cells = [[_fmt(c) if not isinstance(c, str) else c for c in r] for r in rows]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in cells]
    return "\n".join(lines)


def _ms(s: float | None) -> float | None:
    return None if s is None else 1000 * s


def _mem(r: dict[str, Any]) -> str:
    if "peak_mib" not in r:
        return "-"
    return f"{r['peak_mib']:,.0f} (+{r['over_resident_mib']:,.0f})"


Column = tuple[str, Callable[[str, dict[str, Any]], Any]]


def _columns(cols: list[Column], rows: dict[str, dict[str, Any]]) -> str:
    return table([h for h, _ in cols], [[fn(k, r) for _, fn in cols] for k, r in rows.items()])


def _get(key: str, scale: float = 1.0, digits: int = 1) -> Callable[[str, dict[str, Any]], str]:
    def fn(_k: str, r: dict[str, Any]) -> str:
        v = r.get(key)
        return _fmt(v * scale if isinstance(v, (int, float)) and scale != 1.0 else v, digits)

    return fn


def _cached(_k: str, r: dict[str, Any]) -> str:
    return f"{r['cached_tokens']}/{r['prompt_tokens']}" if "cached_tokens" in r else "-"


PATH: Column = ("path", lambda k, _r: k)
MEM: Column = ("peak MiB (+over resident)", lambda _k, r: _mem(r))

GENERATION: list[Column] = [
    PATH,
    ("TTFT ms", _get("ttft_s", 1000)),
    ("decode tok/s", _get("decode_tok_s")),
    ("vs mlx-lm", _get("decode_vs_mlx_lm", digits=3)),
    ("decode tok/s, median gap", _get("decode_median_gap_tok_s")),
    ("vs mlx-lm (median gap)", _get("median_gap_vs_mlx_lm", digits=3)),
    ("worker TTFT ms", _get("worker_ttft_s", 1000)),
    ("worker decode tok/s", _get("worker_decode_tok_s")),
    ("tokens", _get("tokens")),
    ("tokens in 1st stream entry", _get("first_entry_tokens")),
    MEM,
]
PREFILL: list[Column] = [
    ("tokens", _get("tokens")),
    PATH,
    ("tok/s", _get("tok_s")),
    ("ms", _get("s", 1000)),
    ("vs mlx-lm", _get("vs_mlx_lm", digits=3)),
    MEM,
]
WARM: list[Column] = [
    PATH,
    ("first TTFT ms", lambda _k, r: _fmt(_ms(r["first"]["ttft_s"]))),
    ("second TTFT ms", lambda _k, r: _fmt(_ms(r["second"]["ttft_s"]))),
    ("second/first", _get("ttft_ratio", digits=3)),
    ("all reps' ratios", lambda _k, r: ", ".join(f"{x:.3f}" for x in r.get("ratios", []))),
    ("cached tokens (2nd)", lambda _k, r: _fmt(r["second"]["cached_tokens"])),
    (
        "worker TTFT ms 1st → 2nd",
        lambda _k, r: f"{_fmt(_ms(r['first']['worker_ttft_s']))} → {_fmt(_ms(r['second']['worker_ttft_s']))}",
    ),
    ("peak MiB (+over resident)", lambda _k, r: _mem(r["first"])),
]
SCORING: list[Column] = [
    PATH,
    ("rows", _get("rows")),
    ("wall ms", _get("wall_s", 1000)),
    ("rows/s", _get("rows_s")),
    ("x one-forward-per-row", _get("x_one_forward_per_row")),
    ("batches", _get("batches")),
    ("engine score ms", _get("engine_score_s", 1000)),
    ("tokenize ms", _get("tokenize_s", 1000)),
    ("cached/prompt tokens", _cached),
    MEM,
]


def _commands_by_name(table: dict[str, Any], key: str = "redis_commands") -> str:
    """Redis commands per job by name for each pass, those at 0.05 a job or more: run by the server
    (`redis_commands`, INFO commandstats: commands inside Lua scripts and transactions count one each)
    or sent by the worker (`redis_sent`, counted at its client: a script call counts one)."""
    passes = [(k, r) for k, r in table.items() if r.get(key) and r.get("jobs")]
    if not passes:
        return ""
    names: dict[str, float] = {}
    for _, r in passes:
        for name, calls in r[key].items():
            names[name] = max(names.get(name, 0.0), calls / r["jobs"])
    shown = [n for n, per_job in sorted(names.items(), key=lambda kv: -kv[1]) if per_job >= 0.05]
    what = "run by the server" if key == "redis_commands" else "sent by the worker"
    lines = [
        f"\nRedis commands per job {what}, by command:\n",
        "| command | " + " | ".join(k for k, _ in passes) + " |",
        "| --- |" + " ---: |" * len(passes),
    ]
    for name in shown:
        cells = [f"{r[key].get(name, 0) / r['jobs']:.2f}" for _, r in passes]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _phases_by_pass(table: dict[str, Any]) -> str:
    """The worker's own timing of a score batch's phases (its stats hash), ms a batch, for each pass."""
    key = "score_phase_ms_per_batch"
    passes = [(k, r[key]) for k, r in table.items() if r.get(key)]
    if not passes:
        return ""
    phases = list(dict.fromkeys(p for _, ms in passes for p in ms))  # a pass may lack some (no claim)
    lines = [
        "\nA score batch's phases as the worker times them (ms a batch):\n",
        "| phase | " + " | ".join(k for k, _ in passes) + " |",
        "| --- |" + " ---: |" * len(passes),
    ]
    lines += [
        f"| {p} | " + " | ".join(f"{ms[p]:.2f}" if p in ms else "" for _, ms in passes) + " |" for p in phases
    ]
    return "\n".join(lines)


QUEUE: list[Column] = [
    ("pass", lambda k, _r: k),
    ("jobs", _get("jobs")),
    ("done", _get("finished")),
    ("wall s (1st job's tokenizing → last end)", _get("wall_s", digits=2)),
    ("jobs/s", _get("jobs_s")),
    ("batches", _get("batches")),
    ("engine score s", _get("engine_score_s", digits=2)),
    ("tokenize s", _get("tokenize_s", digits=2)),
    ("finish_streams s", _get("finish_streams_s", digits=2)),
    ("share outside MLX", lambda _k, r: f"{100 * r['share_outside_mlx']:.0f}%"),
    ("ms/job outside MLX", _get("ms_per_job_outside_mlx", digits=2)),
    ("Redis cmds/job run (server)", _get("redis_commands_per_job")),
    ("Redis cmds/job sent (worker)", _get("redis_sent_per_job")),
    MEM,
]
BATCH: list[Column] = [
    PATH,
    ("tok/s", _get("tok_s", digits=0)),
    ("vs mlx-lm", _get("vs_mlx_lm", digits=2)),
    ("all reps' tok/s", lambda _k, r: ", ".join(f"{x:,.0f}" for x in r["all_tok_s"])),
    ("decode tok/s", _get("decode_tok_s", digits=0)),
    ("TTFT p50 ms", _get("ttft_p50_s", 1000)),
    ("wall s", _get("wall_s", digits=2)),
    (
        "same ids as engine",
        lambda _k, r: "-" if r["same_ids_as_engine"] is None else f"{r['same_ids_as_engine']}/{r['jobs']}",
    ),
    ("worker batch_step s / flush_streams s / finish_streams s", lambda _k, r: _batch_phases(r)),
    MEM,
]

STRUCTURED: list[Column] = [
    PATH,
    ("decode tok/s", _get("decode_tok_s", digits=0)),
    ("vs unconstrained", _get("vs_unconstrained", digits=2)),
    ("all reps' decode tok/s", lambda _k, r: ", ".join(f"{x:,.0f}" for x in r["all_decode_tok_s"] if x)),
    ("tok/s (with prefill)", _get("tok_s", digits=0)),
    (
        "host ms/step: serial; critical (take, draw, forward, join, launch; handle; read; masks beside;"
        " forward launch)",
        lambda _k, r: _host_ms(r),
    ),
]


def _host_ms(r: dict[str, Any]) -> str:
    """A constrained row's host work per step (`fig_structured`): the loop thread's serial work, then
    the critical path with its parts; "-" where none was timed. Results from before `handle`, `masks`
    and `host` were timed show "?" for them."""
    ms = r.get("host_ms_per_step") or {}
    if not ms:
        return "-"

    def part(key: str) -> str:
        return f"{ms[key]:.2f}" if key in ms else "?"

    keys = ("take_ms", "draw_ms", "forward_ms", "join_ms", "launch_ms")
    parts = ", ".join(part(k) for k in keys)
    tail = f"{part('handle_ms')}; {part('read_ms')}; {part('masks_ms')}; {part('forward_launch_ms')}"
    return f"{part('host_ms')}; {part('critical_ms')} ({parts}; {tail})"


LOGPROBS: list[Column] = [
    PATH,
    ("time s", _get("s", digits=2)),
    ("tokens/s", _get("tok_s", digits=0)),
    ("time vs full logits", _get("vs_full_logits", digits=2)),
    MEM,
    ("max abs logprob diff vs plain", _get("max_abs_logprob_diff", digits=6)),
    ("top-1 same", _get("top1_same", digits=3)),
]


def _ratio_range(r: dict[str, Any]) -> str:
    if r.get("vs_plain_turns") is None:
        return _fmt(r.get("vs_plain"), 2)
    low, high = r["vs_plain_range"]
    return f"{r['vs_plain_turns']:.2f} ({low:.2f}-{high:.2f})"


VERIFY_PARTS = ("read", "draft", "build", "launch", "wait", "trim", "handle")


def _verify(_k: str, r: dict[str, Any]) -> str:
    """A verify step's parts (`VerifyClock`), "-" where the run took none."""
    v = r.get("verify") or {}
    if not v:
        return "-"
    parts = ", ".join(f"{v[k + '_ms']:.2f}" for k in VERIFY_PARTS)
    return f"{v['step_ms']:.2f} ({parts}; {v['fed_per_step']:.1f}, {v['given_per_step']:.1f})"


SPECULATION: list[Column] = [
    PATH,
    ("tok/s (with prefill)", _get("tok_s", digits=1)),
    ("vs plain (turns' median, range)", lambda _k, r: _ratio_range(r)),
    ("drafted", _get("drafted", digits=0)),
    ("kept", _get("kept", digits=0)),
    ("acceptance", lambda _k, r: "-" if r.get("acceptance") is None else f"{r['acceptance']:.0%}"),
    ("tokens as plain", lambda _k, r: "yes" if r.get("same_tokens") else "NO"),
    ("plain step ms", _get("plain_ms", digits=2)),
    ("verify step ms (read, draft, build, launch, wait, trim, handle; fed, given a step)", _verify),
]


def _step_ops(ops: dict[str, Any]) -> str:
    """The batch figure's primitives a decode step (`step_ops.py`), ours at each N and mlx-lm's one row."""
    layers = ops["layers"]

    def count(n: int) -> str:
        return f"{n:,} ({n / layers:.1f} a layer)"

    ours = ", ".join(f"{rows} row{'s' * (rows != '1')} {count(n)}" for rows, n in ops["mlxq"].items())
    return (
        f"\nPrimitives one decode step builds for MLX to encode ({layers} layers; one device's counts only): "
        f"mlxq {ours}; mlx-lm `generate_step` 1 row {count(ops['mlx_lm_1'])}\n"
    )


def _batch_phases(r: dict[str, Any]) -> str:
    p = r.get("phases") or {}
    if not p:
        return "-"
    return " / ".join(f"{p.get(k, 0.0):.3f}" for k in ("batch_step_s", "flush_streams_s", "finish_streams_s"))


DECODE: list[Column] = [
    PATH,
    ("decode tok/s", _get("decode_tok_s")),
    ("vs mlx-lm", _get("vs_mlx_lm", digits=3)),
    ("decode tok/s, median gap", _get("decode_median_gap_tok_s")),
    ("vs mlx-lm (median gap)", _get("median_gap_vs_mlx_lm", digits=3)),
]


def render(result: dict[str, Any]) -> str:
    """Every figure of a run as markdown tables, with each target's verdict."""
    meta, figs = result["meta"], result["figures"]
    out = [
        f"**{meta['machine']}** · model `{meta['model']}` ({meta['dtype']}) · sizes `{meta['sizes']}` · "
        f"{meta['date']} · commit `{meta['commit']}` · mlx {meta['mlx']} · mlx-lm {meta['mlx_lm']} · "
        f"load average at start {meta.get('loadavg', '-')}"
    ]
    if (g := figs.get("generation")) and "rows" in g:
        reps = next(iter(g["rows"].values()))["reps"]
        out.append(
            f"\n### 1. Generation, one job at a time ({g['prompt_tokens']}-token prompt, "
            f"{g['max_tokens']} new tokens, greedy, median of {reps})"
        )
        out.append(_columns(GENERATION, g["rows"]))
        e = g["rows"].get("mlxq engine.generate", {})
        if e.get("after_last_token_s") is not None:
            out.append(
                f"\nEngine phase timers (median): after the last token until `generate` returns "
                f"{_fmt(_ms(e['after_last_token_s']), 2)} ms, of which prefix-cache offer "
                f"{_fmt(_ms(e.get('offer_s')), 2)} ms; engine-reported `prefill_s` "
                f"{_fmt(_ms(e.get('reported_prefill_s')), 2)} ms against TTFT "
                f"{_fmt(_ms(e.get('ttft_s')), 2)} ms."
            )
    if (p := figs.get("prefill")) and "rows" in p:
        out.append(
            f"\n### 2. Prefill (prompt to first token, from token ids; chunk {p['chunk']}, "
            f"median of {p['reps']})"
        )
        rows = [[fn(k, r) for _, fn in PREFILL] for paths in p["rows"].values() for k, r in paths.items()]
        out.append(table([h for h, _ in PREFILL], rows))
    if (sc := figs.get("scoring")) and "table" in sc:
        out.append(
            f"\n### 3. Scoring ({sc['rows']} rows sharing a {sc['prefix_tokens']}-token prefix, "
            f"{sc['own_tokens']} own tokens, {sc['candidates']} candidates)"
        )
        out.append(_columns(SCORING, sc["table"]))
        for name, r in sc["table"].items():
            if "phases" in r:
                parts = ", ".join(
                    f"{k} {_fmt(_ms(v['s']))} ms ({v['calls']} calls)" for k, v in r["phases"].items()
                )
                out.append(f"\nPhase timers, {name}: {parts}.")
            if "tokenize_alternatives_ms" in r:
                alt = ", ".join(f"{k} {v:,.1f} ms" for k, v in r["tokenize_alternatives_ms"].items())
                out.append(
                    f"\nTokenizing the same rows otherwise ({name}: {_fmt(_ms(r['tokenize_s']))} ms): {alt}."
                )
        if sp := sc.get("shared_prefix"):
            out.append(_shared_prefix_table(sp))
        if qt := sc.get("queue_turns"):
            out.append(_queue_turns_table(qt))
        if st := sc.get("start_turns"):
            out.append(
                f"\nThe shared prefix started before tokenizing (one {sc['rows']}-row job through the engine "
                f"from text, cold, {st['turns']} alternating turns): "
                + "; ".join(
                    f"{k} {r['wall_ms']:,.1f} ms ({r['range_ms'][0]:,.1f}-{r['range_ms'][1]:,.1f})"
                    for k, r in st["rows"].items()
                )
                + f"; per turn {st['speedup']:.2f}x"
                + f" ({st['speedup_range'][0]:.2f}-{st['speedup_range'][1]:.2f})."
            )
    if (c := figs.get("warm_cache")) and "rows" in c:
        out.append(
            f"\n### 4. Warm prefix cache ({c['prefix_tokens']}-token prefix twice, "
            f"{c['tail_tokens']}-token tails; median of {c.get('reps', 1)})"
        )
        out.append(_columns(WARM, c["rows"]))
    if (q := figs.get("queue")) and "table" in q:
        out.append(
            f"\n### 5. Queue overhead (tiny model, one-row score jobs of {q['prompt_tokens']} tokens, "
            "one burst worker)"
        )
        out.append(_columns(QUEUE, q["table"]))
        out.append(_commands_by_name(q["table"]))
        out.append(_commands_by_name(q["table"], "redis_sent"))
        out.append(_phases_by_pass(q["table"]))
    if (bg := figs.get("batch")) and "rows" in bg:
        out.append(
            f"\n### 6. Batched generation (N jobs at once, {bg['prompt_tokens']}-token prompts, "
            f"{bg['max_tokens']} new tokens each, greedy, median of {bg['reps']})"
        )
        out.append(_columns(BATCH, bg["rows"]))
        if "step_ops" in bg:
            out.append(_step_ops(bg["step_ops"]))
    if (st := figs.get("structured")) and "rows" in st:
        out.append(
            f"\n### 7. Structured output (N jobs at once in the engine's GenerationBatch, "
            f"{st['prompt_tokens']}-token prompts, {st['max_tokens']} new tokens each, greedy, "
            f"median of {st['reps']})"
        )
        out.append(_columns(STRUCTURED, st["rows"]))
    if (sp := figs.get("speculation")) and "rows" in sp:
        out.append(
            f"\n### 8. Speculative decoding (N jobs at once in the engine's GenerationBatch, greedy, "
            f"{sp['max_tokens']} new tokens each, median of {sp['reps']}; acceptance: drafted tokens kept)"
        )
        out.append(_columns(SPECULATION, sp["rows"]))
    if (ab := figs.get("decode_ab")) and "rows" in ab:
        out.append(
            f"\n### Decode A/B: decode rate, {ab['reps']} repetitions in rotating order "
            f"({ab['tokens']} tokens)"
        )
        out.append(_columns(DECODE, ab["rows"]))
        out.append(
            "\nAll repetitions (tok/s): "
            + "; ".join(f"{k}: {', '.join(f'{x:.0f}' for x in r['all'] if x)}" for k, r in ab["rows"].items())
        )
        if cp := ab.get("compiled_over_plain"):
            out.append(
                f"\nCompiled steps over plain steps, per turn: median {cp['median']:.2f}x "
                f"({cp['min']:.2f}-{cp['max']:.2f})"
            )
    if (fj := figs.get("first_job")) and "rows" in fj:
        out.append(
            f"\n### A fresh worker's first jobs against its warm ones ({fj['prompt_tokens']}-token prompts, "
            f"{fj['max_tokens']} new tokens; warm: median of {_repeats(fj)} repeats; enqueue to `done`)"
        )
        out.append(_columns(FIRST_JOB, fj["rows"]))
    if (lp := figs.get("prompt_logprobs")) and "rows" in lp:
        out.append(
            f"\n### 8. Prompt logprobs of one {lp['prompt_tokens']:,}-token prompt (top-{lp['top_k']}; "
            f"one [T, vocab] float32 block is {lp['block_mib']:,.0f} MiB; best of {lp['reps']}, "
            "the first dropped when more than one)"
        )
        out.append(_columns(LOGPROBS, lp["rows"]))
    for name, fig in figs.items():
        if "error" in fig:
            out.append(f"\n**{name}: FAILED** `{fig['error']}`")
    out.append("\n### Targets")
    out.append(
        table(
            ["target", "figure", "value", "verdict"],
            [[t["target"], t["figure"], t["value"], t["verdict"]] for t in result["targets"]],
        )
    )
    return "\n".join(out)


def targets(figs: dict[str, Any]) -> list[dict[str, str]]:
    """Each target of the brief, met or missed, with the figure it is judged on."""
    out = []

    def add(target: str, figure: str, value: float | None, ok: bool | None, fmt: str) -> None:
        verdict = "n/a" if ok is None else ("met" if ok else "MISSED")
        out.append(
            {
                "target": target,
                "figure": figure,
                "value": "-" if value is None else fmt.format(value),
                "verdict": verdict,
            }
        )

    if (g := figs.get("generation")) and "rows" in g:
        for k in ("mlxq engine.generate", "mlxq via Redis (worker + XREAD)"):
            v = g["rows"][k]["decode_vs_mlx_lm"]
            add("decode ≥ 95% of mlx-lm", k, v, None if v is None else v >= 0.95, "{:.1%}")
    # The rotating A/B's paths take turns in a changing order: on a host whose speed drifts it judges
    # the target more surely than `generation`'s few repetitions.
    if (ab := figs.get("decode_ab")) and "rows" in ab:
        for k, r in ab["rows"].items():
            if k.startswith("mlxq engine.generate") or k.startswith("mlxq via Redis"):
                v = r["vs_mlx_lm"]
                label = f"{k}, rotating A/B ({ab['reps']} repetitions)"
                add("decode ≥ 95% of mlx-lm", label, v, None if v is None else v >= 0.95, "{:.1%}")
    if (p := figs.get("prefill")) and "rows" in p:
        for n, paths in p["rows"].items():
            for k in ("mlxq prefill (engine's chunked prefill)", "mlxq engine.generate (text, max_tokens=1)"):
                v = paths[k]["vs_mlx_lm"]
                add("prefill ≥ 95% of mlx-lm", f"{n} tokens, {k}", v, v >= 0.95, "{:.1%}")
    if (sc := figs.get("scoring")) and "table" in sc:
        for k, r in sc["table"].items():
            if k.startswith("mlxq via Redis") and "no batching" not in k:
                v = r["x_one_forward_per_row"]
                add("scoring rows/s ≥ 25x one forward per row", k, v, v >= 25, "{:.1f}x")
    if (sc := figs.get("scoring")) and (qt := sc.get("queue_turns")):
        for k, r in qt["rows"].items():
            if k != "plain MLX ideal":
                v = r["x_ideal"]
                add("through the queue ≥ 90% of the plain-MLX ideal, rotating", k, v, v >= 0.9, "{:.0%}")
    if (sc := figs.get("scoring")) and (sp := sc.get("shared_prefix")):
        for k in ("in place cold", "in place warm"):
            r = sp["rows"][k]
            add(
                "rows reading the prefix in place ≥ 1.3x the plain-MLX ideal",
                k,
                r["x_ideal"],
                r["x_ideal"] >= 1.3,
                "{:.2f}x",
            )
            v = r["peak_over_kv_bound"]
            add("their peak memory under the prefix's KV + the rows' own", k, v, v < 1.0, "{:.2f}x")
    if (c := figs.get("warm_cache")) and "rows" in c:
        for k, r in c["rows"].items():
            add("second TTFT < 10% of first", k, r["ttft_ratio"], r["ttft_ratio"] < 0.10, "{:.1%}")
    if (st := figs.get("structured")) and "rows" in st:
        for k, r in st["rows"].items():
            if r["jobs"] == 64 and not k.endswith("unconstrained"):
                v = r["vs_unconstrained"]
                add(
                    "constrained decode ≥ 90% of unconstrained",
                    k,
                    v,
                    None if v is None else v >= 0.90,
                    "{:.1%}",
                )
    if (sp := figs.get("speculation")) and "rows" in sp:
        for k, r in sp["rows"].items():
            # forced drafting and a random-weight drafter show acceptance and cost, not a user's speed
            if (
                r["mode"] in ("plain", "prompt lookup, forced", "DFlash (random)", "own draft, forced")
                or r.get("vs_plain_turns") is None
            ):
                continue
            v = r["vs_plain_turns"]
            add("speculation never below 0.97x of plain", k, v, v >= 0.97, "{:.2f}x")
            if r["mode"] == "prompt lookup" and r["kind"] == "copy-heavy" and r["jobs"] == 1:
                add("prompt lookup ≥ 2x at one copy-heavy job", k, v, v >= 2.0, "{:.2f}x")
    if (fj := figs.get("first_job")) and "rows" in fj and "warm-up on" in fj["rows"]:
        r = fj["rows"]["warm-up on"]
        for kind in ("gen", "score"):
            v = r[f"first_{kind}_vs_warm"]
            add("first job within 1.5x of a warm one", f"warm-up on, {kind} job", v, v <= 1.5, "{:.2f}x")
    if (bg := figs.get("batch")) and "rows" in bg and bg["max_tokens"] == 128:
        for k, r in bg["rows"].items():
            if r["jobs"] == 64 and k.endswith(QUEUE_BATCH):
                add(
                    "64 jobs x 128 tokens ≥ 12,000 tok/s", k, r["tok_s"], r["tok_s"] >= 12000, "{:,.0f} tok/s"
                )
    if (lp := figs.get("prompt_logprobs")) and "rows" in lp and FULL_LOGITS in lp["rows"]:
        full = lp["rows"][FULL_LOGITS]["over_resident_mib"]
        for k, r in lp["rows"].items():
            if k.startswith("mlxq") and full:
                v = r["over_resident_mib"] / full
                label = f"{lp['prompt_tokens']:,} tokens, vocab {lp['vocab']:,}, {k}"
                add(
                    "prompt logprobs: peak over resident below the full-logits path's",
                    label,
                    v,
                    v < 1,
                    "{:.2f}x",
                )
    return out


QUEUE_BATCH = "mlxq via Redis (batching worker)"
FULL_LOGITS = "chunked prefill, then the full [T, vocab] float32 logits"  # `fig_logprobs.FULL`


def _repeats(fig: dict[str, Any]) -> int:
    return int(next(iter(fig["rows"].values()))["repeats"])


FIRST_JOB: list[Column] = [
    PATH,
    ("start → listening s", _get("start_to_listening_s", digits=2)),
    ("1st gen job ms", _get("first_gen_job_s", 1000)),
    ("warm gen job ms", _get("warm_gen_job_s", 1000)),
    ("1st/warm (gen)", _get("first_gen_vs_warm", digits=2)),
    ("1st TTFT ms", _get("first_ttft_s", 1000)),
    ("warm TTFT ms", _get("warm_ttft_s", 1000)),
    ("1st decode tok/s", _get("first_decode_tok_s")),
    ("warm decode tok/s", _get("warm_decode_tok_s")),
    ("1st score job ms", _get("first_score_job_s", 1000)),
    ("warm score job ms", _get("warm_score_job_s", 1000)),
    ("1st/warm (score)", _get("first_score_vs_warm", digits=2)),
]


def _git_commit() -> str:
    env = os.environ.get("MLXQ_BENCH_COMMIT")
    if env:
        return env
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        )
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> str:
    """A short description of where this ran."""
    device = mx.default_device()
    if device.type == mx.gpu:
        try:
            name = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            name = "GPU"
        return f"GPU: {name}, {os.cpu_count()} CPU cores (device tool)"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return f"CPU: {os.cpu_count()} cores, {cpu}, MLX Linux CPU build (reference BLAS)"


def metadata(model: str, dtype: str, sizes: str, mlx_lm_version: str) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "device": str(mx.default_device()),
        "commit": _git_commit(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm_version,
        "python": platform.python_version(),
        "model": model,
        "dtype": dtype,
        "sizes": sizes,
        "loadavg": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "worker_src": os.path.dirname(worker.__file__ or ""),
    }


def _queue_turns_table(qt: dict[str, Any]) -> str:
    """Issue 29's queue paths against the plain-MLX ideal, in rotating turns (`fig_score._queue_turns`)."""
    rows = [
        [
            k,
            f"{r['rows_s']:,.1f} ({r['rows_s_range'][0]:,.1f}-{r['rows_s_range'][1]:,.1f})",
            f"{r['x_ideal']:.0%} ({r['x_ideal_range'][0]:.0%}-{r['x_ideal_range'][1]:.0%})",
            "-" if r.get("enqueue_ms") is None else f"{r['enqueue_ms']:,.1f}",
        ]
        for k, r in qt["rows"].items()
    ]
    head = (
        f"\nThrough the queue against the plain-MLX ideal (issue 29), {qt['turns']} rotating turns, a new "
        "prefix each path and turn (cold), a warm-up turn dropped.\n"
    )
    return head + table(
        ["path", "rows/s (range)", "of the ideal, per turn (range)", "producer's enqueue ms (median)"], rows
    )


def _shared_prefix_table(sp: dict[str, Any]) -> str:
    """Issue 29's in-place rows against the plain-MLX ideal and the copy per row, in rotating turns."""
    rows = [
        [
            k,
            f"{r['rows_s']:,.1f} ({r['rows_s_range'][0]:,.1f}-{r['rows_s_range'][1]:,.1f})",
            f"{r['x_ideal']:.2f}x ({r['x_ideal_range'][0]:.2f}-{r['x_ideal_range'][1]:.2f})",
            f"{r['over_resident_mib']:,.1f}",
            f"{r['peak_over_kv_bound']:.2f}x",
        ]
        for k, r in sp["rows"].items()
    ]
    head = (
        f"\nRows reading the shared prefix in place (issue 29), from token ids, {sp['turns']} rotating turns "
        f"(a warm-up turn dropped; warm: the same prefix again, new rows). Bound: the prefix's KV plus the "
        f"rows' own, {sp['kv_bound_mib']:,.1f} MiB.\n"
    )
    return head + table(
        ["path", "rows/s (range)", "over the ideal (range)", "peak over resident MiB", "over the bound"], rows
    )
