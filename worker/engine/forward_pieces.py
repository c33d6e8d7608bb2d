"""A verify step's forward launched in pieces while the rest of it is built.

A plain decode step's build overlaps a launch (`launcher.py`): step N+1 is built on step N's lazy
outputs while N is launched. A verify step of speculative decoding keeps no step in flight (the next
step's drafts depend on what this one keeps), so its forward would be built whole and then launched
whole: on a GPU, where both are host work, one cost after the other (`bench/README.md`).

`ForwardPieces` is handed each decoder layer's output as the forward is built (a `LayerSink`). Every
`every` layers it queues a launch of that output on the launcher's thread (`Launcher.launch_behind`:
the launches run one at a time, in order), and the loop's thread builds the next layers on it while it
is launched. The rest of the forward (its last layers, the logits and what is built on them) is the
last piece (`launch`). The step then costs about the longer of building and launching plus one piece,
not their sum. A piece's outputs are built upon, never read, until `wait`: the launcher's rule.

Without a launcher (the CPU build; `decode_overlap` off) nothing is launched in pieces: `launch` is one
`mx.async_eval` of the whole forward on this thread, as a verify step always did.
"""

from __future__ import annotations

import mlx.core as mx

from mlxq.worker.engine.launcher import Launcher
from mlxq.worker.engine.models.layer_taps import LayerSink

# Launches of one forward: the first piece's build is the part left on the critical path, and every
# launch has a cost of its own (handing the work to the launcher's thread, MLX's commit).
PIECES = 8


class ForwardPieces:
    """One forward's launches: a piece every `every` decoder layers as they are built (with a
    launcher), then the rest (`launch`). Passes every layer's output on to `taps` (a drafter's layer
    taps, where the forward has them: `passing`)."""

    def __init__(self, launcher: Launcher | None, layers: int, pieces: int | None = None) -> None:
        pieces = PIECES if pieces is None else pieces
        if pieces < 1:
            raise ValueError(f"a forward is launched in 1 piece or more, got {pieces}")
        self.launcher = launcher
        self.every = -(-layers // pieces)  # the last piece ends with the forward, not at a layer
        self.taps: LayerSink | None = None
        self.launched = 0  # pieces launched so far (the last one included)

    def passing(self, taps: LayerSink | None) -> ForwardPieces:
        """These pieces, passing every layer's output on to `taps` as well."""
        self.taps = taps
        return self

    def take(self, layer: int, hidden: mx.array) -> None:
        """Decoder layer `layer`'s output, lazy: launched where a piece ends (not the final norm's)."""
        if self.taps is not None:
            self.taps.take(layer, hidden)
        if self.launcher is not None and layer >= 0 and (layer + 1) % self.every == 0:
            self.launcher.launch_behind(hidden)
            self.launched += 1

    def launch(self, *arrays: mx.array) -> None:
        """Launch the rest: the forward's outputs and everything built on them (behind the pieces)."""
        if self.launcher is None:
            mx.async_eval(*arrays)
        else:
            self.launcher.launch_behind(*arrays)
        self.launched += 1

    def wait(self) -> None:
        """Return once every piece launched so far is launched (then arrays may be read)."""
        if self.launcher is not None:
            self.launcher.wait()
