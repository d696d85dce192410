"""The arena: a fixed set of expert slots in one MLX buffer, and which expert sits where.

The buffer is allocated once, as 4 KiB pages of 8-byte words ([pages, 512] uint64): MLX shape
dims are int32, so a flat buffer would stop at 2^31 elements (2 GB of bytes, 16 GB of words),
while a 2-D one has no such limit (each dim < 2^31; 2^31 pages are 8 TB). It has one page of
slack so that slot 0 starts page aligned (MLX's CPU buffers are not: address mod 4096 was 24),
because direct I/O writes straight into slot memory through a numpy view of that buffer.
`rows`, the [n_slots, record_bytes] uint8 array the kernels read, is an `as_strided` view of
the buffer at that page offset, so it shares the buffer's memory. Writes through the numpy
view are seen by later MLX computation on CPU and under MLX CUDA's unified memory. The arena
array is kept alive for the life of the model and never donated.

On CUDA with the reader's device copy the buffer can instead be plain device memory
(`device_memory`): MLX allocates a GPU op's output there (cudaMallocAsync), a one-thread kernel
hands back its address, and the copy engine writes records to it. The host must then never
touch the buffer: MLX would move it to managed memory and the address would go stale, so the
arena has no host view, and `check_device_address` re-reads the address.

Residency (expert -> slot), pinning (slots the running layer reads) and eviction live here.
This module never reads files and never computes with weights.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from .._nextuse import Evictable
from ..config import OptionError
from ..format.store import ALIGNMENT
from .reader import advise_hugepages, prefer_device

if TYPE_CHECKING:
    from .prediction import Ahead

Key = tuple[int, int]  # (layer, expert)


class LRU:
    """Evict the expert used longest ago."""

    name = "lru"
    current: int | None = None  # the layer whose handshake runs now (see LayerDistance)

    def __init__(self):
        self._order: OrderedDict[Key, None] = OrderedDict()

    def touch(self, key: Key) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch_all(self, keys: list[Key]) -> None:
        """`touch` each of `keys`, in order, without a call per key (a subclass that
        overrides `touch` is called for each)."""
        if type(self).touch is not LRU.touch:
            for key in keys:
                self.touch(key)
            return
        order = self._order
        move = order.move_to_end
        for key in keys:
            order[key] = None
            move(key)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def remove_all(self, keys: list[Key]) -> None:
        """`remove` each of `keys`, without a call per key (a subclass that overrides
        `remove` is called for each)."""
        if type(self).remove is not LRU.remove:
            for key in keys:
                self.remove(key)
            return
        pop = self._order.pop
        for key in keys:
            pop(key, None)

    def victim(self, evictable) -> Key | None:
        for key in self._order:
            if evictable(key):
                return key
        return None

    def victims(self, evictable, keys: list[Key]) -> list[Key]:
        """The victims of successive `victim` calls for `keys` (each removed, its slot given
        to the next of `keys`, touched and not evictable): the first evictable ones in one
        walk of the order. A subclass that overrides `victim` gets its one victim. None for
        no keys (the walk stops at as many victims as keys)."""
        if not keys:
            return []
        if type(self).victim is not LRU.victim:
            key = self.victim(evictable)
            return [] if key is None else [key]
        out, n = [], len(keys)
        for key in self._order:
            if evictable(key):
                out.append(key)
                if len(out) == n:
                    break
        return out


class ScoredPolicy:
    """Evict the lowest score, the least recently used among equal scores: a heap of
    (score, use number, key) entries, lazily invalidated (a key's live entry is the one with
    its latest use number), so a victim costs O(log n) instead of a scan of every resident
    expert (~1 ms an eviction at 7 K slots, benchmarks/eviction_cost.py: ~20 s of Python a
    prefill chunk of the full-size store)."""

    current: int | None = None

    def __init__(self):
        self._heap: list[tuple[float, int, Key]] = []
        self._use: dict[Key, int] = {}  # resident key -> its latest use number
        self._uses = 0

    def score(self, key: Key) -> float:
        raise NotImplementedError

    def touch(self, key: Key) -> None:
        self._uses += 1
        self._use[key] = self._uses
        heapq.heappush(self._heap, (self.score(key), self._uses, key))
        if len(self._heap) > 4 * len(self._use) + 1024:  # drop dead entries now and then
            self._heap = [e for e in self._heap if self._use.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def remove(self, key: Key) -> None:
        self._use.pop(key, None)

    def victim(self, evictable) -> Key | None:
        skipped, found = [], None
        while self._heap:
            entry = heapq.heappop(self._heap)
            if self._use.get(entry[2]) != entry[1]:
                continue  # a dead entry: used again since, or evicted
            skipped.append(entry)  # live: back in the heap whatever happens
            if evictable(entry[2]):
                found = entry[2]
                break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return found


class LFUAging(ScoredPolicy):
    """Evict the least used expert; counts halve every `period` uses so old fame fades
    (kept as later uses weighing double instead: the same order, no pass over every count)."""

    name = "lfu"

    def __init__(self, period: int = 4096):
        super().__init__()
        self._count: dict[Key, float] = {}
        self._weight = 1.0
        self._period = period

    def score(self, key: Key) -> float:
        c = self._count[key] = self._count.get(key, 0.0) + self._weight
        if self._uses % self._period == 0:
            self._weight *= 2.0
            if self._weight > 2.0**400:  # rescale before floats overflow (every 400 periods)
                self._rescale(2.0**-400)
        return c

    def _rescale(self, f: float) -> None:
        self._weight *= f
        for k in self._count:
            self._count[k] *= f
        self._heap = [(c * f, n, k) for c, n, k in self._heap]  # order kept: heap stays one


class ProfileAware(ScoredPolicy):
    """Evict the expert the routing profile ranks least popular in its layer (LRU tie-break)."""

    name = "profile"

    def __init__(self, profile: np.ndarray | None = None, layers: list[int] | None = None):
        super().__init__()
        self._pop: dict[int, np.ndarray] = {}
        if profile is not None and layers is not None:
            for pos, layer in enumerate(layers):
                row = profile[pos].astype(np.float64)
                self._pop[layer] = row / max(row.sum(), 1.0)

    def score(self, key: Key) -> float:
        pop = self._pop.get(key[0])
        return float(pop[key[1]]) if pop is not None else 0.0


class LayerDistance:
    """Evict the expert whose layer comes back last: a forward pass visits layers in a cycle,
    so the layer just computed is needed again only after every other layer, while the
    layers just ahead are needed next. LRU gets this backwards (the least recently used
    experts are those of the layers about to run). Within a layer, least recently used."""

    name = "layer"

    def __init__(self, layers: list[int] | None = None):
        self._layers = sorted(layers or [])
        self._pos = {l: i for i, l in enumerate(self._layers)}
        self._by_layer: dict[int, OrderedDict[Key, None]] = {}
        self.current: int | None = None  # the layer whose handshake runs now

    def touch(self, key: Key) -> None:
        od = self._by_layer.setdefault(key[0], OrderedDict())
        od[key] = None
        od.move_to_end(key)

    def remove(self, key: Key) -> None:
        od = self._by_layer.get(key[0])
        if od is not None:
            od.pop(key, None)

    def victim(self, evictable) -> Key | None:
        layers = self._layers or sorted(self._by_layer)  # no layer list given: those seen
        pos = self._pos if self._layers else {l: i for i, l in enumerate(layers)}
        n = len(layers)
        start = pos.get(self.current, 0)
        for i in range(n):  # current layer, the one before, ..., the one after it last
            for key in self._by_layer.get(layers[(start - i) % n], ()):
                if evictable(key):
                    return key
        return None


POLICIES = {p.name: p for p in (LRU, LFUAging, ProfileAware, LayerDistance)}


def make_policy(
    eviction: str, profile: np.ndarray | None = None, layers: list[int] | None = None
) -> LRU | ScoredPolicy | LayerDistance:
    """The policy named `eviction`, given only what it reads: the routing profile (rows in
    the order of `layers`) for "profile", the layer cycle for "layer". Any other name, a
    "module:Class" or a class is a plug-in (strata_mlx.stream.policies)."""
    if not isinstance(eviction, str) or eviction not in POLICIES:
        from .policies import build

        return build(eviction, profile, layers)
    if eviction == "profile":
        return ProfileAware(profile, layers)
    if eviction == "layer":
        return LayerDistance(layers)
    return POLICIES[eviction]()


PAGE_WORDS = ALIGNMENT // 8


def buffer_shape(nbytes: int) -> tuple[int, int]:
    """[pages, words per page] of uint64 holding `nbytes` (a multiple of ALIGNMENT) from any
    start address: one page of slack for aligning slot 0."""
    if nbytes % ALIGNMENT:
        raise ValueError(f"{nbytes} bytes is not a multiple of {ALIGNMENT}")
    pages = nbytes // ALIGNMENT + 1
    if pages >= 2**31:
        raise ValueError(f"arena of {nbytes / 1e12:.1f} TB exceeds 2^31 pages")
    return pages, PAGE_WORDS


def slot_rows(buffer: mx.array, n_slots: int, record_bytes: int, start: int) -> mx.array:
    """[n_slots, record_bytes] uint8 view of `buffer` (shaped by buffer_shape) from byte
    `start`, sharing its memory. mx.as_strided flattens its input, and one flat dim stops at
    2^31 elements (16 GB of words: a 25 GB buffer fails there), so the view is taken through
    the buffer's first page, which shares the whole allocation: as_strided does not bound a
    view by its input's shape (MLX documents it as unchecked). It stays inside the buffer:
    `start` lies in the page of slack."""
    words = record_bytes // 8
    if (
        start % 8
        or not 0 <= start < ALIGNMENT
        or n_slots * record_bytes + ALIGNMENT > buffer.nbytes
    ):
        raise ValueError(
            f"{n_slots} slots of {record_bytes} B from byte {start} overrun the buffer"
        )
    rows = mx.as_strided(buffer[:1], (n_slots, words), (words, 1), start // 8)
    return rows.view(mx.uint8)


_ADDRESS_KERNEL = None


def device_address(a: mx.array) -> int:
    """The CUDA device address of `a`'s data, read by a kernel (MLX passes a kernel its
    inputs' device pointers without moving them to managed memory, as host access would)."""
    global _ADDRESS_KERNEL
    if _ADDRESS_KERNEL is None:
        _ADDRESS_KERNEL = mx.fast.cuda_kernel(
            name="strata_arena_address",
            input_names=["a"],
            output_names=["out"],
            source="if (threadIdx.x == 0) out[0] = (unsigned long long)(a);",
            ensure_row_contiguous=False,
        )
    (out,) = _ADDRESS_KERNEL(
        inputs=[a], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)],
        output_dtypes=[mx.uint64],
    )  # fmt: skip
    return int(out.item())


