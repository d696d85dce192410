"""load(): a store on disk -> MLX model modules with an expert cache behind their seams.

Owns family lookup, dense weight loading, arena sizing and wiring the cache to each MoE
layer. Never reads expert records itself (the cache does).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..config import (
    OptionError,
    check_int,
    check_runtime,
)
from ..format.quant import check_layout
from ..format.store import (
    AFFINE_BITS,
    AFFINE_GROUP_SIZES,
    DENSE,
    JsonFields,
    StoreError,
    load_manifest,
    load_profile,
    verify_dense,
)
from ..models.base import normalize_config
from ..stream import memory
from ..stream.arena import Arena
from ..stream.quick import QUICK_RESERVE, QuickMisses
from .deferred import load_device_gate
from .experts import ExpertCache, device_gate_available, tell_words
from .model import StrataModel
from .options import RuntimeConfig

# The supported model types, each run by models/<model_type>.py; ALIASES are run by
# another type's module.
FAMILIES = (
    "qwen3_moe",
    "qwen3_next",
    "mixtral",
    "olmoe",
    "glm4_moe",
    "deepseek_v3",
    "gpt_oss",
    "llama",
)
ALIASES = {"kimi_k2": "deepseek_v3"}  # the same architecture (mlx-lm maps it so too)

GB = 1024**3


def family(model_type: str, source: str | Path = "config.json"):
    """The model-family module for `model_type`, or a StoreError naming `source`."""
    name = ALIASES.get(model_type, model_type)
    if name not in FAMILIES:
        known = ", ".join(sorted((*FAMILIES, *ALIASES)))
        raise StoreError(f"{source}: unknown architecture {model_type!r}; supported: {known}")
    return importlib.import_module(f"..models.{name}", __package__)


def apply_preset(cfg: RuntimeConfig, name: str) -> RuntimeConfig:
    """`cfg` with the options still at their defaults set from configs/runtime/NAME.json."""
    from .. import configs

    given, default = cfg.options(), RuntimeConfig().options()
    preset = {}
    for key, value in configs.read("runtime", name).items():
        if key.startswith("_"):
            continue
        if key not in given:
            raise StoreError(f"{configs.path('runtime', name)}: unknown setting {key!r}")
        if given[key] == default[key]:
            preset[key] = value
    return cfg.replace(**preset)


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 16 * GB


def auto_arena_bytes(
    total_expert_bytes: int, dense_bytes: int, scratch_bytes: int, memory: int | None = None
) -> int:
    """Physical memory minus dense weights, cache/state and prompt scratch, minus headroom
    for the OS and the rest of the process (a quarter of memory, at least 2 GB)."""
    memory = memory or physical_memory()
    headroom = max(memory // 4, 2 * GB)
    free = memory - headroom - dense_bytes - scratch_bytes
    return max(min(free, total_expert_bytes), 0)


def prefill_scratch_bytes(args, step: int) -> int:
    """A generous estimate of one prefill chunk's activation scratch."""
    hidden = getattr(args, "hidden_size", 4096)
    inter = max(
        getattr(args, "moe_intermediate_size", 0) or 0, getattr(args, "intermediate_size", 0) or 0
    )
    k = getattr(args, "num_experts_per_tok", 1)
    return step * (hidden * 16 + inter * k * 3) * 4


def default_prefill_step(memory: int | None = None) -> int:
    """2048 from 16 GB of memory up (the reference: fewer expert reads per token), else 512."""
    return 2048 if (memory or physical_memory()) >= 16 * GB else 512


