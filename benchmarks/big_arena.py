"""An arena as large as memory allows: allocation time and peak memory, and the expert kernels
reading records from slots past 2, 4 and 16 GiB exactly as from a small arena.

    python3 benchmarks/big_arena.py --gb 25                # default device (CUDA: cuda kernels)
    python3 benchmarks/big_arena.py --gb 25 --device cpu   # CPU: reference + host C++ dialect

Needs the memory (MLX zero-fills the arena) and the test helpers in tests/. tests/stream/test_arena.py
runs the same checks at 2.3 GB (4.4 GB with -m slow).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import mlx.core as mx
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from test_kernels import EPS, _compare, gguf_experts  # noqa: E402

from custom_kernels import dispatch  # noqa: E402
from strata_mlx.format.quant import switch_glu_reference  # noqa: E402
from strata_mlx.runtime import kernels  # noqa: E402
from strata_mlx.stream.arena import Arena  # noqa: E402

GiB = 1024**3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=25.0, help="arena size in GB (10^9 bytes)")
    ap.add_argument("--device", choices=("default", "cpu", "gpu"), default="default")
    a = ap.parse_args()
    if a.device != "default":
        mx.set_default_device(mx.cpu if a.device == "cpu" else mx.gpu)
    cpu = mx.default_device() == mx.cpu
    print(f"device {mx.default_device()}, backend {kernels.backend()}")
    types = {p: "Q4_K" for p in ("gate_proj", "up_proj", "down_proj")}
    layout, recs = gguf_experts(4, 256, 256, types, seed=11)
    rb = layout.record_bytes
    n = int(a.gb * 1e9) // rb + 1
    t = time.perf_counter()
    arena = Arena(n, rb)
    seconds = time.perf_counter() - t
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        f"arena {arena.nbytes / 1e9:.2f} GB ({n} slots of {rb} B): allocated in {seconds:.2f} s,"
        f" MLX peak {mx.get_peak_memory() / 1e9:.2f} GB, process peak RSS {rss / 1e9:.2f} GB"
    )
    print(
        f"slot 0 at byte {arena._start} of the buffer (buffer address mod 4096 ="
        f" {(arena.address(0) - arena._start) % 4096})"
    )
    assert all(arena.address(s) % 4096 == 0 for s in (0, 1, n - 1))
    far = sorted({min(b // rb + 1, n - 1) for b in (2 * GiB, 4 * GiB, 16 * GiB)} | {n - 1})
    for s, rec in zip(far, recs):
        arena.view(s)[: rec.size] = rec
    small = mx.array(np.stack(recs[: len(far)]))
    rng = np.random.default_rng(5)
    ids = np.stack([rng.choice(len(far), 2, replace=False) for _ in range(5)])
    idx = mx.array(ids.astype(np.uint32))
    slots = mx.array(far, dtype=mx.uint32)
    np.testing.assert_array_equal(np.array(arena.rows[slots]), np.array(small))
    print(f"slots {far}: gathered exactly")
    fn = dispatch.kernel_for("host" if cpu else "cuda", layout)
    for dtype in (mx.float32,) if cpu else (mx.float16, mx.float32):
        x = mx.array(rng.standard_normal((5, 256)).astype(np.float32)).astype(dtype)
        ref = switch_glu_reference(x, small, layout, idx)
        got = switch_glu_reference(x, arena.rows[slots], layout, idx)
        np.testing.assert_array_equal(
            np.array(got.astype(mx.float32)), np.array(ref.astype(mx.float32))
        )
        tol = (1e-5, 1e-6) if cpu else (16 * EPS[dtype], 2 * EPS[dtype])
        for strategy in ("fused", "dequant"):
            y = fn(x, arena.rows, slots, idx, layout, strategy=strategy)
            _compare(y, ref, f"{strategy} {dtype}", *tol)
        print(f"{'host' if cpu else 'cuda'} kernels, {dtype}: match the reference")
    w = fn.dequantize(arena.rows, slots)
    w_small = fn.dequantize(small, mx.arange(len(far), dtype=mx.uint32))
    for p in w:
        np.testing.assert_array_equal(np.array(w[p]), np.array(w_small[p]))
    print("dequant kernel: bit-identical to the small arena's\nOK")


if __name__ == "__main__":
    main()
