"""The reader's device-copy path on this CPU, through a stand-in CUDA driver: a small C library
built here as libcuda.so.1 (the reader loads the driver at run time by that name), whose copies
are memcpy run when their stream is waited for (reading their source then, as a copy engine
would) and whose waits may be held for a set time (STUB_HOLD_MS), standing in for a copy held
behind a decode gate. What it checks is the reader's own logic around the driver: how
many copy streams a process makes, that a worker pins its buffers as it starts, and that a
held copy's ready word is given up (READY_FAILED) once held past `copy_held_us`, then stored
once the copy lands. Each case runs in a process of its own (the driver is loaded once a
process, by the name the library path finds first)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

STUB = r"""
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
static atomic_int made, pinned, unpinned, copies, hold_next;

static void hold(int ms) {
    struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}
void stub_hold_next(int ms) { hold_next = ms; } /* the next wait for a copy: held ms */

CUresult cuInit(unsigned f) { (void)f; return 0; }
CUresult cuDeviceGet(int *d, int o) { *d = o; return 0; }
CUresult cuDevicePrimaryCtxRetain(void **c, int d) { (void)d; *c = (void *)1; return 0; }
CUresult cuCtxSetCurrent(void *c) { (void)c; return 0; }
CUresult cuStreamCreate(void **s, unsigned f) { (void)f; *s = (void *)(long)++made; return 0; }
CUresult cuStreamDestroy_v2(void *s) { (void)s; return 0; }
/* A stream's copies run when it is waited for (as a copy engine's would, reading their
 * source then): a reader that reuses a buffer before waiting for its copy lands wrong bytes. */
typedef struct { void *dst; const void *src; size_t n; } Copy;
static Copy pending[256][64];
static int n_pending[256];
static pthread_mutex_t streams_mu = PTHREAD_MUTEX_INITIALIZER;
static void flush(void *s) {
    long i = (long)s & 255;
    pthread_mutex_lock(&streams_mu);
    for (int k = 0; k < n_pending[i]; k++) memcpy(pending[i][k].dst, pending[i][k].src, pending[i][k].n);
    n_pending[i] = 0;
    pthread_mutex_unlock(&streams_mu);
}
CUresult cuStreamQuery(void *s) { flush(s); return 0; }
CUresult cuStreamSynchronize(void *s) {
    const char *ms = getenv("STUB_HOLD_MS");
    int once = atomic_exchange(&hold_next, 0);
    if (once > 0)
        hold(once);
    else if (ms && atoi(ms) > 0)
        hold(atoi(ms));
    flush(s);
    return 0;
}
CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned f) {
    (void)p; (void)n; (void)f; pinned++; return 0;
}
CUresult cuMemHostUnregister(void *p) { (void)p; unpinned++; return 0; }
CUresult cuMemcpyHtoDAsync_v2(unsigned long long dst, const void *src, size_t n, void *s) {
    long i = (long)s & 255;
    pthread_mutex_lock(&streams_mu);
    int full = n_pending[i] == 64;
    if (!full) pending[i][n_pending[i]++] = (Copy){(void *)dst, src, n};
    pthread_mutex_unlock(&streams_mu);
    if (full) return 2; /* (CUDA_ERROR_OUT_OF_MEMORY: never in these tests) */
    copies++;
    return 0;
}
CUresult cuGetErrorString(CUresult e, const char **s) { (void)e; *s = "stub"; return 0; }
/* (the copies queued before it land first) */
CUresult cuLaunchHostFunc(void *s, void (*fn)(void *), void *arg) { flush(s); fn(arg); return 0; }
int stub_count(int which) {
    return which == 0 ? made : which == 1 ? pinned : which == 2 ? unpinned : copies;
}
"""

CASE = r"""
import ctypes, json, sys, time
import numpy as np
from strata_mlx.stream.reader import READY_FAILED, Reader

stub = ctypes.CDLL(sys.argv[1])
case, path, rb = sys.argv[2], sys.argv[3], 1 << 16
count = lambda k: stub.stub_count(k)
out = {}
def started(r):
    # (each thread takes its stream and pins its buffer as it starts: until the counts settle)
    last, still = None, time.monotonic()
    end = still + 10
    while time.monotonic() - still < 0.3 and time.monotonic() < end:
        now = (count(0), count(1))
        if now != last:
            last, still = now, time.monotonic()
        time.sleep(0.01)
    return r
