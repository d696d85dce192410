"""Eviction policies as plug-ins: the interface a policy implements, how one is named or
passed (to `load()`, `--eviction`, `strata-mlx cache-sim --policy`), and the candidate
policies measured against the arena's built-ins by trace replay.

A policy is any object with three methods; keys are (layer, expert) pairs:

    touch(key)          key was used, or was just given a slot: it is resident
    remove(key)         key left the arena (evicted, or its read was dropped or failed)
    victim(evictable)   -> the resident key to evict, one for which evictable(key) is true
                        (pinned and in-flight slots are not), or None if there is none

and optional ones the arena and the replay set or call:

    current             an attribute: the layer whose handshake runs now (set before its
                        lookups; a forward pass visits the MoE layers in order; in
                        pipelined decode a layer's check is its handshake)
    phase(decoding)     generation moved into its decode steps (True) or out of them
                        (False: a prompt's chunks and its last token), told at each change;
                        until the first, no phase was told (a script's own model calls)
    predicted(layer, experts)
                        the experts lookahead predicts `layer` will use, told in decode
                        once the running layer's misses have slots, before their read-ahead
                        (by both decoders, and by cache-sim from the trace's predictions)
    distance(key)       -> handshakes until the resident `key` is expected to be used next;
                        scored read-ahead (strata_mlx.stream.prediction.ExpectedUse) reads a
                        predicted expert only into the slot of a victim expected later

A policy is given as a built-in name (arena.POLICIES), a candidate's name here, a class or
factory, or "module:Class" (a file module.py on the import path, or a dotted module). A
class is constructed with those of the keywords `layers` (the MoE layers in forward order)
and `profile` (the store's routing profile, [layers, experts] counts, or None) that its
__init__ names; a class taking neither is constructed with no arguments.

A policy decides only which resident expert goes: it never reads files, never sees weights,
and cannot change a model's outputs (the tests check them bit-identical under every policy).
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from .._nextuse import Duel
from ..config import OptionError
from .arena import LRU, POLICIES, Key, ScoredPolicy, make_policy, remove_all, touch_all
from .nextuse import Delegated, NextUse, NextUseRecent, core_choice


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


# Adaptive's half-life of its shadows' misses, in uses.
HALF_LIFE = 1024.0


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
        half_life: float = HALF_LIFE,
        sample: float = 1.0,
        min_shadow_slots: int = 0,
    ):
        if not (half_life > 0 and sample > 0):  # the shadows' growth divides by both
            raise ValueError(f"half_life {half_life} and sample {sample} must be above 0")
        self.components = components
        self._real = [build(c, profile, layers) for c in components]
        self._shadow = [build(c, profile, layers) for c in components]
        self._every = [*self._real, *self._shadow]  # told the running layer
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
        self._order = list(self._real)  # the leader's real policy first, then the others
        self._current: int | None = None
        self._call: dict[Key, None] = {}  # the running call's uses, in order, for the shadows

    @property
    def shadow_misses(self) -> list[float]:
        """Each component's misses in its shadow arena, weighted (later ones weigh more)."""
        return list(self._misses)

    @property
    def followed(self) -> tuple[int, int]:
        """(keys the shadows follow, keys whose sample was asked)."""
        return sum(self._sampled.values()), len(self._sampled)

    @property
    def current(self) -> int | None:
        return self._current

    @current.setter
    def current(self, layer: int | None) -> None:
        self._shadow_call()
        self._current = layer
        for p in self._every:
            p.current = layer

    def touch(self, key: Key) -> None:
        self._resident.add(key)
        for p in self._real:
            p.touch(key)
        self._call[key] = None

    def touch_all(self, keys: list[Key]) -> None:
        """`touch` each of `keys`, in order: each component's `touch_all` where it has one
        (the components are independent: one after another is the order of each)."""
        self._resident.update(keys)
        for p in self._real:
            touch_all(p, keys)
        self._call.update(dict.fromkeys(keys))

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
        uses, self._call = self._call, {}
        if self.rate < 1.0:  # (the sample sorted, not every use: the same order)
            follows, sampled = self._follows, self._sampled  # (a call only for a new key)
            uses = [k for k in uses if (s := sampled.get(k)) or (s is None and follows(k))]
        uses = sorted(uses)  # as a layer's distinct experts come
        if not uses:
            return
        self._weight *= self._growth ** len(uses)  # later misses weigh more: old ones fade
        pinned = set(uses)
        for i, (p, held) in enumerate(zip(self._shadow, self._held)):
            hits = [k for k in uses if k in held]
            touch_all(p, hits)
            misses = [k for k in uses if k not in held]
            for _ in misses:  # one addition a miss, as the sums were made
                self._misses[i] += self._weight
            self._shadow_misses(p, held, misses, lambda k: k not in pinned)
        if self._weight > 2.0**500:  # rescale before floats overflow
            self._misses = [m * 2.0**-500 for m in self._misses]
            self._weight *= 2.0**-500
        self._lead()

    def _lead(self) -> None:
        """The leader from the shadows' misses (which change only as a call ends), and
        the order in which victim() asks the real policies."""
        self.leader = min(range(len(self._misses)), key=self._misses.__getitem__)
        self._order = [self._real[self.leader]] + [
            p for i, p in enumerate(self._real) if i != self.leader
        ]

    def _shadow_misses(self, p, held: set[Key], misses: list[Key], evictable) -> None:
        """A shadow's misses given slots, each evicting its policy's victim where the shadow
        is full; one `victims` call for all the misses that evict, where it has one."""
        slots, batch, j = self.shadow_slots, getattr(p, "victims", None), 0
        while j < len(misses):
            if slots is None or len(held) < slots or batch is None:
                if slots is not None and len(held) >= slots:
                    victim = p.victim(evictable)
                    if victim is not None:
                        p.remove(victim)
                        held.discard(victim)
                held.add(misses[j])
                p.touch(misses[j])
                j += 1
                continue
            victims = batch(evictable, misses[j:]) or [None]  # none: the miss takes a slot
            given = misses[j : j + len(victims)]
            for victim in victims:
                if victim is not None:
                    p.remove(victim)
                    held.discard(victim)
            held.update(given)
            touch_all(p, given)
            j += len(given)

    def remove(self, key: Key) -> None:
        self._resident.discard(key)
        for p in self._real:
            p.remove(key)

    def remove_all(self, keys: list[Key]) -> None:
        """`remove` each of `keys`: each component's `remove_all` where it has one."""
        self._resident.difference_update(keys)
        for p in self._real:
            remove_all(p, keys)

    def distance(self, key: Key) -> float:
        """The first component's with an estimate of expected next use (NextUse.distance);
        inf when none has one."""
        for p in self._real:
            if hasattr(p, "distance"):
                return p.distance(key)
        return math.inf

    def victim(self, evictable) -> Key | None:
        if self.capacity is None:
            self._learn_capacity()
        for p in self._order:
            key = p.victim(evictable)
            if key is not None:
                return key
        return None

    def victims(self, evictable, keys: list[Key]) -> list[Key]:
        """The victims of successive `victim` calls for `keys` (each removed, its slot given
        to the next of `keys`): the leader's `victims` (the leader does not change before
        the call ends), or one victim where the leader has none or no `victims`; none for no
        keys (LRU's walk, stopping at as many victims as keys, would take every key)."""
        if not keys:
            return []
        if self.capacity is None:
            self._learn_capacity()
        batch = getattr(self._order[0], "victims", None)
        got = batch(evictable, keys) if batch is not None else []
        if got:
            return got
        key = self.victim(evictable)
        return [] if key is None else [key]


