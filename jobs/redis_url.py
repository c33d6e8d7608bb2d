"""Redis URLs, the one place both sides turn `MLXQ_REDIS_URL` into a client: plain URLs and Sentinel.

Plain: `redis://[user:password@]host:port/db`, `rediss://` (TLS), `unix:///path/redis.sock?db=N`, as
`redis.Redis.from_url` reads them.

Sentinel: `redis+sentinel://[user:password@]host1:26379,host2:26379/<service_name>[/<db>]`, or
`rediss+sentinel://` for TLS to the sentinels and the servers alike. The hosts are sentinels (port
26379 when left out); the service name is the one in their `sentinel monitor` line; the user and
password are the Redis servers' (sentinels usually need none: `?sentinel_username=...&
sentinel_password=...` where they do). The client asks the sentinels for the current primary when it
connects (`_Sentinel`: the promoted replica as soon as the sentinels have seen it take over), and a
connection that meets a demoted primary (READONLY) or a lost one is dropped and made again to the new
primary (redis-py's `Sentinel.master_for`): a failover is ridden out by the callers' ordinary retries
of connection errors.

Producers (`producer.connection`) and workers (`worker.service`) both build their clients here, each with
its own connection options, so a URL means the same thing on both sides; nothing here imports mlx.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

import redis
import redis.asyncio
import redis.asyncio.sentinel
import redis.sentinel

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
SENTINEL_PORT = 26379
_SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password")
_SENTINEL_TIMEOUT_S = 2.0  # one sentinel's answer; a dead one is skipped for the next


class BadRedisUrl(ValueError):
    """A Redis URL that cannot be used, with what is wrong in it (the password never shown)."""


@dataclass(frozen=True)
class SentinelUrl:
    """A parsed `redis+sentinel://` URL."""

    sentinels: tuple[tuple[str, int], ...]
    service_name: str
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ssl: bool = False
    sentinel_username: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)

    def server_options(self) -> dict[str, Any]:
        """Connection options for the primary's connections."""
        out: dict[str, Any] = {"db": self.db}
        if self.username is not None:
            out["username"] = self.username
        if self.password is not None:
            out["password"] = self.password
        if self.ssl:
            out["ssl"] = True
        return out

    def sentinel_options(self, connect_timeout_s: float) -> dict[str, Any]:
        """Connection options for the sentinels' connections (short timeouts: a dead one is skipped)."""
        out: dict[str, Any] = {
            "socket_timeout": _SENTINEL_TIMEOUT_S,
            "socket_connect_timeout": min(connect_timeout_s, _SENTINEL_TIMEOUT_S),
        }
        if self.sentinel_username is not None:
            out["username"] = self.sentinel_username
        if self.sentinel_password is not None:
            out["password"] = self.sentinel_password
        if self.ssl:
            out["ssl"] = True
        return out


def is_sentinel(url: str) -> bool:
    return url.split("://", 1)[0].lower() in SENTINEL_SCHEMES


def parse_sentinel(url: str) -> SentinelUrl:
    """Read a `redis+sentinel://` URL; `BadRedisUrl` saying what is wrong (the password never shown)."""
    scheme, rest = url.split("://", 1) if "://" in url else ("", url)
    if scheme.lower() not in SENTINEL_SCHEMES:
        raise BadRedisUrl(f"not a Sentinel URL (redis+sentinel:// or rediss+sentinel://): {redact_url(url)}")
    netloc, _, tail = rest.partition("/")
    path, _, query = tail.partition("?")
    userinfo, _, hosts = netloc.rpartition("@")
    username = password = None
    if userinfo:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    sentinels = tuple(_host_port(h, url) for h in hosts.split(",") if h.strip())
    if not sentinels:
        raise BadRedisUrl(f"a Sentinel URL names at least one sentinel host:port: {redact_url(url)}")
    parts = [unquote(p) for p in path.split("/") if p]
    if not parts or len(parts) > 2:
        raise BadRedisUrl(
            f"a Sentinel URL's path is /<service_name> or /<service_name>/<db>, got {'/' + path!r}: "
            f"{redact_url(url)}"
        )
    db = 0
    if len(parts) == 2:
        if not parts[1].isdigit():
            raise BadRedisUrl(
                f"the database in a Sentinel URL is a number, got {parts[1]!r}: {redact_url(url)}"
            )
        db = int(parts[1])
    options = dict(parse_qsl(query, keep_blank_values=True))
    unknown = sorted(set(options) - set(_SENTINEL_OPTIONS))
    if unknown:
        raise BadRedisUrl(
            f"unknown Sentinel URL option {', '.join(unknown)} (known: {', '.join(_SENTINEL_OPTIONS)}): "
            f"{redact_url(url)}"
        )
    return SentinelUrl(
        sentinels=sentinels,
        service_name=parts[0],
        db=db,
        username=username,
        password=password,
        ssl=scheme.lower().startswith("rediss"),
        sentinel_username=options.get("sentinel_username"),
        sentinel_password=options.get("sentinel_password"),
    )


