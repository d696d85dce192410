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
