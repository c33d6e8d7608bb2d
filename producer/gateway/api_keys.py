"""API keys: created and revoked with `mlxq api-key`, stored only as SHA-256 hashes in Redis.

A key is 32 random bytes (`sk-mlxq-...`), so a plain hash is enough: there is nothing to guess, and a
leaked Redis dump gives no usable key. Each key's hash `mlxq:gw:key:<sha256>` holds its name, the models
and queues it is limited to (empty: any) and its own concurrent-job limit; `mlxq:gw:keys` maps names to
hashes, so a key is revoked by name. Every gateway instance reads the same records: revoking a key stops
it on all of them within `key_cache_s` (one second by default; `KeyCache`).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio

KEY_RECORD_PREFIX = "mlxq:gw:key:"
NAMES_KEY = "mlxq:gw:keys"
TOKEN_PREFIX = "sk-mlxq-"


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class ApiKey:
    """What a key may do. `models`/`queues` empty: no limit there; `max_jobs` None: the gateway's."""

    name: str
    digest: str
    models: tuple[str, ...] = ()
    queues: tuple[str, ...] = ()
    max_jobs: int | None = None
    created: float = field(default=0.0)

    def fields(self) -> dict[str, str]:
        return {
            "name": self.name,
            "models": json.dumps(list(self.models)),
            "queues": json.dumps(list(self.queues)),
            "max_jobs": "" if self.max_jobs is None else str(self.max_jobs),
            "created": f"{self.created:.3f}",
        }

    @classmethod
    def from_fields(cls, key_digest: str, raw: dict[Any, Any]) -> ApiKey:
        f = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in raw.items()
        }
        return cls(
            name=f["name"],
            digest=key_digest,
            models=tuple(json.loads(f.get("models") or "[]")),
            queues=tuple(json.loads(f.get("queues") or "[]")),
            max_jobs=int(f["max_jobs"]) if f.get("max_jobs") else None,
            created=float(f.get("created") or 0.0),
        )

    def allows_model(self, model: str) -> bool:
        return not self.models or model in self.models

    def allows_queue(self, queue: str) -> bool:
        return not self.queues or queue in self.queues


class KeyExists(ValueError):
    pass


def create(
    conn: redis.Redis,
    name: str,
    *,
    models: list[str] | None = None,
    queues: list[str] | None = None,
    max_jobs: int | None = None,
) -> tuple[str, ApiKey]:
    """A new key named `name` (unique): returns the token, shown once, and its record."""
    if not name or any(c.isspace() for c in name):
        raise ValueError(f"a key's name must be non-empty without spaces, got {name!r}")
    if max_jobs is not None and max_jobs < 1:
        raise ValueError(f"max_jobs must be at least 1, got {max_jobs}")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    key = ApiKey(name, digest(token), tuple(models or ()), tuple(queues or ()), max_jobs, time.time())
    if not conn.hsetnx(NAMES_KEY, name, key.digest):
        raise KeyExists(f"an API key named {name!r} exists already (revoke it first)")
    conn.hset(KEY_RECORD_PREFIX + key.digest, mapping=key.fields())  # type: ignore[arg-type]
    return token, key


def revoke(conn: redis.Redis, name: str) -> bool:
    """Remove the key named `name`; False if there is none."""
    found = conn.hget(NAMES_KEY, name)
    if found is None:
        return False
    key_digest = found.decode() if isinstance(found, bytes) else str(found)
    pipe = conn.pipeline(transaction=True)
    pipe.delete(KEY_RECORD_PREFIX + key_digest)
    pipe.hdel(NAMES_KEY, name)
    pipe.execute()
    return True


def listed(conn: redis.Redis) -> list[ApiKey]:
    """Every key's record (never a token: those are not stored)."""
    out = []
    for _, raw_digest in sorted(conn.hgetall(NAMES_KEY).items()):
        key_digest = raw_digest.decode() if isinstance(raw_digest, bytes) else str(raw_digest)
        raw = conn.hgetall(KEY_RECORD_PREFIX + key_digest)
        if raw:
            out.append(ApiKey.from_fields(key_digest, raw))
    return out


async def lookup(conn: redis.asyncio.Redis, token: str) -> ApiKey | None:
    """The key a bearer token is, or None if it is not (or no longer) a key."""
    key_digest = digest(token)
    raw = await conn.hgetall(KEY_RECORD_PREFIX + key_digest)
    return ApiKey.from_fields(key_digest, raw) if raw else None


class KeyCache:
    """`lookup`, remembered for `ttl_s` seconds per token (a revoked key stops within that time on every
    instance); a busy client then costs no Redis read per request. At most `size` tokens are kept."""

    def __init__(self, ttl_s: float, size: int = 4096) -> None:
        self.ttl_s = ttl_s
        self.size = size
        self._seen: OrderedDict[str, tuple[float, ApiKey | None]] = OrderedDict()

    async def lookup(self, conn: redis.asyncio.Redis, token: str) -> ApiKey | None:
        now = time.monotonic()
        hit = self._seen.get(token)
        if hit is not None and now - hit[0] < self.ttl_s:
            return hit[1]
        key = await lookup(conn, token)
        self._seen[token] = (now, key)
        self._seen.move_to_end(token)
        while len(self._seen) > self.size:
            self._seen.popitem(last=False)
        return key
