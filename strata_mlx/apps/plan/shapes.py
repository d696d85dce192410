"""A model's shape for the forecast (ModelShape): from a store's manifest, a Hugging Face
checkpoint's config.json and safetensors headers, or a GGUF header. Never reads weights."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ...format.store import (
    ALIGNMENT,
    COMPONENT_ALIGNMENT,
    MANIFEST,
    StoreError,
)
from ...stream.memory import activation_itemsize


@dataclass
class ModelShape:
    """What the forecast needs from a model, whatever its source."""

    source: str  # store | hf | gguf
    path: str
    model_type: str
    record_bytes: int  # one expert: gate + up + down, aligned as a store record
    num_experts: int
    moe_layers: int
    top_k: int
    dense_bytes: int
    active_params: int  # per token: dense matmuls + top-k experts (FLOPs = 2x this)
    profile: np.ndarray | None = field(default=None, repr=False)  # [layers, experts] counts
    args: object = field(default=None, repr=False)  # the family's ModelArgs (memory sizing)
    note: str = ""
    kv_itemsize: int = 2  # the activations' and KV cache's bytes an element

    @property
    def n_records(self) -> int:
        return self.num_experts * self.moe_layers

    @property
    def expert_bytes(self) -> int:
        return self.n_records * self.record_bytes


# ---- model shapes ---------------------------------------------------------------------


def _record_bytes(parts: list[int]) -> int:
    """A store record of components of these sizes (64-byte aligned each, 4 KiB in all)."""
    n = sum(-(-p // COMPONENT_ALIGNMENT) * COMPONENT_ALIGNMENT for p in parts)
    return max(-(-n // ALIGNMENT) * ALIGNMENT, ALIGNMENT)


def _args(config: dict, source):
    from ...models.base import normalize_config
    from ...runtime.loader import family

    config = normalize_config(config)
    fam = family(config.get("model_type"), source)
    return fam, fam.ModelArgs.from_dict(config, source)


def _active_params(args, per_expert_params: int, moe_layers: int) -> int:
    """Matmul weights a token uses: attention and dense MLPs (estimated from the shape), the
    LM head, and top-k experts in each MoE layer."""
    D = args.hidden_size
    L = args.num_hidden_layers
    heads = getattr(args, "num_attention_heads", 1) or 1
    kv = getattr(args, "num_key_value_heads", None) or heads
    hd = getattr(args, "head_dim", None) or D // heads
    attn = D * hd * (2 * heads + 2 * kv)
    dense_mlp = 3 * D * (getattr(args, "intermediate_size", 0) or 0)
    k = _top_k(args)
    vocab = getattr(args, "vocab_size", 0) or 0
    return L * attn + (L - moe_layers) * dense_mlp + moe_layers * k * per_expert_params + D * vocab


def from_store(path: Path) -> ModelShape:
    from ...format.store import DENSE, load_manifest, load_profile

    m = load_manifest(path)
    _, args = _args(m.config, path / MANIFEST)
    lay = m.layout
    per_expert = 3 * args.hidden_size * _expert_width(args)
    return ModelShape(
        "store",
        str(path),
        m.model_type,
        lay.record_bytes,
        m.num_experts,
        len(m.moe_layers),
        _top_k(args),
        (path / DENSE).stat().st_size,
        _active_params(args, per_expert, len(m.moe_layers)),
        load_profile(path, m),
        args,
        kv_itemsize=activation_itemsize(m.config.get("torch_dtype")),
    )


def _expert_width(args) -> int:
    """An expert's intermediate width (a split llama's experts share its MLP's columns)."""
    width = getattr(args, "moe_intermediate_size", None)
    if width:
        return width
    if args.model_type == "llama":
        return args.intermediate_size // max(args.num_experts, 1)
    return args.intermediate_size


def _top_k(args) -> int:
    return getattr(args, "num_experts_per_tok", None) or getattr(args, "num_experts", 1)


def _safetensors_headers(src: Path) -> dict[str, tuple[str, int]]:
    """name -> (dtype, bytes) from every *.safetensors header in src (no tensor data read)."""
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise StoreError(f"{src}: no *.safetensors files")
    out = {}
    for f in files:
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise StoreError(f"{f}: truncated safetensors (no header)")
            (n,) = struct.unpack("<Q", head)
            if n > f.stat().st_size - 8:
                raise StoreError(f"{f}: truncated safetensors (header claims {n} bytes)")
            try:
                header = json.loads(fh.read(n))
            except ValueError:
                raise StoreError(f"{f}: corrupt safetensors header") from None
        for k, v in header.items():
            if k != "__metadata__":
                out[k] = (v["dtype"], v["data_offsets"][1] - v["data_offsets"][0])
    return out


ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "U8": 1, "I8": 1, "F64": 8}


