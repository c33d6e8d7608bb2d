"""Taking the next score batch on a helper thread while the current one runs (`ScoreJobs`' pipeline).

Much of a batch of one-row score jobs' host time goes to the queue's work (claiming the queued jobs,
starting them in RQ, ending them) and to tokenizing, none of which needs the model. While one batch is
scored and written on the main thread, this thread claims the next batch from the same queue
(`ScoreClaimer.claim_batch`), starts it in RQ at once (`JobHost.start`: status `started`, the started
registry with its heartbeat TTL, the execution record), hands its runs to the batch's `JobWatch`, which
keeps their heartbeats and polls their cancel keys while they wait, and then validates and tokenizes
their rows (`prepare`), so that the main thread runs only the engine and mlxq's writes. Tokenizing here
uses a tokenizer of its own (`Tokenizer.clone`, handed in by `ScoreJobs`): the engine's is used by the
main thread meanwhile, and its backend's special-token switch (`Tokenizer._encode_split`) and its
memories of recent encodings are state two threads must not change under each other. The tokenizer's
batch calls release the interpreter lock, so much of it runs beside the batch's own Python.

So a job is never held claimed but not started longer than from its claim to the start script's call
right after it (were the worker killed between the two, the job sits in RQ's intermediate list, where
maintenance puts it back at the head of its queue, `MlxqWorker._requeue_stuck`); once started, a killed
worker's job is found when its heartbeat lapses, as any running job is (`Maintenance`), and a cold stop
(`JobHost.stopping_now`) puts a batch taken ahead back at the head of its queue untouched
(`RqBatches.requeue`).

Nothing is taken ahead when a queue served before this one has jobs waiting (RQ's dequeue would take
those first) or workers are suspended (`rq suspend`: RQ's loop takes no job then), and the batch taken
ahead is the last before RQ's dequeue when the claim passed over a queued job (`claim_batch`), so no
job waits behind an endless run of score batches.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rq import Queue
from rq.suspension import WORKERS_SUSPENDED

from mlxq.worker.job_deadline import JobDeadline
from mlxq.worker.job_host import JobHost
from mlxq.worker.job_runs import Run
from mlxq.worker.job_watch import JobWatch
from mlxq.worker.score_claim import ScoreClaimer
from mlxq.worker.score_phases import ScorePhases
from mlxq.worker.stream_writer import REDIS_TRANSIENT

log = logging.getLogger(__name__)


Prepare = Callable[[list[Run]], list[Any]]  # each run's tokenized rows, or its own error


@dataclass
class Taken:
    """A batch taken ahead: its started runs, each job's deadline (from its start), whether the
    worker goes back to RQ's dequeue after it (`last`), and each run's tokenized rows or error
    (`prepared`; None: not tokenized yet)."""

    runs: list[Run] = field(default_factory=list)
    deadlines: dict[str, JobDeadline] = field(default_factory=dict)
    last: bool = True
    prepared: list[Any] | None = None


class ScoreAhead:
    """One helper thread that claims, starts and tokenizes the next score batch (`take`)."""

    def __init__(self, host: JobHost, claimer: ScoreClaimer, phases: ScorePhases, prepare: Prepare) -> None:
        self.host = host
        self.claimer = claimer
        self.phases = phases
        self.prepare = prepare  # validates and tokenizes runs, with this thread's own tokenizer
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlxq-score-ahead")

    def take(self, queue: Queue, watch: JobWatch) -> Future[Taken]:
        """Claim, start and tokenize the next batch from `queue` on the thread; its runs join `watch`
        as soon as they are started."""
        return self._pool.submit(self._take, queue, watch)

    def close(self) -> None:
        """Wait for a take under way, then stop the thread."""
        self._pool.shutdown(wait=True)

    def _take(self, queue: Queue, watch: JobWatch) -> Taken:
        try:
            if self._stand_back(queue):
                return Taken()
            with self.phases.timed("claim", aside=True):
                jobs, passed_over = self.claimer.claim_batch(queue)
        except REDIS_TRANSIENT as e:  # Redis restarting: nothing taken; RQ's dequeue waits it out
            log.warning("score batch could not claim jobs ahead error=%s", e)
            return Taken()
        if not jobs:
            return Taken()
        with self.phases.timed("start", aside=True):
            runs = self.host.start(jobs, queue)
        deadlines = {run.job.id: JobDeadline.of(run.job) for run in runs}  # from its start, as RQ's
        watch.add(runs)
        prepared = None
        try:
            with self.phases.timed("tokenize", aside=True):
                prepared = self.prepare(runs)
        except Exception:  # not a job's own error (those come back in its place): the main thread tries
            log.exception("tokenizing a score batch ahead failed; the batch is tokenized in turn")
        return Taken(runs, deadlines, last=passed_over, prepared=prepared)

    def _stand_back(self, queue: Queue) -> bool:
        """Whether workers are suspended or a queue the worker serves before `queue` has jobs waiting
        (one round trip)."""
        pipe = queue.connection.pipeline(transaction=False)
        pipe.exists(WORKERS_SUSPENDED)
        for q in self.host.queues:
            if q.name == queue.name:
                break
            pipe.llen(q.key)
        return any(pipe.execute())
