"""The native reader: bytes land where asked, queue order, cancel/promote, errors, the GIL,
checksums verified in the worker threads."""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from strata_mlx import _reader
from strata_mlx.stream.reader import (
    ALIGNMENT,
    CHECKSUM_MISMATCH,
    SHORT_READ,
    Reader,
    checksum,
    checksum_implementation,
    error_message,
)

RECORD = 4 * ALIGNMENT
N_RECORDS = 16


def aligned(nbytes: int) -> tuple[np.ndarray, int]:
    """A zeroed uint8 array of nbytes whose data address is ALIGNMENT aligned, and the address."""
    raw = np.zeros(nbytes + ALIGNMENT, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGNMENT
    view = raw[start : start + nbytes]
    assert view.ctypes.data % ALIGNMENT == 0
    return view, view.ctypes.data


@pytest.fixture(scope="module")
def data_dir():
    # /tmp may be tmpfs (no O_DIRECT on older kernels); prefer a disk-backed directory.
    base = "/var/tmp" if os.path.isdir("/var/tmp") and os.access("/var/tmp", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="strata-reader-", dir=base) as d:
        yield Path(d)


@pytest.fixture(scope="module")
def data_file(data_dir) -> tuple[Path, bytes]:
    payload = np.random.default_rng(0).integers(0, 256, RECORD * N_RECORDS, dtype=np.uint8)
    path = data_dir / "records.bin"
    path.write_bytes(payload.tobytes())
    return path, payload.tobytes()


@pytest.fixture(
    autouse=True,
    params=[(False, 0), (True, 0), (True, 2000)],
    ids=["slots-held", "overlap", "overlap-spinning"],
)
def overlap(request, monkeypatch):
    """Every test runs with the reader's overlap off and on (threads that let go of their
    read slot before the copy and the checksum must land, verify, cancel and count alike),
    and with idle threads polling for work before they sleep (spin_us)."""
    on, spin_us = request.param

    class Overlapping(Reader):
        def __init__(self, *args, **kw):
            kw.setdefault("overlap", on)
            kw.setdefault("spin_us", spin_us)
            kw.setdefault("spinners", 2)
            super().__init__(*args, **kw)

    monkeypatch.setitem(globals(), "Reader", Overlapping)
    return on


def drain(reader: Reader, n: int) -> list[tuple[int, int, int]]:
    """Collect n completions in completion order."""
    out: list[tuple[int, int, int]] = []
    while len(out) < n:
        got = reader.wait(None, timeout=10)
        assert got, "no completion within 10 s"
        out += got
    return out


@pytest.mark.parametrize("bounce", [False, True])
@pytest.mark.parametrize("direct", [True, False])
def test_reads_land_in_place(data_file, direct, bounce, overlap):
    """Directly, or (bounce) read into each worker's own buffer and copied into place."""
    path, payload = data_file
    buf, addr = aligned(RECORD * N_RECORDS)
    order = np.random.default_rng(1).permutation(N_RECORDS)
    with Reader(workers=4, bounce=bounce) as r:
        f = r.open(path, direct=direct)
        if not direct:
            assert not r.is_direct(f)
        # record i goes to slot order[i]
        reqs = [(i, f, i * RECORD, RECORD, addr + int(order[i]) * RECORD) for i in range(N_RECORDS)]
        r.submit(reqs[: N_RECORDS // 2], urgent=True)
        r.submit(reqs[N_RECORDS // 2 :])
        done = r.wait(range(N_RECORDS), timeout=10)
        assert done == [(i, 0, RECORD) for i in range(N_RECORDS)]
        stats = r.stats()
        assert stats["bytes_read"] == RECORD * N_RECORDS
        assert stats["requests_done"] == N_RECORDS
        assert stats["errors"] == 0 and len(stats["busy_ns"]) == (8 if overlap else 4)
        assert r.poll() == []
    for i in range(N_RECORDS):
        slot = int(order[i])
        assert (
            buf[slot * RECORD : (slot + 1) * RECORD].tobytes()
            == payload[i * RECORD : (i + 1) * RECORD]
        )


def test_buffered_allows_unaligned(data_file):
    path, payload = data_file
    buf = np.zeros(1000, dtype=np.uint8)
    with Reader(workers=1) as r:
        f = r.open(path, direct=False)
        r.submit([(7, f, 12345, 999, buf.ctypes.data + 1)])
        assert r.wait([7], timeout=10) == [(7, 0, 999)]
    assert buf[1:].tobytes() == payload[12345 : 12345 + 999]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="procfs")
def test_fallback_when_direct_refused():
    # procfs refuses O_DIRECT with EINVAL: the reader falls back to buffered and says so.
    expected = Path("/proc/version").read_bytes()
    buf = np.zeros(len(expected), dtype=np.uint8)
    with Reader(workers=1) as r:
        f = r.open("/proc/version", direct=True)
        assert r.is_direct(f) is False
        r.submit([(1, f, 0, len(expected), buf.ctypes.data)])
        assert r.wait([1], timeout=10) == [(1, 0, len(expected))]
    assert buf.tobytes() == expected


def test_urgent_before_read_ahead(data_file):
    path, _ = data_file
    _, addr = aligned(RECORD)
    # (one thread: with overlap a second one reads the next record while the first verifies
    # and completes its own, so completions may come out of the order the reads were taken in)
    with Reader(workers=1, start_paused=True, overlap=False) as r:
        f = r.open(path)
        r.submit([(t, f, t * RECORD, RECORD, addr) for t in (1, 2, 3)])
        r.submit([(t, f, t * RECORD, RECORD, addr) for t in (10, 11)], urgent=True)
        assert r.stats()["queued_ahead"] == 3 and r.stats()["queued_urgent"] == 2
        r.resume()
        assert [c[0] for c in drain(r, 5)] == [10, 11, 1, 2, 3]


def test_cancel(data_file):
    path, _ = data_file
    _, addr = aligned(RECORD)
    with Reader(workers=1, start_paused=True, overlap=False) as r:  # (one thread: in order)
        f = r.open(path)
        r.submit([(t, f, t * RECORD, RECORD, addr) for t in range(1, 6)])
        r.submit([(9, f, 0, RECORD, addr)], urgent=True)
        assert r.cancel([2, 4, 9, 99]) == [2, 4]  # 9 is urgent, 99 unknown
        r.resume()
        assert [c[0] for c in drain(r, 4)] == [9, 1, 3, 5]
        with pytest.raises(KeyError):
            r.wait([2], timeout=10)  # cancelled: an error, not a hang
        assert r.cancel([1]) == []  # already done
        assert r.stats()["requests_done"] == 4


def test_promote(data_file):
    path, _ = data_file
    _, addr = aligned(RECORD)
    with Reader(workers=1, start_paused=True, overlap=False) as r:  # (one thread: in order)
        f = r.open(path)
        r.submit([(t, f, t * RECORD, RECORD, addr) for t in (1, 2, 3, 4)])
        r.submit([(8, f, 0, RECORD, addr)], urgent=True)
        assert r.promote([4, 3, 8, 77]) == [4, 3]
        r.resume()
        assert [c[0] for c in drain(r, 5)] == [8, 4, 3, 1, 2]


@pytest.mark.parametrize("direct", [True, False])
def test_truncated_file_is_an_error(data_dir, direct):
    path = data_dir / f"short-{direct}.bin"
    path.write_bytes(os.urandom(3 * ALIGNMENT + 1000))
    _, addr = aligned(4 * ALIGNMENT)
    with Reader(workers=2) as r:
        f = r.open(path, direct=direct)
        r.submit(
            [
                (1, f, 0, 2 * ALIGNMENT, addr),  # fine
                (2, f, 2 * ALIGNMENT, 2 * ALIGNMENT, addr),  # runs past the end
                (3, f, 8 * ALIGNMENT, ALIGNMENT, addr),  # starts past the end
            ]
        )
        done = r.wait([1, 2, 3], timeout=10)
        assert done == [
            (1, 0, 2 * ALIGNMENT),
            (2, SHORT_READ, ALIGNMENT + 1000),
            (3, SHORT_READ, 0),
        ]
        assert r.stats()["errors"] == 2
    assert "end of file" in error_message(SHORT_READ)


def test_invalid_requests_raise(data_file):
    path, _ = data_file
    _, addr = aligned(2 * RECORD)
    with Reader(workers=1, start_paused=True) as r:
        f = r.open(path)
        if not r.is_direct(f):
            pytest.skip("file system refuses O_DIRECT")
        good = (1, f, 0, RECORD, addr)
        for bad, word in [
            ((2, f, 100, RECORD, addr), "offset"),
            ((2, f, 0, RECORD - 1, addr), "length"),
            ((2, f, 0, RECORD, addr + 8), "dest_address"),
            ((2, f + 5, 0, RECORD, addr), "file_index"),
            ((2, f, -ALIGNMENT, RECORD, addr), ">= 0"),
            ((2, f, 0, RECORD, 0), "NULL"),
        ]:
            with pytest.raises(ValueError, match=word):
                r.submit([good, bad])
        with pytest.raises(TypeError):
            r.submit([[1, f, 0, RECORD, addr]])
        with pytest.raises(OverflowError):
            r.submit([(1, f, 0, RECORD, -4096)])
        # a bad request rejects the whole batch: nothing was queued
        assert r.stats()["queued_ahead"] == 0
        with pytest.raises(FileNotFoundError):
            r.open(path.parent / "missing.bin")


def test_wait_timeout_unknown_and_close(data_file):
    path, _ = data_file
    _, addr = aligned(RECORD)
    r = Reader(workers=1, start_paused=True)
    f = r.open(path)
    r.submit([(1, f, 0, RECORD, addr)])
    assert r.wait([1], timeout=0.05) == []  # paused: times out, returns what is there
    with pytest.raises(KeyError):
        r.wait([1, 42])
    r.resume()
    r.submit([(2, f, 0, RECORD, addr)])
    assert r.wait([2], timeout=10) == [(2, 0, RECORD)]
    assert r.poll() == [(1, 0, RECORD)]  # not asked for above: kept
    assert r.wait(None, timeout=0) == []  # nothing outstanding: returns at once
    r.close()
    r.close()
    assert r.closed
    with pytest.raises(ValueError):
        r.submit([(3, f, 0, RECORD, addr)])
    with pytest.raises(ValueError):
        r.wait([3])


def test_close_while_waiting_and_with_queued_work(data_file):
    path, _ = data_file
    _, addr = aligned(RECORD)
    r = Reader(workers=1, start_paused=True)
    f = r.open(path)
    r.submit([(t, f, 0, RECORD, addr) for t in range(50)])
    errors = []

    def waiter():
        try:
            r.wait([0])
        except ValueError as e:
            errors.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    r.close()  # queued requests are dropped, the waiter is woken with an error
    t.join(10)
    assert not t.is_alive() and len(errors) == 1


def test_wait_releases_the_gil(data_file):
    # The only thing that lets the read start is a Python thread that must first count to N,
    # so wait() can only return if it let that thread run. No timing involved.
    path, _ = data_file
    _, addr = aligned(RECORD)
    n = 200_000
    count = 0
    with Reader(workers=1, start_paused=True) as r:
        f = r.open(path)
        r.submit([(1, f, 0, RECORD, addr)])

        def counter():
            nonlocal count
            for _ in range(n):
                count += 1
            r.resume()

        t = threading.Thread(target=counter)
        t.start()
        done = r.wait([1], timeout=30)
        t.join()
    assert count == n
    assert done == [(1, 0, RECORD)]


def test_many_concurrent_requests(data_file):
    path, payload = data_file
    rng = np.random.default_rng(2)
    n = 400
    records = rng.integers(0, N_RECORDS, n)
    buf, addr = aligned(n * RECORD)
    with Reader(workers=8) as r:
        f = r.open(path)
        reqs = [
            (i, f, int(rec) * RECORD, RECORD, addr + i * RECORD) for i, rec in enumerate(records)
        ]
        for start in range(0, n, 50):
            r.submit(reqs[start : start + 50], urgent=bool(start % 100))
        done = drain(r, n)
    assert sorted(c[0] for c in done) == list(range(n))
    assert all(c[1:] == (0, RECORD) for c in done)
    for i, rec in enumerate(records):
        got = buf[i * RECORD : (i + 1) * RECORD].tobytes()
        assert got == payload[int(rec) * RECORD : (int(rec) + 1) * RECORD]


def test_probe_small_file(data_dir):
    from strata_mlx.stream.probe import probe_ssd

    path = data_dir / "probe.bin"
    path.write_bytes(os.urandom(5 * ALIGNMENT + 123))  # smaller than one default record
    results = probe_ssd(path, workers_list=(1, 3), seconds=0.2, max_reads=40)
    assert [r["workers"] for r in results] == [1, 3]
    for res in results:
        assert res["record_bytes"] == 5 * ALIGNMENT
        assert 1 <= res["reads"] <= 40 and res["gb_per_s"] > 0
        assert isinstance(res["direct"], bool)
    one = probe_ssd(path, record_bytes=3000, workers_list=(2,), max_reads=1)[0]
    assert one["reads"] == 1 and one["record_bytes"] == ALIGNMENT


def test_checksums_match_references():
    # the standard check values, zlib's crc32, and the instruction path against the tables
    assert checksum("crc32c", b"123456789") == 0xE3069283
    assert checksum("crc32", b"123456789") == 0xCBF43926 == zlib.crc32(b"123456789")
    assert checksum("crc32c", b"") == 0 and checksum("crc32", b"") == 0
    data = np.random.default_rng(3).integers(0, 256, 3 * 24576 + 1000, dtype=np.uint8).tobytes()
    # lengths around the 8-byte words and the three-stream blocks (3 x 256, 3 x 8192)
    for n in (1, 7, 8, 9, 767, 768, 769, 24575, 24576, 24577, 3 * 24576 + 999):
        for start in (0, 3):
            chunk = data[start : start + n]
            assert checksum("crc32", chunk) == zlib.crc32(chunk), n
            assert checksum("crc32c", chunk) == _reader.checksum_table("crc32c", chunk), n
            cut = n // 3
            for name in ("crc32", "crc32c"):
                head = checksum(name, chunk[:cut])
                assert checksum(name, chunk[cut:], head) == checksum(name, chunk), (name, n)
    arr = np.frombuffer(data, dtype=np.uint8)
    assert checksum("crc32c", arr) == checksum("crc32c", data)  # any buffer
    assert checksum_implementation("crc32c") in ("sse4.2", "armv8-crc", "table")
    assert checksum_implementation("crc32") in ("pclmul", "armv8-crc", "table")
    # the folding path (>= 64 bytes) from any starting value, against zlib
    for n in (64, 65, 79, 80, 127, 128, 4096 + 15):
        assert checksum("crc32", data[:n], 0xDEADBEEF) == zlib.crc32(data[:n], 0xDEADBEEF), n
        assert checksum("crc32c", data[:n], 7) == _reader.checksum_table("crc32c", data[:n], 7)
    with pytest.raises(ValueError, match="crc32c"):
        checksum("md5", data)


@pytest.mark.parametrize("bounce", [False, True])
@pytest.mark.parametrize("name", ["crc32c", "crc32"])
@pytest.mark.parametrize("direct", [True, False])
def test_reads_are_verified_in_the_workers(data_file, name, direct, bounce, overlap):
    path, payload = data_file
    sums = [checksum(name, payload[i * RECORD : (i + 1) * RECORD]) for i in range(N_RECORDS)]
    buf, addr = aligned(RECORD * 4)
    with Reader(workers=2, bounce=bounce) as r:
        f = r.open(path, direct=direct, checksum=name)
        r.submit(
            [
                (1, f, 0, RECORD, addr, sums[0]),
                (2, f, RECORD, RECORD, addr + RECORD, sums[1] ^ 1),  # wrong
                (3, f, 2 * RECORD, RECORD, addr + 2 * RECORD, None),  # not checked
                (4, f, 3 * RECORD, RECORD, addr + 3 * RECORD),  # not checked
            ]
        )
        done = r.wait([1, 2, 3, 4], timeout=10)
        assert done == [
            (1, 0, RECORD),
            (2, CHECKSUM_MISMATCH, RECORD),
            (3, 0, RECORD),
            (4, 0, RECORD),
        ]
        stats = r.stats()
        assert stats["verified"] == 2 and stats["errors"] == 1
        assert len(stats["verify_ns"]) == (4 if overlap else 2) and sum(stats["verify_ns"]) > 0
    for i in (0, 2, 3):
        assert (
            buf[i * RECORD : (i + 1) * RECORD].tobytes() == payload[i * RECORD : (i + 1) * RECORD]
        )
    # A mismatched record is left where it landed; through a bounce buffer it is not copied.
    landed = buf[RECORD : 2 * RECORD].tobytes() == payload[RECORD : 2 * RECORD]
    assert landed != bounce
    assert "checksum mismatch" in error_message(CHECKSUM_MISMATCH)


def test_truncated_file_with_a_checksum_is_a_short_read(data_dir):
    path = data_dir / "short-verified.bin"
    path.write_bytes(os.urandom(ALIGNMENT + 10))
    _, addr = aligned(2 * ALIGNMENT)
    with Reader(workers=1) as r:
        f = r.open(path, checksum="crc32c")
        r.submit([(1, f, 0, 2 * ALIGNMENT, addr, 12345)])
        assert r.wait([1], timeout=10) == [(1, SHORT_READ, ALIGNMENT + 10)]


def test_checksum_requests_are_validated(data_file):
    path, _ = data_file
    _, addr = aligned(RECORD)
    with Reader(workers=1, start_paused=True) as r:
        plain = r.open(path)
        checked = r.open(path, checksum="crc32c")
        with pytest.raises(ValueError, match="without a checksum"):
            r.submit([(1, plain, 0, RECORD, addr, 5)])
        with pytest.raises(ValueError, match="32 bits"):
            r.submit([(1, checked, 0, RECORD, addr, 1 << 32)])
        with pytest.raises(OverflowError):
            r.submit([(1, checked, 0, RECORD, addr, -1)])
        with pytest.raises(TypeError):
            r.submit([(1, checked, 0, RECORD, addr, 5, 6)])
        with pytest.raises(ValueError, match="checksum must be"):
            r.open(path, checksum="sha1")
        assert r.stats()["queued_ahead"] == 0


# ---- split reads: one request read as parts by idle workers, completed once --------------


@pytest.mark.parametrize("bounce", [False, True])
@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("spread", [False, True])
def test_split_reads_land_whole_and_complete_once(data_file, direct, bounce, spread):
    path, payload = data_file
    big = 4 * RECORD  # 4 parts of one RECORD each with split=RECORD and 8 idle workers
    sums = [checksum("crc32c", payload[i * big : (i + 1) * big]) for i in range(4)]
    buf, addr = aligned(4 * big)
    with Reader(workers=8, bounce=bounce, split=RECORD) as r:
        assert not r.spread  # (idle / n parts a request, a part's worker wakes the next)
        r.spread = spread
        assert r.spread == spread
        f = r.open(path, direct=direct, checksum="crc32c")
        # 2 requests, 8 idle workers: 4 parts each (spread: 8 each, at most 4 of RECORD)
        r.submit([(t, f, t * big, big, addr + t * big, sums[t]) for t in (0, 1)], urgent=True)
        assert r.wait([0, 1], timeout=10) == [(0, 0, big), (1, 0, big)]
        stats = r.stats()
        assert stats["requests_done"] == 2 and stats["verified"] == 2
        assert stats["bytes_read"] == 2 * big and stats["split"] == 2
        assert r.poll() == []
        # a wrong checksum is caught over the whole request, whichever part finished last
        r.submit([(2, f, 2 * big, big, addr + 2 * big, sums[2] ^ 1)])
        assert r.wait([2], timeout=10) == [(2, CHECKSUM_MISMATCH, big)]
        # a deep queue is read whole: 9 requests for 8 workers
        r.pause()
        r.submit([(10 + i, f, 0, RECORD, addr + 3 * big) for i in range(9)])
        assert r.stats()["queued_ahead"] == 9 and r.queued() == 9
        r.resume()
        drain(r, 9)
        assert r.stats()["split"] == 3
    assert buf[: 2 * big].tobytes() == payload[: 2 * big]


@pytest.mark.parametrize("spread", [False, True])
def test_a_spread_batch_is_split_over_every_idle_worker(data_file, spread):
    """3 urgent requests of 4 RECORDs, 8 idle workers: idle / 3 = 2 parts each (6 in all);
    spread, up to 8 parts each, at most one RECORD a part: 4 each (12 in all), queued beyond
    the workers. Read-ahead keeps idle / 3, and 9 urgent requests (more than the workers, as
    prefill's misses) stay whole. Either way every byte lands where it belongs."""
    path, payload = data_file
    big = 4 * RECORD
    buf, addr = aligned(3 * big)
    with Reader(workers=8, start_paused=True, split=RECORD) as r:
        r.spread = spread
        f = r.open(path)
        for urgent, queue in ((True, "queued_urgent"), (False, "queued_ahead")):
            r.submit([(t, f, t * big, big, addr + t * big) for t in range(3)], urgent=urgent)
            assert r.queued() == 3  # (a split request counts once until its first part starts)
            assert r.stats()[queue] == (12 if spread and urgent else 6)  # (parts)
            r.resume()
            assert sorted(drain(r, 3)) == [(t, 0, big) for t in range(3)]
            r.pause()
        st = r.stats()
        assert st["urgent_parts"] == (12 if spread else 6) and st["split"] == 6
        r.reset_stats()
        r.submit([(10 + t, f, 0, big, addr) for t in range(9)], urgent=True)
        assert r.stats()["queued_urgent"] == 9
        r.resume()
        drain(r, 9)
        assert r.stats()["urgent_parts"] == 9 and r.stats()["split"] == 0
        assert r.stats()["spread_wakes"] == 0  # (neither batch woke a thread a part)
    assert buf.tobytes() == payload[: 3 * big]


@pytest.mark.parametrize("spread", [False, True])
def test_a_spread_batch_wakes_a_thread_for_each_part(data_file, spread):
    """2 urgent requests of 4 RECORDs, 8 sleeping workers: 8 parts either way; spread wakes a
    thread for each (every worker), else one that wakes the next as it takes its part. A
    read-ahead batch never wakes a thread a part."""
    path, payload = data_file
    big = 4 * RECORD
    buf, addr = aligned(2 * big)
    with Reader(workers=8, split=RECORD) as r:
        r.spread = spread
        f = r.open(path)
        time.sleep(0.05)  # (threads asleep, or polling where the fixture has them poll)
        r.submit([(t, f, t * big, big, addr + t * big) for t in range(2)], urgent=True)
        assert sorted(drain(r, 2)) == [(t, 0, big) for t in range(2)]
        woken = r.stats()["spread_wakes"]
        assert 0 < woken <= 8 if spread else woken == 0
        r.submit([(t, f, t * big, big, addr + t * big) for t in range(2)])
        assert sorted(drain(r, 2)) == [(t, 0, big) for t in range(2)]
        assert r.stats()["spread_wakes"] == woken
    assert buf.tobytes() == payload[: 2 * big]


def test_urgent_reads_report_their_latency(data_file):
    """Requests submitted urgent (decode's misses) report their time from submission to
    landing and to a thread taking them up, once a request however many parts it is read in;
    read-ahead, promoted or not, does not count."""
    path, _ = data_file
    big = 4 * RECORD
    _, addr = aligned(4 * big)
    with Reader(workers=8, start_paused=True, split=RECORD) as r:
        f = r.open(path)
        t0 = time.perf_counter()
        r.submit([(0, f, 0, big, addr), (1, f, big, RECORD, addr + big)], urgent=True)
        r.submit([(2, f, 2 * big, RECORD, addr + 2 * big), (3, f, 3 * big, RECORD, addr + 3 * big)])
        assert r.promote([3]) == [3]
        time.sleep(0.05)  # queued, the reader paused: part of every urgent request's latency
        r.resume()
        assert [c[1] for c in drain(r, 4)] == [0] * 4  # (failed reads would count too)
        wall = time.perf_counter() - t0
        st = r.stats()
        assert st["urgent_reads"] == 2 and st["split"] >= 1
        assert 2 * 0.05e9 <= st["urgent_queued_ns"] <= st["urgent_ns"] <= 2 * wall * 1e9
        assert 0.05e9 <= st["urgent_max_ns"] <= wall * 1e9
        # each part's or whole read's own steps (the big one in 2-4 parts, the small one
        # whole; the promoted read-ahead not counted), parts side by side within the wall
        assert 3 <= st["urgent_parts"] <= 5 and 0 < st["urgent_pread_ns"]
        steps = st["urgent_pread_ns"] + st["urgent_verify_ns"] + st["urgent_copy_ns"]
        assert steps <= st["urgent_parts"] * wall * 1e9
        r.reset_stats()
        st = r.stats()
        assert st["urgent_reads"] == st["urgent_ns"] == st["urgent_max_ns"] == 0
        assert st["urgent_queued_ns"] == st["urgent_parts"] == st["urgent_pread_ns"] == 0


def test_polling_threads_take_reads_without_a_wake_up(data_file):
    """With spin_us, an idle thread polls for work before it sleeps: reads submitted while
    threads poll are taken up by them (counted), land in place and complete once; once the
    window has passed with nothing posted, the threads sleep and are woken as without it."""
    path, payload = data_file
    buf, addr = aligned(N_RECORDS * RECORD)
    with Reader(workers=4, split=0, spin_us=300_000, spinners=2) as r:
        f = r.open(path)
        for t in range(6):  # each submitted right after the last landed: threads poll
            r.submit([(t, f, t * RECORD, RECORD, addr + t * RECORD)], urgent=True)
            assert r.wait([t], timeout=10) == [(t, 0, RECORD)]
        assert r.stats()["spin_takes"] >= 5
        time.sleep(0.4)  # past the window: every thread asleep, one woken for the read
        taken = r.stats()["spin_takes"]
        r.submit([(6, f, 6 * RECORD, RECORD, addr + 6 * RECORD)])
        assert r.wait([6], timeout=10) == [(6, 0, RECORD)]
        assert r.stats()["spin_takes"] == taken
        r.submit([(t, f, t * RECORD, RECORD, addr + t * RECORD) for t in range(7, 10)])
        assert sorted(c[0] for c in drain(r, 3)) == [7, 8, 9]
        r.reset_stats()
        assert r.stats()["spin_takes"] == 0
    assert buf[: 10 * RECORD].tobytes() == payload[: 10 * RECORD]


def test_spin_options_are_checked():
    with pytest.raises(ValueError, match="spin_us"):
        Reader(workers=1, spin_us=-1)
    with pytest.raises(ValueError, match="spinners"):
        Reader(workers=1, spinners=-2)


def test_split_request_parts_are_counted_cancelled_and_promoted_together(data_file):
    path, payload = data_file
    big = 4 * RECORD
    buf, addr = aligned(3 * big)
    with Reader(workers=8, start_paused=True, split=RECORD) as r:
        f = r.open(path)
        r.submit([(t, f, t * big, big, addr + t * big) for t in (0, 1)])  # 4 parts each
        assert r.stats()["queued_ahead"] == 8 and r.queued() == 2
        assert r.cancel([0]) == [0]
        assert r.queued() == 1 and r.stats()["queued_ahead"] == 4
        with pytest.raises(KeyError):
            r.wait([0], timeout=1)
        r.submit([(5, f, 2 * big, big, addr + 2 * big)], urgent=True)  # 4 idle: 4 parts
        assert r.promote([1]) == [1]
        assert r.stats()["queued_urgent"] == 8 and r.queued() == 2
        r.resume()
        assert sorted(c[0] for c in drain(r, 2)) == [1, 5]
    assert buf[big:].tobytes() == payload[big : 3 * big]


def test_close_drops_queued_parts(data_file):
    path, _ = data_file
    big = 4 * RECORD
    _, addr = aligned(2 * big)
    r = Reader(workers=4, start_paused=True, split=RECORD)
    f = r.open(path)
    r.submit([(0, f, 0, big, addr)])
    r.resume()
    assert r.wait([0], timeout=10) == [(0, 0, big)]
    r.pause()
    r.submit([(1, f, big, big, addr + big)])  # 4 parts queued, never started
    r.close()  # drops them (and their group) with no completion and no crash
    assert r.closed


def test_split_must_be_aligned():
    with pytest.raises(ValueError, match="split"):
        Reader(workers=1, split=1000)
    with pytest.raises(ValueError, match="split"):
        Reader(workers=1, split=-4096)


def test_split_reads_under_cancel_and_promote_races(data_file):
    """Small batches while parts are in flight, cancels and promotes racing the workers:
    every request not cancelled completes exactly once with its bytes in place."""
    path, payload = data_file
    rng = np.random.default_rng(7)
    n_req, size = 120, 2 * RECORD
    per_file = len(payload) // size
    buf, addr = aligned(n_req * size)
    sums = [checksum("crc32c", payload[(t % per_file) * size :][:size]) for t in range(n_req)]
    cancelled: set[int] = set()
    with Reader(workers=6, split=ALIGNMENT) as r:
        f = r.open(path, checksum="crc32c")
        for start in range(0, n_req, 3):
            batch = range(start, start + 3)
            reqs = [(t, f, (t % per_file) * size, size, addr + t * size, sums[t]) for t in batch]
            r.submit(reqs, urgent=bool(rng.integers(2)))
            if rng.integers(3) == 0:
                cancelled.update(r.cancel([int(rng.integers(start + 1))]))
            if rng.integers(3) == 0:
                r.promote([int(rng.integers(start + 1))])
        wanted = [t for t in range(n_req) if t not in cancelled]
        assert r.wait(wanted, timeout=20) == [(t, 0, size) for t in wanted]
        assert r.poll() == [] and r.stats()["requests_done"] == len(wanted)
    for t in wanted:
        src = (t % per_file) * size
        assert buf[t * size : (t + 1) * size].tobytes() == payload[src : src + size]


# ---- overlap: a thread lets go of its slot on the drive before the copy and the checksum --


@pytest.mark.parametrize("overlap", [False, True])
def test_one_submit_sets_several_workers_reading(data_file, overlap, no_drive_limit):
    """A submit wakes one worker and each worker that takes a read wakes the next while reads
    are queued: a batch is read by several threads, not by the one first woken. The reads go
    through an emulated drive (each holds its worker ~80 us, as a drive's would): from the
    page cache alone the first worker could read the whole batch (~3 ms) before a loaded
    2-core machine schedules the threads it woke."""
    path, payload = data_file
    n = 100 * N_RECORDS
    buf, base = aligned(n * RECORD)
    no_drive_limit.limit_drive(0.2)
    with Reader(workers=4, overlap=overlap) as r:
        f = r.open(path, direct=False)
        r.submit([(t, f, (t % N_RECORDS) * RECORD, RECORD, base + t * RECORD, None)
                  for t in range(n)])  # fmt: skip
        deadline = time.monotonic() + 30
        while r.stats()["requests_done"] < n and time.monotonic() < deadline:
            time.sleep(0.001)  # not wait(): waiting on a tag wakes every worker
        stats = r.stats()
        done = drain(r, n)
    assert sorted(t for t, _, _ in done) == list(range(n))
    assert sum(ns > 0 for ns in stats["busy_ns"]) >= 2, stats["busy_ns"]


@pytest.mark.parametrize("bounce", [False, True])
def test_overlap_keeps_at_most_workers_preads_in_flight(data_file, overlap, bounce):
    """Twice the threads with overlap, never more than `workers` preads at once; every record
    lands whole and verified (bounce: through each thread's own buffer)."""
    path, payload = data_file
    sums = [checksum("crc32c", payload[i * RECORD : (i + 1) * RECORD]) for i in range(N_RECORDS)]
    n = 200 * N_RECORDS  # enough reads that four threads unchecked would overlap
    buf, base = aligned(n * RECORD)
    with Reader(workers=2, start_paused=True, bounce=bounce) as r:
        f = r.open(path, direct=False, checksum="crc32c")
        r.submit(
            [(t, f, (t % N_RECORDS) * RECORD, RECORD, base + t * RECORD, sums[t % N_RECORDS])
             for t in range(n)]
        )  # fmt: skip
        r.resume()
        done = drain(r, n)
        stats = r.stats()
    assert sorted(t for t, _, _ in done) == list(range(n))
    assert all(err == 0 and got == RECORD for _, err, got in done)
    assert stats["verified"] == n
    assert len(stats["busy_ns"]) == (4 if overlap else 2)
    assert 1 <= stats["preads_max"] <= 2
    for t in range(n):
        i = t % N_RECORDS
        assert (
            buf[t * RECORD : (t + 1) * RECORD].tobytes() == payload[i * RECORD : (i + 1) * RECORD]
        )


def test_advise_hugepages_is_a_hint():
    """True or False by the OS (Linux with THP: True), never an error for memory we own. The
    zeroed form gives back the whole 2 MB blocks inside the range (they read as zeros again:
    here they held 7s, to see it) and leaves the partial blocks at either end as they were."""
    from strata_mlx.stream.reader import advise_hugepages

    huge = 2 << 20
    buf, addr = aligned(5 * huge)
    view = buf[(-addr) % huge + ALIGNMENT :]  # just past a 2 MB boundary: head, tail partial
    view[:] = 7
    first = (-view.ctypes.data) % huge  # the first whole block's offset
    last = first + (view.nbytes - first) // huge * huge
    assert first > 0 and last < view.nbytes
    assert isinstance(advise_hugepages(view.ctypes.data, view.nbytes), bool)
    assert (view == 7).all()  # the plain advice changes no byte
    if advise_hugepages(view.ctypes.data, view.nbytes, zeroed=True):
        assert not view[first:last].any()
    else:  # another OS: nothing given back
        assert (view[first:last] == 7).all()
    assert (view[:first] == 7).all() and (view[last:] == 7).all()
    view[:] = 7  # and the memory is still ours to write
    assert (view == 7).all()
    assert advise_hugepages(addr, huge // 2) is False  # no whole block inside: nothing to advise
    with pytest.raises(ValueError, match="NULL"):
        advise_hugepages(0, 4096)


def test_device_copy_is_refused_in_one_line_without_cuda():
    from strata_mlx.stream import reader as rd

    if rd.device_copy_error() is not None:  # no CUDA driver here: the reason, and a refusal
        with pytest.raises(RuntimeError, match="^device_copy: .+"):
            Reader(2, device_copy=True)
        assert not rd.uses_device_copy()
    with pytest.raises(ValueError, match="NULL address"):
        rd.prefer_device(0, 4096)


def test_data_path_probe_reads_verified_records_and_names_a_corrupt_one(store, tmp_path):
    import shutil

    from strata_mlx.format.store import EXPERTS, load_manifest
    from strata_mlx.stream.probe import probe_data_path

    path = Path(store("qwen3_moe"))
    m = load_manifest(path)
    res = probe_data_path(path, m, workers=2, seconds=0.2, seed=0)
    from strata_mlx.stream.reader import uses_device_copy

    assert res["gb_per_s"] > 0 and res["reads"] >= 4
    assert res["device_copy"] is uses_device_copy()
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    with open(bad / EXPERTS, "r+b") as f:  # every record's first bytes changed
        for layer in m.moe_layers:
            for e in range(m.num_experts):
                f.seek(m.record(layer, e)[0])
                f.write(b"\xff" * 64)
    with pytest.raises(OSError, match="checksum mismatch"):
        probe_data_path(bad, m, workers=2, seconds=0.2, seed=0)


def device_copy_store(store):
    """(path, manifest, record bytes, 24 of its records' keys) of a tiny store, for the
    device copy's tests; skipped where there is no CUDA device copy."""
    from strata_mlx.format.store import load_manifest
    from strata_mlx.stream import reader as rd

    if not rd.uses_device_copy():
        pytest.skip(f"no CUDA device copy here: {rd.device_copy_error()}")
    path = Path(store("qwen3_moe"))
    m = load_manifest(path)
    keys = [(layer, e) for layer in m.moe_layers for e in range(m.num_experts)][:24]
    return path, m, m.layout.record_bytes, keys


@pytest.mark.gpu
@pytest.mark.parametrize("copy_behind", [False, True], ids=["wait", "behind"])
@pytest.mark.parametrize("device_memory", [False, True], ids=["managed", "device"])
def test_device_copy_lands_verified_records_in_device_memory(store, device_memory, copy_behind):
    """CUDA: records read through pinned bounce buffers and the copy engine into an arena kept
    on the device (managed memory) or in plain device memory equal the file's bytes, as MLX
    reads them there; the device buffer stayed where the reads went. With copy_behind, the
    read-ahead half's copies are waited for after each worker's next read, the urgent half's
    at once: every record lands and completes all the same."""
    import mlx.core as mx

    from strata_mlx.format.store import EXPERTS
    from strata_mlx.stream.arena import Arena

    path, m, rb, keys = device_copy_store(store)
    arena = Arena(len(keys), rb, on_device=True, device_memory=device_memory)
    assert arena.device_memory == device_memory
    mx.eval(arena.rows.astype(mx.uint32).sum())  # the device has touched every slot first
    reader = Reader(4, bounce=True, overlap=True, device_copy=True, copy_behind=copy_behind)
    with reader as r:
        f = r.open(path / EXPERTS, checksum=m.checksum)
        reqs = [(i, f, m.record(*k)[0], rb, arena.address(i), m.record(*k)[1])
                for i, k in enumerate(keys)]  # fmt: skip
        half = len(reqs) // 2
        r.submit(reqs[:half])
        r.submit(reqs[half:], True)
        done = r.wait(list(range(len(keys))))
        assert [err for _, err, _ in done] == [0] * len(keys)
        assert r.stats()["device_copies"] == len(keys)
    raw = (path / EXPERTS).read_bytes()
    want = np.stack([np.frombuffer(raw, np.uint8, rb, m.record(*k)[0]) for k in keys])
    got = np.array(arena.rows + 0)  # a copy made on the device: the host reads only that
    assert np.array_equal(got, want)
    arena.check_device_address()
    if device_memory:
        with pytest.raises(RuntimeError, match="device memory"):
            arena.view(0)


@pytest.mark.gpu
@pytest.mark.parametrize("by_driver", [True, False], ids=["driver", "worker"])
def test_copied_behind_records_store_their_ready_words_either_way(store, by_driver):
    """CUDA, copy_behind: a read-ahead record's ready word is stored once its copy has landed,
    by the driver's host function (`words_by_driver`, decode's) or by the worker after it
    waited for the copy (prefill's): either way every word ends up its value and the records
    equal the file's bytes."""
    import time

    import mlx.core as mx

    from strata_mlx.format.store import EXPERTS
    from strata_mlx.stream.arena import Arena

    path, m, rb, keys = device_copy_store(store)
    arena = Arena(len(keys), rb, on_device=True, device_memory=True)
    words = np.full(len(keys), -1, dtype=np.int32)
    reader = Reader(4, bounce=True, overlap=True, device_copy=True, copy_behind=True)
    reader.words_by_driver = by_driver
    assert reader.words_by_driver is by_driver
    with reader as r:
        f = r.open(path / EXPERTS, checksum=m.checksum)
        reqs = [(i, f, m.record(*k)[0], rb, arena.address(i), m.record(*k)[1],
                 (words.ctypes.data + 4 * i, 100 + i)) for i, k in enumerate(keys)]  # fmt: skip
        r.submit(reqs)  # read-ahead: every copy behind
        done = r.wait(list(range(len(keys))))
        assert [err for _, err, _ in done] == [0] * len(keys)
        end = time.monotonic() + 2.0  # (the driver's host function may run just after)
        while (words < 0).any() and time.monotonic() < end:
            time.sleep(0.001)
        assert r.stats()["words_by_driver"] == (len(keys) if by_driver else 0)
    assert words.tolist() == [100 + i for i in range(len(keys))]
    raw = (path / EXPERTS).read_bytes()
    want = np.stack([np.frombuffer(raw, np.uint8, rb, m.record(*k)[0]) for k in keys])
    assert np.array_equal(np.array(arena.rows + 0), want)
    mx.synchronize()


def test_split_reads_go_with_the_device_copy():
    """A split record is verified from its parts' checksums, taken where each part was read,
    so its parts may land in device memory: only a missing CUDA driver refuses the pair."""
    from strata_mlx.stream.reader import device_copy_error

    if device_copy_error() is None:
        Reader(2, split=ALIGNMENT, device_copy=True).close()
    else:
        with pytest.raises(RuntimeError, match="device_copy: "):
            Reader(2, split=ALIGNMENT, device_copy=True)


@pytest.mark.parametrize("name", ["crc32", "crc32c"])
def test_a_checksum_combines_from_its_parts(name):
    rng = np.random.default_rng(4)
    for la, lb in ((0, 9), (9, 0), (1, 1), (4096, 12345), (1 << 20, 4099)):
        a = rng.integers(0, 256, la, dtype=np.uint8).tobytes()
        b = rng.integers(0, 256, lb, dtype=np.uint8).tobytes()
        got = _reader.checksum_combine(name, checksum(name, a), checksum(name, b), lb)
        assert got == checksum(name, a + b), (la, lb)


@pytest.mark.parametrize("name", ["crc32", "crc32c"])
def test_a_checksum_combines_across_parts_of_512_mib_and_more(name):
    """combine(c, 0, n) multiplies c by x^(8n) mod P, so n bytes at once must equal n in
    steps of 256 MiB. x^(2^n) mod P repeats every 32 squarings for crc32 but every 31 for
    crc32c: a table read modulo 32 was wrong for crc32c from 2^29 bytes on."""
    step = 1 << 28
    for n in (1 << 29, 3 << 28, 1 << 33):
        crc = whole = 0x1234_5678
        for _ in range(n // step):
            crc = _reader.checksum_combine(name, crc, 0, step)
        whole = _reader.checksum_combine(name, whole, 0, n)
        assert whole == crc, (name, n)


@pytest.mark.parametrize("bounce", [False, True])
def test_a_split_record_of_uneven_parts_is_verified_from_them(data_file, bounce):
    path, payload = data_file
    n = 2 * RECORD + ALIGNMENT  # two parts of RECORD + ALIGNMENT and RECORD at split=RECORD
    buf, addr = aligned(n)
    for name in ("crc32c", "crc32"):
        want = checksum(name, payload[:n])
        with Reader(workers=4, bounce=bounce, split=RECORD) as r:
            f = r.open(path, direct=False, checksum=name)
            r.submit([(0, f, 0, n, addr, want), (1, f, 0, n, addr, want ^ 1)], urgent=True)
            done = sorted(r.wait([0, 1], timeout=10))
            assert done == [(0, 0, n), (1, CHECKSUM_MISMATCH, n)], name
            assert r.stats()["split"] == 2 and r.stats()["verified"] == 2
        assert buf.tobytes() == payload[:n]


def test_forcing_the_device_copy_without_cuda_is_one_line(monkeypatch):
    from strata_mlx.config import OptionError
    from strata_mlx.stream import reader as rd

    if rd.device_copy_error() is None:
        pytest.skip("this machine can copy by CUDA")
    monkeypatch.setenv("STRATA_MLX_DEVICE_COPY", "1")
    with pytest.raises(OptionError, match="^STRATA_MLX_DEVICE_COPY=1: no CUDA driver"):
        rd.uses_device_copy()
    monkeypatch.setenv("STRATA_MLX_DEVICE_COPY", "0")
    assert rd.uses_device_copy() is False


def test_notify_below_announces_only_while_the_queue_has_room(data_file):
    """notify_fd announces at every completion by default; with notify_below(n) only once
    fewer than n requests are queued, and with notify_below(0) never (completions are still
    collected by poll and wait)."""
    import select

    path, _ = data_file

    def readable(fd, timeout=0.0):  # poll, not select: the whole suite opens fds past 1024
        p = select.poll()
        p.register(fd, select.POLLIN)
        return bool(p.poll(timeout * 1000))

    buf, base = aligned(8 * RECORD)
    with Reader(workers=1, start_paused=True) as r:
        f = r.open(path, direct=False)
        fd = r.notify_fd()
        r.notify_below(0)
        r.submit([(t, f, (t % N_RECORDS) * RECORD, RECORD, base + t * RECORD) for t in range(6)])
        r.notify_below(3)
        assert not readable(fd)  # six queued: no room below three
        r.resume()
        assert readable(fd, 10.0)  # the queue ran below three as the worker took reads
        assert sorted(t for t, _, _ in drain(r, 6)) == list(range(6))
        r.ack()
        r.notify_below(0)
        r.submit([(t, f, (t % N_RECORDS) * RECORD, RECORD, base + t * RECORD) for t in (6, 7)])
        assert sorted(t for t, _, _ in drain(r, 2)) == [6, 7]
        assert not readable(fd)  # never, with 0
        r.notify_below(-1)
        r.submit([(8, f, 0, RECORD, base)])
        assert readable(fd, 10.0)  # every completion again
        drain(r, 1)


@pytest.fixture
def no_drive_limit(monkeypatch):
    """Tests that emulate a drive leave none behind for the rest of the process."""
    from strata_mlx.stream import reader as reader_mod

    monkeypatch.delenv(reader_mod.DRIVE_ENV, raising=False)
    yield reader_mod
    reader_mod.limit_drive(None)


def test_an_emulated_drive_delivers_no_faster_than_its_bandwidth(data_file, no_drive_limit):
    """Reads from the page cache land far faster than 10 MB/s; with the emulated drive's limit
    every byte waits its turn on the one drive, so the reads take at least bytes / bandwidth
    (a lower bound: the workers may wake late, never early), and land intact."""
    path, payload = data_file
    n, gbps = 96, 0.01
    buf, addr = aligned(n * RECORD)
    reads = [(i, i % N_RECORDS) for i in range(n)]

    def run() -> float:
        with Reader(workers=8) as r:
            f = r.open(path, direct=False)
            t = time.perf_counter()
            r.submit([(i, f, rec * RECORD, RECORD, addr + i * RECORD) for i, rec in reads])
            done = drain(r, n)
            elapsed = time.perf_counter() - t
        assert all(c[1:] == (0, RECORD) for c in done)
        for i, rec in reads:
            assert (
                buf[i * RECORD : (i + 1) * RECORD].tobytes()
                == payload[rec * RECORD : (rec + 1) * RECORD]
            )
        return elapsed

    no_drive_limit.limit_drive(gbps)
    assert no_drive_limit.drive_limit_gbps() == pytest.approx(gbps)
    assert run() >= n * RECORD / (gbps * 1e9) * (1 - 1e-3)  # 0.157 s of transfers
    no_drive_limit.limit_drive(0)
    assert no_drive_limit.drive_limit_gbps() == 0.0
    with pytest.raises(ValueError, match="limit_drive"):
        no_drive_limit.limit_drive(-1)


def test_the_drive_limit_comes_from_the_environment(data_file, no_drive_limit, monkeypatch):
    from strata_mlx.config import OptionError

    monkeypatch.setenv(no_drive_limit.DRIVE_ENV, "12.5")
    with Reader(workers=1):
        pass
    assert no_drive_limit.drive_limit_gbps() == pytest.approx(12.5)
    for bad in ("fast", "0", "-3", "inf"):
        monkeypatch.setenv(no_drive_limit.DRIVE_ENV, bad)
        with pytest.raises(OptionError, match=f"STRATA_MLX_DRIVE_GBPS='{bad}': expected"):
            Reader(workers=1)


def test_bounce_buffers_made_for_the_longest_request_are_never_made_again(data_dir):
    """A split request's part, then a whole record longer than the first buffer: without the
    record size a worker's buffer is let go of and made again for it (on CUDA letting go of a
    pinned buffer waits for the device to go idle), with it never; the bytes land either way."""
    big = 5 << 20  # longer than the 2 MB a first, part-sized buffer is rounded up to
    payload = np.random.default_rng(3).integers(0, 256, big, dtype=np.uint8).tobytes()
    path = data_dir / "big.bin"
    path.write_bytes(payload)
    for record_bytes, regrown in ((0, 1), (big, 0)):
        buf, addr = aligned(big)
        # (one thread: the whole record meets the buffer the part was read into)
        with Reader(workers=1, bounce=True, overlap=False, record_bytes=record_bytes) as r:
            f = r.open(path)
            r.submit([(1, f, 0, RECORD, addr)])  # (a part's length)
            assert r.wait([1], timeout=10) == [(1, 0, RECORD)]
            r.submit([(2, f, 0, big, addr)])
            assert r.wait([2], timeout=10) == [(2, 0, big)]
            assert r.stats()["bounce_regrown"] == regrown, record_bytes
        assert buf.tobytes() == payload
    with pytest.raises(ValueError, match="record_bytes"):
        Reader(workers=1, record_bytes=-1)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux's /proc")
def test_reader_threads_are_named(overlap):
    """Each worker thread carries the reader's name (top -H, a profiler, /proc tell them
    apart): as many as the reader runs, two a worker with the overlap."""

    def named() -> int:
        count = 0
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    count += f.read().strip() == "strata-reader"
            except OSError:  # (a thread that ended meanwhile)
                pass
        return count

    before, want = named(), 6 if overlap else 3
    with Reader(workers=3):
        deadline = time.monotonic() + 5  # (a thread names itself as it starts)
        while named() - before < want and time.monotonic() < deadline:
            time.sleep(0.01)
        assert named() - before == want
    assert named() == before


def test_a_readers_copy_hold_is_a_whole_number_of_microseconds_settable_at_any_time():
    """copy_held_us: 0 (never) by default, any whole number of microseconds up to a minute,
    a one-line error otherwise; stats count the copies it gave up on (none without a device
    copy)."""
    with Reader(2) as r:
        assert r.copy_held_us == 0 and r.stats()["copies_held"] == 0
        r.copy_held_us = 50_000
        assert r.copy_held_us == 50_000
        for bad, err in ((-1, ValueError), (60_000_001, ValueError), ("5", TypeError)):
            with pytest.raises(err, match="copy_held_us"):
                r._r.copy_held_us = bad
        assert r.copy_held_us == 50_000
        r.copy_held_us = 0
        assert r.copy_held_us == 0
