"""A separate draft model: a smaller (or quantized) causal LM with the target's tokenizer drafts tokens
greedily, and the target's verify step keeps those it agrees with.

Where a draft lives: a `draft/` folder beside the target's files (as the ollama runner stores one), or
a folder named by the worker's setting (`EngineOptions.draft_model`). Which code builds it: a registry
keyed by the draft config's `architectures[0]`, like the targets'; an ordinary causal LM (any target
architecture) is built and loaded by the target's own loader, and drafter kinds with a layout of their
own register a loader here (DFlash's block diffusion, `dflash.py`, fed the target's hidden states).
Whatever the kind, a loaded draft is a `DraftSource`: it makes one drafter per row and names the target
layers whose outputs its drafters read (none for a draft model).

A draft model's rows of one generation batch draft together (`draft_batch.py`): one batch cache of
the draft model holds every row's tokens, caught up with the row's tokens before each proposal (one
forward for all rows) and rolled back to the tokens the target kept after it; each drafted token is
one forward for all rows. Each row's drafter (`DraftModelDrafter`) is its row of that batch. Where the
engine pads shapes (a GPU: `DraftTarget.pad_shapes`) the catch-up forward reads whole steps of that
cache, as the target's verify step does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from mlxq.worker.engine.models import supported_architectures
from mlxq.worker.engine.models.base import Model
from mlxq.worker.engine.models.loader import load_config, load_model
from mlxq.worker.engine.speculation.draft_batch import DraftModelBatch, DraftModelDrafter
from mlxq.worker.engine.speculation.drafter import Drafter
from mlxq.worker.engine.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class DraftTarget:
    """What a draft is loaded for: the target model and tokenizer, the dtype setting, the prefill chunk,
    and whether the engine pads shapes (a GPU: `shapes.padded_size`; its draft's batched forwards then
    read whole steps of their caches)."""

    model: Model
    tokenizer: Tokenizer
    dtype: str | None = None
    prefill_chunk: int = 2048
    pad_shapes: bool = False


class DraftSource(Protocol):
    """A loaded draft of any kind: the drafters of its rows share it."""

    @property
    def folder(self) -> Path: ...

    @property
    def taps(self) -> tuple[int, ...]:
        """The target layers whose outputs its drafters read (`DecodeBatch.taps`); () for none."""
        ...

    @property
    def max_depth(self) -> int | None:
        """Most tokens one proposal holds, None for no bound of its own."""
        ...

    def drafter(self) -> Drafter:
        """A drafter for one row."""
        ...


DraftLoader = Callable[[Path, DraftTarget], DraftSource]

_DRAFT_REGISTRY: dict[str, DraftLoader] = {}


def register_draft(name: str, loader: DraftLoader) -> None:
    """Make draft checkpoints whose `architectures[0]` is `name` loadable by `loader(folder, target)`."""
    _DRAFT_REGISTRY[name] = loader


def load_draft(folder: Path, target: DraftTarget) -> DraftSource:
    """The draft in `folder`: its `architectures[0]` through the draft registry, else a causal LM the
    target loader builds (`DraftModel`); `DraftMismatch` when it cannot draft for this target."""
    config = load_config(folder)
    name = str((config.get("architectures") or ["<none>"])[0])
    if name in _DRAFT_REGISTRY:
        return _DRAFT_REGISTRY[name](folder, target)
    if name in supported_architectures():
        return DraftModel.load(
            folder, target.tokenizer, target.dtype, target.prefill_chunk, target.pad_shapes
        )
    raise DraftMismatch(
        f"the draft model in {folder} is a {name}, which mlxq cannot draft with; "
        f"supported: {', '.join(draft_architectures())}"
    )


def draft_architectures() -> list[str]:
    """Every architecture a draft may have: the draft registry's and every target architecture."""
    return sorted({*_DRAFT_REGISTRY, *supported_architectures()})


class DraftMismatch(ValueError):
    """A draft model that cannot draft for this target (its tokenizer differs, or it cannot be built)."""


def draft_folder(target: Path, setting: str | None) -> Path | None:
    """The draft's folder: the one the setting names, else a `draft/` folder beside the target's files
    holding a config.json; None when there is neither."""
    if setting:
        folder = Path(setting)
        if not (folder / "config.json").is_file():
            raise DraftMismatch(f"the draft model folder {folder} has no config.json")
        return folder
    beside = target / "draft"
    return beside if (beside / "config.json").is_file() else None


@dataclass(eq=False)
class DraftModel:
    """A loaded draft model, checked against its target's tokenizer; the `DraftBatchSource` of its rows
    (a generation batch keeps one `DraftModelBatch` per draft: compared by identity); `pad_shapes`: the
    engine's (its batches' forwards then read whole steps: `DraftModelBatch`)."""

    model: Model
    folder: Path
    prefill_chunk: int = 2048
    pad_shapes: bool = False

    taps: tuple[int, ...] = ()  # it reads none of the target's hidden states
    max_depth: int | None = None

    @classmethod
    def load(
        cls,
        folder: Path,
        target: Tokenizer,
        dtype: str | None = None,
        prefill_chunk: int = 2048,
        pad_shapes: bool = False,
    ) -> DraftModel:
        """Load the causal LM in `folder` with the target loader; `DraftMismatch` when its vocabulary is
        not the target tokenizer's. With `pad_shapes` its forwards over a cached prefix (a long prompt's
        chunks) read whole steps of keys, as the target's do (`bucket_keys`)."""
        model, _ = load_model(folder, dtype=dtype)
        _check_vocabulary(folder, target, model)
        model.bucket_keys = pad_shapes
        return cls(model, folder, prefill_chunk, pad_shapes)

    def drafter(self) -> DraftModelDrafter:
        """A drafter for one row: its row of the batch it drafts in."""
        return DraftModelDrafter(self)

    def draft_batch(self) -> DraftModelBatch:
        """A new, empty batch of this draft's rows."""
        return DraftModelBatch(self.model, self.prefill_chunk, self.pad_shapes)


def _check_vocabulary(folder: Path, target: Tokenizer, model: Model) -> None:
    """The draft must speak the target's token ids: its tokenizer (if it ships one) maps every token to
    the same id, and its embedding covers the target's ids."""
    if (folder / "tokenizer.json").is_file():
        own = Tokenizer.from_dir(folder).backend.get_vocab(with_added_tokens=True)
        if own != target.backend.get_vocab(with_added_tokens=True):
            raise DraftMismatch(
                f"the draft model in {folder} has another tokenizer than the target "
                f"({len(own)} tokens against {target.vocab_size}, or the same tokens under other ids): "
                "a draft must use the target's tokenizer"
            )
    if model.args.vocab_size < target.vocab_size:
        raise DraftMismatch(
            f"the draft model in {folder} knows {model.args.vocab_size} token ids, the target's tokenizer "
            f"{target.vocab_size}: a draft must use the target's tokenizer"
        )
