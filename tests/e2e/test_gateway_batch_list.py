"""`GET /v1/batches` through the real `openai` package: a key's own batches, newest first, in OpenAI's
cursor pages (`limit`, `after`, `has_more`); and OpenAI's limits on a batch's `metadata`."""

from __future__ import annotations

import json

import openai
import pytest
import redis
import test_gateway
from gateway_process import GatewayProcess

from mlxq.producer.gateway import api_keys

# The gateway module's Redis, worker and gateway fixtures (module-scoped: this module starts its own).
server, worker, gateway = test_gateway.server, test_gateway.worker, test_gateway.gateway
model, conn, key, sdk = test_gateway.model, test_gateway.conn, test_gateway.key, test_gateway.sdk


def _batch(sdk: openai.OpenAI, model: str, tag: str) -> str:
    line = {
        "custom_id": tag,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": model, "messages": [{"role": "user", "content": tag}], "max_tokens": 1},
    }
    uploaded = sdk.files.create(file=("in.jsonl", (json.dumps(line) + "\n").encode()), purpose="batch")
    batch = sdk.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"tag": tag},
    )
    return batch.id


def test_a_keys_batches_are_listed_newest_first_in_pages(
    sdk: openai.OpenAI, gateway: GatewayProcess, conn: redis.Redis, model: str
) -> None:
    token, _ = api_keys.create(conn, "someone-else")
    try:
        other = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=token, max_retries=0)
        theirs = _batch(other, model, "theirs")
        mine = [_batch(sdk, model, f"mine-{i}") for i in range(3)]
        first = sdk.batches.list(limit=2)
        assert [b.id for b in first.data] == mine[::-1][:2] and first.has_more
        assert first.data[0].metadata == {"tag": "mine-2"} and first.data[0].request_counts is not None
        second = sdk.batches.list(limit=2, after=first.data[-1].id)
        assert [b.id for b in second.data] == [mine[0]] and not second.has_more
        assert [b.id for b in sdk.batches.list(limit=1)] == mine[::-1]  # the SDK follows the cursor itself
        assert [b.id for b in other.batches.list()] == [theirs]
        with pytest.raises(openai.NotFoundError):
            sdk.batches.list(after=theirs)  # another key's batch is no cursor here
        with pytest.raises(openai.BadRequestError) as e:
            sdk.batches.list(limit=101)
        assert e.value.body["param"] == "limit"  # type: ignore[index]
    finally:
        api_keys.revoke(conn, "someone-else")


def test_metadata_beyond_openais_limits_is_a_400(sdk: openai.OpenAI, model: str) -> None:
    uploaded = sdk.files.create(file=("in.jsonl", b"{}\n"), purpose="batch")
    for metadata in ({f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}):
        with pytest.raises(openai.BadRequestError) as e:
            sdk.batches.create(
                input_file_id=uploaded.id,
                endpoint="/v1/chat/completions",
                completion_window="24h",
                metadata=metadata,
            )
        assert e.value.body["param"] == "metadata"  # type: ignore[index]


def test_a_keys_files_are_listed_and_deleted(
    sdk: openai.OpenAI, gateway: GatewayProcess, conn: redis.Redis
) -> None:
    token, _ = api_keys.create(conn, "file-owner")
    try:
        other = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=token, max_retries=0)
        theirs = other.files.create(file=("x.jsonl", b"{}\n"), purpose="batch").id
        mine = [sdk.files.create(file=(f"f{i}.jsonl", b"{}\n"), purpose="batch").id for i in range(3)]
        assert [f.id for f in sdk.files.list()] == mine[::-1]  # newest first, none of another key's
        page = sdk.files.list(limit=2, order="asc")
        assert [f.id for f in page.data] == mine[:2] and page.has_more
        assert [f.id for f in sdk.files.list(order="asc", after=mine[0])] == mine[1:]
        assert [f.id for f in sdk.files.list(purpose="batch_output")] == []
        deleted = sdk.files.delete(mine[1])
        assert deleted.id == mine[1] and deleted.deleted
        assert [f.id for f in sdk.files.list(order="asc")] == [mine[0], mine[2]]
        with pytest.raises(openai.NotFoundError):
            sdk.files.content(mine[1])
        with pytest.raises(openai.NotFoundError):
            sdk.files.delete(theirs)  # another key's file is not found, nor deleted
        assert [f.id for f in other.files.list()] == [theirs]
    finally:
        api_keys.revoke(conn, "file-owner")
