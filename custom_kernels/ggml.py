"""ggml (GGUF) block formats as data: each block's byte layout (llama.cpp's ggml-common.h
`block_*` structs, as gguf-py mirrors them), row sizes, and the i-quant codebooks and sign
table as numpy arrays (built once from gguf-py's own tables, the single source).

The kernels take the tables as inputs; strata_mlx.format.gguf_quants decodes blocks by these
layouts with MLX ops (the reference every kernel is tested against). Imports gguf-py: only
code that handles ggml blocks imports this module. Never: imports strata_mlx, reads files or
decodes blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import gguf.quants as gq
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# fp16 scale fields: `d` (scale), `dmin` (K-quant min scale), `m` (Q4_1 min).
F16_FIELDS = ("d", "dmin", "m")

# Field order and byte sizes inside one block (ggml-common.h `block_*` structs, QK_K = 256).
# Note the K-quants are not uniform: Q2_K/Q3_K/Q6_K keep `d` at the END of the block,
# Q4_K/Q5_K (and all legacy / i-quants) at the start.
_LAYOUTS: dict[str, tuple[tuple[str, int], ...]] = {
    "Q4_0": (("d", 2), ("qs", 16)),
    "Q4_1": (("d", 2), ("m", 2), ("qs", 16)),
    "Q8_0": (("d", 2), ("qs", 32)),
    "Q2_K": (("scales", 16), ("qs", 64), ("d", 2), ("dmin", 2)),
    "Q3_K": (("hmask", 32), ("qs", 64), ("scales", 12), ("d", 2)),
    "Q4_K": (("d", 2), ("dmin", 2), ("scales", 12), ("qs", 128)),
    "Q5_K": (("d", 2), ("dmin", 2), ("scales", 12), ("qh", 32), ("qs", 128)),
    "Q6_K": (("ql", 128), ("qh", 64), ("scales", 16), ("d", 2)),
    "IQ2_XS": (("d", 2), ("qs", 64), ("scales", 8)),
    "IQ3_S": (("d", 2), ("qs", 64), ("qh", 8), ("signs", 32), ("scales", 4)),
}


@dataclass(frozen=True)
class BlockFormat:
    """One ggml block format: `block_size` weights stored in `type_size` bytes.

    `fields` is the block's byte layout as (name, byte offset, byte length), in order.
    """

    name: str
    ggml_type: int
    block_size: int
    type_size: int
    fields: tuple[tuple[str, int, int], ...] = ()

    def field(self, name: str) -> slice:
        """Byte slice of field `name` within one block."""
        for n, off, size in self.fields:
            if n == name:
                return slice(off, off + size)
        raise KeyError(f"{self.name} has no field {name!r}")

    @property
    def f16_offsets(self) -> tuple[int, ...]:
        """Byte offsets of the fp16 scale fields (`d`, `dmin`, `m`) within one block."""
        return tuple(off for n, off, _ in self.fields if n in F16_FIELDS)


def _make_format(name: str) -> BlockFormat:
    qtype = GGMLQuantizationType[name]
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    fields, off = [], 0
    for fname, size in _LAYOUTS[name]:
        fields.append((fname, off, size))
        off += size
    if off != type_size:  # our layout table must agree with gguf-py's sizes
        raise AssertionError(f"{name}: layout is {off} bytes, gguf says {type_size}")
    return BlockFormat(name, int(qtype), block_size, type_size, tuple(fields))


FORMATS: dict[str, BlockFormat] = {name: _make_format(name) for name in _LAYOUTS}


def get_format(fmt: str | BlockFormat) -> BlockFormat:
    if isinstance(fmt, BlockFormat):
        return fmt
    try:
        return FORMATS[fmt]
    except KeyError:
        raise ValueError(f"unsupported GGUF quant type {fmt!r}; have {sorted(FORMATS)}") from None


def row_bytes(fmt: str | BlockFormat, n_cols: int) -> int:
    """Bytes of one row of `n_cols` weights (n_cols must be a multiple of the block size)."""
    f = get_format(fmt)
    if n_cols % f.block_size:
        raise ValueError(f"{f.name}: row length {n_cols} is not a multiple of {f.block_size}")
    return n_cols // f.block_size * f.type_size


# ---------------------------------------------------------------------------------------------
# Codebooks and sign tables: built once from gguf-py's tables (the single source), cached.
# Byte j of grid row i is weight j of that codebook entry, so `grid.view(mx.uint64)` (IQ2_XS)
# or `grid.view(mx.uint32)` (IQ3_S) gives llama.cpp's packed little-endian tables exactly.


# Codebooks and sign tables. Byte j of grid row i is weight j of that codebook entry, so a view
# as uint64 (IQ2_XS) or uint32 (IQ3_S) gives llama.cpp's packed little-endian tables exactly.


@cache
def grid(qtype: str) -> np.ndarray:
    """The codebook of i-quant `qtype` ("IQ2_XS": uint8 [512, 8], entries in {0x08, 0x19,
    0x2b}; "IQ3_S": uint8 [512, 4], entries in {1, 3, ..., 15}); read-only."""
    cls = getattr(gq, qtype)
    cls.init_grid()  # gguf-py decodes its packed `grid_hex` into a float32 grid, once
    g = np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape)
    u8 = g.astype(np.uint8)
    assert np.array_equal(u8.astype(np.float32), g)
    u8.setflags(write=False)
    return u8


@cache
def ksigns_iq2xs() -> np.ndarray:
    """uint8 [128]: 7 stored sign bits -> 8 sign bits (bit 7 = parity of the low 7)."""
    out = np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8).copy()
    out.setflags(write=False)
    return out
