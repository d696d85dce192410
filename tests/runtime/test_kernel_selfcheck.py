"""strata_mlx.runtime.kernels self-check: a kernel variant that fails on its first resolution (compile
error, wrong results) is replaced by the reference path with one warning; a correct one is used.

Run on the CPU with the host dialect (custom_kernels/host.py), broken deliberately by
monkeypatching its prelude (the text every generated kernel starts with).
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest
from test_kernels import CASES, cpu_reference, make_problem

from custom_kernels import dispatch, host
from strata_mlx.format.quant import switch_glu_reference
from strata_mlx.runtime import kernels

pytestmark = pytest.mark.skipif(host.compiler() is None, reason="no C++ compiler (host dialect)")


@pytest.fixture(autouse=True)
def fresh_variants(monkeypatch):
    # each test resolves its variants afresh: no kernel built or checked by another test
    monkeypatch.setattr(kernels, "_CHECKED", {})
    monkeypatch.setattr(dispatch, "_CACHE", {})


def _problem(case="affine4-g64"):
    layout, recs = CASES[case](4, 256, 256, 1)
    x, arena, slots, idx = make_problem(layout, recs, n_tokens=3, k=2, dtype=mx.float32, seed=2)
    return layout, (x, arena, slots, idx)


def _resolve(layout):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn = kernels.expert_kernel(layout, "host")
    return fn, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize("case", ["affine4-g64", "IQ2_XS+Q2_K-down"])
def test_correct_kernel_passes_without_warning(case, monkeypatch):
    layout, (x, arena, slots, idx) = _problem(case)
    calls = []
    real = dispatch.ExpertKernels.__call__
    monkeypatch.setattr(
        dispatch.ExpertKernels, "__call__", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    fn, warned = _resolve(layout)
    assert warned == []
    n_check = len(calls)
    assert n_check >= 2  # decode and prefill problems
    y = fn(x, arena, slots, idx)
    assert len(calls) == n_check + 1  # the kernel, not the reference, computed y
    ref = cpu_reference(x, arena[slots], layout, idx)  # float32 on the CPU, as the host kernel
    np.testing.assert_allclose(np.array(y), np.array(ref), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "breakage,why",
    [
        # wrong results: SiLU's exp off by a factor (the decode kernels compute SiLU)
        (lambda p: p.replace("return std::exp(v);", "return std::exp(0.5f * v);"), "max error"),
        # compile error
        (lambda p: p + "#error deliberately broken kernel\n", "failed to compile"),
    ],
    ids=["wrong-results", "compile-error"],
)
def test_broken_kernel_falls_back_with_one_warning(monkeypatch, breakage, why):
    broken = breakage(host.PRELUDE)
    assert broken != host.PRELUDE
    monkeypatch.setattr(host, "PRELUDE", broken)
    layout, (x, arena, slots, idx) = _problem("IQ3_S+Q4_K-down")
    fn, warned = _resolve(layout)
    assert len(warned) == 1, warned
    (msg,) = warned
    assert "\n" not in msg
    assert "gguf IQ3_S+Q4_K" in msg and "on host" in msg and why in msg, msg
    assert "reference" in msg
    # the reference path, bit for bit
    y = fn(x, arena, slots, idx)
    ref = switch_glu_reference(x, arena[slots], layout, idx)
    np.testing.assert_array_equal(np.array(y), np.array(ref))
    # once per variant: resolving it again (another layer) neither re-checks nor warns
    fn2, warned2 = _resolve(layout)
    assert warned2 == []
    np.testing.assert_array_equal(np.array(fn2(x, arena, slots, idx)), np.array(ref))


def test_kernel_that_raises_falls_back(monkeypatch):
    def boom(*a, **kw):
        raise RuntimeError("launch failed: too many resources requested")

    monkeypatch.setattr(dispatch.ExpertKernels, "__call__", boom)
    layout, (x, arena, slots, idx) = _problem()
    fn, warned = _resolve(layout)
    assert len(warned) == 1 and "affine 4-bit g64 on host" in warned[0]
    assert "RuntimeError: launch failed" in warned[0]
    ref = switch_glu_reference(x, arena[slots], layout, idx)
    np.testing.assert_array_equal(np.array(fn(x, arena, slots, idx)), np.array(ref))


def test_mismatch_tolerance():
    ref = mx.array(np.random.default_rng(0).standard_normal((4, 2, 64)).astype(np.float32))
    assert kernels._mismatch(ref, ref, mx.float16) is None
    assert kernels._mismatch(ref * (1 + 2.0**-11), ref, mx.float16) is None  # rounding
    assert "max error" in kernels._mismatch(ref * 1.1, ref, mx.float16)
    assert kernels._mismatch(ref * np.nan, ref, mx.float16) == "non-finite output"
    assert "shape" in kernels._mismatch(ref[:1], ref, mx.float16)


def test_format_names():
    assert kernels.format_name(CASES["affine3-g64"](1, 256, 256, 0)[0]) == "affine 3-bit g64"
    assert kernels.format_name(CASES["Q4_K"](1, 256, 256, 0)[0]) == "gguf Q4_K"
    assert kernels.format_name(CASES["IQ2_XS+Q2_K-down"](1, 256, 256, 0)[0]) == "gguf IQ2_XS+Q2_K"
