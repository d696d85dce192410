"""Expected next use: the eviction policy that evicts the resident expert whose next use is
expected farthest away, from the layer cycle and per-layer pick rates (NextUse), and its
setting that trusts recent routing over the profile (NextUseRecent).

PyNextUse is the policy in Python: the model and the reference. NextUse runs the same state
and victim search in C (strata_mlx._nextuse, line for line the Python, every float the same
operation), with the same victims (tests/stream/test_nextuse_native.py replays traces through
both); STRATA_MLX_NEXTUSE=python gives the reference instead, read when a policy is built.

A policy here only orders resident experts and estimates when one is next wanted; it never
reads files, never sees weights, and never decides anything but which expert goes (the
interface is strata_mlx.stream.policies's).
"""

from __future__ import annotations

import heapq
import math
import os

import numpy as np

from .._nextuse import Core
from ..config import OptionError
from .arena import Key

# Below this many keys `victims` gives victim()'s one victim (replayed on the `store` preset,
# decode's ~2-10 misses a layer cost 1.4x more per miss ranked in one pass than one at a time).
SMALL_BATCH = 16
# A layer's heap drops its dead entries (experts evicted or used again since their push) once
# it holds more than DEAD_PER_LIVE entries a live key plus DEAD_SLACK.
DEAD_PER_LIVE, DEAD_SLACK = 4, 1024


def priors(layers: list[int] | None, profile: np.ndarray | None) -> dict[int, np.ndarray]:
    """Per layer, the profile's prior: each expert's share of its layer's picks against the
    layer's most picked expert (float64; none for a layer whose profile row is all zero)."""
    out: dict[int, np.ndarray] = {}
    if profile is not None and layers:
        for pos, layer in enumerate(layers):
            row = np.asarray(profile[pos], dtype=np.float64)
            if row.max() > 0:
                out[layer] = row / row.max()
    return out


