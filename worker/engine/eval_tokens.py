"""Turning continuation, rolling and prompt-logprob rows into `TokenSeq`s, as lm-evaluation-harness does.

lm-eval defines what a loglikelihood is over tokens, so matching its numbers means matching its
tokenization (its Hugging Face backend, `HFLM`, in 0.4.x):

- A continuation after a context: whitespace that ends the context moves to the front of the
  continuation (" Paris" is one word-initial token, not a space and then "Paris"); then context +
  continuation is encoded whole, the context alone, and the continuation is what the whole holds after
  the context's token count. The scored sequence is the context's own tokens followed by those.
- An empty context: the continuation is encoded alone after one prefix token (BOS, or EOS where the
  tokenizer has no BOS), so its first token has something to condition on.
- A rolling text (perplexity): encoded once, then cut into disjoint windows of at most `window` input
  tokens: the first conditions on the prefix token, each later one on as many tokens before it as still
  fit, and every token of the text is scored exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator

from mlxq.jobs.errors import InvalidRequest
from mlxq.worker.engine.text.tokenizer import Tokenizer
from mlxq.worker.engine.token_scoring import TokenSeq


def prefix_token(tokenizer: Tokenizer) -> int:
    """The token lm-eval puts before text that has no context of its own: BOS, else EOS."""
    if tokenizer.bos_id is not None:
        return tokenizer.bos_id
    eos = tokenizer.special_tokens.get("eos_token")
    eos_id = None if eos is None else tokenizer.backend.token_to_id(eos)
    if eos_id is None:
        raise InvalidRequest("the model's tokenizer has neither a BOS nor an EOS token to condition on")
    return int(eos_id)


def continuation_seqs(
    tokenizer: Tokenizer,
    index: int,
    context: str,
    continuations: list[str],
    add_special_tokens: bool,
    split_special: bool,
) -> list[TokenSeq]:
    """One `TokenSeq` per continuation of row `index` (see the module's docstring)."""

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens, split_special=split_special)

    out = []
    for j, continuation in enumerate(continuations):
        if context == "":
            ctx, cont = [prefix_token(tokenizer)], encode(continuation)
        else:
            n_spaces = len(context) - len(context.rstrip())
            head, tail = (
                (context[:-n_spaces], context[-n_spaces:] + continuation)
                if n_spaces
                else (context, continuation)
            )
            ctx = encode(head)
            cont = encode(head + tail)[len(ctx) :]
        if not ctx:
            raise InvalidRequest(
                f"row {index}: the prompt {context!r} encodes to no tokens once its trailing whitespace "
                "moves to the continuation; nothing conditions the continuation's first token"
            )
        if not cont:
            raise InvalidRequest(f"row {index}: continuation {j} ({continuation!r}) encodes to no tokens")
        out.append(TokenSeq(ctx + cont, len(ctx)))
    return out


def rolling_windows(tokens: list[int], prefix: int, window: int) -> Iterator[tuple[list[int], list[int]]]:
    """lm-eval's disjoint rolling windows (`get_rolling_token_windows` with a context of 1, then
    `make_disjoint_window`): (context, scored tokens) pairs whose concatenation is at most `window` + 1
    tokens, the scored parts together being `tokens` once, in order."""
    if not tokens:
        return
    first = min(window, len(tokens))
    yield [prefix], tokens[:first]
    done = first
    while done < len(tokens):
        n = min(len(tokens) - done, window)
        end = done + n
        context = tokens[max(0, end - window - 1) : end - 1]
        yield context[: len(context) - (n - 1)], tokens[end - n : end]
        done = end


def rolling_seqs(tokenizer: Tokenizer, tokens: list[int], window: int) -> list[TokenSeq]:
    return [TokenSeq(c + s, len(c)) for c, s in rolling_windows(tokens, prefix_token(tokenizer), window)]
