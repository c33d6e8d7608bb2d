"""RQ's loop between jobs, as `MlxqWorker` runs it: moved out of `rq_worker.py`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from time import monotonic
from typing import Any, Protocol

import redis
from rq.suspension import WORKERS_SUSPENDED
from rq.worker import WorkerStatus

from mlxq.jobs.transient import is_out_of_memory
from mlxq.worker.redis_full import FullRedis
from mlxq.worker.stream_writer import REDIS_TRANSIENT

log = logging.getLogger(__name__)

_BEAT_AGAIN_S = 1.0  # a heartbeat repeating the last one's TTL sooner than this is skipped (`heartbeat`)


class Stats(Protocol):
    """The worker's live statistics hash (`metrics.StatsPublisher`)."""

    def publish(self, ttl_s: int | None = None, pipeline: Any = None) -> None: ...

    def on_heartbeat(self, ttl_s: int, pipeline: Any = None) -> None: ...


class LoopWorker(Protocol):
    """What `BetweenJobs` reads of the worker whose loop it serves (`MlxqWorker`)."""

    _state: str  # RQ's memory of the worker's state (`get_state`)

    @property
    def connection(self) -> redis.Redis: ...

    @property
    def worker_ttl(self) -> int: ...

    @property
    def stats(self) -> Stats | None: ...

    @property
    def full(self) -> FullRedis: ...

    def set_state(self, state: str, pipeline: Any = None) -> None: ...

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None: ...


class BetweenJobs:
    """RQ's loop between jobs for `worker`; `MlxqWorker`'s RQ hooks hand it RQ's own step."""

    def __init__(self, worker: LoopWorker) -> None:
        self.worker = worker
        self._last_beat = (-1e9, 0)  # (monotonic time, TTL) of the last heartbeat
        self._idle_sent = False  # `_idle` wrote the state `idle` the dequeue is about to write again
        self._not_suspended = False  # `_idle` read the suspension flag the next check would read
        self._starting = False  # a job was just dequeued: its start beats (`reorder_queues`)

    def set_state(self, rq_set_state: Callable[[str, Any], None], state: str, pipeline: Any = None) -> None:
        """RQ's worker state; on its own (no pipeline) a step of RQ's loop between jobs (`_between_jobs`).
        The dequeue's `idle` right after `_idle` wrote it is not written again."""
        idle_sent, self._idle_sent = self._idle_sent, False
        if pipeline is not None:
            rq_set_state(state, pipeline)
        elif idle_sent and state == WorkerStatus.IDLE:
            self.worker._state = state
        else:
            self.step(rq_set_state, state)

    def check_for_suspension(self, rq_check_for_suspension: Callable[[bool], None], burst: bool) -> None:
        """RQ's check for `rq suspend`, unless `_idle` just read the flag unset in its round trip."""
        not_suspended, self._not_suspended = self._not_suspended, False
        if not not_suspended:
            self.step(rq_check_for_suspension, burst)

    def took_job(self) -> None:
        """RQ's reordering of its queues, called by its dequeue only when it took a job: the heartbeat
        RQ's dequeue sends next is skipped (`heartbeat`), as the job's start beats a moment later, in
        the round trip that starts it (or `_idle` does, for a job that never starts)."""
        self._starting = True

    def idle(self) -> None:
        """What RQ's loop writes between a job and its next dequeue, in one round trip where it sent five:
        the worker's state `idle` and its stats snapshot (at the job's end), RQ's heartbeat with the
        idle TTL (after the job, and again in its suspension check) and the suspension flag's read. The
        beat RQ's loop sends after the job is then a repeat (skipped, `heartbeat`), and so are the
        suspension check and the dequeue's `idle` that follow (`check_for_suspension`, `set_state`)."""
        replies: list[Any] = []
        w = self.worker

        def write() -> None:
            with w.connection.pipeline(transaction=True) as pipe:
                w.set_state(WorkerStatus.IDLE, pipe)
                w.heartbeat(pipeline=pipe)
                if w.stats is not None:
                    w.stats.publish(pipeline=pipe)
                pipe.exists(WORKERS_SUSPENDED)
                replies[:] = pipe.execute()

        try:
            written = self.step(write)
        except redis.RedisError as e:  # refused, not Redis away: RQ's loop then writes its own, as before
            log.warning("could not write the worker's state between jobs error=%s", e)
            written = False
        if written:
            self._idle_sent, self._not_suspended = True, not replies[-1]
        else:
            self._last_beat = (-1e9, 0)  # not beaten after all: RQ's next beat goes out

    def step(self, step: Callable[..., Any], *args: Any) -> bool:
        """A step of RQ's loop between jobs (the worker's state, its heartbeat, the suspension check,
        maintenance), where a Redis that is restarting would make RQ quit: the worker process would
        exit, its loaded model and warm cache with it. Here the step is skipped with a warning (False);
        the dequeue that follows waits for Redis with RQ's own backoff, and the next round does it again."""
        try:
            step(*args)
        except REDIS_TRANSIENT as e:
            if is_out_of_memory(e):
                self.worker.full.refused(e, step.__name__)
            else:
                log.warning("redis unreachable between jobs; skipped step=%s error=%s", step.__name__, e)
            return False
        return True

    def heartbeat(
        self,
        rq_heartbeat: Callable[[int | None, Any], None],
        timeout: int | None = None,
        pipeline: Any = None,
    ) -> None:
        """RQ's worker heartbeat (the worker key's `last_heartbeat` and TTL, its executions key's TTL)
        in one round trip instead of three. RQ's loop beats after each job and twice around each
        dequeue: a beat of its own (no pipeline) that gives the TTL the last beat gave, less than
        `_BEAT_AGAIN_S` after it, is skipped, so a lone job costs one beat, not three; so is the beat
        RQ's dequeue sends once it took a job (`reorder_queues`): the job's start beats a moment later,
        in the round trip that starts it. A beat that changes the TTL (a job's shorter one, RQ's idle
        one after it) always goes out."""
        w = self.worker
        ttl = timeout or w.worker_ttl + 60
        at = monotonic()
        starting, self._starting = self._starting, False
        if pipeline is None and starting:
            return
        if pipeline is None:
            last_at, last_ttl = self._last_beat
            if ttl == last_ttl and at - last_at < _BEAT_AGAIN_S:
                return
            with w.connection.pipeline(transaction=False) as pipe:
                rq_heartbeat(timeout, pipe)
                if not self.step(pipe.execute):
                    return
        else:
            rq_heartbeat(timeout, pipeline)
        if w.stats is not None:  # on RQ's own beats between jobs: a fresh snapshot of the stats
            w.stats.on_heartbeat(ttl, pipeline)
        self._last_beat = (at, ttl)
