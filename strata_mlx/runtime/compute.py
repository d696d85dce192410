"""A MoE layer's experts computed from arena slots, once the handshake knows which slots.

Owns the calls to the layer's expert kernel (resolved once per layer, strata_mlx.runtime.kernels)
and the expert-major groups a layer runs in when it needs more experts than the arena has
slots. Never decides what to read or predicts (the expert cache does), and never lets where an
expert sits change a result: the records of a layer's distinct experts are gathered in
expert-id order and computed as one batch, whatever their slots.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from ..format.store import Manifest
from ..stream.arena import Arena
from ..stream.scheduler import Scheduler
from . import kernels


class LayerCompute:
    """The expert kernels of every MoE layer of one model, reading that model's arena.
    `fake_stream`: every expert counts as resident, its bytes whatever its slot holds (times
    compute alone)."""

    def __init__(self, manifest: Manifest, arena: Arena, sched: Scheduler, fake_stream: bool):
        self.arena = arena
        self.sched = sched
        self.fake_stream = fake_stream
        # Kernels resolved once per layer: nothing on the hot path inspects a layout.
        self.kernel = {l: kernels.expert_kernel(manifest.layout_of(l)) for l in manifest.moe_layers}
        # Kernels that take one token's pairs by their slots as they are (the GPU dialects').
        self.pairs = {l: getattr(fn, "pairs", None) for l, fn in self.kernel.items()}
        self._pair_index: dict[tuple, mx.array] = {}
        self._local = np.zeros(manifest.num_experts, dtype=np.uint32)  # expert -> local index

    def by_expert(self, layer, x, ids, shape, needed, slots) -> mx.array:
        """x [..., D] routed to `ids` [T, k] (`shape` the routing's shape), the distinct
        experts `needed` (ascending) read from `slots` -> [..., k, D]."""
        if ids.shape[0] == 1:  # one token (decode): its k ids are distinct, `needed` sorted
            pos = {e: i for i, e in enumerate(needed)}
            local = mx.array([pos[e] for e in ids[0].tolist()], dtype=mx.uint32).reshape(shape)
        else:  # a table lookup: np.searchsorted took 0.44 ms for a 1024-token chunk
            table = self._local
            table[needed] = np.arange(len(needed), dtype=np.uint32)
            local = mx.array(table[ids].reshape(shape))
        slots = mx.array(np.asarray(slots, dtype=np.uint32))
        return self.kernel[layer](x, self.arena.rows, slots, local)

    def one_token(self, layer: int, x: mx.array, inds: mx.array, slots: list[int]) -> mx.array:
        """x [..., D] of one token routed to inds [..., k], pair p's expert in `slots[p]`
        (decode's handshake: pair by pair, no local index; by_expert's outputs bit for bit)
        -> [..., k, D]."""
        return self.by_pair(layer, x, inds, mx.array(slots, dtype=mx.uint32))

    def by_pair(self, layer: int, x: mx.array, inds: mx.array, slots: mx.array) -> mx.array:
        """x [..., D] routed to inds [..., k], pair p read from `slots` [..., k] at p in
        row-major order (slots looked up on the device: pipelined and gated decode) ->
        [..., k, D]. One token goes to the kernels' `pairs` where they have it: the same
        kernels on the same inputs, without the general call's index, gather, tile plan and
        reshapes (two launches a layer instead of four)."""
        direct = self.pairs[layer]
        if direct is not None and inds.size == inds.shape[-1]:
            return direct(x, self.arena.rows, slots)  # (reads slots flat, whatever its shape)
        slots = slots.reshape(-1)
        idx = self._pair_index.get(inds.shape)
        if idx is None:  # pair p reads slots[p]
            idx = mx.arange(inds.size, dtype=mx.uint32).reshape(inds.shape)
            self._pair_index[inds.shape] = idx
        return self.kernel[layer](x, self.arena.rows, slots, idx)

    def fake(self, layer, x, inds, ids, needed) -> mx.array:
        """Compute alone: the experts' bytes are whatever the first slots hold (zeros or stale
        records), so outputs are meaningless but the work is the same, expert-major groups
        included when the layer needs more experts than the arena has slots."""
        self.sched.stats.hits += len(needed)
        if len(needed) > self.arena.n_slots:
            return self.groups(layer, x, inds, ids, needed)
        slots = [i % self.arena.n_slots for i in range(len(needed))]
        return self.by_expert(layer, x, ids, inds.shape, needed, slots)

    def groups(self, layer, x, inds, ids, needed) -> mx.array:
        """Expert-major groups: each group is made resident, computed with the full batch shape
        (absent experts' rows borrow a group member's record and are discarded), then evaluated
        so its slots can be reused. Each kept row is bit-identical to the one-pass result.
        In fake-stream mode the same groups are computed from whatever the slots hold."""
        n, sched, arena = self.arena.n_slots, self.sched, self.arena
        y = None
        for g in range(0, len(needed), n):
            group = needed[g : g + n]
            sched.stats.groups += 1
            if self.fake_stream:  # compute alone: any slots, nothing read or pinned
                slots = [i % n for i in range(len(needed))]
            else:
                waits = sched.claim(layer, group)
                t = time.perf_counter()
                sched.wait(waits)
                sched.stats.exposed_wait_s += time.perf_counter() - t
                with sched.lock:
                    gslots = {e: arena.slot_of[(layer, e)] for e in group}
                    arena.pin(gslots.values())
                filler = gslots[group[0]]
                slots = [gslots.get(e, filler) for e in needed]
            yg = self.by_expert(layer, x, ids, inds.shape, needed, slots)
            member = np.isin(ids, group).reshape(*inds.shape, 1)
            y = yg if y is None else mx.where(mx.array(member), yg, y)
            mx.eval(y)
            with sched.lock:
                arena.unpin_all()
        return y
