"""The seam between the RQ worker and the components that run its jobs (generation and score batches).

`MlxqWorker` implements `JobHost`; `GenerationJobs` and `ScoreJobs` are built once by the service and
handed one. A component starts jobs, watches them while they run and ends them only through it, so RQ's
bookkeeping stays in `rq_worker.py`, `rq_loop.py` and `rq_batches.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Protocol

from rq import Queue
from rq.job import Job

from mlxq.worker.job_runs import Rider, Run
from mlxq.worker.job_watch import JobWatch
from mlxq.worker.rq_batches import RqBatches


class JobHost(Protocol):
    """What a job component may ask of the worker that runs it."""

    batches: RqBatches  # ends runs through RQ (one, or many in one transaction)

    @property
    def queues(self) -> list[Queue]:
        """The queues the worker serves, in priority order (where a batch claims more jobs)."""
        ...

    def start(self, jobs: list[Job], queue: Queue, riders: Sequence[Rider] = ()) -> list[Run]:
        """Start taken jobs through RQ; a job this worker must not run is failed with the reason and
        left out. The `riders`' commands for the started jobs go in the same round trip (`Rider`)."""
        ...

    def watching(self, runs: list[Run]) -> AbstractContextManager[JobWatch]:
        """Heartbeats and cancel polling for `runs` (and runs added later) while the block runs."""
        ...

    def is_cancelled(self, job_id: str) -> bool:
        """True once the job's cancel key was seen, or a second stop signal arrived."""
        ...

    def stopping(self) -> bool:
        """True once a stop was asked for: a running batch takes no more jobs."""
        ...

    def stopping_now(self) -> bool:
        """True once a second stop signal asked running jobs to end now (a cold stop): jobs taken and
        started but not yet run go back to their queue (`RqBatches.requeue`)."""
        ...

    def housekeeping(self) -> None:
        """RQ's registry maintenance, when it is due (a batch may run for hours)."""
        ...

    def progress(self, active_sequences: int) -> None:
        """A running generation batch's size now; the worker republishes its stats now and then."""
        ...
