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
    """GB/s copied by `threads` threads, each over its own pair of buffers."""
    n = mb << 20
    pairs = [(np.ones(n, np.uint8), np.zeros(n, np.uint8)) for _ in range(threads)]
    copied = [0] * threads
    start = threading.Barrier(threads + 1)

    def run(i: int, end: list[float]) -> None:
        src, dst = pairs[i]
        start.wait()
        while time.perf_counter() < end[0]:
            np.copyto(dst, src)
            copied[i] += n

    end = [0.0]
    workers = [threading.Thread(target=run, args=(i, end)) for i in range(threads)]
    for w in workers:
        w.start()
    t0 = time.perf_counter()
    end[0] = t0 + seconds
    start.wait()
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
        copy_rate(t, 0.2, a.mb)  # (pages touched, threads started once)
        gb = copy_rate(t, a.seconds, a.mb)
        print(f"{t} threads: {gb:.1f} GB/s copied, {2 * gb:.1f} GB/s over memory (two passes)")


if __name__ == "__main__":
    main()
