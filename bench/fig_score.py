"""Figures 3 and 5: scoring rows that share a long prefix, and the queue's own cost per small job."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import redis

from mlxq.jobs.schema import ScoreRequest
from mlxq.worker.engine import job_scorer
from mlxq.worker.engine.cache.prefix_cache import PrefixCache
from mlxq.worker.engine.scoring import PrefixScorer

from .common import Bench, mem_fields, memory, phase_timers, worker_memory
from .prompts import PromptMaker
from .queue_client import BenchWorker, cleanup, enqueue_many, follow, job_failures

# Each of these synchronises (mx.eval / .tolist()) inside, so its wall time is its work's time.
SCORE_PHASES = {
    "model (PrefixScorer.score)": (PrefixScorer, "score"),
    "prefix cache offer (KV copy)": (PrefixCache, "offer"),
    "candidate_scores (per row)": (job_scorer, "candidate_scores"),
}


def _rows(b: Bench, prefix: str, n: int) -> list[dict[str, Any]]:
    """`n` rows: `prefix` plus own tokens each, with the same one-token candidates."""
    s = b.sizes
    rows = []
    for _ in range(n):
        prompt = prefix + b.maker.pieces(s.score_own)
        rows.append({"prompt": prompt, "candidates": b.maker.candidates(prompt, s.score_candidates)})
    return rows


def _prefix(b: Bench) -> str:
    return b.maker.pieces(b.sizes.score_prefix - b.maker.special)


def _queue_run(b: Bench, w: BenchWorker, payloads: list[dict[str, Any]]) -> dict[str, Any]:
    """Enqueue all jobs in one pipeline, read every stream to its end; rows/s over that wall time."""
    since = time.time()
    t0 = time.perf_counter()
    job_ids = enqueue_many(w.queue, "jobs.score", payloads)
    enqueued = time.perf_counter() - t0  # the producer's part: RQ's JSON and zlib of every payload
    traces = follow(b.conn, job_ids, t0, b.sizes.timeout_s)
    wall = max(tr.entries[-1][0] for tr in traces.values()) - t0
    failed = job_failures(b.conn, job_ids)
    if failed:
        raise RuntimeError(f"{len(failed)} score jobs failed, first: {failed[0]}")
    records = w.finished(since, len(payloads))
    batches = [r for r in records if r.get("fn") == "score_many"]
    rows = sum(len(p["rows"]) for p in payloads)
    dones = [tr.done or {} for tr in traces.values()]
    out = {
        "jobs": len(payloads),
        "rows": rows,
        "wall_s": wall,
        "enqueue_s": enqueued,
        "rows_s": rows / wall,
        "batches": len(batches),
        "rows_per_batch": [r["rows"] for r in batches],
        "engine_score_s": sum(r["s"] for r in batches),
        "tokenize_s": sum(r["s"] for r in records if r.get("fn") == "score_tokens_many"),
        "finish_s": sum(r["s"] for r in records if r.get("fn") == "finish_streams"),
        "prompt_tokens": sum(int(d["prompt_tokens"]) for d in dones),
        "cached_tokens": sum(int(d["cached_tokens"]) for d in dones),
        **worker_memory(records),
    }
    cleanup(b.conn, job_ids)
    return out


def scoring(b: Bench) -> dict[str, Any]:
    s = b.sizes
    tok = b.engine.tokenizer
    table: dict[str, Any] = {}

    # Plain MLX on mlx-lm's model: one forward per row (no sharing), then the ideal shared-prefix plan.
    prefix = _prefix(b)
    rows = _rows(b, prefix, s.score_rows)
    encoded = [
        (tok.encode(r["prompt"]), [tok.encode(r["prompt"] + c)[-1] for c in r["candidates"]]) for r in rows
    ]

    def score_plain(logits: mx.array, cands: list[int]) -> None:
        picked = logits[mx.array(cands)]
        (picked - mx.logsumexp(logits)).tolist()

    for full in (True, False):
        name = "mlx-lm model, one forward per row" + (
            " (full logits)" if full else " (LM head on last token)"
        )
        score_plain(b.mlxlm.last_logits(encoded[0][0], full), encoded[0][1])  # warm-up
        with memory() as mem:
            t0 = time.perf_counter()
            for ids, cands in encoded[: s.score_baseline_rows]:
                score_plain(b.mlxlm.last_logits(ids, full), cands)
            dt = time.perf_counter() - t0
        table[name] = {
            "rows": s.score_baseline_rows,
            "wall_s": dt,
            "rows_s": s.score_baseline_rows / dt,
            **mem_fields(mem["peak"], mem["active0"]),
        }

    n_prefix = len(tok.encode(prefix))
    suffixes = [ids[n_prefix:] for ids, _ in encoded]
    for _rep in range(2):  # the first warms up
        with memory() as mem:
            t0 = time.perf_counter()
            logits = b.mlxlm.shared_prefix_logits(encoded[0][0][:n_prefix], suffixes)
            for i, (_ids, cands) in enumerate(encoded):
                score_plain(logits[i], cands)
            dt = time.perf_counter() - t0
    table["plain MLX ideal: prefix once, suffixes in one batch"] = {
        "rows": len(rows),
        "wall_s": dt,
        "rows_s": len(rows) / dt,
        **mem_fields(mem["peak"], mem["active0"]),
    }

    _engine_alone(b, table)
    _engine_from_ids(b, table)
    shared_prefix = _shared_prefix_turns(b)

    # Through Redis and a long-lived worker (default settings: cross-job batches, prefix cache on).
    w = b.worker()
    warm_up = _prefix(b)
    for _ in range(2):  # warm-up: the cold path, then the warm-cache path (its shapes) on one prefix
        _queue_run(b, w, [{"rows": [r]} for r in _rows(b, warm_up, s.score_rows)])
    # A new prefix, the first time and again (each its own prefix): what the first cold batch of a
    # worker's life costs beyond the next ones shows as the difference.
    table[f"mlxq via Redis: {s.score_rows} one-row jobs (batched across jobs, cold, first)"] = _queue_run(
        b, w, [{"rows": [r]} for r in _rows(b, _prefix(b), s.score_rows)]
    )
    shared = _prefix(b)
    one_row_jobs = [{"rows": [r]} for r in _rows(b, shared, s.score_rows)]
    table[f"mlxq via Redis: {s.score_rows} one-row jobs (batched across jobs, cold)"] = _queue_run(
        b, w, one_row_jobs
    )
    table[f"mlxq via Redis: one {s.score_rows}-row job (cold)"] = _queue_run(
        b, w, [{"rows": _rows(b, _prefix(b), s.score_rows)}]
    )
    warm_jobs = [{"rows": [r]} for r in _rows(b, shared, s.score_rows)]
    table[f"mlxq via Redis: {s.score_rows} one-row jobs (grouped, warm cache)"] = _queue_run(b, w, warm_jobs)

    queue_turns = _queue_turns(b, w)
    start_turns = _start_turns(b)

    # One row per job, no cross-job batches, no prefix cache: every job is one full forward.
    plain = b.worker("nobatch-nocache", env={"MLXQ_SCORE_BATCH_ROWS": "0", "MLXQ_PREFIX_CACHE_BYTES": "0"})
    _queue_run(b, plain, [{"rows": [r]} for r in _rows(b, _prefix(b), 2)])  # warm-up
    jobs = [{"rows": [r]} for r in _rows(b, _prefix(b), s.score_baseline_rows)]
    table["mlxq via Redis: one row per job, no batching, no cache"] = _queue_run(b, plain, jobs)
    plain.stop()
    del b.workers["nobatch-nocache"]

    base = table["mlx-lm model, one forward per row (LM head on last token)"]["rows_s"]
    for row in table.values():
        row["x_one_forward_per_row"] = row["rows_s"] / base
    return {
        "rows": s.score_rows,
        "prefix_tokens": s.score_prefix,
        "own_tokens": s.score_own,
        "candidates": s.score_candidates,
        "table": table,
        "shared_prefix": shared_prefix,
        "queue_turns": queue_turns,
        "start_turns": start_turns,
    }


def _start_turns(b: Bench) -> dict[str, Any]:
    """What starting a batch's shared prefix before tokenizing it gives (`Engine.start_shared_prefix`):
    one 64-row job through the engine from text, cold (a new prefix each turn), tokenized then scored,
    against the prefix started first, in alternating turns (a warm-up turn dropped). Per path the
    median wall time and its range; and the median of each turn's ratio. The engine starts nothing
    on a CPU by default (`EngineOptions.start_shared_prefix`): there both paths are the same."""
    s, engine = b.sizes, b.engine
    walls: dict[str, list[float]] = {"tokenize, then score": [], "start the prefix, tokenize, score": []}
    names = list(walls)
    for turn in range(s.score_reps + 1):
        for name in names[turn % 2 :] + names[: turn % 2]:
            request = ScoreRequest.model_validate({"rows": _rows(b, _prefix(b), s.score_rows)})
            t0 = time.perf_counter()
            if name != names[0]:
                engine.start_shared_prefix([request])
            engine.score_many([engine.score_tokens(request)])
            if turn:
                walls[name].append(time.perf_counter() - t0)
    ratios = [a / x for a, x in zip(walls[names[0]], walls[names[1]], strict=True)]
    return {
        "turns": s.score_reps,
        "rows": {
            k: {"wall_ms": 1000 * statistics.median(v), "range_ms": [1000 * min(v), 1000 * max(v)]}
            for k, v in walls.items()
        },
        "speedup": statistics.median(ratios),
        "speedup_range": [min(ratios), max(ratios)],
    }


def _queue_turns(b: Bench, w: BenchWorker) -> dict[str, Any]:
    """Issue 29's queue target in rotating turns: the plain-MLX ideal (prefix once, the suffixes in one
    batch, from token ids) beside one 64-row job and 64 one-row jobs through the queue. Each path a
    new prefix every turn (cold); the first turn warms up and is dropped.
    Per path: the median rows/s and its range, and the median of each turn's ratio to that turn's
    ideal."""
    s, tok = b.sizes, b.engine.tokenizer

    def ideal() -> float:
        prefix = _prefix(b)
        rows = _rows(b, prefix, s.score_rows)
        n_prefix = len(tok.encode(prefix))
        encoded = [
            (tok.encode(r["prompt"]), [tok.encode(r["prompt"] + c)[-1] for c in r["candidates"]])
            for r in rows
        ]
        own = [ids[n_prefix:] for ids, _ in encoded]
        t0 = time.perf_counter()
        logits = b.mlxlm.shared_prefix_logits(encoded[0][0][:n_prefix], own)
        for i, (_ids, cands) in enumerate(encoded):
            picked = logits[i][mx.array(cands)]
            (picked - mx.logsumexp(logits[i])).tolist()
        return time.perf_counter() - t0

    enqueue: dict[str, list[float]] = {}

    def queued(name: str, one_job: bool) -> Callable[[], float]:
        def run() -> float:
            rows = _rows(b, _prefix(b), s.score_rows)
            payloads = [{"rows": rows}] if one_job else [{"rows": [r]} for r in rows]
            out = _queue_run(b, w, payloads)
            enqueue.setdefault(name, []).append(out["enqueue_s"])
            return float(out["wall_s"])

        return run

    paths: dict[str, Callable[[], float]] = {
        "plain MLX ideal": ideal,
        f"one {s.score_rows}-row job": queued(f"one {s.score_rows}-row job", True),
        f"{s.score_rows} one-row jobs": queued(f"{s.score_rows} one-row jobs", False),
    }
    names = list(paths)
    walls: dict[str, list[float]] = {k: [] for k in names}
    for turn in range(s.score_reps + 1):
        for name in names[turn % len(names) :] + names[: turn % len(names)]:
            wall = paths[name]()
            if turn:
                walls[name].append(wall)
    rows_out = {}
    for name in names:
        ratios = [i / x for i, x in zip(walls["plain MLX ideal"], walls[name], strict=True)]
        rates = [s.score_rows / x for x in walls[name]]
        rows_out[name] = {
            "rows_s": statistics.median(rates),
            "rows_s_range": [min(rates), max(rates)],
            "x_ideal": statistics.median(ratios),
            "x_ideal_range": [min(ratios), max(ratios)],
            "enqueue_ms": 1000 * statistics.median(enqueue[name]) if name in enqueue else None,
        }
    return {"turns": s.score_reps, "rows": rows_out}


def redis_calls(conn: redis.Redis) -> dict[str, int]:
    """Calls per command since the server started (INFO commandstats); a private server counts only ours."""
    stats = conn.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}


def _engine_alone(b: Bench, table: dict[str, Any]) -> None:
    """One 64-row job through the engine, cold then warm (same prefix, new rows), phases timed."""
    s, engine = b.sizes, b.engine
    warm_up = _prefix(b)
    for _ in range(2):  # warm-up: the cold path, then the warm-cache path (its shapes) on one prefix
        engine.score(ScoreRequest.model_validate({"rows": _rows(b, warm_up, s.score_rows)}))
    cold_prefix = _prefix(b)
    for label in ("cold", "warm cache"):
        rows = _rows(b, cold_prefix, s.score_rows)
        request = ScoreRequest.model_validate({"rows": rows})
        with memory() as mem, phase_timers(SCORE_PHASES) as phases:
            t0 = time.perf_counter()
            prepared = engine.score_tokens(request)
            t1 = time.perf_counter()
            result = engine.score_many([prepared])[0]
            t2 = time.perf_counter()
        row = table[f"mlxq engine, one {s.score_rows}-row job ({label})"] = {
            "rows": len(rows),
            "wall_s": t2 - t0,
            "rows_s": len(rows) / (t2 - t0),
            "tokenize_s": t1 - t0,
            "engine_score_s": t2 - t1,
            "prompt_tokens": result.input_tokens,
            "cached_tokens": result.cached_tokens,
            "phases": phases,
            **mem_fields(mem["peak"], mem["active0"]),
        }
        if label == "cold":
            row["tokenize_alternatives_ms"] = _tokenize_alternatives(b, rows)


def _tokenize_alternatives(b: Bench, rows: list[dict[str, Any]]) -> dict[str, float]:
    """What tokenizing these rows costs done differently (the engine encodes prompt+candidate each time)."""
    tok = b.engine.tokenizer
    texts = [r["prompt"] + c for r in rows for c in ["", *r["candidates"]]]
    t0 = time.perf_counter()
    for r in rows:
        tok.encode(r["prompt"])
    t1 = time.perf_counter()
    tok.backend.encode_batch(texts, add_special_tokens=True)
    t2 = time.perf_counter()
    return {"each prompt once": 1000 * (t1 - t0), "all texts, one encode_batch call": 1000 * (t2 - t1)}


def _engine_from_ids(b: Bench, table: dict[str, Any]) -> None:
    """`score_many` on token ids (no tokenizer): rows whose own tokens start with distinct ids, against
    rows whose first own token is one of 8 (as rows opening with a few common words do). Cold prefixes."""
    s, engine = b.sizes, b.engine
    rng = random.Random(7)
    vocab = engine.model.args.vocab_size
    cands = list(range(10, 10 + s.score_candidates))

    def rows(first: Callable[[int], int]) -> list[tuple[list[int], list[int]]]:
        prefix = [rng.randrange(100, vocab) for _ in range(s.score_prefix)]
        own = [
            [first(i)] + [rng.randrange(100, vocab) for _ in range(s.score_own - 1)]
            for i in range(s.score_rows)
        ]
        return [(prefix + o, cands) for o in own]

    engine.score_many([rows(lambda i: 20 + i)])  # warm-up
    for label, first in (
        ("distinct first own token", lambda i: 20 + i),
        ("first own token one of 8", lambda i: 20 + i % 8),
    ):
        prepared = rows(first)
        with memory() as mem, phase_timers(SCORE_PHASES) as phases:
            t0 = time.perf_counter()
            result = engine.score_many([prepared])[0]
            dt = time.perf_counter() - t0
        table[f"diagnostic: engine.score_many from token ids, {label}"] = {
            "rows": len(prepared),
            "wall_s": dt,
            "rows_s": len(prepared) / dt,
            "engine_score_s": dt,
            "prompt_tokens": result.input_tokens,
            "cached_tokens": result.cached_tokens,
            "phases": phases,
            **mem_fields(mem["peak"], mem["active0"]),
        }


def queue_overhead(b: Bench) -> dict[str, Any]:
    """Many small score jobs through one burst worker on the tiny model: jobs/s and where time goes."""
    from mlxq.worker.engine.text.tokenizer import Tokenizer

    s = b.sizes
    maker = PromptMaker(Tokenizer.from_dir(b.tiny_path), seed=5)
    passes = [
        ("batched (default)", s.queue_jobs, {}, False),
        # The same batches in turn (claim, start, run, end; RQ's dequeue between batches): the A/B of
        # the score pipeline in one run.
        (
            "batched, score pipeline off (MLXQ_SCORE_PIPELINE=0)",
            s.queue_jobs,
            {"MLXQ_SCORE_PIPELINE": "0"},
            False,
        ),
        (
            "one job at a time (MLXQ_SCORE_BATCH_ROWS=0)",
            s.queue_jobs_unbatched,
            {"MLXQ_SCORE_BATCH_ROWS": "0"},
            False,
        ),
    ]
    if s.profile_jobs:
        passes.append(("batched, under cProfile", s.profile_jobs, {}, True))
    table: dict[str, Any] = {}
    profiles: dict[str, str] = {}
    for label, n, env, profile in [p for p in passes if p[1] > 0]:
        payloads = []
        for _ in range(n):
            prompt = maker.prompt(s.queue_prompt)
            payloads.append({"rows": [{"prompt": prompt, "candidates": maker.candidates(prompt, 2)}]})
        w = BenchWorker(
            b.tiny_path, b.redis_url, b.workdir, f"queue-{len(table)}", env=env, burst=True, cprofile=profile
        )
        job_ids = enqueue_many(w.queue, "jobs.score", payloads)
        calls0 = redis_calls(b.conn)
        with w:
            w.start()
            w.wait_ready()
            w.wait_exit(s.timeout_s)
            records = w.records()
        calls = {k: v - calls0.get(k, 0) for k, v in redis_calls(b.conn).items() if v > calls0.get(k, 0)}
        ready = next(r for r in records if r.get("event") == "ready")
        exit_ = next(r for r in records if r.get("event") == "exit")
        pipe = b.conn.pipeline(transaction=False)
        for j in job_ids:
            pipe.exists(f"mlxq:result:{j}")
        finished = sum(pipe.execute())
        # Steady state: the first job's tokenizing to the last job's end (start-up and teardown left out).
        first = min(r["start"] for r in records if r.get("fn") == "score_tokens_many")
        wall = max(r["start"] + r["s"] for r in records if r.get("fn") == "finish_streams") - first
        # The jobs' own calls: a worker's warm-up (before its first job) scores too.
        records = [r for r in records if "fn" not in r or r["start"] >= first]
        sums = {
            fn: sum(r["s"] for r in records if r.get("fn") == fn)
            for fn in ("score_many", "score_tokens_many", "finish_streams")
        }
        table[label] = {
            "jobs": n,
            "finished": finished,
            "wall_s": wall,
            "process_wall_s": exit_["start"] - ready["start"],
            "jobs_s": n / wall,
            "batches": sum(1 for r in records if r.get("fn") == "score_many"),
            "engine_score_s": sums["score_many"],
            "tokenize_s": sums["score_tokens_many"],
            "finish_streams_s": sums["finish_streams"],
            "share_outside_mlx": 1 - sums["score_many"] / wall,
            "ms_per_job_outside_mlx": 1000 * (wall - sums["score_many"]) / n,
            "load_s": ready["load_s"],
            "redis_commands_per_job": sum(calls.values()) / n,
            # Counted at the worker's client: a script call is one command sent, however many it runs.
            "redis_sent_per_job": sum(exit_.get("sent", {}).values()) / n,
            "redis_sent": dict(sorted(exit_.get("sent", {}).items(), key=lambda kv: -kv[1])),
            "score_phase_ms_per_batch": _phase_ms(exit_.get("stats", {})),
            "redis_commands": dict(sorted(calls.items(), key=lambda kv: -kv[1])),
            **worker_memory(records),
        }
        if w.profile_path is not None and w.profile_path.exists():
            profiles[label] = w.profile_path.read_text()
        cleanup(b.conn, job_ids, w.queue_name)
    return {"prompt_tokens": s.queue_prompt, "candidates": 2, "table": table, "cprofile": profiles}


def _phase_ms(stats: dict[str, str]) -> dict[str, float]:
    """The worker's own timing of its score batches (`worker/score_phases.py`): ms a batch per phase."""
    from mlxq.jobs.keys import SCORE_PHASES

    batches = int(stats.get("score_batches", 0))
    if not batches:
        return {}
    ms = {phase: 1000 * float(stats.get(f"score_{phase}_s", 0.0)) / batches for phase in SCORE_PHASES}
    # The overlapped view: claim, start, tokenize (of batches taken ahead) and end done on helper
    # threads, their CPU time (what they can still take from the batch: the interpreter lock is shared),
    # and how much was hidden (not waited for by the batches).
    aside = 1000 * float(stats.get("score_aside_s", 0.0)) / batches
    waited = 1000 * float(stats.get("score_waited_s", 0.0)) / batches
    aside_cpu = 1000 * float(stats.get("score_aside_cpu_s", 0.0)) / batches
    # The CPU time of each phase timed on its thread (the worker's thread clock): apart from its
    # waits on Redis, the cores and the interpreter lock, which this host's load moves.
    ms.update(
        {
            f"{phase} CPU": 1000 * float(stats[f"score_{phase}_cpu_s"]) / batches
            for phase in SCORE_PHASES
            if f"score_{phase}_cpu_s" in stats
        }
    )
    ms.update(
        {
            "aside (claim, start, tokenize, end)": aside,
            "CPU of aside (thread time)": aside_cpu,
            "hidden of aside": max(aside - waited, 0.0),
        }
    )
    return ms


