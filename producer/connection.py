"""Redis connections from a URL, and the one retry policy both clients use for connection errors.

`redis://[user:password@]host:port/db`, `rediss://` (TLS), `unix:///path/redis.sock?db=N` and Sentinel's
`redis+sentinel://[user:password@]host1:26379,host2:26379/<service_name>/<db>` (read in `jobs.redis_url`,
shared with the worker). redis-py's own per-command retry is switched off: the tenacity policy here is
the only one, so "how many tries, how long" has a single, bounded answer. Its defaults (5 tries, waits
0.1, 0.2, 0.4, 0.8 s, each try up to the socket timeouts) cover a Sentinel failover when the client's
connections break at once; a failover that takes longer (the sentinels' `down-after-milliseconds` plus
their election) needs more: docs/operations.md gives the figures and settings.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import redis
import redis.asyncio
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)

from mlxq.jobs import redis_url
from mlxq.jobs.replication import default_replica_acks
from mlxq.jobs.transient import is_transient

from .settings import ProducerSettings

log = logging.getLogger("mlxq.producer")

P = ParamSpec("P")
T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded tries with exponential backoff, for Redis connection errors only."""

    attempts: int = 8
    initial_wait_s: float = 0.1
    max_wait_s: float = 2.0
    say_waits: bool = False  # log each wait as a warning (long runs: a person should know why it stalls)

    def patient(self) -> RetryPolicy:
        """This policy for work that runs for hours (bulk runs): at least 12 tries, waits growing to at
        least 5 s, so a Redis restart or failover of about half a minute is ridden out, not fatal."""
        return RetryPolicy(max(self.attempts, 12), self.initial_wait_s, max(self.max_wait_s, 5.0), True)

    @classmethod
    def from_settings(cls, settings: ProducerSettings) -> RetryPolicy:
        return cls(
            attempts=settings.redis_retry_attempts,
            initial_wait_s=settings.redis_retry_initial_wait_s,
            max_wait_s=settings.redis_retry_max_wait_s,
        )

    def _options(self, tries_made: int = 0) -> dict[str, object]:
        """Tenacity's options for the tries left after `tries_made` (waits go on where they were)."""
        return {
            "stop": stop_after_attempt(self.attempts - tries_made),
            "wait": wait_exponential(multiplier=self.initial_wait_s * 2**tries_made, max=self.max_wait_s),
            "retry": retry_if_exception(is_transient),
            "reraise": True,
            **({"before_sleep": functools.partial(self._say_wait, tries_made)} if self.say_waits else {}),
        }

    def _say_wait(self, tries_made: int, state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        wait = state.next_action.sleep if state.next_action is not None else 0.0
        self._log_wait(wait, state.attempt_number + tries_made + 1, error)

    def _log_wait(self, wait: float, next_try: int, error: BaseException | None) -> None:
        log.warning(
            "redis unreachable; trying again in %.1f s (try %d of %d) error=%s",
            wait, next_try, self.attempts, error,
        )  # fmt: skip

    def call(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run `fn`, trying again on a connection error; the last error is raised as it was."""
        retrying = Retrying(**self._options())  # type: ignore[arg-type]
        return retrying(fn, *args, **kwargs)

    async def acall(self, fn: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> T:
        """Await `fn`, trying again on a connection error; the last error is raised as it was.
        The first try runs outside tenacity, whose bookkeeping costs more than a Redis command."""

        async def attempt() -> T:  # redis.asyncio's commands return awaitables without being `async def`
            return await fn(*args, **kwargs)

        try:
            return await attempt()
        except Exception as e:
            if self.attempts <= 1 or not is_transient(e):
                raise
            wait = min(self.initial_wait_s, self.max_wait_s)  # tenacity's first wait
            if self.say_waits:
                self._log_wait(wait, 2, e)
            await asyncio.sleep(wait)
        retrying = AsyncRetrying(**self._options(tries_made=1))  # type: ignore[arg-type]
        return await retrying(attempt)


def replica_acks(conn: redis.Redis | redis.asyncio.Redis, settings: ProducerSettings) -> int:
    """The least number of replicas that must hold a job before a submit returns: the setting, else
    `jobs.replication.default_replica_acks` (1 through Sentinel, else 0). Through Sentinel a submit
    waits for every replica in sync, never fewer (`jobs.replication.Replicas`)."""
    return settings.replica_acks if settings.replica_acks is not None else default_replica_acks(conn)


def connect(url: str, settings: ProducerSettings | None = None) -> redis.Redis:
    """A sync client (bytes replies, as RQ needs) for `url`; connects lazily."""
    settings = settings or ProducerSettings()
    return redis_url.sync_client(
        url,
        retry=Retry(NoBackoff(), 0),
        socket_timeout=settings.socket_timeout_s,
        socket_connect_timeout=settings.socket_connect_timeout_s,
        health_check_interval=30,
    )


def connect_async(url: str, settings: ProducerSettings | None = None) -> redis.asyncio.Redis:
    """An asyncio client (bytes replies) for `url`; connects lazily."""
    settings = settings or ProducerSettings()
    return redis_url.async_client(
        url,
        retry=AsyncRetry(NoBackoff(), 0),
        socket_timeout=settings.socket_timeout_s,
        socket_connect_timeout=settings.socket_connect_timeout_s,
        health_check_interval=30,
        **({"max_connections": settings.redis_max_connections} if settings.redis_max_connections else {}),
    )


def redact_url(url: str) -> str:
    """`url` with its passwords replaced by `***`, for messages and logs."""
    return redis_url.redact_url(url)
