"""Probe (to be deleted): what the warm-up costs with and without a drafter (forwards, seconds).

Tiny random checkpoints (the test models), padded shapes forced on, the worker's default warm-up shapes
(8 sequences, key columns up to 1,024) and policy (max_batch 8, retry_every 16), prefill chunk 2,048.
Prints each part's wall seconds, the process's CPU seconds, and the forwards of the target, the draft
model and the MTP layer it ran. Run: `python -m bench.probe_draft_warm_up`.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from bench.checkpoints import checkpoint
from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.engine.draft_warm_up import warm_drafts
from mlxq.worker.engine.speculation.draft_model import DraftModel
from mlxq.worker.engine.speculation.mtp import MtpDraft
from mlxq.worker.engine.warm_up import WarmUpShapes, warm_up
from mlxq.worker.modelfiles.tiny_model import write_random_checkpoint


def _counted(obj: Any) -> list[int]:
    calls = [0]

    class Counted(type(obj)):  # type: ignore[misc]
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return super().__call__(*args, **kwargs)

    obj.__class__ = Counted
    return calls


def main() -> None:
    root = Path(tempfile.mkdtemp())
    target = write_random_checkpoint(root / "target", {"max_position_embeddings": 4096})
    draft = write_random_checkpoint(
        root / "draft", {"max_position_embeddings": 4096, "num_hidden_layers": 2}, seed=3
    )
    mtp = checkpoint("tiny-deepseek-mtp", root)
    runs: list[tuple[str, Path, dict[str, Any]]] = [
        ("off", target, {}),
        ("prompt_lookup", target, {"speculation": "prompt_lookup"}),
        ("draft_model", target, {"speculation": "draft_model", "draft_model": str(draft)}),
        ("mtp off", mtp, {}),
        ("mtp", mtp, {"speculation": "mtp"}),
    ]
    for name, model, options in runs:
        engine = Engine.load(str(model), EngineOptions(pad_shapes=True, dtype="float32", **options))
        target_calls = _counted(engine.model.model)
        source = engine.draft_choice.draft
        draft_calls = [0]
        if isinstance(source, DraftModel):
            draft_calls = _counted(source.model.model)
        elif isinstance(source, MtpDraft):
            draft_calls = _counted(source.layer)
        cpu = time.process_time()
        parts = warm_up(engine, WarmUpShapes())
        cpu = time.process_time() - cpu
        print(
            f"{name:14s} total={sum(parts.values()):6.2f}s cpu={cpu:6.2f}s "
            + " ".join(f"{k}={v:.2f}" for k, v in parts.items())
            + f" | target forwards={target_calls[0]} draft forwards={draft_calls[0]}",
            flush=True,
        )
        if "drafts" in parts:  # the drafts part alone, again: its proposals and the draft's forwards
            draft_calls[0] = 0
            proposals = warm_drafts(engine, 8, WarmUpShapes().verify_columns)
            print(f"{'':14s} drafts part: {proposals} proposals, {draft_calls[0]} draft forwards", flush=True)
        engine.close()


if __name__ == "__main__":
    main()