def choose_arena(
    args,
    record_bytes: int,
    n_records: int,
    dense_bytes: int,
    arena_gb: float | None,
    prefill_step_size: int | None,
    memory_bytes: int | None = None,
    available: int | None = None,
    reserve_bytes: int = 0,
    kv_itemsize: int = 2,
) -> tuple[int, int]:
    """(arena bytes, prefill chunk) that load() picks: the chunk from memory unless given, an
    automatic arena from memory less dense weights and scratch, then the memory guard
    (refuses, or shrinks an automatic arena, before anything is allocated). `memory_bytes`
    and `available` (what a new allocation can get, dense weights already loaded) default to
    this machine's; strata_mlx.plan passes another machine's. `reserve_bytes`: memory the
    caller will hold beside the model (serve's kept prompt caches), counted as scratch is;
    `kv_itemsize` the KV cache's bytes an element (memory.activation_itemsize)."""
    step = prefill_step_size or default_prefill_step(memory_bytes)
    scratch = prefill_scratch_bytes(args, step) + reserve_bytes
    if arena_gb is None:
        arena = auto_arena_bytes(n_records * record_bytes, dense_bytes, scratch, memory_bytes)
    else:
        arena = int(arena_gb * GB)
    arena = memory.fit_arena(
        min(arena, n_records * record_bytes),
        record_bytes,
        scratch + memory.kv_cache_bytes(args, step, kv_itemsize),
        arena_gb,
        available,
    )
    return arena, step


def load_model(
    path: str | Path,
    arena_gb: float | None = None,
    config: RuntimeConfig | None = None,
    pipeline=None,
    reserve_bytes: int = 0,
    **overrides,
):
    """Load a strata-mlx store's model: a StrataModel (runtime/model.py), a context manager
    that closes its cache (`strata_mlx.load` adds the tokenizer, as mlx-lm's load() does).
    `pipeline` (a strata_mlx.distributed.Pipeline): load only this rank's layers.
    `reserve_bytes`: memory the caller will hold beside the model (serve's kept prompt
    caches): the automatic arena leaves it free, the memory guard counts it."""
    cfg = config if config is not None else RuntimeConfig()
    if arena_gb is not None:
        overrides["arena_gb"] = arena_gb
    try:
        cfg = cfg.replace(**overrides)
    except TypeError as e:
        raise TypeError(f"load(): {e}") from None
    check_runtime(cfg)
    check_int("reserve_bytes", reserve_bytes, 0)
    if pipeline is not None and pipeline.size > 1:
        cfg.decode = "sync"  # the pipelined decoder runs a whole model (strata_mlx.decode)
    else:
        pipeline = None
    path = Path(path)
    manifest = load_manifest(path)
    module, args = build_module(manifest, cfg, path)

    dense_path = path / DENSE
    if cfg.verify:
        verify_dense(path, manifest)
    try:
        weights = mx.load(str(dense_path))
    except Exception as e:  # mlx raises RuntimeError/ValueError with its own wording
        raise StoreError(f"{dense_path}: unreadable safetensors ({e})") from None
    stage = None
    full_manifest = manifest
    if pipeline is not None:  # this rank's layers, records and weights only
        step = cfg.prefill_step_size or default_prefill_step()
        stage = pipeline.take(module, manifest, weights, args, step)
        manifest, weights = stage.manifest, stage.weights
    load_dense(module, weights, manifest, path)
    cache = build_expert_cache(
        path, manifest, full_manifest, stage, cfg, args, weights, reserve_bytes
    )
    blocks = None if stage is None else stage.blocks
    model = StrataModel(module, cache, cfg, path, blocks, pipeline)
    if pipeline is not None:
        model = pipeline.wrap(model)
    return model


def store_args(path: str | Path):
    """The family's ModelArgs of the store at `path` (its manifest's config); nothing built."""
    path = Path(path)
    return model_args(load_manifest(path), path)


def model_args(manifest, path: Path):
    """The family's ModelArgs from `manifest`'s config (the store at `path`)."""
    source = path / "manifest.json"
    fam = family(manifest.model_type, source)
    return fam.ModelArgs.from_dict(normalize_config(manifest.config), source, "config.")


def sequence_kv_bytes(
    path: str | Path, positions: int, kv_bits: int | None = None, kv_group_size: int = 64
) -> int:
    """The KV cache and recurrent state one sequence of `positions` positions holds in the
    store at `path`, as the memory guard counts caches (memory.kv_cache_bytes, at the store's
    activation itemsize); with `kv_bits`, the attention part as a quantized cache's codes
    plus a scale and a bias per `kv_group_size` elements."""
    return _kv_bytes(*_kv_shape(path), positions, kv_bits, kv_group_size)


