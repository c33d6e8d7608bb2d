"""The worker reads `MLXQ_REDIS_URL` through the same parser as producers (`jobs.redis_url`)."""

from __future__ import annotations

import redis.sentinel

from mlxq.worker.service import redis_from_url


def test_a_worker_gets_a_sentinel_managed_client_with_the_urls_service_and_db() -> None:
    client = redis_from_url("redis+sentinel://app:pw@127.0.0.1:1,127.0.0.1:2/mlxq/2")
    pool = client.connection_pool
    assert isinstance(pool, redis.sentinel.SentinelConnectionPool)
    assert pool.service_name == "mlxq"
    assert (pool.connection_kwargs["db"], pool.connection_kwargs["username"]) == (2, "app")
    assert [s.connection_pool.connection_kwargs["port"] for s in pool.sentinel_manager.sentinels] == [1, 2]
    client.close()
