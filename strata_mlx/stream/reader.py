"""Native SSD reader: worker pthreads pread expert records straight into arena memory.

On MLX's CPU backend, Python threads that read files lose most of their bandwidth while the
main thread sits in ``mx.eval`` (they fight it for the GIL). So the read loop lives in the C
extension ``strata_mlx._reader``: its worker threads take requests off two queues and call
``pread`` without ever holding the GIL. Python decides what to read, submits batches, and
collects completions with :meth:`Reader.wait`, which releases the GIL while it blocks.

Callers pass destination *addresses*, not buffers: a request writes ``length`` bytes at the raw
address ``dest_address`` (a Python int, e.g. ``arr.ctypes.data + offset`` of the arena's numpy
view). The caller must keep that memory alive and leave it alone until the request's
completion has been collected, it has been cancelled, or :meth:`Reader.close` has returned.
Nothing checks that the address is valid: a wrong one crashes the process.

Files opened direct (``O_DIRECT`` on Linux, ``F_NOCACHE`` on macOS) need ``offset``,
``length`` and ``dest_address`` to be multiples of :data:`ALIGNMENT`; :meth:`Reader.submit`
raises ``ValueError`` otherwise. Where the file system refuses direct I/O the file is opened
buffered instead and :meth:`Reader.is_direct` says so.

Integrity: a file opened with ``checksum="crc32c"`` (or ``"crc32"``, zlib's) takes requests
with a sixth element, the record's expected checksum; the worker thread that read the bytes
checks them before it reports the completion, still without the GIL, so verification costs
no Python time and runs on as many cores as there are reads in flight. crc32c runs on the
CPU's instruction (SSE4.2, ARMv8 CRC: 16-19 GB/s a core on the dev machine's EPYC, 10-16 GB/s
streaming from memory), crc32 on ARMv8 CRC or x86 carry-less multiplies (PCLMULQDQ: ~8 GB/s
a core); tables (~1.6 GB/s) only on a CPU with neither. :func:`checksum` computes either in
Python, for writers and tests.

Completions are ``(tag, error, bytes_read)`` tuples: ``error`` is 0, a positive ``errno`` from
``pread``, :data:`SHORT_READ` when the file ended before ``length`` bytes (a truncated
store), with ``bytes_read`` saying how far it got, or :data:`CHECKSUM_MISMATCH` when all the
bytes were read but their checksum is not the one expected (the bytes are left in place).

Tags are the caller's ints and must be unique among requests not yet collected (unchecked).

An emulated drive: ``STRATA_MLX_DRIVE_GBPS=12`` (or :func:`limit_drive`) makes every reader of
the process share one drive of that bandwidth (the probes' readers too, so the floors bench
prints are the emulated drive's). A store on a tmpfs then stands in for a laptop's SSD of
that speed: the real read lands in memory as fast as the machine copies it, and its worker
waits until the emulated drive would have delivered it (see reader.c, ``drive_hold``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING

from .. import _reader

# the checksums the workers verify, and their Python form (re-exported: the reader is where
# a caller of the native extension looks for them)
from ..format.checksums import CHECKSUMS as CHECKSUMS
from ..format.checksums import checksum as checksum

if TYPE_CHECKING:
    from typing_extensions import Self

DRIVE_ENV = "STRATA_MLX_DRIVE_GBPS"


def limit_drive(gb_per_s: float | None) -> None:
    """Every reader of this process reads from one emulated drive of `gb_per_s` (1e9 bytes a
    second); None or 0 lifts the limit. Applies to reads that start from now on."""
    if gb_per_s is not None and not (0 <= gb_per_s < float("inf")):
        raise ValueError(f"limit_drive: {gb_per_s!r} GB/s must be >= 0 and finite")
    _reader.limit_drive(float(gb_per_s or 0) * 1e9)


def drive_limit_gbps() -> float:
    """The emulated drive's GB/s (limit_drive, STRATA_MLX_DRIVE_GBPS); 0.0 without one."""
    return _reader.drive_limit() / 1e9


