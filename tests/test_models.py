"""Every family against transformers: logits, cached decode, 4-bit against mlx-lm."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import hf_logits, prompt_ids

import strata_mlx
from strata_mlx.generate import teacher_forced_logits

FAMILIES = ["qwen3_moe"]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family, hf_checkpoint, store):
    ids = prompt_ids(64)
    ref = hf_logits(hf_checkpoint(family), ids)
    model, _ = strata_mlx.load(store(family))
    ours = teacher_forced_logits(model, ids, step=64)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_decode_matches_full_recompute(family, store):
    ids = prompt_ids(24, seed=1)
    model, _ = strata_mlx.load(store(family))
    full = teacher_forced_logits(model, ids, step=64)
    cache = model.make_cache()
    model(mx.array([ids[:16]]), cache=cache)
    step_logits = [np.array(model(mx.array([[t]]), cache=cache)[0, -1]) for t in ids[16:]]
    np.testing.assert_allclose(np.stack(step_logits), full[16:], atol=1e-5, rtol=1e-5)
