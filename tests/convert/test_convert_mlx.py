"""MLX-quantized checkpoints (what mlx-lm's convert writes) import without requantizing."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import prompt_ids

import strata_mlx
from strata_mlx.convert.hf import convert_hf
from strata_mlx.generation.generate import teacher_forced_logits


@pytest.fixture(scope="module")
def mlx_lm_checkpoint(tmp_path_factory):
    """A tiny transformers Qwen3-MoE, converted to 4-bit (group 32) by mlx-lm itself."""
    import torch
    import transformers as T
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    torch.manual_seed(1)
    cfg = T.Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=256,
    )
    root = tmp_path_factory.mktemp("mlxlm")
    hf = root / "hf"
    T.Qwen3MoeForCausalLM(cfg).float().eval().save_pretrained(hf)
    c = json.loads((hf / "config.json").read_text())  # mlx-lm 0.32 reads transformers 4 keys
    c["rope_theta"] = c["rope_parameters"]["rope_theta"]
    c["num_experts"] = c["num_local_experts"]
    (hf / "config.json").write_text(json.dumps(c))
    # mlx-lm's convert() without its tokenizer step (these checkpoints have no tokenizer)
    model, config = load_model(hf)
    model, config = quantize_model(model, config, 32, 4)
    out = root / "mlx"
    save_model(out, model)
    save_config(config, out / "config.json")
    return out


def test_mlx_lm_quantized_checkpoint_matches_mlx_lm(mlx_lm_checkpoint, tmp_path):
    from mlx_lm.utils import load_model

    store = convert_hf(mlx_lm_checkpoint, tmp_path / "store", progress=False, calibration_tokens=16)
    m = strata_mlx.format.store.load_manifest(store)
    assert m.layout.quant["gate_proj"] == {"format": "affine", "bits": 4, "group_size": 32}
    # The experts' packed codes are the checkpoint's own bytes, not a requantization.
    ck = mx.load(str(next(mlx_lm_checkpoint.glob("*.safetensors"))))
    w = np.array(ck["model.layers.1.mlp.switch_mlp.up_proj.weight"][5])
    rec = np.frombuffer(strata_mlx.format.store.read_record(store, m, 1, 5), np.uint8)
    c = m.layout.component("up_proj.weight")
    np.testing.assert_array_equal(rec[c.offset : c.offset + c.nbytes], w.view(np.uint8).ravel())

    ids = prompt_ids(32, seed=14)
    ref_model, _ = load_model(mlx_lm_checkpoint)
    ref = np.array(ref_model(mx.array([ids]))[0].astype(mx.float32))
    model, _ = strata_mlx.load(store, arena_gb=4 * m.layout.record_bytes / 1024**3)
    ours = teacher_forced_logits(model, ids, step=32)
    np.testing.assert_array_equal(ours, ref)


def test_requantizing_an_mlx_checkpoint_is_refused(mlx_lm_checkpoint, tmp_path):
    from strata_mlx.format.store import StoreError

    with pytest.raises(StoreError, match="already quantized"):
        convert_hf(mlx_lm_checkpoint, tmp_path / "s", quantize=True, progress=False)
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3", "qwen3_next"])
def test_mlx_lm_checkpoint_of_more_families(family, tmp_path):
    """What users download for GLM-4.5, DeepSeek-V3 / Kimi K2 and Qwen3-Next is mostly
    mlx-lm's own 4-bit conversion: stacked switch_mlp experts, DeepSeek's kv_b_proj already
    split into quantized embed_q / unembed_out, Qwen3-Next's norms already carrying their 1
    and its routers in 8 bits. Converted without requantizing, logits equal mlx-lm's."""
    import torch
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model
    from test_families import _hf_model_q, _mlx_lm_config

    hf = tmp_path / "hf"
    _hf_model_q(family).to(torch.float32).eval().save_pretrained(hf)
    model, config = load_model(hf, model_config=_mlx_lm_config(hf))
    model, config = quantize_model(model, config, 32, 4)
    ckpt = tmp_path / "mlx"
    save_model(ckpt, model)
    save_config(config, ckpt / "config.json")

    store = convert_hf(ckpt, tmp_path / "store", progress=False, calibration_tokens=16)
    ids = prompt_ids(32, seed=15)
    ref_model, _ = load_model(ckpt)
    ref = np.array(ref_model(mx.array([ids]))[0].astype(mx.float32))
    ours, _ = strata_mlx.load(store)
    np.testing.assert_array_equal(teacher_forced_logits(ours, ids, step=32), ref)


def _edited(ckpt, dst, edit) -> None:
    import shutil

    shutil.copytree(ckpt, dst)
    (f,) = dst.glob("*.safetensors")
    w = mx.load(str(f))
    edit(w)
    mx.save_safetensors(str(f), w, metadata={"format": "mlx"})


SWITCH = "model.layers.1.mlp.switch_mlp.up_proj"
DENSE = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda w: w.update({f"{SWITCH}.scales": w[f"{SWITCH}.scales"].astype(mx.int32)}),
         f"{SWITCH}.scales: dtype int32, expected float32"),
        (lambda w: w.update({f"{DENSE}.biases": w[f"{DENSE}.biases"].astype(mx.int32)}),
         f"{DENSE}.biases: dtype int32"),
        (lambda w: w.update({f"{DENSE}.scales": w[f"{DENSE}.scales"][:, :1]}),
         rf"{DENSE}.scales: shape \(64, 1\), expected \(64, 2\) for .* at 4 bits in groups of 32"),
        (lambda w: w.pop(f"{SWITCH}.biases"), f"{SWITCH}.weight: quantized .* without its .*biases"),
        (lambda w: [w.pop(f"{SWITCH}.scales"), w.pop(f"{SWITCH}.biases")],
         f"{SWITCH}.weight: quantized .* without its .*scales"),
    ],
    ids=["int32-expert-scales", "int32-dense-biases", "scales-shape", "no-biases", "no-scales"],
)  # fmt: skip
def test_quantized_tensors_without_scales_or_of_the_wrong_dtype_or_shape_are_refused(
    mlx_lm_checkpoint, tmp_path, edit, message
):
    """Integer scales were read as numbers and an unscaled uint32 expert as floats: exit 0 and
    a wrong answer. Each is one line naming the tensor; nothing is written."""
    from strata_mlx.format.store import StoreError

    _edited(mlx_lm_checkpoint, tmp_path / "ck", edit)
    with pytest.raises(StoreError, match=message) as e:
        convert_hf(tmp_path / "ck", tmp_path / "s", progress=False, calibration_tokens=0)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "s").exists()
