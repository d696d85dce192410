"""qwen3moe, olmoe and Mixtral (architecture "llama" with ffn_*_exps tensors): softmax-routed
MoE families, their header readings and writers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...format.store import StoreError
from .config import GgufConfig, check_shapes, expert_shapes, model_dtype, moe_sizes, rope_scaling
from .reading import Gguf
from .writing import (
    DenseWriter,
    add_attention,
    add_embeddings,
    add_layer_norms,
    add_norm,
    convert_moe,
)


def qwen3moe_config(g: Gguf) -> tuple[dict[str, Any], list[int], set[str]]:
    a, s = g.arch, moe_sizes(g)
    dtype = model_dtype(g.path)
    L, E, inter, dim = s["num_hidden_layers"], s["num_experts"], s["expert_size"], s["hidden_size"]
    cfg: dict[str, Any] = {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        **{k: v for k, v in s.items() if k != "expert_size"},
        "intermediate_size": g.int(f"{a}.feed_forward_length", inter),
        "moe_intermediate_size": inter,
        "norm_topk_prob": True,  # llama.cpp's qwen3moe graph always renormalizes the top-k
        "rms_norm_eps": g.float(f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": g.float(f"{a}.rope.freq_base", 1e6),
        "max_position_embeddings": g.int(f"{a}.context_length", 32768, hi=1 << 31),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "torch_dtype": dtype,
    }
    hd = s["head_dim"]

    def per_layer(i: int) -> dict:
        return {
            **{f"{n}.weight": sh for n, sh in expert_shapes(g, i, E, inter, dim).items()},
            "attn_q_norm.weight": (hd,),
            "attn_k_norm.weight": (hd,),
        }

    return cfg, list(range(L)), check_shapes(g, cfg, per_layer)


def convert_qk_norm_moe(
    g: Gguf, c: GgufConfig, out: Path, calibration_tokens: int, progress: bool
) -> Path:
    """qwen3moe and olmoe: the same tensors (q/k norms per head in qwen3moe, over the whole
    projection in olmoe: their shapes are the config's, checked by check_shapes)."""
    cfg, L = c.config, c.config["num_hidden_layers"]
    dense = DenseWriter(c.dtype)
    add_embeddings(dense, g, cfg)
    for i in range(L):
        pre = f"model.layers.{i}"
        add_layer_norms(dense, g, i, "ffn_norm")
        add_norm(dense, g, f"blk.{i}.attn_q_norm.weight", f"{pre}.self_attn.q_norm.weight")
        add_norm(dense, g, f"blk.{i}.attn_k_norm.weight", f"{pre}.self_attn.k_norm.weight")
        # NeoX-rotary architectures in llama.cpp: q/k rows are not permuted.
        add_attention(dense, g, i, pre)
        dense.add(f"{pre}.mlp.gate", g.tensor(f"blk.{i}.ffn_gate_inp.weight"), quantize=False)
    return convert_moe(g, c, out, dense, calibration_tokens, progress)


def olmoe_config(g: Gguf) -> tuple[dict[str, Any], list[int], set[str]]:
    """OLMoE: norms over the whole q and k projections; softmax top-k without renormalizing
    (llama.cpp's olmoe graph has no switch for it). Note llama.cpp's converter writes the
    norm epsilon as 1e-5 whatever the checkpoint's config says (OLMoE's own is 1e-5)."""
    a, s = g.arch, moe_sizes(g)
    dtype = model_dtype(g.path)
    L, E, inter, dim = s["num_hidden_layers"], s["num_experts"], s["expert_size"], s["hidden_size"]
    rope_dim = g.int(f"{a}.rope.dimension_count", s["head_dim"])
    if rope_dim != s["head_dim"]:
        raise StoreError(f"{g.path}: partial rotary ({rope_dim} of {s['head_dim']}) in olmoe")
    cfg: dict[str, Any] = {
        "model_type": "olmoe",
        "architectures": ["OlmoeForCausalLM"],
        **{k: v for k, v in s.items() if k != "expert_size"},
        "intermediate_size": inter,
        "norm_topk_prob": False,
        "rms_norm_eps": g.float(f"{a}.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": g.float(f"{a}.rope.freq_base", 10000.0),
        "rope_scaling": rope_scaling(g),
        "max_position_embeddings": g.int(f"{a}.context_length", 4096, hi=1 << 31),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "attention_bias": "blk.0.attn_q.bias" in g.tensors,
        "torch_dtype": dtype,
    }
    if f"{a}.attention.clamp_kqv" in g.reader.fields:
        cfg["clip_qkv"] = g.float(f"{a}.attention.clamp_kqv")
    H, KV, hd = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]

    def per_layer(i: int) -> dict:
        return {
            **{f"{n}.weight": sh for n, sh in expert_shapes(g, i, E, inter, dim).items()},
            "attn_q_norm.weight": (H * hd,),
            "attn_k_norm.weight": (KV * hd,),
        }

    return cfg, list(range(L)), check_shapes(g, cfg, per_layer)


def mixtral_config(g: Gguf) -> tuple[dict[str, Any], list[int], set[str]]:
    """Mixtral, which llama.cpp writes as architecture "llama" with expert tensors: q/k rows
    un-permuted as for dense llama; top-k then softmax over the k (llama.cpp's softmax over
    all experts renormalized over the top-k: the same weights)."""
    a, s = g.arch, moe_sizes(g)
    dtype = model_dtype(g.path)
    L, E, inter, dim = s["num_hidden_layers"], s["num_experts"], s["expert_size"], s["hidden_size"]
    rope_dim = g.int(f"{a}.rope.dimension_count", s["head_dim"])
    if rope_dim != s["head_dim"]:
        raise StoreError(f"{g.path}: partial rotary ({rope_dim} of {s['head_dim']}) in mixtral")
    if "rope_freqs.weight" in g.tensors:
        raise StoreError(f"{g.path}: rope_freqs.weight (llama3 rope) in a MoE llama GGUF")
    cfg: dict[str, Any] = {
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        **{k: v for k, v in s.items() if k not in ("expert_size", "num_experts")},
        "num_local_experts": E,
        "num_experts": E,
        "intermediate_size": inter,
        "rms_norm_eps": g.float(f"{a}.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": g.float(f"{a}.rope.freq_base", 1e6),
        "rope_scaling": rope_scaling(g),
        "max_position_embeddings": g.int(f"{a}.context_length", 32768, hi=1 << 31),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "torch_dtype": dtype,
    }
    if "blk.0.attn_q.bias" in g.tensors:
        raise StoreError(f"{g.path}: attention biases in a MoE llama GGUF (Mixtral has none)")

    def per_layer(i: int) -> dict:
        return {
            **{f"{n}.weight": sh for n, sh in expert_shapes(g, i, E, inter, dim).items()},
        }

    return cfg, list(range(L)), check_shapes(g, cfg, per_layer)


def convert_mixtral(
    g: Gguf, c: GgufConfig, out: Path, calibration_tokens: int, progress: bool
) -> Path:
    cfg, L = c.config, c.config["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dense = DenseWriter(c.dtype)
    add_embeddings(dense, g, cfg)
    for i in range(L):
        pre = f"model.layers.{i}"
        add_layer_norms(dense, g, i, "ffn_norm")
        add_attention(dense, g, i, pre, unpermute=(heads, kv))
        t = g.tensor(f"blk.{i}.ffn_gate_inp.weight")
        dense.add(f"{pre}.block_sparse_moe.gate", t, quantize=False)
    return convert_moe(g, c, out, dense, calibration_tokens, progress)
