"""gpt-oss: MXFP4 experts, biases, sinks; the header reading and the writer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...format.store import StoreError
from .config import (
    GgufConfig,
    attention_shapes,
    check_shapes,
    expert_shapes,
    moe_sizes,
    rope_scaling,
)
from .reading import Gguf
from .writing import (
    DenseWriter,
    add_attention,
    add_embeddings,
    add_layer_norms,
    add_norm,
    convert_moe,
)

# ---- gpt-oss -------------------------------------------------------------------------------

# What llama.cpp's gpt-oss graph fixes and its converter therefore does not write: the clamped
# SwiGLU's alpha and limit (ggml_swiglu_oai(..., 1.702f, 7.0f)), and the layer pattern
# (set_swa_pattern(2): even layers sliding, odd ones full, as transformers' default).
GPT_OSS_SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}


def gpt_oss_config(g: Gguf) -> tuple[dict[str, Any], list[int], set[str]]:
    """GPT-OSS (gpt-oss), as llama.cpp's converter (conversion/gpt_oss.py) writes it: MXFP4
    experts (ffn_{gate,up,down}_exps, type MXFP4, gate and up de-interleaved from
    gate_up_proj) kept as the store's mxfp4 records, their nibbles moved back to our order
    (repack_mxfp4), or any other type as for the other families (a float checkpoint's
    converts to F32/F16/BF16/Q8_0 experts); expert biases (ffn_*_exps.bias), the router's
    bias (ffn_gate_inp.bias), attention biases and sinks (attn_sinks.weight); NeoX rotary
    (rows not permuted) with YaRN from rope.scaling.*; attention.sliding_window. The file
    has no `truncate` for YaRN: imported as GPT-OSS's config says (false), transformers'
    and OpenAI's reference rule (llama.cpp itself rounds the ramp's ends: docs/decisions.md)."""
    a, s = g.arch, moe_sizes(g)
    # GPT-OSS is a bf16 model: a file too big for float32 keeps bf16's range, not fp16's.
    dtype = "float32" if g.path.stat().st_size < 2 * 1024**3 else "bfloat16"
    L, E, inter, dim = s["num_hidden_layers"], s["num_experts"], s["expert_size"], s["hidden_size"]
    H, hd = s["num_attention_heads"], s["head_dim"]
    rope_dim = g.int(f"{a}.rope.dimension_count", hd)
    if rope_dim != hd:
        raise StoreError(f"{g.path}: partial rotary ({rope_dim} of {hd}) in gpt-oss")
    cfg: dict[str, Any] = {
        "model_type": "gpt_oss",
        "architectures": ["GptOssForCausalLM"],
        **{k: v for k, v in s.items() if k not in ("expert_size", "num_experts")},
        "num_local_experts": E,
        "num_experts": E,
        "intermediate_size": inter,
        "sliding_window": g.int(f"{a}.attention.sliding_window"),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)],
        "rms_norm_eps": g.float(f"{a}.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": g.float(f"{a}.rope.freq_base", 150000.0),
        "rope_scaling": _gpt_oss_rope_scaling(g),
        "max_position_embeddings": g.int(f"{a}.context_length", 131072, hi=1 << 31),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "attention_bias": True,
        **GPT_OSS_SWIGLU,
        "torch_dtype": dtype,
    }

    def per_layer(i: int) -> dict:
        shapes = {
            **attention_shapes(g, cfg, i),
            "attn_output.bias": (dim,),
            "attn_sinks.weight": (H,),
            "attn_norm.weight": (dim,),
            "post_attention_norm.weight": (dim,),
            **{f"{n}.weight": sh for n, sh in expert_shapes(g, i, E, inter, dim).items()},
            "ffn_gate_inp.bias": (E,),
        }
        for gp, rows in (("ffn_gate", inter), ("ffn_up", inter), ("ffn_down", dim)):
            shapes[f"{gp}_exps.bias"] = (E, rows)
        for name in ("attn_q", "attn_k", "attn_v"):
            if f"{name}.bias" not in shapes:
                raise StoreError(f"{g.path}: tensor blk.{i}.{name}.bias not found")
        return shapes

    return cfg, list(range(L)), check_shapes(g, cfg, per_layer, attention=False)


def convert_gpt_oss(
    g: Gguf, c: GgufConfig, out: Path, calibration_tokens: int, progress: bool
) -> Path:
    cfg, L = c.config, c.config["num_hidden_layers"]
    dense = DenseWriter(c.dtype)
    add_embeddings(dense, g, cfg)
    for i in range(L):
        pre = f"model.layers.{i}"
        add_layer_norms(dense, g, i, "post_attention_norm")
        add_attention(dense, g, i, pre)  # NeoX rotary: rows not permuted
        add_norm(dense, g, f"blk.{i}.attn_sinks.weight", f"{pre}.self_attn.sinks")
        dense.add(f"{pre}.mlp.router", g.tensor(f"blk.{i}.ffn_gate_inp.weight"), quantize=False)
        add_norm(dense, g, f"blk.{i}.ffn_gate_inp.bias", f"{pre}.mlp.router.bias")
    return convert_moe(g, c, out, dense, calibration_tokens, progress)


def _gpt_oss_rope_scaling(g: Gguf) -> dict[str, Any] | None:
    a = g.arch
    if g.str(f"{a}.rope.scaling.type") != "yarn":
        return rope_scaling(g)
    return {
        "rope_type": "yarn",
        "factor": g.float(f"{a}.rope.scaling.factor"),
        "original_max_position_embeddings": g.int(
            f"{a}.rope.scaling.original_context_length", hi=1 << 31
        ),
        "beta_fast": g.float(f"{a}.rope.scaling.yarn_beta_fast", 32.0),
        "beta_slow": g.float(f"{a}.rope.scaling.yarn_beta_slow", 1.0),
        "truncate": False,
    }
