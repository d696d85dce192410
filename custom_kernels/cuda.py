"""CUDA dialect of the expert kernels: `mx.fast.cuda_kernel` on MLX's CUDA backend.

This module only maps the handful of names the shared algorithm (algorithm.py) leaves to a
dialect: thread ids, the device-pointer qualifier, half/bfloat conversions, exp and the warp
sum. It never contains kernel logic. Verified on the GPU machine (tests marked `gpu`).

MLX wraps the body in `__global__ void name(inputs..., outputs...)` inside namespace
mlx::core::cu and turns template args into `using T = __half;` lines; every helper here is
prefixed `sk_` so nothing in that namespace can hide it.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from .algorithm import KernelSource, wrap_mlx_kernel

PRELUDE = """\
#define SK_FN __device__ __forceinline__
#define SK_GLOBAL
#define SK_U64 unsigned long long
#define SK_UNROLL _Pragma("unroll")
SK_FN float sk_as_float(uint32_t b) { return __uint_as_float(b); }
SK_FN float sk_tof(float v) { return v; }
SK_FN float sk_tof(__half v) { return __half2float(v); }
SK_FN float sk_tof(__nv_bfloat16 v) { return __bfloat162float(v); }
SK_FN void sk_store(float* p, SK_U64 i, float v) { p[i] = v; }
SK_FN void sk_store(__half* p, SK_U64 i, float v) { p[i] = __float2half(v); }
SK_FN void sk_store(__nv_bfloat16* p, SK_U64 i, float v) { p[i] = __float2bfloat16(v); }
template <typename U> SK_FN void sk_store16(U* p, SK_U64 i, const float* v) {  // i % 16 == 0
  uint4 q[sizeof(U)];  // the 16 values rounded as sk_store's, then 16-byte stores
  for (int k = 0; k < 16; ++k) sk_store(reinterpret_cast<U*>(q), k, v[k]);
  for (int k = 0; k < (int)sizeof(U); ++k) reinterpret_cast<uint4*>(p + i)[k] = q[k];
}
SK_FN float sk_exp(float v) { return expf(v); }
SK_FN float sk_warp_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 16);
  v += __shfl_xor_sync(0xffffffffu, v, 8);
  v += __shfl_xor_sync(0xffffffffu, v, 4);
  v += __shfl_xor_sync(0xffffffffu, v, 2);
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v;
}
"""

PROLOGUE = """\
  const uint32_t sk_gx = blockIdx.x * blockDim.x + threadIdx.x;
  const uint32_t sk_gy = blockIdx.y * blockDim.y + threadIdx.y;
"""

# CUDA caps gridDim.y at 65535 blocks; dispatch splits larger launches.
MAX_GRID_Y = 65535


def sources(src: KernelSource) -> tuple[str, str]:
    """(header, body) as handed to mx.fast.cuda_kernel."""
    return PRELUDE + src.header, PROLOGUE + src.body


def build(src: KernelSource) -> Callable:
    return wrap_mlx_kernel(mx.fast.cuda_kernel, src, *sources(src))
