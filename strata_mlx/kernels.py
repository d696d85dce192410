"""Expert kernels and their dispatch by backend.

`expert_kernel(layout)` resolves, once, the callable that computes a layer's routed SwiGLU
experts from arena slots; the expert cache resolves one per layer at load, so nothing on the
hot path re-inspects a layout (a profiler found ~9 ms/token of layout serialisation when this
was done per call). Backends:
  - "reference": gather the needed slots' records, decode them with plain MLX ops and run
    mlx-lm's SwitchGLU arithmetic (strata_mlx.quant). Runs everywhere; the oracle.
  - "cuda": custom_kernels/ compiled through mx.fast.cuda_kernel, reading weights straight
    from the slots (MLX's CUDA backend).
  - "metal": the same algorithm through mx.fast.metal_kernel (Apple silicon; not executed on
    Linux machines).
A format without a kernel for the running backend falls back to the reference.
STRATA_MLX_KERNELS=reference|cuda|metal forces one (read when a kernel is resolved).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import mlx.core as mx

from .quant import switch_glu_reference
from .store import RecordLayout

# fn(x [..., D], arena [n_slots, record_bytes] uint8, slots [n] uint32, idx [..., k] into
# slots) -> [..., k, D]
ExpertFn = Callable[[mx.array, mx.array, mx.array, mx.array], mx.array]


def backend() -> str:
    """The backend automatic dispatch picks on this machine."""
    env = os.environ.get("STRATA_MLX_KERNELS")
    if env:
        if env not in ("reference", "cuda", "metal"):
            raise ValueError(f"STRATA_MLX_KERNELS={env!r}: one of reference, cuda, metal")
        return env
    if mx.default_device() == mx.gpu:
        if mx.metal.is_available():
            return "metal"
        if hasattr(mx, "cuda") and mx.cuda.is_available():
            return "cuda"
    return "reference"


def expert_kernel(layout: RecordLayout, name: str | None = None) -> ExpertFn:
    """The expert computation for records of `layout` on backend `name` (default: backend())."""
    name = name or backend()
    if name != "reference":
        from custom_kernels import dispatch

        fn = dispatch.kernel_for(name, layout)
        if fn is not None:
            return lambda x, arena, slots, idx: fn(x, arena, slots, idx, layout)

    def reference(x, arena, slots, idx):
        return switch_glu_reference(x, arena[slots], layout, idx)

    return reference


def switch_glu(
    x: mx.array, arena: mx.array, slots: mx.array, idx: mx.array, layout: RecordLayout
) -> mx.array:
    """One call of the expert computation (resolves the kernel each time: tests and tools)."""
    return expert_kernel(layout)(x, arena, slots, idx)