class PyNextUseDuel(Adaptive):
    """NextUseDuel's policy in Python (Adaptive over nextuse, nextuse-recent and lru): the
    reference the C duel is tested against (STRATA_MLX_NEXTUSE=python runs it)."""

    name = "nextuse-duel"

    def __init__(
        self,
        layers: list[int] | None = None,
        profile: np.ndarray | None = None,
        sample: float = 1 / 16,
        min_shadow_slots: int = 512,
        half_life: float = HALF_LIFE,
    ):
        super().__init__(
            layers,
            profile,
            components=NextUseDuel.components,
            half_life=half_life,
            sample=sample,
            min_shadow_slots=min_shadow_slots,
        )


class NextUseDuel(Delegated):
    """Adaptive over NextUse's two settings, the profile trusted (`nextuse`) or recent
    routing (`nextuse-recent`), and LRU (where the arena holds a pass's working set, LRU's
    recency guesses better than either), whichever would have missed least lately.

    Its shadows are miniatures: they follow 1/16 of the keys, and at least 512 slots'
    worth (below 512 slots, every key). Replayed, that keeps the full shadows' choice
    within a few points of the gap closed on every trace of docs/research.md while the
    policy's Python a miss falls by two thirds; `nextuse-duel-full` keeps full shadows.

    The policy runs in C (strata_mlx._nextuse.Duel, the six components' state and every
    call: the same victims and shadow misses as PyNextUseDuel, tests/stream/
    test_duel_native.py); `core="python"` or STRATA_MLX_NEXTUSE=python runs PyNextUseDuel."""

    name = "nextuse-duel"
    components = ("nextuse", "nextuse-recent", "lru")

    def __init__(
        self,
        layers: list[int] | None = None,
        profile: np.ndarray | None = None,
        sample: float = 1 / 16,
        min_shadow_slots: int = 512,
        core: str | None = None,
        half_life: float = HALF_LIFE,
    ):
        if core_choice(core) == "python":
            d = PyNextUseDuel(layers, profile, sample, min_shadow_slots, half_life)
        else:
            cores = [
                cls(layers, profile, core="native")._core
                for _ in ("real", "shadow")
                for cls in (NextUse, NextUseRecent)
            ]
            d = Duel(*cores, sample, min_shadow_slots, half_life)
        self._bind(d)

    @property
    def shadow_misses(self) -> list[float]:
        """Each component's misses in its shadow arena, weighted (later ones weigh more)."""
        return self._core.shadow_misses

    @property
    def leader(self) -> int:
        """The component followed now."""
        return self._core.leader

    @property
    def rate(self) -> float:
        """The share of keys the shadows follow."""
        return self._core.rate

    @property
    def shadow_slots(self) -> int | None:
        return self._core.shadow_slots

    @property
    def capacity(self) -> int | None:
        return self._core.capacity

    @property
    def followed(self) -> tuple[int, int]:
        """(keys the shadows follow, keys whose sample was asked)."""
        return self._core.followed