def _kv_shape(path: str | Path):
    """(ModelArgs, the KV cache's bytes an element) of the store at `path`."""
    path = Path(path)
    manifest = load_manifest(path)
    return model_args(manifest, path), memory.activation_itemsize(
        manifest.config.get("torch_dtype")
    )


def _kv_bytes(args, itemsize: int, positions: int, kv_bits: int | None, kv_group_size: int) -> int:
    total = memory.kv_cache_bytes(args, positions, itemsize)
    if not kv_bits:
        return total
    fixed = memory.kv_cache_bytes(args, 0, itemsize)  # recurrent state: not quantized
    per_element = kv_bits / 8 + 2 * itemsize / kv_group_size
    return fixed + math.ceil((total - fixed) * per_element / itemsize)


def kv_beyond_a_chunk(
    args, itemsize: int, positions: int, step: int, kv_bits: int | None = None, kv_group_size=64
) -> int:
    """The KV cache (and recurrent state) of `positions` positions beyond the one chunk of
    `step` that choose_arena leaves room for (memory.kv_cache_bytes at `step`, unquantized)."""
    whole = _kv_bytes(args, itemsize, positions, kv_bits, kv_group_size)
    return max(whole - memory.kv_cache_bytes(args, step, itemsize), 0)


def kv_past_a_chunk(
    path: str | Path,
    positions: int,
    step: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    max_kv_size: int | None = None,
) -> int:
    """The KV cache (and recurrent state) of `positions` positions (at most `max_kv_size`, a
    rotating cache's) beyond the one chunk of `step` (None: the default) that load()'s arena
    leaves room for: what a caller that knows its prompt passes as `reserve_bytes`, so that
    an automatic arena does not hold the memory a long prompt's cache grows into."""
    if max_kv_size:
        positions = min(positions, max_kv_size)
    args, itemsize = _kv_shape(path)  # (the manifest read once)
    step = step or default_prefill_step()
    return kv_beyond_a_chunk(args, itemsize, positions, step, kv_bits, kv_group_size)


def build_module(manifest, cfg: RuntimeConfig, path: Path) -> tuple[nn.Module, object]:
    """(the family's model, unevaluated, its ModelArgs) from the store's config, every MoE
    block routing to `cfg.experts_per_token` experts when that is set."""
    source = path / "manifest.json"
    fam = family(manifest.model_type, source)
    args = model_args(manifest, path)
    if cfg.experts_per_token is not None:
        if cfg.experts_per_token > manifest.num_experts:
            raise OptionError(
                f"{path}: experts_per_token {cfg.experts_per_token}: the store has "
                f"{manifest.num_experts} experts a layer"
            )
        # The family builds its blocks with this top-k: nothing is changed on them later.
        args = dataclasses.replace(args, num_experts_per_tok=cfg.experts_per_token)
    try:
        module = fam.Model(args)
    except (ValueError, OverflowError) as e:  # a family's refusal, or a width MLX cannot index
        if cfg.experts_per_token is not None:
            raise OptionError(f"experts_per_token: {str(e).splitlines()[0]}") from None
        raise StoreError(f"{source}: config: {str(e).splitlines()[0]}") from None
    check_experts(manifest, module, args, source)
    extra = cfg.read_ahead.extra
    if extra and cfg.trace is not None:
        raise OptionError(
            f"lookahead_extra {extra}: a routing trace records top-k predictions; not with --trace",
            "lookahead_extra",
        )
    if extra and not all(hasattr(b, "route_ids") for b in module.moe_blocks().values()):
        raise OptionError(
            f"lookahead_extra {extra}: the {manifest.model_type} family's router gives no ids "
            "alone to widen (qwen3_moe, qwen3_next and mixtral's do)",
            "lookahead_extra",
        )
    return module, args


