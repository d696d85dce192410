"""Writing the store: dense weights (DenseWriter: float, or repacked MLX affine), the common
per-layer tensors (attention, norms, embeddings), and the expert records of an MoE GGUF
(`convert_moe`, every MoE architecture's last step). Never: decides what a tensor becomes
(config.GgufConfig does).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ...format.store import PROJECTIONS
from ...format.writer import StoreWriter
from .blocks import (
    AFFINE_TYPES,
    GROUP,
    dequantize_rows,
    projection_tensors,
    qtype_name,
    raw_rows,
    record_arrays,
    repack_affine,
    to_dtype,
    unpermute_rows,
)
from .config import GgufConfig, expert_projection_shapes, expert_rows
from .reading import GGUF_PROJ, Gguf
from .tokenizer import build_tokenizer

# ---- dense tensors ------------------------------------------------------------------------


class DenseWriter:
    """Dense weights as MLX arrays: affine-repacked where lossless, else float."""

    def __init__(self, dtype: str):
        self.dtype = dtype
        self.weights: dict[str, mx.array] = {}
        self.quantized: dict[str, dict[str, int]] = {}

    def add(self, name: str, t, data: np.ndarray | None = None, quantize: bool = True) -> None:
        """Module path `name` (e.g. model.layers.0.self_attn.q_proj) from tensor t."""
        data = raw_rows(t) if data is None else data
        qt = qtype_name(t)
        if quantize and qt in AFFINE_TYPES and data.ndim == 2:
            w, s, b = repack_affine(data, qt, np.float32)
            self.weights[f"{name}.weight"] = mx.array(w)
            self.weights[f"{name}.scales"] = mx.array(s).astype(_mx(self.dtype))
            self.weights[f"{name}.biases"] = mx.array(b).astype(_mx(self.dtype))
            self.quantized[name] = {"group_size": GROUP, "bits": AFFINE_TYPES[qt]}
            return
        self.add_array(f"{name}.weight", dequantize_rows(data, t))

    def add_array(self, key: str, a: np.ndarray) -> None:
        self.weights[key] = mx.array(np.ascontiguousarray(a, dtype=np.float32)).astype(
            _mx(self.dtype)
        )

    def quantization_config(self) -> dict[str, Any] | None:
        if not self.quantized:
            return None
        bits = [q["bits"] for q in self.quantized.values()]
        common = max(set(bits), key=bits.count)
        cfg: dict[str, Any] = {"group_size": GROUP, "bits": common, "mode": "affine"}
        for name, q in self.quantized.items():
            if q["bits"] != common:
                cfg[name] = q
        return cfg


def _mx(name: str):
    return {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}[name]


def convert_moe(
    g: Gguf,
    c: GgufConfig,
    out: Path,
    dense: DenseWriter,
    calibration_tokens: int,
    progress: bool,
) -> Path:
    """Write the store `c` of a MoE GGUF whose dense weights are already in `dense`."""
    from ..common import calibrate

    cfg, E, dtype = c.config, c.num_experts, c.dtype
    moe_layers, layer_specs = c.moe_layers, c.layer_specs
    shapes = expert_projection_shapes(cfg)
    inter = shapes["gate_proj"][0]

    def expert_parts(layer: int, e: int) -> dict[str, dict[str, tuple]]:
        parts = {}
        for p in PROJECTIONS:
            t, data = expert_rows(g, layer, p, inter, e)
            parts[p] = projection_tensors(layer_specs[layer][p], data, t, *shapes[p])
            bias = f"blk.{layer}.{GGUF_PROJ[p]}_exps.bias"
            if bias in g.tensors:
                tb = g.tensor(bias)
                b = dequantize_rows(raw_rows(tb)[e], tb).reshape(-1)
                parts[p] = {"bias": (dtype, to_dtype(b, dtype)), **parts[p]}
        return parts

    qcfg = dense.quantization_config()
    if qcfg:
        cfg["quantization"] = qcfg

    writer = StoreWriter(out, c.model_type, cfg, c.layouts[0], moe_layers, E, c.layer_layouts)
    with writer:
        writer.manifest.extra = {
            "source": {"gguf": g.path.name, "architecture": g.arch},
            "formats": [
                {p: s.get("_src", s["format"]) for p, s in layer_specs[i].items()}
                for i in moe_layers
            ],
        }
        writer.write_dense(dense.weights)
        build_tokenizer(g, writer.path, cfg["vocab_size"])
        write_experts(writer, moe_layers, E, expert_parts, progress)
        calibrate(writer, calibration_tokens, progress=progress)
        return writer.commit()


def add_attention(
    dense: DenseWriter, g: Gguf, i: int, pre: str, unpermute: tuple[int, int] | None = None
) -> None:
    """blk.i.attn_{q,k,v,output} (and biases) -> {pre}.self_attn.{q,k,v,o}_proj; with
    `unpermute` = (heads, kv heads), q/k rows are un-permuted (llama.cpp's llama rotary)."""
    heads, kv = unpermute or (None, None)
    for gname, hname, nh in (
        ("attn_q", "q_proj", heads),
        ("attn_k", "k_proj", kv),
        ("attn_v", "v_proj", None),
        ("attn_output", "o_proj", None),
    ):
        t = g.tensor(f"blk.{i}.{gname}.weight")
        data = raw_rows(t)
        dense.add(f"{pre}.self_attn.{hname}", t, unpermute_rows(data, nh) if nh else data)
        if f"blk.{i}.{gname}.bias" in g.tensors:
            tb = g.tensor(f"blk.{i}.{gname}.bias")
            b = dequantize_rows(raw_rows(tb), tb).reshape(-1)
            dense.add_array(f"{pre}.self_attn.{hname}.bias", unpermute_rows(b, nh) if nh else b)


def add_embeddings(dense: DenseWriter, g: Gguf, cfg: dict[str, Any]) -> None:
    dense.add("model.embed_tokens", g.tensor("token_embd.weight"))
    if not cfg["tie_word_embeddings"]:
        dense.add("lm_head", g.tensor("output.weight"))
    add_norm(dense, g, "output_norm.weight", "model.norm.weight")


def write_experts(writer: StoreWriter, layers, E: int, expert_parts, progress: bool) -> None:
    from tqdm import tqdm

    layers = list(layers)
    with tqdm(total=len(layers) * E, desc="experts", unit="expert", disable=not progress) as bar:
        for i in layers:
            for e in range(E):
                writer.add_expert(i, e, record_arrays(expert_parts(i, e)))
                bar.update(1)


def add_layer_norms(dense: DenseWriter, g: Gguf, i: int, post: str) -> None:
    """Layer i's two norms: attn_norm, and `post` (llama.cpp's name for the norm before the
    MLP: ffn_norm, or post_attention_norm in the architectures that call it so)."""
    pre = f"model.layers.{i}"
    add_norm(dense, g, f"blk.{i}.attn_norm.weight", f"{pre}.input_layernorm.weight")
    add_norm(dense, g, f"blk.{i}.{post}.weight", f"{pre}.post_attention_layernorm.weight")


def add_norm(dense: DenseWriter, g: Gguf, name: str, key: str) -> None:
    t = g.tensor(name)
    dense.add_array(key, dequantize_rows(raw_rows(t), t).reshape(-1))
