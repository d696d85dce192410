"""Eviction policies as plug-ins: the interface a policy implements, how one is named or
passed (to `load()`, `--eviction`, `strata-mlx cache-sim --policy`), and the candidate
policies measured against the arena's built-ins by trace replay.

A policy is any object with three methods; keys are (layer, expert) pairs:

    touch(key)          key was used, or was just given a slot: it is resident
    remove(key)         key left the arena (evicted, or its read was dropped or failed)
    victim(evictable)   -> the resident key to evict, one for which evictable(key) is true
                        (pinned and in-flight slots are not), or None if there is none

and two optional ones the arena and the replay set or call:

    current             an attribute: the layer whose handshake runs now (set before its
                        lookups; a forward pass visits the MoE layers in order)
    predicted(layer, experts)
                        the experts lookahead predicts `layer` will use, told before `layer`
                        runs (cache-sim replays the trace's predictions; the live runtime
                        does not call it yet)

A policy is given as a built-in name (arena.POLICIES), a candidate's name here, a class or
factory, or "module:Class" (a file module.py on the import path, or a dotted module). A
class is constructed with those of the keywords `layers` (the MoE layers in forward order)
and `profile` (the store's routing profile, [layers, experts] counts, or None) that its
__init__ names; a class taking neither is constructed with no arguments.

A policy decides only which resident expert goes: it never reads files, never sees weights,
and cannot change a model's outputs (the tests check them bit-identical under every policy).
"""

from __future__ import annotations

import heapq
import importlib
import inspect
import math
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from ..config import OptionError
from .arena import LRU, POLICIES, Key, ScoredPolicy, make_policy


class LRU2(ScoredPolicy):
    """LRU-K with K = 2: evict the expert whose second most recent use is oldest; experts used
    once go first, least recently used among them (an expert must prove itself twice)."""

    name = "lru2"

    def __init__(self):
        super().__init__()
        self._last: dict[Key, int] = {}

    def score(self, key: Key) -> float:
        before = self._last.get(key, 0)  # 0: used once so far (uses count from 1)
        self._last[key] = self._uses
        return float(before)


class LRFU(ScoredPolicy):
    """Frequency with aging by reuse distance (LRFU, Lee et al. 2001): every use adds 1 to an
    expert's score and the score halves every `half_life` uses of the arena, so an expert is
    ranked by how often and how recently it was used at once; half_life -> 0 is LRU, -> inf is
    LFU. Scores are kept as log2(score) + t / half_life, which orders experts as their decayed
    scores at any common time do, so a heap entry never needs updating as time passes."""

    name = "lrfu"

    def __init__(self, half_life: float = 2048.0):
        super().__init__()
        self._half_life = half_life
        self._log: dict[Key, float] = {}  # key -> log2(score at its last use) + t / half_life

    def score(self, key: Key) -> float:
        now = self._uses / self._half_life
        old = self._log.get(key)
        decayed = 0.0 if old is None else 2.0 ** (old - now)  # the old score, aged to now
        self._log[key] = math.log2(decayed + 1.0) + now
        return self._log[key]


class ARC:
    """Adaptive replacement (Megiddo and Modha, 2003), as an eviction order: resident experts
    are in T1 (used once since they came in) or T2 (used again); ghosts of those evicted from
    each are remembered (B1, B2, as many as are resident). A new expert found in B1 says T1
    was evicted too early: the target size of T1 grows; one found in B2 shrinks it. The
    victim is T1's least recent while T1 exceeds its target, else T2's."""

    name = "arc"
    current: int | None = None

    def __init__(self):
        self._t1: OrderedDict[Key, None] = OrderedDict()
        self._t2: OrderedDict[Key, None] = OrderedDict()
        self._b1: OrderedDict[Key, None] = OrderedDict()
        self._b2: OrderedDict[Key, None] = OrderedDict()
        self._p = 0.0  # target size of T1

    def touch(self, key: Key) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)
        elif key in self._b1:
            self._p = min(self._p + max(len(self._b2) / len(self._b1), 1.0), self._size())
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self._p = max(self._p - max(len(self._b1) / len(self._b2), 1.0), 0.0)
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None

    def _size(self) -> int:
        return len(self._t1) + len(self._t2)

    def remove(self, key: Key) -> None:
        for live, ghost in ((self._t1, self._b1), (self._t2, self._b2)):
            if key in live:
                del live[key]
                ghost[key] = None
                while len(self._b1) + len(self._b2) > max(self._size(), 1):
                    (self._b1 if len(self._b1) > len(self._b2) else self._b2).popitem(last=False)
                return

    def victim(self, evictable) -> Key | None:
        lists = (self._t1, self._t2) if len(self._t1) > self._p else (self._t2, self._t1)
        for od in lists:
            for key in od:
                if evictable(key):
                    return key
        return None


