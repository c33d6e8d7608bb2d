"""The baseline: mlx-lm (its loader, model code and `generate_step`) on the same checkpoint.

Only mlx-lm's public API is called here; nothing of it is copied into mlxq.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx


@dataclass
class MlxLm:
    model: Any
    dtype: str
    version: str

    @classmethod
    def load(cls, path: str, dtype: mx.Dtype | None = None) -> MlxLm:
        """`mlx_lm.load` on the HF folder; cast to `dtype` (mlxq's compute dtype) when they differ."""
        import mlx_lm
        from mlx.utils import tree_flatten

        model = _load_model(path)
        current = next(v.dtype for _, v in tree_flatten(model.parameters()))
        if dtype is not None and current != dtype:
            model.set_dtype(dtype)
            mx.eval(model.parameters())
        return cls(model, str(dtype or current).removeprefix("mlx.core."), mlx_lm.__version__)

    def generate_times(self, ids: list[int], max_tokens: int) -> tuple[float, list[float]]:
        """`generate_step` greedy (no EOS check there): start time and the time each token arrived."""
        from mlx_lm.generate import generate_step

        times = []
        t0 = time.perf_counter()
        for _token, _logprobs in generate_step(mx.array(ids), self.model, max_tokens=max_tokens):
            times.append(time.perf_counter())
        _sync()
        return t0, times

    def time_to_first_token(self, ids: list[int]) -> float:
        """Prefill `ids` and produce the first (greedy) token; seconds."""
        from mlx_lm.generate import generate_step

        gen = generate_step(mx.array(ids), self.model, max_tokens=1)
        t0 = time.perf_counter()
        next(gen)
        dt = time.perf_counter() - t0
        gen.close()
        _sync()  # the step it queued behind the first token must not spill into the next timing
        return dt

    def last_logits(self, ids: list[int], full: bool) -> mx.array:
        """One forward over the whole prompt, no cache. `full`: the LM head on every position, as
        `model(ids)` does; else only on the last one."""
        x = mx.array(ids)[None]
        if full:
            return self.model(x)[0, -1].astype(mx.float32)
        return self._head(self.model.model(x)[:, -1])[0].astype(mx.float32)

    def _head(self, hidden: mx.array) -> mx.array:
        # mlx-lm's models drop their lm_head where it is tied (Gemma 3's says so on the model, not args)
        if "lm_head" not in self.model:
            return self.model.model.embed_tokens.as_linear(hidden)
        return self.model.lm_head(hidden)

    def shared_prefix_logits(self, prefix: list[int], suffixes: list[list[int]]) -> mx.array:
        """The ideal plan in plain MLX: the prefix once into mlx-lm's cache, then every suffix (all the
        same length) in one batch on copies of it; LM head on the last positions only. (B, vocab)."""
        from mlx_lm.models.cache import KVCache, make_prompt_cache

        cache = make_prompt_cache(self.model)
        self.model.model(mx.array(prefix)[None], cache=cache)
        mx.eval([c.state for c in cache])
        batch = []
        for c in cache:
            k, v = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
            b = KVCache()
            b.state = (mx.repeat(k, len(suffixes), axis=0), mx.repeat(v, len(suffixes), axis=0), c.offset)
            batch.append(b)
        hidden = self.model.model(mx.array(suffixes), cache=batch)
        return self._head(hidden[:, -1]).astype(mx.float32)


def _sync() -> None:
    """Wait for mlx-lm's own generation stream as well as the default one."""
    from mlx_lm.generate import generation_stream

    mx.synchronize(generation_stream)
    mx.synchronize()


def _load_model(path: str) -> Any:
    """mlx-lm's model for the folder at `path`. A checkpoint with an MTP layer of a model shape other
    than DeepSeek-V3's own (mlx-lm drops only layer 61's weights) is loaded leaving its extra weights
    out (`mlx_lm.utils.load_model(strict=False)`): mlx-lm decodes without it."""
    import json
    from pathlib import Path

    import mlx_lm
    from mlx_lm.utils import load_model

    config = json.loads((Path(path) / "config.json").read_text())
    if config.get("num_nextn_predict_layers"):
        model, _config = load_model(Path(path), strict=False)
        return model
    model, _tokenizer = mlx_lm.load(path)
    return model
