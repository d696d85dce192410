"""SSD bandwidth probe: random record-sized direct reads through the native reader.

Measures what expert streaming can expect from a drive: reads of one expert record each, at
record-aligned random offsets across a file, with 1, 4, 8, 16... reads in flight
(`probe_ssd`); and what the expert cache gets of it into its arena, every step of a read
included (`probe_data_path`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..config import OptionError
from .reader import ALIGNMENT, Reader, error_message

DEFAULT_RECORD_BYTES = 1_474_560  # one expert record of a typical 4-bit MoE layer


def _aligned_buffer(nbytes: int) -> tuple[np.ndarray, int]:
    """A uint8 array of nbytes whose data address is ALIGNMENT aligned, and that address."""
    raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGNMENT
    view = raw[start : start + nbytes]
    return view, view.ctypes.data


def probe_ssd(
    path: str | os.PathLike,
    record_bytes: int = DEFAULT_RECORD_BYTES,
    workers_list: Sequence[int] = (1, 4, 8, 16),
    seconds: float = 2.0,
    max_reads: int | None = None,
    direct: bool = True,
    seed: int | None = None,
) -> list[dict]:
    """Random-read bandwidth of the drive holding ``path``, per worker count.

    For each entry of ``workers_list`` a fresh :class:`~strata_mlx.stream.reader.Reader` with that
    many threads keeps ``workers`` reads in flight, each of one record (``record_bytes``
    rounded up to 4096) at a random record-aligned offset of the file, for ``seconds`` or
    until ``max_reads`` reads, whichever comes first. A file smaller than one record is read
    as one record of its size rounded down to 4096 (it must hold at least 4096 bytes).

    With ``direct=False``, or where the file system refuses direct I/O, reads go through the
    page cache and mostly measure memory: the ``direct`` field of each result says which.

    Returns one dict per setting: ``workers``, ``gb_per_s`` (1e9 bytes/s), ``reads``,
    ``direct``, ``seconds`` (measured), ``record_bytes``. Raises OSError if a read fails.
    """
    size = os.path.getsize(path)
    record = -(-record_bytes // ALIGNMENT) * ALIGNMENT
    if size < record:
        record = size // ALIGNMENT * ALIGNMENT
    if record == 0:
        raise OptionError(f"{path}: {size} bytes is too small to probe (needs {ALIGNMENT})")
    n_records = size // record
    rng = np.random.default_rng(seed)
    return [
        _probe_one(path, record, n_records, workers, seconds, max_reads, direct, rng)
        for workers in workers_list
    ]


def _probe_one(
    path: str | os.PathLike,
    record: int,
    n_records: int,
    workers: int,
    seconds: float,
    max_reads: int | None,
    direct: bool,
    rng: np.random.Generator,
) -> dict:
    """Keep `workers` random record reads in flight for `seconds` (or `max_reads` reads)."""
    buf, base = _aligned_buffer(record * workers)  # one slot per read in flight
    with Reader(workers=workers) as reader:
        f = reader.open(path, direct=direct)
        tag = 0

        def request(slot: int) -> tuple[int, int, int, int, int]:
            nonlocal tag
            tag += 1
            offset = int(rng.integers(n_records)) * record
            return (tag, f, offset, record, base + slot * record)

        in_flight = workers if max_reads is None else max(1, min(workers, max_reads))
        first = [request(slot) for slot in range(in_flight)]
        slot_of = {req[0]: slot for slot, req in enumerate(first)}
        start = time.perf_counter()
        deadline = start + seconds
        reader.submit(first)
        issued, reads, nbytes = in_flight, 0, 0
        while slot_of:
            more = []
            for t, err, got in reader.wait(None):
                if err:
                    raise OSError(err, f"{path}: probe read failed: {error_message(err)}")
                reads += 1
                nbytes += got
                slot = slot_of.pop(t)
                if time.perf_counter() < deadline and (max_reads is None or issued < max_reads):
                    req = request(slot)
                    slot_of[req[0]] = slot
                    more.append(req)
                    issued += 1
            if more:
                reader.submit(more)
        elapsed = time.perf_counter() - start
        result = {
            "workers": workers,
            "gb_per_s": nbytes / elapsed / 1e9,
            "reads": reads,
            "direct": reader.is_direct(f),
            "seconds": elapsed,
            "record_bytes": record,
        }
    del buf  # kept alive until the reader has stopped writing into it
    return result


IN_FLIGHT = 8  # probe_data_path's reads queued a worker (prefill queues hundreds a layer)


def probe_data_path(
    store: str | os.PathLike,
    manifest,
    workers: int = 8,
    seconds: float = 2.0,
    verify: bool = True,
    overlap: bool = True,
    device_copy: bool | None = None,
    touch: bool = True,
    seed: int | None = None,
    bounce: bool | None = None,
    arena=None,
    device_memory: bool = False,
    copy_behind: bool = False,
) -> dict:
    """The bandwidth the expert cache gets into its arena: random records of the store read
    as the cache reads them (direct I/O; the bounce buffer where the machine needs one; the
    checksum; the CUDA copy engine where `device_copy`, None: where the cache would use it)
    into slots of an arena, `workers` in flight, each batch of landed slots then read by the
    device (`touch`: the sum of their rows, evaluated), as kernels read slots between reads.
    probe_ssd measures the drive alone; this measures the drive and every step after it.
    `bounce` (None: where the cache would use it) and `arena` (None: a new one of
    IN_FLIGHT x workers slots; else its first slots) let benchmarks/read_path.py take each
    step apart; `device_memory`: with the device copy, a new arena is plain device memory (the
    cache's device_arena), else managed memory; `copy_behind`: the reader's option of that name.

    Reads stay queued as the cache's prefill keeps them (hundreds a layer): IN_FLIGHT x workers
    slots, each read again once its touch has run. The touch is queued, not waited for: a slot
    is resubmitted at the next batch of completions, by when its touch has finished, so the
    device's reading never holds up the reads of other slots.

    Returns ``gb_per_s`` (1e9 bytes/s), ``reads``, ``seconds``, ``direct``, ``device_copy``,
    ``bounce`` and the reader's ``stats``. Raises OSError if a read fails or a record's checksum
    does not match."""
    import mlx.core as mx

    from ..format.store import EXPERTS
    from .arena import Arena
    from .reader import needs_bounce, uses_device_copy

    if device_copy is None:
        device_copy = uses_device_copy()
    rb = manifest.layout.record_bytes
    keys = [(layer, e) for layer in manifest.moe_layers for e in range(manifest.num_experts)]
    rng = np.random.default_rng(seed)
    if arena is None:
        arena = Arena(IN_FLIGHT * workers, rb, on_device=device_copy, device_memory=device_memory)
    if bounce is None:
        bounce = needs_bounce()
    path = Path(store) / EXPERTS
    reader = Reader(
        workers, bounce=bounce, overlap=overlap, device_copy=device_copy, copy_behind=copy_behind
    )
    with reader as r:
        f = r.open(path, checksum=manifest.checksum if verify else None)
        tag = 0

        def request(slot: int) -> tuple:
            nonlocal tag
            tag += 1
            offset, expected = manifest.record(*keys[int(rng.integers(len(keys)))])
            return (tag, f, offset, rb, arena.address(slot), expected if verify else None)

        first = [request(s) for s in range(min(arena.n_slots, IN_FLIGHT * workers))]
        slot_of = {q[0]: s for s, q in enumerate(first)}
        if touch:  # build the touch's kernels outside the timing: on a CUDA machine with no
            # kernel cache their first build takes seconds, longer than the probe's window
            mx.eval(arena.rows[mx.array([0])].astype(mx.uint32).sum())
        start = time.perf_counter()
        r.submit(first)
        nbytes = reads = 0
        touched, waiting = None, []  # the last touch queued; the slots it reads
        while slot_of or waiting:
            landed = []
            for t, err, got in r.wait(None) if slot_of else ():
                if err:
                    raise OSError(err, f"{path}: read failed: {error_message(err)}")
                nbytes += got
                reads += 1
                landed.append(slot_of.pop(t))
            if touched is not None:
                mx.eval(touched)  # queued one batch ago: done by now, its slots free
            touched = None
            if touch and landed:
                touched = arena.rows[mx.array(landed)].astype(mx.uint32).sum()
                mx.async_eval(touched)
            free, waiting = (waiting, landed) if touch else (landed, [])
            if time.perf_counter() - start < seconds:
                more = [request(slot) for slot in free]
                slot_of.update((q[0], slot) for q, slot in zip(more, free))
                if more:
                    r.submit(more)
            else:
                waiting = []
        if touched is not None:
            mx.eval(touched)
        elapsed = time.perf_counter() - start
        direct = r.is_direct(f)
        stats = r.stats()
    return {
        "gb_per_s": nbytes / elapsed / 1e9,
        "reads": reads,
        "seconds": elapsed,
        "direct": direct,
        "device_copy": device_copy,
        "bounce": bounce,
        "stats": stats,
    }