def landing(n):
    # n ready words (-1: pending) and n record-sized slots from a page-aligned address (their
    # buffer returned too: kept alive with them)
    dest = np.zeros(n * rb + 4096, dtype=np.uint8)
    return np.full(n, -1, dtype=np.int32), dest, (dest.ctypes.data + 4095) // 4096 * 4096
if case == "streams":
    a = started(Reader(8, bounce=True, overlap=True, device_copy=True, record_bytes=rb))
    out["one"] = count(0)
    b = started(Reader(8, bounce=True, overlap=True, device_copy=True, record_bytes=rb))
    out["two"] = count(0)
    a.close(); b.close()
    c = started(Reader(8, bounce=True, overlap=True, device_copy=True, record_bytes=rb))
    out["after"] = count(0)
    c.close()
elif case == "pins":
    r = started(Reader(4, bounce=True, device_copy=True, record_bytes=rb))
    out["pinned_before_any_read"] = count(1)
    r.close()
    out["unpinned_at_close"] = count(2)
elif case.startswith("queued:"):  # four reads on two threads, each copy held STUB_HOLD_MS
    held_us = int(case.split(":")[1])
    words, dest, at = landing(4)
    with Reader(1, bounce=True, overlap=True, device_copy=True, record_bytes=rb) as r:
        r.copy_held_us = held_us
        f = r.open(path, direct=False)
        t0 = time.monotonic()
        r.submit([(i, f, 0, rb, at + i * rb, None, (words.ctypes.data + 4 * i, 7))
                  for i in range(4)], True)
        none_pending = None
        while time.monotonic() - t0 < 10.0 and not (words == 7).all():
            if none_pending is None and (words != -1).all():
                none_pending = round((time.monotonic() - t0) * 1000)
            time.sleep(0.001)
        done = r.wait(list(range(4)))
        s = r.stats()
        out.update(none_pending_ms=none_pending, errs=[d[1] for d in done],
                   held=s["copies_held"], given_up=s["words_given_up"],
                   landed_ms=round((time.monotonic() - t0) * 1000), words=words.tolist())
elif case.startswith("slow:"):  # read-ahead, one thread, 120 ms a read, no copy held
    from strata_mlx.stream.reader import limit_drive

    held_us = int(case.split(":")[1])
    words, dest, at = landing(5)
    limit_drive(rb / 0.12 / 1e9)
    with Reader(1, bounce=True, device_copy=True, copy_behind=True, record_bytes=rb) as r:
        r.words_by_driver = True
        r.copy_held_us = held_us
        f = r.open(path, direct=False)
        r.submit([(i, f, 0, rb, at + i * rb, None, (words.ctypes.data + 4 * i, 7))
                  for i in range(5)], False)
        seen = set()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10.0 and not (words == 7).all():
            seen.update(int(w) for w in words)
            time.sleep(0.002)
        done = r.wait(list(range(5)))
        s = r.stats()
        out.update(seen=sorted(seen), errs=[d[1] for d in done], held=s["copies_held"],
                   given_up=s["words_given_up"], words=words.tolist())
