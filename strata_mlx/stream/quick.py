"""Quick misses: a gated decode layer's misses read by the reader's own thread, off the board.

With the device gate and its routing board (stream.gate), the device writes a layer's routing
ids into mapped host memory, then waits in the gate kernel for the layer's experts to land;
the layer's check (runtime.deferred, on a thread of its own) reads the ids and submits the
misses' reads. That check is Python: on an H100 it waited ~105 us a layer for the GIL once
the ids were in (the decoding thread holds it most of a token), then took ~60 us to its
reads, all of it time the device stood at the gate. Here the reader's native thread
(_native/quick.c) watches each gated layer's board row as the layer is built (`watch`), and
as soon as the ids are in reads those not landed and not already being read into slots of a
reserve that the scheduler set aside beforehand (`refill`, evicting under the eviction
policy's rules); the gate-table word of each is its ready word, so the device waits for the
read alone. The layer's check then waits for that watch (`wait`, microseconds: the ids were
in before it looked) and takes the reads into the scheduler's books (`absorb`: arena,
in-flight reads, counted as misses) before it claims the layer, as if it had submitted them.

Who reads a record is decided in one place, the reader's mutex: `flight` holds a byte per
gate-table word, set by the reader as any request with that ready word is queued (here, or by
the scheduler, whose request for a record already in flight the reader skips: `Scheduler.
_handed`), and cleared by the scheduler once it has finished the read in its books
(`finished`), or dropped it.

Safe slots: the reserve is refilled by a layer's check with victims of no layer built and
not finished (the scheduler's `busy_layers`, as read-ahead's), so nothing on the device reads
a reserve slot; a slot given to a miss is written only by its read, which its gate waits for.

On by default where the routing board runs (RuntimeConfig.decode_quick_misses: the
reserve's size, 32 or an eighth of the arena; 0: off).
"""

from __future__ import annotations

import numpy as np

from .. import _reader
from .gate import GateTable

# The reserve's slots by default (at most an eighth of the arena's): a layer misses a few
# records, every layer's check refills it, and benches of the full-size store with 32 (0.5 %
# of a 6.5 GB arena's slots) left 0.05-0.09 misses a token to the checks for want of a slot.
QUICK_RESERVE = 32

# Later layers a watch reads predictions for at most (the native watch's own bound)
MAX_AHEAD = _reader.QUICK_MAX_AHEAD

# A layer's check waits this long for the watch of its layer (the ids were in before it read
# them: the watcher's turn takes microseconds). Past it, or where the check could not read the
# board, the watches still queued are dropped and the checks claim every miss themselves.
WAIT_S = 0.05


class QuickMisses:
    """The reader's quick misses for one scheduler (stream.scheduler) and its gate table,
    with a reserve of `size` slots; `ahead`: the reader reads lookahead's predictions off the
    board too, as read-ahead, while more than half the reserve is left. Every method but
    `watch`, `wait` and `drop` runs under the scheduler's lock."""

    def __init__(self, sched, gate: GateTable, size: int, ahead: bool = False):
        if size < 1:
            raise ValueError(f"the quick misses' reserve needs a slot at least, got {size}")
        native = getattr(sched.reader, "native", None)
        if native is None or not hasattr(native, "quick_arm"):
            raise ValueError("quick misses need the native reader")
        self.sched, self.gate, self.size, self.ahead = sched, gate, size, ahead
        self._r = native
        m = sched.manifest
        self.layer_at = {pos: layer for layer, pos in gate.pos.items()}
        offsets = np.ascontiguousarray(np.array(m.offsets, dtype=np.int64))
        sums = np.array(m.checksums, dtype=np.uint32) if sched.verify else None
        # the reader's flight bytes (its own memory), cleared here by `finished`
        self.flight = np.frombuffer(
            self._r.quick_arm(
                gate.address,
                *gate.table.shape,
                sched.file_index,
                sched.record_bytes,
                offsets,
                None if sums is None else np.ascontiguousarray(sums),
                size // 2 if ahead else -1,
            ),
            dtype=np.uint8,
        ).reshape(gate.table.shape)
        # each layer's board row's host address and position (numpy's `ctypes` takes
        # microseconds a call, on the thread building the token)
        self._rows = {l: (gate.board_row(l).ctypes.data, p) for l, p in gate.pos.items()}
        self.held: set[int] = set()  # reserve slots the reader holds
        self.timeouts = 0  # checks that gave up waiting for their layer's watch

    # ---- the watch (any thread) ----------------------------------------------------------

    def watch(self, layer: int, seq: int, k: int, ahead: list[tuple[int, int]]) -> int:
        """Watch `layer`'s board row for `seq` and read the misses among its first `k` ids,
        then (with `self.ahead`) read ahead each (later layer, how many ids) of `ahead`'s
        predictions, which follow them on the board: the number to `wait` for."""
        at, pos = self._rows[layer]
        later = [(self.gate.pos[t], n) for t, n in ahead[:MAX_AHEAD]] if self.ahead else None
        return self._r.quick_watch(at, seq, k, pos, later)

    def wait(self, n: int) -> bool:
        """Until the watch numbered `n` is done (its misses queued and logged); False (every
        watch queued dropped) past WAIT_S."""
        if self._r.quick_wait(n, WAIT_S):
            return True
        self.timeouts += 1
        self.drop()
        return False

    def drop(self) -> None:
        """Watches queued are dropped (their boards may never come: a token given up, the
        device drained); a watch under way is abandoned."""
        self._r.quick_drop()

    # ---- the books (under the scheduler's lock) -------------------------------------------

    def absorb(self) -> None:
        """The reader's quick reads since the last call into the scheduler's books."""
        claims = self._r.quick_claims()
        if not claims:
            return
        sched, st = self.sched, self.sched.stats
        for pos, expert, slot, tag, urgent in claims:
            key = (self.layer_at[pos], expert)
            mine = sched.tag_of.get(key)
            if mine is not None:  # recorded, not yet sent (a batch of the scheduler's): this
                sched.withdraw(mine)  # read in its place; the request is never sent
                sched.superseded[mine] = tag
            self.held.discard(slot)
            sched.arena.take_aside(slot, key)
            sched.take_read(tag, key, slot, urgent)
            if urgent:
                sched.early.add(key)  # (a miss read before its claim, as start_misses makes)
                st.quick_misses += 1
            else:
                st.quick_ahead += 1
                st.readahead_submitted += 1

    def finished(self, key) -> None:
        """A read of `key` left the scheduler's books (landed, failed or cancelled)."""
        self.flight[self.gate.pos[key[0]], key[1]] = 0

    def refill(self, protect: set[int] | None) -> None:
        """The reserve back to its size, with free slots or victims of no layer in
        `protect`."""
        want = self.size - self._r.quick_free()
        if want <= 0:
            return
        got = self.sched.arena.set_aside(want, protect)
        for _, victim in got:
            self.sched.evicted(victim)
        if got:
            arena = self.sched.arena
            self._r.quick_give([(s, arena.address(s)) for s, _ in got])
            self.held.update(s for s, _ in got)

    def release(self) -> None:
        """The reserve's slots back to the arena (prefill gets every slot); watches dropped."""
        self.drop()
        self.absorb()
        slots = self._r.quick_take()
        self.held.difference_update(slots)
        self.sched.arena.give_back(slots)
