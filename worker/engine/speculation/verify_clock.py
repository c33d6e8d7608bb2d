"""Where a decode batch's verify steps spend their time, measured step by step.

A verify step keeps nothing in flight (the next step's drafts depend on what this one keeps), so its
whole length is on the critical path: reading the pending tokens back, drafting, building and
launching one forward for every row's drafts, waiting for the device, trimming the caches and
handling the kept tokens. `DecodeBatch.verify_with` times each part here so a benchmark can say what a
verify step costs against a plain one (`bench/fig_speculation.py`) and which part to shorten; nothing
in the engine reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from itertools import pairwise


@dataclass
class VerifyClock:
    """Seconds summed over `steps` verify steps, and the tokens they fed and gave."""

    steps: int = 0
    fed: int = 0  # columns fed (rows x width, padding included)
    given: int = 0  # tokens the rows took (pending tokens and drafts kept)
    read_s: float = 0.0  # the step before finished and its pending tokens read back
    draft_s: float = 0.0  # the drafters' proposals (and a constrained row's cut and masks)
    build_s: float = 0.0  # the forward's and the verification's graphs built
    launch_s: float = 0.0  # their launch past the build (with a launcher, pieces launched while it was
    # built: `forward_pieces.py`) and `meanwhile`
    wait_s: float = 0.0  # waiting for the device: the kept counts read back
    trim_s: float = 0.0  # the caches cut back to what each row kept
    handle_s: float = 0.0  # the rows taking their tokens (text, stop strings, streams)

    def note(self, fed: int, given: int, marks: Sequence[float]) -> None:
        """One verify step: the columns it fed, the tokens it gave, and `marks`, the time it began, then
        the times its parts ended, in the order of the fields above."""
        self.steps, self.fed, self.given = self.steps + 1, self.fed + fed, self.given + given
        for part, (start, end) in zip(fields(self)[3:], pairwise(marks), strict=True):
            setattr(self, part.name, getattr(self, part.name) + end - start)

    @property
    def total_s(self) -> float:
        """The verify steps' whole time."""
        return float(sum(getattr(self, f.name) for f in fields(self)[3:]))

    def per_step_ms(self) -> dict[str, float]:
        """Each part in milliseconds a step, with the step's whole and the tokens a step gave; empty when
        no step was timed."""
        if not self.steps:
            return {}
        parts = {f.name[:-2] + "_ms": 1e3 * getattr(self, f.name) / self.steps for f in fields(self)[3:]}
        return {
            **parts,
            "step_ms": sum(parts.values()),
            "fed_per_step": self.fed / self.steps,
            "given_per_step": self.given / self.steps,
        }