class NextUseDuelFull(NextUseDuel):
    """`nextuse-duel` with shadows that follow every key (the duel before its shadows were
    sampled: the reference the miniature shadows are measured against)."""

    name = "nextuse-duel-full"

    def __init__(
        self,
        layers: list[int] | None = None,
        profile: np.ndarray | None = None,
        core: str | None = None,
    ):
        super().__init__(layers, profile, sample=1.0, core=core)


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
    except (ImportError, ValueError) as e:  # (ValueError: an empty or relative module name)
        raise OptionError(f"{flag} {spec!r}: cannot import {module!r} ({e})", "eviction") from None
    except AttributeError:
        raise OptionError(f"{flag} {spec!r}: {module} has no {attr}", "eviction") from None
    if not callable(obj):
        raise OptionError(f"{flag} {spec!r}: {attr} is not a class", "eviction")
    return spec, obj


def _check_methods(obj, spec, flag: str) -> None:
    missing = [m for m in ("touch", "remove", "victim") if not callable(getattr(obj, m, None))]
    if missing:
        raise OptionError(f"{flag} {spec!r}: a policy needs {', '.join(missing)}", "eviction")


def _arguments(factory, spec, flag: str, given: dict) -> dict:
    """What of `given` the factory takes; an OptionError where it needs anything else (a
    function that is no policy's factory, such as os:system)."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # no signature to read: nothing is passed
        return {}
    params = signature.parameters
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in given.items() if takes_all or k in params}
    try:
        signature.bind(**kwargs)
    except TypeError as e:
        raise OptionError(
            f"{flag} {spec!r}: not a policy's class or factory ({e}; it may take only "
            "`layers` and `profile`)",
            "eviction",
        ) from None
    return kwargs


def check(spec, flag: str = "eviction") -> None:
    """That `spec` names a policy, and a class given has the three methods and takes what
    build() passes (before a load)."""
    _, factory = resolve(spec, flag)
    if isinstance(factory, type):
        _check_methods(factory, spec, flag)
    if not (isinstance(spec, str) and spec in POLICIES):
        _arguments(factory, spec, flag, {"layers": None, "profile": None})


def build(spec, profile: np.ndarray | None = None, layers: list[int] | None = None):
    """A fresh policy for one arena (see the module docstring for the keywords it gets)."""
    if isinstance(spec, str) and spec in POLICIES:
        return make_policy(spec, profile, layers)
    _, factory = resolve(spec)
    policy = factory(
        **_arguments(factory, spec, "eviction", {"layers": layers, "profile": profile})
    )
    _check_methods(policy, spec, "eviction")
    return policy
