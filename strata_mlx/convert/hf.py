"""Hugging Face safetensors checkpoints (bf16/fp16/fp32, sharded or not) -> a store.

Accepts transformers 4 and 5 configs (rope_theta / rope_parameters, num_experts /
num_local_experts) and both per-expert tensors (`experts.{e}.gate_proj.weight`) and fused
ones (`experts.gate_up_proj` [E, 2I, D], `experts.down_proj` [E, D, I]). With `quantize`,
experts and dense layers are MLX-affine quantized as mlx-lm's convert would; with
`q_mode="mxfp4"` the experts are MXFP4 (mx.quantize's mode) and the dense layers stay float,
as GPT-OSS ships. GPT-OSS's own MXFP4 checkpoints (`experts.*_blocks` / `*_scales`, as
transformers' Mxfp4 quantizer writes them) keep their expert bytes as they are. FP8
block-quantized checkpoints (DeepSeek-V3's, `weight_scale_inv`) are dequantized as mlx-lm does.
"""

from __future__ import annotations

import json
import struct
import warnings
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..config import one_line
from ..format.quant import expert_tensors, layout_for
from ..format.store import PROJECTIONS, StoreError
from ..format.writer import StoreWriter
from ..models.base import normalize_config
from ..runtime.loader import family
from .common import (
    FLOAT_DTYPES,
    calibrate,
    check_finite,
    check_output,
    copy_tokenizer,
    to_float_dtype,
)


def read_config(src: Path) -> dict[str, Any]:
    path = src / "config.json"
    if src.is_file() and src.suffix.lower() == ".gguf":
        raise StoreError(
            f"{src}: a GGUF file, not a Hugging Face checkpoint (convert takes it as --gguf-path)"
        )
    if not src.exists():
        raise StoreError(f"{src}: no such directory (expected a Hugging Face checkpoint)")
    if not path.is_file():
        raise StoreError(f"{path}: missing (not a Hugging Face checkpoint directory)")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise StoreError(f"{path}: unreadable JSON ({e})") from None


