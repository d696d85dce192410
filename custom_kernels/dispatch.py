"""Expert kernels by backend: `kernel_for(backend, layout)` -> callable or None.

The callable has switch_glu's signature, `fn(x, arena, slots, idx, layout)`: x [..., D],
arena [n_slots, record_bytes] uint8 (read in place: weights are read at
slot * record_bytes + component offset, no gather copy), slots [n] uint32, idx [..., k] into
slots -> [..., k, D] in x's dtype. It returns None when a projection's format has no kernel
(float experts, GGUF types other than Q4_K/Q2_K/IQ2_XS/IQ3_S), so callers fall back to the
reference path. Kernels are generated and built once per (backend, layout) and cached.

Decode (few pairs per expert) runs the fused kernels with one (token, expert) pair per warp
row. Prefill (>= PREFILL_MIN_PAIRS_PER_EXPERT pairs per needed expert) runs PREFILL_STRATEGY:
  "dequant": a kernel decodes each needed slot's weights once into x's dtype, then mlx-lm's
             SwitchGLU arithmetic (sorted mx.gather_mm) runs on them;
  "fused":   the fused kernels with pairs sorted by slot, each warp taking a tile of up to
             PREFILL_TILE pairs that share a slot (a decoded chunk is reused for each).
Measured on the H200 (D=2048, inter=512, 512 experts, top-10, fp16, 1024 tokens): dequant
20.8 ms, fused tiles 33.5 ms, mx.gather_qmm 4-bit 12.5 ms; decode (1 token) fused 0.157 ms vs
gather_qmm 0.165 ms. The fused prefill loses on activation reads (each lane reads 16 strided
halves per chunk and pair); see benchmarks/kernels.py.

Each kernel's header carries only the parts of formats.h its body calls (algorithm.
kernel_header): MLX's CUDA kernel call copies the whole source on every call and hashes it at
eval, and every format's decoders made each source ~13-14 KB, where one format's make 4-7 KB.
STRATA_MLX_KERNEL_HEADER=own|full picks the header (own, the default; full: the whole of
formats.h, the same code compiled; benchmarks/kernel_call.py times the two), read when a
layout's kernels are first built.

Never: reads the store or chooses slots (strata_mlx.runtime.experts does), computes the
reference.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import import_module
from typing import Any

import mlx.core as mx

from . import algorithm
from .formats import PROJECTIONS, activation_fn, mx_dtype

BACKENDS = ("cuda", "metal", "host")
PREFILL_TILE = 8
PREFILL_STRATEGY = "dequant"
# Pairs per needed expert at which prefill tiles start to pay off (sorting costs a few ops).
PREFILL_MIN_PAIRS_PER_EXPERT = 4


def dequant_stores() -> str:
    """How the dequantize kernel stores a thread's 16 weights, STRATA_MLX_DEQUANT_STORES:
    "wide" (16-byte stores, the default) or "scalar" (one store a weight, the same values;
    algorithm.dequant_source). Read when a layout's dequantize kernels are first built."""
    env = os.environ.get("STRATA_MLX_DEQUANT_STORES", "wide")
    if env not in ("scalar", "wide"):
        raise ValueError(f"STRATA_MLX_DEQUANT_STORES={env!r}: one of scalar, wide")
    return env


def kernel_header() -> str:
    """What each kernel's header holds, STRATA_MLX_KERNEL_HEADER: "own" (the parts of
    formats.h the kernel calls, the default) or "full" (all of formats.h)."""
    env = os.environ.get("STRATA_MLX_KERNEL_HEADER", "own")
    if env not in algorithm.KERNEL_HEADERS:
        raise ValueError(f"STRATA_MLX_KERNEL_HEADER={env!r}: one of own, full")
    return env


def layout_signature(layout) -> str:
    return json.dumps(
        {
            "record_bytes": layout.record_bytes,
            "components": [asdict(c) for c in layout.components],
            "quant": layout.quant,
            "activation": getattr(layout, "activation", None),
        },
        sort_keys=True,
    )


@dataclass(frozen=True)
class _Launch:
    """The two fused kernels' calls for one shape of work, all but what changes per call (x,
    the arena, pair_slot): built once per shape for decode (`pairs`), where a layer's call is
    host time on every token."""

    gate_up: Callable
    down: Callable
    gate_up_inputs: tuple[mx.array, ...]  # after x, arena, pair_slot: tile_pairs, tables
    down_inputs: tuple[mx.array, ...]
    gate_up_args: dict[str, Any]  # grid, threadgroup, output shapes and dtypes, template
    down_args: dict[str, Any]

    def __call__(self, x: mx.array, arena: mx.array, pair_slot: mx.array) -> mx.array:
        (h,) = self.gate_up(inputs=[x, arena, pair_slot, *self.gate_up_inputs], **self.gate_up_args)
        (y,) = self.down(inputs=[h, arena, pair_slot, *self.down_inputs], **self.down_args)
        return y


