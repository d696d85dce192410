"""Read bandwidth of the native reader alone and while MLX computes on the main thread.

    python benchmarks/read_under_compute.py FILE [--seconds 4] [--workers 8] [--record-bytes N]

Reads: random record-sized direct reads into arena slots (an MLX buffer), `workers` in flight,
driven by a Python thread that only submits and waits (the wait releases the GIL), as the
engine does. Compute: a chain of MLX matmuls evaluated on the main thread on the default
device. Also measured for contrast: Python threads issuing os.preadv themselves (what the
native reader replaces). Prints GB/s alone and under compute, and the ratios.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import mlx.core as mx
import numpy as np

from strata_mlx.stream.arena import Arena
from strata_mlx.stream.probe import probe_ssd
from strata_mlx.stream.reader import Reader


def native_reads(path, arena: Arena, workers: int, seconds: float, stop: threading.Event) -> float:
    size = os.path.getsize(path)
    rb = arena.record_bytes
    n = size // rb
    rng = np.random.default_rng()
    done = 0
    with Reader(workers) as r:
        f = r.open(path)
        tag = 0
        inflight = {}

        def submit(slot):
            nonlocal tag
            tag += 1
            inflight[tag] = slot
            return (tag, f, int(rng.integers(n)) * rb, rb, arena.address(slot))

        r.submit([submit(s) for s in range(min(workers * 2, arena.n_slots))])
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds and not stop.is_set():
            more = []
            for t, err, got in r.wait(None):
                if err:
                    raise OSError(err, "read failed")
                done += got
                more.append(submit(inflight.pop(t)))
            r.submit(more)
        elapsed = time.perf_counter() - t0
    return done / elapsed / 1e9


def python_reads(path, arena: Arena, workers: int, seconds: float) -> float:
    size = os.path.getsize(path)
    rb = arena.record_bytes
    n = size // rb
    total = [0] * workers

    def loop(i):
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        rng = np.random.default_rng(i)
        view = memoryview(arena.view(i % arena.n_slots))
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            total[i] += os.preadv(fd, [view], int(rng.integers(n)) * rb)
        os.close(fd)

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(workers)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(total) / (time.perf_counter() - t0) / 1e9


MATRIX = 2048


def under_compute(fn) -> tuple[float, float]:
    """Run fn (a read loop) in a thread while the main thread evaluates MLX matmuls."""
    result = {}
    th = threading.Thread(target=lambda: result.setdefault("gbps", fn()))
    a = mx.random.normal((MATRIX, MATRIX))
    mx.eval(a)
    th.start()
    t0 = time.perf_counter()
    evals = 0
    while th.is_alive():
        b = a
        for _ in range(16):
            b = mx.tanh(b @ a) * 0.5
        mx.eval(b)
        evals += 1
    return result["gbps"], evals / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--record-bytes", type=int, default=1_474_560)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--matrix", type=int, default=2048, help="matmul size of the compute load")
    a = ap.parse_args()
    global MATRIX
    MATRIX = a.matrix
    rb = -(-a.record_bytes // 4096) * 4096
    arena = Arena(64, rb)
    stop = threading.Event()
    rows = {"probe": [], "native": [], "native+compute": [], "python": [], "python+compute": []}
    for _ in range(a.rounds):  # interleaved rounds: this machine's drive is shared and noisy
        rows["probe"].append(probe_ssd(a.file, rb, (a.workers,), a.seconds)[0]["gb_per_s"])
        rows["native"].append(native_reads(a.file, arena, a.workers, a.seconds, stop))
        rows["native+compute"].append(
            under_compute(lambda: native_reads(a.file, arena, a.workers, a.seconds, stop))[0]
        )
        rows["python"].append(python_reads(a.file, arena, a.workers, a.seconds))
        rows["python+compute"].append(
            under_compute(lambda: python_reads(a.file, arena, a.workers, a.seconds))[0]
        )
    med = {k: float(np.median(v)) for k, v in rows.items()}
    print(
        f"device {mx.default_device()}, {a.workers} workers, record {rb} bytes, "
        f"medians of {a.rounds} rounds of {a.seconds:.0f} s"
    )
    print("| reader | alone GB/s | under compute GB/s | ratio | under compute / probe-ssd |")
    print("|---|---|---|---|---|")
    for name in ("native", "python"):
        al, lo = med[name], med[name + "+compute"]
        print(f"| {name} | {al:.2f} | {lo:.2f} | {lo / al:.2f} | {lo / med['probe']:.2f} |")
    print(
        f"probe-ssd median {med['probe']:.2f} GB/s; all rounds: "
        + "; ".join(f"{k} " + ",".join(f"{x:.2f}" for x in v) for k, v in rows.items())
    )


if __name__ == "__main__":
    main()