class Batched:
    """NextUse's calls for many keys at once (a prefill layer's ~500 uses and misses): the
    same state and victims as one call a key, without a call's overhead a key."""

    def touch_all(self, keys: list[Key]) -> None:
        """`touch` each of `keys`, in order, the lookups made once (a prefill layer's hits:
        ~500 touches); a key of a layer not used yet takes `touch` itself."""
        count, live, this_call, p0s = self._count, self._live, self._this_call, self._p0
        index, weight, current, prior = self._index, self._weight, self._current, self._prior
        heaps, changed, uses = self._heap, self._changed, self._uses
        for key in keys:
            layer = key[0]
            i = index.get(layer)
            if i is None or not weight[i]:
                self._uses = uses
                self.touch(key)
                uses = self._uses
                continue
            if key in this_call:
                continue
            c = count.get(key)
            if c is None:
                p0 = p0s.get(layer)
                c = prior * (float(p0[key[1]]) if p0 is not None else 0.5)
            c = count[key] = c + weight[i]
            uses += 1
            live[key] = uses
            if layer == current:
                this_call.add(key)
                continue
            heap = heaps.get(layer)  # _push's, inline (a top-up's reads are of later layers)
            if heap is None or len(heap) >= DEAD_PER_LIVE * len(live) + DEAD_SLACK:
                self._uses = uses
                self._push(key)
                continue
            heapq.heappush(heap, (c, uses, key))
            changed.add(layer)
        self._uses = uses

    def remove_all(self, keys: list[Key]) -> None:
        """`remove` each of `keys`, without a call per key (a batch's victims)."""
        pop, changed, this_call = self._live.pop, self._changed, self._this_call
        for key in keys:
            if pop(key, None) is not None:
                changed.add(key[0])
            this_call.discard(key)

    def victims(self, evictable, keys: list[Key]) -> list[Key]:
        """The victims that successive `victim` calls would give for `keys`, each victim
        removed and its slot given to the next of `keys` (touched, not evictable) before the
        next call, found in one pass: the layers ranked in a heap by their candidate's
        distance (largest first, the lowest layer index among equals, as victim's argmax),
        each layer's heap walked once past its pinned entries (victim walks them again at
        every eviction, and ranks all layers again). Stops after a key of a layer not seen
        yet: its touch adds a layer to the cycle, which moves every distance; the caller
        asks again for the rest, as it does after the one victim of a batch of fewer than
        SMALL_BATCH.
        (A key's touch changes only its own layer's rate, and a layer whose rate moves at
        its first use has no resident but the batch's own, none evictable.) Empty where none
        is evictable, or for no keys. The caller removes every victim returned."""
        if not keys:
            return []
        index, want = self._index, len(keys)
        for j, key in enumerate(keys):
            if key[0] not in index:
                want = j + 1
                break
        self._refresh()
        n = len(self._layers)
        if not n:
            return []
        if want < SMALL_BATCH:  # victim's one argmax a key costs less than ranking every
            key = self._kept_candidate(evictable)  # layer (the caller asks again for the
            if key is not None:  # rest), where the largest distance's candidate may go;
                return [key]  # else one pass for all (victim's would walk the heaps past
            # the pinned and kept entries again at every key: the loop's top-ups)
        # (-distance, layer index, entry): entry None stands for the layer's candidate as
        # victim() first tries it (its kept top, if still live)
        ranked = [(-d, i, None) for i, d in enumerate(self._dist.tolist()) if d > 0]
        heapq.heapify(ranked)
        out: list[Key] = []
        taken: set[Key] = set()
        popped: dict[int, list] = {}  # layer -> entries taken out of its heap
        live, calls, cycle, layers = self._live, self._calls, self._cycle_list, self._layers
        while ranked and len(out) < want:
            _, i, entry = heapq.heappop(ranked)
            layer = layers[i]
            if entry is None:
                top = self._top.get(layer)
                if (
                    top is not None
                    and live.get(top[2]) == top[1]
                    and top[2] not in taken
                    and evictable(top[2])
                ):
                    out.append(top[2])
                    taken.add(top[2])
                    entry = top
            else:
                out.append(entry[2])
                taken.add(entry[2])
            # the layer's next: its least live entry that is evictable and not taken
            heap, back = self._heap.get(layer, []), popped.setdefault(layer, [])
            nxt = None
            while heap:
                e = heapq.heappop(heap)
                if live.get(e[2]) != e[1]:
                    continue  # dead
                back.append(e)
                if e[2] not in taken and evictable(e[2]):
                    nxt = e
                    break
            if nxt is not None:
                d = cycle[i] + n * (calls[i] / nxt[0] - 1.0)
                if d > 0:
                    heapq.heappush(ranked, (-d, i, nxt))
        for layer, back in popped.items():  # the live entries passed over, back
            heap = self._heap.setdefault(layer, [])
            for e in back:
                if e[2] not in taken:  # (a victim's dies: the caller removes it)
                    heapq.heappush(heap, e)
        return out


