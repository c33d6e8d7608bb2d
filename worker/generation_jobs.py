"""Generation jobs: each one runs in a continuous batch that admits queued generation jobs as it goes.

After RQ hands over a generation job, `GenerationJobs.run` keeps a running `GenerationBatch` (a lone job
is a batch of one). Every `admit_every` steps (after a look that found nothing to claim, not before
`empty_wait_s` has passed: each look is a Redis round trip), never blocking, it claims more queued
generation jobs up to the free slots (once enough are free to prefill newcomers together: `JoinGate`;
`JobClaimer`, the same Lua move as score claims) and admits them while the others decode, their
streams opened together. Every step writes the due tokens of all streams in one pipeline, as the
batch's background work (on a GPU while the next decode step launches: `GenerationBatch.step`); the
jobs a step ends then write their results and `done` events in one transaction, and each ends through
RQ's own lifecycle on a thread beside the loop (`finalizer.py`).
Score jobs found in the queue at those points are claimed and scored right there, between two decode
steps (`ScoreJobs.score_between_steps`): a decode stall of one score batch, so scoring never waits for a
busy batch to drain and streams pause a bounded time. The batch ends when its last job does (and RQ
has ended them all); then RQ's own loop dequeues again. A first SIGTERM stops the admissions and lets
the batch finish; a second one cancels every job in it.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from rq import Queue
from rq.job import Job

from mlxq.jobs import MAX_NESTING_DEPTH, keys, parse_generate
from mlxq.worker.engine import Engine
from mlxq.worker.engine.generation_batch import Finished, GenerationBatch
from mlxq.worker.finalizer import Finalizer
from mlxq.worker.job_claim import JobClaimer, QueuedJob, QueueHeads
from mlxq.worker.job_deadline import JobDeadline
from mlxq.worker.job_host import JobHost
from mlxq.worker.job_results import JobResults
from mlxq.worker.job_runs import Ended, Run
from mlxq.worker.job_watch import CancelKeys, JobWatch
from mlxq.worker.score_claim import ScorePicker
from mlxq.worker.score_jobs import ScoreJobs
from mlxq.worker.stream_writer import REDIS_TRANSIENT, StreamOptions, StreamWriter, flush_streams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchOptions:
    """How a worker batches generation jobs (see the module docstring)."""

    max_sequences: int = 8  # 1: one generation job at a time
    kv_budget_bytes: int = 0  # padded KV of the running batch; 0: no limit
    admit_every: int = 4  # decode steps between looks at the queue
    empty_wait_s: float = 0.05  # after a look that claimed nothing, the least time before the next
    min_join: int = 1  # free rows a batch at least half full waits for before claiming (`JoinGate`)


@dataclass
class _BatchJob:
    run: Run
    writer: StreamWriter | None = None


class GenerationJobs:
    """Runs generation jobs in continuous batches on the engine; built once per worker."""

    def __init__(
        self,
        engine: Engine,
        host: JobHost,
        results: JobResults,
        scores: ScoreJobs,
        claimer: JobClaimer,
        options: BatchOptions,
        max_depth: int = MAX_NESTING_DEPTH,
    ) -> None:
        self.engine = engine
        self.host = host
        self.results = results
        self.scores = scores
        self.claimer = claimer
        self.options = options
        self.max_depth = max_depth  # a request's nesting, checked before it is validated

    def run(self, first: Job, queue: Queue) -> None:
        """Run `first` in a generation batch that admits more queued jobs until the batch is empty."""
        opts = self.options
        batch = GenerationBatch(self.engine, opts.max_sequences, opts.kv_budget_bytes)
        jobs: dict[str, _BatchJob] = {}
        finalizer = Finalizer(self.host.batches.succeed_many)
        gate = JoinGate(opts.min_join, opts.max_sequences)
        with self.host.watching([]) as watch:
            next_look = 0.0  # when the queue may be looked at again (it was found empty before)
            try:
                heads = self._admit(batch, jobs, [first], queue, watch, look=True)
                while len(batch):
                    if batch.steps % opts.admit_every == 0 and time.monotonic() >= next_look:
                        try:
                            if not self._claim_between_steps(batch, jobs, watch, gate, heads):
                                next_look = time.monotonic() + opts.empty_wait_s
                        except REDIS_TRANSIENT as e:  # the running jobs go on; claimed ones return
                            log.warning("generation batch could not claim jobs error=%s", e)
                        heads = None  # read once, for the first look
                    flushed = _StreamFlush(self.results.conn, self.results.options, jobs)
                    ended = [(jobs.pop(done.key), done) for done in batch.step(background=flushed)]
                    self._retire_all(ended, watch, finalizer, last=not len(batch))
                    batch.settle()  # the ended jobs' caches to the prefix cache, once their results are out
                    flushed.raise_error()
                    self.host.progress(len(batch))
            except BaseException as e:  # as RQ's perform_job: whatever stops the loop fails what is left
                for done in batch.abort(e):
                    self._retire(jobs.pop(done.key), done, watch)
                raise
            finally:
                batch.close()  # no decode step launching when other work takes this thread
                finalizer.close()  # every job the batch ended has ended through RQ too
                self.host.progress(0)

    def _claim_between_steps(
        self,
        batch: GenerationBatch,
        jobs: dict[str, _BatchJob],
        watch: JobWatch,
        gate: JoinGate,
        heads: QueueHeads | None = None,
    ) -> bool:
        """Admit queued generation jobs into free slots (when `gate` opens); score queued score jobs
        right now. False when the queues were looked at and nothing was claimed. `heads`: the queues'
        first ids as read in the first job's start, where this look need not read them again."""
        if self.host.stopping():
            return True
        self.host.housekeeping()
        found = False
        for queue in self.host.queues:
            budget = self.scores.budget
            pick = _BatchPicker(gate.free_rows(batch), ScorePicker(budget) if budget is not None else None)
            if pick.limit <= 0:
                return True
            head = heads.ids.get(queue.name) if heads is not None else None
            claimed = self.claimer.claim(queue, pick, pick.limit, head)
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
                self.scores.score_between_steps(scores, queue, watch)
        return found

    def _admit(
        self,
        batch: GenerationBatch,
        jobs: dict[str, _BatchJob],
        claimed: list[Job],
        queue: Queue,
        watch: JobWatch,
        look: bool = False,
    ) -> QueueHeads | None:
        """Start generation jobs in the batch; a bad one fails alone. What each job needs before its
        first forward rides in the round trip that starts them (`Rider`): its stream's opening, its
        cancel key and, with `look`, the queues' heads for the batch's first look at them (returned,
        None where nothing started)."""
        opening = self.results.opening()
        cancels = CancelKeys()
        heads = self.claimer.heads(self.host.queues) if look else None
        runs = self.host.start(claimed, queue, [opening, cancels, *([heads] if heads is not None else [])])
        if not runs:
            return None
        deadlines = [JobDeadline.of(run.job) for run in runs]  # from now: admitting them counts
        watch.add(runs, cancels)
        try:
            writers = opening.writers()
        except Exception:
            for run in runs:
                self._fail(run, watch, sys.exc_info())
            return heads
        for run, writer, deadline in zip(runs, writers, deadlines, strict=True):
            try:
                request = parse_generate(run.job.args[0], self.max_depth)
                batch.admit(run.job.id, request, writer, self._cancel_check(run.job, deadline))
            except Exception:
                self._fail(run, watch, sys.exc_info())
                continue
            jobs[run.job.id] = _BatchJob(run, writer)
        return heads

    def _cancel_check(self, job: Job, deadline: JobDeadline) -> Callable[[], bool]:
        """The job's cancel check; past its deadline it raises, as RQ's death penalty would. The batch
        calls it after admitting the job, between prefill chunks and forwards, and between tokens."""

        def cancelled() -> bool:
            deadline.check()
            return self.host.is_cancelled(job.id)

        return cancelled

    def _retire_all(
        self, ended: list[tuple[_BatchJob, Finished]], watch: JobWatch, finalizer: Finalizer, last: bool
    ) -> None:
        """Finish the jobs one step ended: results and `done` events in one transaction, then each
        job through RQ on the finalizer's thread (see `finalizer.py`), or on this one where the batch
        ends with them (`last`). Failed ones go one by one."""
        ok = []
        for entry, done in ended:
            if done.error is None and done.result is not None and entry.writer is not None:
                ok.append((entry, entry.writer, done.result))
            else:
                self._retire(entry, done, watch)
        if not ok:
            return
        try:
            results = self.results.finish_generates([(e.run.job.id, w, result) for e, w, result in ok])
        except Exception:
            for entry, _, _ in ok:
                self._fail(entry.run, watch, sys.exc_info())
            return
        returned: list[Ended] = []
        for (entry, _, _), result in zip(ok, results, strict=True):
            watch.remove(entry.run.job.id)
            returned.append((entry.run, result.model_dump(mode="json")))
        if last:
            finalizer.end_now(returned)
        else:
            finalizer.submit_many(returned)

    def _retire(self, entry: _BatchJob, done: Finished, watch: JobWatch) -> None:
        """Finish one job of the batch through RQ: its stream's end, result and status."""
        run = entry.run
        if done.error is not None:
            self._fail(run, watch, (type(done.error), done.error, done.error.__traceback__))
            return
        watch.remove(run.job.id)
        assert done.result is not None and entry.writer is not None
        try:
            (result,) = self.results.finish_generates([(run.job.id, entry.writer, done.result)])
            self.host.batches.succeed(run, result.model_dump(mode="json"))
        except Exception:
            self._fail(run, watch, sys.exc_info())

    def _fail(self, run: Run, watch: JobWatch, exc_info: Any) -> None:
        """End a job of the batch as failed through RQ; nothing of it stays behind in the worker."""
        watch.remove(run.job.id)
        self.results.forget(run.job.id)
        self.host.batches.fail(run, exc_info)


class _StreamFlush:
    """One step's write of the batch's due stream tokens (`flush_streams`: one pipeline), run by the
    batch as background work (while the device finishes the step in flight, see `GenerationBatch.step`).
    An error is kept, not raised there: the loop raises it once the step's ended jobs are retired, so a failed
    write does not end the step's rows as a failed decode step would."""

    def __init__(self, conn: redis.Redis, options: StreamOptions, jobs: dict[str, _BatchJob]) -> None:
        self.conn = conn
        self.options = options
        self.jobs = jobs
        self.error: BaseException | None = None

    def __call__(self) -> None:
        writers = [j.writer for j in self.jobs.values() if j.writer is not None]
        try:
            flush_streams(self.conn, writers, self.options)
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
    rarely, and a free row is lost throughput), and a batch less than half full fills at once. It made
    fewer prefill groups in the same prefill time and changed no throughput where it was measured,
    hence off by default."""

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
