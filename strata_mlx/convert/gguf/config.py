"""What a GGUF's header says the store will be (GgufConfig), and the header readings every
architecture shares: sizes, rotary scaling, expert and attention tensor shapes, the MoE
layers' record formats and layouts. Never: reads tensor data or writes the store.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...format.store import PROJECTIONS, RecordLayout, StoreError
from .blocks import (
    FLOAT_TYPES,
    build_layout,
    choose_format,
    dequantizable,
    projection_shapes,
    qtype_name,
    raw_rows,
)
from .reading import GGUF_PROJ, MAX_DIM, MAX_LAYERS, Gguf


def check_heads(g: Gguf, heads: int, kv: int, head_dim: int) -> None:
    if heads % kv:
        raise StoreError(f"{g.path}: {kv} key/value heads do not divide {heads} heads")
    if head_dim % 2 or heads * head_dim > MAX_DIM:
        raise StoreError(f"{g.path}: head size {head_dim} x {heads} heads is not a model shape")


@dataclass
class GgufConfig:
    """What convert_gguf makes of a GGUF, from its header alone (no tensor data read): the
    store's config, its MoE layers and each one's record formats and layout, and which of
    the file's tensors become expert records and which dense weights. The converter writes
    the store from it and `strata-mlx plan` forecasts from it: one store, described once."""

    config: dict[str, Any]
    moe_layers: list[int]
    layer_specs: dict[int, dict[str, dict]]  # MoE layer -> projection -> record format
    layouts: list[RecordLayout]  # one per MoE layer, padded to one record size
    expert_tensors: set[str]  # GGUF tensors that become expert records
    dense_tensors: set[str]  # GGUF tensors that become dense weights (or feed them)
    split_experts: int | None = None  # a dense llama's MLPs split into this many experts

    @property
    def model_type(self) -> str:
        return self.config["model_type"]

    @property
    def num_experts(self) -> int:
        return self.config["num_experts"]

    @property
    def dtype(self) -> str:
        return self.config["torch_dtype"]

    @property
    def layer_layouts(self) -> list[RecordLayout] | None:
        """Per-layer layouts for the store, or None when every layer has the first's."""
        return None if all(lay == self.layouts[0] for lay in self.layouts) else self.layouts


def model_dtype(path: Path) -> str:
    return "float32" if path.stat().st_size < 2 * 1024**3 else "float16"


def check_shapes(
    g: Gguf,
    cfg: dict[str, Any],
    per_layer: dict[str, tuple[int, ...]] | Callable[[int], dict[str, tuple[int, ...]]],
    attention: bool = True,
) -> set[str]:
    """Every tensor the converter reads against the shape the metadata implies, and its type
    against what can be decoded, before anything is read or allocated: a header that lies
    (an expert_count of 2^31 - 1) is an error naming the file, not a 24 GB allocation.
    Returns the names of those tensors.
    `per_layer`: the family's own tensors (blk.{i}.NAME.weight -> shape), or a function of
    the layer giving {NAME.weight or NAME.bias: shape}. `attention`: every layer has
    Llama-style attention and attn_norm/ffn_norm tensors (checked here)."""
    L, D, V = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (V, D), "output_norm.weight": (D,)}
    if "output.weight" in g.tensors:
        shapes["output.weight"] = (V, D)
    for i in range(L):
        if attention:
            for name, shape in attention_shapes(g, cfg, i).items():
                shapes[f"blk.{i}.{name}"] = shape
            for name in ("attn_norm", "ffn_norm"):
                shapes[f"blk.{i}.{name}.weight"] = (D,)
        if callable(per_layer):
            for name, shape in per_layer(i).items():
                shapes[f"blk.{i}.{name}"] = shape
        else:
            for name, shape in per_layer.items():
                shapes[f"blk.{i}.{name}.weight"] = shape
    for name, shape in shapes.items():
        t = g.tensor(name, shape)
        if qtype_name(t) not in FLOAT_TYPES and not dequantizable(t):
            raise StoreError(f"{g.path}: tensor {name}: type {qtype_name(t)} is not supported")
    return set(shapes)