def drive_note() -> str:
    """ "an emulated drive of B GB/s (STRATA_MLX_DRIVE_GBPS)" while one is in force, else "":
    what bench, plan and probe-ssd say beside figures read through it."""
    drive = drive_limit_gbps()
    return f"an emulated drive of {drive:g} GB/s ({DRIVE_ENV})" if drive else ""


def drive_from_env() -> float:
    """STRATA_MLX_DRIVE_GBPS, applied where it differs from the limit in force (a reader made
    with it set shares the drive's queue with the readers before it); the limit in force."""
    text = os.environ.get(DRIVE_ENV, "").strip()
    if not text:
        return drive_limit_gbps()
    try:
        gbps = float(text)
    except ValueError:
        gbps = -1.0
    if not (0 < gbps < float("inf")):
        from ..config import OptionError

        raise OptionError(f"{DRIVE_ENV}={text!r}: expected a drive's bandwidth in GB/s, > 0")
    if abs(drive_limit_gbps() - gbps) > 1e-9 * gbps:
        limit_drive(gbps)
    return gbps


ALIGNMENT: int = _reader.ALIGNMENT
"""Direct I/O granularity in bytes (4096)."""

SHORT_READ: int = _reader.SHORT_READ
"""Completion error code (-1): end of file before the requested length."""

CHECKSUM_MISMATCH: int = _reader.CHECKSUM_MISMATCH
"""Completion error code (-2): the bytes read do not have the expected checksum."""

DEVICE_COPY_FAILED: int = _reader.DEVICE_COPY_FAILED
"""Completion error code (-3): the copy engine could not move the record into place."""

READY_FAILED: int = _reader.READY_FAILED
"""A request's ready word once its read failed (an error, a short read, a checksum mismatch, a
failed device copy): a device waiting for the word gives up at once."""


Request = (
    tuple[int, int, int, int, int]
    | tuple[int, int, int, int, int, int | None]
    | tuple[int, int, int, int, int, int | None, tuple[int, int] | None]
)
"""``(tag, file_index, offset, length, dest_address[, expected_checksum[, ready]])``; `ready`:
``(address, value)`` of an int32 word the worker stores ``value`` into (release order) once
the record is in place and verified, before its completion is reported; -1 as the request is
submitted; :data:`READY_FAILED` for a failed read; nothing more for one cancelled (the decode
gate's table, strata_mlx.stream.gate)."""

Completion = tuple[int, int, int]
"""``(tag, error, bytes_read)``; error is 0, an errno, SHORT_READ or CHECKSUM_MISMATCH."""


def error_message(code: int) -> str:
    """Human-readable text for a completion's error code."""
    if code == 0:
        return "ok"
    if code == SHORT_READ:
        return "end of file before the requested length (truncated file?)"
    if code == CHECKSUM_MISMATCH:
        return "checksum mismatch (corrupt data)"
    if code == DEVICE_COPY_FAILED:
        return "the CUDA copy into device memory failed"
    return os.strerror(code)


def checksum_implementation(name: str) -> str:
    """How this CPU computes ``name``: "sse4.2", "pclmul", "armv8-crc" or "table"."""
    return _reader.checksum_impl(name)


