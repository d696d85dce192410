"""The CUDA dequantize kernel of this tree against another tree's: equal outputs (a digest of the
first 48 slots' weights in fp16, bf16 and fp32) and the median time of a 512-expert call.

    python3 benchmarks/dequant_vs_tree.py OTHER_TREE    # from the repository root, MLX CUDA
"""

import hashlib
import statistics
import sys
import time

import mlx.core as mx
import numpy as np

sys.path.insert(0, "benchmarks")
import kernels as kb  # noqa: E402

mx.set_default_device(mx.gpu)
layout, arena, _ = kb.affine_experts(4, 64, np.random.default_rng(0))
slots = mx.arange(512, dtype=mx.uint32)


def run(tag):
    from custom_kernels import dispatch

    fn = dispatch.kernel_for("cuda", layout)
    for dt in (mx.float16, mx.bfloat16, mx.float32):
        w = fn.dequantize(arena, slots[:48], dt)
        digest = hashlib.sha1()
        for p in sorted(w):
            digest.update(np.array(w[p].astype(mx.float32)).tobytes())
        ts = []
        for _ in range(12):
            t = time.perf_counter()
            mx.eval(list(fn.dequantize(arena, slots, dt).values()))
            mx.synchronize()
            ts.append(time.perf_counter() - t)
        print(
            tag,
            dt,
            f"{statistics.median(ts[2:]) * 1e3:.3f} ms",
            digest.hexdigest()[:16],
            flush=True,
        )


run("new")
for m in [m for m in sys.modules if m.startswith("custom_kernels")]:
    del sys.modules[m]
sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else ".old")
run("other")
