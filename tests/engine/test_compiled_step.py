"""A flat decode step through compiled layer parts (`compiled_steps`, `models/compiled_step.py`):
float32 on the CPU, every step's logits are the same bits as the plain step's, whoever joins and
leaves, on the mask and the ragged attention paths, for the Llama family's layouts: the dense ones
whose parts one trace serves (plain, Qwen2's q/k/v biases, a sliding window, Qwen3's per-head norms),
and those whose layers' own modules are compiled (Qwen3-MoE's and Mixtral's experts, 4-bit quantized
folders of a dense and a MoE model); the compiled parts trace again only when the batch's rows change;
models that do not qualify (Gemma 3's blocks) load and decode as without the option.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from engines import closed_after_test, run_requests

from mlxq.jobs.schema import GenerateRequest, GenerateResult
from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.engine.decode_batch import DecodeBatch
from mlxq.worker.engine.device import compiled_steps_by_default, on_cuda
from mlxq.worker.engine.models import moe
from mlxq.worker.engine.models.compiled_step import CompiledStep
from mlxq.worker.engine.models.loader import load_model, save_quantized
from mlxq.worker.engine.prefill import prefill
from mlxq.worker.engine.sampler import Sampler
from mlxq.worker.modelfiles.tiny_model import write_random_checkpoint

PROMPT = "The capital of France is Paris. "

LAYOUTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2_biases": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"},
    "mistral_window": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 8},
    # Qwen3's heads are wider than hidden / heads (Qwen3-30B-A3B: 32 heads of 128 over a hidden 2,048):
    # attention's output is wider than the residual it is projected back onto.
    "qwen3_qk_norm": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 32},
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "head_dim": 32,
        "num_experts": 5,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
    },
    "mixtral": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_local_experts": 5,
        "num_experts_per_tok": 2,
    },
}
# Layouts also written 4-bit (group 32) as `save_quantized` writes mlx-community's folders.
QUANTIZED = ("llama", "qwen3_moe")
# Whose parts one trace serves (`_SharedParts`); the others' layers are compiled each (`_LayerParts`).
SHARED = ("llama", "qwen2_biases", "mistral_window", "qwen3_qk_norm")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    made = {
        name: write_random_checkpoint(tmp_path_factory.mktemp(name), config)
        for name, config in LAYOUTS.items()
    }
    for name in QUANTIZED:
        model, config = load_model(made[name])
        out = tmp_path_factory.mktemp(f"{name}_q4")
        made[f"{name}_q4"] = save_quantized(model, config, out, bits=4, group_size=32, copy_from=made[name])
    return made


def _engine(folder: Path, compiled: bool, **options: Any) -> Engine:
    opts = EngineOptions(prefill_chunk=16, prefix_cache_bytes=0, compiled_steps=compiled, **options)
    return closed_after_test(Engine.load(str(folder), opts))


def _steps(engine: Engine, kernel: bool) -> tuple[list[list[int]], list[mx.array], list[tuple[int, int]]]:
    """Three rows of different lengths decode, a fourth joins, one leaves: each step's tokens, its
    logits, and each compiled step's (buffer rows, traces after it)."""
    model = engine.model
    ids = engine.tokenizer.encode(PROMPT * 20)

    def prefilled(lengths: tuple[int, ...]) -> tuple[list[Any], mx.array, list[Sampler]]:
        caches = [model.make_cache() for _ in lengths]
        logits = [prefill(model, ids[:n], c, chunk=64) for n, c in zip(lengths, caches, strict=True)]
        return (
            caches,
            mx.concatenate(logits),
            [Sampler(model.args.vocab_size, temperature=0) for _ in lengths],
        )

    batch = DecodeBatch(model, ragged_kernel=kernel)
    batch.add(*prefilled((5, 23, 40)))
    made: list[mx.array] = []
    real = batch.forward.logits

    def kept(*args: Any, **kwargs: Any) -> mx.array:
        made.append(real(*args, **kwargs))
        return made[-1]

    batch.forward.logits = kept  # type: ignore[method-assign]
    step, calls = model.model.compiled_step, []
    if step is not None:  # each compiled step's rows and the traces after it

        def counted(h: mx.array, *args: Any) -> mx.array:
            out = step(h, *args)
            calls.append((h.shape[0], step.traces))
            return out

        model.model.compiled_step = counted
    tokens = []
    for i in range(14):
        if i == 5:
            batch.add(*prefilled((12,)))
        if i == 9:
            batch.remove([1])
        tokens.append(batch.step())
    model.model.compiled_step = step
    mx.eval(made)
    return tokens, made, calls


@pytest.mark.parametrize("kernel", [False, True], ids=["mask", "ragged"])
@pytest.mark.parametrize("layout", [*LAYOUTS, *(f"{name}_q4" for name in QUANTIZED)])
def test_compiled_steps_give_the_same_logits_and_trace_again_only_for_other_rows(
    folders: dict[str, Path], layout: str, kernel: bool
) -> None:
    plain, compiled = _engine(folders[layout], False), _engine(folders[layout], True)
    assert plain.model.model.compiled_step is None
    step = compiled.model.model.compiled_step
    assert isinstance(step, CompiledStep)
    layers = len(compiled.model.layers)
    # one trace serves every plain layer (three functions); else each layer's own (one more: the last)
    assert step.parts.per_shape == (3 if layout in SHARED else layers + 1)
    tokens, logits, _ = _steps(plain, kernel)
    tokens_c, logits_c, calls = _steps(compiled, kernel)
    assert tokens == tokens_c
    assert len(logits) == len(logits_c)
    for a, b in zip(logits, logits_c, strict=True):
        assert a.dtype == mx.float32 and mx.array_equal(a, b).item()
    # each compiled function traced once for each number of rows it meets
    traced, seen = 0, set()
    for rows, traces in calls:
        traced += step.parts.per_shape if rows not in seen else 0
        seen.add(rows)
        assert traces == traced, calls
    assert len(calls) == len(logits) and len(seen) > 1


