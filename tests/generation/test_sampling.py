"""strata_mlx.generation.sampling against mlx-lm's own sample_utils as the oracle: the same filtered
distributions, the same logits after each processor, the same tokens from the same seed (also
through a whole generation, against mlx-lm's generate_step on mlx-lm's model of the same
store); min-p and the repetition penalty against hand-computed values on a tiny vocabulary."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from conftest import prompt_ids

import strata_mlx
from strata_mlx.config import OptionError
from strata_mlx.generation import sampling as S

M = pytest.importorskip("mlx_lm.sample_utils")


def logprobs(v: int = 64, seed: int = 0, ties: bool = True) -> mx.array:
    x = np.random.default_rng(seed).normal(size=(1, v)).astype(np.float32) * 2
    if ties:
        x[0, 1:4] = x[0, 0]  # ties at the edge of a filter keep or drop together
    x = mx.array(x)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def same(a: mx.array, b: mx.array) -> None:
    np.testing.assert_array_equal(np.array(a), np.array(b))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_filters_keep_what_mlx_lm_keeps(seed):
    lp = logprobs(seed=seed)
    for p in (0.05, 0.3, 0.9, 0.99):
        same(S.apply_top_p(lp, p), M.apply_top_p(lp, p))
    for p in (0.01, 0.1, 0.5, 1.0):
        for keep in (1, 3, 10):
            same(S.apply_min_p(lp, p, keep), M.apply_min_p(lp, p, keep))
    for k in (1, 2, 5, 63):
        same(S.apply_top_k(lp, k), M.apply_top_k(lp, k))
    for threshold in (0.01, 0.05, 0.2):
        mx.random.seed(seed)
        ours = S.apply_xtc(lp, 0.5, threshold, [3, 7])
        mx.random.seed(seed)
        same(ours, M.apply_xtc(lp, 0.5, threshold, [3, 7]))


SAMPLERS = [
    dict(temp=1.0),
    dict(temp=0.7, top_p=0.9),
    dict(temp=1.0, min_p=0.05),
    dict(temp=1.0, min_p=0.3, min_tokens_to_keep=4),
    dict(temp=1.5, top_k=5),
    dict(temp=1.2, top_p=0.8, min_p=0.02, top_k=10),
    dict(temp=1.0, xtc_probability=0.5, xtc_threshold=0.05, xtc_special_tokens=[0, 5]),
]


@pytest.mark.parametrize("kw", SAMPLERS, ids=lambda kw: ",".join(kw))
def test_same_seed_same_tokens_as_mlx_lm(kw):
    lp = logprobs(seed=4)
    ours, theirs = S.make_sampler(**kw), M.make_sampler(**kw)
    mx.random.seed(11)
    a = [ours(lp).item() for _ in range(40)]
    mx.random.seed(11)
    b = [theirs(lp).item() for _ in range(40)]
    assert a == b
    assert len(set(a)) > 1  # it samples


def test_greedy_readings():
    lp = logprobs(seed=5, ties=False)
    best = mx.argmax(lp, axis=-1).item()
    assert S.make_sampler(0.0, top_k=3)(lp).item() == best
    assert S.make_sampler(1.0, top_p=0.0)(lp).item() == best  # mlx-lm: no filter at 0
    assert S.make_sampler(1.0, top_k=1)(lp).item() == best
    assert S.make_sampler(1.0, min_p=1.0)(lp).item() == best
    # top_k at or above the vocabulary keeps everything (mlx-lm raises)
    mx.random.seed(2)
    a = [S.make_sampler(1.0, top_k=64)(lp).item() for _ in range(20)]
    mx.random.seed(2)
    assert a == [S.make_sampler(1.0)(lp).item() for _ in range(20)]
    # so does min_p keeping that many tokens (argpartition refused it: a crash mid-generation)
    mx.random.seed(2)
    assert a == [
        S.make_sampler(1.0, min_p=0.9, min_tokens_to_keep=100)(lp).item() for _ in range(20)
    ]


def test_min_p_by_hand():
    probs = [0.5, 0.3, 0.15, 0.04, 0.01]
    lp = mx.log(mx.array([probs]))
    # min_p 0.2 of the top 0.5 is 0.1: the first three stay, renormalised
    kept = mx.softmax(S.apply_min_p(lp, 0.2), axis=-1)
    np.testing.assert_allclose(np.array(kept)[0], [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0, 0])
    # min_tokens_to_keep 4 keeps the fourth too
    kept = mx.softmax(S.apply_min_p(lp, 0.2, 4), axis=-1)
    np.testing.assert_allclose(np.array(kept)[0], [p / 0.99 for p in probs[:4]] + [0], rtol=1e-6)
    # the sampler draws from that distribution: 4,000 draws within 3 sigma of it
    sample = S.make_sampler(1.0, min_p=0.2)
    mx.random.seed(0)
    draws = np.array(sample(mx.broadcast_to(lp, (4000, 5))))
    freq = np.bincount(draws, minlength=5) / 4000
    expect = np.array([0.5, 0.3, 0.15, 0, 0]) / 0.95
    assert np.all(np.abs(freq - expect) <= 3 * np.sqrt(expect * (1 - expect) / 4000) + 1e-9)


def test_repetition_penalty_by_hand():
    logits = mx.array([[2.0, -1.0, 0.5, 3.0]])
    tokens = mx.array([0, 1, 1])
    out = S.make_repetition_penalty(2.0, 20)(tokens, mx.array(logits))
    same(out, mx.array([[1.0, -2.0, 0.5, 3.0]]))  # positive / 2, negative * 2, once each
    out = S.make_repetition_penalty(2.0, 1)(tokens, mx.array(logits))
    same(out, mx.array([[2.0, -2.0, 0.5, 3.0]]))  # only the last token counts


def test_processors_equal_mlx_lm():
    rng = np.random.default_rng(3)
    logits = mx.array(rng.normal(size=(1, 64)).astype(np.float32))
    tokens = mx.array(rng.integers(0, 64, size=40).tolist() + [7, 7, 7])
    cases = [
        dict(logit_bias={3: 5.0, 9: -100.0, 7: 1.5}),
        dict(repetition_penalty=1.3),
        dict(repetition_penalty=0.8, repetition_context_size=5),
        dict(presence_penalty=0.5, presence_context_size=10),
        dict(frequency_penalty=0.4, frequency_context_size=30),
        dict(logit_bias={1: 2.0}, repetition_penalty=1.1, frequency_penalty=0.2),
    ]
    for kw in cases:
        ours, theirs = S.make_logits_processors(**kw), M.make_logits_processors(**kw)
        assert len(ours) == len(theirs)
        a, b = mx.array(logits), mx.array(logits)
        for p, q in zip(ours, theirs, strict=True):
            a, b = p(tokens, a), q(tokens, b)
        same(a, b)
        assert not np.array_equal(np.array(a), np.array(logits)), kw
    assert S.make_logits_processors(repetition_penalty=0) == []  # mlx-lm: 0 is off


def test_out_of_range_options_are_refused():
    bad = [
        dict(temp=-1),
        dict(top_p=1.5),
        dict(min_p=-0.1),
        dict(min_p=2),
        dict(top_k=-1),
        dict(top_k=2.5),
        dict(min_tokens_to_keep=0),
        dict(min_tokens_to_keep=1 << 31),  # MLX partitions with 32-bit integers
        dict(top_k=1 << 31),
        dict(xtc_probability=2),
        dict(xtc_threshold=0.9),
    ]
    for kw in bad:
        with pytest.raises(OptionError) as e:
            S.make_sampler(**{"temp": 1.0, **kw})
        assert e.value.param == next(iter(kw)), kw
    for kw, param in [
        (dict(repetition_penalty=-1), "repetition_penalty"),
        (dict(repetition_penalty=math.nan), "repetition_penalty"),
        (dict(repetition_context_size=0), "repetition_context_size"),
        (dict(repetition_context_size=1 << 31), "repetition_context_size"),  # 32-bit slices
        (dict(presence_context_size=1 << 40), "presence_context_size"),
        (dict(frequency_context_size=1 << 40), "frequency_context_size"),
        (dict(logit_bias={128: 1.0}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={1: 101.0}), "logit_bias"),
        (dict(logit_bias=[1, 2]), "logit_bias"),
    ]:
        with pytest.raises(OptionError) as e:
            S.make_logits_processors(**kw, vocab_size=128)
        assert e.value.param == param, kw
    with pytest.raises(OptionError, match="--top-k"):
        S.SamplingOptions(top_k=-2).check(cli=True)


def test_generation_draws_what_mlx_lm_draws(store):
    """A seeded generation with top-k, min-p, top-p, logit bias and a repetition penalty: our
    stream_generate on the store and mlx-lm's generate_step on mlx-lm's own model of the same
    store (logits bit-identical, tests/apps/test_baseline.py) give the same tokens."""
    from mlx_lm.generate import generate_step

    from strata_mlx.apps.baseline import load_mlx_lm
    from strata_mlx.format.store import load_manifest

    path = store("qwen3_moe", quantize=True, bits=4)
    ref = load_mlx_lm(path)
    m = load_manifest(path)
    model, _ = strata_mlx.load(path, arena_gb=m.expert_bytes / 1024**3, read_ahead="demand")
    ids = prompt_ids(12, seed=21)
    sampler_kw = dict(temp=0.9, top_p=0.95, min_p=0.02, top_k=40)
    proc_kw = dict(logit_bias={5: 2.0, 6: -3.0}, repetition_penalty=1.3)
    for seed in (0, 1):
        ours = [
            r.token
            for r in strata_mlx.stream_generate(
                model,
                None,
                ids,
                max_tokens=12,
                seed=seed,
                sampler=S.make_sampler(**sampler_kw),
                logits_processors=S.make_logits_processors(**proc_kw),
            )
        ]
        mx.random.seed(seed)
        theirs = [
            t
            for t, _ in generate_step(
                mx.array(ids),
                ref,
                max_tokens=12,
                sampler=M.make_sampler(**sampler_kw),
                logits_processors=M.make_logits_processors(**proc_kw),
            )
        ]
        assert ours == theirs, seed
    model.expert_cache.close()
