"""strata_mlx.models.rope: the rotary module each scaling kind asks for, against mlx-lm's
rope_utils where both implement a kind (YaRN is checked end to end against transformers by
the DeepSeek-V3 and GPT-OSS families in test_families.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from strata_mlx.models.rope import FreqsRoPE, initialize_rope, rope_kind

X = mx.random.normal((1, 2, 9, 64), key=mx.random.key(0))
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize(
    "scaling",
    [None, {"rope_type": "linear", "factor": 4.0}, {"type": "linear", "factor": 2.0}, LLAMA3],
    ids=["default", "linear", "linear-type", "llama3"],
)
@pytest.mark.parametrize("traditional", [False, True])
def test_matches_mlx_lm(scaling, traditional):
    from mlx_lm.models.rope_utils import initialize_rope as mlx_lm_rope

    ours = initialize_rope(64, 500000.0, traditional, scaling)
    ref = mlx_lm_rope(64, 500000.0, traditional, scaling, max_position_embeddings=8192)
    for offset in (0, 7, 5000):
        np.testing.assert_allclose(
            np.array(ours(X, offset=offset)), np.array(ref(X, offset=offset)), rtol=0, atol=1e-5
        )


def test_freq_factors_divide_each_frequency():
    factors = list(np.linspace(1.0, 8.0, 32))
    rope = initialize_rope(64, 10000.0, False, None, freq_factors=factors)
    assert isinstance(rope, FreqsRoPE)
    want = 10000.0 ** (np.arange(0, 64, 2) / 64) * np.array(factors)
    np.testing.assert_allclose(np.array(rope._freqs), want, rtol=1e-6)


def test_kinds_a_family_does_not_take_are_refused():
    assert rope_kind(None) == rope_kind({}) == rope_kind({"rope_type": None}) == "default"
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    with pytest.raises(ValueError, match="unsupported rope scaling 'yarn'"):
        initialize_rope(64, 1e4, False, yarn, kinds=("default", "linear"))
    with pytest.raises(ValueError, match="yarn needs original_max_position_embeddings"):
        initialize_rope(64, 1e4, False, {"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="unsupported rope scaling 'dynamic'"):
        initialize_rope(64, 1e4, False, {"rope_type": "dynamic", "factor": 2.0})


# ---- a config's rope fields of the wrong type or range: one line naming the field ------------

YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}
# Each of these raised a TypeError or ValueError inside rope.py, or gave inf logits (factor,
# mscale_all_dim, attention_factor of 1e308; NaN for a factor of 2.2e-308), before the scaling
# dict was checked.
BAD_ROPE = [
    ("beta_fast", "x"),
    ("beta_fast", -1),
    ("beta_slow", float("nan")),
    ("mscale_all_dim", "x"),
    ("mscale_all_dim", 1e308),
    ("attention_factor", "x"),
    ("attention_factor", 1e308),
    ("factor", 1e308),
    ("factor", 2.2250738585072014e-308),  # positions / factor overflowed: NaN log-probabilities
    ("truncate", "no"),
    ("rope_type", "x"),
]


def _deepseek_config(hf_checkpoint, **scaling) -> tuple[dict, object]:
    import json

    path = hf_checkpoint("deepseek_v3") / "config.json"
    config = json.loads(path.read_text())
    config.pop("rope_parameters", None)
    config["rope_scaling"] = {**YARN, **scaling}
    return config, path


@pytest.mark.parametrize("key, value", BAD_ROPE, ids=[f"{k}={v!r}" for k, v in BAD_ROPE])
def test_bad_rope_scaling_fields_refused_in_one_line(key, value, hf_checkpoint):
    from strata_mlx.format.store import StoreError
    from strata_mlx.models.base import normalize_config
    from strata_mlx.runtime.loader import family

    config, path = _deepseek_config(hf_checkpoint, **{key: value})
    with pytest.raises(StoreError, match=f"rope_scaling.{key}") as e:
        family("deepseek_v3").ModelArgs.from_dict(normalize_config(config), path)
    assert "\n" not in str(e.value) and str(path) in str(e.value)


@pytest.mark.parametrize("theta", [1.0, 1.6e-58])
def test_rope_theta_must_be_above_one(hf_checkpoint, theta):
    """YaRN divides by log(rope_theta): 1 was a ZeroDivisionError; a base of 1.6e-58 (no
    scaling) gave NaN log-probabilities."""
    from strata_mlx.format.store import StoreError
    from strata_mlx.models.base import normalize_config
    from strata_mlx.runtime.loader import family

    config, path = _deepseek_config(hf_checkpoint)
    config["rope_theta"] = theta
    if theta < 1:
        config.pop("rope_scaling")
    with pytest.raises(StoreError, match=f"rope_theta: {theta}: expected a base > 1"):
        family("deepseek_v3").ModelArgs.from_dict(normalize_config(config), path)


@pytest.mark.parametrize("key, value", [("beta_fast", "x"), ("rope_type", "x")])
def test_bad_rope_scaling_at_convert_and_at_load(key, value, hf_checkpoint, store, tmp_path):
    """The same field through convert (the checkpoint's config.json) and through load() (a
    store's manifest that says so): one StoreError line, no store written."""
    import json
    import shutil

    import strata_mlx
    from strata_mlx.convert.hf import convert_hf
    from strata_mlx.format.store import StoreError

    config, _ = _deepseek_config(hf_checkpoint, **{key: value})
    src = shutil.copytree(hf_checkpoint("deepseek_v3"), tmp_path / "src")
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(StoreError, match=f"config.json: rope_scaling.{key}"):
        convert_hf(src, tmp_path / "out", progress=False, calibration_tokens=0)
    assert not (tmp_path / "out").exists()

    work = shutil.copytree(store("deepseek_v3"), tmp_path / "store")
    manifest = json.loads((work / "manifest.json").read_text())
    manifest["config"]["rope_scaling"] = {**manifest["config"]["rope_scaling"], key: value}
    (work / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match=f"manifest.json: config.rope_scaling.{key}") as e:
        strata_mlx.load(work)
    assert "\n" not in str(e.value)
