"""Continuous batching of generation requests on one engine: join any time, decode together, leave alone.

A `GenerationBatch` holds up to `max_sequences` requests in three stages:
- waiting: admitted (validated, tokenized), not started: the KV budget has no room for it yet;
- prefilling: about one chunk of prompt tokens per `step`, each prompt from the longest prefix in the
  prefix cache: several short prompts together in one forward (`prefill_rows`), or a long one (or one
  whose cached prefix is longer than a chunk) alone, chunk by chunk. While no request decodes (a
  burst of new jobs), a step prefills up to `Engine.idle_prefill_tokens` (8 chunks on a GPU), in one
  forward where the prompts allow, else several launched back to back and waited for once. Prompts
  are offered back to the prefix cache as soon as they are computed, and a prompt sharing a long
  uncached prefix with one being prefilled waits for the next forward, so batch-mates with the same
  prefix (a system prompt) compute it once. Which waiting requests start, and which together, is the
  batch's `PrefillPlan`'s (`prefill_plan.py`); the batch launches the forwards and joins the rows;
- decoding: every decoding request is a row of one `DecodeBatch`: one forward per step for all rows,
  each row with its own sampler, stop strings, token budget and cancel check. With speculative
  decoding, which rows draft at a step, their drafts and the step's progress as the draft gate counts
  it are the batch's `BatchDrafts`' (`batch_drafts.py`).

A request leaves the moment it finishes (EOS, stop string, length, cancel, or an error of its own) with
its `GenerateResult` or exception in a `Finished`; its row is dropped and a newcomer takes its place,
with no other row recomputed. A batched forward computes each row exactly as it would run alone (see
`batch_cache.py`), so results never depend on batch-mates: greedy tokens are identical, and a seeded
sampler draws from its own PRNG key. Knows nothing of Redis or RQ.

Where the engine overlaps (`Engine.decode_overlap`, on a GPU), a decode step is launched on the
engine's launcher thread while this thread handles the step before's tokens (text, stop strings, sinks,
cancel checks), runs the caller's `step(background=...)` work (the worker's stream writes) and builds
the next step: see `DecodeBatch` and `launcher.py`. A launch may then still be in flight when `step`
returns while requests decode: whoever evaluates MLX arrays on this thread between steps calls
`quiet()` first (the batch does so itself before a prefill or an offer to the prefix cache, and when
its last decoding request leaves), and `close()` when done with it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import cast

import mlx.core as mx

from mlxq.jobs.errors import OutOfMemory
from mlxq.jobs.schema import FinishReason, GenerateRequest, GenerateResult
from mlxq.worker.engine.batch_drafts import BatchDrafts
from mlxq.worker.engine.cache.kv_cache import KVCache
from mlxq.worker.engine.cache.prefill_rows_cache import PrefillRowsCache
from mlxq.worker.engine.decode_batch import DecodeBatch
from mlxq.worker.engine.engine import Engine
from mlxq.worker.engine.generation_clock import GenerationClock
from mlxq.worker.engine.memory_guard import is_out_of_memory, with_memory_retry
from mlxq.worker.engine.prefill import ChunkedPrefill, prefill_rows_layers
from mlxq.worker.engine.prefill_plan import SHARED_MIN, PrefillPlan
from mlxq.worker.engine.sampler import Sampler
from mlxq.worker.engine.speculation.drafter import FeatureReader
from mlxq.worker.engine.speculation.policy import RowSpeculation
from mlxq.worker.engine.speculation.row_tokens import RowTokens
from mlxq.worker.engine.text_run import TextRun, TokenSink
from mlxq.worker.engine.token_logprobs import TokenLogprob

log = logging.getLogger(__name__)


@dataclass
class Finished:
    """A request that left the batch: its result, or the exception that ended it."""

    key: str
    result: GenerateResult | None = None
    error: BaseException | None = None


@dataclass(eq=False)
class _Sequence:
    key: str
    prompt: list[int]
    max_tokens: int
    sampler: Sampler
    run: TextRun
    cancelled: Callable[[], bool]
    clock: GenerationClock = field(default_factory=GenerationClock)
    cache: list[KVCache] | None = None
    n_cached: int = 0
    prefill: ChunkedPrefill | None = None
    speculation: RowSpeculation | None = None  # its drafter, where it decodes speculatively
    depth: int = 0  # tokens it may draft at this step
    proposed: int = 0  # tokens its drafter proposed at this step
    reader: FeatureReader | None = None  # its drafter, where it reads the target's hidden states
    ahead: int = 0  # tokens it is ahead of the batch's slowest row (the draft gate's progress)

    @property
    def budget(self) -> int:
        """Tokens it may still generate after its pending one."""
        return self.max_tokens - len(self.run.ids) - 1

    @property
    def longest(self) -> int:
        """Tokens its cache may reach: prompt plus every token it may generate."""
        return len(self.prompt) + self.max_tokens


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


class GenerationBatch:
    """Requests decoded together on one engine; see the module docstring."""

    def __init__(self, engine: Engine, max_sequences: int, kv_budget_bytes: int = 0) -> None:
        if max_sequences < 1:
            raise ValueError(f"max_sequences must be >= 1, got {max_sequences}")
        self.engine = engine
        self.max_sequences = max_sequences
        self.plan = PrefillPlan(engine, kv_budget_bytes)  # which waiting requests start, which together
        self.waiting: list[_Sequence] = []
        self.prefilling: _Sequence | None = None
        self.decoding: list[_Sequence] = []  # in the order of the decode batch's rows
        self.decode = self._new_decode()
        self.steps = 0
        self._offers: list[tuple[list[int], list[KVCache]]] = []  # finished requests' caches (`settle`)
        self._ended: list[Finished] = []  # requests ended by a failed launch, for the next `step`
        self.drafts = BatchDrafts(engine)  # which rows draft at a step, their drafts, the step's progress

    def __len__(self) -> int:
        return len(self.waiting) + (self.prefilling is not None) + len(self.decoding) + len(self._ended)

    @property
    def free_slots(self) -> int:
        return self.max_sequences - len(self)

    def admit(
        self, key: str, request: GenerateRequest, sink: TokenSink, cancelled: Callable[[], bool]
    ) -> None:
        """Add a request (it starts when the KV budget allows); raises the request's own error if bad.

        `cancelled` is the request's check, called between every piece of its work from here on: it
        says whether the request was cancelled, and raises once the request must stop (its timeout).
        Admitting is work too (tokenizing the prompt, compiling the stop strings), so it is called
        after each; should it raise, the request is not admitted and this raises its error."""
        if self.free_slots <= 0:
            raise ValueError(f"the batch is full ({self.max_sequences} sequences)")
        prompt, max_tokens, sampler = self.engine.prepare_generation(request)
        cancelled()
        run = TextRun(self.engine.tokenizer, request.stop, sink, logprobs=request.logprobs is not None)
        cancelled()
        speculation = self.engine.speculation_for(request, sampler)
        drafter = speculation.drafter if speculation is not None else None
        reader = drafter if self.decode.taps and hasattr(drafter, "take_features") else None
        self.waiting.append(
            _Sequence(
                key,
                prompt,
                max_tokens,
                sampler,
                run,
                cancelled,
                speculation=speculation,
                reader=cast("FeatureReader | None", reader),
            )
        )

    def step(self, background: Callable[[], None] | None = None) -> list[Finished]:
        """One unit of work: about one prefill chunk of tokens (several short prompts, or one chunk of a
        long one), then one decode step for every decoding request.

        `background` (host work that touches neither MLX nor this batch, e.g. writing streams) runs once
        per step: while the device finishes the step in flight, before its tokens are read back (so
        it writes the tokens the step before handled), or after the tokens of rows that just joined,
        or, in a batch holding a constrained row, after the step's tokens were handled while the
        device computes the next forward (`DecodeBatch.step_with`). It must not raise (keep its
        errors); should it raise anyway, the decoding requests end with that error, as when a decode
        step fails (in a step that decodes nothing, every request), so none is lost."""
        if self.waiting or self.prefilling is not None:
            self.quiet()  # MLX work on this thread ahead
        self.settle()
        finished, self._ended = self._ended, []
        self._drop_cancelled_waiting(finished)
        self._prefill(finished)
        if self.decoding:
            self._decode_step(finished, background)
        elif background is not None:
            try:
                background()
            except Exception as e:
                log.exception("a generation batch's background work failed")
                finished.extend(self.abort(e))
        self.steps += 1
        return finished

    def _new_decode(self) -> DecodeBatch:
        taps = self.engine.draft_taps
        return DecodeBatch(
            self.engine.model,
            self.engine.pad_shapes,
            launcher=self.engine.launcher(),
            masks_in_place=self.engine.masks_in_place,
            build_ahead=self.engine.build_ahead,
            taps=taps,
            features=self._features if taps else None,
            verify_shapes=self.engine.verify_shapes,
        )

    def _features(self, positions: list[int], features: mx.array) -> list[mx.array]:
        """A decode forward's tapped target features (rows in the order of `decoding`), handed to the
        rows whose drafters read them, with each row's position of its first fed token; returns what
        the drafters made of them (`FeatureSink`)."""
        made: list[mx.array] = []
        for i, (seq, position) in enumerate(zip(self.decoding, positions, strict=True)):
            if seq.reader is not None:
                tokens = RowTokens(seq.prompt, seq.run.ids)
                made.extend(seq.reader.take_features(position, features[i : i + 1], tokens))
        return made

    def quiet(self) -> None:
        """Return once no decode step is being launched: call before evaluating MLX arrays on this thread
        between steps (a score batch). A launch that failed ends every decoding request with its error,
        as a failed decode step does; the next `step` returns them."""
        try:
            self.decode.quiet()
        except Exception as e:
            self._decode_failed(e, self._ended)

    def close(self) -> None:
        """Done stepping (empty or aborted): no launch is left in flight."""
        self.quiet()
        if self._ended:  # not expected: `len` counts them, so the caller steps until `step` returns them
            log.warning("a generation batch closed with %d ended requests not taken", len(self._ended))

    # --- prefill ------------------------------------------------------------------------------

    def _drop_cancelled_waiting(self, finished: list[Finished]) -> None:
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

    def _prefill(self, finished: list[Finished]) -> None:
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

        def run() -> tuple[list[PrefillRowsCache], mx.array]:
            layers, logits = prefill_rows_layers(self.engine.model, rows, self.engine.pad_shapes)
            # Synced, the clocks measure the prefill, not the building of its graph; else a burst's
            # forwards queue up behind one another and are waited for once (`_join_launched`).
            (mx.eval if sync else mx.async_eval)(logits)
            return layers, logits

        try:  # out of memory: caches emptied, one more try (the rows' own caches are left as they were)
            layers, logits = with_memory_retry(
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

    def _start_prefill(self, seq: _Sequence, finished: list[Finished]) -> None:
        try:
            seq.cache, seq.n_cached = self.engine.begin_cache(seq.prompt)
            seq.prefill = ChunkedPrefill(
                self.engine.model,
                seq.prompt[seq.n_cached :],
                seq.cache,
                self.engine.options.prefill_chunk,
                self.engine.pad_shapes,
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
            if logits is None:
                return
            self.prefilling = None
            mx.eval(logits)
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

    # --- decoding -----------------------------------------------------------------------------

    def _decode_step(self, finished: list[Finished], background: Callable[[], None] | None) -> None:
        gate = self.engine.draft_gate
        if gate is not None:
            gate.begin(len(self.decoding))
        verify = self.decode.rows is not None and self.drafts.speculating(self.decoding)
        self.drafts.progress = 0
        try:
            if verify:
                drafts_for = partial(self.drafts.propose, self.decoding)
                leaving = self.decode.verify_with(drafts_for, self._take_runs, meanwhile=background)
            else:
                leaving = self.decode.step_with(
                    self._take_tokens,
                    ends_all=lambda out: len(out) == len(self.decoding),
                    meanwhile=background,
                )
        except Exception as e:  # the shared forward failed: no row can go on
            if gate is not None:
                gate.end("verify" if verify else "plain", 0)
            self._decode_failed(e, finished)
            return
        verified = verify and self.decode.verify_step.verified
        self._leave(self._failed_grammars(leaving), finished)
        if gate is not None:  # rows leaving (their caches cut out) are part of the step's cost
            new_shape = verified and self.decode.verify_step.new_shape
            gate.end("verify" if verified else "plain", self.drafts.progress, new_shape=new_shape)

    def _leave(
        self, leaving: list[tuple[int, FinishReason | BaseException]], finished: list[Finished]
    ) -> None:
        """The rows that ended at this step leave the batch with their results or errors."""
        if not leaving:
            return
        caches = self.decode.remove([i for i, _ in leaving])
        for (i, outcome), cache in zip(leaving, caches, strict=True):
            seq = self.decoding[i]
            if isinstance(outcome, BaseException):
                finished.append(Finished(seq.key, error=outcome))
            else:
                finished.append(self._finish(seq, outcome, cache))
        gone = {i for i, _ in leaving}
        self.decoding = [s for i, s in enumerate(self.decoding) if i not in gone]
        if not self.decoding:  # the step launched for them is not needed: no launch outlives the rows
            self.quiet()

    def _failed_grammars(
        self, leaving: list[tuple[int, FinishReason | BaseException]]
    ) -> list[tuple[int, FinishReason | BaseException]]:
        """`leaving`, with every row whose grammar failed ending with that error: a grammar that fails
        computing its next mask on the mask thread is found once the row handled its token
        (`DecodeBatch._step_ahead`), and its row ends at that token as one whose grammar failed before
        it was handled (`_take_one`: the error comes first) does."""
        if self.decode.rows is None or not self.decode.rows.constrained:
            return leaving
        failed = {
            i: c.error
            for i, seq in enumerate(self.decoding)
            if (c := seq.sampler.constraint) is not None and c.error is not None
        }
        if not failed:
            return leaving
        outcomes: dict[int, FinishReason | BaseException] = {**dict(leaving), **failed}
        return sorted(outcomes.items(), key=lambda item: item[0])

    def _decode_failed(self, error: Exception, finished: list[Finished]) -> None:
        log.exception("batched decode step failed rows=%d", len(self.decoding), exc_info=error)
        error = self._memory_error(error, f"decoding {len(self.decoding)} sequences together")
        finished.extend(Finished(seq.key, error=error) for seq in self.decoding)
        self.decoding, self.decode = [], self._new_decode()

    def _memory_error(self, error: Exception, what: str) -> Exception:
        """An allocation failure as the requests' clear `OutOfMemory`, the caches emptied for the requests
        that follow (nothing is retried once a request streamed text or holds a half-built cache);
        another error as it is."""
        if not is_out_of_memory(error):
            return error
        self.engine.free_memory()
        return OutOfMemory(
            f"the worker ran out of memory {what} ({error}); send a shorter prompt or fewer tokens, "
            "or use a worker with more memory"
        )

    def _take_runs(self, runs: list[list[int]]) -> list[tuple[int, FinishReason | BaseException]]:
        """After a verify step: each row takes its tokens (its pending one, then the drafts kept), in
        order, as from that many plain steps, up to the one it ends with; returns the rows that end."""
        leaving: list[tuple[int, FinishReason | BaseException]] = []
        gains: list[int] = []
        for i, (seq, run) in enumerate(zip(self.decoding, runs, strict=True)):
            if seq.depth > 0 and seq.speculation is not None:
                seq.speculation.observe(seq.proposed, len(run) - 1)
            gains.append(len(run))
            for j, token in enumerate(run):  # rows asking logprobs draft nothing: theirs is the first
                outcome = self._take_one(seq, token, self.decode.logprobs.get(i) if j == 0 else None)
                if outcome is not None:
                    leaving.append((i, outcome))
                    gains[-1] = j + 1
                    break
        self.drafts.count_progress(self.decoding, gains)
        return leaving

    def _take_tokens(self, tokens: list[int]) -> list[tuple[int, FinishReason | BaseException]]:
        """Each decoding request takes its token (one per row, in row order); returns the rows that end
        now, with their finish reason or their own error. Touches no MLX array (see `step`)."""
        leaving: list[tuple[int, FinishReason | BaseException]] = []
        for i, (seq, token) in enumerate(zip(self.decoding, tokens, strict=True)):
            outcome = self._take_one(seq, token, self.decode.logprobs.get(i))
            if outcome is not None:
                leaving.append((i, outcome))
        self.drafts.count_progress(self.decoding, [1] * len(tokens))
        return leaving

    def _take_one(
        self, seq: _Sequence, token: int, logprob: TokenLogprob | None = None
    ) -> FinishReason | BaseException | None:
        """A request takes one token; its finish reason or its own error if it ends now, else None."""
        seq.clock.token()
        try:
            constraint = seq.sampler.constraint
            if constraint is not None and constraint.error is not None:
                raise constraint.error  # its token broke its grammar (see `SamplerRows.take`)
            reason = self.engine.finish_reason_after(seq.run, token, seq.cancelled, logprob)
            if reason is None and constraint is not None and constraint.complete_after(len(seq.run.ids)):
                reason = "stop"  # its grammar is complete and allows no end-of-text token
            if reason is None and len(seq.run.ids) >= seq.max_tokens:
                reason = "length"
        except Exception as e:  # this row's sink or cancel check failed: it alone ends
            return e
        return reason

    def _finish(self, seq: _Sequence, reason: FinishReason, cache: list[KVCache] | None) -> Finished:
        """The request's result; its cache waits for `settle`, so the caller writes the result first."""
        try:
            reason = seq.run.finish(reason)
            result = self.engine.generate_result(seq.run, reason, seq.prompt, seq.n_cached, seq.clock)
            if seq.speculation is not None:
                drafted = {"draft_tokens": seq.speculation.drafted, "accepted_tokens": seq.speculation.kept}
                result = result.model_copy(update={"usage": result.usage.model_copy(update=drafted)})
        except Exception as e:
            return Finished(seq.key, error=e)
        if cache is not None and self.engine.prefix_cache is not None:  # the cache holds these tokens
            self._offers.append((seq.prompt + seq.run.ids, cache))  # (all but the last, never fed)
        return Finished(seq.key, result=result)

    def settle(self) -> None:
        """Offer the caches of the requests that finished to the prefix cache, where a prompt that
        continues one (a chat's next turn) finds it. `step` leaves this to its caller, so the finished
        requests' results go out first (an offer costs a copy of the row's keys and values: 64 rows
        ending together would wait for 64 of them), and does it itself at its start. An offer that
        fails is logged and dropped: a cache is an aid, the request's result stands."""
        offers, self._offers = self._offers, []
        if offers:
            self.quiet()
        prefix_cache = self.engine.prefix_cache
        if prefix_cache is None:
            return
        for tokens, cache in offers:
            try:
                prefix_cache.offer(tokens, cache)
            except Exception:
                log.warning("a finished request's cache could not go to the prefix cache", exc_info=True)

    def abort(self, error: BaseException) -> list[Finished]:
        """End every request with `error` (the caller could not go on); the batch is empty afterwards."""
        try:
            self.decode.quiet()
        except Exception:
            log.warning("a decode step's launch failed as the batch was aborted", exc_info=True)
        seqs = [*self.waiting, *([self.prefilling] if self.prefilling else []), *self.decoding]
        ended, self._ended = self._ended, []
        self.waiting, self.prefilling, self.decoding = [], None, []
        self.decode = self._new_decode()
        self._offers = []
        return [*ended, *(Finished(s.key, error=error) for s in seqs)]


def generate(
    engine: Engine, request: GenerateRequest, sink: TokenSink, cancelled: Callable[[], bool] = lambda: False
) -> GenerateResult:
    """Generate for one request in this process, reporting text deltas to `sink`; returns the result.

    A generation batch of one: the path every generation job of a worker takes (there is no other), for
    tests, benchmarks and scripts that hold an engine. The request's own error is raised.
    """
    batch = GenerationBatch(engine, max_sequences=1)
    try:
        batch.admit("one", request, sink, cancelled)
        while True:
            for done in batch.step():
                batch.settle()
                if done.error is not None:
                    raise done.error
                assert done.result is not None
                return done.result
    finally:
        batch.close()
