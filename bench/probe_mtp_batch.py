"""Probe (to be deleted): a step's MTP proposals for B rows, row by row against drafting together.

Each row's prompt enters first; then every step each row's two newest positions (its pending token
and one kept draft) are entered and it proposes. Row by row: a batch-1 cache a row, a forward and an
`.item()` each (what `MtpDrafter` did before `MtpBatch`); together: `MtpBatch.propose`, one forward
and one read for all rows. Prints the median ms a step of each.

    python bench/probe_mtp_batch.py [rows] [steps]
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from bench.checkpoints import checkpoint
from mlxq.worker.engine import Engine, EngineOptions
from mlxq.worker.engine.cache.kv_cache import KVCache
from mlxq.worker.engine.speculation.drafter import RowToDraft
from mlxq.worker.engine.speculation.mtp import MtpDraft
from mlxq.worker.engine.speculation.mtp_batch import MtpDrafter, ShiftedCache


def main(rows: int = 8, steps: int = 60) -> None:
    folder = checkpoint("tiny-deepseek-mtp", Path(tempfile.mkdtemp()))
    engine = Engine.load(str(folder), EngineOptions(speculation="mtp", dtype="float32"))
    draft = engine.draft_choice.draft
    assert isinstance(draft, MtpDraft)
    rng = random.Random(0)
    vocab = draft.target.args.vocab_size
    prompt = 64
    seqs = [[rng.randrange(vocab) for _ in range(prompt + 2 * steps + 2)] for _ in range(rows)]
    feats = [draft.features(s) for s in seqs]
    mx.eval(feats)

    # row by row
    caches = [ShiftedCache(KVCache()) for _ in range(rows)]
    alone: list[float] = []
    for step in range(steps):
        n = prompt + 2 * step  # positions entered after this step: n, tokens n + 1
        t = time.perf_counter()
        for s, f, c in zip(seqs, feats, caches, strict=True):
            start = c.inner.offset
            out = draft.outputs(s[start + 1 : n + 1], f[:, start:n], c)
            int(mx.argmax(draft.target.logits(out[0, -1])).item())
        alone.append(time.perf_counter() - t)

    # together
    batch = draft.draft_batch()
    drafters = [MtpDrafter(draft) for _ in range(rows)]
    for d, s, f in zip(drafters, seqs, feats, strict=True):
        d.take_features(0, f[:, :prompt], s[:prompt])
    together: list[float] = []
    for step in range(steps):
        n = prompt + 2 * step
        if step:
            for d, s, f in zip(drafters, seqs, feats, strict=True):
                d.take_features(n - 2, f[:, n - 2 : n], s[: n - 1])
        t = time.perf_counter()
        batch.propose([RowToDraft(d, s[: n + 1], 1) for d, s in zip(drafters, seqs, strict=True)])
        together.append(time.perf_counter() - t)
    engine.close()
    for name, times in (("row by row", alone), ("together", together)):
        steady = times[1:]  # the first step enters the prompts
        print(
            f"{name}: rows={rows} median {1e3 * statistics.median(steady):.2f} ms a step "
            f"(min {1e3 * min(steady):.2f}, first {1e3 * times[0]:.1f})"
        )


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
