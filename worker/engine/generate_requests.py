"""Generation requests prepared for a batch: each one's size checked, its prompt tokenized, its sampler built.

A request larger than the worker takes (`EngineOptions`' limits on its messages, characters and stop
strings) fails before any work is done on it; its prompt becomes token ids (raw text encoded, a chat
rendered by the model's template, or ids as given) that fit the model's context; its
`response_format` is compiled (`ConstraintCompiler`) and its sampling settings become a `Sampler`.
"""

from __future__ import annotations

from typing import Any

from mlxq.jobs.errors import ContextTooLong, InvalidRequest
from mlxq.jobs.schema import GenerateRequest
from mlxq.worker.engine.constraint import ConstraintCompiler
from mlxq.worker.engine.engine_options import EngineOptions
from mlxq.worker.engine.sampler import Sampler
from mlxq.worker.engine.text.chat_tokens import chat_tokens
from mlxq.worker.engine.text.tokenizer import Tokenizer


class GenerateRequests:
    """Generation requests turned into what a batch decodes (prompt tokens, token budget, sampler), under
    this worker's limits: the options' messages, characters and stop strings, the model's context and
    vocabulary; `constraints` compiles a request's `response_format` (the engine's)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        options: EngineOptions,
        context_length: int,
        vocab_size: int,
        constraints: ConstraintCompiler,
    ) -> None:
        self.tokenizer = tokenizer
        self.options = options
        self.context_length = context_length
        self.vocab_size = vocab_size
        self.constraints = constraints

    def prompt_tokens(self, request: GenerateRequest) -> list[int]:
        """Token ids for a request: raw `prompt` encoded (special-token text as text unless the request
        allows special tokens), `messages` rendered by the chat template (`chat_tokens`), or `prompt_ids`."""
        if request.messages is not None:
            ids = self.chat_tokens([m.model_dump() for m in request.messages])
        elif request.prompt_ids is not None:
            ids = list(request.prompt_ids)
            vocab = self.vocab_size
            if max(ids) >= vocab:
                raise InvalidRequest(f"prompt token id {max(ids)} is not in the vocabulary (0..{vocab - 1})")
        else:
            assert request.prompt is not None
            ids = self.tokenizer.encode(
                request.prompt,
                add_special_tokens=request.add_special_tokens,
                split_special=not request.allow_special_tokens,
            )
        if not ids:
            raise InvalidRequest("the prompt is empty: it encodes to no tokens")
        if len(ids) >= self.context_length:
            raise ContextTooLong(len(ids), self.context_length)
        return ids

    def chat_tokens(self, messages: list[dict[str, Any]], tokenizer: Tokenizer | None = None) -> list[int]:
        """Token ids of a chat rendered by the model's template, special-token text in the messages
        encoded as text (`text/chat_tokens.py`). `tokenizer`: a clone of the engine's (`Tokenizer.clone`)
        for a thread other than the engine's."""
        return chat_tokens(tokenizer or self.tokenizer, messages)

    @property
    def max_prompt_chars(self) -> int:
        """Characters a prompt (a chat's messages together) may have, checked before it is tokenized:
        the setting, else 32 per token of context (a token is a few characters; a text far longer than
        the context can hold would only cost its tokenizing before `ContextTooLong`)."""
        return self.options.max_prompt_chars or 32 * self.context_length

    def check_sizes(self, request: GenerateRequest) -> None:
        """`InvalidRequest` for a request larger than this worker takes, before any work is done on it."""
        if request.messages is not None and len(request.messages) > self.options.max_messages:
            raise InvalidRequest(
                f"`messages` holds {len(request.messages)} messages; this worker takes at most "
                f"{self.options.max_messages} (MLXQ_MAX_MESSAGES)"
            )
        if request.messages is not None:
            chars = sum(
                len(m.role) + len(m.content) + len(str(m.model_extra or "")) for m in request.messages
            )
        else:
            chars = len(request.prompt or "")
        if chars > self.max_prompt_chars:
            raise InvalidRequest(
                f"the prompt has {chars} characters; this worker takes at most {self.max_prompt_chars} "
                "(MLXQ_MAX_PROMPT_CHARS)"
            )
        if len(request.stop) > self.options.max_stops:
            raise InvalidRequest(
                f"the request has {len(request.stop)} stop strings; this worker takes at most "
                f"{self.options.max_stops} (MLXQ_MAX_STOPS)"
            )
        stop_chars = sum(len(stop) for stop in request.stop)
        if stop_chars > self.options.max_stop_chars:
            raise InvalidRequest(
                f"the stop strings have {stop_chars} characters together; this worker takes at most "
                f"{self.options.max_stop_chars} (MLXQ_MAX_STOP_CHARS)"
            )

    def prepare_generation(self, request: GenerateRequest) -> tuple[list[int], int, Sampler]:
        """Prompt tokens, the token budget and the sampler of a request; `InvalidRequest` if it is bad."""
        self.check_sizes(request)
        prompt = self.prompt_tokens(request)
        max_tokens = min(request.max_tokens, self.context_length - len(prompt))
        constraint = self.constraints.compile(request.response_format)  # its error before any token
        try:
            sampler = Sampler.from_request(
                request, vocab_size=self.vocab_size, prompt=prompt, constraint=constraint
            )
        except ValueError as e:
            raise InvalidRequest(str(e)) from e
        sampler.logprobs = request.logprobs
        return prompt, max_tokens, sampler
