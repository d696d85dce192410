"""Synthetic stores: full-size shapes with random weights, for benchmarks.

`convert --synthetic NAME` reads configs/models/NAME.json (or takes a shape from flags) and
writes a store record by record, never holding the model in memory. Expert weights are
random MLX-affine codes with valid scales (code q of b bits maps to s * (q - (2^b - 1) / 2),
zero-mean, s ~ 1/sqrt(fan-in)/2^(b-1)), so the kernels do real work on real-looking numbers.

Routing of random weights is close to uniform. `router="structured"` (Recipe) gives it the
structure a trained model has, so that prediction and caching are tested on something like
real traffic, and makes the outputs depend on the experts, so that a wrong expert byte shows:
  - skewed popularity: every embedding row (unit norm) adds 0.7 * mu, one shared direction
    (then rows are scaled to rms 1), and expert e's router row carries z_e * mu with z_e
    falling from 0 to -2 by log rank, so some experts are far more popular than others;
  - correlated consecutive layers: every layer's router is sqrt(0.95) R0 + sqrt(0.05) N_l
    around one shared R0;
  - experts that matter: attention's output projection is scaled by 0.02, and the experts'
    down projection so that each MoE update is ~0.3 of the residual it is added to (norms),
    in every layer: the residual grows by sqrt(1 + 0.3^2) a layer, later layers' down
    projections grow with it, and each router's component along mu grows with it too (the
    residual's cosine with mu falls by as much), so every layer routes like the first. Hidden
    states drift by what the experts add, which makes layer l+1's router applied to layer l's
    input a good, imperfect predictor.

Measured (benchmarks/synthetic_routing.py: the store's own weights, one chunk of 1024 random
tokens, experts dequantized to float32 on the CPU), bench-small (hidden 2048, 512 experts,
top-10, 8 layers): 416 distinct experts per layer per chunk (407-423 across layers; a
real 80B-A3B model routes ~410), a per-token lookahead recall of 0.72 (0.71-0.74)
of the true top-10 (chunk level: 0.94 of a layer's distinct experts predicted by some token),
consecutive layers sharing 0.60 of a token's experts, the MoE update 0.30 of the residual in
every layer. Zeroing one layer's experts (layer 4) moves the last 64 positions' logits by
rms 0.26 (their std: 0.58; max 1.2) and changes the top-1 at 61 % of them; every layer's, 95 %.
qwen3-next-80b-a3b (48 layers, same expert shape): the MoE update 0.30 of the residual in
every layer, recall 0.74 (0.71-0.75), 452 distinct experts per layer (414 at layer 0, rising
slowly to ~475 by layer 47: the popularity skew fades a little although the mean cosine with
mu is compensated; top-64 experts take 0.62 of the picks at layer 0, 0.52 at layer 47).
The weak-experts recipe (`--recipe weak-experts`: every residual update x0.02, uncentered
codes; Recipe.weak_experts) measured 362 distinct experts (398 falling to 327 by layer 7),
recall 0.85, shared 0.67, and zeroing every layer's experts moved the logits by at most 0.009
and no top-1: greedy tokens were the same with wrong expert bytes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .. import configs
from ..config import OptionError
from ..format.quant import layout_for
from ..format.store import PROJECTIONS, RecordLayout
from ..format.writer import StoreWriter
from ..models.base import normalize_config
from ..runtime.loader import family
from .common import calibrate, check_output


@dataclass
class Recipe:
    """The structured router's knobs (module docstring; benchmarks/synthetic_routing.py
    measures a recipe). `Recipe.weak_experts()` is one whose experts hardly matter."""

    mean_direction: float = 0.7  # embedding rows (unit norm) + this times mu
    embed_rms: bool = True  # then scaled to rms 1 per element (relative sizes independent of D)
    popularity_nats: float = 2.0  # router term along mu, 0 (most popular) to -this by log rank
    router_shared: float = 0.95  # variance every layer's router shares with one R0
    attention_scale: float = 0.02  # attention's output projection
    gate_up_scale: float = 1.0  # experts' gate and up projections (x fan-in normalized)
    down_scale: float = 10.0  # experts' down projection at the first MoE layer
    # What down_scale makes the MoE update's norm over the residual's (measured 0.30 for
    # bench-small): later layers' down projections grow by sqrt(1 + growth^2) a layer, so that
    # the update stays this share of a residual that grows by as much (layer_growth).
    growth: float = 0.3
    centered: bool = True  # zero-mean expert weights (_random_expert)

    def layer_growth(self, i: int) -> float:
        """The residual's expected norm at the i-th MoE layer over the embedding's."""
        return (1 + self.growth**2) ** (i / 2)

    @classmethod
    def weak_experts(cls) -> Recipe:
        """Every residual update x0.02, uncentered codes: the experts hardly move the logits
        and routing drifts little from token to token."""
        return cls(embed_rms=False, gate_up_scale=0.02, down_scale=0.02, growth=0.0, centered=False)

    @classmethod
    def named(cls, name: str) -> Recipe:
        """`convert --recipe NAME`."""
        name = RECIPE_ALIASES.get(name, name)
        if name not in RECIPES:
            raise OptionError(f"--recipe {name}: one of {', '.join(RECIPES)}")
        return RECIPES[name]()

    def manifest_entry(self) -> str | dict:
        """What a store's config records: the recipe's name, or its fields."""
        for name, make in RECIPES.items():
            if self == make():
                return name
        return dataclasses.asdict(self)


RECIPES = {"default": Recipe, "weak-experts": Recipe.weak_experts}
# Names a recipe had before, still accepted by --recipe.
RECIPE_ALIASES = {"before-issue-17": "weak-experts"}


def synthetic_config(name: str) -> dict:
    """configs/models/NAME.json (package data: strata_mlx.configs)."""
    return configs.read("models", name)


# (the affine widths the expert kernels decode, and MLX's quantization groups)
EXPERT_BITS = (2, 3, 4, 5, 6, 8)
EXPERT_GROUP_SIZES = (32, 64, 128)


def check_experts(bits, gs, config: dict, where: str) -> None:
    """A synthetic shape's experts can be written at all, before any is (OptionError naming
    the key): the affine width and group the kernels take, and each expert input width a
    whole number of groups."""
    if bits not in EXPERT_BITS:
        raise OptionError(f"{where}: expert_bits {bits}: one of {EXPERT_BITS}")
    if gs not in EXPERT_GROUP_SIZES:
        raise OptionError(f"{where}: expert_group_size {gs}: one of {EXPERT_GROUP_SIZES}")
    for key in ("hidden_size", "moe_intermediate_size"):
        width = config.get(key)
        if not isinstance(width, int) or isinstance(width, bool) or width < gs or width % gs:
            raise OptionError(
                f"{where}: {key} {width}: expert inputs come in groups of expert_group_size "
                f"{gs}; give a positive multiple of it"
            )
    if "model_type" not in config:
        raise OptionError(f"{where}: the shape names no model_type")


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
    rng: np.random.Generator,
    pool: np.ndarray,
    layout,
    bits: int,
    scale_mul: dict,
    np_dtype,
    centered: bool = True,
) -> dict:
    """One expert: codes are windows at random offsets into a pool of random bytes (drawing
    fresh bytes for every expert made conversion CPU-bound), scales drawn per expert;
    `scale_mul[proj]` multiplies the fan-in-normalized scale of each projection.

    Centered, code q maps to s * (q - (2^b - 1) / 2): zero-mean weights. Uncentered (the
    weak-experts recipe), s * (q - 2^(b-1)) has mean -s/2: every expert then shares a
    component along the all-ones vector, which feeds itself through the layers and blew the
    residual up ~60x per layer once the experts' outputs were no longer scaled down."""
    zero = (2**bits - 1) / 2 if centered else 2 ** (bits - 1)
    out = {}
    for p in PROJECTIONS:
        w = layout.component(f"{p}.weight")
        s = layout.component(f"{p}.scales")
        fan_in = w.shape[1] * 32 // bits
        base = scale_mul[p] / np.sqrt(fan_in) / 2 ** (bits - 1)
        scales = (base * rng.uniform(0.5, 1.5, size=s.shape)).astype(np_dtype)
        start = int(rng.integers(0, (pool.size - w.nbytes) // 4)) * 4
        out[f"{p}.weight"] = pool[start : start + w.nbytes].view(np.uint32).reshape(w.shape)
        out[f"{p}.scales"] = scales
        out[f"{p}.biases"] = (-zero * scales.astype(np.float32)).astype(np_dtype)
    return out


@dataclass
class Synthetic:
    """A synthetic model before it is written: the dense modules (random, structured) and a
    source of expert records drawn in store order (layer by layer, expert by expert)."""

    config: dict  # the store's config
    model: nn.Module  # the family's modules, dense weights set; experts not attached
    moe_layers: list[int]
    num_experts: int
    layout: RecordLayout
    bits: int
    rng: np.random.Generator
    pool: np.ndarray
    scale_mul: dict[str, float]
    np_dtype: type
    mu: np.ndarray | None  # the structured router's shared direction (None: uniform router)
    recipe: Recipe

    def next_expert(self, position: int) -> dict[str, np.ndarray]:
        """The next expert's record tensors, of the `position`-th MoE layer."""
        mul = dict(self.scale_mul)
        if self.mu is not None:  # structured
            mul["down_proj"] *= self.recipe.layer_growth(position)
        return _random_expert(
            self.rng, self.pool, self.layout, self.bits, mul, self.np_dtype, self.recipe.centered
        )


def build_synthetic(
    name: str | None,
    config: dict | None = None,
    router: str = "structured",
    seed: int = 0,
    dtype: str = "float16",
    recipe: Recipe | None = None,
) -> Synthetic:
    """The dense part of a random-weight model of a named (or given) shape, and its experts'
    generator; `convert_synthetic` writes it, benchmarks/synthetic_routing.py measures it."""
    cfg = dict(config) if config is not None else synthetic_config(name)
    cfg.pop("_comment", None)
    bits = cfg.pop("expert_bits", 4)
    gs = cfg.pop("expert_group_size", 64)
    check_experts(bits, gs, cfg, f"synthetic shape {name or 'given'}")
    if router not in ("uniform", "structured"):
        raise OptionError(f"--router {router}: uniform or structured")
    cfg = normalize_config(cfg)
    if dtype not in ("float16", "float32"):
        raise OptionError(f"--dtype {dtype}: float16 or float32 for synthetic stores")
    mdtype, np_dtype = (mx.float16, np.float16) if dtype == "float16" else (mx.float32, np.float32)
    cfg["torch_dtype"] = dtype
    rc = recipe or Recipe()
    cfg["synthetic"] = {"name": name, "router": router, "seed": seed, "recipe": rc.manifest_entry()}
    fam = family(cfg["model_type"], f"synthetic shape {name}")
    args = fam.ModelArgs.from_dict(cfg)
    mx.random.seed(seed)
    model = fam.Model(args)
    model.set_dtype(mdtype)
    rng = np.random.default_rng(seed)
    D, E = args.hidden_size, args.num_experts
    blocks = model.moe_blocks()
    moe_layers = sorted(blocks)
    structured = router == "structured"
    if structured:
        mu = rng.standard_normal(D).astype(np.float32)
        mu /= np.linalg.norm(mu)
        emb = np.array(model.model.embed_tokens.weight.astype(mx.float32))
        emb = emb / (np.linalg.norm(emb, axis=1, keepdims=True) + 1e-6) + rc.mean_direction * mu
        if rc.embed_rms:
            emb *= np.sqrt(D)
        model.model.embed_tokens.weight = mx.array(emb).astype(mdtype)
        r0 = rng.standard_normal((E, D)).astype(np.float32)
        z = -rc.popularity_nats * np.log1p(np.arange(E)) / np.log1p(E - 1)  # rank 0 most popular
        z = z[rng.permutation(E)]  # popularity unrelated to expert id
        shared = rc.router_shared
        for i, layer in enumerate(moe_layers):
            r = np.sqrt(shared) * r0 + np.sqrt(1 - shared) * rng.standard_normal((E, D)).astype(
                np.float32
            )
            # The residual grows by sqrt(1 + growth^2) a layer while its part along mu stays,
            # so its cosine with mu falls by that factor: scale the router's whole component
            # along mu (the popularity term, and r's own part, which every token shares too)
            # by the growth so far, and every layer routes as skewed as the first.
            growth = rc.layer_growth(i)
            r = r + ((growth - 1) * (r @ mu))[:, None] * mu[None, :]
            r = (r + growth * z[:, None] * mu[None, :]) / np.sqrt(D)
            blocks[layer].gate.weight = mx.array(r).astype(mdtype)
    for layer in model.layers:
        attn = layer.self_attn
        attn.o_proj.weight = attn.o_proj.weight * (rc.attention_scale if structured else 1.0)
    gu, down = (rc.gate_up_scale, rc.down_scale) if structured else (1.0, 1.0)
    layout = _expert_layout(D, args.moe_intermediate_size, bits, gs, mdtype)
    pool = np.frombuffer(rng.bytes(64 << 20), dtype=np.uint8)
    scale_mul = {"gate_proj": gu, "up_proj": gu, "down_proj": down}
    return Synthetic(
        cfg,
        model,
        moe_layers,
        E,
        layout,
        bits,
        rng,
        pool,
        scale_mul,
        np_dtype,
        mu if structured else None,
        rc,
    )


def convert_synthetic(
    name: str | None,
    mlx_path: str | Path,
    config: dict | None = None,
    router: str = "structured",
    seed: int = 0,
    calibration_tokens: int = 128,
    dtype: str = "float16",
    progress: bool = True,
    recipe: Recipe | None = None,
) -> Path:
    """Write a random-weight store of a named (or given) shape; returns its path."""
    from tqdm import tqdm

    out = check_output(mlx_path)
    syn = build_synthetic(name, config, router, seed, dtype, recipe)
    dense = dict(tree_flatten(syn.model.parameters()))
    cfg, E = syn.config, syn.num_experts
    writer = StoreWriter(out, cfg["model_type"], cfg, syn.layout, syn.moe_layers, E)
    with writer:
        writer.write_dense(dense)
        bar = tqdm(
            total=len(syn.moe_layers) * E, desc="experts", unit="expert", disable=not progress
        )
        for i, layer in enumerate(syn.moe_layers):
            for e in range(E):
                writer.add_expert(layer, e, syn.next_expert(i))
                bar.update(1)
        bar.close()
        calibrate(writer, calibration_tokens, seed=seed, progress=progress)
        return writer.commit()
