"""nextuse-duel in C against PyNextUseDuel, the Python reference: the same answers to every
call (victims, batches of victims, distances) and the same shadow misses, leader, sampling
rate and shadow arenas, through random sequences of calls with pinned keys, protected
layers, removals, read-ahead of later layers, miniature and full shadows, arenas that fill
at a few slots or hundreds, and rescaled weights; and the same misses replaying traces."""

import random

import numpy as np
import pytest
from conftest import evictable_as
from strata_mlx._nextuse import Duel

from strata_mlx.apps import cache_sim
from strata_mlx.stream import policies
from strata_mlx.stream.nextuse import NextUse


def state(p):
    return (p.shadow_misses, p.leader, p.rate, p.shadow_slots, p.capacity, p.followed)


def drive(seed, n_layers, n_experts, steps, sample, min_slots, half_life=policies.HALF_LIFE):
    """Random calls to both duels, every answer and the duel's state compared; returns how
    many victims were compared."""
    rng = random.Random(seed)
    layers = list(range(0, 2 * n_layers, 2))
    prof = np.random.default_rng(seed).random((n_layers, n_experts)) if seed % 2 else None
    made = [
        policies.NextUseDuel(layers, prof, sample, min_slots, core=core, half_life=half_life)
        for core in ("native", "python")
    ]
    native, ref = made
    assert isinstance(native._core, Duel) and isinstance(ref._core, policies.PyNextUseDuel)
    # the arena's slots (victims once it holds that many): a few, or half the keys
    cap = rng.choice([8, 40, n_layers * n_experts // 2])
    resident: set = set()
    pinned: set = set()
    compared = 0
    for step in range(steps):
        if step % 5 == 0:  # the next layer's handshake (the cycle, sometimes broken or ended)
            r = rng.random()
            layer = None if r < 0.03 else rng.choice(layers) if r < 0.1 else layers[step % n_layers]
            native.current = ref.current = layer
            assert native.current == ref.current
            assert state(native) == state(ref), step
            pinned = set()
        protect = set(rng.sample(layers, rng.randint(0, 1)))

        def evictable(k, protect=protect, pinned=pinned):
            return k[0] not in protect and k not in pinned

        def either(protect=protect, pinned=pinned, evictable=evictable):
            return evictable_as(rng, resident, protect, pinned, evictable)

        op = rng.random()
        if op < 0.5:  # a call's uses: hits touched, misses given slots (victims where full)
            layer = native.current if native.current is not None else rng.choice(layers)
            keys = list(dict.fromkeys((layer, rng.randrange(n_experts)) for _ in range(8)))
            if rng.random() < 0.15:  # read-ahead of a later layer
                keys = [(rng.choice(layers), rng.randrange(n_experts))]
            hits = [k for k in keys if k in resident]
            misses = [k for k in keys if k not in resident]
            for p in made:
                p.touch_all(hits) if rng.random() < 0.5 else [p.touch(k) for k in hits]
            pinned.update(hits)
            while misses:
                if len(resident) < cap:
                    k = misses.pop(0)
                else:
                    if rng.random() < 0.5:
                        got, want = (
                            native.victims(either(), misses),
                            ref.victims(evictable, misses),
                        )
                    else:
                        got, want = [native.victim(either())], [ref.victim(evictable)]
                    assert got == want, step
                    got = [k for k in got if k is not None]
                    if not got:
                        break  # everything pinned: the misses go without slots
                    compared += len(got)
                    native.remove_all(got)
                    ref.remove_all(got)
                    resident.difference_update(got)
                    given, misses = misses[: len(got)], misses[len(got) :]
                    for p in made:
                        p.touch_all(given)
                    resident.update(given)
                    pinned.update(given)
                    continue
                native.touch(k)
                ref.touch(k)
                resident.add(k)
                pinned.add(k)
        elif op < 0.6 and resident:  # dropped (a failed read, an unneeded read-ahead)
            keys = rng.sample(sorted(resident), min(len(resident), rng.randint(1, 3)))
            for p in made:
                p.remove_all(keys) if rng.random() < 0.5 else [p.remove(k) for k in keys]
            resident.difference_update(keys)
        elif op < 0.7:
            for k in rng.sample(sorted(resident), min(len(resident), 4)) + [(1, 0)]:
                assert native.distance(k) == ref.distance(k), (step, k)
    native.current = ref.current = None
    assert state(native) == state(ref)
    return compared


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("sample, min_slots", [(1 / 16, 0), (0.25, 20), (1.0, 0), (1 / 16, 512)])
def test_the_native_duel_answers_every_call_as_the_reference(seed, sample, min_slots):
    compared = drive(seed, n_layers=4, n_experts=64, steps=1500, sample=sample, min_slots=min_slots)
    assert compared > 100


def test_the_native_duel_rescales_as_the_reference():
    """A half-life of one use: the weight passes 2^500 within a few hundred calls."""
    compared = drive(
        5, n_layers=3, n_experts=32, steps=4000, sample=1.0, min_slots=0, half_life=1.0
    )
    assert compared > 500


@pytest.mark.parametrize("spec", ["nextuse-duel", "nextuse-duel-full"])
def test_replays_miss_alike_through_either_duel(spec, monkeypatch):
    """A store-like trace through the arena's replay, each read-ahead: the same misses, and
    the same shadow misses at the end."""
    from strata_mlx.stream import synthetic_trace as st

    knobs = st.RoutingKnobs(num_experts=128, top_k=8, layers=6, skew=2.0, drift=0.3)
    t = st.make_trace(knobs, prompt_tokens=256, decode_tokens=48, seed=5)
    made = []

    def build(layers=None, profile=None):
        made.append(policies.build(spec, profile, layers))
        return made[-1]

    for read_ahead in ("none", "lookahead", "scored"):
        got = []
        for core in ("native", "python"):
            monkeypatch.setenv("STRATA_MLX_NEXTUSE", core)
            r = cache_sim.replay(t, 200, build, read_ahead)
            made[-1].current = None
            got.append((r.prefill_misses, r.decode_misses, made[-1].shadow_misses))
        assert got[0] == got[1], read_ahead


def test_the_duel_takes_four_distinct_cores_and_good_keys():
    cores = [NextUse([0, 1], core="native")._core for _ in range(4)]
    with pytest.raises(TypeError):
        Duel(cores[0], cores[1], cores[2], "not a core", 0.5, 0, 1024.0)
    with pytest.raises(ValueError, match="distinct"):
        Duel(cores[0], cores[0], cores[2], cores[3], 0.5, 0, 1024.0)
    d = Duel(*cores, 0.5, 0, 1024.0)
    with pytest.raises(TypeError):
        d.touch([0, 1])
    with pytest.raises(ValueError):
        d.touch((0, -1))
    d.touch((0, 1))
    assert d.victim(lambda k: True) == (0, 1)
    assert d.victims(lambda k: False, [(1, 2)]) == []


def test_a_duel_is_made_whole_or_not_at_all():
    """Made without its cores (Duel.__new__), a duel's first touch dereferenced them."""
    with pytest.raises(TypeError):
        Duel.__new__(Duel)
    cores = [NextUse([0, 1], core="native")._core for _ in range(4)]
    d = Duel(*cores, 0.5, 0, 1024.0)
    d.touch((0, 1))
    assert d.victim(lambda k: True) == (0, 1)


def test_a_refused_layer_leaves_the_duel_as_it_was():
    """current = a layer out of range: refused before the ended call reached the shadows and
    before any core was told it (one core told, three not, disagreed ever after)."""
    duels = [policies.NextUseDuel([0, 2, 4], None, 1.0, 0, core="native") for _ in range(2)]
    rng = random.Random(3)
    for step in range(600):
        if step % 6 == 0:
            layer = [0, 2, 4][step // 6 % 3]
            for p in duels:
                p.current = layer
        if step % 4 == 1:  # mid-call: the call's later touches are the running layer's
            with pytest.raises((ValueError, OverflowError)):
                duels[0].current = rng.choice([-1, 1 << 20, 1 << 70])
            assert duels[0].current == duels[1].current
        k = (layer, rng.randrange(24))
        for p in duels:
            p.touch(k)
        if step > 60 and step % 3 == 0:
            got = [p.victims(lambda x, k=k: x != k, [k]) for p in duels]
            assert got[0] == got[1], step
            for p in duels:
                p.remove_all(got[0])
    for p in duels:
        p.current = None
    assert state(duels[0]) == state(duels[1])


@pytest.mark.parametrize("core", ["native", "python"])
@pytest.mark.parametrize("bad", [{"half_life": 0.0}, {"sample": 0.0}, {"sample": -1.0}])
def test_either_duel_refuses_a_half_life_or_sample_not_above_zero(core, bad):
    """The C duel took them (its weights inf, its shadows empty); the reference divided by
    zero, at construction or at the first victim."""
    with pytest.raises(ValueError):
        policies.NextUseDuel([0, 1], None, core=core, min_shadow_slots=0, **bad)


def test_an_evictable_that_calls_back_into_the_policy_is_refused():
    """A victim search holds pointers into the cores' layers and heaps across its evictable
    calls: touching a new layer from evictable moved them under it (a use after free)."""
    duel = policies.NextUseDuel([0, 1, 2, 3], None, 1.0, 0, core="native")
    core = NextUse([0, 1, 2, 3], core="native")._core
    for p in (duel, core):
        for layer in (0, 1, 2, 3, 0):
            p.current = layer
            for e in range(30):
                p.touch((layer, e))

        def evictable(k, p=p):
            p.touch((100 + k[1], 0))
            return True

        with pytest.raises(RuntimeError, match="evictable"):
            p.victim(evictable)
        with pytest.raises(RuntimeError, match="evictable"):
            p.victims(evictable, [(1, 99)] * 20)
        assert p.victim(lambda k: k[0] != 0)[0] != 0  # the policy still answers


@pytest.mark.parametrize("sample", [1 / 16, 1.0])
def test_an_arena_of_no_slots_duels_as_the_reference(sample):
    """A victim asked before any touch: capacity 0, shadows of 0 slots (each miss takes one
    and evicts the ones before it that the call does not use), the rate left at 1."""
    made = [policies.NextUseDuel([0, 1], None, sample, 0, core=c) for c in ("native", "python")]
    for p in made:
        assert p.victim(lambda k: True) is None
        assert (p.capacity, p.shadow_slots, p.rate) == (0, 0, 1.0)
    rng = random.Random(1)
    for step in range(400):
        if step % 4 == 0:
            for p in made:
                p.current = None if step % 36 == 0 else step // 4 % 2
        k = (step // 4 % 2, rng.randrange(16))
        for p in made:
            p.touch(k)
        if step % 7 == 0:
            got = [p.victims(lambda x, k=k: x != k, [k]) for p in made]
            assert got[0] == got[1], step
    for p in made:
        p.current = None
    assert state(made[0]) == state(made[1])
