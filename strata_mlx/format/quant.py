"""Expert weight formats: how a projection's tensors sit in a record, and the reference path.

Formats (the `quant` entry of a record layout, per projection):
  {"format": "float"}                                   weight [out, in] in the store dtype
  {"format": "affine", "bits": b, "group_size": g}      MLX affine: weight/scales/biases
  {"format": "gguf", "type": "IQ2_XS"}                  ggml blocks, [out, row_bytes] uint8
  {"format": "mxfp4"}                                   OCP MXFP4 (GPT-OSS's experts): weight
                                                        uint8 [out, in/2], scales uint8 [out, in/32]

A projection may carry a bias (`{proj}.bias`, float [out], never quantized: GPT-OSS), and a
layout may name a gated activation other than SwiGLU (`layout.activation`: activation_fn).
The formats' tables and activations are custom_kernels.formats' (one source for the kernels
and this reference), imported here.

The reference path decodes records gathered from arena slots with plain MLX ops and computes
SwiGLU experts exactly as mlx-lm's SwitchGLU does, so a fully resident store matches mlx-lm and
transformers. Kernels (strata_mlx.runtime.kernels) are tested against this. This module never
does I/O.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from custom_kernels.formats import MXFP4_BLOCK as MXFP4_BLOCK
from custom_kernels.formats import activation_fn, dtype_name, mx_dtype
from custom_kernels.formats import swiglu_oai as swiglu_oai

from .store import PROJECTIONS, RecordLayout, StoreError


def to_numpy(a: mx.array) -> np.ndarray:
    """numpy copy of an MLX array; bfloat16 comes out as its uint16 bit pattern."""
    if a.dtype == mx.bfloat16:
        return np.array(a.view(mx.uint16))
    return np.array(a)


# ---- MXFP4 (OCP microscaling FP4: GPT-OSS's experts, mx.quantize's "mxfp4" mode) -------------
# A block is 32 weights of a row: 16 bytes of 4-bit E2M1 codes, two a byte with the low nibble
# first (weight 2i in byte i's bits 0-3, weight 2i+1 in bits 4-7), and one E8M0 scale byte s,
# 2^(s - 127). w = E2M1[code] * 2^(s - 127): exact in float32 for every code and scale (the
# smallest non-zero weight is 0.5 * 2^-127, a float32 subnormal); s = 255 is 2^128 = inf, as
# mx.dequantize decodes it (OCP reserves it for NaN; no checkpoint has it).
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e8m0(scales: mx.array) -> mx.array:
    """float32 2^(s - 127) of E8M0 bytes: the exponent field of a float32 (s = 0, 2^-127, is
    the subnormal 0x00400000)."""
    s = scales.astype(mx.uint32)
    return mx.where(s == 0, mx.array(0x00400000, mx.uint32), s << 23).view(mx.float32)


def dequantize_mxfp4(blocks: mx.array, scales: mx.array, dtype: mx.Dtype = mx.float32) -> mx.array:
    """MXFP4 rows -> weights: blocks uint8 [..., out, in/2], scales uint8 [..., out, in/32]
    -> [..., out, in] in `dtype` (computed exactly in float32, then rounded once: bit for bit
    mx.dequantize(..., mode="mxfp4", dtype=dtype), tests/format/test_mxfp4.py)."""
    *lead, half = blocks.shape
    codes = mx.stack([blocks & 15, blocks >> 4], axis=-1)  # [..., in/2, 2]: low nibble first
    values = mx.array(E2M1, dtype=mx.float32)[codes.astype(mx.uint32)]
    values = values.reshape(*lead, half * 2 // MXFP4_BLOCK, MXFP4_BLOCK)
    w = values * mx.expand_dims(e8m0(scales), -1)
    return w.reshape(*lead, half * 2).astype(dtype)


def expert_tensors(
    weights: dict[str, mx.array], quant: dict[str, Any] | None, dtype: mx.Dtype
) -> tuple[dict[str, mx.array], dict[str, dict[str, Any]]]:
    """One expert's gate/up/down float weights [out, in] (and biases [out] under
    `{proj}.bias`, if it has them) -> record tensors and quant table.

    With `quant` = {"bits", "group_size"} the weights are MLX-affine quantized exactly as
    mlx-lm quantizes a SwitchLinear (mx.quantize over the last axis); with {"mode": "mxfp4"}
    they are MXFP4 from mx.quantize(..., mode="mxfp4") (its uint32 words kept as their bytes:
    the layout GPT-OSS ships); else cast to `dtype`. Biases are cast to `dtype` (mlx-lm's
    QuantizedSwitchLinear keeps its bias float).
    """
    tensors, table = {}, {}
    mode = quant.get("mode", "affine") if quant else None
    for p in PROJECTIONS:
        if f"{p}.bias" in weights:
            tensors[f"{p}.bias"] = weights[f"{p}.bias"].astype(dtype)
        w = weights[p].astype(dtype)
        # As mlx-lm: a projection whose input width the group size does not divide stays float.
        if mode == "mxfp4" and w.shape[-1] % MXFP4_BLOCK == 0:
            q, s = mx.quantize(w, mode="mxfp4")
            tensors[f"{p}.weight"], tensors[f"{p}.scales"] = q.view(mx.uint8), s
            table[p] = {"format": "mxfp4"}
        elif mode == "affine" and w.shape[-1] % quant["group_size"] == 0:
            q, s, b = mx.quantize(w, quant["group_size"], quant["bits"])
            tensors[f"{p}.weight"], tensors[f"{p}.scales"], tensors[f"{p}.biases"] = q, s, b
            table[p] = {
                "format": "affine",
                "bits": quant["bits"],
                "group_size": quant["group_size"],
            }
        else:
            tensors[f"{p}.weight"] = w
            table[p] = {"format": "float"}
    return tensors, table


def layout_for(
    tensors: dict[str, mx.array], table: dict[str, dict], activation: dict | None = None
) -> RecordLayout:
    return RecordLayout.build(
        {k: (dtype_name(v.dtype), tuple(v.shape)) for k, v in tensors.items()}, table, activation
    )


FLOAT_DTYPES = ("float32", "float16", "bfloat16")


def check_layout(layout: RecordLayout, hidden_size: int, where: str) -> None:
    """A layout's components against its quant table and the model's width: gate and up
    [I, D], down [D, I] with D = hidden_size, each component of the dtype and shape its format
    needs. A StoreError naming `where` otherwise; nothing is computed from a layout that
    fails here (a mismatch would surface as an MLX shape error mid-generation)."""
    dims = {p: _logical_shape(layout, p, where) for p in PROJECTIONS}
    inter = dims["gate_proj"][0]
    want = {"gate_proj": (inter, hidden_size), "up_proj": (inter, hidden_size)}
    want["down_proj"] = (hidden_size, inter)
    comps = {c.name: c for c in layout.components}
    for p in PROJECTIONS:
        if dims[p] != want[p]:
            raise StoreError(
                f"{where}: {p} is {list(dims[p])} ([out, in]), the model needs {list(want[p])}"
            )
        bias = comps.get(f"{p}.bias")
        if bias is not None and (bias.dtype not in FLOAT_DTYPES or bias.shape != [want[p][0]]):
            raise StoreError(
                f"{where}: component {p}.bias is {bias.dtype} {bias.shape}, expected "
                f"[{want[p][0]}] of {' or '.join(FLOAT_DTYPES)}"
            )


def _logical_shape(layout: RecordLayout, proj: str, where: str) -> tuple[int, int]:
    """[out, in] of one projection's weight, from its components and format."""
    comps = {c.name: c for c in layout.components}

    def need(name: str, dtypes: tuple[str, ...], ndim: int = 2):
        c = comps.get(f"{proj}.{name}")
        if c is None:
            raise StoreError(f"{where}: component {proj}.{name} missing")
        if c.dtype not in dtypes or len(c.shape) != ndim:
            raise StoreError(
                f"{where}: component {proj}.{name} is {c.dtype} {c.shape}, "
                f"expected {ndim} dimensions of {' or '.join(dtypes)}"
            )
        return c.shape

    spec = layout.quant[proj]
    fmt = spec["format"]
    if fmt == "float":
        return tuple(need("weight", FLOAT_DTYPES))
    if fmt == "affine":
        bits, gs = spec["bits"], spec["group_size"]
        out, packed = need("weight", ("uint32",))
        inp = packed * 32 // bits
        if packed * 32 % bits or inp % gs:
            raise StoreError(f"{where}: {proj}.weight width {packed} fits no {bits}-bit group {gs}")
        for name in ("scales", "biases"):
            if list(need(name, FLOAT_DTYPES)) != [out, inp // gs]:
                raise StoreError(f"{where}: {proj}.{name} is not [{out}, {inp // gs}]")
        return out, inp
    if fmt == "mxfp4":
        out, half = need("weight", ("uint8",))
        inp = half * 2
        if inp % MXFP4_BLOCK:
            raise StoreError(
                f"{where}: {proj}.weight rows of {inp} weights: not whole blocks of 32"
            )
        if list(need("scales", ("uint8",))) != [out, inp // MXFP4_BLOCK]:
            raise StoreError(f"{where}: {proj}.scales is not [{out}, {inp // MXFP4_BLOCK}]")
        return out, inp
    from .gguf_quants import FORMATS

    f = FORMATS[spec["type"]]
    out, row_bytes = need("weight", ("uint8",))
    inp = spec["in_features"]
    if row_bytes != inp // f.block_size * f.type_size:
        raise StoreError(
            f"{where}: {proj}.weight rows of {row_bytes} bytes, {f.name} x {inp} needs "
            f"{inp // f.block_size * f.type_size}"
        )
    return out, inp


def component_views(records: mx.array, layout: RecordLayout) -> dict[str, mx.array]:
    """Typed [n, *shape] views of each component of n records ([n, record_bytes] uint8)."""
    n = records.shape[0]
    out = {}
    for c in layout.components:
        raw = records[:, c.offset : c.offset + c.nbytes]
        out[c.name] = raw.view(mx_dtype(c.dtype)).reshape(n, *c.shape)
    return out


def _projection(x: mx.array, views: dict, proj: str, spec: dict, idx: mx.array, sort: bool):
    y = _product(x, views, proj, spec, idx, sort)
    bias = views.get(f"{proj}.bias")
    if bias is not None:  # as mlx-lm's SwitchLinear: bias[indices] over the row axis
        y = y + mx.expand_dims(bias[idx], -2)
    return y


def _product(x: mx.array, views: dict, proj: str, spec: dict, idx: mx.array, sort: bool):
    fmt = spec["format"]
    if fmt == "affine":
        return mx.gather_qmm(
            x,
            views[f"{proj}.weight"],
            views[f"{proj}.scales"],
            views[f"{proj}.biases"],
            rhs_indices=idx,
            transpose=True,
            group_size=spec["group_size"],
            bits=spec["bits"],
            sorted_indices=sort,
        )
    if fmt == "float":
        w = views[f"{proj}.weight"]
    elif fmt == "gguf":
        from .gguf_quants import dequantize

        blocks = views[f"{proj}.weight"]
        n, out_dim, _ = blocks.shape
        w = dequantize(spec["type"], blocks, (n, out_dim, spec["in_features"]), dtype=x.dtype)
    elif fmt == "mxfp4":
        w = dequantize_mxfp4(views[f"{proj}.weight"], views[f"{proj}.scales"], x.dtype)
    else:
        raise ValueError(f"unknown expert format {fmt!r}")
    return _gather_mm(x, w, idx, sort)


def _gather_mm(x: mx.array, w: mx.array, idx: mx.array, sort: bool) -> mx.array:
    """x @ w[idx].T (mlx-lm's SwitchLinear). MLX's CPU gather_mm takes float32 only ("Currently
    only supports float32"): there other dtypes (a bf16 GPT-OSS) multiply in float32 and round
    back to x's dtype once."""
    if x.dtype != mx.float32 and mx.default_device() == mx.cpu:
        wt = w.astype(mx.float32).swapaxes(-1, -2)
        y = mx.gather_mm(x.astype(mx.float32), wt, rhs_indices=idx, sorted_indices=sort)
        return y.astype(x.dtype)
    return mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=idx, sorted_indices=sort)


def switch_glu_reference(
    x: mx.array, records: mx.array, layout: RecordLayout, idx: mx.array
) -> mx.array:
    """SwiGLU experts over gathered records: x [..., D], idx [..., k] into records -> [..., k, D].

    Mirrors mlx-lm's SwitchGLU (sorting rows by expert once there are >= 64 pairs) so that
    the numerics, and therefore every comparison against mlx-lm, line up.
    """
    views = component_views(records, layout)
    x = mx.expand_dims(x, (-2, -3))
    sort = idx.size >= 64
    inv = None
    i = idx
    if sort:
        m = idx.shape[-1]
        flat = idx.flatten()
        order = mx.argsort(flat)
        inv = mx.argsort(order)
        x = x.flatten(0, -3)[order // m]
        i = flat[order]
    q = layout.quant
    up = _projection(x, views, "up_proj", q["up_proj"], i, sort)
    gate = _projection(x, views, "gate_proj", q["gate_proj"], i, sort)
    h = activation_fn(layout.activation)(gate, up)
    y = _projection(h, views, "down_proj", q["down_proj"], i, sort)
    if sort:
        y = mx.unflatten(y[inv], 0, idx.shape)
    return y.squeeze(-2)
