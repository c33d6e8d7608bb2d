"""How a generation job draws its tokens (`SamplingParams`): temperature, top-p/top-k/min-p, seed, logit
bias and penalties, each bounded and finite. `GenerateRequest` extends it."""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import Field, ValidationInfo, field_validator

from .strict_model import StrictModel


def _finite(name: str, value: float) -> float:
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return value


class SamplingParams(StrictModel):
    """Sampling options shared by every generation request."""

    temperature: Annotated[float, Field(ge=0.0, le=100.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    seed: int | None = None
    logit_bias: dict[int, Annotated[float, Field(ge=-100.0, le=100.0)]] = Field(default_factory=dict)
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0

    @field_validator(
        "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"
    )
    @classmethod
    def _no_nan(cls, v: float, info: ValidationInfo) -> float:
        return _finite(info.field_name or "value", v)
