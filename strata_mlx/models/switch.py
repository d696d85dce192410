"""The seam between a family's MoE block and whatever holds its experts.

Model files hold a `SwitchGLU(layer)` where mlx-lm holds a stacked all-experts SwitchGLU. It
asks an `ExpertSource` for the layer's routed experts' outputs and combines them; nothing
indexes a stacked tensor of every expert. The runtime's expert cache is the source a loaded
model attaches (strata_mlx.runtime.experts.ExpertCache); a research script may attach its own.

Owns the combine (scores times outputs, summed in their dtype), the route-bonus and dump hooks'
calls. Never reads records, chooses slots or imports the runtime: the source does all of that.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import mlx.core as mx
import mlx.nn as nn

# dump(layer, x, ids, scores, y): a MoE layer's state (--dump-moe)
Dump = Callable[[int, mx.array, mx.array, mx.array, mx.array], None]


@runtime_checkable
class ExpertSource(Protocol):
    """What the seam asks of the object holding a model's experts."""

    route_bonus: float  # cache-aware routing's bonus on resident experts' logits (0: exact)
    decoding: bool  # the forward is a decode step (the bonus applies only there)
    dump: Dump | None  # gets every MoE layer's state, when set

    def run_layer(self, layer: int, x: mx.array, inds: mx.array) -> mx.array:
        """Experts of `layer` for x [..., D] routed to inds [..., k] -> [..., k, D]."""
        ...

    def resident_mask(self, layer: int) -> mx.array:
        """[num_experts] float: 1 where the expert of `layer` is resident."""
        ...


class SwitchGLU(nn.Module):
    """A layer's routed SwiGLU experts, held by an expert source (the seam)."""

    def __init__(self, layer: int):
        super().__init__()
        self.layer = layer
        self.expert_cache: ExpertSource | None = None

    def attach(self, source: ExpertSource) -> None:
        """Run this layer's experts through `source` (the model object does, once)."""
        self.expert_cache = source

    def __call__(self, x: mx.array, indices: mx.array, scores: mx.array | None = None):
        """x [..., D] routed to indices [..., k]: with `scores` [..., k], the MoE output
        [..., D] (the experts' outputs weighted by the scores and summed, in their dtype, as
        mlx-lm's blocks do; handed to the dump hook); without, each expert's [..., k, D]."""
        if self.expert_cache is None:
            raise RuntimeError("experts not attached: load the model with strata_mlx.load()")
        y = self.expert_cache.run_layer(self.layer, x, indices)
        if scores is None:
            return y
        y = (y * scores[..., None]).sum(axis=-2).astype(y.dtype)
        self.observe(x, indices, scores, y)
        return y

    def route_bonus(self) -> mx.array | None:
        """Cache-aware routing: a bonus on resident experts' router logits, decode only."""
        c = self.expert_cache
        if c is None or not c.route_bonus or not c.decoding:
            return None
        return c.route_bonus * c.resident_mask(self.layer)

    def observe(self, x: mx.array, inds: mx.array, scores: mx.array, y: mx.array) -> None:
        """Hand the layer's MoE state to a dump hook (--dump-moe), if one is set."""
        c = self.expert_cache
        if c is not None and c.dump is not None:
            c.dump(self.layer, x, inds, scores, y)
