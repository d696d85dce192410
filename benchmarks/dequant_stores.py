"""The CUDA dequantize kernel's two stores (STRATA_MLX_DEQUANT_STORES scalar | wide): equal
outputs (a digest of the first 48 slots' weights in fp16, bf16 and fp32) and the median time of
a call over 512 experts (qwen3-next-80b-a3b's experts, affine 4-bit g64).

    python3 benchmarks/dequant_stores.py      # from the repository root, on MLX's CUDA backend
"""

from __future__ import annotations

import hashlib
import os
import statistics
import sys
import time

import mlx.core as mx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernels as kb  # noqa: E402


def run(stores: str, layout, arena, slots) -> None:
    from custom_kernels import dispatch

    os.environ["STRATA_MLX_DEQUANT_STORES"] = stores
    dispatch._CACHE.clear()  # built afresh with this store
    fn = dispatch.kernel_for("cuda", layout)
    for dt in (mx.float16, mx.bfloat16, mx.float32):
        w = fn.dequantize(arena, slots[:48], dt)
        digest = hashlib.sha1()
        for p in sorted(w):
            digest.update(np.array(w[p].astype(mx.float32)).tobytes())
        times = []
        for _ in range(12):
            t = time.perf_counter()
            mx.eval(list(fn.dequantize(arena, slots, dt).values()))
            mx.synchronize()
            times.append(time.perf_counter() - t)
        ms = statistics.median(times[2:]) * 1e3
        print(f"{stores:7s} {str(dt):14s} {ms:8.3f} ms  {digest.hexdigest()[:16]}", flush=True)


def main() -> int:
    if not (hasattr(mx, "cuda") and mx.cuda.is_available()):
        print("benchmarks/dequant_stores.py needs MLX's CUDA backend")
        return 2
    mx.set_default_device(mx.gpu)
    layout, arena, _ = kb.affine_experts(4, 64, np.random.default_rng(0))
    slots = mx.arange(kb.N_EXPERTS, dtype=mx.uint32)
    for stores in ("scalar", "wide", "scalar", "wide"):
        run(stores, layout, arena, slots)
    return 0


if __name__ == "__main__":
    sys.exit(main())
