"""Where score batches spend their time: each phase timed (`worker/score_phases.py`), published in the
worker's stats hash and shown by `mlxq status`; checked with a real worker in this process."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from mlxq.jobs import parse_score
from mlxq.jobs.keys import SCORE_PHASES
from mlxq.producer import Client, JobFailed
from mlxq.producer.status_report import WorkerHealth, _health_lines
from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.score_phases import ScorePhases
from mlxq.worker.service import WorkerService
from mlxq.worker.settings import WorkerSettings

PROMPT = "The capital of France is Paris. The capital of Spain is"


def test_each_phase_adds_its_time_also_when_it_raises() -> None:
    now = [0.0]
    phases = ScorePhases(clock=lambda: now[0])
    assert phases.fields() == {}  # nothing published before the first batch
    with phases.timed("tokenize"):
        now[0] += 0.25
    with pytest.raises(RuntimeError), phases.timed("write"):
        now[0] += 0.5
        raise RuntimeError("redis went away")
    with phases.timed("tokenize"):
        now[0] += 0.25
    phases.batch_done(jobs=3, rows=7)
    fields = phases.fields()
    assert fields["score_tokenize_s"] == "0.500000" and fields["score_write_s"] == "0.500000"
    assert fields["score_claim_s"] == "0.000000"
    assert (fields["score_batches"], fields["score_jobs"], fields["score_rows"]) == ("1", "3", "7")
    with pytest.raises(ValueError, match="unknown score phase 'sampling'"), phases.timed("sampling"):
        pass


def test_work_done_aside_counts_in_its_phase_and_aside_and_what_was_waited_for_apart() -> None:
    now, cpu = [0.0], [0.0]
    phases = ScorePhases(clock=lambda: now[0], cpu_clock=lambda: cpu[0])
    with phases.timed("claim", aside=True):
        now[0] += 0.25
        cpu[0] += 0.125  # the rest of it waited on Redis
    with phases.timed("claim"):  # the first batch's claim, on the main thread
        now[0] += 0.125
        cpu[0] += 0.0625
    with phases.timed("end", aside=True):
        now[0] += 0.5
        cpu[0] += 0.25
    with phases.waiting():
        now[0] += 0.0625
    phases.batch_done(jobs=2, rows=2)
    fields = phases.fields()
    assert (fields["score_claim_s"], fields["score_end_s"]) == ("0.375000", "0.500000")
    assert (fields["score_aside_s"], fields["score_waited_s"]) == ("0.750000", "0.062500")
    assert fields["score_aside_cpu_s"] == "0.375000"
    # each timed phase's CPU time, aside or not; none for a phase not timed here (the engine's parts)
    assert (fields["score_claim_cpu_s"], fields["score_end_cpu_s"]) == ("0.187500", "0.250000")
    assert "score_forward_cpu_s" not in fields and "score_write_cpu_s" not in fields


def test_a_workers_score_batches_are_timed_in_its_stats_and_status(
    model_dir: Path, redis_url: str, client: Client
) -> None:
    good = [client.submit_score([{"prompt": PROMPT, "candidates": [" the", " a"]}] * n) for n in (1, 2, 3)]
    bad = client.submit_score([{"prompt": "x", "candidates": [" Paris"]}])  # not one token: fails alone
    settings = WorkerSettings(  # type: ignore[call-arg]
        model=str(model_dir), redis_url=redis_url, queues=["default"], warm_up=False, _env_file=None
    )
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        service = WorkerService.start(settings, engine=Engine.load(str(model_dir), EngineOptions()))
        assert service.work(burst=True) == 0
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert [len(job.result(timeout=5).rows) for job in good] == [1, 2, 3]
    with pytest.raises(JobFailed):
        bad.result(timeout=5)

    stats = service.stats.latest  # the last snapshot the worker published
    assert stats["score_batches"] == "1"  # all four claimed together
    assert (stats["score_jobs"], stats["score_rows"]) == ("3", "6")  # the failed job is not counted
    seconds = {phase: float(stats[f"score_{phase}_s"]) for phase in SCORE_PHASES}
    assert all(seconds[p] > 0 for p in SCORE_PHASES), seconds  # the engine's parts too (tree, forward...)

    health = WorkerHealth.from_stats(stats)
    assert health.score_phase_s == pytest.approx(seconds)
    line = next(line for line in _health_lines(health) if line.startswith("score batches"))
    assert line.startswith("score batches: 1 (3 jobs, 6 rows)  ms a batch: claim ")
    assert all(f" {phase} " in f" {line} " for phase in SCORE_PHASES)
    # Pipelined (the default): the claim ahead (it found the queue empty) and RQ's end ran aside.
    aside, waited = float(stats["score_aside_s"]), float(stats["score_waited_s"])
    assert aside > 0 and waited >= 0 and (health.score_aside_s, health.score_waited_s) == (aside, waited)
    overlap = next(line for line in _health_lines(health) if line.startswith("score overlap"))
    said = f"score overlap: {1000 * aside:.2f} ms a batch of claim, start, tokenize and end"
    assert overlap.startswith(said)
    assert f"({1000 * float(stats['score_aside_cpu_s']):.2f} CPU)" in overlap
    assert f"{1000 * max(aside - waited, 0):.2f} hidden" in overlap


@pytest.mark.parametrize("sync", [False, True])
def test_the_engine_times_its_parts_of_scoring_with_or_without_waiting_for_each(
    model_dir: Path, sync: bool
) -> None:
    """The engine adds up its parts of a score batch (tree, forward, unembed, device_wait); with
    `sync_score_phases` each forward and head is waited for where it is built, so the forward's part
    holds its device time and the result is the same."""
    engine = Engine.load(str(model_dir), EngineOptions(sync_score_phases=sync))
    request = parse_score({"rows": [{"prompt": PROMPT, "candidates": [" the", " a"]}] * 2})
    (rows,) = engine.score_tokens_many([request])
    assert not isinstance(rows, Exception)
    before = dict(engine.score_seconds)
    (result,) = engine.score_many([rows])
    spent = {k: engine.score_seconds[k] - before[k] for k in before}
    assert set(spent) == {"tree", "forward", "unembed", "device_wait"}
    assert all(s > 0 for s in spent.values()), spent
    assert len(result.rows) == 2 and all(len(r.logits) == 2 for r in result.rows)
