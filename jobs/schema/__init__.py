"""The wire format: requests, results and stream events, as pydantic models.

Any language may produce jobs and read results; these models are the one definition of what crosses
Redis. Field names follow OpenAI's completions/chat APIs where one exists. Unknown fields are errors,
so a typo (`max_token`) fails the job instead of being silently ignored.

A module per family, re-exported here, so every reader imports `mlxq.jobs.schema`: `generate_request`
(with `sampling_params`, `response_format`) and `generate_result`; `score_request` and `score_result`;
`stream_events`; what several share: `request_text` (`Text`, `ChatMessage`), `logprobs` and
`strict_model` (the base of them all).
"""

from __future__ import annotations

from .generate_request import MAX_STOP_STRINGS, GenerateRequest
from .generate_result import FinishReason, GenerateResult, Timings, Usage
from .logprobs import GeneratedLogprob, TopLogprob
from .request_text import ChatMessage, Text
from .response_format import (
    GrammarFormat,
    JsonObjectFormat,
    JsonSchemaFormat,
    JsonSchemaSpec,
    RegexFormat,
    ResponseFormat,
    TextFormat,
)
from .sampling_params import SamplingParams
from .score_request import MAX_TOP_LOGPROBS, ScoreRequest, ScoreRow
from .score_result import ContinuationScore, PromptLogprobs, RollingScore, ScoredRow, ScoreResult
from .stream_events import DoneEvent, ErrorEvent, RestartEvent, StreamEvent, TokenEvent, parse_event

__all__ = [
    "MAX_STOP_STRINGS",
    "MAX_TOP_LOGPROBS",
    "ChatMessage",
    "ContinuationScore",
    "DoneEvent",
    "ErrorEvent",
    "FinishReason",
    "GenerateRequest",
    "GenerateResult",
    "GeneratedLogprob",
    "GrammarFormat",
    "JsonObjectFormat",
    "JsonSchemaFormat",
    "JsonSchemaSpec",
    "PromptLogprobs",
    "RegexFormat",
    "ResponseFormat",
    "RestartEvent",
    "RollingScore",
    "SamplingParams",
    "ScoreRequest",
    "ScoreResult",
    "ScoreRow",
    "ScoredRow",
    "StreamEvent",
    "Text",
    "TextFormat",
    "Timings",
    "TokenEvent",
    "TopLogprob",
    "Usage",
    "parse_event",
]
