"""A generation's text as it becomes safe to show: per request, the detokenizer, the stop strings, the
tokens and logprobs behind the text not emitted yet, and the sink that takes what is emitted.

It knows nothing of Redis: the sink is the stream writer in a worker, a list in tests. A generation
batch (`generation_batch.py`) hands each request's tokens here one at a time, through
`Engine.finish_reason_after`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from mlxq.jobs.schema import FinishReason, GeneratedLogprob
from mlxq.worker.engine.text.detokenizer import IncrementalDetokenizer
from mlxq.worker.engine.text.stop_strings import StopStringMatcher
from mlxq.worker.engine.text.token_texts import piece as token_piece
from mlxq.worker.engine.text.tokenizer import Tokenizer
from mlxq.worker.engine.token_logprobs import TokenLogprob, as_generated


class TokenSink(Protocol):
    """Receives generated text as it becomes safe to show; `ids` are the tokens behind it."""

    def __call__(self, text: str, ids: list[int]) -> None: ...


@runtime_checkable
class LogprobSink(Protocol):
    """A sink that also takes the logprobs of the tokens behind its next text, just before it (where
    the request asked for logprobs)."""

    def logprobs(self, items: list[GeneratedLogprob]) -> None: ...


class TextRun:
    """Per-request text state: detokenizer, stop strings, what was emitted."""

    def __init__(
        self, tokenizer: Tokenizer, stops: list[str], sink: TokenSink, logprobs: bool = False
    ) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        # one per generated token, where the request asked; those behind the text not emitted yet
        self.logprobs: list[GeneratedLogprob] | None = [] if logprobs else None
        self._pending_logprobs: list[GeneratedLogprob] = []
        self._text_of = lambda token: token_piece(tokenizer, token)
        self.stops = StopStringMatcher(stops) if stops else None
        self.sink = sink
        self.ids: list[int] = []
        self._pending: list[int] = []  # ids whose text is not emitted yet
        self._parts: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def _emit(self, text: str) -> None:
        if text or self._pending:
            self._parts.append(text)
            if self._pending_logprobs and isinstance(self.sink, LogprobSink):
                self.sink.logprobs(self._pending_logprobs)
            self._pending_logprobs = []
            self.sink(text, self._pending)
            self._pending = []

    def add(self, token: int, logprob: TokenLogprob | None = None) -> bool:
        """Take one token (with its logprob, where asked); returns True when a stop string was completed."""
        self.ids.append(token)
        if self.logprobs is not None and logprob is not None:
            generated = as_generated(logprob, self._text_of)
            self.logprobs.append(generated)
            self._pending_logprobs.append(generated)
        self._pending.append(token)
        delta = self.detok.add(token)
        if self.stops is None:
            self._emit(delta)
            return False
        safe, stopped = self.stops.feed(delta)
        self._emit(safe)
        return stopped

    def finish(self, reason: FinishReason) -> FinishReason:
        """Release held-back text at the end (nothing after a stop string is ever shown).

        Returns the final finish reason: `stop` if the released tail itself completes a stop string
        (e.g. the last bytes of a character, or a longer stop that could still have matched).
        """
        if reason == "stop" and self.stops is not None:
            self._emit("")
            return reason
        tail = self.detok.flush()
        if self.stops is not None:
            safe, hit = self.stops.feed(tail)
            tail = safe if hit else safe + self.stops.flush()
            if self.stops.stopped:
                reason = "stop"
        self._emit(tail)
        return reason
