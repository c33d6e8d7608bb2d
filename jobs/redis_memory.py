"""Redis's `maxmemory-policy`, and what it means for mlxq's keys: read by workers, producers and
`mlxq status`, which all warn when Redis may evict what mlxq keeps.

An evicting Redis loses work silently: RQ skips a queued id whose job hash is gone, and a reader finds
no result. Which keys a policy may evict:

- `noeviction`: none; a full Redis refuses writes with an OOM error instead (workers wait for memory,
  producers are told). The only safe policy for a queue.
- `allkeys-*`: any key, queued jobs' hashes and the queues themselves included.
- `volatile-*`: keys with a TTL. In mlxq those are the token streams (`MLXQ_STREAM_TTL_S`), result keys
  (`MLXQ_RESULT_TTL_S`), ended jobs' hashes and RQ results (RQ's `result_ttl`/`failure_ttl`), cancel
  keys, and the workers' registrations and stats (heartbeat TTLs): a reader loses tokens or a result it
  has not collected, and a worker whose registration is evicted looks dead, so its running jobs are
  reaped as abandoned. Queued and running jobs' hashes and the queues have no TTL and stay.

The policy is read from `INFO memory` (`maxmemory_policy`), which the users in `deploy/redis/users.acl`
may run, else from `CONFIG GET maxmemory-policy` (refused to most ACL users and renamed or refused on
several managed services). Where neither answers, the reading says so (`MemoryPolicy.unknown`): that is
worth one line, never an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio

SAFE_POLICY = "noeviction"


@dataclass(frozen=True)
class MemoryPolicy:
    """What a Redis said of its memory: its policy (None where it could not be read), its limit."""

    policy: str | None
    maxmemory: int | None = None  # bytes; 0: no limit
    used_memory: int | None = None  # bytes (INFO memory only)
    refused: str | None = None  # why the policy could not be read

    @property
    def unknown(self) -> bool:
        return self.policy is None

    @property
    def full(self) -> bool:
        """Redis is at its limit: under `noeviction` it refuses writes (OOM replies)."""
        return bool(self.maxmemory) and (self.used_memory or 0) >= (self.maxmemory or 0)

    @property
    def evicts(self) -> bool:
        """True when Redis may delete mlxq's keys when it fills up."""
        return self.policy is not None and self.policy != SAFE_POLICY

    def warning(self) -> str | None:
        """One line for a log or `mlxq status` when the policy can evict mlxq's keys, else None."""
        if not self.evicts:
            return None
        policy = self.policy or ""
        if policy.startswith("volatile-"):
            lost = (
                "keys with a TTL: token streams, results not yet collected, ended jobs and worker "
                "registrations (their running jobs then look abandoned); queued jobs stay"
            )
        else:
            lost = "any key, queued jobs included: they vanish without an error"
        limit = "" if self.maxmemory else " (maxmemory is 0 for now: nothing is evicted until one is set)"
        return (
            f"Redis maxmemory-policy is {policy}: when full it evicts {lost}{limit}. "
            f"Set maxmemory-policy {SAFE_POLICY} (deploy/redis/README.md)"
        )

    def unknown_note(self) -> str | None:
        """One line when the policy could not be read, else None."""
        if not self.unknown:
            return None
        return (
            f"could not read Redis maxmemory-policy ({self.refused}); make sure it is {SAFE_POLICY}: "
            "an evicting Redis loses queued jobs without an error"
        )


def from_info(info: dict[str, Any]) -> MemoryPolicy | None:
    """The policy from an `INFO memory` reply (redis-py's parsed dict), if it says one."""
    policy = info.get("maxmemory_policy")
    if policy is None:
        return None
    return MemoryPolicy(_text(policy), _int(info.get("maxmemory")), _int(info.get("used_memory")))


def from_config(reply: dict[Any, Any]) -> MemoryPolicy | None:
    """The policy from a `CONFIG GET maxmemory*` reply, if it holds one."""
    values = {_text(k): v for k, v in reply.items()}
    policy = values.get("maxmemory-policy")
    if policy is None:
        return None
    return MemoryPolicy(_text(policy), _int(values.get("maxmemory")))


_READS = (
    ("INFO", ("info", "memory"), from_info, "INFO memory has no maxmemory_policy"),
    ("CONFIG GET", ("config_get", "maxmemory*"), from_config, "CONFIG GET has no maxmemory-policy"),
)
"""The two ways to ask, in order: INFO first (the shipped ACL users may run it, not CONFIG)."""


def read_policy(conn: redis.Redis) -> MemoryPolicy:
    """The Redis's policy: INFO memory, else CONFIG GET; `unknown` where both are refused. A connection
    error is raised: the caller retries as it retries anything else."""
    refusals = []
    for name, (method, arg), parse, absent in _READS:
        try:
            found = parse(getattr(conn, method)(arg))
        except (redis.ConnectionError, redis.TimeoutError):
            raise
        except redis.RedisError as e:
            refusals.append(f"{name}: {e}")
            continue
        if found is not None:
            return found
        refusals.append(absent)
    return MemoryPolicy(None, refused="; ".join(refusals))


async def aread_policy(conn: redis.asyncio.Redis) -> MemoryPolicy:
    """`read_policy` on an asyncio client."""
    refusals = []
    for name, (method, arg), parse, absent in _READS:
        try:
            found = parse(await getattr(conn, method)(arg))
        except (redis.ConnectionError, redis.TimeoutError):
            raise
        except redis.RedisError as e:
            refusals.append(f"{name}: {e}")
            continue
        if found is not None:
            return found
        refusals.append(absent)
    return MemoryPolicy(None, refused="; ".join(refusals))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _int(value: Any) -> int | None:
    try:
        return int(_text(value))
    except (TypeError, ValueError):
        return None
