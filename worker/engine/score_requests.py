"""Score requests prepared for the scorer: each job's limits checked, its rows tokenized and validated
(`ScoreRequests`, which the engine composes), and the answers of the rows scored token by token.

A candidates row becomes the tokens of its prompt and candidates (`RowTokens`); a row of continuations,
a rolling text or a prompt's logprobs becomes token sequences (`SeqRow`) that `TokenHead` scores. Preparing
reads only the tokenizer and the engine's settings, never the model: another thread may prepare a batch
while the engine scores the one before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice

from mlxq.jobs.errors import ContextTooLong, InvalidRequest
from mlxq.jobs.schema import (
    ContinuationScore,
    PromptLogprobs,
    RollingScore,
    ScoredRow,
    ScoreRequest,
    TopLogprob,
)
from mlxq.worker.engine.cache.token_match import common_length
from mlxq.worker.engine.candidate_tokens import RowText, RowTokens, candidate_token_ids
from mlxq.worker.engine.engine_options import EngineOptions
from mlxq.worker.engine.eval_tokens import continuation_seqs, rolling_seqs
from mlxq.worker.engine.text.chat_tokens import chat_tokens
from mlxq.worker.engine.text.token_texts import piece as token_piece
from mlxq.worker.engine.text.token_texts import token_texts
from mlxq.worker.engine.text.tokenizer import Tokenizer
from mlxq.worker.engine.token_scoring import TokenScores, TokenSeq


@dataclass(frozen=True)
class SeqRow:
    """A prepared score row of a kind scored token by token (`TokenHead`): continuations (a
    sequence each), rolling windows, or one prompt."""

    kind: str  # "continuations" | "rolling" | "prompt_logprobs"
    seqs: list[TokenSeq]
    prompt: PromptAsk | None = None  # a prompt_logprobs row's prompt and extras


@dataclass(frozen=True)
class PromptAsk:
    """A prompt_logprobs row's tokens and what it asks besides their log-probabilities: `top_k`
    alternatives, token texts, and the token after the prompt (its sequence then ends in a placeholder
    token whose position gives that next token's alternatives)."""

    tokens: list[int]
    top_k: int
    chosen: bool
    texts: bool
    next_token: bool


PreparedRow = RowTokens | SeqRow


class ScoreRequests:
    """Score requests turned into the rows the scorer takes, under this worker's limits: the options'
    rows and candidates a job, `max_prompt_chars`, the model's context and vocabulary."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        options: EngineOptions,
        context_length: int,
        max_prompt_chars: int,
        vocab_size: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.options = options
        self.context_length = context_length
        self.max_prompt_chars = max_prompt_chars
        self.vocab_size = vocab_size

    def score_tokens(self, request: ScoreRequest) -> list[PreparedRow]:
        """Per row: its tokens, validated (prompts are never truncated; rolling texts are windowed)."""
        prepared = self.score_tokens_many([request])[0]
        if isinstance(prepared, Exception):
            raise prepared
        return prepared

    def score_tokens_many(
        self, requests: Sequence[ScoreRequest], tokenizer: Tokenizer | None = None
    ) -> list[list[PreparedRow] | InvalidRequest]:
        """`score_tokens` of several jobs, their candidate rows tokenized together (one batch call to the
        tokenizer for all of their short texts); a bad job gets its error in its place, alone.

        Tokenizing reads only the tokenizer and the engine's settings, never the model: another thread
        may tokenize a batch while this one scores, with a `tokenizer` of its own (`Tokenizer.clone`:
        the engine's own holds state that two threads must not share)."""
        tokenizer = tokenizer or self.tokenizer
        limits = [self._limits_error(request) for request in requests]
        rows = [
            RowText(r.prompt, r.candidates, i, request.add_special_tokens, not request.allow_special_tokens)
            for request, error in zip(requests, limits, strict=True)
            if error is None
            for i, r in enumerate(request.rows)
            if r.candidates is not None
        ]
        tokens = iter(candidate_token_ids(tokenizer, rows))
        out: list[list[PreparedRow] | InvalidRequest] = []
        for request, error in zip(requests, limits, strict=True):
            if error is not None:
                out.append(error)
                continue
            mine: list[PreparedRow | InvalidRequest] = []
            for i, r in enumerate(request.rows):
                if r.candidates is not None:
                    mine.append(next(tokens))
                    continue
                try:
                    mine.append(self._seq_row(request, i, tokenizer))
                except InvalidRequest as e:
                    mine.append(e)
            out.append(self._job_rows(mine, request.max_tokens))
        return out

    def shared_start(self, requests: Sequence[ScoreRequest]) -> list[int]:
        """The prompt tokens that the first two candidate rows of a batch's jobs share (at most all but
        each prompt's last token): where a batch's prefix tree most likely starts, which the engine can
        start on the device while the host tokenizes the rest (`Engine.start_shared_prefix`). Empty
        where there are fewer than two such rows within their jobs' limits. With the engine's own
        tokenizer: its shared-prefix encoder then has the first prompt at hand for the rest."""
        candidates = (
            (r.prompt, request.add_special_tokens, not request.allow_special_tokens)
            for request in requests
            if self._limits_error(request) is None
            for r in request.rows[:2]
            if r.candidates is not None
        )
        rows = list(islice(candidates, 2))  # the jobs after the second row's are not looked at
        if len(rows) < 2:
            return []
        a, b = self.tokenizer.encode_many(*(list(column) for column in zip(*rows, strict=True)))
        n = min(common_length(a, b), len(a) - 1, len(b) - 1, self.context_length - 1)
        return a[: max(n, 0)]

    def _seq_row(self, request: ScoreRequest, index: int, tokenizer: Tokenizer) -> SeqRow:
        """Row `index` of `request` (not a candidates row) as token sequences to score."""
        row = request.rows[index]
        split = not request.allow_special_tokens
        if row.continuations is not None:
            seqs = continuation_seqs(
                tokenizer, index, row.prompt, row.continuations, request.add_special_tokens, split
            )
            return SeqRow("continuations", seqs)
        if row.prompt_ids is not None:
            tokens = list(row.prompt_ids)
        elif row.messages is not None:
            tokens = chat_tokens(tokenizer, [m.model_dump() for m in row.messages])
        else:
            special = request.add_special_tokens
            tokens = tokenizer.encode(row.prompt, add_special_tokens=special, split_special=split)
        if row.rolling:  # an empty text has no windows: 0 over 0 tokens, as lm-eval has it
            window = min(row.window or request.max_tokens or self.context_length, self.context_length)
            return SeqRow("rolling", rolling_seqs(tokenizer, tokens, window))
        tokens = [*tokens, *row.completion_ids]
        vocab = self.vocab_size
        checked = (("token id", row.token_ids), ("prompt token id", row.prompt_ids or []))
        for what, ids in (*checked, ("completion token id", row.completion_ids)):
            for t in ids:
                if t >= vocab:
                    raise InvalidRequest(f"row {index}: {what} {t} is not in the vocabulary (0..{vocab - 1})")
        if not tokens:
            raise InvalidRequest(f"row {index}: the prompt is empty (it encodes to no tokens)")
        ask = PromptAsk(tokens, row.top_logprobs, bool(row.token_ids), row.token_texts, row.next_token)
        if row.next_token:  # a placeholder after the prompt: its position's alternatives are the next token's
            seq = TokenSeq([*tokens, 0], 1, max(row.top_logprobs, 1), tuple(row.token_ids))
            return SeqRow("prompt_logprobs", [seq], ask)
        if len(tokens) < 2:
            return SeqRow("prompt_logprobs", [], ask)  # one token: nothing before it, no logprob
        return SeqRow("prompt_logprobs", [TokenSeq(tokens, 1, row.top_logprobs, tuple(row.token_ids))], ask)

    def _job_rows(
        self, rows: list[PreparedRow | InvalidRequest], max_tokens: int | None
    ) -> list[PreparedRow] | InvalidRequest:
        """A job's tokenized rows, or the error of its first bad row. Each row's input to the model (a
        prompt; a prompt with a continuation; a rolling window) must have 1..`max_tokens` tokens (the
        model's context when None, and never more)."""
        good: list[PreparedRow] = []
        for i, row in enumerate(rows):
            if isinstance(row, InvalidRequest):
                return row
            n = len(row[0]) if isinstance(row, tuple) else max((len(s.inputs) for s in row.seqs), default=0)
            if max_tokens is not None and n > max_tokens:
                what = "the prompt is" if isinstance(row, tuple) else "its longest sequence puts"
                return InvalidRequest(
                    f"row {i}: {what} {n} tokens through the model, more than max_tokens={max_tokens} "
                    "(a score prompt is never truncated)"
                )
            limit = self.context_length - 1 if isinstance(row, tuple) else self.context_length
            if n > limit:
                return ContextTooLong(n, self.context_length)
            good.append(row)
        return good

    def _limits_error(self, request: ScoreRequest) -> InvalidRequest | None:
        """The job's error where it has more rows, candidates or prompt characters than this worker
        takes, else None."""
        if len(request.rows) > self.options.max_score_rows:
            return InvalidRequest(
                f"the score job has {len(request.rows)} rows; this worker takes at most "
                f"{self.options.max_score_rows} per job (MLXQ_MAX_SCORE_ROWS): split it into several jobs"
            )
        if request.max_tokens is not None and request.max_tokens > self.context_length:
            return InvalidRequest(
                f"max_tokens={request.max_tokens} is more than the model's context "
                f"of {self.context_length} tokens"
            )
        for i, row in enumerate(request.rows):
            chars = self.max_prompt_chars * (8 if row.rolling else 1)
            if len(row.prompt) > chars:
                return InvalidRequest(
                    f"row {i}'s prompt has {len(row.prompt)} characters; this worker takes at most "
                    f"{chars} (MLXQ_MAX_PROMPT_CHARS{', x8 for a rolling row' if row.rolling else ''})"
                )
            many = len(row.candidates or row.continuations or [])
            if many > self.options.max_score_candidates:
                return InvalidRequest(
                    f"row {i} has {many} {row.kind}; this worker takes at most "
                    f"{self.options.max_score_candidates} (MLXQ_MAX_SCORE_CANDIDATES)"
                )
        return None


def prompt_logprobs(
    ask: PromptAsk, results: list[TokenScores], computed: list[int], tokenizer: Tokenizer
) -> ScoredRow:
    """A prompt_logprobs row's answer, with the texts and the next token where it asked for them."""
    piece = (lambda t: token_piece(tokenizer, t)) if ask.texts else None
    texts, offsets = token_texts(tokenizer, ask.tokens) if ask.texts else (None, None)
    r = results[0] if results else TokenScores()
    n = len(ask.tokens) - 1  # scored prompt tokens; a `next_token` row's last scored slot is the placeholder

    def tops(top: list[tuple[int, float]], k: int) -> list[TopLogprob]:
        return [TopLogprob(id=t, logprob=lp, text=piece(t) if piece else None) for t, lp in top[:k]]

    inputs = len(ask.tokens) - 1 + (1 if ask.next_token else 0)
    return ScoredRow(
        prompt_logprobs=PromptLogprobs(
            tokens=ask.tokens[1:],
            token_logprobs=r.logprobs[:n],
            top_logprobs=[tops(top, ask.top_k) for top in r.top[:n]] if ask.top_k else [],
            chosen_logprobs=r.chosen[:n] if ask.chosen else [],
            first_token=ask.tokens[0] if ask.texts or ask.next_token else None,
            texts=texts,
            offsets=offsets,
            next_top=tops(r.top[n], max(ask.top_k, 1)) if ask.next_token else None,
            next_ends=r.top[n][0][0] in tokenizer.eos_ids if ask.next_token else None,
        ),
        input_tokens=inputs,
        cached_tokens=inputs - sum(computed),
    )


def seq_result(row: SeqRow, results: list[TokenScores], computed: list[int]) -> ScoredRow:
    """A token-by-token row's answer from its sequences' scores."""
    inputs = sum(len(s.inputs) for s in row.seqs)
    cached = inputs - sum(computed)
    if row.kind == "continuations":
        conts = [
            ContinuationScore(
                logprob=sum(r.logprobs),
                is_greedy=all(r.greedy),
                token_logprobs=r.logprobs,
                tokens=s.tokens[s.first :],
            )
            for s, r in zip(row.seqs, results, strict=True)
        ]
        return ScoredRow(continuations=conts, input_tokens=inputs, cached_tokens=cached)
    if row.kind == "rolling":
        total = sum(sum(r.logprobs) for r in results)
        n = sum(len(r.logprobs) for r in results)
        return ScoredRow(
            rolling=RollingScore(logprob=total, tokens=n, windows=len(results)),
            input_tokens=inputs,
            cached_tokens=cached,
        )
    raise ValueError(f"not a row scored token by token: {row.kind!r}")
