"""Writes one job's events to its Redis stream, in small batches, exactly once.

Entries get explicit, increasing ids (`<ms>-<seq>`) chosen here before the write, so a write retried
after a lost reply is refused by Redis as a duplicate instead of being appended twice: nothing streamed
is emitted twice. An id's `<ms>` is the time the entry was made (as Redis' own ids would say, so
`XRANGE` by time and latency read from ids work), never below the stream's last id: a clock that steps
back, or several entries in one millisecond, count up `<seq>` instead.
Every flush is one pipeline: `XADD ... MAXLEN ~ N`, and `EXPIRE` after it (it does nothing on a key
that does not exist yet) when the stream's TTL was last set long enough ago (`_EXPIRE_EVERY_S`, or a
quarter of the TTL): XADD keeps a key's TTL, so refreshing it on every flush only doubled the commands.
The last write of a job (`done` or `error`) always sets it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

import redis
from tenacity import RetryCallState, Retrying, retry_if_exception, wait_exponential

from mlxq.jobs import keys
from mlxq.jobs.replication import NotReplicated, Replicas
from mlxq.jobs.schema import (
    DoneEvent,
    ErrorEvent,
    GeneratedLogprob,
    GenerateResult,
    RestartEvent,
    ScoreResult,
    TokenEvent,
)
from mlxq.jobs.transient import WORKER_TRANSIENT_ERRORS, is_out_of_memory, is_worker_transient
from mlxq.worker.redis_full import FullRedis

log = logging.getLogger(__name__)

REDIS_TRANSIENT = WORKER_TRANSIENT_ERRORS
P = ParamSpec("P")
T = TypeVar("T")

# How often a stream being written refreshes its TTL (at most; a quarter of a short TTL).
_EXPIRE_EVERY_S = 60.0


@dataclass(frozen=True)
class StreamOptions:
    maxlen: int = 10_000
    ttl_s: int = 3600
    result_ttl_s: int = 86_400
    flush_tokens: int = 8
    flush_ms: float = 20.0
    retry_attempts: int = 8
    retry_max_wait_s: float = 5.0
    full_wait_s: float | None = None  # how long a write waits for a full Redis; None: until it frees
    full: FullRedis = field(default_factory=FullRedis, compare=False, repr=False)  # shared by the process
    replication: Replicas | None = field(default=None, compare=False, repr=False)  # writes wait for them


class retrying:  # lower case: used as a function, `retrying(options)(fn, *args)`
    """The worker's policy for a Redis write: bounded retries with exponential backoff for Redis away
    (a restart, a failover), and waiting, backed off the same way, while Redis is full (OOM replies)
    for `full_wait_s` or until memory frees: the jobs are kept, never failed for it (`FullRedis`)."""

    def __init__(self, options: StreamOptions) -> None:
        self.options = options
        self._retrying = Retrying(
            retry=retry_if_exception(is_worker_transient),
            stop=self._stop,
            wait=wait_exponential(multiplier=0.05, max=options.retry_max_wait_s),
            reraise=True,
            before_sleep=self._before_sleep,
        )

    def __call__(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        replication = self.options.replication
        if replication is None or replication.floor <= 0:
            result = self._retrying(fn, *args, **kwargs)
        else:
            result = self._replicated(replication, fn, *args, **kwargs)
        self.options.full.accepted()
        return result

    def _replicated(self, replication: Replicas, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn`, then WAIT for the replicas; a shortfall writes again (as after a lost reply), so after a
        failover the writes reach the new primary. Should no replica confirm within the tries, the
        worker goes on (the writes are on the primary): a replica outage must not fail jobs."""
        done: list[T] = []

        def durably() -> T:
            out = fn(*args, **kwargs)
            done[:] = [out]
            replication.confirm()
            return out

        try:
            return self._retrying(durably)
        except NotReplicated as e:
            if not done:
                raise
            log.warning("writes not confirmed by a replica; going on error=%s", e)
            return done[0]

    def _stop(self, state: RetryCallState) -> bool:
        error = state.outcome.exception() if state.outcome else None
        if error is not None and is_out_of_memory(error):
            limit = self.options.full_wait_s
            return limit is not None and (state.seconds_since_start or 0.0) >= limit
        return state.attempt_number >= self.options.retry_attempts

    def _before_sleep(self, state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome else None
        if error is not None and is_out_of_memory(error):
            self.options.full.refused(error, getattr(state.fn, "__name__", "write"))
            return
        log.warning("redis write retry attempt=%d error=%s", state.attempt_number, error)


class StreamWriter:
    """Token sink for one job: buffers deltas, flushes every few tokens or milliseconds."""

    def __init__(
        self, conn: redis.Redis, job_id: str, options: StreamOptions, deferred: bool = False
    ) -> None:
        self.conn = conn
        self.job_id = job_id
        self.key = keys.stream_key(job_id)
        self.options = options
        self._retry = retrying(options)
        self._text: list[str] = []
        self._ids: list[int] = []
        self._logprobs: list[GeneratedLogprob] = []  # the buffered tokens', where the job asked
        self._index = 0  # completion-token index of the first buffered id
        self._last_flush = time.monotonic()
        self._ms = 0  # the last id chosen (or found at the stream's end): `<ms>-<seq>`
        self._seq = 0
        self._expired_at: float | None = None  # when the stream's TTL was last set (monotonic)
        self.deferred = deferred  # buffer only: `flush_streams` writes many jobs' tokens in one pipeline

    def open(self, attempt: int) -> None:
        """Start writing; if the stream already has entries (a retried job), announce a restart."""
        if self._seek_end() is not None:
            self._write([RestartEvent(attempt=attempt).fields()])

    def error_once(self, message: str) -> None:
        """End the stream with an `error` event unless it already ended (done or error)."""
        last_event = self._seek_end()
        if last_event not in ("done", "error"):
            self._write([ErrorEvent(message=message).fields()])

    def _seek_end(self) -> str | None:
        """Place new entry ids after the stream's last one; return that entry's event, if any."""
        last: Any = self._retry(self.conn.xrevrange, self.key, count=1)
        return self._seek_to(last)

    def seek(self, pipe: Any) -> None:
        """Queue the read of the stream's last entry on `pipe` (its reply goes to `opened`)."""
        pipe.xrevrange(self.key, count=1)

    def _seek_to(self, last: list[Any]) -> str | None:
        """`_seek_end` given the stream's last entry as XREVRANGE returned it."""
        if not last:
            self._ms, self._seq = 0, 0
            return None
        entry_id, fields = last[0]
        ms, seq = _text(entry_id).split("-")
        self._ms, self._seq = int(ms), int(seq)
        return _text(fields.get(b"event", fields.get("event", b"")))

    def logprobs(self, items: list[GeneratedLogprob]) -> None:
        """The logprobs of the tokens of the next call (`LogprobSink`), where the job asked."""
        self._logprobs.extend(items)

    def __call__(self, text: str, ids: list[int]) -> None:
        self._text.append(text)
        self._ids.extend(ids)
        if not self.deferred and self.due():
            self.flush()

    def due(self) -> bool:
        """Whether buffered tokens should go out now: the first token at once (it is what a reader
        waits for), then every `flush_tokens` tokens or `flush_ms` milliseconds."""
        if not self._ids and not any(self._text):
            return False
        elapsed_ms = (time.monotonic() - self._last_flush) * 1000
        return (
            self._index == 0
            or len(self._ids) >= self.options.flush_tokens
            or elapsed_ms >= self.options.flush_ms
        )

    def flush(self) -> None:
        entry = self._take()
        if entry is not None:
            self._retry(self._pipeline, [entry[1]], [entry[0]], self.expire_due())

    def expire_due(self) -> bool:
        """Whether the next write should (re)set the stream's TTL."""
        every = min(_EXPIRE_EVERY_S, self.options.ttl_s / 4)
        return self._expired_at is None or time.monotonic() - self._expired_at >= every

    def _take(self) -> tuple[str, dict[str, str]] | None:
        """The buffered tokens as one `token` entry with its id; the buffer is empty afterwards."""
        if not self._ids and not any(self._text):
            return None
        logprobs = self._logprobs or None
        event = TokenEvent(text="".join(self._text), ids=self._ids, index=self._index, logprobs=logprobs)
        self._index += len(self._ids)
        self._text, self._ids, self._logprobs = [], [], []
        self._last_flush = time.monotonic()
        return self._next_id(), event.fields()

    def finish(self, result: GenerateResult | ScoreResult, done: DoneEvent) -> None:
        """What is buffered, the `done` event and the result key, in one transaction (`finish_streams`)."""
        finish_streams(self.conn, [(self, result, done)], self.options)

    def _next_id(self) -> str:
        """The next entry's id: now, or just after the last id if the clock has not moved past it."""
        now_ms = int(time.time() * 1000)
        if now_ms > self._ms:
            self._ms, self._seq = now_ms, 0
        else:
            self._seq += 1
        return f"{self._ms}-{self._seq}"

    def _write(self, entries: list[dict[str, str]]) -> None:
        ids = [self._next_id() for _ in entries]
        self._retry(self._pipeline, entries, ids)

    def _pipeline(self, entries: list[dict[str, str]], ids: list[str], expire: bool = True) -> None:
        pipe = self.conn.pipeline(transaction=True)
        for entry_id, fields in zip(ids, entries, strict=True):
            pipe.xadd(self.key, fields, id=entry_id, maxlen=self.options.maxlen, approximate=True)  # type: ignore[arg-type]
        if expire:
            pipe.expire(self.key, self.options.ttl_s)
        for reply in pipe.execute(raise_on_error=False):
            if isinstance(reply, redis.ResponseError) and not _already_written(reply):
                raise reply
        if expire:
            self._expired_at = time.monotonic()


def opened(openings: list[tuple[StreamWriter, int]], lasts: list[Any]) -> None:
    """`StreamWriter.open(attempt)` for many writers whose streams' last entries were read together, in
    a round trip of the caller's (`StreamWriter.seek`): each writer's ids placed after its stream's
    end, and a `restart` entry written, as `open` writes it, where a stream already has entries."""
    for (w, attempt), last in zip(openings, lasts, strict=True):
        if w._seek_to(last) is not None:
            w._write([RestartEvent(attempt=attempt).fields()])


def finish_streams(
    conn: redis.Redis,
    finals: Sequence[tuple[StreamWriter, GenerateResult | ScoreResult, DoneEvent]],
    options: StreamOptions,
) -> None:
    """`StreamWriter.finish` for many jobs in one transaction: per job its result key, then what it has
    buffered and its `done` event (so a reader who sees `done` finds the result), and the TTL."""
    if not finals:
        return
    writes = []
    for w, result, done in finals:
        buffered = w._take()
        entries = [*([buffered] if buffered is not None else []), (w._next_id(), done.fields())]
        writes.append((w, entries, json.dumps(result.model_dump(mode="json"))))

    def write() -> None:
        pipe = conn.pipeline(transaction=True)
        for w, entries, payload in writes:
            pipe.set(keys.result_key(w.job_id), payload, ex=options.result_ttl_s)
            for entry_id, fields in entries:
                pipe.xadd(w.key, fields, id=entry_id, maxlen=options.maxlen, approximate=True)  # type: ignore[arg-type]
            pipe.expire(w.key, options.ttl_s)
        for reply in pipe.execute(raise_on_error=False):
            if isinstance(reply, redis.ResponseError) and not _already_written(reply):
                raise reply

    retrying(options)(write)


def flush_streams(conn: redis.Redis, writers: list[StreamWriter], options: StreamOptions) -> None:
    """Write the due tokens of many jobs' streams in one pipeline: one round trip per decode step of a
    generation batch, instead of one per job."""
    entries = [(w, e, w.expire_due()) for w in writers if w.due() for e in [w._take()] if e is not None]
    if not entries:
        return

    def write() -> None:
        pipe = conn.pipeline(transaction=False)
        for w, (entry_id, fields), expire in entries:
            pipe.xadd(w.key, fields, id=entry_id, maxlen=options.maxlen, approximate=True)  # type: ignore[arg-type]
            if expire:
                pipe.expire(w.key, options.ttl_s)
        for reply in pipe.execute(raise_on_error=False):
            if isinstance(reply, redis.ResponseError) and not _already_written(reply):
                raise reply

    retrying(options)(write)
    now = time.monotonic()
    for w, _, expire in entries:
        if expire:
            w._expired_at = now


def _already_written(err: redis.ResponseError) -> bool:
    # A retried XADD whose first attempt landed: Redis refuses the same explicit id.
    return "equal or smaller than the target stream top item" in str(err)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
