"""The expert computation on MLX's CPU device through native loops (_native/cpu_experts.c).

Owns `cpu_expert_kernel(layout)`: for records whose projections are MLX affine codes (2, 4 or
8 bits) or float weights, at least one of them affine, no biases, and float32 activations, an
ExpertFn whose outputs are bit for bit those of the reference path (format.quant.switch_glu_reference: MLX's CPU quantized matmul,
the activation, the down projection), only faster. MLX's CPU kernel computes each (token,
expert) pair on its own, one output's sum after another; the native loops run many outputs'
sums side by side in vector lanes and decode a slot's codes once for all the pairs routed to
it, so the work a batched decode step adds per row shrinks. The activation between the two
matmuls stays MLX's own op, and a float projection (a down projection too narrow to
quantize) the reference's own gather_mm, so each rounds as the reference's does.

Used only where it agrees: the first time a layout is resolved in a process it runs on random
records against the reference (decode and sorted-prefill pair counts) and any difference in
any bit sends that layout to the reference, silently (it is a speed path, not a format).

Never: runs off the CPU device, reads the store, or chooses slots. The host reads the
activations (`np.asarray`), so a caller that builds layers without a host sync (the pipelined
decoder) syncs at each layer here.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from custom_kernels.formats import activation_fn

from ..format.quant import component_views, switch_glu_reference
from ..format.store import PROJECTIONS, RecordLayout

try:
    from .. import _cpu_experts as native
except ImportError:  # the extension is not built: the reference path runs
    native = None

# x [..., D], arena [n_slots, record_bytes] uint8, slots [n], idx [..., k] into slots
ExpertFn = Callable[[mx.array, mx.array, mx.array, mx.array], mx.array]

SCALE_KINDS = {"float32": 0, "float16": 1, "bfloat16": 2}
BITS = (2, 4, 8)

_AGREES: dict[str, bool] = {}


def supported(layout: RecordLayout) -> bool:
    """Whether the native loops can compute records of `layout`: affine codes they unpack
    (float projections beside them run MLX's op), no biases."""
    if native is None:
        return False
    names = {c.name for c in layout.components}
    affine = 0
    for p in PROJECTIONS:
        spec = layout.quant.get(p, {})
        if f"{p}.bias" in names:
            return False
        if spec.get("format") == "float":
            continue
        if spec.get("format") != "affine" or int(spec.get("bits", 0)) not in BITS:
            return False
        if not all(f"{p}.{part}" in names for part in ("weight", "scales", "biases")):
            return False
        kind = layout.component(f"{p}.scales").dtype
        if kind not in SCALE_KINDS or layout.component(f"{p}.biases").dtype != kind:
            return False
        affine += 1
    return affine > 0


def cpu_expert_kernel(layout: RecordLayout) -> ExpertFn | None:
    """The native ExpertFn of `layout`, or None where it does not apply or does not agree with
    the reference bit for bit (checked once per layout and process)."""
    if not supported(layout) or mx.default_device() != mx.cpu:
        return None
    fn = _kernel(layout)
    key = repr(layout.record_bytes) + repr(sorted(layout.quant.items())) + repr(layout.components)
    if key not in _AGREES:
        _AGREES[key] = _agrees(layout, fn)
    return fn if _AGREES[key] else None


def _kernel(layout: RecordLayout) -> ExpertFn:
    projs = {}
    for p in PROJECTIONS:
        spec = layout.quant[p]
        if spec["format"] != "affine":
            continue
        w, s, b = (layout.component(f"{p}.{part}") for part in ("weight", "scales", "biases"))
        projs[p] = (
            w.offset,
            s.offset,
            b.offset,
            w.shape[0],  # outputs
            int(spec["bits"]),
            int(spec["group_size"]),
            SCALE_KINDS[s.dtype],
        )
    activation = activation_fn(layout.activation)
    record_bytes = layout.record_bytes

    def run(x: mx.array, arena: mx.array, slots: mx.array, idx: mx.array) -> mx.array:
        if x.dtype != mx.float32:  # the native loops compute float32 only
            return switch_glu_reference(x, arena[slots], layout, idx)
        k, d = idx.shape[-1], x.shape[-1]
        n_tokens = x.size // d
        ids = idx.reshape(n_tokens, k)
        rows = np.asarray(arena)  # the arena in place: no copy
        slot_of = np.asarray(slots).astype(np.int32)
        pair_slot = np.ascontiguousarray(slot_of[np.asarray(ids).reshape(-1)])
        # pairs of one slot side by side: its codes are decoded once for all of them
        order = np.argsort(pair_slot, kind="stable").astype(np.int32)
        # each pair's input row: its token's (up, gate) or its own (down)
        token_of_pair = np.repeat(np.arange(n_tokens, dtype=np.int32), k)
        each_pair = np.arange(n_tokens * k, dtype=np.int32)
        views = None
        shape = (n_tokens, k, 1, -1)  # the reference's: [tokens, k, 1, outputs]

        def project(p: str, inputs: mx.array, per_pair: bool) -> mx.array:
            """inputs [tokens, 1, 1, in] (per_pair: [tokens, k, 1, in]) -> [tokens, k, 1, out]"""
            nonlocal views
            if p not in projs:  # float weights: the reference's op (float32), pair by pair
                if views is None:
                    views = component_views(arena[slots], layout)
                w = views[f"{p}.weight"].swapaxes(-1, -2)
                return mx.gather_mm(inputs, w, rhs_indices=ids, sorted_indices=False)
            w_off, s_off, b_off, n_out, bits, group_size, kind = projs[p]
            flat = np.asarray(inputs).reshape(-1, inputs.shape[-1])
            pair_x = each_pair if per_pair else token_of_pair
            out = np.empty((pair_slot.size, n_out), np.float32)
            native.qmm_pairs(
                out,
                np.ascontiguousarray(flat, np.float32),
                rows,
                pair_x,
                pair_slot,
                order,
                record_bytes,
                w_off,
                s_off,
                b_off,
                n_out,
                flat.shape[1],
                bits,
                group_size,
                kind,
            )
            return mx.array(out).reshape(shape)

        x4 = x.reshape(n_tokens, 1, 1, d)
        up = project("up_proj", x4, False)
        gate = project("gate_proj", x4, False)
        y = project("down_proj", activation(gate, up), True)
        return y.reshape(*idx.shape, d)

    return run


def _agrees(layout: RecordLayout, fn: ExpertFn, seed: int = 0) -> bool:
    """Whether `fn` gives the reference's outputs bit for bit on random records: one token,
    a few (decode's shapes), and enough pairs for the reference's sorted path."""
    from .kernels import hidden_of, random_arena

    rng = np.random.default_rng(seed)
    n_experts, k = 8, 4
    arena = mx.array(random_arena(layout, n_experts, n_experts + 2, rng))
    for n_tokens in (1, 3, 17):
        ids = np.stack([rng.choice(n_experts, k, replace=False) for _ in range(n_tokens)])
        needed = np.unique(ids)
        slots = mx.array((needed + 1).astype(np.uint32))
        idx = mx.array(np.searchsorted(needed, ids).astype(np.uint32))
        x = mx.array(rng.standard_normal((n_tokens, hidden_of(layout))).astype(np.float32))
        ref = np.array(switch_glu_reference(x, arena[slots], layout, idx))
        got = np.array(fn(x, arena, slots, idx))
        if ref.shape != got.shape or not np.array_equal(ref.view(np.uint32), got.view(np.uint32)):
            return False
    return True
