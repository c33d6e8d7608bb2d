"""The host's time on a constrained decode batch's critical path, measured step by step.

A constrained row's next draw needs its mask, and its mask needs the token the step before drew: so
between reading a step's tokens back and launching the next draw (with the forward fed by it), the
device may wait on the host. A decode batch's `ForwardAhead` times that stretch of each such step
here, split into its parts, so a benchmark can say where a step's time goes (`bench/fig_structured.py`).
Free batches take no such step and record nothing.

Where the masks are written in place (`mask_buffer.py`), the mask thread computes them while the
loop thread builds the draw and the forward (`masks`, the thread's own time, overlaps `draw` and
`forward`; `join` is the wait for it past them); else the masks are computed within `draw`. The tokens
are handled after the launch, in either order. `host_ms` (`per_step_ms`) sums the loop thread's work
a step: with the device waiting on the host, a step lasts at least that long.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class CriticalPath:
    """Seconds summed over `steps` constrained steps (`DecodeBatch`'s steps with a forward ahead)."""

    steps: int = 0
    read_s: float = 0.0  # waiting for the tokens (the device still computing their draw): not host work
    critical_s: float = 0.0  # tokens read back -> the next draw and forward launched (the parts below)
    take_s: float = 0.0  # the grammars taking the tokens
    draw_s: float = 0.0  # the draw's graph built (in the plain order with the masks computed)
    forward_s: float = 0.0  # the next forward's graph built
    join_s: float = 0.0  # in place: waiting for the mask thread past the graphs
    launch_s: float = 0.0  # the launch (with a launcher: waiting for the forward before it, handing over)
    handle_s: float = 0.0  # the tokens handled (text, stop strings, sinks), after the launch
    masks_s: float = 0.0  # in place: the mask thread computing the masks, beside `draw` and `forward`
    forward_launch_s: float = 0.0  # with a launcher: the forward's launch behind the draw (its thread)

    def per_step_ms(self) -> dict[str, float]:
        """Each part in milliseconds a step, and `host_ms`: the loop thread's work (all but `read`,
        `critical`, `masks` and `forward_launch`); empty when no step was timed."""
        if not self.steps:
            return {}
        out = {f.name[:-2] + "_ms": 1e3 * getattr(self, f.name) / self.steps for f in fields(self)[1:]}
        serial = ("take_ms", "draw_ms", "forward_ms", "join_ms", "launch_ms", "handle_ms")
        out["host_ms"] = sum(out[k] for k in serial)
        return out
