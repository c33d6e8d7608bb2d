"""Warming a drafter's batched forwards up: the shapes a draft model's or an MTP layer's rows meet first.

Where the engine pads shapes (a GPU) and drafts with a draft model or the target's MTP layer, a
generation batch's rows draft together (`DraftModelBatch`, `MtpBatch`), and their forwards of several
columns meet few shapes: widths padded, key columns read in whole cache steps. On MLX's CUDA build the
first forward of each shape builds its kernels and attention plans, many times the forward itself;
without this the first verify steps of a live batch (the draft gate's first probe of drafting) pay for
them. `warm_drafts` meets them on made-up rows, driven through the batch's own `propose` as a
generation's rows are (tokens of no meaning; an MTP row's target hidden states zeros):
- rows entering their prompts together: each number of rows that may join at once (padded to a power
  of two: a draft model's prefill, `prefill_rows`, and an MTP batch's entering forward add rows of
  padding), each width a prompt of up to a chunk is padded to (`join_widths`);
- the forward feeding a batch's rows what they lack since their last proposal: each number of rows
  the batch may hold (not padded), each width up to a lag of a retry's wait (`catch_up_widths`), each
  number of key columns up to `verify_columns`, as the verify steps are warmed (`warm_up.py`); and a
  draft model's one-token forward (a drafted token) for each number of rows.
A row that lags longer (drafting paused by the draft gate) or a longer context meets its shape live,
once. The batches are dropped after: nothing here changes what a job decodes.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from mlxq.worker.engine.cache.kv_cache import KVCache
from mlxq.worker.engine.engine import Engine
from mlxq.worker.engine.shapes import padded_size, padded_width
from mlxq.worker.engine.speculation.draft_model import DraftModel
from mlxq.worker.engine.speculation.drafter import RowToDraft
from mlxq.worker.engine.speculation.mtp import MtpDraft
from mlxq.worker.engine.speculation.mtp_batch import MtpDrafter
from mlxq.worker.engine.speculation.policy import DraftPolicy

BatchedDraft = DraftModel | MtpDraft


def drafts_to_warm(engine: Engine) -> BatchedDraft | None:
    """The engine's draft whose rows draft together, where it pads shapes; None where there is nothing
    to warm (no padding: every shape is new anyway and builds nothing; prompt lookup, DFlash)."""
    draft = engine.draft_choice.draft
    return draft if engine.pad_shapes and isinstance(draft, DraftModel | MtpDraft) else None


def join_widths(draft: BatchedDraft, chunk: int) -> list[int]:
    """The prompt lengths whose joins meet every width a prompt of up to `chunk` tokens enters in: a
    draft model's prefill pads to `padded_width`, an MTP batch's entering forward to a power of two
    (`padded_size`, at most `chunk`); one length a width, two tokens at least (one column reads
    exactly)."""
    pad = padded_width if isinstance(draft, DraftModel) else lambda n: padded_size(n, smallest=1)
    lengths, n = [], 2
    while n <= chunk:
        width = pad(n)
        lengths.append(min(width, chunk))
        n = width + 1
    return lengths


def catch_up_widths(policy: DraftPolicy) -> list[int]:
    """The padded widths of a batch's forward feeding its rows what they lack, up to a lag of a retry's
    wait: a drafting row lags its pending token and its last draft kept (two columns), one drafting
    nothing at steps where nobody drafts lags a step each, and a row whose drafts keep failing retries
    after `retry_every` such steps."""
    widest = padded_size(2 + policy.retry_every, smallest=1)
    return [1 << i for i in range(1, widest.bit_length())]


def warm_drafts(engine: Engine, max_rows: int, verify_columns: int) -> int:
    """Meet the drafter's shapes (see the module docstring) for batches of up to `max_rows` drafting
    rows (and the policy's `max_batch`) and key columns up to `verify_columns`; the proposals run."""
    draft = drafts_to_warm(engine)
    if draft is None:
        return 0
    policy = engine.options.draft_policy
    most = min(max_rows, policy.max_batch)
    vocab = min(engine.tokenizer.vocab_size, engine.model.args.vocab_size)
    proposals = 0
    together = sorted({padded_size(n, smallest=1) for n in range(1, most + 1)})  # rows joining at once
    chunk = min(engine.options.prefill_chunk, engine.context_length - 1)
    for rows in together:
        for length in join_widths(draft, chunk):
            _WarmRows(draft, rows, vocab).advance(length)
            proposals += 1
    step = KVCache.step
    widths = catch_up_widths(policy)
    while sum(widths) + 2 >= step:  # the rows' ends stay inside a cache step while they take them all
        widths.pop()
    margin = sum(widths) + 2
    steps = [s for s in range(1, verify_columns // step + 1) if s * step <= engine.context_length]
    for rows in range(1, most + 1):
        warm = _WarmRows(draft, rows, vocab)
        for s in steps:
            warm.advance(s * step - margin - warm.end)  # the first: the rows join
            for i, width in enumerate(widths):  # once, a drafted token's forward too (exact reads)
                warm.advance(width, depth=2 if i == 0 and s == steps[0] else 1)
            proposals += 1 + len(widths)
    return proposals


class _WarmRows:
    """Made-up rows of one draft batch of `draft`'s, fed through its `propose` as a generation's rows
    are: all rows alike, each proposal's drafts never kept."""

    def __init__(self, draft: BatchedDraft, rows: int, vocab: int) -> None:
        self.batch = draft.draft_batch()
        self.drafters = [draft.drafter() for _ in range(rows)]
        self.vocab = vocab
        self.end = 0  # tokens each row's cache holds after the last proposal
        self._features: Callable[[int], mx.array] | None = None
        if isinstance(draft, MtpDraft):  # the target's hidden states of the positions fed: zeros
            weight = draft.layer.eh_proj.weight  # (hidden, 2 x hidden)
            self._features = lambda n: mx.zeros((1, n, weight.shape[0]), dtype=weight.dtype)

    def advance(self, n: int, depth: int = 1) -> None:
        """Every row takes `n` more tokens, then all propose `depth` tokens (the first time: they join)."""
        tokens = [i % self.vocab for i in range(self.end + n)]
        if self._features is None:  # a draft model's rows: the latest token is fed too
            asked = [RowToDraft(d, tokens, depth) for d in self.drafters]
        else:  # an MTP row enters the positions whose hidden states it holds; the next one is pending
            for d in self.drafters:
                assert isinstance(d, MtpDrafter)
                d.take_features(self.end, self._features(n), tokens)
            asked = [RowToDraft(d, [*tokens, 0], depth) for d in self.drafters]
        self.batch.propose(asked)
        self.end += n