class Reader:
    """A pool of native reader threads with an urgent and a read-ahead queue.

    Workers always take urgent requests first; read-ahead requests run only while no urgent
    one is queued. Usable as a context manager; :meth:`close` also runs on garbage collection.

    Args:
        workers: number of reader threads (concurrent preads in flight).
        start_paused: start with the workers paused (nothing is read until :meth:`resume`);
            lets tests and callers queue work deterministically.
        bounce: each worker reads into a buffer of its own, verifies it there, and copies
            it into the destination (see :func:`needs_bounce`).
        split: split reads (0: never). While workers would sit idle (fewer requests queued
            and in flight than workers, as in decode, where a layer misses a few records),
            each request of a batch is read as up to ``idle workers / batch size`` parts of
            at least ``split`` bytes (a multiple of :data:`ALIGNMENT`), side by side; it still
            completes once, when its last part has landed; each part's checksum is taken by
            the worker that read it, where it read it, and the worker that finishes the last
            part verifies the request from them (combined in order), so parts may land in
            device memory. A split request is cancelled only while none of its parts has
            started.
        overlap: run twice as many threads and let each go of its read slot as soon as its
            pread returns, before the bounce copy and the checksum: ``workers`` preads stay
            in flight while other threads finish theirs (without it, a worker's copy and
            checksum are time its slot on the drive stands idle).
        device_copy: (CUDA) the bounce buffers are pinned and each record reaches its
            destination, device-visible memory, by the GPU's copy engine on a stream of the
            worker's own, instead of a CPU memcpy into managed memory (which migrates the
            pages to the host, and the next kernel to touch them migrates them back). Implies
            ``bounce``. RuntimeError where no CUDA driver is present (see
            :func:`device_copy_error`).
        copy_behind: (with ``device_copy``) a worker queues a read-ahead record's copy and
            reads its next record while the copy runs, in a second pinned buffer; the record
            completes once that next read has landed (or the worker finds nothing to read).
            Urgent records are copied and completed at once, as without it.
        record_bytes: (with ``bounce``) the longest request it will be given (0: not known).
            A worker's buffers are made at least that large (with ``device_copy``, and
            pinned, as the worker starts; else at their first use), so that a longer read
            after a shorter one (a whole record after a split request's part) never has a
            buffer let go of and made again: on CUDA letting go of a pinned buffer waits for
            the device to go idle, behind a decode gate that may be waiting for that very
            read (``stats()["bounce_regrown"]`` counts them).
        spin_us: a thread with nothing to read polls for new work this long (us) before it
            sleeps (0: it sleeps at once). A sleeping thread's wake-up takes a trip through
            the OS scheduler (38-107 us on H100 machines) before a decode miss's read starts;
            a polling one starts it at once. Costs a CPU core a polling thread.
        spinners: how many threads may poll at once (-1: any). ``stats()["spin_takes"]``
            counts the reads taken by a thread that was polling.
    """

    def __init__(
        self,
        workers: int = 8,
        start_paused: bool = False,
        bounce: bool = False,
        split: int = 0,
        overlap: bool = False,
        device_copy: bool = False,
        copy_behind: bool = False,
        record_bytes: int = 0,
        spin_us: int = 0,
        spinners: int = -1,
    ) -> None:
        drive_from_env()
        self._r = _reader.Reader(
            workers,
            start_paused,
            bounce,
            split,
            overlap,
            device_copy,
            copy_behind,
            record_bytes,
            spin_us,
            spinners,
        )

    @property
    def workers(self) -> int:
        """Number of worker threads."""
        return self._r.workers

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has been called."""
        return self._r.closed

    @property
    def words_by_driver(self) -> bool:
        """(copy_behind) Who stores a read-ahead record's ready word (:data:`Request`): True
        (the default), the CUDA driver's host-function thread as the record's copy lands, so
        a device waiting for the word sees it at once; False, the worker, once it has waited
        for the copy (after its next read, or before it sleeps), with no host function
        queued behind the copy on the worker's stream, whose next copy would wait for it.
        Settable at any time; it applies to records whose copy is queued after it
        (``stats()["words_by_driver"]`` counts the words left to the driver)."""
        return self._r.words_by_driver

    @words_by_driver.setter
    def words_by_driver(self, on: bool) -> None:
        self._r.words_by_driver = bool(on)

    @property
    def verify_in_copy(self) -> bool:
        """(device_copy, bounce) A record copied by the device and waited for at once (a
        miss, a split request's part): its checksum taken while the copy engine reads the same
        buffer instead of before the copy starts, so that the two overlap. A record whose
        checksum does not match then reaches its slot; its read fails all the same (its ready
        word READY_FAILED, CHECKSUM_MISMATCH). False (the default): a whole record verified
        before its copy, a mismatched one never copied (a split request's parts are copied
        as they come either way). Settable at any time."""
        return self._r.verify_in_copy

    @verify_in_copy.setter
    def verify_in_copy(self, on: bool) -> None:
        self._r.verify_in_copy = bool(on)

    @property
    def spread(self) -> bool:
        """Split reads spread over every idle thread: each request of an urgent batch no
        larger than the idle threads (a decode layer's misses) in up to `idle` parts, not
        `idle / batch size` (the batch lands when its last part does, so its bytes over every
        thread set its time), and a thread woken for each part (not one that wakes the next
        as it takes its part; ``stats()["spread_wakes"]`` counts them). Off by default.
        Settable."""
        return self._r.spread

    @spread.setter
    def spread(self, on: bool) -> None:
        self._r.spread = bool(on)

    @property
    def copy_held_us(self) -> int:
        """(device_copy) A device copy whose ready word a gate may wait on, still not done
        this many microseconds after it was queued, is held behind the device and so behind
        that very gate (another thread freeing device or pinned memory while the gate spins
        waits in the driver for the device to go idle, and holds copies queued meanwhile): a
        watcher thread, looking every quarter of this, makes its word, still pending,
        :data:`READY_FAILED`, and while any copy is held, the words of the reads still queued
        too; the gates give up at once instead of after their timeout (their token is
        recomputed), the device goes idle, the copies land, their words then stored as ever.
        0 (the default): never. Settable at any time. The native reader's ``stop_word`` (the
        gate table's) is set to 1 too: every gate gives up, whatever it waits on."""
        return self._r.copy_held_us

    @copy_held_us.setter
    def copy_held_us(self, us: int) -> None:
        self._r.copy_held_us = int(us)

    def open(
        self, path: str | os.PathLike, direct: bool = True, checksum: str | None = None
    ) -> int:
        """Open ``path`` read-only and return its file index for requests.

        With ``direct=True`` the page cache is bypassed (Linux ``O_DIRECT``, macOS
        ``F_NOCACHE``). If the file system rejects ``O_DIRECT`` (``EINVAL``) the file is opened
        buffered instead; check :meth:`is_direct`. With ``checksum`` (one of
        :data:`CHECKSUMS`) requests may carry an expected checksum that the workers verify.
        Files stay open until :meth:`close`. Raises OSError if the file cannot be opened.
        """
        return self._r.open(path, direct, checksum)

    def is_direct(self, file_index: int) -> bool:
        """Whether the file was opened with direct I/O (and so needs aligned requests)."""
        return self._r.is_direct(file_index)

    def submit(self, requests: Sequence[Request], urgent: bool = False) -> list[int]:
        """Queue a batch of ``(tag, file_index, offset, length, dest_address)`` requests,
        each optionally with a sixth element: the expected checksum of the ``length`` bytes
        (None: not checked), for a file opened with ``checksum=``; and a seventh: its ready
        word (:data:`Request`), or None.

        The whole batch is validated before any of it is queued, then queued under one lock,
        in order, at the back of the urgent or the read-ahead queue. Raises ValueError for an
        unknown file index, negative offset/length, a NULL address, an expected checksum for a
        file opened without one (or not in 32 bits), a ready word's address NULL or not 4-byte
        aligned, or (direct files) an offset, length or address that is not a multiple of
        :data:`ALIGNMENT`.

        Returns the tags of the requests not queued: with quick misses armed
        (:mod:`strata_mlx.stream.quick`), those whose ready word's record is being read
        already.
        """
        return self._r.submit(requests, urgent)

    @property
    def native(self):
        """The extension's reader (its quick misses: :mod:`strata_mlx.stream.quick`)."""
        return self._r

    def cancel(self, tags: Iterable[int]) -> list[int]:
        """Drop queued read-ahead requests with these tags; returns the tags dropped.

        Requests already being read, urgent ones and completed ones are not touched. A
        cancelled tag never completes (waiting for it raises KeyError).
        """
        return self._r.cancel(list(tags))

    def promote(self, tags: Iterable[int]) -> list[int]:
        """Move queued read-ahead requests to the back of the urgent queue, in the order
        given; returns the tags moved (those not in the read-ahead queue are skipped)."""
        return self._r.promote(list(tags))

    def wait(
        self, tags: Iterable[int] | None = None, timeout: float | None = None
    ) -> list[Completion]:
        """Block (GIL released) until every tag in ``tags`` has completed; return and clear
        their completions, in the order of ``tags``.

        With ``tags=None``, block until at least one completion is available and return and
        clear all of them, in completion order (``[]`` at once if nothing is queued, in flight
        or completed). Completions not asked for stay for later :meth:`wait`/:meth:`poll`.

        On ``timeout`` (seconds) return whichever of the asked-for completions are there,
        possibly none: compare lengths to tell. Raises KeyError for a tag that is not queued,
        in flight or completed (never submitted, cancelled, or already collected) instead of
        waiting forever for it, and ValueError if the reader is closed. Ctrl-C interrupts it.
        Waiting does not promote: a read-ahead tag you need now should be :meth:`promote`\\ d.
        """
        return self._r.wait(None if tags is None else list(tags), timeout)

    def poll(self) -> list[Completion]:
        """Return and clear all available completions without blocking."""
        return self._r.poll()

    def notify_fd(self) -> int:
        """The read end of a non-blocking pipe that becomes readable when a completion arrives
        (for an event loop's ``add_reader``; created on first call, closed by :meth:`close`).
        It gets one byte per :meth:`ack`, however many completions follow: call ``ack()``
        before collecting, so a completion landing after the collection wakes it again."""
        return self._r.notify_fd()

    def ack(self) -> None:
        """Re-arm :meth:`notify_fd` and drain it. Must not race :meth:`close`."""
        self._r.ack()

    def notify_below(self, n: int) -> None:
        """Make :meth:`notify_fd` announce only while fewer than ``n`` requests are queued
        (checked as requests start and complete) instead of at every completion (``n`` < 0,
        the default). Completions are collected by :meth:`poll` / :meth:`wait` either way."""
        self._r.notify_below(n)

    def queued(self) -> int:
        """Requests queued (urgent and read-ahead) that no worker has started (a split
        request counts once, until its first part starts)."""
        return self._r.queued()

    def pause(self) -> None:
        """Stop starting new reads (reads in flight finish)."""
        self._r.pause()

    def resume(self) -> None:
        """Start reads again after :meth:`pause` or ``start_paused``."""
        self._r.resume()

    def stats(self) -> dict:
        """Counters: ``bytes_read``, ``requests_done``, ``errors``, ``verified`` (reads whose
        checksum was checked), ``split`` (requests read in parts), ``busy_ns`` and
        ``verify_ns`` (lists, per thread: time spent inside reads, and checking checksums),
        ``preads_max`` (the most preads in flight at once since the last reset: at most
        ``workers``), ``device_copies`` and ``device_copy_ns`` (copies by the copy engine,
        and their time), ``bounce_regrown`` (bounce buffers let go of for a larger one),
        ``words_by_driver`` (ready words left to the driver's host functions),
        ``urgent_reads`` (requests submitted urgent, the misses, that landed or failed:
        their ready word stored either way; once each, however many parts), ``urgent_ns``
        and ``urgent_max_ns`` (their time from submission to landing, in all and the
        longest), ``urgent_queued_ns`` (their time from submission until a thread took
        them, or their first part, up), ``urgent_parts`` (their reads or parts, each by a
        thread) and that time in the pread (with a bounce buffer's first allocation and an
        emulated drive's hold), the checksum and the copy into the destination by the copy
        engine or the CPU (``urgent_pread_ns``, ``urgent_verify_ns``, ``urgent_copy_ns``),
        ``spin_takes`` (reads, or parts, taken by a thread that was polling: ``spin_us``),
        ``copies_held`` (ready words given up for a copy held past ``copy_held_us``),
        ``words_given_up`` (queued reads' words given up meanwhile), ``gates_stopped`` (rises
        of the native reader's ``stop_word`` from 0), ``spread_wakes`` (threads woken, one a
        part, for spread batches: ``spread``), and the current ``queued_urgent``,
        ``queued_ahead``, ``in_flight`` (requests a thread holds), uncollected ``completions``."""
        return self._r.stats()

    def reset_stats(self) -> None:
        """Zero bytes_read, requests_done, errors, verified, split, busy_ns, verify_ns, the
        device copies' counts, bounce_regrown, words_by_driver, the urgent_* ones,
        spin_takes, copies_held, words_given_up and gates_stopped."""
        self._r.reset_stats()

    def close(self) -> None:
        """Stop the workers and close the files. Reads in flight finish first; queued ones
        are dropped. After it returns no thread writes to caller memory. Idempotent."""
        self._r.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def advise_hugepages(address: int, nbytes: int, zeroed: bool = False) -> bool:
    """Ask the OS to back the 2 MB-aligned blocks inside ``[address, address + nbytes)`` with
    huge pages from their next fault on (Linux transparent huge pages, MADV_HUGEPAGE; only
    such blocks can become huge). ``zeroed``: the range is private anonymous memory that holds
    only zeros (a fresh host buffer), so those blocks are given back (MADV_DONTNEED; they read
    as zeros) and return as huge pages. Direct reads into 4 KB pages ran at half the bandwidth
    of reads into huge pages on the dev machine (benchmarks/read_path.py). True if the kernel
    took the advice; False where not (macOS, a range without a whole 2 MB block): a hint,
    never an error."""
    return _reader.advise_hugepages(address, nbytes, zeroed)


def needs_bounce() -> bool:
    """Whether reads must land through a bounce buffer on this machine: on MLX's CUDA backend
    arrays live in managed memory, which migrates between host and device in blocks larger
    than a slot, and a direct read's DMA into such pages while kernels read neighbouring
    slots is not coherent with it (H200, lookahead prefill: records whose checksums failed
    though the file was sound). A copy by the CPU is. Apple silicon's unified memory does
    not migrate; the CPU backend has no device."""
    import mlx.core as mx

    forced = os.environ.get("STRATA_MLX_BOUNCE")  # "0" / "1": measure either way
    if forced in ("0", "1"):
        return forced == "1"
    return mx.default_device() == mx.gpu and not mx.metal.is_available()


def device_copy_error() -> str | None:
    """None where the reader can copy by the CUDA copy engine (a CUDA driver and a device),
    else the reason it cannot."""
    return _reader.device_copy_error()


def uses_device_copy() -> bool:
    """Whether reads on this machine should reach the arena by the CUDA copy engine: MLX's
    default device is a CUDA GPU (managed memory) and a CUDA driver is present.
    STRATA_MLX_DEVICE_COPY=0/1 forces it (1 where CUDA cannot copy: an OptionError saying
    why)."""
    forced = os.environ.get("STRATA_MLX_DEVICE_COPY")
    if forced == "1" and device_copy_error() is not None:
        from ..config import OptionError

        raise OptionError(f"STRATA_MLX_DEVICE_COPY=1: {device_copy_error()}")
    if forced in ("0", "1"):
        return forced == "1"
    return needs_bounce() and device_copy_error() is None


def prefer_device(address: int, nbytes: int) -> None:
    """Keep the managed memory ``[address, address + nbytes)`` on CUDA device 0 and move it
    there now (cudaMemAdvise preferred location + prefetch), so kernels reading it do not
    fault pages in and copies into it land in device memory. RuntimeError without CUDA."""
    _reader.prefer_device(address, nbytes)


def map_host(address: int, nbytes: int) -> int:
    """Page-lock the page-aligned host memory ``[address, address + nbytes)`` and map it into
    CUDA device 0's address space: the device address kernels read it at (the host keeps
    writing it in place). RuntimeError without CUDA."""
    return _reader.map_host(address, nbytes)


def unmap_host(address: int) -> None:
    """Undo `map_host` for the range starting at `address`."""
    _reader.unmap_host(address)


def wait_word(address: int, value: int, timeout_s: float) -> float | None:
    """Until the int32 word at ``address`` holds ``value`` or ``timeout_s`` has passed (None),
    polled outside the GIL (without sleeping for its first 100 us): a word a device stores
    into mapped host memory (stream.gate's routing board). Once seen, the seconds from seeing
    it to holding the GIL again (another thread's hold of it, added to the wait); 0.0 for a
    word already in, the GIL kept throughout."""
    return _reader.wait_word(address, value, timeout_s)


def replace_words(address: int, count: int, old: int, new: int) -> int:
    """Each int32 word of ``[address, address + 4 * count)`` that holds `old` takes `new`, in
    one atomic step a word: a ready word a reader's thread stores meanwhile is never
    overwritten (a numpy masked assignment could, between its compare and its store).
    Returns the number of words replaced."""
    return _reader.replace_words(address, count, old, new)
