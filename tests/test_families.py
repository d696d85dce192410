"""Every family against transformers (logits, cached decode), and every MoE family's 4-bit
conversion against mlx-lm's quantized model of the same checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import TINY, _randomize_norms, hf_logits, prompt_ids

import strata_mlx
from strata_mlx.generate import teacher_forced_logits

FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "qwen3_next", "glm4_moe"]


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


# ---- 4-bit against mlx-lm ------------------------------------------------------------------
#
# conftest's tiny models cannot be quantized at group size 32: their expert (and Mixtral/OLMoE
# dense) intermediate size is 16, and the Qwen routers quantize at 8 bits with group size 64,
# which needs hidden_size % 64 == 0 (mlx-lm's own convert fails on them too). These use the
# same families with every quantized axis a multiple of 64 (32 for the experts' inner axis).

Q_TINY = {**TINY, "hidden_size": 64}


def _hf_model_q(family: str):
    import torch
    import transformers as T

    torch.manual_seed(0)
    moe = dict(num_experts_per_tok=2)
    if family == "qwen3_moe":
        cfg = T.Qwen3MoeConfig(
            **Q_TINY,
            intermediate_size=64,
            moe_intermediate_size=32,
            head_dim=16,
            num_experts=8,
            norm_topk_prob=True,
            **moe,
        )
        return T.Qwen3MoeForCausalLM(cfg)
    if family == "mixtral":
        cfg = T.MixtralConfig(**Q_TINY, intermediate_size=32, num_local_experts=8, **moe)
        return T.MixtralForCausalLM(cfg)
    if family == "olmoe":
        cfg = T.OlmoeConfig(**Q_TINY, intermediate_size=32, num_experts=8, **moe)
        return T.OlmoeForCausalLM(cfg)
    if family == "qwen3_next":
        cfg = T.Qwen3NextConfig(
            **{**Q_TINY, "num_hidden_layers": 4},
            intermediate_size=64,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            head_dim=16,
            num_experts=8,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            full_attention_interval=2,
            norm_topk_prob=True,
            **moe,
        )
        return T.Qwen3NextForCausalLM(cfg)
    if family == "glm4_moe":
        cfg = T.Glm4MoeConfig(
            **{**Q_TINY, "num_hidden_layers": 3},
            intermediate_size=64,
            moe_intermediate_size=32,
            head_dim=16,
            partial_rotary_factor=0.5,
            n_routed_experts=8,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            routed_scaling_factor=1.5,
            use_qk_norm=True,
            attention_bias=True,
            **moe,
        )
        return T.Glm4MoeForCausalLM(cfg)
    raise ValueError(family)


@pytest.fixture(scope="module")
def q_checkpoint(tmp_path_factory):
    """family -> a saved float32 transformers checkpoint whose layers all quantize at g32."""
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            import torch

            d = tmp_path_factory.mktemp(f"hfq_{family}")
            m = _hf_model_q(family).to(torch.float32).eval()
            _randomize_norms(m)
            m.save_pretrained(d)
            made[family] = d
        return made[family]

    return get


def _mlx_lm_config(checkpoint: Path) -> dict:
    """The transformers-5 spellings mlx-lm 0.32 does not read, in the ones it does."""
    from strata_mlx.models.base import normalize_config

    config = normalize_config(json.loads((checkpoint / "config.json").read_text()))
    patch = {
        k: v
        for k, v in config.items()
        if k in ("rope_theta", "partial_rotary_factor", "num_experts", "num_local_experts")
    }
    # GLM-4.5's ModelArgs requires rope_scaling, which transformers 5 leaves out when unset.
    if config.get("model_type") == "glm4_moe":
        patch.setdefault("rope_scaling", config.get("rope_scaling"))
    # Qwen3-Next: transformers 5 writes the layer schedule as layer_types only.
    if types := config.get("layer_types"):
        interval = types.index("full_attention") + 1
        assert all(
            (t == "full_attention") == ((i + 1) % interval == 0) for i, t in enumerate(types)
        )
        patch["full_attention_interval"] = interval
    return patch


def mlx_lm_quantized_logits(checkpoint: Path, ids: list[int], bits: int, group_size: int):
    """Logits of mlx-lm's own conversion (load, sanitize, quantize_model), prefilled in one
    step through its prompt cache, as ours are."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model, quantize_model

    model, config = load_model(checkpoint, model_config=_mlx_lm_config(checkpoint))
    model, _ = quantize_model(model, config, group_size, bits)
    cache = make_prompt_cache(model)
    return np.array(model(mx.array([ids]), cache=cache)[0].astype(mx.float32))


@pytest.mark.parametrize("family", ["qwen3_moe", *FAMILIES])
def test_quantized_matches_mlx_lm(family, q_checkpoint, tmp_path):
    from strata_mlx.convert.hf import convert_hf

    ckpt = q_checkpoint(family)
    out = convert_hf(
        ckpt,
        tmp_path / "store",
        quantize=True,
        q_bits=4,
        q_group_size=32,
        progress=False,
        calibration_tokens=64,
    )
    ids = prompt_ids(64)
    ref = mlx_lm_quantized_logits(ckpt, ids, bits=4, group_size=32)
    model, _ = strata_mlx.load(out)
    ours = teacher_forced_logits(model, ids, step=64)
    np.testing.assert_array_equal(ours, ref)
