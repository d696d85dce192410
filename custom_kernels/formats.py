"""The weight formats as data, for the kernels and for strata_mlx alike: the projections of an
expert record, its gated activations, the dtype names a layout uses, and the ggml block tables
(each block's byte layout, row sizes, the i-quant codebooks and sign table).

strata_mlx imports these from here (strata_mlx.format.store, .quant, .gguf_quants), so the
kernels and the reference path read one table. Never: imports strata_mlx, reads files, or
decodes weights (formats.h decodes them in C, strata_mlx.format.gguf_quants with MLX ops).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import mlx.core as mx

# The projections of one expert record, in record order.
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

# OCP MXFP4: weights that share one E8M0 scale.
MXFP4_BLOCK = 32

_MX_DTYPES = {
    "float32": mx.float32,
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
    "uint32": mx.uint32,
    "uint8": mx.uint8,
}


def mx_dtype(name: str) -> mx.Dtype:
    """The MLX dtype a layout's component dtype name stands for."""
    return _MX_DTYPES[name]


def dtype_name(dtype: mx.Dtype) -> str:
    """The name a layout gives an MLX dtype (the inverse of mx_dtype)."""
    for name, d in _MX_DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}")


@partial(mx.compile, shapeless=True)
def swiglu_oai(gate: mx.array, up: mx.array, alpha: float, limit: float) -> mx.array:
    """GPT-OSS: the gate clipped from above, up clipped both ways and shifted by 1, the gate's
    sigmoid sharpened by alpha (transformers' GptOssExperts; mlx-lm's swiglu_oai, op for op)."""
    gate = mx.minimum(gate, limit)
    up = mx.clip(up, -limit, limit)
    return (up + 1.0) * (gate * mx.sigmoid(alpha * gate))


def activation_fn(spec: dict[str, Any] | None):
    """(gate, up) -> hidden for a layout's `activation` (None: SwiGLU)."""
    if spec is None:
        return _plain_swiglu
    if spec["name"] == "swiglu_oai":
        alpha, limit = float(spec["alpha"]), float(spec["limit"])
        return lambda gate, up: swiglu_oai(gate, up, alpha, limit)
    raise ValueError(f"unknown expert activation {spec['name']!r}")


def _plain_swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return (gate * mx.sigmoid(gate)) * up