def load_dense(module: nn.Module, weights: dict, manifest, path: Path) -> None:
    """Quantize `module`'s layers as config.quantization says, load `weights` (strict) and
    evaluate them."""
    source, dense_path = path / "manifest.json", path / DENSE
    quant = check_quantization(manifest.config.get("quantization"), source)
    if quant:

        def predicate(p, m):
            if p in quant and isinstance(quant[p], dict):
                return quant[p]
            return hasattr(m, "to_quantized") and f"{p}.scales" in weights

        try:
            nn.quantize(
                module,
                group_size=quant["group_size"],
                bits=quant["bits"],
                class_predicate=predicate,
            )
        except ValueError as e:  # a layer whose width the group size does not divide
            raise StoreError(f"{source}: config.quantization: {str(e).splitlines()[0]}") from None
    try:
        module.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise StoreError(f"{dense_path}: {str(e).splitlines()[0]}") from None
    bad = [k for k, v in weights.items() if v.dtype not in DENSE_DTYPES]
    if bad:
        raise StoreError(f"{dense_path}: {bad[0]} is {weights[bad[0]].dtype}, not a weight dtype")
    mx.eval(module.parameters())


def build_expert_cache(
    path: Path,
    manifest,
    full_manifest,
    stage,
    cfg: RuntimeConfig,
    args,
    weights: dict,
    reserve_bytes: int,
) -> ExpertCache:
    """The arena (sized now: `cfg.prefill_step_size` is set here when it was automatic), the
    reader and the expert cache over `manifest`'s records (a pipeline `stage`'s own)."""
    rb = manifest.layout.record_bytes
    n_records = manifest.num_experts * len(manifest.moe_layers)
    dense_bytes = sum(v.nbytes for v in weights.values())
    itemsize = memory.activation_itemsize(manifest.config.get("torch_dtype"))
    arena_bytes, cfg.prefill_step_size = choose_arena(
        args, rb, n_records, dense_bytes, cfg.arena_gb, cfg.prefill_step_size,
        reserve_bytes=reserve_bytes, kv_itemsize=itemsize,
    )  # fmt: skip
    n_slots = max(1, min(arena_bytes // rb, n_records))
    k = getattr(args, "num_experts_per_tok", 1)  # (experts a token's layer reads)
    profile = load_profile(path, full_manifest)
    if stage is not None:
        profile = stage.profile(profile)
    _warn_unprofiled(path, cfg, profile)
    from ..stream.reader import Reader, needs_bounce, uses_device_copy

    device_copy = cfg.device_copy and uses_device_copy()
    arena = Arena(
        n_slots, rb, cfg.eviction, profile, manifest.moe_layers, on_device=device_copy,
        device_memory=cfg.device_arena,
    )  # fmt: skip
    reader = Reader(
        cfg.io_workers,
        bounce=needs_bounce(),
        split=cfg.read_split_kb * 1024,
        overlap=cfg.read_overlap,
        device_copy=device_copy,
        copy_behind=cfg.copy_behind,
        record_bytes=rb,
        spin_us=cfg.read_spin_us,
        spinners=cfg.read_spinners,
    )
    reader.verify_in_copy = cfg.verify_in_copy
    reader.spread = cfg.read_spread
    cache = ExpertCache(
        path,
        manifest,
        arena,
        reader,
        read_ahead=cfg.read_ahead,
        profile=profile,
        verify=cfg.verify,
        fake_stream=cfg.fake_stream,
        scheduler=cfg.scheduler,
        loop=dict(
            low_water=cfg.scheduler_low_water,
            wake_every=cfg.scheduler_wake_every,
            loop_top_up=cfg.scheduler_loop_top_up,
        ),
        route_bonus=cfg.moce_bonus,
        dump=cfg.dump,
        trace=cfg.trace,
        # (an arena smaller than one token's experts runs a layer in groups: never gated)
        gate=cfg.decode == "pipelined"
        and (device_gate_available() if cfg.decode_gate is None else cfg.decode_gate)
        and n_slots >= k,
    )
    if (gate := cache.sched.residency.gate) is not None:
        gate.prefill_by_driver = cfg.prefill_words_by_driver
        gate.copy_held_us = round(cfg.decode_copy_held_ms * 1000)
        asked = cfg.decode_gate_board  # (None: on where the device gate runs)
        gate.board_on = cache.pipelined.device_gate and asked is not False
        gate.board_fused = gate.board_on and cfg.decode_gate_fused
        quick = cfg.decode_quick_misses
        if quick is None:  # (at most an eighth of the arena: the rest keeps its experts)
            quick = min(QUICK_RESERVE, n_slots // 8)
        elif quick > n_slots // 2 and gate.board_on:
            cache.close()  # (its reader's threads and the mapped table, not left to the GC)
            raise OptionError(
                f"decode_quick_misses {quick}: the arena has {n_slots} slots, and a reserve "
                f"may hold half of them at most ({n_slots // 2})",
                "decode_quick_misses",
            )
        if gate.board_on and quick:
            cache.sched.quick = QuickMisses(cache.sched, gate, quick, cfg.decode_quick_ahead)
        tell_words(cache.sched, decoding=False)  # (until a phase says otherwise)
        if cache.pipelined.device_gate:
            wide = cfg.read_ahead.decode_width(k, manifest.num_experts)  # (lookahead_extra)
            load_device_gate(cache, k, cfg.read_ahead.depth, asked=cfg.decode_gate, wide=wide)
    return cache


# What dense.safetensors may hold: float weights, and uint32 codes of quantized layers.
DENSE_DTYPES = (mx.float32, mx.float16, mx.bfloat16, mx.uint32)


def check_experts(manifest, model, args, source: Path) -> None:
    """The manifest's expert tables against the model its config builds: the same MoE layers,
    as many experts as the routers choose from, and record layouts of the model's width."""
    blocks = sorted(model.moe_blocks())
    if blocks != manifest.moe_layers:
        raise StoreError(
            f"{source}: experts.moe_layers {_brief(manifest.moe_layers)} are not the model's "
            f"MoE layers {_brief(blocks)}"
        )
    n = getattr(args, "num_experts", None) or getattr(args, "num_local_experts", None)
    if blocks and n != manifest.num_experts:
        raise StoreError(f"{source}: experts.num_experts {manifest.num_experts}, config says {n}")
    if manifest.layer_layouts is None:
        check_layout(manifest.layout, args.hidden_size, f"{source}: experts")
    else:
        for layer, lay in zip(manifest.moe_layers, manifest.layer_layouts):
            check_layout(lay, args.hidden_size, f"{source}: experts, layer {layer}")


def check_quantization(quant, source: Path) -> dict | None:
    """config.quantization (the dense layers'): group size and bits MLX accepts, globally and
    per layer; None when the dense layers are not quantized."""
    if quant is None or quant == {}:
        return None
    f = JsonFields(source)
    f.dict(quant, "config.quantization", ("group_size", "bits"))
    if quant.get("mode", "affine") != "affine":
        f.fail("config.quantization.mode", f"{quant['mode']!r}; this build reads affine")
    for key, spec in [("", quant)] + [
        (f".{k}", v) for k, v in quant.items() if k not in ("group_size", "bits", "mode")
    ]:
        field = f"config.quantization{key}"
        if not isinstance(spec, dict):
            continue  # mlx-lm writes `path: false` for layers left unquantized
        f.dict(spec, field, ("group_size", "bits"))
        unknown = sorted(set(spec) - {"group_size", "bits", "mode"})
        if key and unknown:
            f.fail(field, f"unknown key {unknown[0]!r}")
        for name, allowed in (("bits", AFFINE_BITS), ("group_size", AFFINE_GROUP_SIZES)):
            f.int(spec[name], f"{field}.{name}")
            if spec[name] not in allowed:
                f.fail(f"{field}.{name}", f"{spec[name]} is not one of {allowed}")
    return quant


def _brief(xs: list[int]) -> str:
    return str(xs) if len(xs) <= 8 else f"[{xs[0]}, {xs[1]}, ..., {xs[-1]}] ({len(xs)})"


def _warn_unprofiled(path, cfg: RuntimeConfig, profile) -> None:
    """A policy that ranks experts by the store's routing profile, on a store without one
    (converted with --calibration-tokens 0): it ranks them by id, and said nothing."""
    import warnings

    if profile is not None:
        return
    uses = [f"--read-ahead {cfg.read_ahead.policy}"] if cfg.read_ahead.policy == "static" else []
    if cfg.eviction == "profile":
        uses.append("--eviction profile")
    if uses:
        warnings.warn(
            f"{path}: no routing profile (profile.json); {' and '.join(uses)} ranks experts by id",
            stacklevel=2,
        )
