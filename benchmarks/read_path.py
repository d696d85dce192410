"""What each step of a record's way into the arena costs: the native reader's bandwidth with the
bounce copy, the checksum and the overlap each on and off, into arena slots, in one run.

    python benchmarks/read_path.py STORE [--workers 8] [--seconds 3] [--rounds 3] [--touch]
        [--variants direct,bounce,bounce+verify,bounce+verify+overlap]

Reads: random records of STORE's experts.bin, `workers` in flight, one record a read, direct
I/O, into the slots of an Arena (an MLX buffer: CUDA managed memory on the GPU machine, where
the bounce copy lands through the driver's page migration), as the expert cache issues them.
"dc": (CUDA) the copy engine moves each record from pinned memory into an arena kept on the
device (the expert cache's default there); without it the CPU copies into managed memory.
"dm": (with dc) into an arena in plain device memory (the cache's device_arena option) instead
of managed memory. "cb": (with dc) the reader's copy_behind (the next record read while the
last one's copy runs).
"4k": into an arena left in 4 KB pages (Arena(hugepages=False); by default the CPU backend's
arena asks Linux for huge pages, which CUDA's managed memory does not take).
--touch: each batch of landed slots is then read by the device (a sum over their rows,
evaluated), so that on CUDA the next reads into those slots find pages on the device, as in
prefill, where kernels read the slots between reads. Variants rotate round by round, so drift
in the drive falls on all alike; prints GB/s per round, medians, and each against the first.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import mlx.core as mx

from strata_mlx.format.store import load_manifest
from strata_mlx.stream.arena import Arena
from strata_mlx.stream.probe import IN_FLIGHT, probe_data_path

PARTS = ("direct", "bounce", "verify", "overlap", "4k", "dc", "dm", "cb")


def read_round(store: Path, m, arena: Arena, variant: set, workers: int, seconds: float,
               touch: bool, seed: int) -> dict:  # fmt: skip
    """One round of the data path's probe (strata_mlx.stream.probe.probe_data_path) with the
    variant's steps, into `arena`; per read: pread, checksum and device-copy times."""
    res = probe_data_path(store, m, workers, seconds, verify="verify" in variant,
                          overlap="overlap" in variant, device_copy="dc" in variant,
                          touch=touch, seed=seed, bounce="bounce" in variant,
                          arena=arena, copy_behind="cb" in variant)  # fmt: skip
    st = res["stats"]
    busy = sum(st["busy_ns"]) + sum(st["verify_ns"])
    per = max(st["requests_done"], 1) * 1e3  # ns -> us a read
    return {"gb_per_s": res["gb_per_s"], "reads": st["requests_done"],
            "pread_us": sum(st["busy_ns"]) / per, "verify_us": sum(st["verify_ns"]) / per,
            "copy_us": st["device_copy_ns"] / max(st["device_copies"], 1) / 1e3,
            "verified": st["verified"], "preads_max": st["preads_max"],
            "verify_share": sum(st["verify_ns"]) / busy if busy else 0.0,
            "direct": res["direct"]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("store", type=Path)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--touch", action="store_true")
    ap.add_argument("--variants", default="direct,bounce,bounce+verify,bounce+verify+overlap")
    a = ap.parse_args()
    variants = [v for v in a.variants.split(",") if v]
    for v in variants:
        bad = set(v.split("+")) - set(PARTS)
        if bad:
            raise SystemExit(f"--variants {v!r}: unknown {sorted(bad)} (parts: {', '.join(PARTS)})")
    m = load_manifest(a.store)
    rb = m.layout.record_bytes
    dc = any("dc" in v.split("+") for v in variants)
    dm = any("dm" in v.split("+") for v in variants)
    arenas = {
        ("4k", False): Arena(a.workers * IN_FLIGHT, rb, hugepages=False, on_device=dc),
        ("", False): Arena(a.workers * IN_FLIGHT, rb, on_device=dc),
    }
    if dm:
        arenas["", True] = Arena(a.workers * IN_FLIGHT, rb, on_device=True, device_memory=True)
    print(
        f"{a.store}: {m.checksum} records of {rb} bytes, {a.workers} workers, device "
        f"{mx.default_device()}, touch={a.touch}"
    )
    runs: dict[str, list[float]] = {v: [] for v in variants}
    for i in range(a.rounds):
        order = variants[i % len(variants) :] + variants[: i % len(variants)]
        for v in order:
            parts = set(v.split("+"))
            res = read_round(a.store, m, arenas["4k" if "4k" in parts else "", "dm" in parts], parts, a.workers, a.seconds,
                             a.touch, seed=i)  # fmt: skip
            runs[v].append(res["gb_per_s"])
            print(f"round {i} {v}: {res['gb_per_s']:.3f} GB/s ({res['reads']} reads, "
                  f"{res['verified']} verified, preads at once <= {res['preads_max']}; a read: "
                  f"pread {res['pread_us']:.0f} us, verify {res['verify_us']:.0f} us, device copy "
                  f"{res['copy_us']:.0f} us)")  # fmt: skip
    first = statistics.median(runs[variants[0]])
    for v in variants:
        med = statistics.median(runs[v])
        print(f"{v}: median {med:.3f} GB/s, x{med / first:.3f} of {variants[0]}")


if __name__ == "__main__":
    main()