class ProtectedLRU(LRU):
    """LRU that does not evict an expert lookahead predicted for a layer that has not run
    yet: a prediction protects its experts until their layer's handshake. Falls back to
    plain LRU when every evictable expert is protected."""

    name = "protected"

    def __init__(self):
        super().__init__()
        self._protected: dict[int, set[int]] = {}  # layer -> predicted experts

    @property
    def current(self) -> int | None:
        return self._current

    @current.setter
    def current(self, layer: int | None) -> None:
        self._current = layer
        self._protected.pop(layer, None)  # the layer runs: its prediction is spent

    _current: int | None = None

    def predicted(self, layer: int, experts) -> None:
        self._protected[layer] = {int(e) for e in experts}

    def victim(self, evictable) -> Key | None:
        prot = self._protected
        key = super().victim(lambda k: evictable(k) and k[1] not in prot.get(k[0], ()))
        return key if key is not None else super().victim(evictable)


class ProfileLRU(ScoredPolicy):
    """Recency with the profile's popularity as a head start: an expert's score is its last
    use number plus `weight` uses per unit of its share of its layer's routing (times the
    number of experts, so a uniform layer's experts get `weight`)."""

    name = "profile-lru"

    def __init__(self, profile: np.ndarray | None = None, layers: list[int] | None = None):
        super().__init__()
        self._bonus: dict[int, np.ndarray] = {}
        if profile is not None and layers is not None:
            for pos, layer in enumerate(layers):
                row = np.asarray(profile[pos], dtype=np.float64)
                self._bonus[layer] = row / max(row.sum(), 1.0) * len(row)
        self.weight = 1024.0

    def score(self, key: Key) -> float:
        bonus = self._bonus.get(key[0])
        return self._uses + (self.weight * float(bonus[key[1]]) if bonus is not None else 0.0)


def sample_hash(key: Key) -> float:
    """A key's place in [0, 1): a fixed hash (MurmurHash3's 64-bit finaliser of layer and
    expert), the same in every process, so a sample of keys is the same in every run."""
    h = (key[0] << 32 | key[1]) & 0xFFFFFFFFFFFFFFFF
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & 0xFFFFFFFFFFFFFFFF
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & 0xFFFFFFFFFFFFFFFF
    h ^= h >> 33
    return h / 2.0**64


