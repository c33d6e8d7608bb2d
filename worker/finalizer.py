"""RQ's end of the jobs a generation batch finished, on a thread beside the decode loop.

A generation batch writes each finished job's result key and `done` event itself, in one transaction
per step (`stream_writer.finish_streams`): that is what readers wait on. RQ's own bookkeeping after it
(status, registries, RQ's copy of the result, dependents) costs several Redis round trips per job, about
4 ms on the 2-core CI box: with a backlog of jobs one ends every step or two, and the decode loop
would wait on them (CPU, 128 jobs through 32 rows: 796-800 tok/s inline, 880-964 here). The thread
runs RQ's own `_finalize_success` for each job in turn (its `_finalize_failure` if that raises), so
RQ's status of a job follows its result key by a few milliseconds, as documented. `close()` waits
until every job handed over has ended; a batch closes it before it returns to RQ's loop, so RQ never
sees a job of a finished batch still running. No job here has an RQ callback to run (RQ runs them
under a signal-based timeout, which only the main thread can set): the allowlist refuses jobs that
name one.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

from rq import Queue
from rq.job import Job

log = logging.getLogger(__name__)

Success = Callable[[Job, Queue, Any, Any], None]
Failure = Callable[[Job, Queue, Any, Any], None]


class Finalizer:
    """One thread ending jobs through RQ in the order they were handed over."""

    def __init__(self, success: Success, failure: Failure) -> None:
        self._success = success
        self._failure = failure
        self._jobs: queue.Queue[tuple[Job, Queue, Any, Any] | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def submit(self, job: Job, rq_queue: Queue, execution: Any, return_value: Any) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mlxq-finalizer", daemon=True)
            self._thread.start()
        self._jobs.put((job, rq_queue, execution, return_value))

    def close(self) -> None:
        """Wait until every job handed over has ended (finished, or failed with the reason), then stop
        the thread."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, rq_queue, execution, return_value = item
            try:
                self._success(job, rq_queue, execution, return_value)
            except BaseException:  # whatever it is, the thread must live on: `close` waits for it
                try:
                    self._failure(job, rq_queue, execution, sys.exc_info())
                except BaseException:  # Redis gone for good: RQ's abandoned-job handling takes the job
                    log.exception("could not end job=%s through RQ", job.id)
            finally:
                self._jobs.task_done()
        self._jobs.task_done()
