"""mlx-lm as the baseline: its own model class built from one of our stores, and a side-by-side
run of it and strata-mlx on the same prompt (`strata-mlx bench --baseline mlx-lm`).

`load_mlx_lm(store)` builds `mlx_lm.models.<family>.Model` with mlx-lm's own ModelArgs: dense
weights as the store holds them (quantized dense layers stay quantized, as `load()` rebuilds
them) and every MoE layer's expert records, read through the manifest's offsets and layout,
stacked into mlx-lm's SwitchGLU parameters (`switch_mlp.{gate,up,down}_proj.{weight,scales,
biases}`). Our dense names are already what mlx-lm's modules hold after ITS sanitize() (Qwen3-
Next's (1 + w) norms folded, conv kernels moved to [C, K, 1]; GPT-OSS's gate_up_proj split,
its experts under `mlp.experts`, where mlx-lm's gpt_oss keeps them), so sanitize() is not called.
MXFP4 experts are mx.quantize(mode="mxfp4")'s own words and scales (strata_mlx.format.quant), so they
load into mlx-lm's QuantizedSwitchLinear in that mode as they are.

GPT-OSS runs as mlx-lm runs it, where the two differ: YaRN with `truncate: false` (its real
configs) with the ramp's ends rounded (~1e-6 in logits, docs/decisions.md); MXFP4 experts
decoded inside gather_qmm, ours before gather_mm (the same float32 weights, sums in another
order: 3 x eps x max|logit| on the tiny model); at decode, sliding layers attend over mlx-lm's
rotating cache in ring order once it wraps (~1e-7 in logits; equal before). Float and affine
experts with `truncate: true` are bit-identical on a prompt. The clamped SwiGLU's alpha and
limit, which mlx-lm fixes, must be 1.702 and 7.0.

mlx-lm is an optional extra (`pip install -e ".[baseline]"`), imported only here and lazily.
This module never touches the arena or the expert cache's reads; it reads experts.bin itself,
through the page cache, once, to hold every expert in memory as mlx-lm does.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..format.store import DENSE, EXPERTS, PROJECTIONS, Manifest, StoreError, load_manifest
from ..models.base import normalize_config

# Our families that mlx-lm has, under the same module name; the same parameter names too.
MLX_LM_FAMILIES = (
    "qwen3_moe",
    "mixtral",
    "olmoe",
    "qwen3_next",
    "glm4_moe",
    "deepseek_v3",
    "gpt_oss",
)
# Families whose mlx-lm model keeps the stacked experts under the checkpoint's own name
# (gpt_oss: mlp.experts), not under switch_mlp.
EXPERTS_AT_CHECKPOINT_NAME = ("gpt_oss",)
# mlx-lm's gpt_oss builds SwigluOAI() at these defaults (and always biased attention, an
# untied lm_head).
GPT_OSS_SWIGLU = {"alpha": 1.702, "limit": 7.0}


def _mlx_lm():
    try:
        import mlx_lm  # noqa: F401
    except ImportError:
        raise StoreError(
            'the mlx-lm baseline needs mlx-lm: pip install -e ".[baseline]" (or pip install mlx-lm)'
        ) from None
    return mlx_lm


def check_runnable(store_path: str | Path) -> None:
    """Raise a one-line StoreError unless mlx-lm is installed and can run this store."""
    _mlx_lm()
    path = Path(store_path)
    _check_runnable(path, load_manifest(path))


def _check_runnable(path: Path, m: Manifest) -> None:
    """One-line StoreError for a store that mlx-lm cannot run as it is."""
    if m.model_type == "llama":
        raise StoreError(
            f"{path}: the llama split family (a dense MLP split into experts) has no mlx-lm "
            "MoE counterpart"
        )
    if _module_name(m.model_type) not in MLX_LM_FAMILIES:
        raise StoreError(
            f"{path}: architecture {m.model_type!r} has no mlx-lm baseline here "
            f"(supported: {', '.join(MLX_LM_FAMILIES)})"
        )
    for lay in m.layouts:
        for proj, spec in lay.quant.items():
            if spec["format"] not in ("affine", "mxfp4", "float"):
                kind = spec.get("type", spec["format"])
                raise StoreError(
                    f"{path}: experts' {proj} is GGUF {kind} blocks, which mlx-lm's "
                    "SwitchGLU cannot run (only MLX affine, MXFP4 and float experts)"
                )
    if m.model_type == "gpt_oss":
        _check_gpt_oss(path, m)
    _check_cpu_gather_mm(path, m)


def _check_cpu_gather_mm(path: Path, m: Manifest) -> None:
    """mlx-lm's SwitchGLU multiplies float experts with gather_mm, which MLX's CPU backend
    runs in float32 only ("[GatherMM::eval] Currently only supports float32")."""
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        return
    for lay in m.layouts:
        for c in lay.components:
            proj = c.name.split(".")[0]
            if lay.quant.get(proj, {}).get("format") == "float" and c.dtype != "float32":
                raise StoreError(
                    f"{path}: mlx-lm runs {c.dtype} float experts through gather_mm, which MLX's "
                    "CPU backend computes in float32 only: run the baseline on a GPU, or on a "
                    "float32 or quantized (-q) store"
                )


def _check_gpt_oss(path: Path, m: Manifest) -> None:
    """What a GPT-OSS store may set that mlx-lm's gpt_oss cannot express."""
    for lay in m.layouts:
        got = {k: (lay.activation or {}).get(k) for k in GPT_OSS_SWIGLU}
        if got != GPT_OSS_SWIGLU:
            raise StoreError(
                f"{path}: experts' swiglu alpha {got['alpha']} and limit {got['limit']}; "
                "mlx-lm's gpt_oss fixes them at 1.702 and 7.0"
            )
    config = normalize_config(m.config)
    if config.get("tie_word_embeddings", False):
        raise StoreError(f"{path}: tied embeddings; mlx-lm's gpt_oss always has its own lm_head")
    if not config.get("attention_bias", True):
        raise StoreError(f"{path}: attention without biases; mlx-lm's gpt_oss always has them")