class Adaptive:
    """Follow whichever of several policies would have missed least lately (set dueling,
    as in adaptive cache insertion): each component runs twice, once ordering the real
    residents (its victim is the one taken when it leads) and once in a shadow arena of the
    same size fed the same uses, where its misses are counted with a half-life of
    `half_life` uses. The arena's size is learnt at the first eviction (the arena is full
    then). A shadow takes each call's uses when the call ends, as the arena does: its hits
    first, then its misses, each evicting among experts the call does not use.

    With `sample` < 1 the shadows are miniature simulations (SHARDS, Waldspurger et al.,
    FAST'15): they follow only the keys whose fixed hash falls below the rate, in an arena
    of as many slots as the real arena holds sampled keys when it first fills, so a shadow
    costs about that share of a full one while its miss ratio estimates the full arena's.
    The rate is raised where that would leave a shadow fewer than `min_shadow_slots`
    (a miniature of a few slots no longer behaves as the arena does). Until the arena
    first fills every key is followed (no shadow evicts then); at 1 every key always is."""

    name = "adaptive"

    def __init__(
        self,
        layers: list[int] | None = None,
        profile: np.ndarray | None = None,
        # Measured by replay (docs/research.md): with "layer" too, or a half-life of 16 K
        # uses, the synthetic store's trace lost 10-20 points of the gap closed.
        components: tuple[str, ...] = ("lru", "lfu", "profile"),
        half_life: float = 1024.0,
        sample: float = 1.0,
        min_shadow_slots: int = 0,
    ):
        self.components = components
        self._real = [build(c, profile, layers) for c in components]
        self._shadow = [build(c, profile, layers) for c in components]
        self._held: list[set[Key]] = [set() for _ in components]
        self._misses = [0.0] * len(components)
        self._weight = 1.0
        self._half_life = half_life
        self._growth = 2.0 ** (1.0 / half_life)  # later misses weigh more: old ones fade
        self._resident: set[Key] = set()
        self.capacity: int | None = None
        self.sample = sample
        self.min_shadow_slots = min_shadow_slots
        self.rate = 1.0  # the share of keys the shadows follow (set when the arena fills)
        self.shadow_slots: int | None = None  # each shadow arena's slots
        self._sampled: dict[Key, bool] = {}  # key -> whether the shadows follow it
        self.leader = 0  # the component followed now
        self._current: int | None = None
        self._call: dict[Key, None] = {}  # the running call's uses, in order, for the shadows

    @property
    def shadow_misses(self) -> list[float]:
        """Each component's misses in its shadow arena, weighted (later ones weigh more)."""
        return list(self._misses)

    @property
    def current(self) -> int | None:
        return self._current

    @current.setter
    def current(self, layer: int | None) -> None:
        self._shadow_call()
        self._current = layer
        for p in (*self._real, *self._shadow):
            p.current = layer

    def touch(self, key: Key) -> None:
        self._resident.add(key)
        for p in self._real:
            p.touch(key)
        self._call[key] = None

    def _follows(self, key: Key) -> bool:
        s = self._sampled.get(key)
        if s is None:
            s = self._sampled[key] = sample_hash(key) < self.rate
        return s

    def _learn_capacity(self) -> None:
        """The arena is full: its size, the sampling rate, and each shadow's share of it."""
        self.capacity = len(self._resident)
        if self.sample < 1.0 and self.capacity:
            self.rate = min(1.0, max(self.sample, self.min_shadow_slots / self.capacity))
        if self.rate >= 1.0:
            self.shadow_slots = self.capacity
            return
        self.shadow_slots = max(1, sum(map(self._follows, self._resident)))
        # a sampled use stands for 1 / rate uses: the half-life in uses is kept
        self._growth = 2.0 ** (1.0 / (self._half_life * self.rate))
        for p, held in zip(self._shadow, self._held):
            for key in [k for k in held if not self._follows(k)]:
                p.remove(key)
                held.discard(key)

    def _shadow_call(self) -> None:
        """The ended call's uses through each shadow arena, counting its misses there."""
        uses, self._call = sorted(self._call), {}  # as a layer's distinct experts come
        if self.rate < 1.0:
            uses = [k for k in uses if self._follows(k)]
        if not uses:
            return
        self._weight *= self._growth ** len(uses)  # later misses weigh more: old ones fade
        pinned = set(uses)
        slots = self.shadow_slots
        for i, (p, held) in enumerate(zip(self._shadow, self._held)):
            for key in uses:
                if key in held:
                    p.touch(key)
            for key in uses:
                if key in held:
                    continue
                self._misses[i] += self._weight
                if slots is not None and len(held) >= slots:
                    victim = p.victim(lambda k: k not in pinned)
                    if victim is not None:
                        p.remove(victim)
                        held.discard(victim)
                held.add(key)
                p.touch(key)
        if self._weight > 2.0**500:  # rescale before floats overflow
            self._misses = [m * 2.0**-500 for m in self._misses]
            self._weight *= 2.0**-500

    def remove(self, key: Key) -> None:
        self._resident.discard(key)
        for p in self._real:
            p.remove(key)

    def victim(self, evictable) -> Key | None:
        if self.capacity is None:
            self._learn_capacity()
        self.leader = min(range(len(self._misses)), key=self._misses.__getitem__)
        order = [self.leader] + [i for i in range(len(self._real)) if i != self.leader]
        for i in order:
            key = self._real[i].victim(evictable)
            if key is not None:
                return key
        return None