class ExpertKernels:
    """The two kernels of one layout on one dialect (built lazily per tile size). header:
    "own" or "full" (kernel_header(); None reads it when the kernels are first built)."""

    def __init__(
        self,
        dialect: Any,
        layout,
        projections: dict[str, algorithm.Projection],
        header: str | None = None,
    ):
        self.dialect = dialect
        self.record_bytes = layout.record_bytes
        self.activation = getattr(layout, "activation", None)
        self.gate, self.up, self.down = (projections[p] for p in PROJECTIONS)
        self.hidden = self.gate.in_features
        self.inter = self.gate.out_features
        self.header = header
        self._built: dict[tuple[int, int], tuple[Any, Any, Any, Any]] = {}
        self._dequant_built: dict[str, tuple[Any, Any]] = {}
        self._tables: dict[str, mx.array] = {}
        self._pairs: dict[tuple, _Launch] = {}

    def sources(self, k: int, tm: int) -> tuple[algorithm.KernelSource, algorithm.KernelSource]:
        header = self.header or kernel_header()
        return (
            algorithm.gate_up_source(
                self.gate, self.up, k, self.record_bytes, tm, self.activation, header
            ),
            algorithm.down_source(self.down, self.record_bytes, tm, header),
        )

    def _kernels(self, k: int, tm: int):
        key = (k, tm)
        if key not in self._built:
            s1, s2 = self.sources(k, tm)
            self._built[key] = (s1, self.dialect.build(s1), s2, self.dialect.build(s2))
        return self._built[key]

    def dequant_sources(self) -> dict[str, algorithm.KernelSource]:
        projs = dict(zip(PROJECTIONS, (self.gate, self.up, self.down)))
        wide = dequant_stores() == "wide"
        header = self.header or kernel_header()
        return {
            p: algorithm.dequant_source(pr, self.record_bytes, p, wide, header)
            for p, pr in projs.items()
        }

    def _dequant_kernels(self):
        if not self._dequant_built:
            for p, src in self.dequant_sources().items():
                self._dequant_built[p] = (src, self.dialect.build(src))
        return self._dequant_built

    def _table(self, name: str) -> mx.array:
        if name not in self._tables:
            self._tables[name] = mx.array(algorithm.tables()[name])
        return self._tables[name]

    def __call__(
        self, x, arena, slots, idx, layout=None, tile: int | None = None, strategy=None
    ) -> mx.array:
        """strategy: None (automatic), "fused" (tile pairs per warp; tile None -> 1 for
        decode, PREFILL_TILE for prefill) or "dequant"."""
        k = idx.shape[-1]
        lead = idx.shape[:-1]
        if x.shape[-1] != self.hidden:
            raise ValueError(f"x has {x.shape[-1]} features, the experts take {self.hidden}")
        if arena.dtype != mx.uint8 or arena.ndim != 2 or arena.shape[1] != self.record_bytes:
            raise ValueError(f"arena must be uint8 [n_slots, {self.record_bytes}]")
        x2 = x.reshape(-1, self.hidden)
        idx2 = idx.reshape(-1, k)
        if x2.shape[0] != idx2.shape[0]:
            raise ValueError(f"x has {x2.shape[0]} tokens, idx {idx2.shape[0]}")
        slots = mx.array(slots) if not isinstance(slots, mx.array) else slots
        n_tokens = x2.shape[0]
        if n_tokens == 0:
            return mx.zeros((*lead, k, self.hidden), dtype=x.dtype)
        slots = slots.astype(mx.uint32)
        dense = n_tokens * k >= PREFILL_MIN_PAIRS_PER_EXPERT * max(slots.size, 1)
        if strategy is None:
            strategy = "fused" if tile is not None or not dense else PREFILL_STRATEGY
        if strategy == "dequant":
            y = self._run_dequant(x2, arena, slots, idx2, k)
        elif strategy in ("fused", "tiles"):
            if tile is None:
                tile = PREFILL_TILE if dense else 1
            y = self._run(x2, arena, slots, idx2, k, tile)
        else:
            raise ValueError(f"unknown strategy {strategy!r}")
        return y.reshape(*lead, k, self.hidden)

    def dequantize(self, arena, slots, dtype=mx.float32) -> dict[str, mx.array]:
        """{proj: [len(slots), out, in]} weights of the records in `slots`, decoded in place
        from the arena by the dequant kernels (float32 is exact for GGUF formats)."""
        slots = slots if isinstance(slots, mx.array) else mx.array(slots)
        return self._dequantize(arena, slots.astype(mx.uint32), dtype)

    def _dequantize(self, arena, slots, dtype) -> dict[str, mx.array]:
        out = {}
        for p, (src, run) in self._dequant_kernels().items():
            pr = {"gate_proj": self.gate, "up_proj": self.up, "down_proj": self.down}[p]
            (w,) = run(
                inputs=[arena, slots, *(self._table(t) for t in src.input_names[2:])],
                grid=(pr.out_features * pr.in_features // algorithm.CHUNK, slots.size, 1),
                threadgroup=(algorithm.THREADGROUP, 1, 1),
                output_shapes=[(slots.size, pr.out_features, pr.in_features)],
                output_dtypes=[dtype],
                template=[("T", dtype)],
            )
            out[p] = w
        return out

    def _run_dequant(self, x2, arena, slots, idx2, k: int) -> mx.array:
        if slots.size > self.dialect.MAX_GRID_Y:
            raise ValueError(f"{slots.size} slots in one call; at most {self.dialect.MAX_GRID_Y}")
        w = self._dequantize(arena, slots, x2.dtype)
        # mlx-lm's SwitchGLU arithmetic (as strata_mlx.format.quant.switch_glu_reference): pairs
        # sorted by expert, grouped matmuls.
        flat = idx2.flatten()
        order = mx.argsort(flat)
        inv = mx.argsort(order)
        xs = mx.expand_dims(x2, -2)[order // k]
        i = flat[order]

        projs = {"gate_proj": self.gate, "up_proj": self.up, "down_proj": self.down}

        def mm(a, p):
            y = mx.gather_mm(a, w[p].swapaxes(-1, -2), rhs_indices=i, sorted_indices=True)
            if projs[p].bias is not None:  # as SwitchLinear: bias[indices] over the row axis
                off, dtype = projs[p].bias
                n = projs[p].out_features
                raw = arena[slots, off : off + n * (4 if dtype == "float32" else 2)]
                bias = raw.view(mx_dtype(dtype)).reshape(slots.size, n).astype(y.dtype)
                y = y + mx.expand_dims(bias[i], -2)
            return y

        up = mm(xs, "up_proj")
        h = activation_fn(self.activation)(mm(xs, "gate_proj"), up)
        y = mm(h, "down_proj")
        return mx.unflatten(y[inv], 0, idx2.shape).squeeze(-2)

    def _max_tiles(self, n_pairs: int, n_slots: int, tile: int) -> int:
        # Each run of pairs sharing a slot makes ceil(len / tile) tiles, at most
        # len / tile + 1 - 1/tile; runs <= distinct slots <= n_slots.
        return n_pairs if tile == 1 else -(-n_pairs // tile) + min(n_slots, n_pairs)

    def _run(self, x2, arena, slots, idx2, k: int, tile: int) -> mx.array:
        n_tokens = x2.shape[0]
        if self._max_tiles(n_tokens * k, slots.size, tile) > self.dialect.MAX_GRID_Y:
            half = n_tokens // 2
            return mx.concatenate(
                [
                    self._run(x2[:half], arena, slots, idx2[:half], k, tile),
                    self._run(x2[half:], arena, slots, idx2[half:], k, tile),
                ]
            )
        pair_slot = slots[idx2.reshape(-1)]
        tiles, n_tiles = tile_pairs(pair_slot, tile, slots.size)
        run = self._launch(k, tile, tiles, n_tiles, n_tokens * k, x2.dtype, (n_tokens,))
        return run(x2, arena, pair_slot)

    def pairs(self, x, arena, pair_slot: mx.array) -> mx.array:
        """One token's experts pair by pair (decode's handshake): x [..., D] of one token,
        pair_slot uint32 [k] each pair's slot -> [..., k, D]. The same kernels on the same
        inputs as `self(x, arena, slots, idx)` where slots[idx] is pair_slot, with fewer graph
        ops: no gather of the pairs' slots, no tile plan, no reshapes (the kernels read x
        flat and write y in its final shape); the calls' arguments are built once per x shape,
        x dtype and k."""
        key = (x.shape, x.dtype, pair_slot.size)
        run = self._pairs.get(key)
        if run is None:
            shape, dtype, k = key
            if shape[-1] != self.hidden or math.prod(shape[:-1]) != 1:
                raise ValueError(f"x {shape}: one token of {self.hidden} features expected")
            tiles = mx.arange(k, dtype=mx.int32)  # tile_pairs' plan at tile 1: pair p in tile p
            run = self._pairs[key] = self._launch(k, 1, tiles, k, k, dtype, shape[:-1])
        return run(x, arena, pair_slot)

    def _launch(
        self, k: int, tile: int, tiles, n_tiles: int, n_pairs: int, dtype, lead: tuple
    ) -> _Launch:
        """The two fused kernels over `n_pairs` pairs in `tiles` (x [n_pairs / k, D] in
        `dtype`) -> y [*lead, k, D], lead the pairs' tokens' shape."""
        s1, k1, s2, k2 = self._kernels(k, tile)
        common = {
            "threadgroup": (algorithm.THREADGROUP, 1, 1),
            "output_dtypes": [dtype],
            "template": [("T", dtype)],
        }
        return _Launch(
            gate_up=k1,
            down=k2,
            gate_up_inputs=(tiles, *(self._table(t) for t in s1.input_names[4:])),
            down_inputs=(tiles, *(self._table(t) for t in s2.input_names[4:])),
            gate_up_args={
                "grid": (algorithm.WARP * self.inter, n_tiles, 1),
                "output_shapes": [(n_pairs, self.inter)],
                **common,
            },
            down_args={
                "grid": (algorithm.WARP * self.hidden, n_tiles, 1),
                "output_shapes": [(*lead, k, self.hidden)],
                **common,
            },
        )


def tile_pairs(pair_slot: mx.array, tile: int, n_slots: int) -> tuple[mx.array, int]:
    """int32 [n_tiles * tile] pair indices (-1 = empty), each tile's pairs sharing a slot and
    filled from its first entry; and n_tiles (an upper bound: surplus tiles are all -1)."""
    n = pair_slot.size
    if tile == 1:
        return mx.arange(n, dtype=mx.int32), n
    n_tiles = -(-n // tile) + min(n_slots, n)
    order = mx.argsort(pair_slot)
    s = pair_slot[order]
    pos = mx.arange(n, dtype=mx.int32)
    new_run = mx.concatenate([mx.array([True]), s[1:] != s[:-1]])
    run_start = mx.cummax(mx.where(new_run, pos, 0))
    rank = pos - run_start
    first = (rank % tile) == 0
    tile_id = mx.cumsum(first.astype(mx.int32)) - 1
    dest = tile_id * tile + rank % tile
    tiles = mx.zeros((n_tiles * tile,), dtype=mx.int32).at[dest].add(order.astype(mx.int32) + 1)
    return tiles - 1, n_tiles


def plan(layout) -> dict[str, algorithm.Projection] | None:
    """Each projection's kernel view, or None if any has no kernel or the shapes don't chain.
    Biased projections and GPT-OSS's clamped SwiGLU (`layout.activation` swiglu_oai) are
    computed by the kernels; any other activation, or a bias they cannot read, has none."""
    activation = getattr(layout, "activation", None)
    if activation is not None and activation.get("name") != "swiglu_oai":
        return None
    projs = {}
    for p in PROJECTIONS:
        pr = algorithm.projection(layout, p)
        if pr is None:
            return None
        projs[p] = pr
    g, u, d = projs["gate_proj"], projs["up_proj"], projs["down_proj"]
    if (g.out_features, g.in_features) != (u.out_features, u.in_features):
        return None
    if (d.in_features, d.out_features) != (g.out_features, g.in_features):
        return None
    return projs


_CACHE: dict[tuple[str, str], ExpertKernels | None] = {}


def kernel_for(backend: str, layout) -> Callable | None:
    """The expert kernel callable for `backend` ("cuda", "metal", or "host" for tests), or
    None: for "reference" (the reference path is not a kernel) and for layouts with a
    projection whose format has no kernel."""
    if backend == "reference":
        return None
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; one of {BACKENDS}")
    key = (backend, layout_signature(layout))
    if key not in _CACHE:
        projs = plan(layout)
        dialect = import_module(f"{__package__}.{backend}")
        _CACHE[key] = None if projs is None else ExpertKernels(dialect, layout, projs)
    return _CACHE[key]


def supported(layout) -> bool:
    return plan(layout) is not None
