"""NextUse's core in C against PyNextUse, the Python reference: the same answers to every
call (victims, batches of victims, distances to the last bit) through random sequences of
calls, layers visited in a cycle and out of it, pinned keys, protected layers, removals,
profiles and rescaled weights, and the same misses replaying traces."""

import random

import numpy as np
import pytest
from conftest import evictable_as

from strata_mlx.apps import cache_sim
from strata_mlx.config import OptionError
from strata_mlx.stream import policies
from strata_mlx.stream.nextuse import NextUse, NextUseRecent, PyNextUse


def pair(layers, profile, half_life=256.0, prior=64.0):
    native = NextUse(layers, profile, half_life, prior, core="native")
    ref = PyNextUse(layers, profile, half_life, prior)
    assert type(native._core).__name__ == "Core"
    return native, ref


def each(policies, name: str, keys, batched: bool) -> None:
    """`name`_all(keys) on each policy, or `name`(key) a key."""
    for p in policies:
        if batched:
            getattr(p, f"{name}_all")(keys)
        else:
            for k in keys:
                getattr(p, name)(k)


def drive(seed, n_layers, n_experts, steps, half_life=256.0, profile=True, prior=64.0):
    """Random calls to both, every answer compared; returns how many victims were compared."""
    rng = random.Random(seed)
    layers = list(range(0, 2 * n_layers, 2))  # MoE layers between dense ones
    prof = np.random.default_rng(seed).random((n_layers, n_experts)) if profile else None
    if prof is not None:
        prof[0] = 0.0  # a layer whose profile is all zeros: no prior
    native, ref = pair(layers, prof, half_life, prior)
    resident: set = set()
    pinned: set = set()
    compared = 0
    for step in range(steps):
        if step % 7 == 0:  # the cycle, sometimes broken, sometimes ended
            r = rng.random()
            layer = (
                None if r < 0.03 else rng.choice(layers) if r < 0.15 else layers[step % len(layers)]
            )
            if r > 0.98:  # a layer outside the profile's cycle
                layer = 2 * n_layers + 1
            native.current = ref.current = layer
            assert native.current == ref.current
            pinned = set()
        protect = set(rng.sample(layers, rng.randint(0, 2)))

        def evictable(k, protect=protect, pinned=pinned):
            return k[0] not in protect and k not in pinned

        def either(protect=protect, pinned=pinned, evictable=evictable):
            return evictable_as(rng, resident, protect, pinned, evictable)

        op = rng.random()
        if op < 0.35:  # a call's uses
            layer = native.current if native.current is not None else rng.choice(layers)
            keys = [(layer, rng.randrange(n_experts)) for _ in range(rng.randint(1, 12))]
            each((native, ref), "touch", keys, batched=rng.random() < 0.5)
            resident.update(keys)
            pinned.update(keys)
        elif op < 0.45:  # read-ahead of a later layer's experts
            key = (rng.choice(layers + [2 * n_layers + 3]), rng.randrange(n_experts))
            native.touch(key)
            ref.touch(key)
            resident.add(key)
        elif op < 0.55 and resident:  # evicted or dropped
            keys = rng.sample(sorted(resident), min(len(resident), rng.randint(1, 4)))
            each((native, ref), "remove", keys, batched=rng.random() < 0.5)
            resident.difference_update(keys)
        elif op < 0.75:
            got, want = native.victim(either()), ref.victim(evictable)
            assert got == want, step
            compared += 1
            if got is not None and rng.random() < 0.7:
                native.remove(got)
                ref.remove(got)
                resident.discard(got)
        elif op < 0.9:
            layer = rng.choice(layers + [2 * n_layers + 5])
            keys = [(layer, rng.randrange(n_experts)) for _ in range(rng.choice([3, 20, 60]))]
            keys = list(dict.fromkeys(k for k in keys if k not in resident))
            got, want = native.victims(either(), keys), ref.victims(evictable, keys)
            assert got == want, step
            compared += len(got)
            native.remove_all(got)
            ref.remove_all(got)
            resident.difference_update(got)
            given = keys[: len(got)]
            native.touch_all(given)
            ref.touch_all(given)
            resident.update(given)
        else:
            for k in rng.sample(sorted(resident), min(len(resident), 5)) + [(1, 0), (0, 10**5)]:
                a, b = native.distance(k), ref.distance(k)
                assert a == b or (a != a and b != b), (step, k, a, b)
    return compared


@pytest.mark.parametrize("seed", range(6))
def test_the_native_core_answers_every_call_as_the_reference(seed):
    compared = drive(seed, n_layers=6, n_experts=24, steps=3000, profile=seed % 2 == 0)
    assert compared > 500


def test_the_native_core_breaks_ties_as_the_reference():
    """No aging (a weight of 1 a call), no profile, small counts (short runs of few
    experts): layers' distances tie at the largest in ~1-2 % of victim calls; the lowest layer
    index wins in both."""
    compared = 0
    for seed in range(300):
        for n_layers, prior in ((2, 0.0), (4, 2.0)):
            compared += drive(seed, n_layers, 4, 40, float("inf"), profile=False, prior=prior)
    assert compared > 5000


def test_the_native_core_rescales_as_the_reference():
    """A half-life of one call doubles a layer's weight each call: past 2^500 both rescale."""
    compared = drive(11, n_layers=3, n_experts=16, steps=12000, half_life=1.0)
    assert compared > 1000


def test_replays_miss_alike_through_either_core():
    """A store-like trace through the arena's replay: the same misses, prefill and decode,
    for both settings and the duel over them."""
    from strata_mlx.stream import synthetic_trace as st

    knobs = st.RoutingKnobs(num_experts=64, top_k=6, layers=6, skew=2.0, drift=0.3)
    t = st.make_trace(knobs, prompt_tokens=128, decode_tokens=48, seed=3)

    def made(cls, core, **kw):
        return lambda layers=None, profile=None: cls(layers, profile, core=core, **kw)

    for cls in (NextUse, NextUseRecent):
        for read_ahead in ("none", "lookahead", "scored"):
            a = cache_sim.replay(t, 100, made(cls, "native"), read_ahead)
            b = cache_sim.replay(t, 100, made(cls, "python"), read_ahead)
            assert (a.prefill_misses, a.decode_misses) == (b.prefill_misses, b.decode_misses)


def test_the_duel_misses_alike_through_either_core(monkeypatch):
    from strata_mlx.stream import synthetic_trace as st

    knobs = st.RoutingKnobs(num_experts=64, top_k=6, layers=6, skew=2.0, drift=0.3)
    t = st.make_trace(knobs, prompt_tokens=128, decode_tokens=48, seed=4)
    got = []
    for core in ("native", "python"):
        monkeypatch.setenv("STRATA_MLX_NEXTUSE", core)
        r = cache_sim.replay(t, 100, "nextuse-duel-full")
        got.append((r.prefill_misses, r.decode_misses))
    assert got[0] == got[1]


def test_a_bad_core_choice_is_one_line(monkeypatch):
    monkeypatch.setenv("STRATA_MLX_NEXTUSE", "fortran")
    with pytest.raises(OptionError, match="STRATA_MLX_NEXTUSE='fortran'"):
        policies.build("nextuse", layers=[0])


def test_bad_keys_raise_instead_of_corrupting():
    p = NextUse([0, 1], core="native")
    with pytest.raises(TypeError):
        p.touch([0, 1])
    with pytest.raises(ValueError):
        p.touch((0, -1))
    p.touch((0, 1))
    assert p.victim(lambda k: True) == (0, 1)
