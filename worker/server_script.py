"""A Lua script run by its SHA (EVALSHA): what the worker's ACL user may send (`evalsha`, `script|load`).

The worker's scripts (`rq_scripts.py`, `stream_scripts.py`) write many jobs' records with one command
sent; each passes every key it touches in KEYS, so ACL key patterns apply to what it runs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import redis


class ServerScript:
    """A Lua script run by its SHA; loaded (SCRIPT LOAD) where the server does not know it."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    def queue(self, pipe: Any, keys: list[str], args: list[Any]) -> None:
        """Queue one call on `pipe` (its reply says NOSCRIPT where the server lacks the script)."""
        pipe.evalsha(self.sha, len(keys), *keys, *args)

    def run(self, conn: redis.Redis, send: Callable[[], Any]) -> Any:
        """`send()` (which queues or sends this script's call), sent again once after SCRIPT LOAD if
        the server did not know the script."""
        try:
            return send()
        except redis.exceptions.NoScriptError:
            conn.script_load(self.source)
            return send()


def wire(value: Any) -> bytes:
    """A value as redis-py sends it (its `Encoder`): what a field holds once written."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, int | float) and not isinstance(value, bool):
        return repr(value).encode()
    raise TypeError(f"cannot send {type(value).__name__} {value!r} to Redis")


# A script's reading of `packed` values: `unpacked(ARGV[i])` gives them back as a Lua list.
UNPACKED_LUA = """
local function unpacked(blob)
  local out, at = {}, 1
  while at <= #blob do
    local colon = string.find(blob, ':', at, true)
    local size = tonumber(string.sub(blob, at, colon - 1))
    out[#out + 1] = string.sub(blob, colon + 1, colon + size)
    at = colon + size + 1
  end
  return out
end
"""


def packed(values: list[bytes]) -> bytes:
    """Values as one script argument, each as its length, a colon and its bytes (`UNPACKED_LUA` reads
    it back): the client packs each argument it sends apart (its encoder's checks, a generator step),
    which for a batch's ~15 values a job cost more than the script's reading of them."""
    return b"".join([b"%d:%b" % (len(v), v) for v in values])