class PyNextUse(Batched):
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
        self._p0 = priors(layers, profile)
        # Per layer, Python floats (a numpy scalar costs more than the arithmetic on it):
        self._weight: list[float] = []  # what one call's use counts now
        self._calls: list[float] = []  # the weights of its calls (and the prior's)
        self._least_count: list[float] = []  # its candidate's count (inf: none)
        self._far = np.zeros(0)  # per layer: L (calls / least count - 1), its candidate's
        # running layer's index -> d(l) per layer, as an array and as Python ints
        self._cycles: dict[int, tuple[np.ndarray, list[int]]] = {}
        self._cycle = np.zeros(0)  # d(l) per layer, the running layer's
        self._cycle_list: list[int] = []  # the same, as Python ints
        # d(l) + L (1 / p - 1) per layer: what victim() ranks (None: to be made again)
        self._dist: np.ndarray | None = np.zeros(0)
        self._changed: set[int] = set()  # layers whose candidate is to be found again
        self._current: int | None = None
        for layer in layers or []:
            self._add_layer(layer)
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
        """The running layer changed: every layer's distance in the cycle with it (the
        distances' array is made again by the next `_refresh`: a layer's handshake moves the
        cycle once, and its victims, if any, come after)."""
        at = self._index.get(self._current, 0)
        got = self._cycles.get(at)
        if got is None:
            n = len(self._layers)
            cycle = (np.arange(n) - at - 1) % n + 1
            got = self._cycles[at] = (cycle, cycle.tolist())
        self._cycle, self._cycle_list = got
        self._dist = None

    def _refar(self, i: int) -> None:
        """Layer i's calls or candidate changed: its L (1 / p - 1) with them."""
        far = self._far[i] = len(self._layers) * (self._calls[i] / self._least_count[i] - 1.0)
        if self._dist is not None:  # (else made whole by the next _refresh)
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
        w = self._weight[i]
        if not w:  # used before any handshake of its layer (a read ahead)
            w = self._weight[i] = 1.0
            self._calls[i] += 1.0
            self._refar(i)
        this_call = self._this_call
        if key in this_call:  # a call counts once, however many tokens pick it
            return
        count = self._count
        c = count.get(key)
        if c is None:
            p0 = self._p0.get(layer)
            c = self._prior * (float(p0[key[1]]) if p0 is not None else 0.5)
        c = count[key] = c + w
        uses = self._uses = self._uses + 1
        self._live[key] = uses
        if layer == self._current:
            # In use by the running call (pinned): in its layer's heap only once the call
            # ends, so that victim() does not step over it at every eviction of the call.
            this_call.add(key)
            return
        heap = self._heap.get(layer)  # _push's, inline (decode's read-ahead: a touch a miss)
        if heap is None or len(heap) >= DEAD_PER_LIVE * len(self._live) + DEAD_SLACK:
            self._push(key)
            return
        heapq.heappush(heap, (c, uses, key))
        self._changed.add(layer)

    def _push(self, key: Key) -> None:
        layer = key[0]
        heap = self._heap.setdefault(layer, [])
        heapq.heappush(heap, (self._count[key], self._live[key], key))
        if len(heap) > DEAD_PER_LIVE * len(self._live) + DEAD_SLACK:  # drop dead entries
            self._heap[layer] = [e for e in heap if self._live.get(e[2]) == e[1]]
            heapq.heapify(self._heap[layer])
        self._changed.add(layer)

    def distance(self, key: Key) -> float:
        """Handshakes until `key` is expected to be used next: d(l) + L (1 / p - 1), d(l)
        counted from the running layer (inf for an expert never seen)."""
        i = self._index.get(key[0])
        count = self._count.get(key)
        if i is None or not count:
            return math.inf
        return self._cycle_list[i] + len(self._layers) * (self._calls[i] / count - 1.0)

    def _end_call(self) -> None:
        if not self._this_call:
            return
        # the call's keys are all of its layer: one heap, one check for dead entries
        heap = self._heap.setdefault(self._current, [])
        live, count = self._live, self._count
        new = [(count[k], n, k) for k in self._this_call if (n := live.get(k)) is not None]
        self._this_call = set()
        if len(new) > len(heap) // 2 or len(heap) > DEAD_PER_LIVE * len(live) + DEAD_SLACK:
            # more than half the heap (a prefill call's ~500; not decode's ~10, where the
            # pushes cost less than a pass over the heap): one heapify of the live entries
            # (the heap's layout is all that differs: its order is total, live numbers unique)
            heap = [e for e in heap if live.get(e[2]) == e[1]] + new
            heapq.heapify(heap)
            self._heap[self._current] = heap
        else:
            for e in new:
                heapq.heappush(heap, e)
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

    def _refresh(self) -> None:
        """The candidates of the layers that changed, found again."""
        least_count = self._least_count
        for layer in self._changed:
            entry = self._top[layer] = self._least(layer)
            i = self._index[layer]
            c = entry[0] if entry else math.inf
            if c != least_count[i]:  # (its calls' changes made its distance as they came)
                least_count[i] = c
                self._refar(i)
        self._changed.clear()
        if self._dist is None:  # the cycle moved since: int + float, as _refar adds them
            self._dist = self._cycle + self._far

    def _kept_candidate(self, evictable) -> Key | None:
        """The candidate of the layer of largest distance, where it is still live and
        evictable (victim's answer then); None otherwise (refreshed candidates assumed)."""
        # calls / count = 1 / p; no candidate: count inf, a distance <= 0, never the largest
        i = int(self._dist.argmax())
        if self._dist[i] <= 0:
            return None
        # A kept candidate may have been used by the running call since (it left the heap
        # for the call's end): not a victim, whenever its layer's candidate was found.
        entry = self._top.get(self._layers[i])
        if entry is not None and self._live.get(entry[2]) == entry[1] and evictable(entry[2]):
            return entry[2]
        return None

    def victim(self, evictable) -> Key | None:
        self._refresh()
        n = len(self._layers)
        if not n:
            return None
        key = self._kept_candidate(evictable)
        if key is not None:
            return key
        if self._dist.max() <= 0:
            return None
        live = self._live
        far = self._dist.copy()  # the candidate is pinned: rank the layers' next ones
        cycle = self._cycle
        instead: dict[int, tuple[float, int, Key]] = {}  # layer index -> its evictable one
        for _ in range(2 * n):
            i = int(far.argmax())
            if far[i] <= 0:
                return None
            layer = self._layers[i]
            entry = instead.get(i) or self._top.get(layer)
            if entry is not None and live.get(entry[2]) == entry[1] and evictable(entry[2]):
                return entry[2]
            entry = self._least(layer, evictable)  # pinned or protected: its next one
            if entry is None:
                far[i] = -np.inf
            else:
                instead[i] = entry
                far[i] = cycle[i] + n * (self._calls[i] / entry[0] - 1.0)
        return None