@contextmanager
def _prefix_copied_per_row(model: Any) -> Iterator[None]:
    """Score rows the way they went before they read the prefix in place: each on its own copy of it
    (`kv_cache.broadcast_batch`, the way a model whose attention cannot read it in place still goes)."""
    cls = type(model)
    original = cls.reads_shared_prefix
    cls.reads_shared_prefix = property(lambda self: False)
    try:
        yield
    finally:
        cls.reads_shared_prefix = original


def _shared_prefix_turns(b: Bench) -> dict[str, Any]:
    """Issue 29's cascade target, ratios in one run: the plain-MLX ideal (prefix once, the suffixes in
    one batch on copies of it), the engine with rows reading the prefix in place, cold (a new prefix)
    and warm (the same prefix again, new rows: the prefix cache holds it, nothing of it is recomputed),
    and the engine with a copy of the prefix per row (the old way), in rotating turns on token ids.
    Each path's peak memory over what was resident, against the bound the target sets: the prefix's
    keys and values plus the rows' own."""
    s, engine = b.sizes, b.engine
    rng = random.Random(11)
    vocab = engine.model.args.vocab_size
    cands = list(range(10, 10 + s.score_candidates))
    reps = s.score_reps

    def fresh() -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(s.score_prefix)]

    def rows(prefix: list[int]) -> list[tuple[list[int], list[int]]]:
        return [
            (prefix + [rng.randrange(100, vocab) for _ in range(s.score_own)], cands)
            for _ in range(s.score_rows)
        ]

    def ideal(prefix: list[int]) -> None:
        own = [ids[len(prefix) :] for ids, _ in rows(prefix)]
        mx.eval(b.mlxlm.shared_prefix_logits(prefix, own)[:, mx.array(cands)])

    def engine_cold_and_warm(copy: bool) -> tuple[float, float, dict[str, float], dict[str, float]]:
        prefix = fresh()
        out = []
        for job in (rows(prefix), rows(prefix)):  # cold, then warm: the same prefix, new rows
            with memory() as mem:
                t0 = time.perf_counter()
                if copy:
                    with _prefix_copied_per_row(engine.model):
                        engine.score_many([job])
                else:
                    engine.score_many([job])
                dt = time.perf_counter() - t0
            out.append((dt, mem_fields(mem["peak"], mem["active0"])))
        return out[0][0], out[1][0], out[0][1], out[1][1]

    paths = ["ideal", "in place", "copy per row"]
    times: dict[str, list[float]] = {
        k: [] for k in ["ideal", "in place cold", "in place warm", "copy cold", "copy warm"]
    }
    mems: dict[str, dict[str, float]] = {}
    for turn in range(reps + 1):  # the first turn warms every path's shapes up and is dropped
        order = paths[turn % 3 :] + paths[: turn % 3]
        for path in order:
            if path == "ideal":
                prefix = fresh()
                with memory() as mem:
                    t0 = time.perf_counter()
                    ideal(prefix)
                    dt = time.perf_counter() - t0
                if turn:
                    times["ideal"].append(dt)
                    mems["ideal"] = mem_fields(mem["peak"], mem["active0"])
                continue
            copy = path == "copy per row"
            cold, warm, mem_cold, mem_warm = engine_cold_and_warm(copy)
            key = "copy" if copy else "in place"
            if turn:
                times[f"{key} cold"].append(cold)
                times[f"{key} warm"].append(warm)
                mems[f"{key} cold"], mems[f"{key} warm"] = mem_cold, mem_warm
    bound = (s.score_prefix + s.score_rows * s.score_own) * engine.kv_bytes_per_token
    out: dict[str, Any] = {"turns": reps, "kv_bound_mib": round(bound / 2**20, 1), "rows": {}}
    for key, ts in times.items():
        rates = [s.score_rows / t for t in ts]
        paired = [i / t for i, t in zip(times["ideal"], ts, strict=True)]  # over the same turn's ideal
        over = mems[key]["over_resident_mib"]
        out["rows"][key] = {
            "rows_s": statistics.median(rates),
            "rows_s_range": [min(rates), max(rates)],
            "x_ideal": statistics.median(paired),
            "x_ideal_range": [min(paired), max(paired)],
            **mems[key],
            "peak_over_kv_bound": over * 2**20 / bound,
        }
    return out
