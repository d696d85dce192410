"""How long a decode miss's read takes, alone: batches of K urgent records (a gated layer's
misses) submitted as the expert cache submits them, each with its ready word, timed from the
submission until every word says landed, the reader's threads idle between batches as they are
between a decode's layers; then the reader's own split of that time (the wait for a thread, a
part's pread, checksum and copy).

    python benchmarks/miss_latency.py STORE [--misses 2] [--batches 300] [--gap-us 250]
        [--variants base,sp1,s128:sp1,rs2000,s0,vc1,nv,w16:sp1] [--rounds 2]

A variant is `base` (the runtime's defaults: 8 threads, 256 KB parts, checksums, on CUDA the
copy engine into an arena in device memory) or `:`-joined changes to it: `sN` parts of N KB
(0: whole records), `sp1` a batch split over every idle thread (up to idle parts a record,
not idle / K, a thread woken for each part, not one that wakes the next), `rsN` threads poll
N us for work before sleeping (`rnK`: K of them at most), `wN` N threads, `vc1` a checksum
taken while its copy runs, `nv` no checksum. Variants rotate round by round, so drift falls
on all alike. The host polls the words (the device's gate polls the same words in mapped
memory, ~1 us a poll): what this measures is the reader's part of a gated layer's wait.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from strata_mlx.format.store import EXPERTS, load_manifest
from strata_mlx.stream.arena import Arena
from strata_mlx.stream.reader import Reader, error_message, needs_bounce, uses_device_copy

DEFAULTS = {"s": 256, "rs": 0, "rn": 4, "w": 8, "vc": 0, "nv": 0, "sp": 0}


def parse(variant: str) -> dict:
    """A variant's settings: DEFAULTS with its `:`-joined changes."""
    out = dict(DEFAULTS)
    for part in variant.split(":"):
        if part in ("base", ""):
            continue
        if part == "nv":
            out["nv"] = 1
            continue
        key = part.rstrip("0123456789")
        num = part[len(key) :]
        if key not in DEFAULTS or not num:
            raise SystemExit(f"--variants {variant!r}: unknown part {part!r} (see --help)")
        out[key] = int(num)
    return out


def run_variant(store: Path, m, arena: Arena, v: dict, a, seed: int) -> dict:
    """One round of `a.batches` batches with settings `v`: batch latencies (us) and stats."""
    rb = m.layout.record_bytes
    dc = uses_device_copy()
    keys = [(layer, e) for layer in m.moe_layers for e in range(m.num_experts)]
    rng = np.random.default_rng(seed)
    words = np.full(arena.n_slots, -1, np.int32)
    base = words.ctypes.data
    lat = []
    reader = Reader(v["w"], bounce=needs_bounce(), split=v["s"] * 1024, overlap=True,
                    device_copy=dc, copy_behind=dc, record_bytes=rb, spin_us=v["rs"],
                    spinners=v["rn"])  # fmt: skip
    with reader as r:
        r.verify_in_copy = bool(v["vc"])
        r.spread = bool(v["sp"])
        f = r.open(store / EXPERTS, checksum=None if v["nv"] else m.checksum)
        tag = 0
        for b in range(a.warmup + a.batches):
            if b == a.warmup:
                r.reset_stats()
            picks = rng.choice(len(keys), a.misses, replace=False)
            first = (b * a.misses) % (arena.n_slots - a.misses + 1)
            reqs = []
            for i, k in enumerate(picks):
                slot = first + i
                offset, expected = m.record(*keys[int(k)])
                words[slot] = -1
                tag += 1
                reqs.append((tag, f, offset, rb, arena.address(slot),
                             None if v["nv"] else expected, (base + 4 * slot, slot)))  # fmt: skip
            mine = words[first : first + a.misses]
            t0 = time.perf_counter_ns()
            r.submit(reqs, urgent=True)
            while (mine == -1).any():
                pass
            t1 = time.perf_counter_ns()
            got = 0
            while got < a.misses:
                for _t, err, _n in r.wait(None):
                    if err:
                        raise SystemExit(f"{store / EXPERTS}: read failed: {error_message(err)}")
                    got += 1
            if b >= a.warmup:
                lat.append((t1 - t0) / 1e3)
            # (the threads idle between batches, as between a decode's layers)
            end = time.perf_counter_ns() + a.gap_us * 1000
            while time.perf_counter_ns() < end:
                time.sleep(0)
        st = r.stats()
    n = max(st["urgent_reads"], 1)
    parts = max(st["urgent_parts"], 1)
    return {
        "lat": lat,
        "miss_us": st["urgent_ns"] / n / 1e3,
        "queued_us": st["urgent_queued_ns"] / n / 1e3,
        "parts": st["urgent_parts"] / n,
        "pread_us": st["urgent_pread_ns"] / parts / 1e3,
        "verify_us": st["urgent_verify_ns"] / parts / 1e3,
        "copy_us": st["urgent_copy_ns"] / parts / 1e3,
        "spin_takes": st["spin_takes"] / parts,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("store", type=Path)
    ap.add_argument("--misses", type=int, default=2, help="records a batch (a layer's misses)")
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--gap-us", type=int, default=250, help="idle time between batches")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default="base,sp1,s128:sp1,rs2000,s0,vc1,nv,w16:sp1")
    a = ap.parse_args()
    variants = [v for v in a.variants.split(",") if v]
    settings = {v: parse(v) for v in variants}
    if not 1 <= a.misses <= 64:
        raise SystemExit(f"--misses {a.misses}: 1 to 64")
    m = load_manifest(a.store)
    dc = uses_device_copy()
    arena = Arena(128, m.layout.record_bytes, on_device=dc, device_memory=dc)
    print(f"{a.store}: records of {m.layout.record_bytes} bytes, {a.misses} a batch, "
          f"{a.gap_us} us apart, device copy {dc}")  # fmt: skip
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for i in range(a.rounds):
        for v in variants[i % len(variants) :] + variants[: i % len(variants)]:
            runs[v].append(res := run_variant(a.store, m, arena, settings[v], a, seed=i))
            print(f"round {i} {v}: median {statistics.median(res['lat']):.0f} us",
                  file=sys.stderr, flush=True)  # fmt: skip
    first = None
    for v in variants:
        lat = [x for res in runs[v] for x in res["lat"]]
        med = statistics.median(lat)
        p90 = statistics.quantiles(lat, n=10)[-1]
        first = first or med
        avg = {k: statistics.fmean(res[k] for res in runs[v]) for k in runs[v][0] if k != "lat"}
        print(f"{v:>12}: a batch lands in {med:6.0f} us (p90 {p90:.0f}), x{med / first:.2f}; "
              f"a miss {avg['miss_us']:.0f} us, {avg['queued_us']:.0f} before a thread took "
              f"it; {avg['parts']:.1f} parts a miss, a part's pread {avg['pread_us']:.0f}, "
              f"checksum {avg['verify_us']:.0f}, copy {avg['copy_us']:.0f} us; "
              f"taken by a polling thread {avg['spin_takes']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
