"""The expert scheduler: which reads are in flight, where they land, and what to read next.

The handshake (strata_mlx.runtime.experts) says what a layer needs (`claim`), what the next
layer is predicted to need (`read_ahead`) and what would be worth reading after that
(`reserve`); this module turns those into reads on the native reader, keeps the residency
map (expert -> slot, on the host and as the device's per-layer rows: `ResidencyRows`) and
counts what happened.

The books of reads (`ReadBooks`) take in those the reader queued itself (stream.quick).
Two schedulers share that contract:

- `SyncScheduler` ("sync"): completions are collected inside the handshake's own calls, and
  everything reserved is submitted at once. Between two handshakes nothing decides anything.
  The simpler scheduling, from before the loop, kept to measure the loop against.
- `LoopScheduler` ("loop", the default): an asyncio event loop on a thread of its own. The
  reader's completion pipe wakes it (`loop.add_reader`, no polling); it collects completions,
  makes landed records visible to the next layer built, and keeps the drive busy: whenever
  fewer reads are queued than `low_water`, it
  submits the next of the reserve (the experts predicted for the layers after the next),
  each into a slot whose expert is neither pinned, mid-read, predicted, nor of a layer still
  computing. The reserve is replaced at every handshake, so stale guesses never pile up.

One (re-entrant) lock guards all of this state; the loop thread holds it only while it
handles a batch of completions. A handshake waiting for its misses holds it and collects
itself (its urgent reads land without a hop through the loop's thread), topping the queue up
as the loop would (with `loop_top_up` it leaves that to the loop, which the completions it
collected wake once it lets go of the lock). Reads themselves never take the GIL: the
reader's threads pread, verify and report completions in C.

Results never depend on any of this: which slot holds an expert, and when it landed, never
changes what a layer computes (strata_mlx.runtime.experts).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..format.store import EXPERTS, Manifest, StoreError
from .arena import Arena, Key
from .gate import GateTable
from .quick import QuickMisses
from .reader import CHECKSUM_MISMATCH, SHORT_READ, error_message
from .stats import ExpertStats

SCHEDULERS = ("loop", "sync")
# The loop's top-ups (~4 reads a call, ~12 000 calls a prefill chunk, each read's victim kept
# off the reserve's experts) ask the policy for their victims as one batch from this many
# keys: a policy's victim search walks past the kept experts once a batch, not once a key.
TOP_UP_BATCH_FROM = 2
CLOSED = "expert cache is closed"


class ExpertReadError(StoreError):
    """An expert record could not be read or failed its checksum."""


@dataclass(slots=True)
class _Read:
    key: Key
    slot: int
    urgent: bool
    layer_wanted: bool = False  # a handshake asked for it while in flight


class ResidencyRows:
    """The residency map as the handshake and the device read it: per MoE layer, expert ->
    slot, -1 where not resident. The host table is kept current; a layer's device row
    (pipelined decode) is rebuilt only when its residency changed. The scheduler's lock
    guards it."""

    def __init__(self, manifest: Manifest, n_slots: int):
        self.num_experts, self.n_slots = manifest.num_experts, n_slots
        self.pos = {l: manifest.layer_position(l) for l in manifest.moe_layers}
        self.table = np.full((len(self.pos), manifest.num_experts), -1, dtype=np.int32)
        self._rows: dict[int, tuple[np.ndarray, mx.array]] = {}
        self._dirty: set[int] = set(self.pos)
        # Gated decode's table (stream.gate), set by its expert cache: each read announces its
        # landing there (`ready`), each eviction is cleared there before its slot is refilled.
        self.gate: GateTable | None = None

    def ready(self, key: Key, slot: int) -> tuple[int, int] | None:
        """A read request's ready word for `key` into `slot` (None without a gate table)."""
        return None if self.gate is None else self.gate.ready(key, slot)

    def row(self, layer: int) -> np.ndarray:
        """The host row of `layer`: expert -> slot, -1 where absent."""
        return self.table[self.pos[layer]]

    def set(self, key: Key, slot: int) -> None:
        """`key` landed in `slot` (-1: it left the arena, and the gate table, before the read
        that refills its slot is handed to the reader)."""
        self.table[self.pos[key[0]], key[1]] = slot
        self._dirty.add(key[0])
        if slot < 0 and self.gate is not None:
            self.gate.clear(key)

    def device_row(self, layer: int, fake: bool) -> tuple[np.ndarray, mx.array]:
        """(host copy, device row) of `layer`, rebuilt only when it changed; absent experts
        read slot 0. `fake`: every expert counts as resident, its bytes whatever its slot
        holds."""
        if layer in self._dirty:
            if fake:
                row = np.arange(self.num_experts, dtype=np.int32) % self.n_slots
            else:
                row = self.row(layer).copy()
            self._rows[layer] = (row, mx.array(np.maximum(row, 0).astype(np.uint32)))
            self._dirty.discard(layer)
        return self._rows[layer]


