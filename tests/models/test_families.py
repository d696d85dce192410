"""Every family against transformers (logits, cached decode), and every MoE family's 4-bit
conversion against mlx-lm's quantized model of the same checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import TINY, hf_logits, prompt_ids

import strata_mlx
from strata_mlx.generation.generate import teacher_forced_logits

FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "qwen3_next", "glm4_moe", "deepseek_v3", "gpt_oss"]


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
    if family == "deepseek_v3":
        # q without its low-rank path here (conftest's model takes it); YaRN as there.
        cfg = T.DeepseekV3Config(
            **{**Q_TINY, "num_hidden_layers": 3, "num_key_value_heads": 4},
            intermediate_size=64,
            moe_intermediate_size=32,
            n_routed_experts=8,
            n_shared_experts=2,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            kv_lora_rank=32,
            q_lora_rank=None,
            qk_rope_head_dim=16,
            qk_nope_head_dim=32,
            v_head_dim=16,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "mscale": 1.0,
                "mscale_all_dim": 0.8,
            },
            **moe,
        )
        return T.DeepseekV3ForCausalLM(cfg)
    if family == "gpt_oss":
        # mlx-lm's swiglu_oai has alpha and limit fixed at the defaults, and its YaRN always
        # rounds the ramp's ends (transformers' truncate true): the config says so here.
        cfg = T.GptOssConfig(
            **{**Q_TINY, "num_hidden_layers": 3},
            intermediate_size=32,
            head_dim=16,
            num_local_experts=8,
            sliding_window=5,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": True,
                "original_max_position_embeddings": 4096,
            },
            **moe,
        )
        return T.GptOssForCausalLM(cfg)
    raise ValueError(family)


def _mlx_lm_layout(checkpoint: Path, out: Path) -> Path:
    """GPT-OSS experts under mlx-lm's own names (its sanitize reads only OpenAI's MXFP4
    blocks, or these): gate_proj / up_proj [E, I, D] and down_proj [E, D, I] `.weight` and
    `.bias`, from transformers' gate_up_proj [E, D, 2I] (gate and up interleaved)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(checkpoint, out)
    w = load_file(out / "model.safetensors")
    for k in [k for k in w if k.endswith("experts.gate_up_proj")]:
        base = k[: -len("gate_up_proj")]
        gate_up, bias = w.pop(k), w.pop(k + "_bias")
        down, down_bias = w.pop(base + "down_proj"), w.pop(base + "down_proj_bias")
        w[base + "gate_proj.weight"] = np.ascontiguousarray(gate_up[..., ::2].swapaxes(-1, -2))
        w[base + "up_proj.weight"] = np.ascontiguousarray(gate_up[..., 1::2].swapaxes(-1, -2))
        w[base + "down_proj.weight"] = np.ascontiguousarray(down.swapaxes(-1, -2))
        w[base + "gate_proj.bias"] = np.ascontiguousarray(bias[..., ::2])
        w[base + "up_proj.bias"] = np.ascontiguousarray(bias[..., 1::2])
        w[base + "down_proj.bias"] = down_bias
    save_file(w, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def q_checkpoint(tmp_path_factory, randomize_norms):
    """family -> a saved float32 transformers checkpoint whose layers all quantize at g32."""
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            import torch

            d = tmp_path_factory.mktemp(f"hfq_{family}")
            m = _hf_model_q(family).to(torch.float32).eval()
            randomize_norms(m)
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
    # transformers 5 writes scaled rotary (DeepSeek-V3's YaRN) into rope_parameters only, and
    # leaves rope_scaling out when unset, which GLM-4.5's ModelArgs requires.
    if "rope_scaling" in config or config.get("model_type") == "glm4_moe":
        patch["rope_scaling"] = config.get("rope_scaling")
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
    mlx_lm_ckpt = _mlx_lm_layout(ckpt, tmp_path / "mlx_lm") if family == "gpt_oss" else ckpt
    ref = mlx_lm_quantized_logits(mlx_lm_ckpt, ids, bits=4, group_size=32)
    model, _ = strata_mlx.load(out)
    ours = teacher_forced_logits(model, ids, step=64)
    np.testing.assert_array_equal(ours, ref)


# ---- sigmoid group-limited routing (deepseek_v3, glm4_moe) -----------------------------------


def _hf_route(logits, bias, k, n_group, topk_group, scale):
    """transformers' DeepseekV3TopkRouter, in numpy: groups left out are masked with -inf."""
    scores = 1 / (1 + np.exp(-logits.astype(np.float64)))
    choice = scores + bias
    grouped = choice.reshape(len(choice), n_group, -1)
    group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(-1)
    kept = np.argsort(-group_scores, axis=-1, kind="stable")[:, :topk_group]
    mask = np.zeros_like(group_scores, dtype=bool)
    np.put_along_axis(mask, kept, True, axis=-1)
    choice = np.where(np.repeat(mask, grouped.shape[-1], axis=-1), choice, -np.inf)
    inds = np.argsort(-choice, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(scores, inds, axis=-1)
    return inds, scale * w / w.sum(-1, keepdims=True)


def test_group_limited_route_matches_transformers_with_negative_biased_scores():
    """A chosen group's expert whose biased score is negative still beats every expert of a
    group left out (transformers masks with -inf; masking with 0 would pick the left-out)."""
    from strata_mlx.models.deepseek_v3 import group_limited_route

    logits = mx.array([[4.0, 3.0, -4.0, -5.0, -6.0, -7.0]])
    bias = mx.array([0.0, 0.0, -0.5, -0.5, -0.9, -0.9])  # biased: .98 .95 -.48 -.49 -.90 -.90
    inds, w = group_limited_route(logits, bias, 3, 3, 2, 2.5, True)
    assert sorted(np.array(inds)[0].tolist()) == [0, 1, 2]

    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, (200, 16)).astype(np.float32)
    bias = rng.normal(-0.6, 0.5, 16).astype(np.float32)  # most biased scores negative
    inds, w = group_limited_route(mx.array(logits), mx.array(bias), 3, 4, 2, 2.5, True)
    ref_inds, ref_w = _hf_route(logits, bias, 3, 4, 2, 2.5)
    order = np.argsort(np.array(inds), axis=-1)
    got_inds = np.take_along_axis(np.array(inds), order, -1)
    got_w = np.take_along_axis(np.array(w), order, -1)
    ref_order = np.argsort(ref_inds, axis=-1)
    assert np.array_equal(got_inds, np.take_along_axis(ref_inds, ref_order, -1))
    np.testing.assert_allclose(got_w, np.take_along_axis(ref_w, ref_order, -1), rtol=1e-6)


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_bf16_conversion_keeps_correction_bias_float32(family, hf_checkpoint, tmp_path):
    from strata_mlx.convert.hf import convert_hf

    out = convert_hf(
        hf_checkpoint(family),
        tmp_path / "s",
        dtype="bfloat16",
        progress=False,
        calibration_tokens=0,
    )
    dense = mx.load(str(out / "dense.safetensors"))
    biases = [k for k in dense if k.endswith("e_score_correction_bias")]
    assert biases and all(dense[k].dtype == mx.float32 for k in biases)
    assert dense["model.norm.weight"].dtype == mx.bfloat16
    model, _ = strata_mlx.load(out)  # (not run: MLX's CPU gather_mm takes float32 only)
    gate = model.moe_blocks()[1].gate
    assert gate.e_score_correction_bias.dtype == mx.float32 and gate.weight.dtype == mx.bfloat16


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_mtp_layer_is_dropped(family, hf_checkpoint, tmp_path):
    """Real GLM-4.5 and DeepSeek-V3 checkpoints carry a multi-token-prediction layer numbered
    num_hidden_layers: conversion leaves it out (and its experts are not experts of ours)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from strata_mlx.convert.hf import convert_hf

    src = tmp_path / "hf"
    shutil.copytree(hf_checkpoint(family), src)
    n = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    w = load_file(src / "model.safetensors")
    extra = {
        k.replace(f"layers.{n - 1}.", f"layers.{n}."): v
        for k, v in w.items()
        if f"layers.{n - 1}." in k
    }
    extra[f"model.layers.{n}.eh_proj.weight"] = np.zeros((4, 4), np.float32)
    save_file({**w, **extra}, src / "model.safetensors", metadata={"format": "pt"})
    out = convert_hf(src, tmp_path / "s", progress=False, calibration_tokens=0)
    dense = mx.load(str(out / "dense.safetensors"))
    assert not any(k.startswith(f"model.layers.{n}.") for k in dense)
    ids = prompt_ids(16)
    model, _ = strata_mlx.load(out)
    np.testing.assert_allclose(
        teacher_forced_logits(model, ids, 16), hf_logits(hf_checkpoint(family), ids), atol=1e-4
    )


def test_kimi_k2_runs_as_deepseek_v3(hf_checkpoint, store, tmp_path):
    """Kimi K2 checkpoints say model_type kimi_k2 with DeepSeek-V3's architecture."""
    import shutil

    from strata_mlx.convert.hf import convert_hf

    src = tmp_path / "hf"
    shutil.copytree(hf_checkpoint("deepseek_v3"), src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))
    out = convert_hf(src, tmp_path / "s", progress=False, calibration_tokens=0)
    ids = prompt_ids(16)
    kimi, _ = strata_mlx.load(out)
    ref, _ = strata_mlx.load(store("deepseek_v3"))
    assert kimi.model_type == "kimi_k2"
    assert np.array_equal(teacher_forced_logits(kimi, ids, 16), teacher_forced_logits(ref, ids, 16))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"n_group": 3}, "n_group 3 does not divide n_routed_experts 8"),
        ({"topk_group": 5}, "topk_group 5 outside"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok 5 is more than the 4"),
        ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
    ],
)
def test_group_routing_configs_refused_in_one_line(change, message, hf_checkpoint):
    from strata_mlx.format.store import StoreError
    from strata_mlx.models.base import normalize_config
    from strata_mlx.runtime.loader import family

    path = hf_checkpoint("deepseek_v3") / "config.json"
    config = normalize_config({**json.loads(path.read_text()), **change})
    with pytest.raises(StoreError, match=message) as e:
        family("deepseek_v3").ModelArgs.from_dict(config, path)
    assert "\n" not in str(e.value)


