"""`MLXQ_REDIS_URL` read in one place for producers and workers (`jobs.redis_url`): Sentinel URLs
parsed, bad ones refused with what is wrong and no password shown, plain URLs left to redis-py."""

from __future__ import annotations

import pytest
import redis
import redis.sentinel

from mlxq.jobs.redis_url import BadRedisUrl, SentinelUrl, is_sentinel, parse_sentinel, redact_url, sync_client
from mlxq.producer.connection import connect


def test_a_sentinel_url_names_sentinels_service_db_and_credentials() -> None:
    url = "redis+sentinel://app:p%40ss@10.0.0.1:26379,10.0.0.2,[::1]:26380/mlxq/3?sentinel_password=s3"
    assert is_sentinel(url) and not is_sentinel("redis://h:6379/0")
    assert parse_sentinel(url) == SentinelUrl(
        sentinels=(("10.0.0.1", 26379), ("10.0.0.2", 26379), ("::1", 26380)),
        service_name="mlxq",
        db=3,
        username="app",
        password="p@ss",
        sentinel_password="s3",
    )
    tls = parse_sentinel("rediss+sentinel://h1:1,h2:2/svc")
    assert tls.ssl and tls.db == 0 and tls.username is None and tls.server_options() == {"db": 0, "ssl": True}


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+sentinel:///mlxq/0", "at least one sentinel"),
        ("redis+sentinel://h:26379", "path is /<service_name>"),
        ("redis+sentinel://h:26379/mlxq/zero", "is a number"),
        ("redis+sentinel://h:port/mlxq", "is not a number"),
        ("redis+sentinel://h/mlxq/0/extra", "path is /<service_name>"),
        ("redis+sentinel://h/mlxq?socket_timeout=1", "unknown Sentinel URL option socket_timeout"),
    ],
)
def test_a_bad_sentinel_url_is_refused_with_the_reason(url: str, says: str) -> None:
    with pytest.raises(BadRedisUrl, match=says):
        parse_sentinel(url)


def test_passwords_never_show() -> None:
    shown = redact_url("redis+sentinel://app:secret@h1:1,h2:2/mlxq/0?sentinel_password=also")
    assert "secret" not in shown and "also" not in shown
    assert shown == "redis+sentinel://app:***@h1:1,h2:2/mlxq/0?sentinel_password=***"
    assert redact_url("rediss://app:s3cret@redis.example:6380/2") == "rediss://app:***@redis.example:6380/2"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"
    with pytest.raises(BadRedisUrl) as refused:
        parse_sentinel("redis+sentinel://app:secret@h1/mlxq/x")
    assert "secret" not in str(refused.value)


def test_a_producer_gets_a_sentinel_managed_client() -> None:
    url = "redis+sentinel://127.0.0.1:1,127.0.0.1:2/mlxq/2"
    for client in (connect(url), sync_client(url)):
        pool = client.connection_pool
        assert isinstance(pool, redis.sentinel.SentinelConnectionPool)
        assert pool.service_name == "mlxq" and pool.connection_kwargs["db"] == 2
        client.close()
    assert not isinstance(
        connect("redis://127.0.0.1:1/0").connection_pool, redis.sentinel.SentinelConnectionPool
    )


def test_an_async_producer_gets_a_sentinel_managed_client() -> None:
    import redis.asyncio.sentinel

    from mlxq.producer.connection import connect_async

    client = connect_async("redis+sentinel://127.0.0.1:1/mlxq/4")
    assert isinstance(client.connection_pool, redis.asyncio.sentinel.SentinelConnectionPool)
    assert client.connection_pool.connection_kwargs["db"] == 4