def read_error(sched: Scheduler, key: Key, err: int, nbytes: int) -> ExpertReadError:
    """The one-line error of a failed read of `key`: which record, and why."""
    if err == CHECKSUM_MISMATCH:  # verified by the reader's thread that read it
        why = f"checksum mismatch ({sched.manifest.checksum}; corrupt record)"
    elif err == SHORT_READ or not err:
        why = f"short read ({nbytes} of {sched.record_bytes} bytes; truncated store?)"
    else:
        why = f"read failed: {error_message(err)} (errno {err})"
    layer, expert = key
    return ExpertReadError(f"{sched.store / EXPERTS}: layer {layer} expert {expert}: {why}")


class ReadBooks:
    """The scheduler's books of reads: the requests it makes (their victims evicted, their
    slots assigned), those in flight, and their completions made resident. Reads the
    reader queued itself (stream.quick) are taken into them."""

    def __init__(self, store: str | Path, manifest: Manifest, arena: Arena, reader, verify: bool):
        self.store = Path(store)
        self.manifest = manifest
        self.record_bytes = manifest.layout.record_bytes
        self.arena = arena
        self._reader = reader
        self.closed = False
        self.verify = verify
        self.lock = threading.RLock()
        self.stats = ExpertStats()
        # With verify, the reader's threads check each record's checksum as it lands.
        checksum = manifest.checksum if verify else None
        path = str(self.store / EXPERTS)
        self.file_index = reader.open(path, checksum=checksum) if reader is not None else None
        self.reads: dict[int, _Read] = {}  # tag -> read in flight
        self.tag_of: dict[Key, int] = {}
        self._tags = 0
        self.prefetched: set[Key] = set()  # read-ahead landed, not used yet
        self.residency = ResidencyRows(manifest, arena.n_slots)
        self.busy_layers: set[int] = set()  # layers computing on the device (pipelined decode)
        self.early: set[Key] = set()  # misses read before their claim (start_misses)
        # The reader's quick misses (stream.quick), and requests recorded, not sent, that
        # their reads superseded (tag -> theirs)
        self.quick: QuickMisses | None = None
        self.superseded: dict[int, int] = {}

    @property
    def reader(self):
        """The native reader. Asked for after `close()` (a generation still running, on this
        thread or another), it raises one line instead of handing out a closed reader."""
        if self.closed:
            raise RuntimeError(CLOSED)
        return self._reader

    @reader.setter
    def reader(self, value) -> None:
        self._reader = value

    # ---- reads ------------------------------------------------------------------------

    def _submit(self, keys: list[Key], protect, keep, urgent: bool = False) -> list[int]:
        """Reads (read-ahead unless `urgent`) of those of `keys` neither resident nor in
        flight, in order, into slots whose expert is of no layer in `protect` and not in
        `keep`, until no such slot is left; their tags."""
        return self._send(self._requests(keys, protect, keep, urgent), urgent)

    def _requests(
        self, keys: list[Key], protect, keep, urgent: bool = False, batch_from: int | None = None
    ) -> list[tuple]:
        """`_submit`'s reads, recorded as in flight, not yet handed to the reader (their
        victims asked of the policy as one batch from `batch_from` keys; None: the arena's
        BATCH_FROM)."""
        self._take_quick_reads()  # (the reader's own reads are in flight too)
        tag_of, slot_of = self.tag_of, self.arena.slot_of
        todo = [k for k in dict.fromkeys(keys) if k not in tag_of and k not in slot_of]
        reqs = []
        # up to the first key with no slot that may be given up: the rest waits for demand
        for key, (slot, victim) in zip(
            todo, self.arena.allocate_many(todo, protect, keep, batch_from)
        ):
            self.evicted(victim)
            reqs.append(self._start_read(key, slot, urgent))
        return reqs

    def _send(self, reqs: list[tuple], urgent: bool) -> list[int]:
        """Hand `reqs` to the reader in one batch; their tags."""
        if reqs and not urgent:
            self.stats.readahead_submitted += len(reqs)
        return self._handed(reqs, urgent)

    def _handed(self, reqs: list[tuple], urgent: bool) -> list[int]:
        """`reqs` submitted; the tags each key is read under. A request for a record the
        reader's quick misses read meanwhile (stream.quick) is undone and the quick read
        taken in its place: not sent (`superseded`), or skipped by the reader."""
        if not reqs:
            return []
        sent = [r for r in reqs if r[0] in self.reads] if self.superseded else reqs
        skipped = self.reader.submit(sent, urgent) if sent else []
        if not skipped and not self.superseded:
            return [r[0] for r in reqs]
        keys = {tag: self.withdraw(tag) for tag in skipped or ()}
        if keys:
            self.quick.absorb()
        over = self.superseded
        return [
            self.tag_of[keys[t]] if t in keys else over.pop(t) if t in over else t
            for t in (r[0] for r in reqs)
        ]

    def withdraw(self, tag: int) -> Key:
        """A read that never started out of these books (not sent, skipped, cancelled); its
        key."""
        r = self.reads.pop(tag)
        del self.tag_of[r.key]
        self.arena.release(r.slot)
        return r.key

    def take_read(self, tag: int, key: Key, slot: int, urgent: bool) -> None:
        """A read of `key` into `slot` in flight in these books from now on (one the reader
        queued itself too: stream.quick)."""
        self.reads[tag] = _Read(key, slot, urgent)
        self.tag_of[key] = tag

    def _take_quick_reads(self) -> None:
        """The reads the reader queued itself since the last call into these books."""
        if self.quick is not None:
            self.quick.absorb()

    def _start_read(self, key: Key, slot: int, urgent: bool) -> tuple:
        """Record a read of `key` into `slot` as in flight; its request for the reader."""
        tag = self._tags = self._tags + 1
        pos, m = self.residency.pos[key[0]], self.manifest  # (manifest.record, without its lookups)
        expected = m.checksums[pos][key[1]] if self.verify else None
        self.take_read(tag, key, slot, urgent)
        address, ready = self.arena.address(slot), self.residency.ready(key, slot)
        offset = m.offsets[pos][key[1]]
        return (tag, self.file_index, offset, self.record_bytes, address, expected, ready)

    def evicted(self, key: Key | None) -> None:
        """`key` left the arena (None: nothing did); read-ahead evicted unused was wasted."""
        if key is None:
            return
        self.residency.set(key, -1)
        self.early.discard(key)
        if key in self.prefetched:
            self.prefetched.discard(key)
            self.stats.wasted_readahead += 1

    def _finish(self, completions) -> ExpertReadError | None:
        """Completions into residency; the error of the first failed read, if any."""
        errors, quick = [], self.quick
        self._take_quick_reads()  # (their completions may be among these)
        for tag, err, nbytes in completions:
            r = self.reads.pop(tag, None)
            if r is None:
                continue
            del self.tag_of[r.key]
            if quick is not None:
                quick.finished(r.key)
            if err or nbytes != self.record_bytes:
                self.arena.release(r.slot)
                self.early.discard(r.key)  # (read again, it is counted again)
                errors.append((r.key, err, nbytes))
                continue
            self.arena.loaded(r.slot)
            self.residency.set(r.key, r.slot)
            self.stats.experts_read += 1
            self.stats.bytes_read += nbytes
            if not r.urgent and not r.layer_wanted:
                self.prefetched.add(r.key)
        return read_error(self, *errors[0]) if errors else None