class NextUse:
    """Evict the resident expert whose next use is expected farthest away. Decode visits the
    MoE layers in a cycle, so expert (l, e) is next wanted when layer l next runs, d(l)
    handshakes from now (1 to L), if the router picks it then, else L handshakes later for
    each token it is passed over: with p its chance of being picked by one call of layer l,
    the expected distance is d(l) + L (1 / p - 1). LRU and LFU each see half of this: the
    layer cycle (LayerDistance alone) wins where every layer reuses most of its experts, the
    frequency where a few experts of each layer take most picks.

    p is estimated per layer: each call of layer l adds a weight that grows by 2^(1 /
    `half_life`) a call (old calls fade), an expert counts the weight of the calls that used it
    (once a call), and the routing profile (where the store has one) is a prior worth `prior`
    calls: the expert's share of its layer's picks against the layer's most picked expert.
    Within a layer the victim is the expert of least count (a heap, lazily invalidated, as
    ScoredPolicy's); across layers the largest expected distance of each layer's candidate:
    each layer's L (1 / p - 1) is kept in an array and updated when its candidate or its
    calls change, so a victim costs one array sum and argmax over the layers, not a pass
    over every layer's arrays (that pass was most of the policy's time a miss)."""

    name = "nextuse"

    def __init__(
        self,
        layers: list[int] | None = None,
        profile: np.ndarray | None = None,
        half_life: float = 256.0,
        prior: float = 64.0,
    ):
        self._index: dict[int, int] = {}  # layer -> its place in the cycle and the arrays
        self._layers: list[int] = []
        self._growth = 2.0 ** (1.0 / half_life)
        self._prior = prior
        self._p0: dict[int, np.ndarray] = {}
        # Per layer, Python floats (a numpy scalar costs more than the arithmetic on it):
        self._weight: list[float] = []  # what one call's use counts now
        self._calls: list[float] = []  # the weights of its calls (and the prior's)
        self._least_count: list[float] = []  # its candidate's count (inf: none)
        self._far = np.zeros(0)  # per layer: L (calls / least count - 1), its candidate's
        self._cycles: dict[int, np.ndarray] = {}  # running layer's index -> d(l) per layer
        self._cycle = np.zeros(0)  # d(l) per layer, the running layer's
        self._cycle_list: list[int] = []  # the same, as Python ints
        self._dist = np.zeros(0)  # d(l) + L (1 / p - 1) per layer: what victim() ranks
        self._changed: set[int] = set()  # layers whose candidate is to be found again
        self._current: int | None = None
        for layer in layers or []:
            self._add_layer(layer)
        if profile is not None and layers:
            for pos, layer in enumerate(layers):
                row = np.asarray(profile[pos], dtype=np.float64)
                if row.max() > 0:
                    self._p0[layer] = row / row.max()
        self._count: dict[Key, float] = {}  # every expert seen, resident or not
        self._heap: dict[int, list[tuple[float, int, Key]]] = {}  # layer -> residents
        self._live: dict[Key, int] = {}  # resident key -> its live entry's number
        self._top: dict[int, tuple[float, int, Key] | None] = {}  # layer -> its candidate
        self._uses = 0
        self._this_call: set[Key] = set()

    def _add_layer(self, layer: int) -> int:
        i = self._index[layer] = len(self._layers)
        self._layers.append(layer)
        self._weight.append(0.0)
        self._calls.append(self._prior)
        self._least_count.append(math.inf)
        n = len(self._layers)  # L changed: every layer's distance with it
        self._far = np.array([n * (c / lc - 1.0) for c, lc in zip(self._calls, self._least_count)])
        self._cycles = {}
        self._place()
        return i

    def _place(self) -> None:
        """The running layer changed: every layer's distance in the cycle with it."""
        at = self._index.get(self._current, 0)
        cycle = self._cycles.get(at)
        if cycle is None:
            n = len(self._layers)
            cycle = self._cycles[at] = (np.arange(n) - at - 1) % n + 1
        self._cycle = cycle
        self._cycle_list = cycle.tolist()
        self._dist = cycle + self._far

    def _refar(self, i: int) -> None:
        """Layer i's calls or candidate changed: its L (1 / p - 1) with them."""
        far = self._far[i] = len(self._layers) * (self._calls[i] / self._least_count[i] - 1.0)
        self._dist[i] = self._cycle_list[i] + far

    @property
    def current(self) -> int | None:
        return self._current

    @current.setter
    def current(self, layer: int | None) -> None:
        self._end_call()
        self._current = layer
        if layer is None:
            self._place()
            return
        i = self._index.get(layer)
        if i is None:
            i = self._add_layer(layer)
        w = self._weight[i] = self._weight[i] * self._growth if self._weight[i] else 1.0
        if w > 2.0**500:
            self._rescale(layer, 2.0**-500)
        self._calls[i] += self._weight[i]
        self._place()
        self._refar(i)

    def _rescale(self, layer: int, f: float) -> None:
        i = self._index[layer]
        self._weight[i] *= f
        self._calls[i] *= f
        for k in self._count:
            if k[0] == layer:
                self._count[k] *= f
        self._heap[layer] = [(c * f, n, k) for c, n, k in self._heap.get(layer, [])]
        self._changed.add(layer)

    def touch(self, key: Key) -> None:
        layer = key[0]
        i = self._index.get(layer)
        if i is None:
            i = self._add_layer(layer)
        if not self._weight[i]:  # used before any handshake of its layer (a read ahead)
            self._weight[i] = 1.0
            self._calls[i] += 1.0
            self._refar(i)
        if key in self._this_call:  # a call counts once, however many tokens pick it
            return
        count = self._count.get(key)
        if count is None:
            p0 = self._p0.get(layer)
            count = self._prior * (float(p0[key[1]]) if p0 is not None else 0.5)
        self._count[key] = count + self._weight[i]
        self._uses += 1
        self._live[key] = self._uses
        if layer == self._current:
            # In use by the running call (pinned): in its layer's heap only once the call
            # ends, so that victim() does not step over it at every eviction of the call.
            self._this_call.add(key)
        else:
            self._push(key)

    def _push(self, key: Key) -> None:
        layer = key[0]
        heap = self._heap.setdefault(layer, [])
        heapq.heappush(heap, (self._count[key], self._live[key], key))
        if len(heap) > 4 * len(self._live) + 1024:  # drop dead entries now and then
            self._heap[layer] = [e for e in heap if self._live.get(e[2]) == e[1]]
            heapq.heapify(self._heap[layer])
        self._changed.add(layer)

    def _end_call(self) -> None:
        if not self._this_call:
            return
        # the call's keys are all of its layer: one heap, one check for dead entries
        heap = self._heap.setdefault(self._current, [])
        live, count = self._live, self._count
        for key in self._this_call:
            n = live.get(key)
            if n is not None:
                heapq.heappush(heap, (count[key], n, key))
        self._this_call = set()
        if len(heap) > 4 * len(live) + 1024:  # drop dead entries now and then
            self._heap[self._current] = [e for e in heap if live.get(e[2]) == e[1]]
            heapq.heapify(self._heap[self._current])
        self._changed.add(self._current)

    def remove(self, key: Key) -> None:
        if self._live.pop(key, None) is not None:
            self._changed.add(key[0])
        self._this_call.discard(key)

    def _least(self, layer: int, evictable=None) -> tuple[float, int, Key] | None:
        """The live entry of least count in `layer` (that is `evictable`, if given)."""
        heap = self._heap.get(layer)
        live = self._live
        if evictable is None:
            while heap and live.get(heap[0][2]) != heap[0][1]:
                heapq.heappop(heap)  # a dead entry: used again since, or evicted
            return heap[0] if heap else None
        skipped, found = [], None
        while heap:
            entry = heapq.heappop(heap)
            if live.get(entry[2]) != entry[1]:
                continue
            skipped.append(entry)
            if evictable(entry[2]):
                found = entry
                break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found

    def victim(self, evictable) -> Key | None:
        for layer in self._changed:  # candidates that changed
            entry = self._top[layer] = self._least(layer)
            i = self._index[layer]
            self._least_count[i] = entry[0] if entry else math.inf
            self._refar(i)
        self._changed.clear()
        n = len(self._layers)
        if not n:
            return None
        # calls / count = 1 / p; no candidate: count inf, a distance <= 0, never the largest
        i = int(self._dist.argmax())
        if self._dist[i] <= 0:
            return None
        entry = self._top.get(self._layers[i])
        if entry is not None and evictable(entry[2]):
            return entry[2]
        far = self._dist.copy()  # the candidate is pinned: rank the layers' next ones
        cycle = self._cycle
        instead: dict[int, tuple[float, int, Key]] = {}  # layer index -> its evictable one
        for _ in range(2 * n):
            i = int(far.argmax())
            if far[i] <= 0:
                return None
            layer = self._layers[i]
            entry = instead.get(i) or self._top.get(layer)
            if entry is not None and evictable(entry[2]):
                return entry[2]
            entry = self._least(layer, evictable)  # pinned or protected: its next one
            if entry is None:
                far[i] = -np.inf
            else:
                instead[i] = entry
                far[i] = cycle[i] + n * (self._calls[i] / entry[0] - 1.0)
        return None