def _module_name(model_type: str) -> str:
    """The family module a model type runs as (kimi_k2 as deepseek_v3, in mlx-lm too)."""
    from ..runtime.loader import ALIASES

    return ALIASES.get(model_type, model_type)


def mlx_lm_config(m: Manifest, path: Path) -> dict:
    """The store's config in the spellings mlx-lm 0.32 reads, every field its ModelArgs needs
    filled from our family's defaults (synthetic shapes omit e.g. decoder_sparse_step)."""
    from ..runtime.loader import family

    config = normalize_config(m.config)
    ours = family(m.model_type, path / "manifest.json").ModelArgs.from_dict(config)
    merged = {**dataclasses.asdict(ours), **config}
    if m.model_type == "qwen3_next":
        # transformers 5 writes the schedule as layer_types; mlx-lm reads only the interval.
        types = merged.get("layer_types")
        if types:
            interval = types.index("full_attention") + 1 if "full_attention" in types else 0
            if not interval or any(
                (t == "full_attention") != ((i + 1) % interval == 0) for i, t in enumerate(types)
            ):
                raise StoreError(
                    f"{path}: layer_types is not every-Nth-layer full attention, which is "
                    "all mlx-lm's qwen3_next can express"
                )
            merged["full_attention_interval"] = interval
    return merged


def _read_layer(path: Path, m: Manifest, layer: int) -> np.ndarray:
    """Every expert record of `layer`, [num_experts, record_bytes] uint8, in expert order."""
    rb = m.layout.record_bytes
    out = np.empty((m.num_experts, rb), dtype=np.uint8)
    with open(path / EXPERTS, "rb") as f:
        for e in range(m.num_experts):
            off, _ = m.record(layer, e)
            f.seek(off)
            if f.readinto(memoryview(out[e])) != rb:
                raise StoreError(
                    f"{path / EXPERTS}: short read of layer {layer} expert {e} (truncated store?)"
                )
    return out


def stacked_experts(path: Path, m: Manifest, prefix: str, layer: int) -> dict[str, mx.array]:
    """A layer's records as mlx-lm's stacked SwitchGLU parameters under `prefix`."""
    from ..format.quant import component_views

    layout = m.layout_of(layer)
    views = component_views(mx.array(_read_layer(path, m, layer)), layout)
    out = {}
    for name, v in views.items():
        proj, part = name.split(".")
        v = mx.contiguous(v)
        if part == "weight" and layout.quant[proj]["format"] == "mxfp4":
            v = v.view(mx.uint32)  # the bytes of mx.quantize(mode="mxfp4")'s uint32 words
        out[f"{prefix}.{name}"] = v
    mx.eval(out)  # let the raw records go before the next layer is read
    return out


