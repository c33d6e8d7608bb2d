"""A background thread beside running jobs: heartbeats and cancel requests, never touching MLX.

A worker keeps one for its life (`MlxqWorker.watching`): its batches add their jobs and remove them as
they end, so a batch waits neither for a new thread to be scheduled nor for one to end."""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

import redis
from rq.job import Job

from mlxq.jobs import keys
from mlxq.worker.job_runs import Run
from mlxq.worker.stream_writer import REDIS_TRANSIENT

log = logging.getLogger(__name__)

_mget_refused = False  # this process's Redis user may not run MGET (said once, then EXISTS)


class Heartbeats(Protocol):
    connection: redis.Redis

    def maintain_heartbeats(self, job: Job, execution: Any) -> None: ...


class CancelKeys:
    """The cancel keys of jobs about to be watched, read in their start's round trip (a `Rider` of
    `RqBatches.start`) by the one MGET `JobWatch.add` would send alone after it: a job cancelled just
    before it started stops at its first check. Where MGET is refused (or fails), `found` stays None
    and `add` reads the keys itself."""

    def __init__(self) -> None:
        self.found: list[bool] | None = None  # whether each job's cancel key was set

    def queue(self, pipe: Any, runs: list[Run]) -> None:
        if not _mget_refused:
            pipe.mget([keys.cancel_key(run.job.id) for run in runs])

    def replied(self, replies: list[Any]) -> None:
        reply = replies[0] if replies else None
        self.found = [value is not None for value in reply] if isinstance(reply, list) else None


class JobWatch:
    """While jobs run: refresh their heartbeats every `beat_s`, poll their cancel keys every `poll_s`.

    The main thread reads `cancelled` between decode steps, so a cancel takes effect within one step
    of being seen, without a Redis round trip on the hot path. Runs may be added and removed while it
    watches (a generation batch admits and retires jobs between steps).
    """

    def __init__(self, worker: Heartbeats, runs: list[Run], beat_s: float, poll_s: float) -> None:
        self.worker = worker
        self.runs = {run.job.id: run for run in runs}  # by job id: a batch removes its jobs one by one
        self.beat_s = beat_s
        self.poll_s = poll_s
        self.cancelled: set[str] = set()
        self._lock = threading.Lock()  # guards `runs` against the thread iterating it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlxq-job-watch", daemon=True)

    def __enter__(self) -> JobWatch:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> JobWatch:
        """Check the cancel keys of the jobs given (a job cancelled just before it started stops at its
        first check), then watch on the thread."""
        try:
            self._poll_cancels()
        except REDIS_TRANSIENT as e:
            log.warning("job watch redis error=%s", e)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def job_ids(self) -> list[str]:
        return [run.job.id for run in self._snapshot()]

    def add(self, runs: list[Run], read: CancelKeys | None = None) -> None:
        """Watch more running jobs; their cancel keys are checked at once, together: as `read` found
        them in their start's round trip, else by a read of their own."""
        if not runs:
            return
        with self._lock:
            self.runs.update((run.job.id, run) for run in runs)
        if read is not None and read.found is not None:
            self._note_cancels(runs, read.found)
            return
        try:
            self._poll_cancels(runs)
        except REDIS_TRANSIENT as e:
            log.warning("job watch redis error=%s", e)

    def remove(self, job_id: str) -> None:
        """Stop watching a job that ended."""
        with self._lock:
            self.runs.pop(job_id, None)
        self.cancelled.discard(job_id)

    def clear(self) -> None:
        """Stop watching every job (a batch is over): none gets another heartbeat once this returns."""
        with self._lock:
            self.runs.clear()
        self.cancelled.clear()

    def _snapshot(self) -> list[Run]:
        with self._lock:
            return list(self.runs.values())

    def _poll_cancels(self, runs: list[Run] | None = None) -> None:
        runs = self._snapshot() if runs is None else runs
        if not runs:
            return
        self._note_cancels(runs, self._cancel_keys_set([keys.cancel_key(run.job.id) for run in runs]))

    def _note_cancels(self, runs: list[Run], hits: list[bool]) -> None:
        live = {run.job.id for run in self._snapshot()}  # a job removed meanwhile stays removed
        for run, hit in zip(runs, hits, strict=True):
            if hit and run.job.id in live and run.job.id not in self.cancelled:
                log.info("cancel requested job=%s", run.job.id)
                self.cancelled.add(run.job.id)

    def _cancel_keys_set(self, names: list[str]) -> list[bool]:
        """Which of these keys exist: one MGET for all (a pipeline of one EXISTS per job cost 64
        commands per poll in a full batch), or EXISTS where the Redis user may not run MGET (an ACL
        file from before MGET was needed; `deploy/redis/users.acl` grants it)."""
        global _mget_refused
        conn = self.worker.connection
        if not _mget_refused:
            try:
                return [value is not None for value in conn.mget(names)]
            except redis.exceptions.NoPermissionError:
                log.warning("the worker's Redis user may not run MGET: cancel keys polled with EXISTS")
                _mget_refused = True
        pipe = conn.pipeline(transaction=False)
        for name in names:
            pipe.exists(name)
        return [bool(n) for n in pipe.execute()]

    def _run(self) -> None:
        since_beat = 0.0
        failing = False  # the last tick met a Redis error (logged once per outage, not every tick)
        while not self._stop.wait(self.poll_s):
            try:
                self._poll_cancels()
                since_beat += self.poll_s
                if since_beat >= self.beat_s:
                    with self._lock:  # once `remove` returns, that job gets no more heartbeats
                        for run in self.runs.values():
                            self.worker.maintain_heartbeats(run.job, run.execution)
                    since_beat = 0.0  # only once beaten: a refused beat is tried again next tick
                if failing:
                    log.warning("job watch reaches redis again")
                    failing = False
            except REDIS_TRANSIENT as e:  # Redis restarting, failing over or full: the jobs go on
                if not failing:
                    log.warning("job watch redis error=%s", e)
                failing = True
            except Exception:  # a bug here must not kill the thread that keeps jobs alive
                log.exception("job watch failed a tick")