class NextUseRecent(NextUse):
    """NextUse trusting the routing of the last few dozen calls over the profile: a prior of
    4 calls, a half-life of 32 (where the profile misleads: routing with no static hot
    set)."""

    name = "nextuse-recent"

    def __init__(self, layers: list[int] | None = None, profile: np.ndarray | None = None):
        super().__init__(layers, profile, half_life=32.0, prior=4.0)


class NextUseDuel(Adaptive):
    """Adaptive over NextUse's two settings, the profile trusted (`nextuse`) or recent
    routing (`nextuse-recent`), and LRU (where the arena holds a pass's working set, LRU's
    recency guesses better than either), whichever would have missed least lately.

    Its shadows are miniatures: they follow 1/16 of the keys, and at least 512 slots'
    worth (below 512 slots, every key). Replayed, that keeps the full shadows' choice
    within a few points of the gap closed on every trace of docs/research.md while the
    policy's Python a miss falls by two thirds; `nextuse-duel-full` keeps full shadows."""

    name = "nextuse-duel"

    def __init__(
        self,
        layers: list[int] | None = None,
        profile: np.ndarray | None = None,
        sample: float = 1 / 16,
        min_shadow_slots: int = 512,
    ):
        super().__init__(
            layers,
            profile,
            components=("nextuse", "nextuse-recent", "lru"),
            sample=sample,
            min_shadow_slots=min_shadow_slots,
        )


