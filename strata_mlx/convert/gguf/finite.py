"""NaN and inf in a GGUF's tensors, found before conversion writes anything.

A quantized ggml tensor is finite exactly when every block's float scales are: its quants are
integers (codebook indices, sub-scales of a few bits) multiplied by them. So the check reads
only the scale fields of each block (fp16 `d`, `dmin`, `m`, as numpy views over the raw
bytes), never dequantizes, and float tensors (F32/F16/BF16/F64) by their exponent bits. A NaN
or inf there would convert silently and make the model compute NaN.

Never: dequantizes a tensor, converts or writes anything.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ...format.store import StoreError
from .blocks import block_info, qtype_name, raw_rows
from .reading import Gguf

# Byte offsets of the fp16 scale fields inside one block, per ggml type (llama.cpp's
# ggml-common.h `block_*` structs, as gguf-py's quants.py splits them): the K-quants Q2_K,
# Q3_K and Q6_K keep `d` at the end of the block, the others at the start.
F16_SCALES: dict[str, tuple[int, ...]] = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ2_XXS": (0,),
    "IQ2_XS": (0,),
    "IQ2_S": (0,),
    "IQ3_XXS": (0,),
    "IQ3_S": (0,),
    "IQ1_S": (0,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
    "TQ1_0": (52,),
    "TQ2_0": (64,),
}
IQ1_M_SCALES = 48  # IQ1_M's fp16 d is the top nibbles of its 4 uint16 scale words, from here
FLOAT_BITS = {  # exponent mask, mantissa mask of the raw bits
    "F16": (np.uint16, 0x7C00, 0x03FF),
    "BF16": (np.uint16, 0x7F80, 0x007F),
    "F32": (np.uint32, 0x7F800000, 0x007FFFFF),
    "F64": (np.uint64, 0x7FF0000000000000, 0x000FFFFFFFFFFFFF),
}
F16_EXP, F16_MANT = 0x7C00, 0x03FF
CHUNK = 1 << 22  # blocks or values per step: bounded temporaries on a many-GB tensor


def check_finite_tensors(g: Gguf, names: Iterable[str]) -> None:
    """Refuse the first of tensors `names` (in file order) holding a NaN or inf: a float
    value, a block's fp16 scale, or MXFP4's E8M0 scale 0xFF (NaN in the store's MXFP4). One
    StoreError naming the file, the tensor and the kind; --allow-non-finite skips the call."""
    wanted = set(names)
    for t in g.reader.tensors:
        if t.name not in wanted:
            continue
        found = tensor_non_finite(t)
        if found is not None:
            raise StoreError(
                f"{g.path}: tensor {t.name} ({qtype_name(t)}): {found}; the model would "
                "compute NaN (pass --allow-non-finite to convert it anyway)"
            )


def tensor_non_finite(t) -> str | None:
    """What is not finite in gguf-py tensor t ("2 NaN block scales (first in block 7)"), or
    None when all is finite or its type holds no floats (integer tensors)."""
    name = qtype_name(t)
    data = raw_rows(t)
    if name in FLOAT_BITS:
        uint, exp, mant = FLOAT_BITS[name]
        bits = data.reshape(-1).view(uint)
        nan, inf, first = _count(bits, exp, mant)
        return _describe(nan, inf, first, "values", "element")
    if name not in F16_SCALES and name not in ("IQ1_M", "MXFP4"):
        return None  # integer types (I8..I64); types the converter refuses never get here
    _, type_size = block_info(t)
    blocks = data.reshape(-1, type_size)
    if name == "MXFP4":
        bad = np.flatnonzero(blocks[:, 0] == 0xFF)
        if not len(bad):
            return None
        return f"{len(bad)} E8M0 block scales 0xFF (NaN; first in block {bad[0]})"
    words = blocks.view(np.uint16)  # every fp16 field sits at an even offset
    if name == "IQ1_M":
        w = IQ1_M_SCALES // 2
        d = words[:, w : w + 4] & np.uint16(0xF000)
        fields = [d[:, 0] >> 12 | d[:, 1] >> 8 | d[:, 2] >> 4 | d[:, 3]]
    else:
        fields = [words[:, off // 2] for off in F16_SCALES[name]]
    nan = inf = 0
    first = None
    for f in fields:
        n, i, at = _count(f, F16_EXP, F16_MANT)
        nan, inf = nan + n, inf + i
        if at is not None and (first is None or at < first):
            first = at
    return _describe(nan, inf, first, "block scales", "block")


def _count(bits: np.ndarray, exp: int, mant: int) -> tuple[int, int, int | None]:
    """(NaNs, infs, index of the first) among raw float bits: exponent all ones."""
    nan = inf = 0
    first = None
    for start in range(0, len(bits), CHUNK):
        b = bits[start : start + CHUNK]
        special = (b & exp) == exp
        if not special.any():
            continue
        where = np.flatnonzero(special)
        n = int(np.count_nonzero(b[where] & mant))
        nan, inf = nan + n, inf + len(where) - n
        first = start + int(where[0]) if first is None else first
    return nan, inf, first


def _describe(nan: int, inf: int, first: int | None, what: str, unit: str) -> str | None:
    if first is None:
        return None
    kinds = " and ".join(f"{n} {k}" for n, k in ((nan, "NaN"), (inf, "inf")) if n)
    return f"{kinds} {what} (first in {unit} {first})"
