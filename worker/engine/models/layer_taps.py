"""Hidden states of chosen decoder layers, collected during a forward that asks for them.

A drafter that reads the target's own hidden states (DFlash's context features: `speculation/dflash.py`)
asks a forward for the outputs of a few decoder layers: the forward is passed a `LayerTaps` naming them
and fills it as it goes (a prefill of a prompt whose drafter reads them, and every forward of the
decode batch). A forward given none does nothing more than before (one comparison per layer).
A forward hands each layer's output to any `LayerSink`: a verify step's forward launched in pieces as
it is built (`forward_pieces.py`) is one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import mlx.core as mx

# The final norm's output (the hidden states the LM head reads, transformers' `hidden_states[-1]`), as a
# layer `LayerTaps` may list; taken only from forwards computing every position (no `last`).
FINAL = -1


class LayerSink(Protocol):
    """What a forward hands the residual stream after each decoder layer but the last (and, computing
    every position, the final norm's output as `FINAL`), lazy, as it builds them."""

    def take(self, layer: int, hidden: mx.array) -> None: ...


class LayerTaps:
    """The layers to collect (as `layers` lists them, in that order) and, after a forward, their outputs:
    the residual stream after each listed decoder layer (what transformers' `hidden_states[i + 1]`
    holds for every layer but the last, whose entry there is the final norm's output instead), or for
    `FINAL` the final norm's output."""

    def __init__(self, layers: Sequence[int]) -> None:
        if not layers:
            raise ValueError("layer taps need at least one layer")
        self.layers = tuple(int(i) for i in layers)
        self.wanted = frozenset(self.layers)
        self._outputs: dict[int, mx.array] = {}

    def take(self, layer: int, hidden: mx.array) -> None:
        """The forward's output of decoder layer `layer` (B, L, hidden), if it is one of `layers`."""
        if layer in self.wanted:
            self._outputs[layer] = hidden

    def features(self) -> mx.array:
        """The listed layers' outputs side by side (B, L, len(layers) * hidden), in `layers`' order."""
        missing = [i for i in self.layers if i not in self._outputs]
        if missing:
            raise ValueError(f"the forward computed no output of layers {missing} for every position")
        return mx.concatenate([self._outputs[i] for i in self.layers], axis=-1)
