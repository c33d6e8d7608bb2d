"""The host's time on a constrained decode batch's critical path, measured step by step.

A constrained row's next draw needs its mask, and its mask needs the token the step before drew: so
between reading a step's tokens back and launching the next draw (with the forward fed by it), the
device may wait on the host. `DecodeBatch` times that stretch of each such step here, split into its
parts, and the graphs it built before the read-back (where the masks are written in place:
`mask_buffer.py`), so a benchmark can say where a step's time goes (`bench/fig_structured.py`). Free
batches take no such step and record nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class CriticalPath:
    """Seconds summed over `steps` constrained steps (`DecodeBatch`'s steps with a forward ahead)."""

    steps: int = 0
    ahead_s: float = 0.0  # the next draw and forward built before the read-back: off the critical path
    read_s: float = 0.0  # waiting for the tokens (the device still computing their draw): not host work
    critical_s: float = 0.0  # tokens read back -> the next draw and forward launched (the parts below)
    take_s: float = 0.0  # the grammars taking the tokens
    draw_s: float = 0.0  # the masks computed and the draw's graph built (or the masks written)
    forward_s: float = 0.0  # the next forward's graph built (0 where built before the read-back)
    launch_s: float = 0.0  # the launch (with a launcher: waiting for the forward before it, handing over)

    def per_step_ms(self) -> dict[str, float]:
        """Each part in milliseconds a step; empty when no step was timed."""
        if not self.steps:
            return {}
        return {f.name[:-2] + "_ms": 1e3 * getattr(self, f.name) / self.steps for f in fields(self)[1:]}
