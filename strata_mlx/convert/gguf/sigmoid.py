"""The sigmoid-routed families: glm4moe (GLM-4.5) and deepseek2 (DeepSeek-V3, Kimi K2), their
header readings and writers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .blocks import dequantize_rows, raw_rows
from .config import (
    GgufConfig,
    attention_shapes,
    check_shapes,
    expert_shapes,
    model_dtype,
    moe_sizes,
    rope_scaling,
)
from .reading import GGUF_PROJ, Gguf, bool_field
from .writing import (
    DenseWriter,
    add_attention,
    add_embeddings,
    add_layer_norms,
    add_norm,
    convert_moe,
)

# ---- sigmoid-routed families: glm4moe (GLM-4.5), deepseek2 (DeepSeek-V3, Kimi K2) -----------

SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def _sigmoid_routing(g: Gguf, L: int) -> dict[str, Any]:
    """The router settings llama.cpp's converter writes for GLM-4.5 and DeepSeek-V3 (sigmoid
    scores, correction bias exp_probs_b, group-limited top-k, scale, renormalization)."""
    a = g.arch
    func = g.int(f"{a}.expert_gating_func", 0, lo=0, hi=8)
    if func != SIGMOID:
        g.fail(
            f"{a}.expert_gating_func",
            f"{func or 'missing'}; only sigmoid routing ({SIGMOID}, DeepSeek-V3 and GLM-4.5's) "
            "is supported (llama.cpp's converter writes it from the config's scoring_func)",
        )
    E = g.int(f"{a}.expert_count")
    n_group = g.int(f"{a}.expert_group_count", 1, hi=E)
    return {
        "n_routed_experts": E,
        "n_group": n_group,
        "topk_group": g.int(f"{a}.expert_group_used_count", 1, hi=n_group),
        "routed_scaling_factor": g.float(f"{a}.expert_weights_scale", 1.0),
        "norm_topk_prob": bool_field(g, f"{a}.expert_weights_norm", False),
        "n_shared_experts": g.int(f"{a}.expert_shared_count", 0, lo=0, hi=E),
        "first_k_dense_replace": g.int(f"{a}.leading_dense_block_count", 0, lo=0, hi=L),
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
    }


def _sigmoid_moe_shapes(g: Gguf, cfg: dict[str, Any], i: int) -> dict[str, tuple]:
    """Layer i's feed-forward tensors: a dense MLP before first_k_dense_replace, else experts,
    router, correction bias and shared experts."""
    dim, E = cfg["hidden_size"], cfg["n_routed_experts"]
    inter, ff = cfg["moe_intermediate_size"], cfg["intermediate_size"]
    if i < cfg["first_k_dense_replace"]:
        return {
            "ffn_gate.weight": (ff, dim),
            "ffn_up.weight": (ff, dim),
            "ffn_down.weight": (dim, ff),
        }
    shapes = {f"{n}.weight": sh for n, sh in expert_shapes(g, i, E, inter, dim).items()}
    shapes["exp_probs_b.bias"] = (E,)
    if cfg["n_shared_experts"]:
        sh = inter * cfg["n_shared_experts"]
        shapes.update(
            {
                "ffn_gate_shexp.weight": (sh, dim),
                "ffn_up_shexp.weight": (sh, dim),
                "ffn_down_shexp.weight": (dim, sh),
            }
        )
    return shapes


def _add_sigmoid_moe(dense: DenseWriter, g: Gguf, cfg: dict[str, Any], i: int, pre: str) -> None:
    """Layer i's dense MLP, or its router (a bare float weight), float32 correction bias
    (it picks experts by differences in the fourth digit) and shared experts."""
    mlp = f"{pre}.mlp"
    if i < cfg["first_k_dense_replace"]:
        for p, gp in GGUF_PROJ.items():
            dense.add(f"{mlp}.{p}", g.tensor(f"blk.{i}.{gp}.weight"))
        return
    dense.add(f"{mlp}.gate", g.tensor(f"blk.{i}.ffn_gate_inp.weight"), quantize=False)
    t = g.tensor(f"blk.{i}.exp_probs_b.bias")
    bias = dequantize_rows(raw_rows(t), t).reshape(-1)
    dense.weights[f"{mlp}.gate.e_score_correction_bias"] = mx.array(bias.astype(np.float32))
    if cfg["n_shared_experts"]:
        for p, gp in GGUF_PROJ.items():
            dense.add(f"{mlp}.shared_experts.{p}", g.tensor(f"blk.{i}.{gp}_shexp.weight"))


def glm4moe_config(g: Gguf) -> tuple[dict[str, Any], list[int], set[str]]:
    """GLM-4.5 / 4.6 (glm4moe): NeoX rotary over the first rope.dimension_count dims of each
    head (rows not permuted), biased q/k/v, q/k norms where present; the converter's
    multi-token-prediction layers (nextn_predict_layers, appended to block_count) left out."""
    a, s = g.arch, moe_sizes(g)
    dtype = model_dtype(g.path)
    L = s["num_hidden_layers"] - g.int(
        f"{a}.nextn_predict_layers", 0, lo=0, hi=s["num_hidden_layers"] - 1
    )
    hd = s["head_dim"]
    rope_dim = g.int(f"{a}.rope.dimension_count", hd // 2, hi=hd)
    cfg: dict[str, Any] = {
        "model_type": "glm4_moe",
        "architectures": ["Glm4MoeForCausalLM"],
        **{k: v for k, v in s.items() if k != "expert_size"},
        **_sigmoid_routing(g, L),
        "num_hidden_layers": L,
        "intermediate_size": g.int(f"{a}.feed_forward_length"),
        "moe_intermediate_size": s["expert_size"],
        "partial_rotary_factor": rope_dim / hd,
        "use_qk_norm": "blk.0.attn_q_norm.weight" in g.tensors,
        "attention_bias": "blk.0.attn_q.bias" in g.tensors,
        "rms_norm_eps": g.float(f"{a}.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": g.float(f"{a}.rope.freq_base", 10000.0),
        "rope_scaling": rope_scaling(g),
        "max_position_embeddings": g.int(f"{a}.context_length", 131072, hi=1 << 31),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "torch_dtype": dtype,
    }
    if int(hd * cfg["partial_rotary_factor"]) != rope_dim:
        g.fail(f"{a}.rope.dimension_count", f"{rope_dim} of head size {hd}")

    def per_layer(i: int) -> dict:
        shapes = {
            **attention_shapes(g, cfg, i),
            "attn_norm.weight": (s["hidden_size"],),
            "post_attention_norm.weight": (s["hidden_size"],),
            **_sigmoid_moe_shapes(g, cfg, i),
        }
        if cfg["use_qk_norm"]:
            shapes.update({"attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,)})
        return shapes

    moe_layers = list(range(cfg["first_k_dense_replace"], L))
    return cfg, moe_layers, check_shapes(g, cfg, per_layer, attention=False)


def convert_glm4moe(
    g: Gguf, c: GgufConfig, out: Path, calibration_tokens: int, progress: bool
) -> Path:
    cfg, L = c.config, c.config["num_hidden_layers"]
    dense = DenseWriter(c.dtype)
    add_embeddings(dense, g, cfg)
    for i in range(L):
        pre = f"model.layers.{i}"
        add_layer_norms(dense, g, i, "post_attention_norm")
        if cfg["use_qk_norm"]:
            add_norm(dense, g, f"blk.{i}.attn_q_norm.weight", f"{pre}.self_attn.q_norm.weight")
            add_norm(dense, g, f"blk.{i}.attn_k_norm.weight", f"{pre}.self_attn.k_norm.weight")
        add_attention(dense, g, i, pre)  # NeoX rotary: rows not permuted
        _add_sigmoid_moe(dense, g, cfg, i, pre)
    return convert_moe(g, c, out, dense, calibration_tokens, progress)


def deepseek2_config(g: Gguf) -> tuple[dict[str, Any], list[int], set[str]]:
    """DeepSeek-V3 / Kimi K2 (deepseek2 with sigmoid routing), as llama.cpp's converter writes
    them: multi-head latent attention written as one-KV-head MQA (head_count_kv 1, key_length
    kv_lora_rank + rope dims); kv_b_proj split into attn_k_b [heads, rank, nope] and attn_v_b
    [heads, v, rank], which are our embed_q and unembed_out as they are; interleaved rotary
    (llama.cpp's "norm" rope: rows not permuted). YaRN's mscale comes back from
    yarn_log_multiplier (0.1 x mscale_all_dim), applied as llama.cpp does: to the attention
    scale only (mscale = mscale_all_dim, as DeepSeek-V3's own config says)."""
    a, s = g.arch, moe_sizes(g)
    dtype = model_dtype(g.path)
    L, H, dim = s["num_hidden_layers"], s["num_attention_heads"], s["hidden_size"]
    rank = g.int(f"{a}.attention.kv_lora_rank")
    rope = g.int(f"{a}.rope.dimension_count")
    nope = g.int(f"{a}.attention.key_length_mla") - rope
    if nope < 1 or s["head_dim"] != rank + rope:
        g.fail(f"{a}.attention.key_length_mla", f"{nope + rope} with rope dims {rope}")
    v_dim = g.int(f"{a}.attention.value_length_mla")
    q_rank = (
        g.int(f"{a}.attention.q_lora_rank")
        if f"{a}.attention.q_lora_rank" in g.reader.fields
        else None
    )
    cfg: dict[str, Any] = {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        **{k: v for k, v in s.items() if k not in ("expert_size", "head_dim")},
        **_sigmoid_routing(g, L),
        "num_key_value_heads": H,
        "intermediate_size": g.int(f"{a}.feed_forward_length"),
        "moe_intermediate_size": s["expert_size"],
        "kv_lora_rank": rank,
        "q_lora_rank": q_rank,
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": nope,
        "v_head_dim": v_dim,
        "rope_interleave": True,
        "attention_bias": False,
        "rms_norm_eps": g.float(f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": g.float(f"{a}.rope.freq_base", 10000.0),
        "rope_scaling": _deepseek2_rope_scaling(g),
        "max_position_embeddings": g.int(f"{a}.context_length", 163840, hi=1 << 31),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "torch_dtype": dtype,
    }
    q_out = H * (nope + rope)

    def per_layer(i: int) -> dict:
        shapes: dict[str, tuple] = {
            "attn_norm.weight": (dim,),
            "ffn_norm.weight": (dim,),
            "attn_kv_a_mqa.weight": (rank + rope, dim),
            "attn_kv_a_norm.weight": (rank,),
            "attn_k_b.weight": (H, rank, nope),
            "attn_v_b.weight": (H, v_dim, rank),
            "attn_output.weight": (dim, H * v_dim),
            **_sigmoid_moe_shapes(g, cfg, i),
        }
        if q_rank is None:
            shapes["attn_q.weight"] = (q_out, dim)
        else:
            shapes.update(
                {
                    "attn_q_a.weight": (q_rank, dim),
                    "attn_q_a_norm.weight": (q_rank,),
                    "attn_q_b.weight": (q_out, q_rank),
                }
            )
        return shapes

    moe_layers = list(range(cfg["first_k_dense_replace"], L))
    return cfg, moe_layers, check_shapes(g, cfg, per_layer, attention=False)


def convert_deepseek2(
    g: Gguf, c: GgufConfig, out: Path, calibration_tokens: int, progress: bool
) -> Path:
    cfg, L, q_rank = c.config, c.config["num_hidden_layers"], c.config["q_lora_rank"]
    dense = DenseWriter(c.dtype)
    add_embeddings(dense, g, cfg)
    for i in range(L):
        pre, blk = f"model.layers.{i}", f"blk.{i}"
        at = f"{pre}.self_attn"
        add_layer_norms(dense, g, i, "ffn_norm")
        if q_rank is None:
            dense.add(f"{at}.q_proj", g.tensor(f"{blk}.attn_q.weight"))
        else:
            dense.add(f"{at}.q_a_proj", g.tensor(f"{blk}.attn_q_a.weight"))
            add_norm(dense, g, f"{blk}.attn_q_a_norm.weight", f"{at}.q_a_layernorm.weight")
            dense.add(f"{at}.q_b_proj", g.tensor(f"{blk}.attn_q_b.weight"))
        dense.add(f"{at}.kv_a_proj_with_mqa", g.tensor(f"{blk}.attn_kv_a_mqa.weight"))
        add_norm(dense, g, f"{blk}.attn_kv_a_norm.weight", f"{at}.kv_a_layernorm.weight")
        for gname, name in (("attn_k_b", "embed_q"), ("attn_v_b", "unembed_out")):
            t = g.tensor(f"{blk}.{gname}.weight")
            dense.add_array(f"{at}.{name}.weight", dequantize_rows(raw_rows(t), t))
        dense.add(f"{at}.o_proj", g.tensor(f"{blk}.attn_output.weight"))
        _add_sigmoid_moe(dense, g, cfg, i, pre)
    return convert_moe(g, c, out, dense, calibration_tokens, progress)


def _deepseek2_rope_scaling(g: Gguf) -> dict[str, Any] | None:
    a = g.arch
    if g.str(f"{a}.rope.scaling.type") != "yarn":
        return rope_scaling(g)
    key = f"{a}.rope.scaling.yarn_log_multiplier"
    if key not in g.reader.fields:
        g.fail(key, "missing (yarn rotary without it is not DeepSeek-V3's)")
    m = g.float(key) / 0.1
    return {
        "rope_type": "yarn",
        "factor": g.float(f"{a}.rope.scaling.factor"),
        "original_max_position_embeddings": g.int(
            f"{a}.rope.scaling.original_context_length", hi=1 << 31
        ),
        "beta_fast": g.float(f"{a}.rope.scaling.yarn_beta_fast", 32.0),
        "beta_slow": g.float(f"{a}.rope.scaling.yarn_beta_slow", 1.0),
        "mscale": m,
        "mscale_all_dim": m,
    }
