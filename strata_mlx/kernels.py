"""Expert kernels and their dispatch by backend.

`switch_glu` computes a layer's routed SwiGLU experts from records gathered out of arena
slots. Backends: the reference path in plain MLX ops (strata_mlx.quant; runs everywhere and
is the oracle), custom kernels from custom_kernels/ where a format has one for the running
backend. `set_backend("reference")` forces the reference path for tests and benchmarks.
"""

from __future__ import annotations

import mlx.core as mx

from .quant import switch_glu_reference
from .store import RecordLayout

_forced: str | None = None


def set_backend(name: str | None) -> None:
    """Force "reference" (or "cuda"/"metal"), or None for automatic dispatch."""
    global _forced
    _forced = name


def backend() -> str:
    if _forced:
        return _forced
    return "reference"


def switch_glu(x: mx.array, records: mx.array, layout: RecordLayout, idx: mx.array) -> mx.array:
    """x [..., D], records [n, record_bytes] uint8, idx [..., k] into records -> [..., k, D]."""
    return switch_glu_reference(x, records, layout, idx)
