"""lm-evaluation-harness through the queue: `mlxq eval --model mlxq` against lm-eval's own `--model hf`.

Both run lm-eval's command line on the same tiny random-weight checkpoint (float32) over local tasks
(YAML over JSONL files written here: nothing is downloaded): a multiple-choice task
(`loglikelihood`, a shared preamble, continuations of several tokens, one with an empty context), a
perplexity task (`loglikelihood_rolling`, texts longer than the context) and a greedy generation task
(`generate_until`). mlxq's side goes through real Redis to a real worker process. Per-request
loglikelihoods agree within 1e-4, generated texts are equal, and so are the metrics.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from worker_process import ROOT, WorkerProcess

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

QUESTIONS = [
    ("what do queues hold?", ["jobs", "cats and dogs", "the sea", "nothing at all"], 0),
    ("what runs the jobs?", ["a worker", "the moon", "red paint", "seven"], 0),
    ("where do results go?", ["to Redis", "into a hat", "up", "away from here"], 0),
    ("what is shared?", ["a prefix", "a sandwich", "blue", "no idea"], 0),
    ("", ["Hello", "Goodbye world"], 1),
]
TEXTS = [
    "Workers keep a model loaded and score rows by shared prefix, all day long. " * 5,
    "A short text.",
    "Queues hold jobs; producers add them and workers take them, one after another. " * 4,
]

MC_TASK = """task: mlxq_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{ 'Answer briefly. Question: ' + question + ' Answer:' if question else '' }}}}"
doc_to_choice: "{{{{ choices }}}}"
doc_to_target: "{{{{ answer }}}}"
target_delimiter: " "
metric_list:
  - metric: acc
"""

PPL_TASK = """task: mlxq_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{ text }}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


GEN_TASK = """task: mlxq_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{ question }}}} Answer:"
doc_to_target: "{{{{ choices[answer] }}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""
TASKS = ("mlxq_mc", "mlxq_ppl", "mlxq_gen")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from reference import make_hf_checkpoint

    return make_hf_checkpoint(tmp_path_factory.mktemp("hf"), "LlamaForCausalLM", max_position_embeddings=64)


def _tasks(folder: Path) -> Path:
    tasks = folder / "tasks"
    tasks.mkdir()
    mc, ppl = folder / "mc.jsonl", folder / "ppl.jsonl"
    mc.write_text(
        "".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS)
    )
    ppl.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    (tasks / "mlxq_mc.yaml").write_text(MC_TASK.format(data=mc))
    (tasks / "mlxq_ppl.yaml").write_text(PPL_TASK.format(data=ppl))
    (tasks / "mlxq_gen.yaml").write_text(GEN_TASK.format(data=mc))
    return tasks


def _run(cmd: list[str], folder: Path, name: str) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """Run an lm-eval command line; its metrics by task, and its samples' responses by task."""
    out = folder / name
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(folder / "datasets-cache"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    flags = ["--tasks", ",".join(TASKS), "--include_path", str(folder / "tasks")]
    flags += ["--output_path", str(out), "--log_samples", "--batch_size", "1"]
    done = subprocess.run([*cmd, *flags], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    samples = {}
    for task in TASKS:
        lines = next(out.rglob(f"samples_{task}_*.jsonl")).read_text().splitlines()
        docs = sorted((json.loads(line) for line in lines), key=lambda s: s["doc_id"])
        samples[task] = [d["resps"] for d in docs]
    return results, samples


def _numbers(value: Any) -> list[float | bool]:
    if isinstance(value, list | tuple):
        return [x for v in value for x in _numbers(v)]
    if isinstance(value, str):  # lm-eval writes some floats as strings in samples
        return [value == "True"] if value in ("True", "False") else [float(value)]
    return [value]


def test_mlxq_eval_matches_lm_evals_own_hf_backend(checkpoint: Path, redis_url: str, tmp_path: Path) -> None:
    _tasks(tmp_path)
    hf_results, hf_samples = _run(
        [sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--device", "cpu",
         "--model_args", f"pretrained={checkpoint},dtype=float32"],
        tmp_path,
        "hf",
    )  # fmt: skip
    worker = WorkerProcess(checkpoint, redis_url, tmp_path / "worker.log", "--queue", "evalq")
    try:
        worker.wait_ready()
        mlxq_results, mlxq_samples = _run(
            [sys.executable, "-m", "mlxq.producer.cli", "--redis-url", redis_url, "eval",
             "--model", "mlxq", "--model_args", "queue=evalq,rows_per_job=3"],
            tmp_path,
            "mlxq",
        )  # fmt: skip
    finally:
        worker.stop()
    for task in ("mlxq_mc", "mlxq_ppl"):
        assert len(mlxq_samples[task]) == len(hf_samples[task]) > 0
        for got, want in zip(mlxq_samples[task], hf_samples[task], strict=True):
            got_n, want_n = _numbers(got), _numbers(want)
            assert [type(x) for x in got_n] == [type(x) for x in want_n]
            assert got_n == pytest.approx(want_n, abs=1e-4)
    # generate_until: greedy, so the same text, cut at the same `until` strings.
    assert mlxq_samples["mlxq_gen"] == hf_samples["mlxq_gen"]
    assert any(r[0][0] for r in hf_samples["mlxq_gen"])  # something was generated
    assert mlxq_results["mlxq_mc"]["acc,none"] == hf_results["mlxq_mc"]["acc,none"]
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert mlxq_results["mlxq_ppl"][metric] == pytest.approx(hf_results["mlxq_ppl"][metric], rel=1e-4)
    # The perplexity texts are longer than the 64-token context: several windows each.
    assert len(TEXTS[0]) > 4 * 64
