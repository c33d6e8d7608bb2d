"""Structured output in bulk runs end to end: real Redis, a real worker process on a tiny random
checkpoint, the bulk runner and `mlxq generate-file --json-schema`.

The model's text is noise; every answer parses and validates (the `jsonschema` library) because the
worker constrained it. A row whose schema cannot be compiled fails alone, with the reason."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from jsonl_files import read_jsonl, write_jsonl
from worker_process import ROOT, WorkerProcess

from mlxq.producer import Client

pytest.importorskip("llguidance")

REDIS_DB = 15  # the bulk tests' DB

LABEL = {
    "type": "object",
    "properties": {
        "label": {"enum": ["positive", "negative", "neutral"]},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "evidence": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"quote": {"type": "string", "maxLength": 12}, "weight": {"type": "integer"}},
                "required": ["quote", "weight"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 2,
        },
    },
    "required": ["label", "confidence", "evidence"],
    "additionalProperties": False,
}
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "rank": {"type": "integer", "maximum": 99}},
    "required": ["city", "rank"],
    "additionalProperties": False,
}
CODE = r"[A-Z]{2}-[0-9]{3}"


def _format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "row", "schema": schema}}


def test_every_answer_of_a_constrained_bulk_run_validates(
    worker: WorkerProcess, client: Client, tmp_path: Path
) -> None:
    rows: list[dict[str, Any]] = [
        {"custom_id": f"r{i}", "prompt": f"Review {i}: the food was fine.", "seed": i} for i in range(16)
    ]
    for i in (2, 9):
        rows[i]["response_format"] = _format(CITY)  # a row's own constraint wins over the run's
    rows[5]["response_format"] = {"type": "regex", "regex": CODE}
    rows[12] = {"custom_id": "chat", "messages": [{"role": "user", "content": "Label this."}], "seed": 1}
    bad = {"custom_id": "bad", "prompt": "x", "response_format": _format({"type": "strin"})}
    src = write_jsonl(tmp_path / "in.jsonl", [*rows[:8], bad, *rows[8:]])
    out = tmp_path / "out.jsonl"
    summary = client.generate_dataset(
        src, out, in_flight=16, max_tokens=300, temperature=1.0, response_format=_format(LABEL)
    )

    assert (summary.succeeded, summary.failed) == (16, 1)
    got = {g["custom_id"]: g for g in read_jsonl(out)}
    for row in rows:
        answer = got[row["custom_id"]]
        assert answer["finish_reason"] == "stop", answer["text"]
        if row["custom_id"] == "r5":
            assert re.fullmatch(CODE, answer["text"])
        else:
            schema = CITY if row["custom_id"] in ("r2", "r9") else LABEL
            jsonschema.validate(json.loads(answer["text"]), schema)
    (error,) = read_jsonl(tmp_path / "out.errors.jsonl")
    assert error["custom_id"] == "bad"
    assert "response_format: the json_schema 'row' cannot be compiled" in error["error"]
    assert "strin" in error["error"]


def test_generate_file_takes_one_schema_for_the_whole_file(
    worker: WorkerProcess, redis_url: str, tmp_path: Path
) -> None:
    src = write_jsonl(
        tmp_path / "in.jsonl", [{"custom_id": f"c{i}", "prompt": f"City {i}:"} for i in range(6)]
    )
    schema_file = tmp_path / "city.schema.json"
    schema_file.write_text(json.dumps(CITY))
    out = tmp_path / "out.jsonl"
    cli = [sys.executable, "-m", "mlxq.producer.cli", "--redis-url", redis_url, "generate-file", str(src)]
    options = ["--max-tokens", "200", "--temperature", "1"]
    proc = subprocess.run(
        [*cli, "-o", str(out), "--json-schema", str(schema_file), *options],
        capture_output=True, text=True, timeout=120, cwd=ROOT, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    got = read_jsonl(out)
    assert [g["custom_id"] for g in got] == [f"c{i}" for i in range(6)]
    for g in got:
        assert g["finish_reason"] == "stop", g["text"]
        jsonschema.validate(json.loads(g["text"]), CITY)
    missing = subprocess.run(
        [*cli, "-o", str(out), "--json-schema", str(tmp_path / "nope.json")],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=False,
    )  # fmt: skip
    assert missing.returncode == 2 and "cannot read" in missing.stderr and "nope.json" in missing.stderr
    one = subprocess.run(
        [*cli[:5], "generate", "Code:", "--regex", CODE, "--json", "--timeout", "60"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, check=False,
    )  # fmt: skip
    assert one.returncode == 0, one.stderr
    assert re.fullmatch(CODE, json.loads(one.stdout)["text"])
    both = subprocess.run(
        [*cli, "-o", str(out), "--json-object", "--regex", "a+"],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=False,
    )  # fmt: skip
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
