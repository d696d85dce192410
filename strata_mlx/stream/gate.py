"""The gate table: which experts' records have landed in their slots, where the device reads it.

Gated decode (strata_mlx.runtime.decode, "gated" mode) builds a token's layers ahead of the
host's routing checks; each layer's experts wait on the device, in the gate kernel
(custom_kernels/gate.py), until this table shows every expert the layer chose landed, then
compute from the slots it names. A miss costs the device its read and nothing else: no
rollback, no per-layer host round trip before the experts are queued.

One int32 word per (MoE layer, expert): its slot once the record is in place, -1 otherwise;
FAILED once its read failed, or the token waiting for it was abandoned; CLOSED once the table
is closed. A gate gives up at once on either (its token is recomputed, or never used), and on
any word while the table's stop word is set: the reader's watcher sets it while a device copy
is held behind the device (a gate may wait on a read that nothing can submit meanwhile: the
thread holding the copy, in the driver, may hold the GIL the check that submits it needs), the
decoder clears it once its token's gates have run (`go_on`).
Written by
  - the reader's threads, as a read completes (Request.ready in _native/reader.c: the slot
    stored with release order after the record sits verified in its slot, its device copy
    done, before the completion is reported; FAILED for a failed read);
  - the reader, -1 as a read's request is submitted (an earlier read of the expert may have
    failed);
  - the scheduler, -1 for an expert evicted, before the read that refills its slot is handed
    to the reader (`clear`);
  - the expert cache: FAILED for every word not landed when a gated token is abandoned by an
    error (`abandon`: the gates it left queued give up at once, rather than each waiting out
    its timeout before the next generation's work), -1 again for them once the device is
    idle (`reset`).
The table lives in page-locked host memory mapped into the CUDA device's address space
(`reader.map_host`): the device polls it in place, the host and the reader's threads store
into it with plain stores, so no copy or page migration stands between a landing and the
device seeing it. Elsewhere it is plain host memory, read by the host (the gate's host form).

Never decides residency (the arena does) and never reads the store.

Beside the table, in the same mapped memory, the routing board: a row per MoE layer into which
a kernel of gated decode's may write a layer's routing ids, then a sequence number
(custom_kernels/gate.py, `board`), so that the layer's check reads them in place as soon as
the device has computed them, without a copy back or a wait on MLX's event for the command
buffer they belong to.
"""

from __future__ import annotations

import mmap
import threading
from contextlib import contextmanager

import mlx.core as mx
import numpy as np

from custom_kernels.gate import BOARD_IDS

from ..format.store import Manifest
from .reader import READY_FAILED, replace_words

