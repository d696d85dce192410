"""Host C++ dialect: runs the shared kernel algorithm on the CPU, for tests only.

The GPU dialects cannot run on this project's CPU machines, so this third dialect compiles the
very same header and body (algorithm.py) with the system C++ compiler and runs every warp's 32
lanes as coroutines (ucontext) on one thread: `sk_warp_sum` parks a lane until all 32 have
posted, then each lane gets the sum (added in lane order). It also checks the algorithm keeps
warp-uniform control flow (every lane makes the same `sk_warp_sum` calls), which the GPU
dialects rely on. Threads are numbered like CUDA's launch (the grid rounded up to whole
threadgroups), so the body's early returns for surplus threads are exercised too.

Supports float32 activations only (T = float). Never used by dispatch outside tests.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from .algorithm import KernelSource

PRELUDE = """\
#include <cmath>
#include <cstdint>
#include <cstring>
#define SK_FN static inline
#define SK_GLOBAL
#define SK_U64 uint64_t
#define SK_UNROLL
SK_FN float sk_as_float(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
SK_FN float sk_tof(float v) { return v; }
SK_FN void sk_store(float* p, SK_U64 i, float v) { p[i] = v; }
SK_FN void sk_store16(float* p, SK_U64 i, const float* v) { std::memcpy(p + i, v, 64); }
SK_FN float sk_exp(float v) { return std::exp(v); }
static float sk_warp_sum(float v);
"""

PROLOGUE = """\
  using T = float;
  const uint32_t sk_gx = sk_thread_x;
  const uint32_t sk_gy = sk_thread_y;
"""

MAX_GRID_Y = 65535

_HARNESS = """\
#include <ucontext.h>
static ucontext_t sk_main_ctx;
static ucontext_t sk_ctx[32];
static char sk_stacks[32][1 << 16];
static int sk_cur, sk_ndone, sk_error;
static int sk_done[32];
static long sk_calls[32];
static float sk_buf[32];
static float sk_total;
static void** sk_bufs;
static uint32_t sk_wgx, sk_wgy;

static void sk_yield() {
  const int me = sk_cur;
  if (sk_ndone == 32 || sk_error) { swapcontext(&sk_ctx[me], &sk_main_ctx); return; }
  sk_cur = (me + 1) & 31;
  swapcontext(&sk_ctx[me], &sk_ctx[sk_cur]);
}

static float sk_warp_sum(float v) {
  sk_buf[sk_cur] = v;
  sk_calls[sk_cur]++;
  if (sk_cur == 31) {
    for (int i = 0; i < 32; ++i) {
      if (sk_done[i] || sk_calls[i] != sk_calls[31]) sk_error = 1;
    }
    float s = 0.0f;
    for (int i = 0; i < 32; ++i) s += sk_buf[i];
    sk_total = s;
  }
  sk_yield();
  return sk_total;
}

static void sk_lane_entry() {
  const int lane = sk_cur;
  sk_run_body(sk_bufs, sk_wgx * 32u + (uint32_t)lane, sk_wgy);
  sk_done[lane] = 1;
  sk_ndone++;
  if (lane == 31) {
    for (int i = 0; i < 32; ++i) {
      if (!sk_done[i] || sk_calls[i] != sk_calls[31]) sk_error = 1;
    }
    sk_ndone = 32;
  }
  sk_yield();
}

extern "C" int sk_launch(void** bufs, uint32_t n_warps_x, uint32_t gy) {
  sk_bufs = bufs;
  for (uint32_t y = 0; y < gy; ++y) {
    for (uint32_t w = 0; w < n_warps_x; ++w) {
      sk_wgx = w; sk_wgy = y; sk_ndone = 0; sk_error = 0;
      for (int i = 0; i < 32; ++i) {
        sk_done[i] = 0; sk_calls[i] = 0;
        getcontext(&sk_ctx[i]);
        sk_ctx[i].uc_stack.ss_sp = sk_stacks[i];
        sk_ctx[i].uc_stack.ss_size = sizeof(sk_stacks[i]);
        sk_ctx[i].uc_link = &sk_main_ctx;
        makecontext(&sk_ctx[i], sk_lane_entry, 0);
      }
      sk_cur = 0;
      swapcontext(&sk_main_ctx, &sk_ctx[0]);
      if (sk_error) return 1;
    }
  }
  return 0;
}
"""

_CTYPES = {
    np.dtype(np.float32): "float",
    np.dtype(np.uint8): "uint8_t",
    np.dtype(np.uint32): "uint32_t",
    np.dtype(np.int32): "int32_t",
}


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")


def sources(src: KernelSource) -> tuple[str, str]:
    """(header, body) of the host dialect."""
    return PRELUDE + src.header, PROLOGUE + src.body


def translation_unit(src: KernelSource, in_dtypes: list[np.dtype], out_dtypes: list[np.dtype]):
    header, body = sources(src)
    params, args = [], []
    for i, (n, dt) in enumerate(zip(src.input_names, in_dtypes)):
        params.append(f"const {_CTYPES[dt]}* {n}")
        args.append(f"(const {_CTYPES[dt]}*)b[{i}]")
    for i, (n, dt) in enumerate(zip(src.output_names, out_dtypes)):
        params.append(f"{_CTYPES[dt]}* {n}")
        args.append(f"({_CTYPES[dt]}*)b[{len(in_dtypes) + i}]")
    sig = ",\n    ".join([*params, "uint32_t sk_thread_x", "uint32_t sk_thread_y"])
    return (
        f"{header}\nstatic void sk_body(\n    {sig}) {{\n{body}}}\n\n"
        f"static void sk_run_body(void** b, uint32_t gx, uint32_t gy) {{\n"
        f"  sk_body({', '.join([*args, 'gx', 'gy'])});\n}}\n\n{_HARNESS}"
    )


_LIBS: dict[str, ctypes.CDLL] = {}


def _compile(code: str) -> ctypes.CDLL:
    key = hashlib.sha1(code.encode()).hexdigest()[:16]
    if key in _LIBS:
        return _LIBS[key]
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("host dialect needs a C++ compiler (g++)")
    d = Path(tempfile.gettempdir()) / f"strata_sk_host_{os.getuid()}"
    d.mkdir(exist_ok=True)
    lib = d / f"{key}.so"
    if not lib.exists():
        cpp = d / f"{key}.cpp"
        cpp.write_text(code)
        tmp = d / f"{key}.{os.getpid()}.so"
        cmd = [cxx, "-std=c++17", "-O1", "-fno-strict-aliasing", "-shared", "-fPIC"]
        r = subprocess.run([*cmd, "-o", str(tmp), str(cpp)], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"host kernel {cpp} failed to compile:\n{r.stderr[-4000:]}")
        os.replace(tmp, lib)
    _LIBS[key] = ctypes.CDLL(str(lib))
    return _LIBS[key]


def build(src: KernelSource) -> Callable:
    def run(inputs, grid, threadgroup, output_shapes, output_dtypes, template):
        if dict(template).get("T", mx.float32) != mx.float32:
            raise TypeError("the host dialect runs float32 activations only")
        # in place, no copy (np.asarray): the arena input can be many GB
        ins = [np.ascontiguousarray(np.asarray(a)) for a in inputs]
        outs = [
            np.full(tuple(s), np.nan if dt == mx.float32 else 0, dtype=np.dtype(_np_name(dt)))
            for s, dt in zip(output_shapes, output_dtypes)
        ]
        lib = _compile(translation_unit(src, [a.dtype for a in ins], [o.dtype for o in outs]))
        ptrs = (ctypes.c_void_p * (len(ins) + len(outs)))(
            *[a.ctypes.data for a in ins], *[o.ctypes.data for o in outs]
        )
        gx, gy, _ = grid
        tx = threadgroup[0]
        n_warps_x = (gx + tx - 1) // tx * tx // 32  # whole threadgroups, as CUDA launches
        rc = lib.sk_launch(ptrs, ctypes.c_uint32(n_warps_x), ctypes.c_uint32(gy))
        if rc:
            raise RuntimeError(f"{src.name}: lanes of a warp diverged around sk_warp_sum")
        return [mx.array(o) for o in outs]

    return run


def _np_name(dt: mx.Dtype) -> str:
    return {mx.float32: "float32", mx.uint32: "uint32", mx.int32: "int32"}[dt]