def test_fp8_block_quantized_deepseek_v3_matches_transformers_on_its_weights(
    hf_checkpoint, tmp_path
):
    """DeepSeek-V3's own checkpoints are FP8: each linear weight e4m3 with a float32
    `weight_scale_inv` per block (128 x 128 there; 16 x 16 here, so these small matrices
    have several blocks and partial ones at the edges). The oracle: torch's own float8_e4m3fn
    values times the blocks' scales, put into transformers' model; ours converts the FP8
    checkpoint itself. The same tolerance as the float checkpoints'."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from strata_mlx.convert.hf import convert_hf

    src, deq = tmp_path / "fp8", tmp_path / "dequantized"
    shutil.copytree(hf_checkpoint("deepseek_v3"), src)
    shutil.copytree(src, deq)
    (f,) = src.glob("*.safetensors")
    w = load_file(f)
    fp8, oracle, bs = {}, dict(w), 16
    for k, v in w.items():
        linear = v.dim() == 2 and k.endswith("proj.weight") or k.endswith("proj_with_mqa.weight")
        if not linear:
            fp8[k] = v
            continue
        m, n = v.shape
        blocks = torch.nn.functional.pad(v, (0, -n % bs, 0, -m % bs))
        blocks = blocks.reshape(-(-m // bs), bs, -(-n // bs), bs)
        scale = (blocks.abs().amax(dim=(1, 3)) / 448).clamp(min=1e-12)
        full = scale.repeat_interleave(bs, 0).repeat_interleave(bs, 1)[:m, :n]
        q = (v / full).to(torch.float8_e4m3fn)
        fp8[k], fp8[k + "_scale_inv"] = q, scale.float()
        oracle[k] = q.float() * full
    assert sum(k.endswith("_scale_inv") for k in fp8) > 40  # experts, attention, shared
    save_file(fp8, f, metadata={"format": "pt"})
    save_file(oracle, deq / f.name, metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic", "weight_block_size": [bs, bs]}  # fmt: skip
    (src / "config.json").write_text(json.dumps(config))

    out = convert_hf(src, tmp_path / "s", progress=False, calibration_tokens=0)
    assert "quantization_config" not in json.loads((out / "manifest.json").read_text())["config"]
    ids = prompt_ids(32)
    model, _ = strata_mlx.load(out)
    ours = teacher_forced_logits(model, ids, 32)
    np.testing.assert_allclose(ours, hf_logits(deq, ids), atol=1e-4, rtol=1e-4)
    # the oracle tells the FP8 weights from the float ones they were made from
    assert np.abs(ours - hf_logits(hf_checkpoint("deepseek_v3"), ids)).max() > 1e-3

    from strata_mlx.format.store import StoreError

    bad = next(k for k in fp8 if k.endswith("_scale_inv"))
    save_file({**fp8, bad: fp8[bad][:1]}, f, metadata={"format": "pt"})
    with pytest.raises(StoreError, match=f"{bad}: shape .* expected"):
        convert_hf(src, tmp_path / "s2", progress=False, calibration_tokens=0)
    assert not (tmp_path / "s2").exists()
