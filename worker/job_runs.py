"""A started job as the worker and its components hand it around (`Run`, `Ended`), and what a caller
may send in the round trip that starts its jobs (`Rider`). Types only: starting and ending jobs is
`rq_batches.RqBatches`'s, and the modules that only hold runs (the job watch, the finalizer, the
results) need not import it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from rq import Queue
from rq.executions import Execution
from rq.job import Job


@dataclass(frozen=True)
class Run:
    """A started job: the job, the queue it came from, and RQ's record of this execution."""

    job: Job
    queue: Queue
    execution: Execution


Ended = tuple[Run, Any]  # a run that returned, with its return value


class Rider(Protocol):
    """Commands a caller sends in the round trip that starts its jobs (`RqBatches.start`), after the
    start's own. `queue` puts them on the pipeline, given the runs; it is called again should the round
    trip be sent again (Redis away, a server without the start script), so it must not count anything
    twice and its commands must be safe to repeat. `replied` is handed their replies once the start
    went through, an error reply as its exception (never raised there: the jobs did start)."""

    def queue(self, pipe: Any, runs: list[Run]) -> None: ...

    def replied(self, replies: list[Any]) -> None: ...
