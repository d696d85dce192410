"""What verifying expert records costs: read bandwidth with checksums on and off, in one run.

    python benchmarks/verify_bandwidth.py STORE [--workers 8] [--seconds 4] [--rounds 3]
    python benchmarks/verify_bandwidth.py --checksum-only      # GB/s a core, no drive

Reads: random records of STORE's experts.bin, `workers` in flight, through the native reader
as the expert cache issues them (direct I/O, one record a read, into arena slots, through the
bounce buffer where the machine needs one, the overlap on), once with each record's
checksum from the manifest verified in the reader's threads and once without; the two
alternate for `rounds` rounds so that drift in the drive hits both alike. Also probe-ssd at
the same worker count and record size: the figure docs/benchmarks.md reports ratios to.
Prints GB/s of each, verified / unverified (the target: >= 95 %), verified / probe, and the
share of the workers' time spent checksumming.

--checksum-only: crc32c and crc32 GB/s on one core, on a record in cache and streaming over
a buffer larger than the caches.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import read_path  # benchmarks/read_path.py, beside this file

from strata_mlx.format.store import EXPERTS, load_manifest
from strata_mlx.stream.arena import Arena
from strata_mlx.stream.probe import probe_ssd
from strata_mlx.stream.reader import checksum, checksum_implementation, needs_bounce


def read_round(store: Path, m, arena: Arena, verify: bool, workers: int, seconds: float,
               seed: int) -> dict:  # fmt: skip
    """One round of read_path.py's reads into arena slots as the expert cache issues them
    (through the bounce buffer where this machine needs one, the overlap on), checksums
    verified or not."""
    variant = (
        {"overlap"} | ({"bounce"} if needs_bounce() else set()) | ({"verify"} if verify else set())
    )
    return read_path.read_round(store, m, arena, variant, workers, seconds, False, seed)


def checksum_only() -> None:
    for name in ("crc32c", "crc32"):
        record = np.random.default_rng(0).integers(0, 256, 1_474_560, dtype=np.uint8)
        checksum(name, record)
        t0 = time.perf_counter()
        n = 0
        while time.perf_counter() - t0 < 1.0:
            checksum(name, record)
            n += 1
        warm = n * record.nbytes / (time.perf_counter() - t0) / 1e9
        big = np.ones(1 << 30, dtype=np.uint8)  # larger than any cache: streams from memory
        t0 = time.perf_counter()
        for start in range(0, big.nbytes, record.nbytes):
            checksum(name, big[start : start + record.nbytes])
        cold = big.nbytes / (time.perf_counter() - t0) / 1e9
        print(
            f"{name} ({checksum_implementation(name)}): {warm:.2f} GB/s a core on a cached "
            f"record, {cold:.2f} GB/s streaming 1 GiB"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("store", type=Path, nargs="?")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--checksum-only", action="store_true")
    a = ap.parse_args()
    if a.checksum_only or a.store is None:
        checksum_only()
        if a.store is None:
            return
    m = load_manifest(a.store)
    rb = m.layout.record_bytes
    print(f"{a.store}: {m.checksum} records of {rb} bytes, {a.workers} workers")
    arena = Arena(a.workers * 2, rb)
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for i in range(a.rounds):
        for verify in (False, True) if i % 2 == 0 else (True, False):
            res = read_round(a.store, m, arena, verify, a.workers, a.seconds, seed=i)
            runs[verify].append(res)
            print(
                f"round {i} verify={'on ' if verify else 'off'}: {res['gb_per_s']:.2f} GB/s "
                f"({res['reads']} reads, {res['verified']} verified, direct={res['direct']}, "
                f"{100 * res['verify_share']:.1f} % of worker time checksumming)"
            )
    probe = probe_ssd(a.store / EXPERTS, record_bytes=rb, workers_list=(a.workers,))[0]
    on = statistics.median(r["gb_per_s"] for r in runs[True])
    off = statistics.median(r["gb_per_s"] for r in runs[False])
    print(
        f"median: verify on {on:.2f} GB/s, off {off:.2f} GB/s, probe-ssd {probe['gb_per_s']:.2f}"
        f" GB/s; on/off {100 * on / off:.1f} %, on/probe {100 * on / probe['gb_per_s']:.1f} %"
    )


if __name__ == "__main__":
    main()