def check_safetensors(path: Path) -> None:
    """Validate a safetensors header against the file size (a truncated download fails here)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise StoreError(f"{path}: truncated safetensors (no header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise StoreError(f"{path}: truncated safetensors (header claims {n} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise StoreError(f"{path}: corrupt safetensors header") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise StoreError(
            f"{path}: truncated safetensors (tensors end at {8 + n + end}, file has {size} bytes)"
        )


def load_weights(src: Path) -> dict[str, mx.array]:
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise StoreError(f"{src}: no *.safetensors files")
    weights = {}
    for f in files:
        check_safetensors(f)
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:
            raise StoreError(f"{f}: unreadable safetensors ({e})") from None
    return weights


def dequantize_fp8(weights: dict[str, mx.array], config: dict, src: Path) -> dict[str, mx.array]:
    """FP8 block-quantized checkpoints (DeepSeek-V3's own, Qwen3's "-FP8"): each weight with a
    `weight_scale_inv` is e4m3 (read as bytes) times one float32 scale per block of
    config.quantization_config.weight_block_size (128 x 128 by default), the partial blocks at
    the edges included, as mlx-lm's DeepSeek-V3 sanitize dequantizes it; the rest is as it was.
    Lazy: nothing is computed until a record or the dense file is written."""
    qc = config.get("quantization_config") or {}
    block = qc.get("weight_block_size") or [128, 128]
    where = f"{src / 'config.json'}: quantization_config.weight_block_size"
    if not (isinstance(block, list) and len(block) == 2 and all(_pos_int(b) for b in block)):
        raise StoreError(f"{where} {block!r}: expected two positive integers")
    bm, bn = block
    out = {k: v for k, v in weights.items() if not k.endswith("weight_scale_inv")}
    for k, scale in weights.items():
        if not k.endswith("weight_scale_inv"):
            continue
        name = k[: -len("_scale_inv")]
        w = weights.get(name)
        if w is None or w.ndim != 2 or w.dtype != mx.uint8:
            what = "missing" if w is None else f"{w.dtype} {tuple(w.shape)}"
            raise StoreError(f"{src}: {k}: its weight {name} is {what}, not 2-D FP8 (e4m3)")
        if scale.dtype not in FLOAT_DTYPES:
            raise StoreError(
                f"{src}: {k}: dtype {_dtype(scale)}, expected a float scale (float32, bfloat16 "
                "or float16)"
            )
        m, n = w.shape
        blocks = (-(-m // bm), -(-n // bn))
        if tuple(scale.shape) != blocks:
            raise StoreError(
                f"{src}: {k}: shape {tuple(scale.shape)}, expected {blocks} for {name} "
                f"{(m, n)} in blocks of {bm} x {bn}"
            )
        full = mx.repeat(mx.repeat(scale.astype(mx.float32), bm, axis=0), bn, axis=1)
        out[name] = mx.from_fp8(w, dtype=mx.float32) * full[:m, :n]
    return out


def check_unscaled(weights: dict[str, mx.array], config: dict, src: Path) -> None:
    """A Hugging Face checkpoint (not mlx-lm's), its FP8 weights dequantized: every tensor
    left is float, but for GPT-OSS's MXFP4 expert blocks and their scales. An FP8 weight
    whose `weight_scale_inv` is missing is still e4m3 bytes here; cast to floats it would
    convert with exit 0 and compute wrong (top-1 agreement fell to 50 %)."""
    fp8 = (config.get("quantization_config") or {}).get("quant_method") == "fp8"
    for k, v in weights.items():
        if v.dtype in FLOAT_DTYPES or k.endswith(("_blocks", "_scales")):
            continue
        scale = "its weight_scale_inv" if fp8 or v.dtype == mx.uint8 else "a scale"
        raise StoreError(
            f"{src}: {k}: dtype {_dtype(v)} without {scale}; a quantized weight cannot be "
            "read as floats (is a shard of the checkpoint missing?)"
        )


def check_mlx_quantized(weights: dict[str, mx.array], quant: dict, src: Path) -> None:
    """An mlx-lm checkpoint's quantized tensors, before any is used: each uint32 `.weight`
    has float `.scales` and `.biases` (MLX affine) of the shape its bits and group size give
    ([..., in * bits / 32] codes -> [..., in / group_size] scales). Integer scales were
    accepted and read as numbers; a weight without scales was read as floats."""
    from ..runtime.loader import check_quantization

    config = src / "config.json"
    check_quantization(quant or None, config)
    for k, w in weights.items():
        if not k.endswith(".weight") or w.dtype in FLOAT_DTYPES:
            continue
        base = k[: -len(".weight")]
        scales, biases = weights.get(f"{base}.scales"), weights.get(f"{base}.biases")
        if w.dtype != mx.uint32 or scales is None or biases is None:
            what = "scales" if scales is None else "biases"
            if w.dtype != mx.uint32:
                raise StoreError(f"{src}: {k}: dtype {_dtype(w)}, expected float or uint32 codes")
            raise StoreError(f"{src}: {k}: quantized (uint32) without its {base}.{what}")
        spec = quant.get(base) if isinstance(quant.get(base), dict) else quant
        if not spec:
            raise StoreError(f"{config}: quantization: missing, but {k} is quantized")
        for name, t in (("scales", scales), ("biases", biases)):
            if t.dtype not in FLOAT_DTYPES:
                raise StoreError(
                    f"{src}: {base}.{name}: dtype {_dtype(t)}, expected float32, bfloat16 or "
                    "float16"
                )
        inputs = w.shape[-1] * 32 // spec["bits"]
        want = (*w.shape[:-1], inputs // spec["group_size"])
        for name, t in (("scales", scales), ("biases", biases)):
            if tuple(t.shape) != want or inputs % spec["group_size"]:
                raise StoreError(
                    f"{src}: {base}.{name}: shape {tuple(t.shape)}, expected {want} for "
                    f"{k} {tuple(w.shape)} at {spec['bits']} bits in groups of "
                    f"{spec['group_size']}"
                )


def _dtype(a: mx.array) -> str:
    return str(a.dtype).split(".")[-1]


def _pos_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def expert_weights(
    weights: dict, prefix: str, names: dict[str, str], e: int
) -> dict[str, mx.array]:
    """Expert e's [out, in] gate/up/down from per-expert or fused tensors (and its biases
    [out] as `{proj}.bias` where the checkpoint has them); removes nothing."""
    per = f"{prefix}.{e}.{names['gate_proj']}.weight"
    if per in weights:
        return {p: weights[f"{prefix}.{e}.{names[p]}.weight"] for p in PROJECTIONS}
    if f"{prefix}.gate_up_proj_bias" in weights:
        # GPT-OSS (transformers' GptOssExperts): gate_up_proj [E, D, 2I] ([in, out]) with gate
        # and up interleaved along out, down_proj [E, I, D], a bias for each.
        gate_up = weights[f"{prefix}.gate_up_proj"][e]
        bias = weights[f"{prefix}.gate_up_proj_bias"][e]
        return {
            "gate_proj": gate_up[:, ::2].T,
            "up_proj": gate_up[:, 1::2].T,
            "down_proj": weights[f"{prefix}.down_proj"][e].T,
            "gate_proj.bias": bias[::2],
            "up_proj.bias": bias[1::2],
            "down_proj.bias": weights[f"{prefix}.down_proj_bias"][e],
        }
    fused = f"{prefix}.gate_up_proj"
    if fused in weights:
        gate_up = weights[fused][e]
        inter = gate_up.shape[0] // 2
        return {
            "gate_proj": gate_up[:inter],
            "up_proj": gate_up[inter:],
            "down_proj": weights[f"{prefix}.down_proj"][e],
        }
    raise KeyError(per)


def is_mxfp4_checkpoint(weights: dict) -> bool:
    """GPT-OSS as OpenAI ships it: MXFP4 expert blocks (`experts.gate_up_proj_blocks`)."""
    return any(k.endswith("experts.gate_up_proj_blocks") for k in weights)


def mxfp4_expert_record(weights: dict, prefix: str, e: int, fdtype) -> tuple[dict, dict]:
    """Expert e of a GPT-OSS MXFP4 checkpoint, its bytes kept: gate_up_proj_blocks
    [E, 2I, D/32, 16] and gate_up_proj_scales [E, 2I, D/32] uint8 ([out, in] rows, gate and up
    interleaved along out), down_proj_blocks [E, D, I/32, 16] / _scales [E, D, I/32]; each
    row's blocks are its `weight` uint8 [out, in/2], its scales `scales` [out, in/32]. The
    float biases are cast to `fdtype`."""
    gate_up_bias = weights[f"{prefix}.gate_up_proj_bias"][e]
    down = f"{prefix}.down_proj"
    rows = {
        "gate_proj": (f"{prefix}.gate_up_proj", slice(0, None, 2), gate_up_bias[::2]),
        "up_proj": (f"{prefix}.gate_up_proj", slice(1, None, 2), gate_up_bias[1::2]),
        "down_proj": (down, slice(None), weights[f"{down}_bias"][e]),
    }
    tensors, table = {}, {}
    for p, (name, sel, bias) in rows.items():
        blocks, scales = weights[f"{name}_blocks"][e][sel], weights[f"{name}_scales"][e][sel]
        if blocks.dtype != mx.uint8 or scales.dtype != mx.uint8:
            raise ValueError(f"{name}_blocks / _scales are {blocks.dtype} / {scales.dtype}")
        if blocks.ndim != 3 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
            raise ValueError(
                f"{name}_blocks {list(blocks.shape)} and _scales {list(scales.shape)} of an "
                "expert are not [out, in/32, 16] and [out, in/32]"
            )
        tensors[f"{p}.bias"] = bias.astype(fdtype)
        tensors[f"{p}.weight"] = blocks.reshape(blocks.shape[0], -1)
        tensors[f"{p}.scales"] = scales
        table[p] = {"format": "mxfp4"}
    return tensors, table


def switch_prefix(expert_prefix: str) -> str:
    """Where an mlx-lm checkpoint keeps the stacked experts: `...mlp.switch_mlp`."""
    return expert_prefix.rsplit(".", 1)[0] + ".switch_mlp"


def is_mlx_checkpoint(weights: dict, config: dict) -> bool:
    """An mlx-lm checkpoint: stacked `switch_mlp` experts, quantized or not."""
    return any(".switch_mlp." in k for k in weights)


def expert_record(
    weights: dict,
    prefix: str,
    names: dict[str, str],
    e: int,
    equant,
    fdtype,
    mlx_quant: dict | None,
) -> tuple[dict, dict]:
    """Expert e's record tensors and quant table, from per-expert or fused HF tensors
    (quantized with `equant`, else cast to `fdtype`) or from an mlx-lm checkpoint's stacked
    switch_mlp tensors (kept exactly as they are: already-quantized experts are not requantized),
    or from a GPT-OSS MXFP4 checkpoint's blocks (kept too)."""
    if f"{prefix}.gate_up_proj_blocks" in weights:
        return mxfp4_expert_record(weights, prefix, e, fdtype)
    if mlx_quant is None:
        return expert_tensors(expert_weights(weights, prefix, names, e), equant, fdtype)
    tensors, table = {}, {}
    for p in PROJECTIONS:
        base = f"{switch_prefix(prefix)}.{p}"
        tensors[f"{p}.weight"] = weights[f"{base}.weight"][e]
        if f"{base}.scales" in weights:
            q = mlx_quant.get(base) if isinstance(mlx_quant.get(base), dict) else mlx_quant
            tensors[f"{p}.scales"] = weights[f"{base}.scales"][e]
            tensors[f"{p}.biases"] = weights[f"{base}.biases"][e]
            table[p] = {"format": "affine", "bits": q["bits"], "group_size": q["group_size"]}
        else:
            table[p] = {"format": "float"}
    return tensors, table


