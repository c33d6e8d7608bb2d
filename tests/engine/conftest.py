"""Fixtures every engine test shares."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from engines import close_engines


@pytest.fixture(autouse=True)
def _close_engines() -> Iterator[None]:
    """Engines a test loaded through `engines.closed_after_test` are closed when it ends."""
    yield
    close_engines()
