"""Generation batches inside the RQ worker (`MlxqWorker` mixes `GenerationJobs` in).

After RQ hands over a generation job, the worker keeps a running `GenerationBatch`. Every
`admit_every` steps (after a look that found nothing to claim, not before `empty_wait_s` has passed:
each look is a Redis round trip, ~5% of a lone job's decode on a CPU when made every 4 steps), never
blocking, it claims more queued generation jobs up to the free slots
(once enough are free to prefill newcomers together: `JoinGate`; `JobClaimer`, the same Lua move as
score claims) and admits them while the others decode, their
streams opened together. Every step writes the due tokens of all streams in one pipeline, as the
batch's background work (on a GPU while the next decode step launches: `GenerationBatch.step`); the
jobs a step ends then write their results and `done` events in one transaction, and each ends through
RQ's own lifecycle on a thread beside the loop (`finalizer.py`).
Score jobs found in the queue at those points are claimed and scored right there, between two decode
steps: a decode stall of one score batch, so scoring never waits for a busy batch to drain and
streams pause a bounded time. The batch ends when its last job does (and RQ has ended them all);
then RQ's own loop dequeues again. A first SIGTERM stops the admissions and lets the batch finish; a
second one cancels every job in it.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rq import Queue
from rq.job import Job
from rq.timeouts import JobTimeoutException

from jobs import keys, parse_generate
from worker.engine.generation_batch import Finished, GenerationBatch
from worker.finalizer import Finalizer
from worker.job_claim import QueuedJob
from worker.job_watch import JobWatch
from worker.score_claim import ScorePicker
from worker.stream_writer import REDIS_TRANSIENT, StreamWriter, flush_streams

log = logging.getLogger(__name__)

_STATS_EVERY_S = 1.0  # how often a running generation batch republishes the worker's stats


@dataclass(frozen=True)
class BatchOptions:
    """How a worker batches generation jobs (see the module docstring)."""

    max_sequences: int = 1  # 1: one generation job at a time, no batching
    kv_budget_bytes: int = 0  # padded KV of the running batch; 0: no limit
    admit_every: int = 4  # decode steps between looks at the queue
    empty_wait_s: float = 0.05  # after a look that claimed nothing, the least time before the next
    min_join: int = 1  # free rows a batch at least half full waits for before claiming (`JoinGate`)


@dataclass
class _BatchJob:
    job: Job
    queue: Queue
    execution: Any
    writer: StreamWriter | None = None


class GenerationJobs:
    """The generation-batch half of `MlxqWorker`: a mixin whose methods use the worker's RQ lifecycle
    (`_start_allowed`, `_finalize_success`, ...), its executor, claimers and batch options."""

    @property
    def _batching(self) -> bool:
        return (
            self.batch_options.max_sequences > 1
            and self.job_claimer is not None
            and self.executor is not None
        )

    def _execute_generate_batch(self, first: Job, queue: Queue) -> None:
        """Run `first` in a generation batch that admits more queued jobs until the batch is empty."""
        assert self.executor is not None
        opts = self.batch_options
        batch = GenerationBatch(self.executor.engine, opts.max_sequences, opts.kv_budget_bytes)
        jobs: dict[str, _BatchJob] = {}
        finalizer = Finalizer(self._finalize_successes)
        gate = JoinGate(opts.min_join, opts.max_sequences)
        with JobWatch(self, [], self.heartbeat_s, self.cancel_poll_s) as watch:
            self._watch = watch
            last_stats = time.monotonic()
            next_look = 0.0  # when the queue may be looked at again (it was found empty before)
            try:
                self._admit(batch, jobs, [first], queue, watch)
                while len(batch):
                    if batch.steps % opts.admit_every == 0 and time.monotonic() >= next_look:
                        try:
                            if not self._claim_between_steps(batch, jobs, watch, gate):
                                next_look = time.monotonic() + opts.empty_wait_s
                        except REDIS_TRANSIENT as e:  # the running jobs go on; claimed ones return
                            log.warning("generation batch could not claim jobs error=%s", e)
                    flushed = _StreamFlush(self, jobs)
                    ended = [(jobs.pop(done.key), done) for done in batch.step(background=flushed)]
                    self._retire_all(ended, watch, finalizer)
                    batch.settle()  # the ended jobs' caches to the prefix cache, once their results are out
                    flushed.raise_error()
                    self.active_sequences = len(batch)
                    if time.monotonic() - last_stats >= _STATS_EVERY_S:
                        last_stats = time.monotonic()
                        self.publish_stats()
            except BaseException as e:  # as RQ's perform_job: whatever stops the loop fails what is left
                for done in batch.abort(e):
                    self._retire(jobs.pop(done.key), done, watch)
                raise
            finally:
                batch.close()  # no decode step launching when other work takes this thread
                finalizer.close()  # every job the batch ended has ended through RQ too
                self._watch = None
                self.active_sequences = 0

    def _claim_between_steps(
        self, batch: GenerationBatch, jobs: dict[str, _BatchJob], watch: JobWatch, gate: JoinGate
    ) -> bool:
        """Admit queued generation jobs into free slots (when `gate` opens); score queued score jobs
        right now. False when the queues were looked at and nothing was claimed."""
        assert self.job_claimer is not None
        if self._stop_requested or self._force_stop:
            return True
        if self.should_run_maintenance_tasks:  # a batch may run for hours: keep RQ's housekeeping going
            self.run_maintenance_tasks()
        found = False
        for queue in self.queues:
            score = ScorePicker(self.score_claimer.budget) if self.score_claimer is not None else None
            pick = _BatchPicker(gate.free_rows(batch), score)
            if pick.limit <= 0:
                return True
            claimed = self.job_claimer.claim(queue, pick, pick.limit)
            found = found or bool(claimed)
            scores = [job for job in claimed if job.func_name == keys.SCORE_FUNC]
            self._admit(
                batch, jobs, [job for job in claimed if job.func_name != keys.SCORE_FUNC], queue, watch
            )
            if claimed:
                log.info(
                    "generation batch claimed=%d scored=%d active=%d",
                    len(claimed) - len(scores),
                    len(scores),
                    len(batch),
                )
            if scores:
                batch.quiet()  # no decode step is launching while the score batch runs
                self._score_between_steps(scores, queue, watch)
        return found

    def _score_between_steps(self, scores: list[Job], queue: Queue, watch: JobWatch) -> None:
        runs = self._start_allowed(scores, queue)
        watch.add(runs)
        try:
            self._score_runs(runs, queue)
        finally:
            for job, _ in runs:
                watch.remove(job.id)

    def _admit(
        self,
        batch: GenerationBatch,
        jobs: dict[str, _BatchJob],
        claimed: list[Job],
        queue: Queue,
        watch: JobWatch,
    ) -> None:
        """Start generation jobs in the batch (their streams opened together); a bad one fails alone."""
        assert self.executor is not None
        runs = self._start_allowed(claimed, queue)
        if not runs:
            return
        started = [_BatchJob(job, queue, execution) for job, execution in runs]
        watch.add(runs)
        try:
            writers = self.executor.open_streams([entry.job for entry in started])
        except Exception:
            for entry in started:
                watch.remove(entry.job.id)
                self._finalize_failure(entry.job, queue, entry.execution, sys.exc_info())
            return
        for entry, writer in zip(started, writers, strict=True):
            entry.writer = writer
            try:
                request = parse_generate(entry.job.args[0])
                batch.admit(entry.job.id, request, writer, self._cancel_check(entry.job))
            except Exception:
                watch.remove(entry.job.id)
                self._finalize_failure(entry.job, queue, entry.execution, sys.exc_info())
                continue
            jobs[entry.job.id] = entry

    def _cancel_check(self, job: Job) -> Callable[[], bool]:
        """The job's cancel check; past its timeout it raises, as RQ's death penalty would."""
        timeout = int(job.timeout or self.default_job_timeout)
        deadline = time.monotonic() + timeout if timeout > 0 else float("inf")

        def cancelled() -> bool:
            if time.monotonic() > deadline:
                raise JobTimeoutException(f"Task exceeded maximum timeout value ({timeout} seconds)")
            return self.is_cancelled(job.id)

        return cancelled

    def _retire_all(
        self, ended: list[tuple[_BatchJob, Finished]], watch: JobWatch, finalizer: Finalizer
    ) -> None:
        """Finish the jobs one step ended: results and `done` events in one transaction, then each
        job through RQ on the finalizer's thread (see `finalizer.py`). Failed ones go one by one."""
        assert self.executor is not None
        ok = []
        for entry, done in ended:
            if done.error is None and done.result is not None and entry.writer is not None:
                ok.append((entry, entry.writer, done.result))
            else:
                self._retire(entry, done, watch)
        if not ok:
            return
        try:
            results = self.executor.finish_generates([(entry.job.id, w, result) for entry, w, result in ok])
        except Exception:
            for entry, _, _ in ok:
                watch.remove(entry.job.id)
                self._finalize_failure(entry.job, entry.queue, entry.execution, sys.exc_info())
            return
        for (entry, _, _), result in zip(ok, results, strict=True):
            watch.remove(entry.job.id)
            finalizer.submit(entry.job, entry.queue, entry.execution, result.model_dump(mode="json"))

    def _retire(self, entry: _BatchJob, done: Finished, watch: JobWatch) -> None:
        """Finish one job of the batch through RQ: its stream's end, result and status."""
        assert self.executor is not None
        job, queue, execution = entry.job, entry.queue, entry.execution
        watch.remove(job.id)
        if done.error is not None:
            e = done.error
            self._finalize_failure(job, queue, execution, (type(e), e, e.__traceback__))
            return
        assert done.result is not None and entry.writer is not None
        try:
            result = self.executor.finish_generate(job.id, entry.writer, done.result)
            self._finalize_success(job, queue, execution, result.model_dump(mode="json"))
        except Exception:
            self._finalize_failure(job, queue, execution, sys.exc_info())