class Scheduler(ReadBooks):
    """Reads, residency and statistics, shared by both schedulers. How completions are
    collected is each one's own: `wait`, `_absorb` (completions into residency),
    `_reserved` (the reserve's reads to send now) and `_check_failed`."""

    # ---- what the handshake asks -------------------------------------------------------

    def row(self, layer: int) -> np.ndarray:
        """The host residency row of `layer`: expert -> slot, -1 where absent."""
        return self.residency.row(layer)

    def device_row(self, layer: int, fake: bool = False) -> tuple[np.ndarray, mx.array]:
        """(host copy, device row) of `layer`'s residency (ResidencyRows.device_row): a
        miss's result is discarded once the host sees it."""
        with self.lock:
            return self.residency.device_row(layer, fake)

    def claim(self, layer: int, needed: list[int]) -> list[int]:
        """Count hits / streamed-ahead / misses of `layer`'s `needed` experts, submit the
        misses urgently, pin them all; the tags the computation must wait for."""
        with self.lock:
            self._check_failed()
            self._take_quick_reads()
            row = self.residency.row(layer)
            if self.early:  # misses read before their claim: each key looked at alone
                resident, rest = [], needed
            else:
                # The host row says which experts are resident (landed, not evicted since):
                # those are hits, counted and pinned together; the rest is looked at alone.
                if len(needed) < 64:  # decode's few experts: numpy's calls cost more
                    resident, rest, pins = [], [], []
                    for e in needed:
                        if (s := row.item(e)) >= 0:
                            resident.append(e)
                            pins.append(s)
                        else:
                            rest.append(e)
                else:  # a prefill layer's ~500: one mask, not a Python test per expert
                    slots = row[needed]
                    hit, ids = slots >= 0, np.asarray(needed)
                    resident, rest = ids[hit].tolist(), ids[~hit].tolist()
                    pins = slots[hit].tolist()
                if resident:
                    self._count_hits([(layer, e) for e in resident])
                    self.arena.pin(pins)
                if not rest:
                    return []
            st = self.stats
            waits, urgent, missed = [], [], []
            for e in rest:
                key = (layer, e)
                tag = self.tag_of.get(key)
                early = key in self.early  # a miss whose read started before this claim
                if early:
                    self.early.discard(key)
                    st.misses += 1
                if tag is not None:  # in flight: read-ahead is promoted
                    if not early:
                        st.streamed_ahead += 1
                    r = self.reads[tag]
                    r.layer_wanted = True
                    waits.append(tag)
                    if not r.urgent:  # (a miss's read is urgent already)
                        urgent.append(tag)
                elif self.arena.resident(key):
                    if early:
                        self.arena.touch(key)
                    else:
                        self._count_hits([key])
                else:  # (an early read evicted since is no longer in `early`)
                    missed.append(key)
                    continue
                # Pinned before the misses are given slots: none of them may evict this one.
                self.arena.pin([self.arena.slot_of[key]])
            if urgent:
                self.reader.promote(urgent)
            if missed:  # one batch: the reader splits it over its idle workers
                st.misses += len(missed)
                waits += self.ensure(missed)
                self.arena.pin([self.arena.slot_of[k] for k in missed])
            return waits

    def _count_hits(self, keys: list[Key]) -> None:
        """Resident experts used, in this order: hits, or read-ahead that paid off (landed
        unused); each use recorded for eviction."""
        st, prefetched = self.stats, self.prefetched
        ahead = prefetched.intersection(keys) if prefetched else ()
        if ahead:
            prefetched.difference_update(ahead)
            st.streamed_ahead += len(ahead)
        st.hits += len(keys) - len(ahead)
        self.arena.touch_all(keys)

    def count_resident(self, layer: int, needed: list[int]) -> None:
        with self.lock:
            self._count_hits([(layer, e) for e in needed])

    def ensure(self, keys: list[Key]) -> list[int]:
        """Allocate slots and submit urgent reads for keys; returns their tags."""
        with self.lock:
            reqs, i = [], 0
            while True:
                for slot, victim in self.arena.allocate_many(keys[i:]):
                    self.evicted(victim)
                    reqs.append(self._start_read(keys[i], slot, urgent=True))
                    i += 1
                if i == len(keys):
                    break
                # Every slot is pinned or mid-read: wait for a read to land, then retry.
                if not self.reads:
                    raise RuntimeError("arena exhausted: every slot is pinned")
                self.collect(block=True)
            return self._handed(reqs, True)

    def start_misses(self, layer: int, experts: list[int], protect: set[int]) -> None:
        """Urgent reads of `layer`'s absent `experts`, started before the handshake that
        will claim (and count) them, into slots of no layer in `protect`; as many as there
        are such slots (the handshake reads the rest)."""
        with self.lock:
            tags = self._submit([(layer, e) for e in experts], protect, None, urgent=True)
            self.early.update(self.reads[t].key for t in tags)

    def read_ahead(
        self,
        layer: int,
        ranked: list[int],
        protect: set[int] | None = None,
        keep: set[Key] | None = None,
    ) -> list[int]:
        """Read-ahead for `layer`'s experts in `ranked` order; no victim from a layer in
        `protect` nor in `keep`. Returns the tags submitted."""
        with self.lock:
            return self._submit([(layer, e) for e in ranked], protect, keep)

    def reserve(self, keys: list[Key], predicted: set[Key]) -> None:
        """Reads worth making once the next layer's are done, most valuable first. This
        scheduler has no moment between handshakes, so it submits them now."""
        with self.lock:
            self._send(self._reserved(keys, predicted, 0), False)

    def predicted(
        self, layer: int, ranked: list[int], keys: list[Key], predicted: set[Key]
    ) -> None:
        """`read_ahead(layer, ranked)` then `reserve(keys, predicted)`, the reads of both
        handed to the reader in one batch (each hand-over wakes its threads)."""
        with self.lock:
            # (layers built on the device and not finished: gated and pipelined decode)
            reqs = self._requests([(layer, e) for e in ranked], self.busy_layers or None, None)
            reqs += self._reserved(keys, predicted, len(reqs))
            self._send(reqs, False)

    def drop_unneeded(self, layer: int, needed: Collection[int]) -> None:
        """Cancel this layer's queued read-ahead that its routing did not ask for."""
        with self.lock:
            mine = [(t, r) for t, r in self.reads.items() if r.key[0] == layer and not r.urgent]
            if not mine:
                return
            needed = set(needed)
            stale = [t for t, r in mine if r.key[1] not in needed]
            if not stale:
                return
            for tag in self.reader.cancel(stale):
                key = self.withdraw(tag)
                if self.quick is not None:
                    self.quick.finished(key)
                self.stats.readahead_dropped += 1

    def settle(self, keep: int | None = None) -> None:
        """The device finished everything built so far: no slot is in use (but layer
        `keep`'s, about to be recomputed), and boards the reader still watches will not come."""
        self.drop_watches()
        with self.lock:
            self.arena.unpin_all()
            self.busy_layers.clear()
            if keep is not None:
                self.busy_layers.add(keep)

    def drop_watches(self) -> None:
        """The reader's quick misses watch no more boards (stream.quick)."""
        if self.quick is not None:
            self.quick.drop()

    def release_reserve(self) -> None:
        """The quick misses' reserve back to the arena (a generation starts)."""
        if self.quick is not None:
            with self.lock:
                self.quick.release()

    def collect(self, block: bool) -> None:
        """Make landed reads resident; with `block`, wait for at least one if any is out."""
        with self.lock:
            if self.reads:
                self._absorb(self.reader.wait(None, None) if block else self.reader.poll())
            self._check_failed()

    def drain(self) -> None:
        """Until no read is in flight."""
        while self.reads:
            self.collect(block=True)

    def close(self) -> None:
        """Stop the reader (reads in flight land first). Idempotent; every request after it
        raises RuntimeError("expert cache is closed")."""
        with self.lock:  # after a handshake on another thread has collected its reads
            if self.closed:
                return
            self.closed = True
            if self._reader is not None:
                self._reader.close()
            if self.residency.gate is not None:  # (the reader's threads, its writers, are gone)
                self.residency.gate.close()


