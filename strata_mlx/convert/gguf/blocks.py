"""GGUF tensors' ggml blocks as the store keeps them: record formats, repacks and dequantization.

What each tensor type becomes (every conversion is lossless unless it says dequantized):
  Q4_1  MLX affine 4-bit, group 32: scale = d, bias = m (identical arithmetic q*d + m; the
        nibbles are re-packed from ggml's low-half/high-half order to MLX's element order).
  Q4_0  MLX affine 4-bit, group 32: scale = d, bias = -8*d.
  Q8_0  MLX affine 8-bit, group 32: stored byte q + 128, scale = d, bias = -128*d.
  F32/F16/BF16  float.
  MXFP4 (gpt-oss's experts)  the store's {"format": "mxfp4"} records, the same bits with
        the nibbles moved from ggml's block order to ours (repack_mxfp4).
  others (K-quants, IQ*)  experts keep their ggml blocks as {"format": "gguf"} records when
        strata_mlx.format.gguf_quants decodes the type; dense tensors are dequantized.
Dense quantized tensors become MLX QuantizedLinear/QuantizedEmbedding with float32 scales
(the model computes in float32 for files under 2 GiB, float16 above). Expert records keep
float16 scales (d and m are float16 in the file).


Never: reads files (tensors come from reading.Gguf) or writes the store.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from ...format.store import PROJECTIONS, RecordLayout, StoreError

AFFINE_TYPES = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
GROUP = 32


def qtype_name(t) -> str:
    return t.tensor_type.name


def block_info(t) -> tuple[int, int]:
    """(elements per block, bytes per block) of a tensor's type."""
    from gguf import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES[t.tensor_type]


def raw_rows(t) -> np.ndarray:
    """A tensor's data as stored: [..., rows, row_bytes] uint8 for quantized types, else the
    float array [..., rows, cols]."""
    return np.asarray(t.data)


def dequantize_rows(data: np.ndarray, t) -> np.ndarray:
    """float32 [..., rows, cols] of `data` (raw rows of tensor t's type, possibly sliced)."""
    name = qtype_name(t)
    if name in FLOAT_TYPES:
        if name == "BF16":
            return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        return data.astype(np.float32)
    from gguf.quants import dequantize

    return dequantize(np.ascontiguousarray(data), t.tensor_type)