Key = tuple[int, int]
PAGE = 4096
BOARD_WIDTH = BOARD_IDS + 1  # int32 a board row: the sequence number, then the ids
CLOSED = -2  # a word not landed when the table closed: the gate kernel gives up on it at once
FAILED = READY_FAILED  # its read failed, or its token was abandoned: given up on at once too


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class GateTable:
    """Expert -> landed slot (-1: not in place) per MoE layer of `manifest`; `device`: mapped
    for the CUDA device (`device_address`), the stop word then `reader`'s (its watcher of held
    copies sets it, until close())."""

    # Whether the driver stores prefill's read-ahead ready words too (runtime.experts.
    # tell_words; RuntimeConfig.prefill_words_by_driver), as it does decode's.
    prefill_by_driver = False
    # Inside gated decode, a device copy held this long gives its gate up (Reader.
    # copy_held_us; RuntimeConfig.decode_copy_held_ms; 0: never).
    copy_held_us = 0
    # Whether gated layers' checks read their routing from the board (RuntimeConfig.
    # decode_gate_board; runtime.deferred.RoutingBoard).
    board_on = False
    # With it, whether the board's write and the gate are one kernel a layer (RuntimeConfig.
    # decode_gate_fused; custom_kernels.gate.board_gate).
    board_fused = False

    def __init__(self, manifest: Manifest, device: bool = False, reader=None):
        self.num_experts = manifest.num_experts
        self.pos = {l: manifest.layer_position(l) for l in manifest.moe_layers}
        shape = (len(self.pos), self.num_experts)
        # After the layers' rows and board rows, one more of each: the spare, whose words
        # read slot 0 (landed), where the gate's kernels run once before decode
        # (`spare_address`).
        self.spare = shape[0]
        rows = shape[0] + 1
        board_at = _round_up(rows * shape[1] * 4, 256)  # (its own cache lines)
        stop_at = _round_up(board_at + rows * BOARD_WIDTH * 4, 256)  # (and the stop word)
        self._mem = mmap.mmap(-1, _round_up(stop_at + 4, PAGE))  # page aligned, as mapping needs
        self.table = np.frombuffer(self._mem, dtype=np.int32, count=shape[0] * shape[1])
        self.table = self.table.reshape(shape)
        self.table.fill(-1)  # (the spare row stays 0)
        self.address = self.table.ctypes.data
        self.board = np.frombuffer(
            self._mem, dtype=np.int32, count=rows * BOARD_WIDTH, offset=board_at
        ).reshape(rows, BOARD_WIDTH)  # zeros: no sequence number written yet
        self._board_at = board_at
        # The stop word: 1 while every gate gives up at once (`stopped`, `go_on`).
        self.stop_word = np.frombuffer(self._mem, dtype=np.int32, count=1, offset=stop_at)
        self.stop_address = self.stop_word.ctypes.data
        self._stop_at = stop_at
        self.device_address: int | None = None
        # Decodes running (`in_use`), and whether close() left the unmapping to the last.
        self._lock = threading.Lock()
        self._users = 0
        self._closing = False
        if device:
            from .reader import map_host

            self.device_address = map_host(self.address, len(self._mem))
            if reader is not None:
                reader.native.stop_word = self.stop_address
        # (the reader whose watcher sets the stop word, which lets go of it at close())
        self._reader = reader if self.device_address is not None else None

    def ready(self, key: Key, slot: int) -> tuple[int, int]:
        """A read request's ready word for `key` landing in `slot`: (address, value)."""
        return self.address + 4 * (self.pos[key[0]] * self.num_experts + key[1]), slot

    def clear(self, key: Key) -> None:
        """`key` left its slot: the device must not take it as landed from now on."""
        self.table[self.pos[key[0]], key[1]] = -1

    def row(self, layer: int) -> np.ndarray:
        """The host's view of `layer`'s row (live: the reader's threads write into it)."""
        return self.table[self.pos[layer]]

    def board_row(self, layer: int) -> np.ndarray:
        """The host's view of `layer`'s board row: [sequence number, ids...]."""
        return self.board[self.pos[layer]]

    def board_address(self, layer: int) -> int:
        """The device address of `layer`'s board row (mapped tables only)."""
        return self._board_address(self.pos[layer])

    def _board_address(self, position: int) -> int:
        if self.device_address is None:
            raise RuntimeError("the gate table is not mapped for a device")
        return self.device_address + self._board_at + 4 * BOARD_WIDTH * position

    def gate_at(self, row_address: int) -> mx.array:
        """A gate kernel's `row_at` for the row at device address `row_address` (`row_address`,
        `spare_address`): uint64 [row, the stop word], mapped tables only."""
        if self.device_address is None:
            raise RuntimeError("the gate table is not mapped for a device")
        return mx.array([row_address, self.device_address + self._stop_at], dtype=mx.uint64)

    def stopped(self) -> bool:
        """Whether the stop word is set: the reader's watcher saw a device copy held behind
        the device (the native reader's stop_word), and every gate gives up at once until
        `go_on`."""
        return bool(self.stop_word[0])

    def go_on(self) -> None:
        """The stop word cleared: gates wait for their words again. Called once the gates
        that were stopped have run (the decoder, having read their flags); set again by the
        watcher within a quarter of decode_copy_held_ms where a copy is still held."""
        self.stop_word[0] = 0

    def row_address(self, layer: int) -> int:
        """The device address of `layer`'s row (mapped tables only)."""
        return self._row_address(self.pos[layer])

    def spare_row(self) -> np.ndarray:
        """The host's view of the spare row (every word 0)."""
        n = self.num_experts
        return np.frombuffer(self._mem, dtype=np.int32, count=n, offset=4 * self.spare * n)

    def spare_address(self) -> tuple[int, int]:
        """The device addresses of the spare row (every word slot 0: a gate on it passes at
        once) and of the spare board row (mapped tables only)."""
        return self._row_address(self.spare), self._board_address(self.spare)

    def _row_address(self, position: int) -> int:
        if self.device_address is None:
            raise RuntimeError("the gate table is not mapped for a device")
        return self.device_address + 4 * position * self.num_experts

    def abandon(self) -> None:
        """A gated token was stopped by an error, on the calling thread: every word not
        landed reads FAILED, so that the gates it left queued give up at once (`reset` once
        the device is idle). Word by word, atomically: a read of the token's landing
        meanwhile keeps its slot. Mapped, the thread's device work is then waited for (the
        gates give up at once): MLX synchronizes a thread's own stream only, so a close() or
        reset() on another thread could not wait for this one's gates."""
        self.fail_pending()
        self._wait_for_device()

    def fail_pending(self) -> None:
        """Every word not landed reads FAILED, word by word, atomically (`abandon` without
        its wait: a check that failed on the checks' thread, which has no device work)."""
        replace_words(self.address, self.table.size, -1, FAILED)

    def reset(self) -> None:
        """Nothing runs on the device: words left FAILED read -1 again (a later read of the
        expert lands in them). The device is waited for first where a gate may still be
        queued behind an abandoned token (it would otherwise wait out its timeout). Reads
        the token left in flight land meanwhile: only words still FAILED after the wait go
        back to -1, each atomically, so a landed slot is never taken for one not in place
        (its expert resident, every gate needing it would wait out its timeout)."""
        if (self.table == FAILED).any() or self.stopped():
            self._wait_for_device()
            replace_words(self.address, self.table.size, FAILED, -1)
            self.go_on()

    @contextmanager
    def in_use(self):
        """A decode runs inside (gates may be built and launched): a close() meanwhile, from
        another thread, leaves the table mapped until the block ends."""
        with self._lock:
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0 and self._closing:
                    self._unmap()

    def close(self) -> None:
        """Unmap from the device, once nothing there can read the table. A gate still
        waiting (a token abandoned mid-way: a read error, or close() on another thread while
        a token computes; the reader's threads are stopped first) would wait out its timeout
        for a read never made, and then read an unmapped page, an error that leaves the
        device's context unusable: every word not landed is made CLOSED, which such a gate
        gives up on at once (its late flag set), and the device is waited for. While a decode
        runs (`in_use`; another thread's), it may still launch gates (which then give up at
        once): the mapping stays until it ends."""
        self.table[self.table < 0] = CLOSED
        if self._reader is not None:  # (no longer set into memory that may be let go of)
            self._reader.native.stop_word = 0
        with self._lock:
            self._closing = True
            if self._users == 0:
                self._unmap()

    def _wait_for_device(self) -> None:
        """Mapped: the calling thread's device work done (MLX's synchronize: its stream)."""
        if self.device_address is not None:
            mx.synchronize()

    def _unmap(self) -> None:
        if self.device_address is not None:
            from .reader import unmap_host

            self._wait_for_device()
            unmap_host(self.address)
            self.device_address = None