# ---- MoE architectures: experts keep their ggml blocks ------------------------------------
#
# qwen3moe, qwen3next, olmoe and Mixtral (architecture "llama" with ffn_*_exps tensors): each
# expert's gate/up/down rows are cut out of the stacked [E, rows, row_bytes] tensors as they
# are (no requantization), with each layer's own ggml types (a Q4_K_M file's down projection
# is Q6_K in some layers and Q4_K in others): per-layer record layouts, padded to one record
# size. llama.cpp's `--fuse-gate-up-exps` writes gate and up as one ffn_gate_up_exps tensor
# [E, 2 * I, D], gate rows first: whole rows, so its blocks are kept too. Routers stay float;
# dense tensors as above (Q4_0/Q4_1/Q8_0 repacked, others dequantized).


def has_experts(g: Gguf) -> bool:
    """Whether the file is a MoE model, by its tensors (any blk.N.ffn_*_exps) or its
    metadata ({arch}.expert_count > 0): a Mixtral GGUF is architecture "llama"."""
    if any(n.endswith("_exps.weight") for n in g.tensors):
        return True
    n = g.get(f"{g.arch}.expert_count", 0)
    return isinstance(n, int) and not isinstance(n, bool) and n > 0


def moe_sizes(g: Gguf) -> dict[str, int]:
    """What every MoE architecture's metadata says the same way."""
    a = g.arch
    heads = g.int(f"{a}.attention.head_count")
    if isinstance(g.get(f"{a}.attention.head_count_kv"), list):
        raise StoreError(f"{g.path}: per-layer head counts are not supported")
    dim = g.int(f"{a}.embedding_length")
    E = g.int(f"{a}.expert_count")
    if f"{a}.expert_feed_forward_length" in g.reader.fields:
        inter = g.int(f"{a}.expert_feed_forward_length")
    else:
        inter = g.int(f"{a}.feed_forward_length")
    kv = g.int(f"{a}.attention.head_count_kv", heads)
    head_dim = g.int(f"{a}.attention.key_length", max(dim // heads, 1))
    check_heads(g, heads, kv, head_dim)
    top_k = g.int(f"{a}.expert_used_count")
    if top_k > E:
        g.fail(f"{a}.expert_used_count", f"{top_k} is more than expert_count {E}")
    emb = g.tensor("token_embd.weight")
    return {
        "hidden_size": dim,
        "num_hidden_layers": g.int(f"{a}.block_count", hi=MAX_LAYERS),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "num_experts": E,
        "num_experts_per_tok": top_k,
        "expert_size": inter,
        "vocab_size": g.int(f"{a}.vocab_size", int(emb.shape[1])),
    }


def rope_scaling(g: Gguf) -> dict[str, Any] | None:
    scaling = g.str(f"{g.arch}.rope.scaling.type")
    if scaling in (None, "none"):
        return None
    if scaling == "linear":
        return {"rope_type": "linear", "factor": g.float(f"{g.arch}.rope.scaling.factor")}
    raise StoreError(f"{g.path}: rope scaling {scaling!r} is not supported")


def expert_rows(g: Gguf, layer: int, proj: str, inter: int, e: int):
    """(tensor, raw rows) of expert e's `proj` in layer `layer`: a slice of its ffn_*_exps
    tensor, or a half of the fused ffn_gate_up_exps, or (GGUFs from before llama.cpp stacked
    experts, early 2024 Mixtral files) its own blk.N.ffn_*.E.weight tensor."""
    legacy = f"blk.{layer}.{GGUF_PROJ[proj]}.{e}.weight"
    if legacy in g.tensors:
        t = g.tensor(legacy)
        return t, raw_rows(t)
    fused = f"blk.{layer}.ffn_gate_up_exps.weight"
    if proj != "down_proj" and fused in g.tensors:
        rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
        t = g.tensor(fused)
        return t, raw_rows(t)[e][rows]
    t = g.tensor(f"blk.{layer}.{GGUF_PROJ[proj]}_exps.weight")
    return t, raw_rows(t)[e]


def expert_shapes(g: Gguf, layer: int, E: int, inter: int, dim: int) -> dict[str, tuple]:
    """Layer `layer`'s expert tensors (name without blk.N. and .weight -> shape)."""
    if f"blk.{layer}.ffn_gate.0.weight" in g.tensors:  # one tensor per expert
        shapes = {}
        for e in range(E):
            shapes[f"ffn_gate.{e}"] = (inter, dim)
            shapes[f"ffn_up.{e}"] = (inter, dim)
            shapes[f"ffn_down.{e}"] = (dim, inter)
        return {**shapes, "ffn_gate_inp": (E, dim)}
    if f"blk.{layer}.ffn_gate_up_exps.weight" in g.tensors:
        shapes = {"ffn_gate_up_exps": (E, 2 * inter, dim)}
    else:
        shapes = {"ffn_gate_exps": (E, inter, dim), "ffn_up_exps": (E, inter, dim)}
    return {**shapes, "ffn_down_exps": (E, dim, inter), "ffn_gate_inp": (E, dim)}


def attention_shapes(g: Gguf, cfg: dict[str, Any], i: int, q_rows: int | None = None) -> dict:
    """A Llama-style attention block's tensors (q/k/v/output, biases where present)."""
    D, H, KV, hd = (
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
    )
    shapes: dict[str, tuple] = {}
    rows = {"attn_q": q_rows or H * hd, "attn_k": KV * hd, "attn_v": KV * hd}
    for name, r in rows.items():
        shapes[f"{name}.weight"] = (r, D)
        if f"blk.{i}.{name}.bias" in g.tensors:
            shapes[f"{name}.bias"] = (r,)
    shapes["attn_output.weight"] = (D, H * hd)
    return shapes


def expert_projection_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Each projection's [out, in] in one expert of a MoE GGUF's store."""
    dim = cfg["hidden_size"]
    inter = cfg.get("moe_intermediate_size", cfg.get("intermediate_size"))
    return {"gate_proj": (inter, dim), "up_proj": (inter, dim), "down_proj": (dim, inter)}


def moe_config(g: Gguf, cfg: dict[str, Any], moe_layers: list[int], read: set[str]) -> GgufConfig:
    """A MoE GGUF's store: the experts of `moe_layers` keep their ggml blocks, one format per
    projection and layer (per-layer layouts where types differ, padded to one record size).
    Expert biases (blk.N.ffn_*_exps.bias [E, out], GPT-OSS's) become each record's
    `{proj}.bias` in the model's dtype. `read`: every tensor the converter reads."""
    E, dtype = cfg["num_experts"], cfg["torch_dtype"]
    shapes = expert_projection_shapes(cfg)
    inter = shapes["gate_proj"][0]
    activation = None
    if cfg["model_type"] == "gpt_oss":
        activation = {
            "name": "swiglu_oai",
            "alpha": cfg["swiglu_alpha"],
            "limit": cfg["swiglu_limit"],
        }
    layer_specs, layouts, experts = {}, [], set()
    for i in moe_layers:
        specs, parts = {}, {}
        for p in PROJECTIONS:
            # One type per projection and layer (per-expert tensors of mixed types: float).
            ts = [expert_rows(g, i, p, inter, e)[0] for e in range(E)]
            experts |= {t.name for t in ts}
            specs[p] = choose_format({qtype_name(t) for t in ts}, True, dtype)
            if specs[p]["format"] == "gguf":
                specs[p]["in_features"] = shapes[p][1]
            parts[p] = projection_shapes(specs[p], ts[0], *shapes[p])
            bias = f"blk.{i}.{GGUF_PROJ[p]}_exps.bias"
            if bias in g.tensors:
                experts.add(bias)
                parts[p] = {"bias": (dtype, (shapes[p][0],)), **parts[p]}
        layer_specs[i] = specs
        layouts.append(build_layout(parts, specs, activation))
    record_bytes = max(lay.record_bytes for lay in layouts)
    layouts = [lay.padded(record_bytes) for lay in layouts]
    return GgufConfig(cfg, moe_layers, layer_specs, layouts, experts, read - experts)


def has_layer_experts(g: Gguf, i: int) -> bool:
    return any(f"blk.{i}.{n}.weight" in g.tensors for n in ("ffn_gate_exps", "ffn_gate_up_exps"))