def _switch_quant(spec: dict) -> dict | None:
    """to_quantized() parameters of mlx-lm's SwitchLinear for an expert format; None: float."""
    from ..format.quant import MXFP4_BLOCK

    if spec["format"] == "affine":
        return {"group_size": spec["group_size"], "bits": spec["bits"], "mode": "affine"}
    if spec["format"] == "mxfp4":
        return {"group_size": MXFP4_BLOCK, "bits": 4, "mode": "mxfp4"}
    return None


def load_mlx_lm(store_path: str | Path):
    """mlx-lm's own model for a store: mlx_lm.models.<family>.Model, every weight resident."""
    _mlx_lm()
    from ..convert.hf import switch_prefix
    from ..runtime.loader import family

    path = Path(store_path)
    m = load_manifest(path)
    _check_runnable(path, m)
    arch = importlib.import_module(f"mlx_lm.models.{_module_name(m.model_type)}")
    config = mlx_lm_config(m, path)
    try:
        model = arch.Model(arch.ModelArgs.from_dict(config))
    except (TypeError, ValueError) as e:
        raise StoreError(f"{path / 'manifest.json'}: mlx-lm's ModelArgs: {e}") from None

    dense_path = path / DENSE
    try:
        weights = mx.load(str(dense_path))
    except Exception as e:
        raise StoreError(f"{dense_path}: unreadable safetensors ({e})") from None
    fam = family(m.model_type, path / "manifest.json")
    expert_quant = {}  # module path -> to_quantized() params, or None for float
    for layer in m.moe_layers:
        prefix = fam.EXPERT_PREFIX.format(layer=layer)
        if m.model_type not in EXPERTS_AT_CHECKPOINT_NAME:
            prefix = switch_prefix(prefix)
        weights.update(stacked_experts(path, m, prefix, layer))
        for proj in PROJECTIONS:
            expert_quant[f"{prefix}.{proj}"] = _switch_quant(m.layout_of(layer).quant[proj])

    quant = config.get("quantization") or {}

    def predicate(p, module):
        if p in expert_quant:
            return expert_quant[p] or False
        if p in quant and isinstance(quant[p], dict):
            return dict(quant[p])
        return hasattr(module, "to_quantized") and f"{p}.scales" in weights

    nn.quantize(
        model,
        group_size=quant.get("group_size", 64),
        bits=quant.get("bits", 4),
        class_predicate=predicate,
    )
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise StoreError(
            f"{path}: does not fit mlx-lm's {m.model_type}: {str(e).splitlines()[0]}"
        ) from None
    mx.eval(model.parameters())
    model.eval()
    return model


# ---- the side-by-side run --------------------------------------------------------------------


@dataclasses.dataclass
class Timed:
    prefill_tps: float  # prompt tokens over the time to the first generated token
    decode_ms_per_token: float  # between the first and the last generated token
    tokens: list[int]
    logprobs: np.ndarray  # float32 [vocab]: the first generated token's (last prompt position)


def _timed(steps, prompt_len: int) -> Timed:
    """Drive a (token, logprobs) generator: first token -> prefill, the rest -> decode."""
    tokens = []
    t0 = time.perf_counter()
    t_first = t_decode = t_last = t0
    first = None
    for n, (token, logprobs) in enumerate(steps):
        tokens.append(int(token))
        if n == 0:
            t_first = time.perf_counter()
            first = np.array(logprobs.astype(mx.float32))
            t_decode = t_last = time.perf_counter()
        else:
            t_last = time.perf_counter()
    return Timed(
        prefill_tps=prompt_len / (t_first - t0),
        decode_ms_per_token=(t_last - t_decode) / (len(tokens) - 1) * 1e3
        if len(tokens) > 1
        else 0.0,
        tokens=tokens,
        logprobs=first,
    )


def run_mlx_lm(model, ids: list[int], gen: int, step: int) -> Timed:
    """mlx-lm's generate_step, greedy: prefill in chunks of `step`, then `gen` tokens."""
    from mlx_lm.generate import generate_step

    return _timed(
        generate_step(mx.array(ids), model, max_tokens=gen, prefill_step_size=step), len(ids)
    )


def run_strata(model, ids: list[int], gen: int, step: int) -> Timed:
    """strata-mlx's generate_step, greedy, on the same prompt and chunk size."""
    from ..generation.generate import generate_step, make_sampler

    return _timed(generate_step(model, mx.array(ids), gen, make_sampler(0.0), step), len(ids))


