"""A tenant's key space on the producer side: ids and queue names under its prefix, checked names."""

from __future__ import annotations

import pytest
import redis
from pydantic import ValidationError

from mlxq.producer import Client, ProducerSettings
from mlxq.producer.cli import main
from mlxq.producer.tenant import SHARED, Tenant, acl_rules

REDIS_DB = 12


@pytest.mark.parametrize("name", ["", "Acme", "ac_me", "ac-me", "a*", "a:b", "x" * 33])
def test_a_tenant_name_that_would_blur_key_patterns_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="lowercase letters and digits"):
        Tenant(name)
    with pytest.raises(ValidationError, match="lowercase letters and digits"):
        ProducerSettings(tenant=name)


def test_ids_and_queues_are_the_tenants_and_a_foreign_id_is_refused() -> None:
    acme = Tenant("acme")
    assert acme.job_id().startswith("acme_") and len(acme.job_id()) == len("acme_") + 32
    assert acme.job_id("acme_mine") == "acme_mine"
    with pytest.raises(ValueError, match="must start 'acme_'"):
        acme.job_id("beta_x")
    assert (acme.queue("llama"), acme.queue("acme_llama")) == ("acme_llama", "acme_llama")
    assert (SHARED.queue("llama"), SHARED.job_id("x")) == ("llama", "x")
    rules = acl_rules("acme")
    assert "%RW~rq:job:acme_*" in rules and "%R~mlxq:result:acme_*" in rules and "beta" not in rules


def test_a_tenant_client_enqueues_into_its_own_key_space(redis_url: str, redis_conn: redis.Redis) -> None:
    with Client(redis_url, settings=ProducerSettings(tenant="acme"), queue="llama") as client:
        job = client.submit_generate("hi", max_tokens=1)
        other = client.submit_score([{"prompt": "2+2=", "candidates": ["4"]}], queue="fast", job_id="acme_s1")
    assert job.id.startswith("acme_") and other.id == "acme_s1"
    assert redis_conn.lrange("rq:queue:acme_llama", 0, -1) == [job.id.encode()]
    assert redis_conn.lrange("rq:queue:acme_fast", 0, -1) == [b"acme_s1"]
    assert redis_conn.hget(f"rq:job:{job.id}", "origin") == b"acme_llama"


def test_the_cli_prints_a_tenants_acl_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tenant-acl", "acme", "--user", "web-acme"]) == 0
    assert capsys.readouterr().out == f"user web-acme on >CHANGE-ME {acl_rules('acme')}\n"
    assert main(["tenant-acl", "ACME"]) == 2
    assert "lowercase letters and digits" in capsys.readouterr().err
