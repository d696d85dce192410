"""Victims found for a batch (Arena.allocate_many, a policy's `victims`, the duel's shadows,
cache-sim's misses) are those of one search a key: the same slots, the same victims in the same
order, the same shadow miss counts, whatever is pinned, loading, protected or kept."""

from __future__ import annotations

import numpy as np
import pytest

from strata_mlx.apps import cache_sim
from strata_mlx.format.store import ALIGNMENT
from strata_mlx.stream import arena as arena_module
from strata_mlx.stream import nextuse, policies
from strata_mlx.stream.arena import Arena
from strata_mlx.stream.nextuse import NextUse
from strata_mlx.stream.synthetic_trace import RoutingKnobs, make_trace

LAYERS, EXPERTS, SLOTS = list(range(8)), 24, 40
POLICIES = ["lru", "lfu", "protected", "nextuse", "nextuse-recent", "nextuse-duel", "adaptive"]


@pytest.fixture(autouse=True)
def one_pass_from_two(monkeypatch):
    """Batches of 2 keys or more are asked of the policy and ranked by NextUse in one pass
    (not only the large ones)."""
    monkeypatch.setattr(nextuse, "SMALL_BATCH", 2)
    monkeypatch.setattr(arena_module, "BATCH_FROM", 2)


class OneAtATime:
    """`inner` with only the one-key calls: no `victims`, no `touch_all`."""

    def __init__(self, inner):
        self.inner = inner
        for name in ("phase", "predicted", "distance"):
            if hasattr(inner, name):
                setattr(self, name, getattr(inner, name))

    def touch(self, key):
        self.inner.touch(key)

    def remove(self, key):
        self.inner.remove(key)

    def victim(self, evictable):
        return self.inner.victim(evictable)

    @property
    def current(self):
        return self.inner.current

    @current.setter
    def current(self, layer):
        self.inner.current = layer


def one_at_a_time(policy):
    """`policy` searching one victim a key, in its components and shadows too."""
    if isinstance(policy, policies.Adaptive):
        policy._real = [OneAtATime(p) for p in policy._real]
        policy._shadow = [OneAtATime(p) for p in policy._shadow]
    return OneAtATime(policy)