def from_hf(src: Path, q_bits: int | None = None, q_group_size: int = 64) -> ModelShape:
    """As `convert --hf-path` would store it: experts as they are (an mlx-lm checkpoint's
    quantized experts stay so), or MLX-affine at `q_bits` (-q)."""
    from ...convert.hf import read_config

    config = read_config(src)
    fam, args = _args(config, src / "config.json")
    tensors = _safetensors_headers(src)
    prefixes = {}
    for layer in range(args.num_hidden_layers):
        p = fam.EXPERT_PREFIX.format(layer=layer)
        prefixes[layer] = (p + ".", p.rsplit(".", 1)[0] + ".switch_mlp.")
    moe = [l for l, ps in prefixes.items() if any(k.startswith(ps) for k in tensors)]
    E = getattr(args, "num_experts", None) or getattr(args, "num_local_experts", 0) or 0
    expert_total, dense = 0, 0
    for k, (_dtype, n) in tensors.items():
        if any(k.startswith(prefixes[l]) for l in moe):
            expert_total += n
        else:
            dense += n
    D, inter = args.hidden_size, _expert_width(args)
    if q_bits is not None:  # weights at q_bits, fp16 scale and bias per group
        parts = [D * inter * q_bits // 8, 2 * 2 * D * inter // q_group_size] * 3
        record = _record_bytes(parts)
    else:
        record = _record_bytes([expert_total // max(len(moe) * E, 1)])
    note = "experts as in the checkpoint" if q_bits is None else f"experts at {q_bits}-bit"
    return ModelShape(
        "hf",
        str(src),
        config.get("model_type", "?"),
        record,
        E,
        len(moe),
        _top_k(args),
        dense,
        _active_params(args, 3 * D * inter, len(moe)),
        None,
        args,
        note,
        kv_itemsize=activation_itemsize(config.get("torch_dtype") or config.get("dtype")),
    )


def from_gguf(path: Path, split_experts: int | None = None) -> ModelShape:
    """As `convert --gguf-path` would store it (convert.gguf.gguf_config, the converter's own
    reading of the header: config, MoE layers, record layouts): expert blocks kept as they
    are, or a dense llama's MLPs split into `split_experts` (16 when not given); dense
    tensors as DenseWriter keeps them (Q4_0/Q4_1/Q8_0 repacked, others in the model's
    dtype: float32 under 2 GB of file, else float16; bfloat16 for gpt-oss)."""
    from ...convert.gguf import Gguf, gguf_config
    from ...convert.gguf.blocks import AFFINE_TYPES, GROUP, qtype_name
    from ...convert.gguf.config import has_experts

    g = Gguf(path)
    if split_experts is None and g.arch == "llama" and not has_experts(g):
        split_experts = 16
    c = gguf_config(g, split_experts)
    _, args = _args(c.config, path)
    item = 2 if c.dtype in ("float16", "bfloat16") else 4
    dense = 0
    for name in c.dense_tensors:
        t = g.tensors[name]
        n = int(t.n_elements)
        bits = AFFINE_TYPES.get(qtype_name(t))
        if bits and len(t.shape) == 2 and "ffn_gate_inp" not in name:  # routers stay float
            dense += n * bits // 8 + 2 * (n // GROUP) * item
        else:
            dense += n * item
    D, inter = args.hidden_size, _expert_width(args)
    if c.split_experts:  # the converter's routers, float [E, D] and [E] a layer
        dense += len(c.moe_layers) * c.num_experts * (D + 1) * item
    moe = len(c.moe_layers)
    return ModelShape(
        "gguf",
        str(path),
        c.model_type,
        c.layouts[0].record_bytes,
        c.num_experts,
        moe,
        _top_k(args),
        dense,
        _active_params(args, 3 * D * inter, moe),
        None,
        args,
        f"llama MLPs split into {c.num_experts} experts" if c.split_experts else "",
        kv_itemsize=item,
    )


def model_shape(
    path: str | Path, q_bits: int | None = None, split_experts: int | None = None
) -> ModelShape:
    path = Path(path)
    if path.is_dir() and (path / MANIFEST).is_file():
        return from_store(path)
    if path.is_dir() and (path / "config.json").is_file():
        return from_hf(path, q_bits)
    if path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic == b"GGUF":
            return from_gguf(path, split_experts)
        raise StoreError(f"{path}: not a GGUF file (magic {magic!r})")
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    raise StoreError(
        f"{path}: not a store (manifest.json), a Hugging Face checkpoint (config.json) or a GGUF"
    )
