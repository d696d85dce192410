"""The gate table: which experts' records have landed in their slots, where the device reads it.

Gated decode (strata_mlx.runtime.decode, "gated" mode) builds a token's layers ahead of the
host's routing checks; each layer's experts wait on the device, in the gate kernel
(custom_kernels/gate.py), until this table shows every expert the layer chose landed, then
compute from the slots it names. A miss costs the device its read and nothing else: no
rollback, no per-layer host round trip before the experts are queued.

One int32 word per (MoE layer, expert): its slot once the record is in place, -1 otherwise
(CLOSED, once the table is closed: a gate still waiting gives up).
Written by
  - the reader's threads, as a read completes (Request.ready in _native/reader.c: the slot
    stored with release order after the record sits verified in its slot, its device copy
    done, before the completion is reported; never for a failed read);
  - the scheduler, -1 for an expert evicted, before the read that refills its slot is handed
    to the reader (`clear`).
The table lives in page-locked host memory mapped into the CUDA device's address space
(`reader.map_host`): the device polls it in place, the host and the reader's threads store
into it with plain stores, so no copy or page migration stands between a landing and the
device seeing it. Elsewhere it is plain host memory, read by the host (the gate's host form).

Never decides residency (the arena does) and never reads the store.
"""

from __future__ import annotations

import mmap

import numpy as np

from ..format.store import Manifest

Key = tuple[int, int]
PAGE = 4096
CLOSED = -2  # a word not landed when the table closed: the gate kernel gives up on it at once


class GateTable:
    """Expert -> landed slot (-1: not in place) per MoE layer of `manifest`; `device`: mapped
    for the CUDA device (`device_address`)."""

    def __init__(self, manifest: Manifest, device: bool = False):
        self.num_experts = manifest.num_experts
        self.pos = {l: manifest.layer_position(l) for l in manifest.moe_layers}
        shape = (len(self.pos), self.num_experts)
        nbytes = max(shape[0] * shape[1] * 4, 4)
        self._mem = mmap.mmap(-1, -(-nbytes // PAGE) * PAGE)  # page aligned, as mapping needs
        self.table = np.frombuffer(self._mem, dtype=np.int32, count=shape[0] * shape[1])
        self.table = self.table.reshape(shape)
        self.table.fill(-1)
        self.address = self.table.ctypes.data
        self.device_address: int | None = None
        if device:
            from .reader import map_host

            self.device_address = map_host(self.address, len(self._mem))

    def ready(self, key: Key, slot: int) -> tuple[int, int]:
        """A read request's ready word for `key` landing in `slot`: (address, value)."""
        return self.address + 4 * (self.pos[key[0]] * self.num_experts + key[1]), slot

    def clear(self, key: Key) -> None:
        """`key` left its slot: the device must not take it as landed from now on."""
        self.table[self.pos[key[0]], key[1]] = -1

    def row(self, layer: int) -> np.ndarray:
        """The host's view of `layer`'s row (live: the reader's threads write into it)."""
        return self.table[self.pos[layer]]

    def row_address(self, layer: int) -> int:
        """The device address of `layer`'s row (mapped tables only)."""
        if self.device_address is None:
            raise RuntimeError("the gate table is not mapped for a device")
        return self.device_address + 4 * self.pos[layer] * self.num_experts

    def close(self) -> None:
        """Unmap from the device, once nothing there can read the table. A gate still
        waiting (a token abandoned mid-way: a read error, or close() on another thread while
        a token computes; the reader's threads are stopped first) would wait out its timeout
        for a read never made, and then read an unmapped page, an error that leaves the
        device's context unusable: every word not landed is made CLOSED, which such a gate
        gives up on at once (its late flag set), and the device is waited for."""
        if self.device_address is not None:
            import mlx.core as mx

            from .reader import unmap_host

            self.table[self.table < 0] = CLOSED
            mx.synchronize()
            unmap_host(self.address)
            self.device_address = None
