"""qwen3next: the header reading and the writer, with llama.cpp's changes to the delta-net
tensors undone.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

from ...format.store import StoreError
from .blocks import dequantize_rows, qtype_name, raw_rows
from .config import (
    GgufConfig,
    attention_shapes,
    check_shapes,
    expert_shapes,
    has_layer_experts,
    model_dtype,
    moe_sizes,
    rope_scaling,
)
from .reading import GGUF_PROJ, Gguf
from .writing import (
    DenseWriter,
    add_attention,
    add_embeddings,
    add_layer_norms,
    add_norm,
    convert_moe,
)


def qwen3next_config(g: Gguf) -> tuple[dict[str, Any], list[int], set[str]]:
    """Qwen3-Next, as llama.cpp's converter (convert_hf_to_gguf.py, Qwen3NextModel) writes it,
    each of its changes undone:
      in_proj_qkvz, grouped per key head [q k v z], is split into attn_qkv [all q | all k |
        all v] and attn_gate [all z]: rows are put back (whole rows: blocks survive);
      A_log is written as ssm_a = -exp(A_log): A_log = log(-ssm_a) (float64, ~1 ulp);
      conv1d [C, 1, K] is squeezed to [C, K]: back to [C, K, 1] (our sanitized layout);
      the (1 + w) norms get their 1 added, as our sanitize() does, so they are kept as they are
        (the gated delta-net's own ssm_norm, a plain weight, has none).
    Layer kinds come from {arch}.attention.recurrent_layers when present (transformers 5
    checkpoints give only layer_types, and then the written full_attention_interval is the
    default 4), else from full_attention_interval. The multi-token-prediction layers that
    the converter appends (without --no-mtp) are left out. Layers without expert tensors
    keep a dense MLP (ffn_gate/up/down)."""
    a, s = g.arch, moe_sizes(g)
    dtype = model_dtype(g.path)
    L, inter, hd = s["num_hidden_layers"], s["expert_size"], s["head_dim"]
    nextn = g.int(f"{a}.nextn_predict_layers", 0, lo=0, hi=L - 1)
    L -= nextn
    n_k, n_v, d_k, d_v, kernel = _ssm_sizes(g)
    rope_dim = g.int(f"{a}.rope.dimension_count", hd)
    if rope_dim > hd or int(hd * (rope_dim / hd)) != rope_dim:
        raise StoreError(f"{g.path}: rope.dimension_count {rope_dim} of head size {hd}")
    linear = _linear_layers(g, L)
    moe_layers = [i for i in range(L) if has_layer_experts(g, i)]
    cfg: dict[str, Any] = {
        "model_type": "qwen3_next",
        "architectures": ["Qwen3NextForCausalLM"],
        **{k: v for k, v in s.items() if k != "expert_size"},
        "num_hidden_layers": L,
        "intermediate_size": g.int(f"{a}.feed_forward_length", inter),
        "moe_intermediate_size": inter,
        "shared_expert_intermediate_size": g.int(f"{a}.expert_shared_feed_forward_length"),
        "linear_num_value_heads": n_v,
        "linear_num_key_heads": n_k,
        "linear_key_head_dim": d_k,
        "linear_value_head_dim": d_v,
        "linear_conv_kernel_dim": kernel,
        "layer_types": ["linear_attention" if x else "full_attention" for x in linear],
        "norm_topk_prob": True,  # llama.cpp's qwen3next graph always renormalizes the top-k
        "rms_norm_eps": g.float(f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": g.float(f"{a}.rope.freq_base", 10000.0),
        "partial_rotary_factor": rope_dim / hd,
        "rope_scaling": rope_scaling(g),
        "max_position_embeddings": g.int(f"{a}.context_length", 32768, hi=1 << 31),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(L) if i not in moe_layers],
        "attention_bias": False,
        "torch_dtype": dtype,
    }
    if not moe_layers:
        raise StoreError(f"{g.path}: no layer has expert tensors (blk.N.ffn_gate_exps.weight)")
    per_layer = functools.partial(_layer_shapes, g, cfg, moe_layers)
    return cfg, moe_layers, check_shapes(g, cfg, per_layer, attention=False)


def _ssm_sizes(g: Gguf) -> tuple[int, int, int, int, int]:
    """The gated delta-net's (key heads, value heads, key head size, value head size, conv
    kernel) from the header."""
    a = g.arch
    n_k = g.int(f"{a}.ssm.group_count")
    n_v = g.int(f"{a}.ssm.time_step_rank")
    d_k = g.int(f"{a}.ssm.state_size")
    inner = g.int(f"{a}.ssm.inner_size")
    if inner % n_v or n_v % n_k:
        raise StoreError(
            f"{g.path}: ssm.inner_size {inner} over {n_v} value heads in {n_k} key groups "
            "is not a Qwen3-Next shape"
        )
    return n_k, n_v, d_k, inner // n_v, g.int(f"{a}.ssm.conv_kernel")


def _linear_layers(g: Gguf, L: int) -> list[bool]:
    """Which of the first L layers are linear attention (the gated delta-net): from
    {arch}.attention.recurrent_layers when present, else every full_attention_interval-th
    layer is full attention."""
    a = g.arch
    recurrent = g.get(f"{a}.attention.recurrent_layers")
    if recurrent is not None:
        if not isinstance(recurrent, list) or len(recurrent) < L:
            g.fail(f"{a}.attention.recurrent_layers", f"expected {L} true/false values")
        return [bool(x) for x in recurrent[:L]]
    interval = g.int(f"{a}.full_attention_interval", 4)
    return [(i + 1) % interval != 0 for i in range(L)]


def _layer_shapes(g: Gguf, cfg: dict[str, Any], moe_layers: list[int], i: int) -> dict:
    """The tensors of layer i and their shapes, as llama.cpp's converter writes them."""
    dim, hd = cfg["hidden_size"], cfg["head_dim"]
    n_v, d_v = cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]
    key_dim, value_dim = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"], n_v * d_v
    conv_dim = 2 * key_dim + value_dim
    shapes: dict[str, tuple] = {
        "attn_norm.weight": (dim,),
        "post_attention_norm.weight": (dim,),
    }
    if cfg["layer_types"][i] == "linear_attention":
        shapes.update(
            {
                "attn_qkv.weight": (conv_dim, dim),
                "attn_gate.weight": (value_dim, dim),
                "ssm_ba.weight": (2 * n_v, dim),
                "ssm_conv1d.weight": (conv_dim, cfg["linear_conv_kernel_dim"]),
                "ssm_a": (n_v,),
                "ssm_dt.bias": (n_v,),
                "ssm_norm.weight": (d_v,),
                "ssm_out.weight": (dim, value_dim),
            }
        )
    else:
        shapes.update(attention_shapes(g, cfg, i, q_rows=2 * cfg["num_attention_heads"] * hd))
        shapes.update({"attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,)})
    if i in moe_layers:
        E, inter = cfg["num_experts"], cfg["moe_intermediate_size"]
        shapes.update({f"{n}.weight": sh for n, sh in expert_shapes(g, i, E, inter, dim).items()})
        shexp = cfg["shared_expert_intermediate_size"]
        shapes.update(
            {
                "ffn_gate_shexp.weight": (shexp, dim),
                "ffn_up_shexp.weight": (shexp, dim),
                "ffn_down_shexp.weight": (dim, shexp),
                "ffn_gate_inp_shexp.weight": (1, dim),
            }
        )
    else:
        dense_ffn = cfg["intermediate_size"]
        shapes.update(
            {
                "ffn_gate.weight": (dense_ffn, dim),
                "ffn_up.weight": (dense_ffn, dim),
                "ffn_down.weight": (dim, dense_ffn),
            }
        )
    return shapes


def convert_qwen3next(
    g: Gguf, c: GgufConfig, out: Path, calibration_tokens: int, progress: bool
) -> Path:
    cfg, moe_layers = c.config, c.moe_layers
    L = cfg["num_hidden_layers"]
    n_k, n_v = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    d_k, d_v = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    kernel = cfg["linear_conv_kernel_dim"]
    linear = [t == "linear_attention" for t in cfg["layer_types"]]
    key_dim, value_dim = n_k * d_k, n_v * d_v
    conv_dim = 2 * key_dim + value_dim
    dense = DenseWriter(c.dtype)
    add_embeddings(dense, g, cfg)
    # in_proj_qkvz rows, group by key head: [q_g | k_g | v_g | z_g] out of [q | k | v] and z.
    r = n_v // n_k
    order = np.concatenate(
        [
            np.concatenate(
                [
                    np.arange(j * d_k, (j + 1) * d_k),
                    key_dim + np.arange(j * d_k, (j + 1) * d_k),
                    2 * key_dim + np.arange(j * r * d_v, (j + 1) * r * d_v),
                    conv_dim + np.arange(j * r * d_v, (j + 1) * r * d_v),
                ]
            )
            for j in range(n_k)
        ]
    )
    for i in range(L):
        pre = f"model.layers.{i}"
        add_layer_norms(dense, g, i, "post_attention_norm")
        if linear[i]:
            la = f"{pre}.linear_attn"
            qkv, z = g.tensor(f"blk.{i}.attn_qkv.weight"), g.tensor(f"blk.{i}.attn_gate.weight")
            if qtype_name(qkv) == qtype_name(z):
                rows = np.concatenate([raw_rows(qkv), raw_rows(z)])[order]
                dense.add(f"{la}.in_proj_qkvz", qkv, rows)
            else:
                w = np.concatenate(
                    [dequantize_rows(raw_rows(qkv), qkv), dequantize_rows(raw_rows(z), z)]
                )
                dense.add_array(f"{la}.in_proj_qkvz.weight", w[order])
            dense.add(f"{la}.in_proj_ba", g.tensor(f"blk.{i}.ssm_ba.weight"))
            dense.add(f"{la}.out_proj", g.tensor(f"blk.{i}.ssm_out.weight"))
            t = g.tensor(f"blk.{i}.ssm_conv1d.weight")
            conv = dequantize_rows(raw_rows(t), t).reshape(conv_dim, kernel, 1)
            dense.add_array(f"{la}.conv1d.weight", conv)
            t = g.tensor(f"blk.{i}.ssm_a")
            A = dequantize_rows(raw_rows(t), t).reshape(-1).astype(np.float64)
            if not (np.isfinite(A) & (A < 0)).all():
                raise StoreError(f"{g.path}: tensor blk.{i}.ssm_a holds values that are not < 0")
            dense.add_array(f"{la}.A_log", np.log(-A))
            add_norm(dense, g, f"blk.{i}.ssm_dt.bias", f"{la}.dt_bias")
            add_norm(dense, g, f"blk.{i}.ssm_norm.weight", f"{la}.norm.weight")
        else:
            add_norm(dense, g, f"blk.{i}.attn_q_norm.weight", f"{pre}.self_attn.q_norm.weight")
            add_norm(dense, g, f"blk.{i}.attn_k_norm.weight", f"{pre}.self_attn.k_norm.weight")
            add_attention(dense, g, i, pre)  # NeoX rotary: rows not permuted
        if i in moe_layers:
            mlp = f"{pre}.mlp"
            dense.add(f"{mlp}.gate", g.tensor(f"blk.{i}.ffn_gate_inp.weight"), quantize=False)
            for p, gp in GGUF_PROJ.items():
                dense.add(f"{mlp}.shared_expert.{p}", g.tensor(f"blk.{i}.{gp}_shexp.weight"))
            t = g.tensor(f"blk.{i}.ffn_gate_inp_shexp.weight")
            gate = raw_rows(t).reshape(1, -1)  # [D] in llama-quantize's files (one row)
            dense.add(f"{mlp}.shared_expert_gate", t, gate, quantize=False)
        else:
            for p, gp in GGUF_PROJ.items():
                dense.add(f"{pre}.mlp.{p}", g.tensor(f"blk.{i}.{gp}.weight"))
    return convert_moe(g, c, out, dense, calibration_tokens, progress)