def is_expert_key(key: str, prefixes: list[str]) -> bool:
    return any(key.startswith(p + ".") for p in prefixes)


def convert_hf(
    hf_path: str | Path,
    mlx_path: str | Path,
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    dtype: str | None = None,
    calibration_tokens: int = 256,
    progress: bool = True,
    overwrite: bool | None = None,
    q_mode: str = "affine",
    allow_non_finite: bool = False,
) -> Path:
    """A Hugging Face (or mlx-lm) checkpoint directory -> a store at mlx_path; an existing
    store there is replaced only with `overwrite` (common.check_output). `q_mode` (with
    `quantize`): "affine" (q_bits, q_group_size; experts and dense layers) or "mxfp4" (experts
    only: OCP MXFP4, 4-bit E2M1 in blocks of 32; the dense layers stay float). Refused before
    the store is committed: a quantized weight without its scale or with scales of the wrong
    dtype or shape, and NaN or inf weights unless `allow_non_finite` (--allow-non-finite)."""
    src = Path(hf_path)
    if q_mode not in ("affine", "mxfp4"):
        raise StoreError(f"--q-mode {q_mode}: expected affine or mxfp4")
    out = check_output(mlx_path, src, overwrite=overwrite)
    config, model_type, fam, args = _read_config(src)
    dtype = dtype or config.get("torch_dtype") or config.get("dtype") or "float16"
    fdtype = to_float_dtype(dtype)
    weights = load_weights(src)
    if any(k.endswith("weight_scale_inv") for k in weights):
        weights = dequantize_fp8(weights, config, src)
        config.pop("quantization_config", None)  # the source's; the store holds floats
    try:
        model = fam.Model(args)
    except (ValueError, OverflowError) as e:  # a family's refusal, as load() reports it
        raise StoreError(f"{src / 'config.json'}: {str(e).splitlines()[0]}") from None
    moe_layers = sorted(model.moe_blocks())
    num_experts = 0
    if moe_layers:  # DeepSeek-V3 and GLM-4.5 say n_routed_experts: their ModelArgs map it
        num_experts = getattr(args, "num_experts", None) or args.num_local_experts
    prefixes = [fam.EXPERT_PREFIX.format(layer=l) for l in moe_layers]

    mlx_ckpt = is_mlx_checkpoint(weights, config)
    mlx_quant = (config.get("quantization") or {}) if mlx_ckpt else None
    if mlx_ckpt:
        check_mlx_quantized(weights, mlx_quant, src)
    else:
        check_unscaled(weights, config, src)
    if mlx_ckpt:
        if quantize and mlx_quant:
            raise StoreError(f"{src}: already quantized (an mlx-lm checkpoint); drop -q")
        prefixes_all = prefixes + [switch_prefix(p) for p in prefixes]
    else:
        prefixes_all = prefixes
    if is_mxfp4_checkpoint(weights):
        if quantize:
            raise StoreError(f"{src}: already quantized (MXFP4 experts); drop -q")
        config.pop("quantization_config", None)  # the source's; the store's layout says MXFP4
    equant = {"bits": q_bits, "group_size": q_group_size} if quantize else None
    if quantize and q_mode == "mxfp4":
        equant, quantize = {"mode": "mxfp4"}, False  # the dense layers stay float
    layout = _expert_layout(src, model, fam, weights, prefixes, equant, fdtype, mlx_quant)

    dense = {k: v for k, v in weights.items() if not is_expert_key(k, prefixes_all)}
    dense = _dense_weights(model, dense, mlx_ckpt, mlx_quant, fdtype)
    check_finite(dense, f"{src}: ", allow_non_finite)
    store_config = dict(config)
    store_config["torch_dtype"] = dtype
    try:
        model.load_weights(list(dense.items()), strict=True)
    except ValueError as e:
        raise StoreError(
            f"{src}: checkpoint does not match {model_type}: {one_line(str(e))}"
        ) from None
    if quantize:
        store_config["quantization"] = _quantize_dense(model, q_bits, q_group_size)
        dense = dict(tree_flatten(model.parameters()))

    writer = StoreWriter(out, model_type, store_config, layout, moe_layers, num_experts)
    with writer:
        writer.write_dense(dense)
        if not copy_tokenizer(src, writer.path):
            warnings.warn(
                f"{src}: no tokenizer files; the store will need --prompt-tokens", stacklevel=2
            )
        _write_experts(
            writer,
            weights,
            prefixes,
            fam.EXPERT_NAMES,
            moe_layers,
            num_experts,
            equant,
            fdtype,
            progress,
            src,
            mlx_quant,
            allow_non_finite,
        )
        calibrate(writer, calibration_tokens, progress=progress)
        return writer.commit()


