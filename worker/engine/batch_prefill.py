"""A generation batch's prefill: its waiting requests, and the prompts it prefills until they decode.

`BatchPrefill` owns the requests admitted but not started (`waiting`: the KV budget has no room for
them yet) and the long prompt being prefilled alone (`prefilling`). At each of the batch's steps it
drops the waiting requests that were cancelled, then prefills about one chunk of prompt tokens (more
while no request decodes): several short prompts together in one forward, or a long one chunk by
chunk; which waiting requests start, and which together, is its `PrefillPlan`'s (`prefill_plan.py`).
A prefilled prompt joins the batch's decoding rows. Only its `GenerationBatch` touches it: the batch
admits requests into `waiting`, calls it once a step, and hands it its decoding side (`DecodingRows`),
how it finishes a request and how it words an allocation failure.

A prompt whose drafter reads the target's hidden states (`FeatureReader`: MTP, DFlash) is prefilled with
the drafter's layers tapped (`Engine.draft_taps`), and the drafter is handed their outputs for the
prompt's positions as they are computed (`take_features`), as the decode batch hands it every later
forward's: it never runs the target over a prompt the batch prefilled. What the prefix cache gave a
prompt was never run here, so its drafter computes those positions' features itself when it first
proposes. A forward with no such prompt taps nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from mlxq.jobs.errors import OutOfMemory
from mlxq.jobs.schema import FinishReason
from mlxq.worker.engine.batch_sequence import Finished, _Sequence
from mlxq.worker.engine.cache.kv_cache import KVCache
from mlxq.worker.engine.cache.prefill_rows_cache import PrefillRowsCache
from mlxq.worker.engine.decode_batch import DecodeBatch
from mlxq.worker.engine.engine import Engine
from mlxq.worker.engine.memory_guard import is_out_of_memory, with_memory_retry
from mlxq.worker.engine.models.layer_taps import LayerTaps
from mlxq.worker.engine.prefill import ChunkedPrefill, prefill_rows_layers
from mlxq.worker.engine.prefill_plan import SHARED_MIN, PrefillPlan

log = logging.getLogger(__name__)


class DecodingRows(Protocol):
    """The batch's decoding side as its prefill reads and feeds it, read at each use: the batch
    replaces both after a failed decode step."""

    decoding: list[_Sequence]  # in the order of the decode batch's rows
    decode: DecodeBatch


@dataclass
class _Launched:
    """A prefill forward of several prompts, launched: the prompts that may join (`rows`: theirs of
    the forward's logits), their caches, the logits (rows, vocab), and the forward's own caches."""

    seqs: list[_Sequence]
    caches: list[list[KVCache]]
    logits: mx.array
    rows: list[int]
    layers: list[PrefillRowsCache]

    @property
    def whole(self) -> bool:
        """Whether every prompt of the forward may join."""
        return len(self.rows) == self.logits.shape[0]

    def rows_logits(self) -> mx.array:
        if self.whole:
            return self.logits
        return self.logits[mx.array(self.rows, dtype=mx.int32)]


class BatchPrefill:
    """A generation batch's waiting requests and prefill; see the module docstring."""

    def __init__(
        self,
        engine: Engine,
        kv_budget_bytes: int,
        rows: DecodingRows,
        finish: Callable[[_Sequence, FinishReason, list[KVCache] | None], Finished],
        memory_error: Callable[[Exception, str], Exception],
    ) -> None:
        self.engine = engine
        self.plan = PrefillPlan(engine, kv_budget_bytes)  # which waiting requests start, which together
        self.waiting: list[_Sequence] = []
        self.prefilling: _Sequence | None = None
        self._rows = rows
        self._finish = finish
        self._memory_error = memory_error

    @property
    def decoding(self) -> list[_Sequence]:
        """The batch's decoding requests, which the prefilled ones join."""
        return self._rows.decoding

    @property
    def decode(self) -> DecodeBatch:
        """The batch's decode batch, which the prefilled rows join."""
        return self._rows.decode

    def drop_cancelled_waiting(self, finished: list[Finished]) -> None:
        """The waiting requests cancelled (or whose check raised) leave `waiting` into `finished`."""
        for seq in list(self.waiting):
            if not self._goes_on(seq, finished):
                self.waiting.remove(seq)

    def _goes_on(self, seq: _Sequence, finished: list[Finished]) -> bool:
        """Whether a request that has not started decoding goes on (its cache, if any, not yet offered);
        else it is finished: cancelled, or with the error its check raised (e.g. its timeout)."""
        try:
            stop = seq.cancelled()
        except Exception as e:
            finished.append(Finished(seq.key, error=e))
            return False
        if stop:
            seq.clock.prefilled()
            finished.append(self._finish(seq, "cancelled", None))
        return not stop

    def step(self, finished: list[Finished]) -> None:
        """About one prefill chunk of tokens: the next chunk of a long prompt, or several short prompts
        together in one forward. With no request decoding (a burst of new jobs: no stream waits on this
        step) up to `Engine.idle_prefill_tokens` instead, as few forwards as the prompts allow (on a GPU
        a forward of many rows runs far faster per token than several of a chunk each), launched back
        to back and waited for once. The ones done join the decode batch together."""
        if self.prefilling is not None:
            self._advance_prefill(self.prefilling, finished)
            return
        chunk = self.engine.options.prefill_chunk
        budget = chunk if self.decoding else max(chunk, self.engine.idle_prefill_tokens)
        burst = budget > chunk
        launched: list[_Launched] = []
        spent = 0
        while spent < budget:
            joining = [s for run in launched for s in run.seqs]
            active = [*self.decoding, *([self.prefilling] if self.prefilling else [])]
            group, cost, long = self.plan.next_group(self.waiting, active, joining, budget - spent)
            if long is not None:  # alone, one chunk per step (this step's first one)
                self._start_prefill(long, finished)
                if self.prefilling is not None:
                    self._advance_prefill(self.prefilling, finished)
            if not group:
                break
            run = self._launch_group(group, finished, sync=not burst)
            if run is not None:
                launched.append(run)
            spent += cost
            if not burst:
                break
        if launched:
            self._join_launched(launched, finished)

    def _launch_group(self, group: list[_Sequence], finished: list[Finished], sync: bool) -> _Launched | None:
        """One forward for `group`'s prompts (waited for with `sync`, else only launched), each prompt
        offered to the prefix cache; None when none of them can start."""
        ready: list[_Sequence] = []
        for seq in group:
            if not self._goes_on(seq, finished):  # a burst's later forwards: checked before each
                continue
            try:
                seq.cache, seq.n_cached = self.engine.begin_cache(seq.prompt, SHARED_MIN)
                ready.append(seq)
            except Exception as e:
                finished.append(Finished(seq.key, error=e))
        if not ready:
            return None
        rows = [(s.prompt[s.n_cached :], s.cache or []) for s in ready]
        tapped = any(s.reader is not None for s in ready)

        def run() -> tuple[list[PrefillRowsCache], mx.array, list[mx.array | None]]:
            taps = LayerTaps(self.engine.draft_taps) if tapped else None
            layers, logits = prefill_rows_layers(self.engine.model, rows, self.engine.pad_shapes, taps)
            # A reader's own positions, copied: what its drafter holds keeps no other row's, nor padding.
            features: list[mx.array | None] = [None] * len(ready)
            if taps is not None:
                every = taps.features()
                for i, (seq, (new, _)) in enumerate(zip(ready, rows, strict=True)):
                    if seq.reader is not None:  # its new tokens: the last columns
                        features[i] = mx.contiguous(every[i : i + 1, -len(new) :])
            # Synced, the clocks measure the prefill, not the building of its graph; else a burst's
            # forwards queue up behind one another and are waited for once (`_join_launched`).
            (mx.eval if sync else mx.async_eval)(logits, *[f for f in features if f is not None])
            return layers, logits, features

        try:  # out of memory: caches emptied, one more try (the rows' own caches are left as they were)
            layers, logits, features = with_memory_retry(
                run, self.engine.free_memory, f"prefilling {len(rows)} prompts together"
            )
        except Exception as e:  # the shared forward failed: none of these rows can start
            log.exception("batched prefill failed rows=%d", len(ready))
            finished.extend(Finished(s.key, error=e) for s in ready)
            return None
        caches = [[layer.row_cache(i) for layer in layers] for i in range(len(ready))]
        offered: list[int] = []
        for i, (seq, cache) in enumerate(zip(ready, caches, strict=True)):
            seq.cache = None
            try:
                if self.engine.prefix_cache is not None:  # later prompts with this prefix reuse it
                    self.engine.prefix_cache.offer(seq.prompt, cache)
            except Exception as e:
                finished.append(Finished(seq.key, error=e))
                continue
            offered.append(i)
            if (own := features[i]) is not None:
                self._hand_features(seq, seq.n_cached, own)
        return _Launched([ready[i] for i in offered], [caches[i] for i in offered], logits, offered, layers)

    def _join_launched(self, launched: list[_Launched], finished: list[Finished]) -> None:
        """The step's prefilled prompts, waited for at once, start decoding together."""
        try:
            mx.eval([run.logits for run in launched])
        except Exception as e:  # a burst's forward failed: none of its rows can start
            log.exception("batched prefill failed rows=%d", sum(len(run.seqs) for run in launched))
            self.engine.free_memory()  # the prefix cache was offered what the failed forwards compute
            if is_out_of_memory(e):
                e = OutOfMemory(f"the worker ran out of memory prefilling prompts together ({e})")
            finished.extend(Finished(s.key, error=e) for run in launched for s in run.seqs)
            return
        for run in launched:
            for seq in run.seqs:
                seq.clock.prefilled()
        first = launched[0]  # every row of it starting an empty batch: its buffers, uncopied
        samplers = [s.sampler for s in first.seqs]
        if first.whole and not self.decoding and self.decode.start(first.layers, first.logits, samplers):
            self.decoding.extend(first.seqs)
            launched = launched[1:]
        logits = [run.rows_logits() for run in launched if run.seqs]
        if not logits:
            return
        seqs = [s for run in launched for s in run.seqs]
        caches = [c for run in launched for c in run.caches]
        self._join(seqs, caches, logits[0] if len(logits) == 1 else mx.concatenate(logits))

    def _join(self, seqs: list[_Sequence], caches: list[list[KVCache]], logits: mx.array) -> None:
        """Prefilled `seqs` start decoding; `logits` are their last positions' logits, row for row."""
        if not seqs:
            return
        self.decode.add(caches, logits, [s.sampler for s in seqs])
        self.decoding.extend(seqs)

    def _hand_features(self, seq: _Sequence, position: int, features: mx.array) -> None:
        """The tapped features (1, L, features) of `seq`'s prompt tokens from `position` on, to its
        drafter; what it makes of them is computed at once (a prefill is not a step in flight)."""
        assert seq.reader is not None
        made = seq.reader.take_features(position, features, seq.prompt)
        if made:
            mx.async_eval(made)

    def _start_prefill(self, seq: _Sequence, finished: list[Finished]) -> None:
        try:
            seq.cache, seq.n_cached = self.engine.begin_cache(seq.prompt)
            seq.prefill = ChunkedPrefill(
                self.engine.model,
                seq.prompt[seq.n_cached :],
                seq.cache,
                self.engine.options.prefill_chunk,
                self.engine.pad_shapes,
                taps=self.engine.draft_taps if seq.reader is not None else (),
            )
            self.prefilling = seq
        except Exception as e:
            finished.append(Finished(seq.key, error=e))

    def _advance_prefill(self, seq: _Sequence, finished: list[Finished]) -> None:
        """One chunk of a long prompt's prefill; once done, `seq` is decoding."""
        assert seq.prefill is not None and seq.cache is not None
        try:
            if seq.cancelled():
                self.prefilling = None
                seq.clock.prefilled()
                finished.append(self._finish(seq, "cancelled", seq.cache))
                return
            logits = seq.prefill.advance()
            tapped = seq.prefill.tapped
            if tapped is not None:
                assert seq.reader is not None
                self._hand_features(seq, seq.n_cached + seq.prefill.tapped_from, tapped)
                seq.prefill.tapped = None
            if logits is None:
                return
            self.prefilling = None
            mx.eval(logits, *([tapped] if tapped is not None else []))
            seq.clock.prefilled()
            if self.engine.prefix_cache is not None:
                self.engine.prefix_cache.offer(seq.prompt, seq.cache)
            cache, seq.cache = seq.cache, None
        except Exception as e:
            self.prefilling = None
            finished.append(
                Finished(seq.key, error=self._memory_error(e, f"prefilling {len(seq.prompt)} tokens"))
            )
            return
        self._join([seq], [cache], logits)
