"""Structured output: `response_format` in OpenAI's shape (`text`, `json_object`, `json_schema`), plus
two mlxq types of the same shape: `regex` and `grammar` (Lark, as llguidance reads it). One field, so a
request carries at most one constraint."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from .request_text import Text
from .strict_model import StrictModel


class TextFormat(StrictModel):
    type: Literal["text"]


class JsonObjectFormat(StrictModel):
    """Any JSON object."""

    type: Literal["json_object"]


class JsonSchemaSpec(StrictModel):
    """OpenAI's `json_schema` object: the schema under `schema` (a JSON Schema document)."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_by_name=True, serialize_by_alias=True)
    name: Text = Field(default="response", min_length=1, max_length=64)
    description: Text | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(StrictModel):
    """JSON that validates against `json_schema.schema`."""

    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class RegexFormat(StrictModel):
    """Text that matches `regex` whole."""

    type: Literal["regex"]
    regex: Text = Field(min_length=1)


class GrammarFormat(StrictModel):
    """Text of the Lark grammar `grammar` (its `start` rule), in llguidance's dialect of Lark."""

    type: Literal["grammar"]
    grammar: Text = Field(min_length=1)


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat | RegexFormat | GrammarFormat,
    Field(discriminator="type"),
]