def last_logits(model, ids: list[int], step: int, cache: list) -> np.ndarray:
    """float32 logits of the last prompt position, the prompt run in chunks of `step` (the
    same chunks for either model: on CUDA a chunk's shape can move the last bits)."""
    from ..generation.generate import forward_chunks

    last: list[mx.array] = []  # each chunk's last position; the prompt's is the final one
    forward_chunks(
        model, mx.array(ids), cache, step, on_logits=lambda logits: last.append(logits[0, -1])
    )
    return np.array(last[-1].astype(mx.float32))


def _warmup(run, model, ids: list[int], step: int) -> None:
    # The first pass compiles kernels (MLX CUDA JITs them): no timed run should pay for it.
    run(model, ids[: min(len(ids), step + 1)], 2, step)


def compare(
    path: str | Path,
    ids: list[int],
    gen: int,
    step: int,
    config=None,
    log=print,
) -> dict:
    """mlx-lm's model, then strata-mlx's (every expert resident unless `config.arena_gb` says
    otherwise), on the same prompt: speed of each, their ratios, logits and token parity."""
    from ..runtime.loader import GB, RuntimeConfig, load_model

    path = Path(path)
    m = load_manifest(path)
    from mlx_lm.models.cache import make_prompt_cache

    ref_model = load_mlx_lm(path)
    _warmup(run_mlx_lm, ref_model, ids, step)
    ref = run_mlx_lm(ref_model, ids, gen, step)
    ref_logits = last_logits(ref_model, ids, step, make_prompt_cache(ref_model))
    del ref_model
    gc.collect()
    mx.clear_cache()  # both models need not fit at once

    cfg = (config or RuntimeConfig()).replace(prefill_step_size=step)
    if cfg.arena_gb is None:
        cfg = cfg.replace(arena_gb=m.expert_bytes / GB)
    model = load_model(path, config=cfg)
    try:
        model.expert_cache.warm()
        _warmup(run_strata, model, ids, step)
        ours = run_strata(model, ids, gen, step)
        logits = last_logits(model, ids, step, model.make_cache())
        arena = model.expert_cache.arena
        resident = min(arena.n_slots, m.num_experts * len(m.moe_layers)) / max(
            m.num_experts * len(m.moe_layers), 1
        )
    finally:
        model.expert_cache.close()
    del model
    gc.collect()

    agree = 0
    for a, b in zip(ours.tokens, ref.tokens):
        if a != b:
            break
        agree += 1
    result = {
        "mlx_lm": {"prefill_tps": ref.prefill_tps, "decode_ms_per_token": ref.decode_ms_per_token},
        "strata": {
            "prefill_tps": ours.prefill_tps,
            "decode_ms_per_token": ours.decode_ms_per_token,
            "arena_resident_fraction": resident,
        },
        "prefill_tps_ratio": ours.prefill_tps / ref.prefill_tps if ref.prefill_tps else 0.0,
        "decode_ms_ratio": ours.decode_ms_per_token / ref.decode_ms_per_token
        if ref.decode_ms_per_token
        else 0.0,
        # teacher-forced, both in the same chunks; and the timed runs' own first logprobs
        "max_abs_logit_diff": float(np.max(np.abs(logits - ref_logits))),
        "max_abs_logprob_diff": float(np.max(np.abs(ours.logprobs - ref.logprobs))),
        "tokens": len(ref.tokens),
        "tokens_agree": agree,  # leading greedy tokens equal (later ones see other histories)
        "mlx_lm_tokens": ref.tokens,
        "strata_tokens": ours.tokens,
    }
    for line in lines(result):
        log(line)
    return result


def lines(r: dict) -> list[str]:
    a, b = r["mlx_lm"], r["strata"]
    return [
        f"baseline mlx-lm: prefill {a['prefill_tps']:.1f} tok/s, decode "
        f"{a['decode_ms_per_token']:.2f} ms/token",
        f"baseline strata-mlx: prefill {b['prefill_tps']:.1f} tok/s, decode "
        f"{b['decode_ms_per_token']:.2f} ms/token ({100 * b['arena_resident_fraction']:.0f}% of "
        "experts fit the arena)",
        f"baseline ratio strata/mlx-lm: prefill tok/s x{r['prefill_tps_ratio']:.3f}, decode "
        f"ms/token x{r['decode_ms_ratio']:.3f}",
        f"baseline parity: last prompt position max |logit diff| {r['max_abs_logit_diff']:.3g} "
        f"(timed runs' |logprob diff| {r['max_abs_logprob_diff']:.3g}), "
        f"greedy tokens agree {r['tokens_agree']}/{r['tokens']}",
    ]