class SyncScheduler(Scheduler):
    """Completions collected by the caller's own calls; the reserve submitted at once."""

    name = "sync"

    def wait(self, tags: list[int]) -> None:
        """Until every read in `tags` has landed (raises ExpertReadError if one failed)."""
        with self.lock:
            pending = [t for t in tags if t in self.reads]
            if pending:
                self._absorb(self.reader.wait(pending, None))

    def _reserved(self, keys: list[Key], predicted: set[Key], pending: int) -> list[tuple]:
        """`reserve`'s reads to go out now, `pending` reads about to be queued before them."""
        return self._requests(keys, self.busy_layers or None, None) if keys else []

    def _absorb(self, completions) -> None:
        """Completions collected by the caller: into residency, a failed read raised."""
        error = self._finish(completions)
        if error is not None:
            raise error

    def _check_failed(self) -> None:
        """A read that failed in the background is reported at the next request (loop)."""


class LoopScheduler(Scheduler):
    """The scheduler on an asyncio event loop of its own thread (see the module docstring).

    Args:
        low_water: the loop tops the reader's queue up from the reserve while fewer reads
            than this are queued (None: twice the reader's workers).
        wake_every: the reader's pipe wakes the loop at every completion (else only while
            the queue is below half the low-water mark and the reserve has reads left).
        loop_top_up: the reserve's reads are sent from the loop's thread alone (woken by
            each completion, whoever collects it), where reads are in flight; a handshake
            sends them only with none in flight.
    """

    name = "loop"

    def __init__(
        self,
        *args,
        low_water: int | None = None,
        wake_every: bool = True,
        loop_top_up: bool = False,
        **kw,
    ):
        super().__init__(*args, **kw)
        self.wake_every = wake_every
        self.loop_top_up = loop_top_up and wake_every  # (else no completion need wake it)
        self.low_water = low_water if low_water is not None else 2 * self.reader.workers
        self._reserve: list[Key] = []
        self._next = 0  # the reserve's next key
        self._predicted: set[Key] = set()  # experts the reserve's reads may not evict
        self._failed: Exception | None = None  # raised at the caller's next request
        self._fd = self.reader.notify_fd()
        # Without wake_every the pipe wakes the loop only while the queue has room below
        # this, and not at all while the reserve is spent (`_arm`): fewer wake-ups (a wake at
        # every completion costs the loop ~0.5 s of Python a 1024-token prefill chunk on an
        # H200), but the handshake then collects what landed (RuntimeConfig's reasons).
        self._wake_below = max(1, self.low_water // 2)
        self._armed = False
        self.reader.notify_below(-1 if wake_every else 0)  # (nothing reserved yet)
        self._loop = asyncio.new_event_loop()
        self._loop.add_reader(self._fd, self._on_completions)
        self._thread = threading.Thread(target=self._run, name="strata-mlx-scheduler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.remove_reader(self._fd)
            self._loop.close()

    def _on_completions(self) -> None:
        """The reader's pipe is readable (the queue ran low): collect and top the queue up."""
        with self.lock:
            t0, c0 = time.perf_counter(), time.thread_time()
            if self.closed:
                return
            try:
                self.reader.ack()  # before polling: a completion after the poll wakes us again
                done = self.reader.poll()
                self._absorb(done)
                if self.loop_top_up and not done:  # a handshake collected what woke us
                    self._top_up()
                self._arm(self._reserve_left() and self._failed is None)
            except Exception as e:  # a bug here must reach the caller, not hang it
                self._failed = self._failed or e
            self.stats.loop_s += time.perf_counter() - t0
            self.stats.loop_cpu_s += time.thread_time() - c0

    def _arm(self, on: bool) -> None:
        """Whether the pipe wakes the loop when the queue runs low (only while the reserve
        has reads left to send; completions meanwhile are collected by the handshakes)."""
        if on != self._armed and not self.wake_every:
            self._armed = on
            self.reader.notify_below(self._wake_below if on else 0)

    def _absorb(self, completions) -> None:
        """Completions, whoever collected them: into residency, a failed read kept for the
        caller's next request, the queue topped up (with loop_top_up, by the loop alone:
        each completion wakes it)."""
        if completions:
            self._failed = self._failed or self._finish(completions)
            if not self.loop_top_up or threading.current_thread() is self._thread:
                self._top_up()

    def _top_up(self) -> None:
        """Reads from the reserve while the reader's queue is below the low-water mark."""
        self._send(self._top_up_requests(0), False)

    def _reserve_left(self) -> bool:
        return self._next < len(self._reserve)

    def _top_up_requests(self, pending: int) -> list[tuple]:
        """`_top_up`'s reads, `pending` reads about to be queued before them."""
        if not self._reserve_left() or self._failed is not None:
            return []
        room = self.low_water - self.reader.queued() - pending
        if room <= 0:
            return []
        batch = []
        while room > 0 and self._reserve_left():
            key = self._reserve[self._next]
            self._next += 1
            if key not in self.tag_of and key not in self.arena.slot_of:
                batch.append(key)
                room -= 1
        reqs = self._requests(
            batch, self.busy_layers, self._predicted, batch_from=TOP_UP_BATCH_FROM
        )
        self.stats.topped_up += len(reqs)
        if len(reqs) < len(batch):  # nothing left that may be evicted for them
            self._next = len(self._reserve)
        return reqs

    # ---- the contract, for a caller on another thread -----------------------------------

    def _reserved(self, keys: list[Key], predicted: set[Key], pending: int) -> list[tuple]:
        self._reserve, self._next, self._predicted = keys, 0, predicted
        if self.loop_top_up and self.reads:
            # A read in flight (this handshake's read-ahead included) wakes the loop when it
            # lands, whoever collects it, and the loop tops the queue up then: the reserve's
            # victim searches and requests run on its thread, not the handshake's.
            return []
        reqs = self._top_up_requests(pending)
        self._arm(self._reserve_left())
        return reqs

    def wait(self, tags: list[int]) -> None:
        """The caller collects while it waits (holding the lock, so the loop cannot): its
        misses land without a hop through the loop's thread, and what else lands meanwhile
        is made resident and tops the queue up as the loop would (with `loop_top_up` the
        loop does, woken by those completions once the lock is let go: the reserve waits
        out this wait)."""
        with self.lock:
            # Only the completions collected here take reads out while the lock is held:
            # what is left to wait for shrinks by them (no rescan of every tag per batch).
            pending = {t for t in tags if t in self.reads}
            while True:
                self._check_failed()
                if not pending:
                    return
                done = self.reader.wait(None, None)  # GIL released until one lands
                if not done:
                    raise RuntimeError("reads in flight that the reader does not know")
                self._absorb(done)
                pending.difference_update(c[0] for c in done)

    def _check_failed(self) -> None:
        if self._failed is not None:
            error, self._failed = self._failed, None
            raise error

    def close(self) -> None:
        """Stop the loop (joining its thread), then the reader: no thread or descriptor is
        left behind."""
        if self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._thread = None
        super().close()


def make_scheduler(name: str, *args, loop: dict | None = None, **kw) -> Scheduler:
    """`loop`: LoopScheduler's own options (low_water, wake_every, loop_top_up)."""
    if name == "sync":
        return SyncScheduler(*args, **kw)
    if name == "loop":
        return LoopScheduler(*args, **(loop or {}), **kw)
    raise ValueError(f"unknown scheduler {name!r}; one of {SCHEDULERS}")
