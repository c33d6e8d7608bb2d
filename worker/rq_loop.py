"""RQ's loop between jobs, as an mlxq worker runs it: the one module that reproduces RQ's writes there.

RQ 3.x (`BaseWorker.work`, read in RQ 3.0's `rq/worker/base.py`, `worker_classes.py`, `suspension.py`)
goes round `check_for_suspension`, `run_maintenance_tasks` when due, `dequeue_job_and_maintain_ttl`,
`execute_job` and `heartbeat()`, each writing on its own. From one job's end to the next one's start:

- `SimpleWorker.execute_job` ends with `set_state(IDLE)` (HSET `state`);
- `work` beats (`heartbeat()`: HSET `last_heartbeat`, EXPIRE of the worker key and of its executions
  key, TTL `worker_ttl + 60`, three round trips);
- `check_for_suspension` reads the flag `rq suspend` sets (`suspension.is_suspended`: a MULTI of a
  heartbeat and EXISTS `rq:suspended`); while it is set, a burst worker stops (`StopRequested`), any
  other sets its state `suspended`, polls every second, and sets the state back once resumed;
- `dequeue_job_and_maintain_ttl` sets `idle` again, beats before each blocking wait, calls
  `reorder_queues` once it took a job, and beats again before it returns.

A lone job paid those round trips between its end and the next one's start. `BetweenJobs` sends the
same values, written by RQ's own `set_state` and `heartbeat` (handed over by the worker's hooks), with
fewer round trips:

- `idle` (where `SimpleWorker.execute_job` would set `idle`): the state, a heartbeat, the worker's stats
  (`metrics.StatsPublisher`, mlxq's own) and the flag's read, in one MULTI as `is_suspended` sends its
  two;
- `heartbeat`: RQ's three commands in one round trip; a beat of RQ's loop (no pipeline) repeating the
  last one's TTL within `_BEAT_AGAIN_S` is skipped (`work`'s after the job, the dequeue's before its
  wait, right after `idle`), and so is the dequeue's beat once it took a job (`took_job`, from
  `reorder_queues`): the job's start beats a moment later in its own round trip
  (`rq_batches.RqBatches.start`), or `idle` does for a job that never starts. A beat that changes
  the TTL, or one given a pipeline (a job's start, RQ's `maintain_heartbeats` and `is_suspended`),
  always goes;
- `check_for_suspension`: skipped when `idle` read the flag unset a moment before; otherwise RQ's own
  check runs, so `rq suspend` is honoured as RQ honours it;
- `set_state`: the dequeue's `idle` right after `idle` wrote it is only remembered (RQ's `_state`, what
  `get_state` returns); any other state, or one given a pipeline, is RQ's write;
- `step`: any error ends RQ's `work` loop, and with it the process, its loaded model and warm cache;
  a step of the loop that meets Redis away, restarting or full (`REDIS_TRANSIENT`) is skipped with a
  warning instead (a full Redis is counted, `FullRedis`), and RQ's dequeue, which waits out a Redis
  that is away, comes next.

`tests/service/test_rq_loop.py` holds the worker's hash, its TTLs and `rq suspend` against RQ's own
`SimpleWorker` between the same two jobs.
"""

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
    """What `BetweenJobs` reads of the worker whose loop it serves (`MlxqWorker`): RQ's attributes, and
    its `set_state` and `heartbeat` hooks (which come back here)."""

    _state: str  # RQ's memory of the worker's state (`get_state`), set where its write is skipped

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
    """RQ's loop between jobs for one worker: which of RQ's writes go, together or not at all.

    The worker's RQ hooks (`set_state`, `heartbeat`, `check_for_suspension`, `reorder_queues`,
    `run_maintenance_tasks`) delegate here, handing over RQ's own method; `idle` is called at the end of
    the worker's `execute_job`. RQ's loop runs on the main thread; a state or beat given a pipeline (a
    job's start, which a helper thread may send, the job watch's beats) may come from any."""

    def __init__(self, worker: LoopWorker) -> None:
        self.worker = worker
        self._last_beat = (-1e9, 0)  # (monotonic time, TTL) of the last heartbeat
        self._idle_sent = False  # `idle` wrote the state `idle` the dequeue is about to write again
        self._not_suspended = False  # `idle` read the suspension flag the next check would read
        self._starting = False  # a job was just dequeued: its start beats (`took_job`)

    def set_state(self, rq_set_state: Callable[[str, Any], None], state: str, pipeline: Any = None) -> None:
        """RQ's `set_state`; on its own (no pipeline) a `step` of RQ's loop between jobs. The dequeue's
        `idle` right after `idle` wrote it is not written again."""
        idle_sent, self._idle_sent = self._idle_sent, False
        if pipeline is not None:
            rq_set_state(state, pipeline)
        elif idle_sent and state == WorkerStatus.IDLE:
            self.worker._state = state
        else:
            self.step(rq_set_state, state)

    def check_for_suspension(self, rq_check_for_suspension: Callable[[bool], None], burst: bool) -> None:
        """RQ's check for `rq suspend`, unless `idle` just read the flag unset in its round trip."""
        not_suspended, self._not_suspended = self._not_suspended, False
        if not not_suspended:
            self.step(rq_check_for_suspension, burst)

    def took_job(self) -> None:
        """RQ's dequeue took a job (it reorders its queues only then): the heartbeat it sends next is
        skipped (`heartbeat`), as the job's start beats a moment later, in the round trip that starts
        it (or `idle` does, for a job that never starts)."""
        self._starting = True

    def idle(self) -> None:
        """What RQ's loop writes between a job and its next dequeue, in one round trip where it sent five:
        the worker's state `idle` and its stats snapshot (at the job's end), RQ's heartbeat with the
        idle TTL (after the job, and again in its suspension check) and the suspension flag's read. The
        beat RQ's loop sends after the job is then a repeat (skipped, `heartbeat`), and so are the
        suspension check and the dequeue's `idle` that follow (`check_for_suspension`, `set_state`).
        A write Redis refuses (not one it is away for) is said in the log, and RQ's loop then sends
        its own."""
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
        RQ's dequeue sends once it took a job (`took_job`): the job's start beats a moment later, in
        the round trip that starts it. A beat that changes the TTL (a job's shorter one, RQ's idle one
        after it) always goes out, and a beat of RQ's own refreshes the worker's stats."""
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
