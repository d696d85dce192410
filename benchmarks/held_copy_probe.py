"""Which driver calls, made by another thread while a decode gate spins on the device, hold a
reader's device copy until the gate gives up (CUDA only).

Each action runs in a fresh process: a gate waits on the device for a record's ready word
(giving up after --timeout-ms), a second thread makes one driver call, then a reader copies
the record and stores the word. A copy held by the call lands only when the gate has given
up: `late` 1 and `copy_s` about the gate's timeout. Prints one JSON line an action. (The MLX
actions run MLX on the holder's thread, whose evaluation may wait behind the spinning gate:
their `holder_s` is then about the timeout whatever the call did.)

    python benchmarks/held_copy_probe.py --actions none,ctx_sync,free_managed,free_device
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile

ACTIONS = {
    "none": "no call",
    "ctx_sync": "cuCtxSynchronize",
    "alloc_managed": "cuMemAllocManaged (4 bytes)",
    "free_managed": "cuMemFree of managed memory allocated before the gate",
    "free_device": "cuMemFree of device memory allocated before the gate",
    "alloc_device": "cuMemAlloc (64 MiB)",
    "host_register": "cuMemHostRegister of 2 MiB",
    "alloc_async": "cuMemAllocAsync of 256 MiB on a new stream, freed, synchronized (the pool grows, trims)",
    "host_unregister": "cuMemHostUnregister of 2 MiB registered before the gate",
    "free_host": "cuMemFreeHost of pinned memory allocated before the gate",
    "mlx_free": "MLX freeing a host-made array with its cache limit 0 (its managed memory)",
    "mlx_event": "an MLX CPU-stream result used on the GPU (an event in managed memory)",
    "module_load": "cuModuleLoadData of a one-kernel PTX module (the same each run: the driver"
    " compiles it once, then loads it from its cache)",
    "mlx_new_kernel": "a custom MLX kernel's first call (a new name each run: NVRTC, then its "
    "module loaded)",
    "mlx_compiled": "an mx.compile'd function's first call (its fused kernel compiled, or taken "
    "from MLX's disk cache where an earlier run put it, then loaded)",
}

CHILD = r"""
import ctypes, json, sys, threading, time
import mlx.core as mx
import numpy as np
from custom_kernels.gate import gate
from strata_mlx.stream.arena import Arena
from strata_mlx.stream.gate import GateTable
from strata_mlx.stream.reader import Reader

class Shape:
    num_experts, moe_layers = 8, [0]
    def layer_position(self, layer):
        return 0

path, action, timeout_ms = sys.argv[1], sys.argv[2], int(sys.argv[3])
PTX = b".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry probe_k()\n{\n  ret;\n}\n"
cu = ctypes.CDLL("libcuda.so.1")
rb = 1 << 20
g = GateTable(Shape(), device=True)
row_at = g.gate_at(g.row_address(0))
g.table[0, 1] = 0
mx.eval(*gate(mx.array([1], dtype=mx.uint32), row_at, timeout_ms))
arena = Arena(1, rb, on_device=True, device_memory=True)
mx.eval(arena.rows.astype(mx.uint32).sum())
ctx = ctypes.c_void_p()
assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
before = ctypes.c_uint64()
buf = ctypes.create_string_buffer(2 << 20)
if action == "free_managed":
    assert cu.cuMemAllocManaged(ctypes.byref(before), 4, 1) == 0
elif action == "free_device":
    assert cu.cuMemAlloc_v2(ctypes.byref(before), 1 << 20) == 0
elif action == "free_host":
    hp = ctypes.c_void_p()
    assert cu.cuMemAllocHost_v2(ctypes.byref(hp), 1 << 20) == 0
elif action == "host_unregister":
    assert cu.cuMemHostRegister_v2(buf, 2 << 20, 0) == 0
elif action == "mlx_free":
    mx.set_cache_limit(0)
    host_made = mx.array(np.ones(1 << 16, np.float32))
    mx.eval(host_made)
held = {}