class _StreamFlush:
    """One step's write of the batch's due stream tokens (`flush_streams`: one pipeline), run by the
    batch as background work (while the device finishes the step in flight, see `GenerationBatch.step`).
    An error is kept, not raised there: the loop raises it once the step's ended jobs are retired, so a failed
    write does not end the step's rows as a failed decode step would."""

    def __init__(self, worker: Any, jobs: dict[str, _BatchJob]) -> None:
        self.worker = worker
        self.jobs = jobs
        self.error: BaseException | None = None

    def __call__(self) -> None:
        writers = [j.writer for j in self.jobs.values() if j.writer is not None]
        try:
            flush_streams(self.worker.connection, writers, self.worker.stream_options)
        except BaseException as e:
            self.error = e

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error


class JoinGate:
    """How many free rows of a running batch to fill with queued generation jobs at an admission point.

    With `min_join` > 1 (`MLXQ_BATCH_MIN_JOIN`; default 1: fill at once) a batch at least half full waits
    until that many rows are free, so newcomers prefill together: on a GPU a prefill forward costs at
    least a decode step's launch whatever its rows, and rows freed one at a time by staggered departures
    otherwise cost one each. It never waits more than `patience` steps (long generations free rows
    rarely, and a free row is lost throughput), and a batch less than half full fills at once. Measured,
    it changes no throughput: 256 staggered jobs through 64 rows with `min_join` 8 on the CPU made 26
    prefill groups instead of 62 in the same prefill time, and on the H200 (2026-12-01, `9483f0f`) 43
    joins instead of 63 at 2,611 against 2,628 tok/s. Hence off by default."""

    def __init__(self, min_join: int, max_sequences: int, patience: int = 16) -> None:
        self.min_join = min_join
        self.max_sequences = max_sequences
        self.patience = patience
        self._free_since: int | None = None  # the step at which the rows free now started waiting

    def free_rows(self, batch: GenerationBatch) -> int:
        """The rows to fill now (0: wait)."""
        free = batch.free_slots
        if free <= 0:
            self._free_since = None
            return 0
        if self._free_since is None:
            self._free_since = batch.steps
        if (
            free >= self.min_join
            or 2 * len(batch) < self.max_sequences
            or batch.steps - self._free_since >= self.patience
        ):
            self._free_since = None
            return free
        return 0


class _BatchPicker:
    """Chooses queued jobs at a generation batch's admission point: generation jobs for its free
    slots, and score jobs within the score batch budget (scored between two decode steps)."""

    def __init__(self, free_slots: int, score: ScorePicker | None) -> None:
        self.free = max(0, free_slots)
        self.score = score
        self.limit = self.free + (score.jobs_left if score is not None else 0)

    def __call__(self, queued: QueuedJob) -> bool:
        if queued.func == keys.GENERATE_FUNC:
            if self.free <= 0:
                return False
            self.free -= 1
            return True
        return self.score is not None and self.score(queued)
