"""The native CPU expert loops (strata_mlx.runtime.cpu_experts): bit for bit the reference
path's outputs (format.quant.switch_glu_reference) for every affine width they take, decode
and prefill pair counts, a float projection beside them; chosen automatically on the CPU,
never when the reference is forced; generation through them is the reference's, token and
log-probability."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import prompt_ids

import strata_mlx
from strata_mlx.format.quant import switch_glu_reference
from strata_mlx.format.store import load_manifest
from strata_mlx.runtime import cpu_experts, kernels
from strata_mlx.runtime.kernels import example_layout, random_arena


def random_problem(layout, n_tokens: int, k: int = 4, n_experts: int = 8, seed: int = 0):
    rng = np.random.default_rng(seed)
    arena = mx.array(random_arena(layout, n_experts, n_experts + 2, rng))
    ids = np.stack([rng.choice(n_experts, k, replace=False) for _ in range(n_tokens)])
    needed = np.unique(ids)
    slots = mx.array((needed + 1).astype(np.uint32))
    idx = mx.array(np.searchsorted(needed, ids).astype(np.uint32))
    x = mx.array(rng.standard_normal((n_tokens, kernels.hidden_of(layout))).astype(np.float32))
    return x, arena, slots, idx


def same_bits(a: mx.array, b: mx.array) -> bool:
    a, b = np.array(a), np.array(b)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("fmt", ["affine2-g64", "affine4-g32", "affine8-g128", "affine2-g32"])
@pytest.mark.parametrize("n_tokens", [1, 3, 40])  # 40 x 4 pairs: the reference sorts them
def test_native_loops_give_the_reference_bits(fmt, n_tokens):
    layout = example_layout(fmt, 256, 128)
    fn = cpu_experts.cpu_expert_kernel(layout)
    assert fn is not None
    problem = random_problem(layout, n_tokens, seed=n_tokens)
    x, arena, slots, idx = problem
    assert same_bits(fn(*problem), switch_glu_reference(x, arena[slots], layout, idx))


def test_a_float_projection_beside_affine_ones(store):
    # the tiny quantized store keeps its down projection float (16 inputs: less than a group)
    layout = load_manifest(store("qwen3_moe", True)).layout
    assert layout.quant["down_proj"]["format"] == "float"
    fn = cpu_experts.cpu_expert_kernel(layout)
    assert fn is not None
    for n_tokens in (1, 5, 33):
        problem = random_problem(layout, n_tokens, k=2, seed=n_tokens)
        x, arena, slots, idx = problem
        assert same_bits(fn(*problem), switch_glu_reference(x, arena[slots], layout, idx))


def test_chosen_on_the_cpu_unless_the_reference_is_forced(monkeypatch):
    layout = example_layout("affine4-g64", 128, 64)
    monkeypatch.delenv("STRATA_MLX_KERNELS", raising=False)
    assert kernels.expert_kernel(layout).__name__ == "run"
    monkeypatch.setenv("STRATA_MLX_KERNELS", "reference")
    assert kernels.expert_kernel(layout).__name__ == "reference"
    # formats the loops do not take keep the reference
    assert cpu_experts.cpu_expert_kernel(example_layout("Q4_K", 256, 256)) is None
    assert cpu_experts.cpu_expert_kernel(example_layout("mxfp4", 64, 64)) is None


def test_a_kernel_that_disagrees_is_not_used(monkeypatch):
    layout = example_layout("affine4-g64", 128, 64)
    real = cpu_experts._kernel

    def off_by_one_bit(lay):
        fn = real(lay)
        return lambda *a: mx.array(np.array(fn(*a)).view(np.uint32) ^ 1).view(mx.float32)

    monkeypatch.setattr(cpu_experts, "_kernel", off_by_one_bit)
    monkeypatch.setattr(cpu_experts, "_AGREES", {})
    assert cpu_experts.cpu_expert_kernel(layout) is None


def test_bad_indices_raise_instead_of_reading_past_the_arena():
    layout = example_layout("affine4-g64", 128, 64)
    c = {p: layout.component(f"gate_proj.{p}") for p in ("weight", "scales", "biases")}
    arena = np.zeros((3, layout.record_bytes), np.uint8)
    out = np.empty((1, 64), np.float32)
    x = np.zeros((1, 128), np.float32)
    one = np.zeros(1, np.int32)
    args = (layout.record_bytes, c["weight"].offset, c["scales"].offset, c["biases"].offset)
    args += (64, 128, 4, 64, 0)
    cpu_experts.native.qmm_pairs(out, x, arena, one, one, one, *args)
    with pytest.raises(ValueError, match="index out of range"):
        cpu_experts.native.qmm_pairs(out, x, arena, one, one + 3, one, *args)


def test_generation_is_the_reference_token_for_token(store, monkeypatch):
    path = store("olmoe", True)
    ids = prompt_ids(12, seed=3)

    def run():
        with strata_mlx.load(path, prefill_step_size=8)[0] as model:
            rs = list(strata_mlx.stream_generate(model, None, ids, max_tokens=6))
        return [r.token for r in rs], [np.array(r.logprobs) for r in rs]

    monkeypatch.delenv("STRATA_MLX_KERNELS", raising=False)
    native = run()
    monkeypatch.setenv("STRATA_MLX_KERNELS", "reference")
    reference = run()
    assert native[0] == reference[0]
    for a, b in zip(native[1], reference[1]):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
