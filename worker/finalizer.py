"""RQ's end of the jobs a batch finished, on a thread beside the batch's own work.

A generation batch writes each finished job's result key and `done` event itself, in one transaction
per step (`stream_writer.finish_streams`): that is what readers wait on. RQ's own bookkeeping after it
(status, registries, RQ's copy of the result, dependents) costs several Redis round trips per job:
with a backlog of jobs one ends every step or two, and the decode loop would wait on them. The thread
ends the jobs handed over since it last woke in one go (`RqBatches.succeed_many`: RQ's writes for
all of them in one transaction, a job failed with the reason if its end fails), so RQ's
status of a job follows its result key by a few milliseconds, as documented. The jobs a batch ends
with are ended on its own thread instead (`end_now`): nothing is left to overlap with them.
`close()` waits until every job handed over has ended; a batch closes it before it returns to RQ's
loop, so RQ never sees a job of a finished batch still running. Score batches hand over each
batch's finished jobs together (`submit_many`), so that RQ's end of one batch overlaps the next
batch. No job here has an RQ callback to run (RQ runs them under a signal-based timeout, which only
the main thread can set): the allowlist refuses jobs that name one.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from mlxq.worker.job_runs import Ended, Run

log = logging.getLogger(__name__)


class Finalizer:
    """One thread ending jobs through RQ in the order they were handed over: each time it wakes, every
    job handed over since in one call of `end` (`RqBatches.succeed_many`, one transaction
    for them all), so a step that ends 64 jobs costs RQ a few round trips, not four per job."""

    def __init__(self, end: Callable[[list[Ended]], None]) -> None:
        self._end = end
        self._jobs: queue.Queue[list[Ended] | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def submit(self, run: Run, return_value: Any) -> None:
        self.submit_many([(run, return_value)])

    def submit_many(self, ended: list[Ended]) -> None:
        """Hand over jobs that end together (the thread never wakes between them)."""
        if not ended:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mlxq-finalizer", daemon=True)
            self._thread.start()
        self._jobs.put(list(ended))

    def end_now(self, ended: list[Ended]) -> None:
        """End jobs on the caller's thread, after every job handed over before them: a batch's last
        jobs, which nothing is left to overlap with (the batch would only wait for the thread, and
        start one for them)."""
        self.close()
        if ended:
            self._end_safely(ended)

    def close(self) -> None:
        """Wait until every job handed over has ended (finished, or failed with the reason), then stop
        the thread."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        stop = False
        while not stop:
            batch: list[Ended] = []
            item = self._jobs.get()
            while item is not None:
                batch.extend(item)
                try:
                    item = self._jobs.get_nowait()
                except queue.Empty:
                    break
            stop = item is None
            if batch:
                self._end_safely(batch)

    def _end_safely(self, batch: list[Ended]) -> None:
        try:
            self._end(batch)
        except BaseException:  # whatever it is, the thread must live on: `close` waits for it
            log.exception("could not end jobs through RQ jobs=%s", ",".join(run.job.id for run, _ in batch))