def _expert_layout(src: Path, model, fam, weights, prefixes, equant, fdtype, mlx_quant):
    """The record layout of the first MoE layer's first expert as the store will hold it
    (an empty layout for a model without experts)."""
    if not prefixes:
        from ..format.store import RecordLayout

        return RecordLayout([], {}, 4096)
    try:
        tensors, table = expert_record(
            weights, prefixes[0], fam.EXPERT_NAMES, 0, equant, fdtype, mlx_quant
        )
    except KeyError as e:
        raise StoreError(f"{src}: expert tensor {e} not found in the checkpoint") from None
    except ValueError as e:  # an MXFP4 checkpoint's blocks of the wrong type or shape
        raise StoreError(f"{src}: {e}") from None
    # A family whose experts are not SwiGLU names its activation (GPT-OSS).
    return layout_for(tensors, table, getattr(model, "expert_activation", None))


def _read_config(src: Path):
    """(config, model_type, family module, ModelArgs) of the checkpoint's config.json."""
    config = read_config(src)
    if not isinstance(config, dict):
        raise StoreError(f"{src / 'config.json'}: expected a JSON object")
    config = normalize_config(config)
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise StoreError(f"{src / 'config.json'}: model_type: missing or not a string")
    fam = family(model_type, src / "config.json")
    return config, model_type, fam, fam.ModelArgs.from_dict(config, src / "config.json")


