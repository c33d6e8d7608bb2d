"""The base every wire model extends (`StrictModel`: unknown fields are errors, instances are frozen) and
the serializer helper that leaves out optional fields a reader did not ask for (`without_none`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def without_none(data: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """`data` less the fields among `names` that are None: fields a reader must have asked for, so an
    older reader (which forbids unknown fields) never sees them."""
    for name in names:
        if data.get(name) is None:
            data.pop(name, None)
    return data