def holder():
    assert cu.cuCtxSetCurrent(ctx) == 0
    t0 = time.monotonic()
    rc = 0
    if action == "ctx_sync":
        rc = cu.cuCtxSynchronize()
    elif action == "alloc_managed":
        p = ctypes.c_uint64()
        rc = cu.cuMemAllocManaged(ctypes.byref(p), 4, 1)
    elif action in ("free_managed", "free_device"):
        rc = cu.cuMemFree_v2(before)
    elif action == "alloc_device":
        p = ctypes.c_uint64()
        rc = cu.cuMemAlloc_v2(ctypes.byref(p), 64 << 20)
    elif action == "host_register":
        rc = cu.cuMemHostRegister_v2(buf, 2 << 20, 0)
    elif action == "alloc_async":
        st, p = ctypes.c_void_p(), ctypes.c_uint64()
        rc = cu.cuStreamCreate(ctypes.byref(st), 1) or cu.cuMemAllocAsync(
            ctypes.byref(p), ctypes.c_size_t(256 << 20), st) or cu.cuMemFreeAsync(p, st) or (
            cu.cuStreamSynchronize(st))
    elif action == "free_host":
        rc = cu.cuMemFreeHost(hp)
    elif action == "host_unregister":
        rc = cu.cuMemHostUnregister(buf)
    elif action == "mlx_free":
        global host_made
        del host_made
        mx.clear_cache()
    elif action == "mlx_event":
        c = mx.add(mx.array([1.0]), 1.0, stream=mx.cpu)
        mx.eval(mx.multiply(c, 2.0, stream=mx.gpu))
    elif action == "module_load":
        mod = ctypes.c_void_p()
        rc = cu.cuModuleLoadData(ctypes.byref(mod), PTX)
    elif action == "mlx_new_kernel":  # (a source of its own each run: no cached copy)
        k = mx.fast.cuda_kernel(name=f"probe_{time.time_ns()}", input_names=["a"],
                                output_names=["b"], source="b[0] = a[0] + 1.0f;")
        mx.eval(k(inputs=[mx.array([1.0])], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                  output_shapes=[(1,)], output_dtypes=[mx.float32])[0])
    elif action == "mlx_compiled":
        f = mx.compile(lambda a: mx.tanh(a * 1.7) / (a + 3.1) - mx.sqrt(a + 5.3))
        mx.eval(f(mx.array([0.5, 0.25])))
    held["rc"], held["s"] = rc, time.monotonic() - t0

with Reader(1, bounce=True, device_copy=True, record_bytes=rb) as r:
    f = r.open(path, direct=False)
    slots, late = gate(mx.array([2], dtype=mx.uint32) + 0, row_at, timeout_ms)
    mx.async_eval(slots, late)
    time.sleep(0.2)  # the gate spins on the device for word (0, 2)
    t = threading.Thread(target=holder)
    t.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    r.submit([(1, f, 0, rb, arena.address(0), None, g.ready((0, 2), 0))], True)
    (done,) = r.wait([1])
    copy_s = time.monotonic() - t0
    flag = late.tolist()[0]
    t.join()
    s = r.stats()
ok = bool(np.array_equal(np.array(arena.rows[0] + 0), np.fromfile(path, np.uint8, rb)))
print(json.dumps(dict(action=action, late=flag, copy_s=round(copy_s, 4),
                      holder_s=round(held.get("s", -1), 4), holder_rc=held.get("rc"),
                      err=done[1], bytes_ok=ok, urgent_max_ms=s["urgent_max_ns"] / 1e6)))
g.close()
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--actions", default=",".join(ACTIONS))
    ap.add_argument("--timeout-ms", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=1)
    args = ap.parse_args()
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        sys.exit("held_copy_probe: needs a CUDA driver (libcuda.so.1 did not load)")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "record.bin")
        with open(path, "wb") as f:
            f.write(os.urandom(1 << 20))
        for action in args.actions.split(","):
            if action not in ACTIONS:
                sys.exit(f"--actions: {action!r} is none of {', '.join(ACTIONS)}")
            for _ in range(args.reps):
                cmd = [sys.executable, "-c", CHILD, path, action, str(args.timeout_ms)]
                try:
                    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
                except subprocess.TimeoutExpired:
                    print(json.dumps(dict(action=action, error="no answer in 120 s")), flush=True)
                    continue
                lines = out.stdout.strip().splitlines()
                if out.returncode or not lines:
                    tail = out.stderr.strip().splitlines()[-3:]
                    print(json.dumps(dict(action=action, error=" | ".join(tail))), flush=True)
                else:
                    print(lines[-1], f"# {ACTIONS[action]}", flush=True)


if __name__ == "__main__":
    main()
