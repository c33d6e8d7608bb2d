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
  prefix (a system prompt) compute it once. The waiting requests and their prefill are the batch's
  `BatchPrefill`'s (`batch_prefill.py`): which start, and which together, is its `PrefillPlan`'s
  (`prefill_plan.py`); it launches the forwards and joins the rows;
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
from functools import partial
from typing import cast

import mlx.core as mx

from mlxq.jobs.errors import OutOfMemory
from mlxq.jobs.schema import FinishReason, GenerateRequest, GenerateResult
from mlxq.worker.engine.batch_drafts import BatchDrafts
from mlxq.worker.engine.batch_prefill import BatchPrefill
from mlxq.worker.engine.batch_sequence import Finished, _Sequence
from mlxq.worker.engine.cache.kv_cache import KVCache
from mlxq.worker.engine.decode_batch import DecodeBatch
from mlxq.worker.engine.engine import Engine
from mlxq.worker.engine.memory_guard import is_out_of_memory
from mlxq.worker.engine.speculation.drafter import FeatureReader
from mlxq.worker.engine.speculation.row_tokens import RowTokens
from mlxq.worker.engine.text_run import TextRun, TokenSink
from mlxq.worker.engine.token_logprobs import TokenLogprob

__all__ = ["Finished", "GenerationBatch", "generate"]

log = logging.getLogger(__name__)


class GenerationBatch:
    """Requests decoded together on one engine; see the module docstring."""

    def __init__(self, engine: Engine, max_sequences: int, kv_budget_bytes: int = 0) -> None:
        if max_sequences < 1:
            raise ValueError(f"max_sequences must be >= 1, got {max_sequences}")
        self.engine = engine
        self.max_sequences = max_sequences
        self.prefill = BatchPrefill(engine, kv_budget_bytes, self, self._finish, self._memory_error)
        self.decoding: list[_Sequence] = []  # in the order of the decode batch's rows
        self.decode = self._new_decode()
        self.steps = 0
        self._offers: list[tuple[list[int], list[KVCache]]] = []  # finished requests' caches (`settle`)
        self._ended: list[Finished] = []  # requests ended by a failed launch, for the next `step`
        self.drafts = BatchDrafts(engine)  # which rows draft at a step, their drafts, the step's progress

    @property
    def waiting(self) -> list[_Sequence]:
        """The requests admitted and not started (the prefill's)."""
        return self.prefill.waiting

    @property
    def prefilling(self) -> _Sequence | None:
        """The long prompt being prefilled alone, chunk by chunk (the prefill's)."""
        return self.prefill.prefilling

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
        self.prefill.drop_cancelled_waiting(finished)
        self.prefill.step(finished)
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
        self.drafts.leave([self.decoding[i] for i, _ in leaving])
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
        self.drafts.leave(self.decoding)
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
        self.drafts.leave(self.decoding)
        self.prefill.waiting, self.prefill.prefilling, self.decoding = [], None, []
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
