"""The real SmolLM2-135M-Instruct scored by mlxq against transformers, on the same weights (slow).

The model ships as a GGUF file (Q4_1 weights, a Q8_0 token embedding that is also the LM head).
transformers reads it with its own `gguf_file=` loader: its own dequantization (through gguf-py), its own
undoing of llama.cpp's Q/K row permutation and its own tokenizer built from the GGUF's metadata, in
float32. mlxq serves its default import of the same file (`default_model_dir`), which keeps every
weight in bfloat16, and computes in float32 on the CPU.

So the two hold the same weights once transformers' are rounded to bfloat16 (nearest, ties to even, as
the import rounds): then per-token logprobs agree to float32 accuracy. 5e-4 leaves room for float32
sums over 30 layers and a 49,152-way log-softmax (seen: at most ~2e-4; the tiny models' 1e-4 is for two
layers and a 384-token vocabulary). Against transformers' unrounded float32 weights the gap is the
import's bfloat16 rounding (8 significant bits, up to 2^-9 relative per weight): seen at most ~0.03 a
token; 0.1 a token and 0.02 on average bound it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from mlxq.jobs.schema import ScoreRequest
from mlxq.worker.engine import Engine
from mlxq.worker.modelfiles.default_model import default_gguf_path, default_model_dir

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "def add(a, b):\n    return a + b\n",
    "<|im_start|>user\nWhat do queues hold?<|im_end|>\n<|im_start|>assistant\nJobs, waiting for workers.",
]
SAME_WEIGHTS = 5e-4
BF16_GAP, BF16_MEAN_GAP = 0.1, 0.02


@pytest.fixture(scope="module")
def hf_gguf() -> tuple[Any, Any]:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    path = default_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.eval(), tokenizer


def _reference(model: Any, ids: list[int]) -> np.ndarray:
    """Each prompt token's logprob after the tokens before it (float64 log-softmax of the logits)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits, dim=-1).numpy()
    return np.array([lp[i, t] for i, t in enumerate(ids[1:])])


def test_prompt_logprobs_match_transformers_reading_the_gguf(hf_gguf: tuple[Any, Any]) -> None:
    import torch

    model, tokenizer = hf_gguf
    engine = Engine.load(str(default_model_dir()))
    request = ScoreRequest.model_validate(
        {"rows": [{"prompt": p, "prompt_logprobs": True} for p in PROMPTS], "allow_special_tokens": True}
    )
    got = engine.score(request).rows
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    assert ids == [tokenizer.encode(p) for p in PROMPTS]  # the GGUF's tokenizer, read by each side
    unrounded = [_reference(model, i) for i in ids]
    with torch.no_grad():  # the import's weights: transformers' float32 ones rounded to bfloat16
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    same = [_reference(model, i) for i in ids]
    for row, prompt_ids, want, loose in zip(got, ids, same, unrounded, strict=True):
        assert row.prompt_logprobs is not None
        assert row.prompt_logprobs.tokens == prompt_ids[1:]
        mine = np.array(row.prompt_logprobs.token_logprobs)
        assert np.abs(mine - want).max() < SAME_WEIGHTS
        gap = np.abs(mine - loose)
        assert gap.max() < BF16_GAP and gap.mean() < BF16_MEAN_GAP
        assert mine.mean() < -0.5  # a real model on real text: neither empty nor degenerate