def _dense_weights(model, dense: dict, mlx_ckpt: bool, mlx_quant: dict | None, fdtype) -> dict:
    """The non-expert weights as the family's modules take them: sanitized (an mlx-lm
    checkpoint's the family's way for it), then cast to `fdtype`; an mlx-lm checkpoint's
    quantized layers stay as they are, `model` rebuilt with the same quantized modules."""
    # A family whose sanitize does what mlx-lm's did at conversion names how to take an
    # mlx-lm checkpoint's weights instead (Qwen3-Next's norm shift is not idempotent).
    again = getattr(model, "sanitize_mlx_lm", None) if mlx_ckpt else None
    dense = again(dense) if again else model.sanitize(dense)
    if mlx_quant:
        # Quantized dense layers stay as they are: rebuild the same modules first (as load()).
        def quantized(path, m):
            if path in mlx_quant and isinstance(mlx_quant[path], dict):
                return mlx_quant[path]
            return hasattr(m, "to_quantized") and f"{path}.scales" in dense

        nn.quantize(model, mlx_quant["group_size"], mlx_quant["bits"], class_predicate=quantized)
        return dense
    keep = getattr(model, "cast_predicate", None)  # e.g. routers' correction biases
    return {
        k: v.astype(fdtype)
        if mx.issubdtype(v.dtype, mx.floating) and (keep is None or keep(k))
        else v
        for k, v in dense.items()
    }


