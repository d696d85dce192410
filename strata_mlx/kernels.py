"""Expert kernels and their dispatch by backend.

`switch_glu` computes a layer's routed SwiGLU experts from arena slots. Backends:
  - "reference": gather the needed slots' records, decode them with plain MLX ops and run
    mlx-lm's SwitchGLU arithmetic (strata_mlx.quant). Runs everywhere; the oracle.
  - "cuda": custom_kernels/ compiled through mx.fast.cuda_kernel, reading weights straight
    from the slots (MLX's CUDA backend).
  - "metal": the same algorithm through mx.fast.metal_kernel (Apple silicon; not executed on
    Linux machines).
A format without a kernel for the running backend falls back to the reference.
`set_backend(...)` or STRATA_MLX_KERNELS=reference|cuda|metal forces one.
"""

from __future__ import annotations

import os

import mlx.core as mx

from .quant import switch_glu_reference
from .store import RecordLayout

_forced: str | None = None


def set_backend(name: str | None) -> None:
    """Force "reference", "cuda" or "metal"; None restores automatic dispatch."""
    if name not in (None, "reference", "cuda", "metal"):
        raise ValueError(f"unknown kernel backend {name!r}")
    global _forced
    _forced = name


def backend() -> str:
    """The backend automatic dispatch picks on this machine."""
    if _forced:
        return _forced
    env = os.environ.get("STRATA_MLX_KERNELS")
    if env:
        return env
    if mx.default_device() == mx.gpu:
        if mx.metal.is_available():
            return "metal"
        if hasattr(mx, "cuda") and mx.cuda.is_available():
            return "cuda"
    return "reference"


def switch_glu(
    x: mx.array, arena: mx.array, slots: mx.array, idx: mx.array, layout: RecordLayout
) -> mx.array:
    """x [..., D]; arena [n_slots, record_bytes] uint8; slots [n] uint32 (the layer's needed
    experts' slots); idx [..., k] into `slots` -> [..., k, D]."""
    name = backend()
    if name != "reference":
        from custom_kernels import dispatch

        fn = dispatch.kernel_for(name, layout)
        if fn is not None:
            return fn(x, arena, slots, idx, layout)
    return switch_glu_reference(x, arena[slots], layout, idx)
