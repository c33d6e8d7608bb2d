"""Text a request carries (`Text`: prompts, stop strings, candidates; valid Unicode, so no lone
surrogate reaches a tokenizer) and a chat turn (`ChatMessage`), whose extra fields are checked the same
way."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, ConfigDict, Field, model_validator

from .strict_model import StrictModel


def _unicode(v: str) -> str:
    """Text a tokenizer can take: JSON may carry a lone surrogate (`\\ud83d` without its pair), which
    decodes to a Python string that is not Unicode text and that no tokenizer encodes."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"is not valid Unicode: a lone surrogate U+{ord(v[e.start]):04X} at character {e.start} (a JSON "
            "\\u escape of a character beyond U+FFFF must come as a pair: high, then low surrogate)"
        ) from None
    return v


Text = Annotated[str, AfterValidator(_unicode)]  # request text: prompts, messages, stop strings, candidates


def _unicode_values(value: object) -> None:
    """`_unicode` for every string in a JSON-like value (a chat message's extra fields)."""
    if isinstance(value, str):
        _unicode(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _unicode_values(k)
            _unicode_values(v)
    elif isinstance(value, list | tuple):
        for v in value:
            _unicode_values(v)


class ChatMessage(StrictModel):
    """One turn of a chat: `role` is free-form (system, user, assistant, tool, ...) for the template."""

    model_config = ConfigDict(extra="allow", frozen=True)  # templates may read e.g. `name`, `tool_calls`
    role: Text = Field(min_length=1)
    content: Text

    @model_validator(mode="after")
    def _extra_is_unicode(self) -> ChatMessage:
        for name, value in (self.model_extra or {}).items():
            try:
                _unicode_values(value)
            except ValueError as e:
                raise ValueError(f"field {name!r} {e}") from None
        return self
