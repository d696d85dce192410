"""The host's memory copy rate, beside the drive's: whether memory bounds a tmpfs data path.

    python benchmarks/memory_copy.py [--threads 8,16] [--seconds 2] [--mb 64]

On a tmpfs a "read" is a CPU copy (two passes over memory), and the data path into the
arena makes four (the copy into the bounce buffer, the checksum, the device copy's read):
docs/benchmarks.md, "How fast is the drive and the data path?". Each of `threads` threads
copies its own `mb` MB buffer into another (numpy's copy lets go of the GIL) for `seconds`;
printed: GB/s copied (bytes of the destination written a second, as probe-ssd counts a
read's bytes) and the passes over memory that stands for (twice that).
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np


def copy_rate(threads: int, seconds: float, mb: int) -> float:
    """GB/s copied by `threads` threads, each over its own pair of buffers, made and first
    touched by that thread (so they sit where its reads would: its NUMA node) and copied once
    untimed before the clock starts."""
    n = mb << 20
    copied = [0] * threads
    ready, go = threading.Barrier(threads + 1), threading.Event()
    end = [0.0]

    def run(i: int) -> None:
        src, dst = np.ones(n, np.uint8), np.zeros(n, np.uint8)
        np.copyto(dst, src)  # (every page touched before the clock starts)
        ready.wait()
        go.wait()
        while time.perf_counter() < end[0]:
            np.copyto(dst, src)
            copied[i] += n

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    ready.wait()  # (every buffer made and touched)
    t0 = time.perf_counter()
    end[0] = t0 + seconds
    go.set()
    for w in workers:
        w.join()
    return sum(copied) / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="8,16")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--mb", type=int, default=64)
    a = ap.parse_args()
    for t in (int(x) for x in a.threads.split(",")):
        gb = copy_rate(t, a.seconds, a.mb)
        print(f"{t} threads: {gb:.1f} GB/s copied, {2 * gb:.1f} GB/s over memory (two passes)")


if __name__ == "__main__":
    main()