def touch_all(policy, keys: list[Key]) -> None:
    """`policy.touch` each of `keys`, in order (its `touch_all` where it has one)."""
    _each(policy, "touch", keys)


def remove_all(policy, keys: list[Key]) -> None:
    """`policy.remove` each of `keys`, in order (its `remove_all` where it has one)."""
    _each(policy, "remove", keys)


def _each(policy, name: str, keys: list[Key]) -> None:
    batch = getattr(policy, f"{name}_all", None)
    if batch is not None:
        batch(keys)
        return
    one = getattr(policy, name)
    for key in keys:
        one(key)


# allocate_many asks the policy for a batch's victims from this many keys: decode's few
# misses cost less one `allocate` a key (the loop's top-ups ask from TOP_UP_BATCH_FROM).
BATCH_FROM = 16


class Arena:
    """`n_slots` slots of `record_bytes` each, in one MLX buffer allocated once; `rows` is
    that buffer as [n_slots, record_bytes] uint8, row s = slot s, at address(s). `on_device`
    (CUDA, with the reader's device copy): the buffer's managed memory is kept on the device,
    where the copy engine writes records and kernels read them without faulting pages in.
    `device_memory` (with `on_device`): the buffer is plain device memory instead, which the
    host never maps (no view(), no page migration at all)."""

    def __init__(
        self,
        n_slots: int,
        record_bytes: int,
        eviction: str = "lru",
        profile: np.ndarray | None = None,
        layers: list[int] | None = None,
        hugepages: bool = True,
        on_device: bool = False,
        device_memory: bool = False,
    ):
        if n_slots < 1:
            raise ValueError("the arena needs at least one slot")
        if record_bytes % ALIGNMENT:
            raise ValueError(f"record_bytes {record_bytes} is not a multiple of {ALIGNMENT}")
        self.n_slots = n_slots
        self.record_bytes = record_bytes
        self.device_memory = bool(on_device and device_memory)
        self.buffer = mx.zeros(buffer_shape(self.nbytes), dtype=mx.uint64)
        mx.eval(self.buffer)
        if self.device_memory:  # zeros computed on the GPU: an output in device memory
            self._host = None
            address = device_address(self.buffer)
        else:
            self._host = np.array(self.buffer, copy=False).reshape(-1).view(np.uint8)  # writable
            address = self._host.ctypes.data
        self._start = (-address) % ALIGNMENT
        self._base = address + self._start  # slot 0's address
        if hugepages and mx.default_device() == mx.cpu:  # host memory where reads land: huge
            advise_hugepages(self._base, self.nbytes, zeroed=True)  # pages (CUDA's is managed)
        if on_device and not self.device_memory:  # CUDA managed memory: keep it on the device
            prefer_device(self._base, self.nbytes)
        self.rows = slot_rows(self.buffer, n_slots, record_bytes, self._start)
        mx.eval(self.rows)
        self.policy = make_policy(eviction, profile, layers)
        # A plug-in's victims are held to the interface (`_check_victim`); the built-ins and
        # the candidates, named without a module, are not.
        self._plug_in = None
        if not isinstance(eviction, str) or ":" in eviction:
            self._plug_in = getattr(eviction, "__name__", str(eviction))
        self.decoding: bool | None = None  # the phase generation last told (None: none yet)
        self.layer: int | None = None  # the layer whose handshake runs now (set_layer)
        self.slot_of: dict[Key, int] = {}
        self.owner: list[Key | None] = [None] * n_slots
        self.pinned: set[int] = set()
        self.loading: set[int] = set()  # slots whose read is in flight
        self._free = list(range(n_slots - 1, -1, -1))
        # Scored read-ahead (strata_mlx.stream.prediction.ExpectedUse): while set, a slot is
        # given up only by a victim the policy expects used later than this many handshakes.
        self.read_ahead_bar: float | None = None

    @property
    def nbytes(self) -> int:
        return self.n_slots * self.record_bytes

    def address(self, slot: int) -> int:
        return self._base + slot * self.record_bytes

    def check_device_address(self) -> None:
        """Raise if the device-memory buffer has moved (something read it from the host, and
        MLX moved it to managed memory): reads would land in freed memory."""
        if self.device_memory and device_address(self.buffer) + self._start != self._base:
            raise RuntimeError("the arena's device buffer moved: the host must not read it")

    def view(self, slot: int) -> np.ndarray:
        """Writable host view of one slot's memory (not of a device-memory arena)."""
        if self._host is None:
            raise RuntimeError("the arena is in device memory: the host has no view of it")
        o = self._start + slot * self.record_bytes
        return self._host[o : o + self.record_bytes]

    def touch(self, key: Key) -> None:
        self.policy.touch(key)

    def touch_all(self, keys: list[Key]) -> None:
        """Each of `keys` used, in this order (a prefill layer's hits are ~1000 touches,
        two calls each through `touch`)."""
        touch_all(self.policy, keys)

    def set_layer(self, layer: int) -> None:
        """Tell the eviction policy which layer runs now (the layer-aware one uses it)."""
        self.policy.current = self.layer = layer

    def set_phase(self, decoding: bool) -> None:
        """Generation moves into decode steps or out of them (prefill): the policy's
        optional `phase(decoding)` hook, told at each change."""
        if decoding != self.decoding:
            self.decoding = decoding
            hook = getattr(self.policy, "phase", None)
            if hook is not None:
                hook(decoding)

    def predicted(self, layer: int, experts: list[int]) -> None:
        """Lookahead predicts `experts` for `layer` (decode's read-ahead): the policy's
        optional `predicted` hook."""
        hook = getattr(self.policy, "predicted", None)
        if hook is not None:
            hook(layer, experts)

    def allocate_many(
        self,
        keys: list[Key],
        protect: set[int] | None = None,
        keep: set[Key] | None = None,
        batch_from: int | None = None,
    ) -> list[tuple[int, Key | None]]:
        """`allocate` for each of `keys` (distinct, none resident), in order, until one
        gets no slot: their (slot, evicted expert or None). The same slots and victims as
        one `allocate` a key; a policy with `victims` (the victims of successive `victim`
        calls) is asked once for a batch of `batch_from` keys or more (None: BATCH_FROM)
        instead of once a key."""
        batch = getattr(self.policy, "victims", None)
        if batch_from is None:
            batch_from = BATCH_FROM
        if batch is None or self.read_ahead_bar is not None or len(keys) < batch_from:
            out, evictable = [], self._evictable(protect, keep)
            for key in keys:
                got = self._take(key, evictable)
                if got is None:
                    break
                out.append(got)
            return out
        out, i, n = [], 0, len(keys)
        while i < n and self._free:  # free slots first, as allocate takes them
            slot = self._free.pop()
            self._assign(slot, keys[i])
            self.policy.touch(keys[i])
            out.append((slot, None))
            i += 1
        if i == n:
            return out
        evictable = self._evictable(protect, keep)
        while i < n:
            victims = batch(evictable, keys[i:])
            if not victims:
                if self._plug_in is not None:
                    self._check_victim(None, evictable)
                break
            if self._plug_in is not None:
                if len(set(victims)) < len(victims) or len(victims) > n - i:
                    raise OptionError(
                        f"eviction policy {self._plug_in}: victims() named a key twice, or "
                        f"more keys than the {n - i} asked for",
                        "eviction",
                    )
                for victim in victims:  # (each evictable now: none of them is taken yet)
                    self._check_victim(victim, evictable)
            given = keys[i : i + len(victims)]
            for victim, key in zip(victims, given):
                slot = self.slot_of.pop(victim)
                self._assign(slot, key)
                out.append((slot, victim))
            remove_all(self.policy, victims)
            self.touch_all(given)  # after the removes: no policy orders them apart
            i += len(victims)
        return out

    def _assign(self, slot: int, key: Key) -> None:
        self.owner[slot] = key
        self.slot_of[key] = slot
        self.loading.add(slot)

    def _evictable(self, protect: set[int] | None, keep: set[Key] | None) -> Evictable:
        """Whether a resident key may give up its slot: not pinned, not loading, of no layer
        in `protect`, not in `keep` (a C check the native policies call without Python)."""
        return Evictable(self.slot_of, self.pinned, self.loading, protect or None, keep or None)

    def allocate(
        self, key: Key, protect: set[int] | None = None, keep: set[Key] | None = None
    ) -> tuple[int, Key | None] | None:
        """(slot, the expert evicted from it or None) for `key`, the slot marked loading;
        never evicts an expert of a layer in `protect` nor one in `keep`. None if every slot
        is busy."""
        return self._take(key, None if self._free else self._evictable(protect, keep))

    def _take(self, key: Key, evictable: Evictable | None) -> tuple[int, Key | None] | None:
        """`allocate`, its rule built (None: only where a slot is free)."""
        victim = None
        if self._free:
            slot = self._free.pop()
        else:
            victim = self._victim(evictable)
            if victim is None or not self._beyond_bar(victim):
                return None
            slot = self.slot_of.pop(victim)
            self.policy.remove(victim)
        self._assign(slot, key)
        self.policy.touch(key)
        return slot, victim

    def _victim(self, evictable: Evictable) -> Key | None:
        """The policy's victim, a plug-in's checked (`_check_victim`)."""
        victim = self.policy.victim(evictable)
        if self._plug_in is not None:
            self._check_victim(victim, evictable)
        return victim

    def _check_victim(self, victim: Key | None, evictable: Evictable) -> None:
        """An OptionError naming the plug-in where its victim breaks the interface: a key
        not resident, one a computation reads (pinned) or a read lands in (loading), or
        None while a resident key could go (a read would wait for a slot forever)."""
        if victim is None:
            if not any(evictable(k) for k in self.slot_of):
                return
            why = "victim() returned None while resident experts could be evicted"
        elif victim not in self.slot_of:
            why = f"victim {victim!r} is not resident"
        elif not evictable(victim):
            why = f"victim {victim!r} may not be evicted (pinned, or its read in flight)"
        else:
            return
        raise OptionError(f"eviction policy {self._plug_in}: {why}", "eviction")

    @contextmanager
    def scored(self, ahead: Ahead | None) -> Iterator[None]:
        """Inside, read-ahead for `ahead.layer` (Predictor.ahead_bar; None: in prefill):
        the policy is told the prediction (its optional `predicted` hook), and a slot is
        given up only by a victim that the policy expects used more than `ahead.bar`
        handshakes from now (None: any victim)."""
        if ahead is not None:
            self.predicted(ahead.layer, ahead.experts)
        self.read_ahead_bar = ahead.bar if ahead is not None else None
        try:
            yield
        finally:
            self.read_ahead_bar = None

    def _beyond_bar(self, victim: Key) -> bool:
        if self.read_ahead_bar is None:
            return True
        distance = getattr(self.policy, "distance", None)
        return distance is None or distance(victim) > self.read_ahead_bar

    def set_aside(self, n: int, protect: set[int] | None) -> list[tuple[int, Key | None]]:
        """Up to `n` slots taken out of use, free ones first, then victims' (none of a
        layer in `protect`): (slot, the expert evicted from it or None). Such a slot holds
        nothing and is given out by nothing here until `take_aside` or `give_back`
        (stream.quick's reserve)."""
        out: list[tuple[int, Key | None]] = []
        while len(out) < n and self._free:
            out.append((self._free.pop(), None))
        if len(out) < n:
            evictable = self._evictable(protect, None)
            while len(out) < n and (victim := self._victim(evictable)) is not None:
                slot = self.slot_of.pop(victim)
                self.policy.remove(victim)
                self.owner[slot] = None
                out.append((slot, victim))
        return out

    def take_aside(self, slot: int, key: Key) -> None:
        """A slot set aside now takes `key`, its read in flight (as `allocate` gives one)."""
        self._assign(slot, key)
        self.policy.touch(key)

    def give_back(self, slots) -> None:
        """Slots set aside and never taken are free again."""
        self._free.extend(slots)

    def loaded(self, slot: int) -> None:
        self.loading.discard(slot)

    def release(self, slot: int) -> None:
        """Give a slot back (its read was dropped or failed): it holds nothing valid."""
        key = self.owner[slot]
        if key is not None:
            self.slot_of.pop(key, None)
            self.policy.remove(key)
        self.owner[slot] = None
        self.loading.discard(slot)
        self.pinned.discard(slot)
        self._free.append(slot)

    def resident(self, key: Key) -> bool:
        s = self.slot_of.get(key)
        return s is not None and s not in self.loading

    def pin(self, slots) -> None:
        self.pinned.update(slots)

    def unpin_all(self) -> None:
        self.pinned.clear()