@pytest.mark.parametrize("layout", ["qwen3_moe", "qwen3_moe_q4"])
def test_compiled_moe_steps_sorting_pairs_by_expert_give_the_same_logits(
    folders: dict[str, Path], layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of many rows sorts its (token, expert) pairs by expert before the gathered matmuls
    (from `moe.SORT_FROM` pairs; here from 2, so that this batch's few rows take that path): inside the
    compiled parts, the same bits too."""
    monkeypatch.setattr(moe, "SORT_FROM", 2)
    plain, compiled = _engine(folders[layout], False), _engine(folders[layout], True)
    tokens, logits, _ = _steps(plain, kernel=True)
    tokens_c, logits_c, calls = _steps(compiled, kernel=True)
    assert tokens == tokens_c and calls
    for a, b in zip(logits, logits_c, strict=True):
        assert mx.array_equal(a, b).item()


def _every_expert(engine: Engine) -> None:
    """Every sparse layer multiplies every token by every expert from 2 pairs on (on MLX's CUDA build
    quantized experts do from as many pairs as experts: `moe.EVERY_EXPERT_FROM_ON_CUDA`)."""
    for layer in engine.model.layers:
        layer.feed_forward.switch_mlp.every_from, layer.feed_forward.switch_mlp.every_tokens = 2, 64


def test_compiled_quantized_moe_steps_through_every_expert_give_the_same_logits(
    folders: dict[str, Path],
) -> None:
    """A batch multiplying every token by every quantized expert and keeping its own (the path MLX's
    CUDA build takes for a few dozen rows through quantized experts the grouped experts' kernel does
    not serve), plain and inside the compiled parts: the same tokens and logits bits as the pairs'
    gathered matmuls."""
    pairs, every, compiled = (_engine(folders["qwen3_moe_q4"], c) for c in (False, False, True))
    _every_expert(every)
    _every_expert(compiled)
    tokens, logits, _ = _steps(pairs, kernel=True)
    for engine in (every, compiled):
        tokens_e, logits_e, _ = _steps(engine, kernel=True)
        assert tokens_e == tokens
        for a, b in zip(logits, logits_e, strict=True):
            assert mx.array_equal(a, b).item()


def _untimed(result: GenerateResult) -> dict[str, Any]:
    return result.model_dump(exclude={"timings"})


def _requests(engine: Engine, n: int, **fields: Any) -> list[GenerateRequest]:
    no_eos = {i: -100.0 for i in engine.tokenizer.eos_ids}
    return [
        GenerateRequest.model_validate(
            {
                "prompt": PROMPT * (1 + i % 4) + f"#{i}",
                "max_tokens": 6 + (i * 7) % 13,
                "logit_bias": no_eos,
                "temperature": 0.0 if i % 2 == 0 else 1.1,
                "seed": 7 + i,
                **fields,
            }
        )
        for i in range(n)
    ]


@pytest.mark.parametrize(
    ("layout", "options", "fields"),
    [
        ("llama", {}, {}),
        ("llama", {"speculation": "prompt_lookup"}, {}),
        ("llama", {}, {"response_format": {"type": "regex", "regex": "[0-9]{2}-[a-z]{3,9}"}}),
        ("qwen3_moe_q4", {"speculation": "prompt_lookup"}, {}),
    ],
    ids=["plain", "prompt_lookup", "constrained", "moe_q4_prompt_lookup"],
)
def test_requests_joining_and_leaving_decode_the_same_with_compiled_steps(
    folders: dict[str, Path], layout: str, options: dict[str, Any], fields: dict[str, Any]
) -> None:
    if "response_format" in fields:
        pytest.importorskip("llguidance")  # the worker's `structured` extra
    plain = _engine(folders[layout], False, **options)
    compiled = _engine(folders[layout], True, **options)
    requests = _requests(plain, 6, **fields)
    expected = run_requests(plain, requests, max_sequences=3, one_per_step=True)
    got = run_requests(compiled, requests, max_sequences=3, one_per_step=True)
    assert [_untimed(r) for r in got] == [_untimed(r) for r in expected]
    assert compiled.model.model.compiled_step.traces > 0


def test_models_whose_layers_do_not_qualify_decode_as_without_the_option(tmp_path: Path) -> None:
    config = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "head_dim": 32}
    folder = write_random_checkpoint(tmp_path, config)
    plain, compiled = _engine(folder, False), _engine(folder, True)
    assert compiled.model.model.compiled_step is None
    requests = _requests(plain, 3)
    got, expected = (run_requests(e, requests, max_sequences=3) for e in (compiled, plain))
    assert [_untimed(r) for r in got] == [_untimed(r) for r in expected]


def test_compiled_steps_follow_the_device_unless_set(folders: dict[str, Path]) -> None:
    """Unset, a Llama-family model compiles its decode steps with MLX's CUDA and CPU builds (not on
    Metal); set, as said."""
    assert compiled_steps_by_default() == (on_cuda() or mx.default_device().type == mx.DeviceType.cpu)
    opts = EngineOptions(prefill_chunk=16, prefix_cache_bytes=0)
    default = closed_after_test(Engine.load(str(folders["llama"]), opts))
    assert (default.model.model.compiled_step is not None) == compiled_steps_by_default()
    assert _engine(folders["llama"], True).model.model.compiled_step is not None
    assert _engine(folders["llama"], False).model.model.compiled_step is None
