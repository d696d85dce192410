"""Metal dialect of the expert kernels: `mx.fast.metal_kernel` on Apple silicon.

Metal is NOT executed on this project's Linux machines: nothing here has ever run on a Mac in
this project's CI or on its GPU machine. What is verified is (1) on the CPU, that the source
handed to Metal is the shared header and body (formats.h, algorithm.py) plus this file's prelude
and prologue, character for character the same text as the CUDA dialect's, that it type-checks
as C++ against stand-ins for Metal's builtins (tests/runtime/test_kernels.py), and that the shared text
computes the reference result when compiled as host C++ (host.py); (2) on the
GPU machine, that the CUDA dialect of that same body matches the reference.

This module only maps the names the algorithm leaves to a dialect. MLX adds a kernel attribute
(`thread_position_in_grid`) to the signature when its name occurs in the body, hence the
prologue; simdgroups are 32 wide on Apple GPUs, the algorithm's warp width.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from .algorithm import KernelSource, wrap_mlx_kernel

PRELUDE = """\
#define SK_FN inline
#define SK_GLOBAL device
#define SK_U64 ulong
#define SK_UNROLL _Pragma("clang loop unroll(full)")
SK_FN float sk_as_float(uint32_t b) { return as_type<float>(b); }
template <typename U> SK_FN float sk_tof(U v) { return static_cast<float>(v); }
template <typename U> SK_FN void sk_store(device U* p, ulong i, float v) {
  p[i] = static_cast<U>(v);
}
template <typename U> SK_FN void sk_store16(device U* p, ulong i, thread const float* v) {
  for (int k = 0; k < 16; ++k) p[i + k] = static_cast<U>(v[k]);
}
SK_FN float sk_exp(float v) { return metal::exp(v); }
SK_FN float sk_warp_sum(float v) { return metal::simd_sum(v); }
"""

PROLOGUE = """\
  const uint32_t sk_gx = thread_position_in_grid.x;
  const uint32_t sk_gy = thread_position_in_grid.y;
"""

MAX_GRID_Y = 65535  # no such Metal limit; kept equal to CUDA's so both split launches alike


def sources(src: KernelSource) -> tuple[str, str]:
    """(header, body) as handed to mx.fast.metal_kernel."""
    return PRELUDE + src.header, PROLOGUE + src.body


def build(src: KernelSource) -> Callable:
    return wrap_mlx_kernel(mx.fast.metal_kernel, src, *sources(src))