def core_choice(core: str | None) -> str:
    """ "native" or "python": `core` where given, else STRATA_MLX_NEXTUSE (native by default)."""
    choice = core or os.environ.get("STRATA_MLX_NEXTUSE") or "native"
    if choice not in ("native", "python"):
        raise OptionError(f"STRATA_MLX_NEXTUSE={choice!r}: one of native, python")
    return choice


def native_core(
    layers: list[int] | None, profile: np.ndarray | None, half_life: float, prior: float
) -> Core:
    """A C core of NextUse's state: the cycle's layers and the profile's priors given."""
    c = Core(2.0 ** (1.0 / half_life), prior)
    for layer in layers or []:
        c.add_layer(layer)
    for layer, p0 in priors(layers, profile).items():
        c.set_prior(layer, np.ascontiguousarray(p0))
    return c


class Delegated:
    """A policy whose every call goes to `_core` (a C object, or its Python reference): the
    core's methods are bound on the instance (they shadow the class's below), so a call goes
    straight to C, with no Python frame of this class in between."""

    _core: object
    CALLS = ("touch", "touch_all", "remove", "remove_all", "victim", "victims", "distance")

    def _bind(self, core) -> None:
        self._core = core
        for name in self.CALLS:
            setattr(self, name, getattr(core, name))

    @property
    def current(self) -> int | None:
        return self._core.current

    @current.setter
    def current(self, layer: int | None) -> None:
        self._core.current = layer

    # (the interface, for a check of the class; each instance binds its core's)
    def touch(self, key: Key) -> None:
        self._core.touch(key)

    def touch_all(self, keys: list[Key]) -> None:
        self._core.touch_all(keys)

    def remove(self, key: Key) -> None:
        self._core.remove(key)

    def remove_all(self, keys: list[Key]) -> None:
        self._core.remove_all(keys)

    def victim(self, evictable) -> Key | None:
        return self._core.victim(evictable)

    def victims(self, evictable, keys: list[Key]) -> list[Key]:
        return self._core.victims(evictable, keys)

    def distance(self, key: Key) -> float:
        return self._core.distance(key)


class NextUse(Delegated):
    """PyNextUse's policy, its state and victim search in C (`core="python"` or
    STRATA_MLX_NEXTUSE=python: PyNextUse itself). Live decode calls the policy ~30 times a
    layer and prefill ~1000; in Python the expected-use duel's calls cost ~0.3 ms a decode
    layer on the H200 (docs/benchmarks.md, "NextUse in C")."""

    name = "nextuse"

    def __init__(
        self,
        layers: list[int] | None = None,
        profile: np.ndarray | None = None,
        half_life: float = 256.0,
        prior: float = 64.0,
        core: str | None = None,
    ):
        if core_choice(core) == "python":
            self._bind(PyNextUse(layers, profile, half_life, prior))
        else:
            self._bind(native_core(layers, profile, half_life, prior))


class NextUseRecent(NextUse):
    """NextUse trusting the routing of the last few dozen calls over the profile: a prior of
    4 calls, a half-life of 32 (where the profile misleads: routing with no static hot
    set)."""

    name = "nextuse-recent"

    def __init__(
        self,
        layers: list[int] | None = None,
        profile: np.ndarray | None = None,
        core: str | None = None,
    ):
        super().__init__(layers, profile, half_life=32.0, prior=4.0, core=core)
