"""`generate-file` and `score-file` over OpenAI Batch API files: request lines in (told from the file's
first line, or by `--format`), OpenAI's batch output and error lines out. Real Redis, a real worker on
the tiny model; each answer checked against the same request run as a plain mlxq row or score job."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from jsonl_files import read_jsonl, write_jsonl
from worker_process import ROOT, WorkerProcess

from mlxq.producer import Client

REDIS_DB = 15  # the bulk tests' DB (the modules run one after the other; each flushes it)

CHAT = [{"role": "user", "content": "Name a city."}]


def _line(custom_id: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "m", **body}}


def test_generate_file_answers_openai_batch_lines_in_openais_output_format(
    worker: WorkerProcess, redis_url: str, client: Client, no_eos: dict[int, float], tmp_path: Path
) -> None:
    bias = {str(k): v for k, v in no_eos.items()}
    lines = [
        _line(
            "chat", "/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 3, "logit_bias": bias}
        ),
        _line(
            "text",
            "/v1/completions",
            {"prompt": "Paris is", "max_tokens": 2, "logit_bias": bias, "logprobs": 1},
        ),
        _line("two", "/v1/chat/completions", {"messages": CHAT, "n": 2}),
        _line("tools", "/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}),
    ]
    src, out = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    cli = [sys.executable, "-m", "mlxq.producer.cli", "--redis-url", redis_url, "generate-file", str(src)]
    proc = subprocess.run(
        [*cli, "-o", str(out), "--temperature", "0"], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert proc.returncode == 1, proc.stderr  # two lines failed
    plain = [
        {"custom_id": "chat", "messages": CHAT, "max_tokens": 3},
        {"custom_id": "text", "prompt": "Paris is", "max_tokens": 2},
    ]
    want = {r["custom_id"]: r for r in _plain(client, plain, tmp_path, no_eos)}
    got = read_jsonl(out)
    assert [g["custom_id"] for g in got] == ["chat", "text"]
    chat, text = (g["response"] for g in got)
    assert all(g["id"].startswith("batch_req_") and g["error"] is None for g in got)
    assert chat["status_code"] == 200 and chat["body"]["object"] == "chat.completion"
    assert chat["body"]["choices"][0]["message"]["content"] == want["chat"]["text"]
    assert chat["body"]["usage"]["completion_tokens"] == 3 and chat["body"]["model"] == "m"
    for key, response in (("chat", chat), ("text", text)):  # OpenAI's usage on every output line
        usage, plain_usage = response["body"]["usage"], want[key]["usage"]
        assert usage["prompt_tokens"] == plain_usage["prompt_tokens"] > 0
        assert usage["completion_tokens"] == plain_usage["completion_tokens"] > 0
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert (
        text["body"]["object"] == "text_completion"
        and text["body"]["choices"][0]["text"] == want["text"]["text"]
    )
    lp = text["body"]["choices"][0][
        "logprobs"
    ]  # offsets from the prompt's start (OpenAI's legacy completions)
    assert lp["text_offset"] == [len("Paris is") + len("".join(lp["tokens"][:i])) for i in range(2)]
    errors = read_jsonl(tmp_path / "out.errors.jsonl")
    assert [(e["custom_id"], e["response"]["status_code"]) for e in errors] == [("two", 400), ("tools", 400)]
    assert "`n` > 1" in errors[0]["response"]["body"]["error"]["message"]
    assert "tools" in errors[1]["response"]["body"]["error"]["message"]
    again = [*cli, "-o", str(out), "--no-retry-errors"]
    rerun = subprocess.run(again, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert "0 succeeded, 0 failed, 4 skipped" in rerun.stderr, rerun.stderr  # resumed by custom_id


def _plain(client: Client, rows: list[dict[str, Any]], tmp_path: Path, no_eos: dict[int, float]) -> list[Any]:
    out = tmp_path / "plain.jsonl"
    client.generate_dataset(rows, out, temperature=0.0, logit_bias=no_eos)
    return read_jsonl(out)


def test_score_file_answers_echo_logprobs_lines_as_the_gateway_does(
    worker: WorkerProcess, client: Client, tmp_path: Path
) -> None:
    prompts = ["Queues hold jobs.", "Workers take them, one after another."]
    lines = [
        _line(f"p{i}", "/v1/completions", {"prompt": p, "echo": True, "logprobs": 1, "max_tokens": 0})
        for i, p in enumerate(prompts)
    ]
    lines.append(_line("gen", "/v1/completions", {"prompt": "x", "max_tokens": 3}))
    src, out = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    summary = client.score_dataset(src, out, batch_format="openai")
    assert (summary.succeeded, summary.failed) == (2, 1)
    want = client.submit_score(
        [{"prompt": p, "prompt_logprobs": True, "token_texts": True, "top_logprobs": 1} for p in prompts]
    ).result(timeout=60)
    for g, row in zip(read_jsonl(out), want.rows, strict=True):
        pl = row.prompt_logprobs
        assert pl is not None and pl.texts is not None
        (choice,) = g["response"]["body"]["choices"]
        assert choice["text"] == "".join(pl.texts) and choice["logprobs"]["tokens"] == pl.texts
        assert choice["logprobs"]["token_logprobs"][0] is None
        assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(pl.token_logprobs, abs=1e-6)
        assert choice["logprobs"]["text_offset"] == pl.offsets
    (error,) = read_jsonl(tmp_path / "out.errors.jsonl")
    assert error["custom_id"] == "gen" and "generate-file" in error["response"]["body"]["error"]["message"]
