"""Probe (to be deleted): a draft model's proposals for 8 rows, batched (`DraftModelBatch`) against each
row alone with a batch-1 cache (how rows drafted before), split into the step rows join at (their
prompts prefilled) and the steps after (a few tokens caught up, then depth - 1 one-token forwards).

    python -m bench.probe_draft_batch [MODEL_DIR] [ROWS] [DEPTH] [STEPS]
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import mlx.core as mx

from bench.fig_speculation import COPY_HEAVY
from mlxq.worker.engine.prefill import prefill
from mlxq.worker.engine.speculation.draft_batch import DraftModelDrafter
from mlxq.worker.engine.speculation.draft_model import DraftModel
from mlxq.worker.engine.speculation.drafter import RowToDraft
from mlxq.worker.engine.text.tokenizer import Tokenizer


class Alone:
    """A row drafting alone (the drafter before `draft_batch.py`)."""

    def __init__(self, draft: DraftModel) -> None:
        self.model, self.chunk, self.cache = draft.model, draft.prefill_chunk, draft.model.make_cache()

    def propose(self, tokens: list[int], depth: int) -> list[int]:
        logits = prefill(self.model, tokens[self.cache[0].offset :], self.cache, self.chunk)
        out: list[int] = []
        while True:
            out.append(int(mx.argmax(logits, axis=-1).item()))
            if len(out) == depth:
                return out
            logits = self.model(mx.array([[out[-1]]], dtype=mx.int32), cache=self.cache)[:, -1, :]

    def accepted(self, proposed: int, kept: int) -> None:
        for layer in self.cache:
            layer.trim(max(0, proposed - 1 - kept))


def main() -> None:
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path.home() / ".cache/mlxq/bench-models/tiny"
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    depth = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 20
    tokenizer = Tokenizer.from_dir(folder)
    draft = DraftModel.load(folder, tokenizer)
    prompts = [tokenizer.encode(COPY_HEAVY[i % len(COPY_HEAVY)]) for i in range(rows)]
    print(f"model {folder.name} rows {rows} depth {depth} prompt tokens {[len(p) for p in prompts]}")
    for turn in range(3):
        for way in ("alone", "batched"):
            rng = random.Random(turn)
            tokens = [list(p) for p in prompts]
            batch = draft.draft_batch()
            batched = [DraftModelDrafter(draft) for _ in prompts]
            alone = [Alone(draft) for _ in prompts]
            times: list[float] = []
            for _ in range(steps):
                t0 = time.perf_counter()
                if way == "batched":
                    got = batch.propose([RowToDraft(d, t, depth) for d, t in zip(batched, tokens, strict=True)])
                else:
                    got = [a.propose(t, depth) for a, t in zip(alone, tokens, strict=True)]
                times.append(time.perf_counter() - t0)
                for i, drafts in enumerate(got):
                    kept = rng.randint(0, depth)
                    (batched[i] if way == "batched" else alone[i]).accepted(depth, kept)
                    tokens[i] = [*tokens[i], *drafts[:kept], rng.randrange(draft.model.args.vocab_size)]
            later = sorted(times[1:])
            print(
                f"turn {turn} {way:8s} join step {1e3 * times[0]:7.2f} ms; later steps median "
                f"{1e3 * later[len(later) // 2]:6.2f} ms (min {1e3 * later[0]:6.2f})"
            )


if __name__ == "__main__":
    main()