elif case.startswith("verify:"):  # checksums taken before the copy or while it runs
    from strata_mlx import _reader

    data = np.fromfile(path, np.uint8, rb)
    good = _reader.checksum("crc32c", data.tobytes())
    words, dest, at = landing(4)
    slot = lambda i: np.ctypeslib.as_array((ctypes.c_uint8 * rb).from_address(at + i * rb))
    req = lambda t, f, crc: (t, f, 0, rb, at + t * rb, crc, (words.ctypes.data + 4 * t, 7))
    done, split = [], 0
    # records split into parts by idle threads (verified part by part), then whole ones
    for tags, parts in (((0, 1), rb // 4), ((2, 3), 0)):
        with Reader(8, bounce=True, device_copy=True, split=parts, record_bytes=rb) as r:
            r.verify_in_copy = case.endswith(":1")
            f = r.open(path, direct=False, checksum="crc32c")
            r.submit([req(tags[0], f, good), req(tags[1], f, good ^ 1)], True)
            done += r.wait(list(tags), timeout=10)
            split += r.stats()["split"]
    out.update(errs=[d[1] for d in sorted(done)], words=words.tolist(), split=split,
               good_bytes=[bool((slot(i) == data).all()) for i in (0, 2)],
               bad_copied=bool((slot(3) == data).all()))
else:  # "held": one read, its copy held STUB_HOLD_MS; the word watched every ms
    held_us = int(case.split(":")[1])
    word, dest, at = landing(1)
    stop = np.zeros(1, dtype=np.int32)  # (the gate table's stop word)
    with Reader(1, bounce=True, device_copy=True, record_bytes=rb) as r:
        r.copy_held_us = held_us
        r.native.stop_word = stop.ctypes.data
        f = r.open(path, direct=False)
        t0 = time.monotonic()
        r.submit([(1, f, 0, rb, at, None, (word.ctypes.data, 7))], True)
        seen, stop_ms = [], None
        while time.monotonic() - t0 < 5.0:
            w = int(word[0])
            if not seen or seen[-1][0] != w:
                seen.append((w, round((time.monotonic() - t0) * 1000)))
            if stop_ms is None and stop[0]:
                stop_ms = round((time.monotonic() - t0) * 1000)
            if w == 7:
                break
            time.sleep(0.001)
        (done,) = r.wait([1])
        out.update(seen=seen, err=done[1], held=r.stats()["copies_held"], failed=READY_FAILED,
                   stop_ms=stop_ms, stopped=r.stats()["gates_stopped"], stop=int(stop[0]))
        r.native.stop_word = 0
    data = np.fromfile(path, np.uint8, rb)
    out["bytes_ok"] = bool((np.ctypeslib.as_array((ctypes.c_uint8 * rb).from_address(at)) == data).all())
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def fake_driver_lib(tmp_path_factory):
    """The stand-in driver, built: its path (a folder of its own, named libcuda.so.1)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in driver")
    d = tmp_path_factory.mktemp("fake_cuda")
    (d / "stub.c").write_text(STUB)
    lib = d / "libcuda.so.1"
    subprocess.run(
        [cc, "-shared", "-fPIC", "-O1", "-pthread", "-o", str(lib), str(d / "stub.c")], check=True
    )
    return lib


@pytest.fixture(scope="module")
def fake_driver(fake_driver_lib):
    lib, d = fake_driver_lib, fake_driver_lib.parent
    record = d / "record.bin"
    record.write_bytes(os.urandom(1 << 16))

    def run(case: str, **env) -> dict:
        e = {**os.environ, "LD_LIBRARY_PATH": str(d), **env}
        p = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(CASE), str(lib), case, str(record)],
            env=e, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    return run


@pytest.mark.skipif(sys.platform != "linux", reason="the stand-in driver is a Linux library")
def test_reader_threads_reuse_the_copy_streams_of_threads_gone(fake_driver):
    """16 reader threads make 16 streams, a second reader alive beside the first 16 more (no
    cap tied to CUDA's hardware queues: a copy on a queue shared with MLX's did not wait
    behind its gate), a reader made after both closed makes none (it takes theirs)."""
    for queues in ("32", "8"):
        assert fake_driver("streams", CUDA_DEVICE_MAX_CONNECTIONS=queues) == {
            "one": 16, "two": 32, "after": 32,
        }  # fmt: skip


@pytest.mark.skipif(sys.platform != "linux", reason="the stand-in driver is a Linux library")
def test_a_device_copying_worker_pins_its_buffer_as_it_starts(fake_driver):
    """Each worker pins its record-sized buffer before any read (no driver call of its own
    for it inside decode, beside a spinning gate), and lets go of it at close."""
    out = fake_driver("pins")
    assert out == {"pinned_before_any_read": 4, "unpinned_at_close": 4}


@pytest.mark.skipif(sys.platform != "linux", reason="the stand-in driver is a Linux library")
def test_a_copy_held_past_copy_held_us_gives_its_word_up_then_lands(fake_driver):
    """A copy held 1.5 s: with copy_held_us 50 ms the watcher turns its pending word into
    READY_FAILED once it has been held that long (a gate waiting on it gives up at once) and
    sets the stop word (every gate gives up: one may wait on a read nothing can submit while
    the copy is held), and the word reads its value once the copy lands; without it the word
    stays pending the whole hold and the stop word 0. The record's bytes arrive either way,
    with no error."""
    given_up = fake_driver("held:50000", STUB_HOLD_MS="1500")
    failed = given_up["failed"]
    values = [w for w, _ in given_up["seen"]]
    assert values == [-1, failed, 7] and given_up["held"] == 1
    at = dict((w, ms) for w, ms in given_up["seen"])
    assert 45 <= at[failed] < 1500 <= at[7]
    assert given_up["err"] == 0 and given_up["bytes_ok"]
    # The stop word, set with it (every gate gives up, whatever word it waits on), once: the
    # decoder clears it
    assert 45 <= given_up["stop_ms"] < 1500 and given_up["stop"] == 1
    assert given_up["stopped"] == 1
    waited = fake_driver("held:0", STUB_HOLD_MS="1500")
    assert waited["stop_ms"] is None and waited["stopped"] == 0
    assert [w for w, _ in waited["seen"]] == [-1, 7] and waited["held"] == 0
    assert dict(waited["seen"])[7] >= 1500 and waited["err"] == 0 and waited["bytes_ok"]


@pytest.mark.skipif(sys.platform != "linux", reason="the stand-in driver is a Linux library")
def test_while_a_copy_is_held_the_reads_queued_behind_it_give_their_words_up(fake_driver):
    """Four reads, two threads, every copy held 1.5 s (a hold ends only once the device is
    idle, and a gate waiting on a read still queued would keep it busy): with copy_held_us
    50 ms, the two held copies' words and the two queued reads' words are all given up
    within a fraction of the hold, and all four land and read their value; without it, the
    queued reads' words stay pending until their own copies, seconds on."""
    given_up = fake_driver("queued:50000", STUB_HOLD_MS="1500")
    assert given_up["held"] == 2 and given_up["given_up"] == 2
    assert given_up["none_pending_ms"] is not None and given_up["none_pending_ms"] < 500
    assert given_up["words"] == [7] * 4 and given_up["errs"] == [0] * 4
    waited = fake_driver("queued:0", STUB_HOLD_MS="1500")
    assert waited["held"] == 0 and waited["given_up"] == 0
    assert waited["none_pending_ms"] is None or waited["none_pending_ms"] >= 1500
    assert waited["words"] == [7] * 4 and waited["errs"] == [0] * 4


@pytest.mark.skipif(sys.platform != "linux", reason="the stand-in driver is a Linux library")
def test_a_landed_read_ahead_copy_is_not_taken_for_held_behind_a_slow_read(fake_driver):
    """Read-ahead on one thread, its words stored by the driver as each copy lands, each read
    120 ms (an emulated drive) and no copy held: a landed copy stays armed until the worker's
    next read is done, longer than copy_held_us (50 ms), and is still not taken for held: no
    word is ever given up, all five land."""
    out = fake_driver("slow:50000")
    assert out["held"] == 0 and out["given_up"] == 0
    assert -3 not in out["seen"]
    assert out["words"] == [7] * 5 and out["errs"] == [0] * 5


@pytest.mark.skipif(sys.platform != "linux", reason="the stand-in driver is a Linux library")
def test_a_checksum_taken_while_the_copy_runs_fails_a_wrong_record_all_the_same(fake_driver):
    """verify_in_copy: urgent records, split into parts and whole, verified while their
    device copy runs land exactly; a wrong checksum still fails its read and its ready word,
    though a whole record's bytes now reach the slot (verified before the copy they never
    do; a split record's parts are copied as they come either way)."""
    from strata_mlx.stream.reader import CHECKSUM_MISMATCH, READY_FAILED

    for on in (True, False):
        out = fake_driver(f"verify:{int(on)}")
        assert out["errs"] == [0, CHECKSUM_MISMATCH] * 2 and out["split"] == 2
        assert out["words"] == [7, READY_FAILED] * 2 and out["good_bytes"] == [True, True]
        assert out["bad_copied"] == on


@pytest.mark.skipif(sys.platform != "linux", reason="the stand-in driver is a Linux library")
@pytest.mark.parametrize("read_ahead", ["demand", "lookahead"])
def test_gated_decode_with_a_held_copy_gives_its_gate_up_and_stays_exact(
    fake_driver_lib, read_ahead
):
    """Gated decode through the device copy (the stand-in driver's: read-ahead's copies left
    running behind the next read, their words stored by its host functions) and the emulated
    device gate, one copy held 1.5 s mid-decode: with decode_copy_held_ms a gate waiting on it
    gives up (the watcher), the token is recomputed, and the tokens equal the per-layer
    handshake's (tests/runtime/test_gate.py's `..._under_the_stand_in_driver`, run in a
    process of its own with the driver on its library path)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    test = (
        "tests/runtime/test_gate.py::test_a_held_copy_under_the_stand_in_driver_is_recomputed"
        f"[{read_ahead}]"
    )
    env = {**os.environ, "LD_LIBRARY_PATH": str(fake_driver_lib.parent),
           "STRATA_MLX_FAKE_DRIVER": str(fake_driver_lib)}  # fmt: skip
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert p.returncode == 0 and "1 passed" in p.stdout, (p.stdout + p.stderr)[-3000:]
