"""Structured output on the real SmolLM2-135M-Instruct (its 49k-token vocabulary and chat template),
served by a worker: a small labelling run under a JSON schema, every answer valid, and a regex.

Slow on this CPU, so it asks for little: a few short answers decoded together."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from jsonl_files import read_jsonl, write_jsonl

from mlxq.producer import Client
from mlxq.worker.modelfiles.default_model import default_model_dir

pytest.importorskip("llguidance")

REDIS_DB = 3

pytestmark = pytest.mark.slow

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"enum": ["France", "Italy", "Japan", "Peru", "other"]},
        "capital": {"type": "boolean"},
        "landmarks": {
            "type": "array",
            "items": {"type": "string", "maxLength": 24},
            "minItems": 1,
            "maxItems": 2,
        },
    },
    "required": ["city", "country", "capital", "landmarks"],
    "additionalProperties": False,
}


def test_a_labelling_run_on_the_real_model_gives_valid_json(
    tmp_path: Path, redis_url: str, spawn_worker: Any
) -> None:
    spawn_worker(default_model_dir(), redis_url).wait_ready()
    cities = ["Paris", "Rome", "Tokyo", "Lima"]
    rows = [
        {"custom_id": c, "messages": [{"role": "user", "content": f"Describe {c} as JSON."}]} for c in cities
    ]
    out = tmp_path / "out.jsonl"
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    with Client(redis_url) as client:
        summary = client.generate_dataset(
            write_jsonl(tmp_path / "in.jsonl", rows),
            out,
            max_tokens=96,
            temperature=0.0,
            response_format=response_format,
        )
        date = client.submit_generate(
            messages=[{"role": "user", "content": "When did the Eiffel Tower open? Give the date."}],
            max_tokens=16,
            temperature=0.0,
            response_format={"type": "regex", "regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"},
        ).result(timeout=300)
    assert (summary.succeeded, summary.failed) == (4, 0)
    answers = {g["custom_id"]: g for g in read_jsonl(out)}
    for city in cities:
        assert answers[city]["finish_reason"] == "stop", answers[city]["text"]
        value = json.loads(answers[city]["text"])
        jsonschema.validate(value, CITY)
    assert json.loads(answers["Paris"]["text"])["country"] == "France"  # a real model, not noise
    assert date.finish_reason == "stop" and re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", date.text)