def slice_cols(data: np.ndarray, t, start: int, stop: int) -> np.ndarray | None:
    """Columns [start, stop) of raw rows, or None when the cut splits a ggml block."""
    if qtype_name(t) in FLOAT_TYPES:
        return data[..., start:stop]
    bs, ts = block_info(t)
    if start % bs or stop % bs:
        return None
    return data[..., start // bs * ts : stop // bs * ts]


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation. Its converter (LlamaModel.permute) maps each
    head's rows [first half | second half] (transformers' rotate-half pairs i, i + d/2) to
    interleaved pairs (2i, 2i + 1): reshape(n_head, 2, d/2).swapaxes(1, 2). The inverse is
    reshape(n_head, d/2, 2).swapaxes(1, 2)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def repack_affine(data: np.ndarray, qtype: str, dtype=np.float16):
    """ggml Q4_0 / Q4_1 / Q8_0 rows [..., row_bytes] -> MLX affine (weight uint32, scales,
    biases), group 32, with mx.dequantize(weight, scales, biases) == ggml's dequantization."""
    bs, ts = 32, {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[qtype]
    lead = data.shape[:-1]
    nb = data.shape[-1] // ts
    b = np.ascontiguousarray(data).reshape(*lead, nb, ts)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if qtype == "Q8_0":
        q = (b[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)  # [.., nb, 32]
        packed = q
        bias = -128.0 * d
    else:
        if qtype == "Q4_1":
            bias = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            qs = b[..., 4:20]
        else:
            bias = -8.0 * d
            qs = b[..., 2:18]
        # ggml: element j < 16 is the low nibble of byte j, element j >= 16 the high nibble of
        # byte j - 16. MLX: element i sits at bits 4*(i % 8) of uint32 i // 8 (little endian),
        # i.e. byte i // 2, low nibble first.
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [.., nb, 32] in element order
        packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    weight = np.ascontiguousarray(packed).reshape(*lead, nb * bs * AFFINE_TYPES[qtype] // 8)
    weight = weight.view(np.uint32)
    scales, biases = d.astype(dtype), bias.astype(dtype)
    if dtype == np.float16 and not (
        np.array_equal(scales.astype(np.float32), d)
        and np.array_equal(biases.astype(np.float32), bias)
    ):
        raise StoreError(f"{qtype} block scale overflows float16")  # cannot happen for sane files
    return weight, scales, biases


def repack_mxfp4(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml MXFP4 rows [..., row_bytes] -> the store's mxfp4 (codes uint8 [..., cols/2],
    scales uint8 [..., cols/32]), the same bits moved: a ggml block (block_mxfp4) is its E8M0
    scale byte, then 16 bytes whose byte j holds element j in its low nibble and element
    j + 16 in its high one (gguf-py's quants.MXFP4); ours (transformers' and mx.quantize's
    order) hold elements 2j and 2j + 1 of the block in byte j, low nibble first. The codes
    themselves are the same E2M1 (ggml's kvalues are the E2M1 values doubled against a halved
    scale: the same number)."""
    lead = data.shape[:-1]
    b = np.ascontiguousarray(data).reshape(*lead, -1, 17)
    qs = b[..., 1:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [.., nb, 32] in element order
    codes = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    return codes.reshape(*lead, -1), np.ascontiguousarray(b[..., 0])


def gguf_record_types() -> set[str]:
    """ggml types the runtime decodes from expert records (strata_mlx.format.gguf_quants)."""
    try:
        from ...format.gguf_quants import FORMATS
    except ImportError:
        return set()
    return set(FORMATS)


# ---- expert record formats ----------------------------------------------------------------


def choose_format(types: set[str], width_ok: bool, dtype: str) -> dict[str, Any]:
    """How one projection is stored in every record, given its ggml types over all layers."""
    if len(types) == 1 and width_ok:
        (t,) = types
        if t in AFFINE_TYPES:
            return {"format": "affine", "bits": AFFINE_TYPES[t], "group_size": GROUP, "_src": t}
        if t in FLOAT_TYPES:
            return {"format": "float", "_dtype": dtype}
        if t == "MXFP4":  # GPT-OSS's experts: the store's own mxfp4 format, bits moved only
            return {"format": "mxfp4", "_src": t}
        if t in gguf_record_types():
            return {"format": "gguf", "type": t, "_src": t}
    # Mixed types across layers (e.g. Q4_K_M's down), a cut through blocks, or a type the
    # runtime cannot decode: dequantize, exactly, to float.
    return {"format": "float", "_dtype": dtype}


def projection_tensors(spec: dict, data: np.ndarray, t, out: int, inp: int) -> dict[str, tuple]:
    """(dtype name, array) per record component of one expert's projection [out, inp]."""
    fmt = spec["format"]
    if fmt == "affine":
        w, s, b = repack_affine(data, spec["_src"], np.float16)
        return {"weight": ("uint32", w), "scales": ("float16", s), "biases": ("float16", b)}
    if fmt == "gguf":
        return {"weight": ("uint8", np.ascontiguousarray(data))}
    if fmt == "mxfp4":
        codes, scales = repack_mxfp4(data)
        return {"weight": ("uint8", codes), "scales": ("uint8", scales)}
    w = dequantize_rows(data, t).reshape(*data.shape[:-2], out, inp)
    return {"weight": (spec["_dtype"], to_dtype(w, spec["_dtype"]))}


def projection_shapes(spec: dict, t, out: int, inp: int) -> dict[str, tuple]:
    """(dtype name, shape) per record component, as projection_tensors gives them for one
    expert's projection [out, inp] of tensor t, from the header alone (no data read)."""
    fmt = spec["format"]
    if fmt == "affine":
        groups = inp // GROUP
        return {
            "weight": ("uint32", (out, inp * spec["bits"] // 32)),
            "scales": ("float16", (out, groups)),
            "biases": ("float16", (out, groups)),
        }
    if fmt == "gguf":
        bs, ts = block_info(t)
        return {"weight": ("uint8", (out, inp // bs * ts))}
    if fmt == "mxfp4":
        return {"weight": ("uint8", (out, inp // 2)), "scales": ("uint8", (out, inp // 32))}
    return {"weight": (spec["_dtype"], (out, inp))}


def to_dtype(a: np.ndarray, name: str) -> np.ndarray:
    if name == "bfloat16":
        return np.array(mx.array(a).astype(mx.bfloat16).view(mx.uint16))
    return a.astype(name)


def build_layout(
    shapes: dict[str, dict[str, tuple]],
    specs: dict[str, dict],
    activation: dict[str, Any] | None = None,
) -> RecordLayout:
    """The record layout of one expert: `shapes` is projection -> component -> (dtype name,
    shape), as projection_shapes gives them."""
    tensors = {}
    for p in PROJECTIONS:
        for comp, (dt, shape) in shapes[p].items():
            tensors[f"{p}.{comp}"] = (dt, tuple(shape))
    quant = {p: {k: v for k, v in specs[p].items() if not k.startswith("_")} for p in PROJECTIONS}
    return RecordLayout.build(tensors, quant, activation)


def record_arrays(parts: dict[str, dict[str, tuple]]) -> dict[str, np.ndarray]:
    out = {}
    for p, comps in parts.items():
        for comp, (dt, arr) in comps.items():
            out[f"{p}.{comp}"] = arr if dt != "bfloat16" else arr.view(np.uint16)
    return out


def dequantizable(t) -> bool:
    import gguf.quants

    traits = getattr(gguf.quants, "_type_traits", None)  # gguf-py's dequantizers, by type
    return traits is None or t.tensor_type in traits or qtype_name(t) in gguf_record_types()