class NextUseDuelFull(NextUseDuel):
    """`nextuse-duel` with shadows that follow every key (the duel before its shadows were
    sampled: the reference the miniature shadows are measured against)."""

    name = "nextuse-duel-full"

    def __init__(self, layers: list[int] | None = None, profile: np.ndarray | None = None):
        super().__init__(layers, profile, sample=1.0)


CANDIDATES = {
    p.name: p
    for p in (LRU2, LRFU, ARC, ProtectedLRU, ProfileLRU, Adaptive, NextUse, NextUseRecent,
              NextUseDuel, NextUseDuelFull)
}  # fmt: skip


def names() -> list[str]:
    """Every policy given by name: the arena's built-ins, then the candidates."""
    return sorted(POLICIES) + sorted(CANDIDATES)


def resolve(spec, flag: str = "eviction") -> tuple[str, Callable]:
    """(a display name, the class or factory) of a policy given by name, "module:Class", or
    as a class or factory; an OptionError naming `flag` and the value otherwise."""
    if callable(spec) and not isinstance(spec, str):
        return getattr(spec, "name", getattr(spec, "__name__", repr(spec))), spec
    if not isinstance(spec, str):
        raise OptionError(f"{flag} {spec!r}: a policy name, 'module:Class' or a class", "eviction")
    if spec in POLICIES or spec in CANDIDATES:
        return spec, POLICIES.get(spec) or CANDIDATES[spec]
    if ":" not in spec:
        raise OptionError(
            f"{flag} {spec!r}: unknown eviction policy; one of {', '.join(names())}, "
            "or module:Class",
            "eviction",
        )
    module, _, attr = spec.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except ImportError as e:
        raise OptionError(f"{flag} {spec!r}: cannot import {module} ({e})", "eviction") from None
    except AttributeError:
        raise OptionError(f"{flag} {spec!r}: {module} has no {attr}", "eviction") from None
    if not callable(obj):
        raise OptionError(f"{flag} {spec!r}: {attr} is not a class", "eviction")
    return spec, obj


def _check_methods(obj, spec, flag: str) -> None:
    missing = [m for m in ("touch", "remove", "victim") if not callable(getattr(obj, m, None))]
    if missing:
        raise OptionError(f"{flag} {spec!r}: a policy needs {', '.join(missing)}", "eviction")


def check(spec, flag: str = "eviction") -> None:
    """That `spec` names a policy, and a class given has the three methods (before a load)."""
    _, factory = resolve(spec, flag)
    if isinstance(factory, type):
        _check_methods(factory, spec, flag)


def build(spec, profile: np.ndarray | None = None, layers: list[int] | None = None):
    """A fresh policy for one arena (see the module docstring for the keywords it gets)."""
    if isinstance(spec, str) and spec in POLICIES:
        return make_policy(spec, profile, layers)
    _, factory = resolve(spec)
    given = {"layers": layers, "profile": profile}
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no signature to read: nothing is passed
        params = {}
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    policy = factory(**{k: v for k, v in given.items() if takes_all or k in params})
    _check_methods(policy, spec, "eviction")
    return policy