@pytest.mark.parametrize("eviction", POLICIES + ["nextuse:unlisted"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("small_batch", [2, 16])
def test_allocate_many_gives_the_slots_and_victims_of_one_allocate_a_key(
    eviction, seed, small_batch, monkeypatch
):
    """Hits, misses and read-ahead of later layers (some not run yet) through two arenas, one
    allocating a key at a time: the same slots and victims at every step. "unlisted": the
    policy learns the layers as they come (each new one moves every distance). At a
    SMALL_BATCH of 16, NextUse gives a batch below it the kept candidate of victim's argmax
    where it may go, else ranks the batch in one pass (the loop's top-ups)."""
    monkeypatch.setattr(nextuse, "SMALL_BATCH", small_batch)
    rng = np.random.default_rng(seed)
    profile = rng.random((len(LAYERS), EXPERTS))
    eviction, _, unlisted = eviction.partition(":")
    kw = dict(profile=profile, layers=None if unlisted else LAYERS, hugepages=False)
    one, many = Arena(SLOTS, ALIGNMENT, eviction, **kw), Arena(SLOTS, ALIGNMENT, eviction, **kw)
    one.policy = one_at_a_time(one.policy)
    assert not hasattr(one.policy, "victims")  # (lfu has none: allocate_many loops)
    batches = 0
    for step in range(160):
        layer = LAYERS[step % len(LAYERS)]
        for arena in (one, many):
            arena.set_layer(layer)
            arena.set_phase(step >= 100)
        needed = [(layer, int(e)) for e in sorted(rng.choice(EXPERTS, 14, replace=False))]
        hits = [k for k in needed if one.resident(k)]
        for arena in (one, many):
            arena.touch_all(hits)
            arena.pin([arena.slot_of[k] for k in hits])
        # read-ahead of a later layer (some never run yet: their first use comes here),
        # with layers protected and most residents kept (the loop's top-up), or the misses
        later = LAYERS[(step + 1 + int(rng.integers(3))) % len(LAYERS)]
        if rng.random() < 0.3:  # the layer's own experts unpinned before it ends
            for arena in (one, many):
                arena.unpin_all()
        protect = set(rng.choice(LAYERS, int(rng.integers(3)), replace=False).tolist())
        resident = sorted(one.slot_of)
        keep = {k for k in resident if rng.random() < rng.choice([0.0, 0.5, 0.95])}
        ahead = [(later, int(e)) for e in rng.choice(EXPERTS, 12, replace=False)]
        for keys, p, k in ((needed, None, None), (ahead, protect, keep)):
            keys = [key for key in keys if key not in one.slot_of]
            got = [one.allocate(key, p, k) for key in keys]
            got = got[: got.index(None)] if None in got else got
            assert many.allocate_many(keys, p, k) == got, (step, keys)
            batches += len(got) > 1
            for arena in (one, many):
                arena.pin([s for s, _ in got])
        done = [s for s in sorted(one.loading) if rng.random() < 0.8]  # reads that landed
        for arena in (one, many):
            for s in done:
                arena.loaded(s)
            arena.unpin_all()
        assert one.slot_of == many.slot_of
    assert batches > 20
    if eviction == "nextuse-duel":
        assert many.policy.shadow_misses == one.policy.inner.shadow_misses


class Recorded(OneAtATime):
    """`inner` (with its `victims`, if any) recording every victim it gives into `seq`."""

    def __init__(self, inner, seq: list):
        super().__init__(inner)
        self.seq = seq
        if hasattr(inner, "victims"):
            self.victims = self._victims

    def victim(self, evictable):
        v = self.inner.victim(evictable)
        self.seq.append(v)
        return v

    def _victims(self, evictable, keys):
        got = self.inner.victims(evictable, keys)
        self.seq.extend(got)
        return got


@pytest.mark.parametrize("spec", ["lru", "nextuse", "nextuse-duel", "nextuse-duel-full"])
def test_a_replay_s_victims_and_shadows_are_those_of_one_search_a_key(spec):
    t = make_trace(RoutingKnobs(num_experts=64, layers=6, top_k=6), 512, 24, 256)
    made, seqs = [], [[], []]

    def factory(batched: bool):
        def build(layers=None, profile=None):
            made.append(policies.build(spec, profile, layers))
            inner = made[-1] if batched else one_at_a_time(made[-1])
            return Recorded(inner, seqs[not batched])

        return build

    runs = [cache_sim.replay(t, 120, factory(b)) for b in (True, False)]
    assert runs[0].prefill_misses == runs[1].prefill_misses > 0
    assert runs[0].decode_misses == runs[1].decode_misses > 0
    assert seqs[0] == seqs[1] and len(seqs[0]) > 100
    if isinstance(made[0], policies.Adaptive):
        assert made[0].shadow_misses == made[1].shadow_misses


def test_nextuse_s_victims_stop_after_a_layer_not_seen_yet():
    """A key of a layer the policy has not seen adds a layer to the cycle when touched, which
    moves every distance: the victims after it are those of the longer cycle."""
    differ = 0
    for seed in range(100):
        rng = np.random.default_rng(seed)
        ps = [NextUse(prior=0.01) for _ in range(3)]  # a weak prior: distances far apart
        for step in range(int(rng.integers(4, 14))):
            touched = [(step % 2, int(e)) for e in rng.choice(6, int(rng.integers(1, 6)), False)]
            for p in ps:
                p.current = step % 2
                for key in touched:
                    p.touch(key)
        keys = [(9, e) for e in range(4)]
        one = []
        for key in keys:
            one.append(ps[0].victim(lambda k: k[0] != 9))
            if one[-1] is None:
                break
            ps[0].remove(one[-1])
            ps[0].touch(key)
        batched = []
        while len(batched) < len(keys):  # as the arena: ask again for the rest
            got = ps[1].victims(lambda k: k[0] != 9, keys[len(batched) :])
            for v, k in zip(got, keys[len(batched) :]):
                ps[1].remove(v)
                ps[1].touch(k)
            batched += got
            if not got:
                batched.append(None)
                break
        assert batched == one[: len(batched)] and len(batched) == len(one)
        # one pass over the old cycle (keys of a layer it knows) would not give them
        differ += one != ps[2].victims(lambda k: k[0] != 9, [(0, 99 + e) for e in range(4)])
    assert differ


@pytest.mark.parametrize(
    "make",
    [
        arena_module.LRU,
        lambda: NextUse(core="native"),
        lambda: NextUse(core="python"),
        lambda: policies.NextUseDuel([0, 1], None, core="native"),
        lambda: policies.NextUseDuel([0, 1], None, core="python"),
    ],
    ids=["lru", "nextuse-native", "nextuse-python", "duel-native", "duel-python"],
)
def test_no_keys_have_no_victims(make):
    """A batch of no keys evicts nothing: LRU's walk, which stops at as many victims as keys,
    took every evictable one; NextUse's small batch gave its one candidate (the duel, in C and
    in Python, asks its leader for none)."""
    p = make()
    for step in range(3):
        p.current = step % 2
        for e in range(8):
            p.touch((step % 2, e))
    p.current = None
    assert p.victims(lambda k: True, []) == []
    assert len(p.victims(lambda k: True, [(0, 9)])) == 1
