"""GPT-OSS beyond the family suites (test_families, test_streaming, test_decode): chunked
prefill across the sliding window against transformers, the expert records' biases and
activation in the store, the reference path for float experts, refused configs."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from conftest import hf_logits, prompt_ids

import strata_mlx
from strata_mlx.format.store import StoreError, load_manifest
from strata_mlx.generation.generate import teacher_forced_logits


@pytest.mark.parametrize("step", [1, 7])
def test_chunked_prefill_across_the_window_matches_transformers(step, hf_checkpoint, store):
    """Chunks that start past the window (window 5) read only the keys their queries see."""
    ids = prompt_ids(40, seed=7)
    ref = hf_logits(hf_checkpoint("gpt_oss"), ids)
    model, _ = strata_mlx.load(store("gpt_oss"))
    np.testing.assert_allclose(teacher_forced_logits(model, ids, step), ref, atol=1e-4, rtol=1e-4)


def test_records_carry_biases_and_the_clamped_activation(store):
    m = load_manifest(store("gpt_oss"))
    names = {c.name for c in m.layout.components}
    assert {"gate_proj.bias", "up_proj.bias", "down_proj.bias"} <= names
    assert m.layout.activation == {"name": "swiglu_oai", "alpha": 1.702, "limit": 0.05}


def test_float_experts_take_the_reference_path(store):
    """Float experts have no kernel on any backend (the biases and the clamped SwiGLU do:
    MXFP4 and affine GPT-OSS experts run the kernels, tests/format/test_mxfp4.py, test_kernels.py)."""
    from custom_kernels import dispatch
    from strata_mlx.runtime import kernels

    layout = load_manifest(store("gpt_oss")).layout
    assert not dispatch.supported(layout)
    for backend in ("host", "cuda", "metal"):
        assert dispatch.kernel_for(backend, layout) is None
    assert kernels.expert_kernel(layout, "host").__name__ == "reference"


@pytest.mark.parametrize(
    "activation, message",
    [
        ({"name": "gelu"}, r"experts\.activation\.name: 'gelu' is not one of swiglu_oai"),
        ({"name": "swiglu_oai", "alpha": 1.702}, r"experts\.activation\.limit: missing"),
        ({"name": "swiglu_oai", "alpha": 1.7, "limit": "7"}, r"activation\.limit: expected a"),
        ({"name": "swiglu_oai", "alpha": -1, "limit": 7}, r"activation\.alpha: expected a"),
    ],
)
def test_bad_activation_in_manifest_is_one_line(activation, message, store, tmp_path):
    path = tmp_path / "s"
    shutil.copytree(store("gpt_oss"), path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["experts"]["activation"] = activation
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match=message) as e:
        load_manifest(path)
    assert "manifest.json" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"sliding_window": 0}, "sliding_window 0 must be > 0"),
        ({"swiglu_limit": 0.0}, "swiglu_limit 0.0 must be > 0"),
        ({"layer_types": ["sliding_attention", "linear_attention", "full_attention"]}, "linear"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope scaling 'dynamic'"),
    ],
)
def test_refused_configs_in_one_line(change, message, hf_checkpoint, tmp_path):
    from strata_mlx.convert.hf import convert_hf

    src = tmp_path / "hf"
    shutil.copytree(hf_checkpoint("gpt_oss"), src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(StoreError, match=message) as e:
        convert_hf(src, tmp_path / "s", progress=False, calibration_tokens=0)
    assert "config.json" in str(e.value) and "\n" not in str(e.value)


def test_decode_past_the_window_matches_full_recompute(store):
    """One-token steps attend over the last `sliding_window` keys of a longer cache."""
    ids = prompt_ids(24, seed=8)
    model, _ = strata_mlx.load(store("gpt_oss"))
    full = teacher_forced_logits(model, ids, step=64)
    cache = model.make_cache()
    model(mx.array([ids[:3]]), cache=cache)
    steps = [np.array(model(mx.array([[t]]), cache=cache)[0, -1]) for t in ids[3:]]
    np.testing.assert_allclose(np.stack(steps), full[3:], atol=1e-5, rtol=1e-5)


def test_rotating_cache_is_refused_in_one_line(store):
    from strata_mlx.models.base import RotatingKVCache

    model, _ = strata_mlx.load(store("gpt_oss"))
    cache = [RotatingKVCache(16, keep=4) for _ in model.layers]
    with pytest.raises(ValueError, match="plain KV cache, not RotatingKVCache") as e:
        model(mx.array([[1, 2, 3]]), cache=cache)
    assert "\n" not in str(e.value)
    assert model.quantized_kv is False  # --kv-bits is refused before a cache is made
