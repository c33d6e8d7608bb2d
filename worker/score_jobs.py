"""Score jobs: each one scored in a batch with the queued score jobs claimed beside it.

RQ hands the worker one score job; this claims more queued score jobs up to a row budget
(`ScoreClaimer`), starts them together, tokenizes every job's rows together, puts all rows in one prefix
tree (the engine computes each shared prefix once, across jobs) and ends each job on its own: a bad job
fails alone, its batch-mates go on. Pipelined (`MLXQ_SCORE_PIPELINE`, on by default), the next batch is
claimed, started and tokenized on a helper thread while one runs (`score_ahead.py`, with a tokenizer of
its own) and RQ's end of a batch is done on the finalizer's thread (`finalizer.py`), so that the queue's
round trips and the tokenizer overlap the model's work and batches follow one another without RQ's
dequeue between them; a cold stop puts the batch taken ahead back in its queue untouched. A generation
batch hands over the score jobs it claims between two decode steps (`score_between_steps`). With no
claimer (`MLXQ_SCORE_BATCH_ROWS=0`) a job is a batch of one.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from rq import Queue
from rq.job import Job
from rq.timeouts import JobTimeoutException

from mlxq.jobs import MAX_NESTING_DEPTH, parse_score
from mlxq.jobs.errors import InvalidRequest
from mlxq.jobs.schema import ScoreRequest, ScoreResult
from mlxq.worker.engine.score_requests import PreparedRow
from mlxq.worker.engine.text.tokenizer import Tokenizer
from mlxq.worker.finalizer import Finalizer
from mlxq.worker.job_deadline import JobDeadline
from mlxq.worker.job_host import JobHost
from mlxq.worker.job_results import JobResults
from mlxq.worker.job_runs import Ended, Run
from mlxq.worker.job_watch import JobWatch
from mlxq.worker.score_ahead import ScoreAhead, Taken
from mlxq.worker.score_claim import ClaimBudget, ScoreClaimer
from mlxq.worker.score_phases import ScorePhases
from mlxq.worker.stream_writer import REDIS_TRANSIENT

log = logging.getLogger(__name__)

Prepared = list[PreparedRow]  # one job's rows: tokens of candidates, continuations, windows, prompts


class ScoringEngine(Protocol):
    """What scoring needs of the engine: tokenizing (with its tokenizer or, on another thread, a clone
    of it) and scoring, and the seconds scoring spent in each of its parts so far (`score_seconds`:
    tree, forward, unembed, device_wait)."""

    score_seconds: dict[str, float]
    tokenizer: Tokenizer

    def score_tokens_many(
        self, requests: Sequence[ScoreRequest], tokenizer: Tokenizer | None = None
    ) -> list[list[PreparedRow] | InvalidRequest]: ...

    def score_many(
        self, jobs: list[list[PreparedRow]], interrupt: Callable[[], None] | None = None
    ) -> list[ScoreResult]: ...

    def start_shared_prefix(self, requests: Sequence[ScoreRequest]) -> int: ...


class ScoreJobs:
    """Runs score jobs in batches on the engine; built once per worker."""

    def __init__(
        self,
        engine: ScoringEngine,
        host: JobHost,
        results: JobResults,
        claimer: ScoreClaimer | None,
        max_depth: int = MAX_NESTING_DEPTH,
        pipelined: bool = True,
    ) -> None:
        self.engine = engine
        self.host = host
        self.results = results
        self.claimer = claimer
        self.pipelined = pipelined  # the next batch taken beside this one, RQ's end on a thread
        self.max_depth = max_depth  # a request's nesting, checked before it is validated
        self.phases = ScorePhases()  # where batches spend their time, for the worker's stats
        # The helper thread's tokenizer (`ScoreAhead`), cloned here, at the worker's start and on the
        # engine's thread: a large vocabulary takes a while to rebuild, which the first batch need not wait.
        self._aside_tokenizer = engine.tokenizer.clone() if claimer is not None and pipelined else None

    @property
    def budget(self) -> ClaimBudget | None:
        """How many score jobs a batch may claim (None: one job at a time)."""
        return self.claimer.budget if self.claimer is not None else None

    def run(self, first: Job, queue: Queue) -> None:
        """Score `first` together with the score jobs claimed from its queue; each job ends on its own.
        Pipelined (the default with a claimer), the next batch is claimed and started beside this one
        (`ScoreAhead`) and RQ's end of each batch goes to the finalizer's thread (`Finalizer`): batches
        follow one another without RQ's dequeue between them while score jobs are queued."""
        claimed: list[Job] = []
        if self.claimer is not None:
            try:
                with self.phases.timed("claim"):
                    claimed = self.claimer.claim(queue, rows_taken=_rows_of(first))
            except REDIS_TRANSIENT as e:  # Redis restarting: score `first` alone; the rest stay queued
                log.warning("score batch could not claim jobs error=%s", e)
        with self.phases.timed("start"):
            runs = self.host.start([first, *claimed], queue)
        if self.claimer is None or not self.pipelined:
            with self.host.watching(runs):
                self.score(runs)
            return
        self._run_pipelined(Taken(runs, {}, last=False), queue, self.claimer)

    def _run_pipelined(self, taken: Taken, queue: Queue, claimer: ScoreClaimer) -> None:
        """Score batch after batch: while one is scored, the next is taken (claimed, started and
        tokenized) on the helper thread. A stop request (warm shutdown) takes nothing more; what was
        taken is scored. A cold stop (`stopping_now`), or whatever else stops the loop, puts the jobs
        taken ahead and not scored back at the head of their queue untouched: they never ran, as RQ
        puts back a job it is handed to requeue. RQ's end of every batch is done before this returns to
        RQ's loop."""
        tokenizer = self._aside_tokenizer
        ahead = ScoreAhead(self.host, claimer, self.phases, lambda runs: self._prepare(runs, tokenizer))
        finalizer = Finalizer(self._end_aside)
        following: Future[Taken] | None = None
        with self.host.watching(taken.runs) as watch:
            try:
                while taken.runs and not self.host.stopping_now():
                    batch = taken
                    taken = Taken()
                    if not batch.last and not self.host.stopping():
                        following = ahead.take(queue, watch)
                    try:
                        self.score(batch.runs, batch.deadlines, watch, finalizer, batch.prepared)
                    finally:
                        if following is not None:
                            with self.phases.waiting():
                                taken = following.result()
                            following = None
                    self.host.housekeeping()
                    self.host.progress(0)  # the worker's stats (and score phases), now and then
            finally:
                try:
                    if following is not None:  # the stop broke in while this thread waited for it
                        taken = following.result()
                    for run in taken.runs:
                        watch.remove(run.job.id)
                    self.host.batches.requeue(taken.runs)
                except Exception:  # left started: abandoned-job recovery finds them when heartbeats lapse
                    log.exception("could not requeue the score batch taken ahead jobs=%d", len(taken.runs))
                ahead.close()
                with self.phases.waiting():
                    finalizer.close()  # every job scored here has ended through RQ too

    def score_between_steps(self, jobs: list[Job], queue: Queue, watch: JobWatch) -> None:
        """Score jobs a generation batch claimed, watched by that batch's watch while they run."""
        with self.phases.timed("start"):
            runs = self.host.start(jobs, queue)
        watch.add(runs)
        try:
            self.score(runs)
        finally:
            for run in runs:
                watch.remove(run.job.id)

    def score(
        self,
        runs: list[Run],
        deadlines: dict[str, JobDeadline] | None = None,
        watch: JobWatch | None = None,
        finalizer: Finalizer | None = None,
        prepared: list[Prepared | Exception] | None = None,
    ) -> None:
        """Score started jobs together; each one ends (finished or failed) through RQ, and leaves `watch`
        when it does. Each job's deadline runs from its start (`deadlines`, where it was taken ahead)
        or from here: tokenizing its rows counts, and it is checked before every forward. Their rows
        are tokenized here unless `prepared` (tokenized ahead, one entry a run) holds them. With a
        `finalizer`, RQ's end of the finished jobs is done on its thread, after their results and
        `done` events are written here."""
        deadlines = {run.job.id: (deadlines or {}).get(run.job.id) or JobDeadline.of(run.job) for run in runs}

        def fail(run: Run, exc_info: Any) -> None:
            if watch is not None:
                watch.remove(run.job.id)
            self.host.batches.fail(run, exc_info)

        ready: list[tuple[Run, Prepared]] = []
        if prepared is None:  # tokenized here, the batch's shared prefix started on the device first
            with self.phases.timed("tokenize"):
                prepared = self._prepare(runs, lead=True)
        for run, rows in zip(runs, prepared, strict=True):
            if not isinstance(rows, Exception) and deadlines[run.job.id].passed():
                rows = deadlines[run.job.id].exceeded()
            if isinstance(rows, Exception):  # a bad job fails alone; its batch-mates go on
                fail(run, (type(rows), rows, rows.__traceback__))
            else:
                ready.append((run, rows))
        if not ready:
            return
        with self.phases.timed("score"), self.phases.parts(self.engine.score_seconds):
            results, timed_out = self._score_together(ready, deadlines, fail)
            scored: list[tuple[Run, ScoreResult]] = []
            for i, (run, rows) in enumerate(ready):
                if i in timed_out:
                    continue
                try:
                    result = results.get(i)
                    if result is None:  # the batch failed: this job alone, still within its deadline
                        result = self.engine.score_many([rows], deadlines[run.job.id].check)[0]
                    scored.append((run, result))
                except Exception:
                    fail(run, sys.exc_info())
        try:  # every job's result and `done` in one go; a failed write fails them all (RQ may retry)
            with self.phases.timed("write"):
                values = self.results.finish_scores([(run.job, result) for run, result in scored])
        except Exception:
            for run, _ in scored:
                fail(run, sys.exc_info())
            return
        ended = [(run, value) for (run, _), value in zip(scored, values, strict=True)]  # as written
        if watch is not None:
            for run, _ in ended:
                watch.remove(run.job.id)  # no heartbeat may write its started entry back once it ends
        if finalizer is not None:
            finalizer.submit_many(ended)
        else:
            with self.phases.timed("end"):
                self.host.batches.succeed_many(ended)
        self.phases.batch_done(len(scored), sum(_rows_of(run.job) for run, _ in scored))

    def _end_aside(self, ended: list[Ended]) -> None:
        """RQ's end of finished jobs, on the finalizer's thread."""
        with self.phases.timed("end", aside=True):
            self.host.batches.succeed_many(ended)

    def _score_together(
        self,
        ready: list[tuple[Run, Prepared]],
        deadlines: dict[str, JobDeadline],
        fail: Callable[[Run, Any], None],
    ) -> tuple[dict[int, ScoreResult], set[int]]:
        """Score the jobs in one batch: their results by index in `ready`, and the indices of jobs that
        failed because their deadline passed meanwhile (each fails alone; the others are scored again
        without it, what was computed staying in the prefix cache). Should the batch fail otherwise,
        the jobs left have no result: the caller scores them one by one."""
        results: dict[int, ScoreResult] = {}
        timed_out: set[int] = set()
        left = list(range(len(ready)))
        while left:

            def interrupt() -> None:
                for i in left:
                    try:
                        deadlines[ready[i][0].job.id].check()
                    except JobTimeoutException as e:
                        raise _PastDeadline(i, e) from None

            try:
                done = self.engine.score_many([ready[i][1] for i in left], interrupt)
            except _PastDeadline as past:
                fail(ready[past.index][0], (type(past.error), past.error, past.error.__traceback__))
                left.remove(past.index)
                timed_out.add(past.index)
                continue
            except Exception:
                log.exception("score batch failed; scoring its jobs one by one jobs=%d", len(left))
                break
            results.update(zip(left, done, strict=True))
            break
        return results, timed_out

    def _prepare(
        self, runs: list[Run], tokenizer: Tokenizer | None = None, lead: bool = False
    ) -> list[Prepared | Exception]:
        """Each run's tokenized rows, or its own error (validation, limits, a bad candidate); with
        `tokenizer`, a clone of the engine's for a thread of its own (the engine's otherwise); with
        `lead` (on the engine's thread, the batch to be scored next), the prefix its first rows share
        is started on the device before the rest is tokenized (`Engine.start_shared_prefix`)."""
        try:
            return self._prepare_together([run.job.args[0] for run in runs], tokenizer, lead)
        except Exception:  # not a job's own error (those come back in its place): each job alone
            log.exception("preparing a score batch failed; preparing its jobs one by one jobs=%d", len(runs))
        out: list[Prepared | Exception] = []
        for run in runs:
            try:
                out.extend(self._prepare_together([run.job.args[0]], tokenizer))
            except Exception as e:
                out.append(e)
        return out

    def _prepare_together(
        self, payloads: list[Any], tokenizer: Tokenizer | None = None, lead: bool = False
    ) -> list[Prepared | Exception]:
        """Validate score jobs' payloads and tokenize their rows together; a bad job's own error stands
        in its place. `lead`: as `_prepare`."""
        parsed: list[ScoreRequest | Exception] = []
        for payload in payloads:
            try:
                parsed.append(parse_score(payload, self.max_depth))
            except Exception as e:
                parsed.append(e)
        requests = [p for p in parsed if isinstance(p, ScoreRequest)]
        if lead and requests:
            try:
                self.engine.start_shared_prefix(requests)
            except Exception:  # the batch computes the prefix itself, as it would have
                log.warning("could not start a score batch's shared prefix ahead", exc_info=True)
        prepared = iter(self.engine.score_tokens_many(requests, tokenizer))
        return [p if isinstance(p, Exception) else next(prepared) for p in parsed]


class _PastDeadline(Exception):
    """A job of a score batch is past its deadline (`error`): the batch stops for it to fail alone."""

    def __init__(self, index: int, error: JobTimeoutException) -> None:
        super().__init__(str(error))
        self.index = index
        self.error = error


def _rows_of(job: Job) -> int:
    payload = job.args[0]
    rows = payload.get("rows") if isinstance(payload, dict) else None
    return len(rows) if isinstance(rows, list) else 0