def _host_port(text: str, url: str) -> tuple[str, int]:
    text = text.strip()
    if text.startswith("["):  # [::1]:26379
        host, _, port = text[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = text.partition(":")
    if not host:
        raise BadRedisUrl(f"a sentinel with no host in {redact_url(url)}")
    if port and not port.isdigit():
        raise BadRedisUrl(f"sentinel port {port!r} is not a number in {redact_url(url)}")
    return host, int(port) if port else SENTINEL_PORT


def _address(reply: Any) -> tuple[str, int] | None:
    """The (host, port) of a `SENTINEL GET-MASTER-ADDR-BY-NAME` reply, or None (the service unknown)."""
    if not reply:
        return None
    host, port = reply[0], reply[1]
    return (host.decode() if isinstance(host, bytes) else str(host)), int(port)


class _Sentinel(redis.sentinel.Sentinel):
    """redis-py's `Sentinel`, finding the primary with `SENTINEL GET-MASTER-ADDR-BY-NAME`. redis-py reads
    `SENTINEL MASTERS`, which names the old primary until the whole failover has ended (every replica
    re-pointed: seconds); the address asked for here is the promoted replica's as soon as the sentinels
    have seen it take over. Until clients move, the old primary (in a `SENTINEL FAILOVER` it stays up)
    takes writes that are lost when it is demoted; `jobs.replication` refuses to count them, and this
    lets the writes done again reach the new primary without waiting out the failover."""

    def discover_master(self, service_name: str) -> tuple[str, int]:
        errors = []
        for i, sentinel in enumerate(self.sentinels):
            try:
                address = _address(sentinel.sentinel_get_master_addr_by_name(service_name))
            except (redis.ConnectionError, redis.TimeoutError) as e:
                errors.append(f"{sentinel} - {e!r}")
                continue
            if address is not None:
                self.sentinels[0], self.sentinels[i] = sentinel, self.sentinels[0]
                return address
        said = f" : {', '.join(errors)}" if errors else ""
        raise redis.sentinel.MasterNotFoundError(f"No master found for {service_name!r}{said}")


class _AsyncSentinel(redis.asyncio.sentinel.Sentinel):
    """`_Sentinel` on asyncio."""

    async def discover_master(self, service_name: str) -> tuple[str, int]:
        errors = []
        for i, sentinel in enumerate(self.sentinels):
            try:
                address = _address(await sentinel.sentinel_get_master_addr_by_name(service_name))
            except (redis.ConnectionError, redis.TimeoutError) as e:
                errors.append(f"{sentinel} - {e!r}")
                continue
            if address is not None:
                self.sentinels[0], self.sentinels[i] = sentinel, self.sentinels[0]
                return address
        said = f" : {', '.join(errors)}" if errors else ""
        raise redis.asyncio.sentinel.MasterNotFoundError(f"No master found for {service_name!r}{said}")


def sync_client(url: str, **options: Any) -> redis.Redis:
    """A sync client (bytes replies) for a plain or Sentinel URL; `options` go to its connections."""
    if not is_sentinel(url):
        return redis.Redis.from_url(url, **options)
    target = parse_sentinel(url)
    sentinel = _Sentinel(  # type: ignore[no-untyped-call,unused-ignore]  # typed from redis-py 8.2
        list(target.sentinels),
        sentinel_kwargs=target.sentinel_options(float(options.get("socket_connect_timeout") or 5.0)),
    )
    client: redis.Redis = sentinel.master_for(  # type: ignore[no-untyped-call,unused-ignore]  # typed from redis-py 8.2
        target.service_name, redis_class=redis.Redis, **target.server_options(), **options
    )
    return client


def async_client(url: str, **options: Any) -> redis.asyncio.Redis:
    """An asyncio client (bytes replies) for a plain or Sentinel URL."""
    if not is_sentinel(url):
        return redis.asyncio.Redis.from_url(url, **options)
    target = parse_sentinel(url)
    sentinel = _AsyncSentinel(  # type: ignore[no-untyped-call,unused-ignore]  # typed from redis-py 8.2
        list(target.sentinels),
        sentinel_kwargs=target.sentinel_options(float(options.get("socket_connect_timeout") or 5.0)),
    )
    client: redis.asyncio.Redis = sentinel.master_for(
        target.service_name, redis_class=redis.asyncio.Redis, **target.server_options(), **options
    )
    return client


def redact_url(url: str) -> str:
    """`url` with its passwords (the URL's own, a `sentinel_password` option) replaced by `***`."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, tail = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = f"{userinfo.split(':', 1)[0]}:***@{hosts}"
    parts = urlsplit(f"x://h/{tail}") if slash else None
    if parts is not None and parts.query:
        query = "&".join(
            f"{k}=***" if "password" in k else (f"{k}={v}" if v else k)
            for k, v in parse_qsl(parts.query, keep_blank_values=True)
        )
        tail = urlunsplit(("", "", parts.path, query, parts.fragment)).lstrip("/")
    return f"{scheme}://{netloc}{slash}{tail}"