def _quantize_dense(model, q_bits: int, q_group_size: int) -> dict:
    """Quantize the model's dense layers in place as mlx-lm's convert does (the family's
    quant_predicate may give a layer its own bits; a layer whose width the group size does
    not divide stays float); the store's config.quantization for them."""
    quantization: dict = {"group_size": q_group_size, "bits": q_bits, "mode": "affine"}
    qpred = getattr(model, "quant_predicate", None)

    def predicate(path, m):
        if not hasattr(m, "to_quantized") or m.weight.shape[-1] % q_group_size:
            return False
        p = qpred(path, m) if qpred else True
        if isinstance(p, dict) and m.weight.shape[-1] % p.get("group_size", q_group_size):
            return False  # where mlx-lm's convert would fail, leave the layer float
        if isinstance(p, dict):
            quantization[path] = p
        return p

    nn.quantize(model, q_group_size, q_bits, class_predicate=predicate)
    return quantization


def _write_experts(
    writer,
    weights,
    prefixes,
    names,
    moe_layers,
    num_experts,
    equant,
    fdtype,
    progress,
    src,
    mlx_quant,
    allow_non_finite=False,
) -> None:
    from tqdm import tqdm

    total = len(moe_layers) * num_experts
    with tqdm(total=total, desc="experts", unit="expert", disable=not progress) as bar:
        for layer, prefix in zip(moe_layers, prefixes):
            for e in range(num_experts):
                try:
                    tensors, _ = expert_record(weights, prefix, names, e, equant, fdtype, mlx_quant)
                except KeyError as k:
                    raise StoreError(f"{src}: expert tensor {k} not found") from None
                except ValueError as v:  # an MXFP4 checkpoint's blocks of the wrong type or shape
                    raise StoreError(f"{src}: {v}") from None
                mx.eval(tensors)
                if not allow_non_finite:
                    _check_expert_finite(weights, prefix, names, e, tensors, fdtype, src, mlx_quant)
                try:
                    writer.add_expert(layer, e, {k: _np(v) for k, v in tensors.items()})
                except StoreError as err:  # (shaped unlike the layer's first expert)
                    raise StoreError(f"{src}: {err}") from None
                bar.update(1)


def _check_expert_finite(weights, prefix, names, e, tensors, fdtype, src, mlx_quant) -> None:
    """Expert e's source floats (cast to the store's dtype where the converter casts or
    quantizes them), or the tensors kept as the checkpoint holds them (mlx-lm's, MXFP4's,
    whose E8M0 scale byte 0xFF is NaN)."""
    where = f"{src}: {prefix}.{e}."
    if mlx_quant is None and f"{prefix}.gate_up_proj_blocks" not in weights:
        check_finite(expert_weights(weights, prefix, names, e), where, cast=fdtype)
        return
    check_finite(tensors, where)
    for k, v in tensors.items():
        if k.endswith(".scales") and v.dtype == mx.uint8 and mx.any(v == 255).item():
            raise StoreError(
                f"{where}{k}: E8M0 scale 0xFF (NaN); the model would compute NaN (pass "
                "--allow-non-finite to convert it anyway)"
            )


def _np(a: mx.array):
    from ..format.quant import to_numpy

    return to_numpy(a)
