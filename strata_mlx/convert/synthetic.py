"""Synthetic stores: full-size shapes with random weights, for benchmarks.

`convert --synthetic NAME` reads configs/models/NAME.json (or takes a shape from flags) and
writes a store record by record, never holding the model in memory. Expert weights are
random MLX-affine codes with valid scales (every code maps to a weight in about
[-8s, 7s], s = 1/sqrt(fan-in)/8), so the kernels do real work on real-looking numbers.

Routing of random weights is close to uniform. `router="structured"` gives it the structure a
trained model has, so that prediction and caching are tested on something like real traffic:
  - skewed popularity: every embedding row (unit norm) adds 0.7 * mu, one shared direction,
    and expert e's router row carries z_e * mu with z_e falling from 0 to -2 by log rank, so
    some experts are far more popular than others;
  - correlated consecutive layers: every layer's router is sqrt(0.95) R0 + sqrt(0.05) N_l
    around one shared R0, and residual updates (attention output, experts) are scaled by 0.02
    so hidden states drift slowly, which makes layer l+1's router applied to layer l's input
    a good, imperfect predictor.
  Tuned (numpy, hidden 2048, 512 experts, top-10, 1024 tokens) to what the reference system
  saw on a real model: ~430 distinct experts per layer per chunk (reference: ~410), and a
  per-token lookahead recall of ~0.7 of the true top-10.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..loader import family
from ..models.base import normalize_config
from ..quant import layout_for
from ..store import PROJECTIONS, StoreError, StoreWriter
from .common import calibrate, check_output

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"


def synthetic_config(name: str) -> dict:
    path = CONFIGS / f"{name}.json"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in CONFIGS.glob("*.json")))
        raise StoreError(f"{path}: no such synthetic shape (known: {known})")
    return json.loads(path.read_text())


def _expert_layout(D: int, inter: int, bits: int, gs: int, dtype):
    tensors, table = {}, {}
    for p, (out, inn) in {
        "gate_proj": (inter, D),
        "up_proj": (inter, D),
        "down_proj": (D, inter),
    }.items():
        tensors[f"{p}.weight"] = mx.zeros((out, inn * bits // 32), mx.uint32)
        tensors[f"{p}.scales"] = mx.zeros((out, inn // gs), dtype)
        tensors[f"{p}.biases"] = mx.zeros((out, inn // gs), dtype)
        table[p] = {"format": "affine", "bits": bits, "group_size": gs}
    return layout_for(tensors, table)


def _random_expert(
    rng: np.random.Generator, pool: np.ndarray, layout, bits: int, scale_mul: float, np_dtype
) -> dict:
    """One expert: codes are windows at random offsets into a pool of random bytes (drawing
    fresh bytes for every expert made conversion CPU-bound), scales drawn per expert."""
    out = {}
    for p in PROJECTIONS:
        w = layout.component(f"{p}.weight")
        s = layout.component(f"{p}.scales")
        fan_in = w.shape[1] * 32 // bits
        base = scale_mul / np.sqrt(fan_in) / 2 ** (bits - 1)
        scales = (base * rng.uniform(0.5, 1.5, size=s.shape)).astype(np_dtype)
        start = int(rng.integers(0, (pool.size - w.nbytes) // 4)) * 4
        out[f"{p}.weight"] = pool[start : start + w.nbytes].view(np.uint32).reshape(w.shape)
        out[f"{p}.scales"] = scales
        out[f"{p}.biases"] = (-(2 ** (bits - 1)) * scales.astype(np.float32)).astype(np_dtype)
    return out


def convert_synthetic(
    name: str | None,
    mlx_path: str | Path,
    config: dict | None = None,
    router: str = "structured",
    seed: int = 0,
    calibration_tokens: int = 128,
    dtype: str = "float16",
    progress: bool = True,
) -> Path:
    """Write a random-weight store of a named (or given) shape; returns its path."""
    from tqdm import tqdm

    out = check_output(mlx_path)
    cfg = dict(config) if config is not None else synthetic_config(name)
    cfg.pop("_comment", None)
    bits = cfg.pop("expert_bits", 4)
    gs = cfg.pop("expert_group_size", 64)
    if router not in ("uniform", "structured"):
        raise ValueError(f"--router {router}: uniform or structured")
    cfg = normalize_config(cfg)
    if dtype not in ("float16", "float32"):
        raise ValueError(f"--dtype {dtype}: float16 or float32 for synthetic stores")
    mdtype, np_dtype = (mx.float16, np.float16) if dtype == "float16" else (mx.float32, np.float32)
    cfg["torch_dtype"] = dtype
    cfg["synthetic"] = {"name": name, "router": router, "seed": seed}
    fam = family(cfg["model_type"], f"synthetic shape {name}")
    args = fam.ModelArgs.from_dict(cfg)
    mx.random.seed(seed)
    model = fam.Model(args)
    model.set_dtype(mdtype)
    rng = np.random.default_rng(seed)
    D, E = args.hidden_size, args.num_experts
    blocks = model.moe_blocks()
    moe_layers = sorted(blocks)
    residual_scale = 0.02 if router == "structured" else 1.0
    if router == "structured":
        mu = rng.standard_normal(D).astype(np.float32)
        mu /= np.linalg.norm(mu)
        emb = np.array(model.model.embed_tokens.weight.astype(mx.float32))
        emb = emb / (np.linalg.norm(emb, axis=1, keepdims=True) + 1e-6) + 0.7 * mu
        model.model.embed_tokens.weight = mx.array(emb).astype(mdtype)
        r0 = rng.standard_normal((E, D)).astype(np.float32)
        z = -2.0 * np.log1p(np.arange(E)) / np.log1p(E - 1)  # rank 0 most popular
        z = z[rng.permutation(E)]  # popularity unrelated to expert id
        for layer in moe_layers:
            r = np.sqrt(0.95) * r0 + np.sqrt(0.05) * rng.standard_normal((E, D)).astype(np.float32)
            r = (r + z[:, None] * mu[None, :]) / np.sqrt(D)
            blocks[layer].gate.weight = mx.array(r).astype(mdtype)
    for layer in model.layers:
        attn = layer.self_attn
        attn.o_proj.weight = attn.o_proj.weight * residual_scale
    dense = dict(tree_flatten(model.parameters()))
    layout = _expert_layout(D, args.moe_intermediate_size, bits, gs, mdtype)
    pool = np.frombuffer(rng.bytes(64 << 20), dtype=np.uint8)
    writer = StoreWriter(out, cfg["model_type"], cfg, layout, moe_layers, E)
    with writer:
        writer.write_dense(dense)
        bar = tqdm(total=len(moe_layers) * E, desc="experts", unit="expert", disable=not progress)
        for layer in moe_layers:
            for e in range(E):
                writer.add_expert(
                    layer, e, _random_expert(rng, pool, layout, bits, residual_scale, np_dtype)
                )
                bar.update(1)
        bar.close()
        calibrate(writer, calibration_tokens, seed=seed)
        return writer.commit()
