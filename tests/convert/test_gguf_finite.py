"""NaN and inf in a GGUF's tensors (strata_mlx.convert.gguf.finite): llama.cpp's fixtures
with one block's fp16 scale or one float value patched to NaN or inf, in place at the
tensor's data offset, are refused naming the file, the tensor and the kind, and convert with
--allow-non-finite. The scale table is checked against gguf-py's dequantizers (the reference
nobody here wrote): every field it names is one they multiply by, and none is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from strata_mlx.convert.gguf import convert_gguf
from strata_mlx.convert.gguf.finite import F16_SCALES, IQ1_M_SCALES, tensor_non_finite
from strata_mlx.format.store import StoreError, load_manifest

DATA = Path(__file__).parents[1] / "data" / "gguf"
NAN16, INF16, ONE16 = 0x7E00, 0x7C00, 0x3C00


def _patch(src: Path, dst: Path, type_name: str, offset: int, bits: int, block: int = 1) -> str:
    """A copy of `src` with block `block` (element, for float types) of its first tensor of
    ggml type `type_name` holding `bits` at byte `offset`; returns that tensor's name."""
    shutil.copy(src, dst)
    (t,) = [t for t in GGUFReader(src).tensors if t.tensor_type.name == type_name][:1]
    _, type_size = GGML_QUANT_SIZES[t.tensor_type]
    width = {"F32": 4}.get(type_name, 2)
    with open(dst, "r+b") as f:
        f.seek(t.data_offset + block * type_size + offset)
        f.write(int(bits).to_bytes(width, "little"))
    return t.name


CASES = [  # fixture, ggml type, byte offset of the patched field in its block
    ("qwen3_moe-Q4_K_M", "Q4_K", 0),  # d
    ("qwen3_moe-Q4_K_M", "Q4_K", 2),  # dmin
    ("qwen3_moe-Q4_K_M", "Q6_K", 208),  # d at the end of the block
    ("qwen3_moe-Q4_K_M", "Q5_0", 0),
    ("deepseek_v3-Q2_K", "Q2_K", 82),  # dmin after scales and quants
    ("deepseek_v3-Q2_K", "Q3_K", 108),
    ("deepseek_v3-Q2_K", "Q4_0", 0),
    ("deepseek_v3-Q2_K", "F16", 0),
    ("qwen3_moe-Q8_0", "Q8_0", 0),
    ("qwen3_moe-Q8_0", "F32", 0),
    ("glm4_moe-IQ2_XS", "IQ2_XS", 0),
    ("glm4_moe-IQ2_XS", "Q5_K", 2),
    ("olmoe-IQ3_S", "IQ3_S", 0),
    ("mixtral-IQ3_S", "IQ4_NL", 0),
]


@pytest.mark.parametrize("fixture, type_name, offset", CASES)
@pytest.mark.parametrize("kind", ["NaN", "inf"])
def test_a_non_finite_scale_or_value_is_refused_unless_allowed(
    tmp_path, fixture, type_name, offset, kind
):
    src = tmp_path / f"{fixture}.gguf"
    if type_name == "F32":
        bits = 0x7FC00000 if kind == "NaN" else 0x7F800000
    else:
        bits = NAN16 if kind == "NaN" else INF16
    name = _patch(DATA / f"{fixture}.gguf", src, type_name, offset, bits)
    what = "values" if type_name in ("F16", "F32") else "block scales"
    where = "element" if type_name in ("F16", "F32") else "block"
    with pytest.raises(StoreError) as e:
        convert_gguf(src, tmp_path / "s", calibration_tokens=0, progress=False)
    msg = str(e.value)
    assert msg == (
        f"{src}: tensor {name} ({type_name}): 1 {kind} {what} (first in {where} 1); the model "
        "would compute NaN (pass --allow-non-finite to convert it anyway)"
    )
    assert not (tmp_path / "s").exists()
    with np.errstate(invalid="ignore"):  # gguf-py's dequantizer: inf x 0 in a dense tensor
        out = convert_gguf(
            src, tmp_path / "s", calibration_tokens=0, progress=False, allow_non_finite=True
        )
    load_manifest(out)


def test_cli_refuses_a_nan_scale_in_one_line(tmp_path):
    src = tmp_path / "q.gguf"
    name = _patch(DATA / "qwen3_moe-Q4_K_M.gguf", src, "Q4_K", 0, NAN16)
    out = tmp_path / "s"
    args = [sys.executable, "-m", "strata_mlx", "convert", "--gguf-path", str(src)]
    args += ["--mlx-path", str(out), "--calibration-tokens", "0"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: {src}: tensor {name} (Q4_K): 1 NaN block scales")
    assert not out.exists()
    r = subprocess.run(
        [*args, "--allow-non-finite"], capture_output=True, text=True, env=env, timeout=300
    )
    assert r.returncode == 0, r.stderr
    load_manifest(out)


def _blocks(type_name: str, n: int, seed: int = 0) -> SimpleNamespace:
    """n random blocks of a ggml type with every scale the table names set to 1.0."""
    qtype = GGMLQuantizationType[type_name]
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    b = np.random.default_rng(seed).integers(0, 256, (n, type_size), dtype=np.uint8)
    words = b.view(np.uint16)
    if type_name == "IQ1_M":  # d's four nibbles: the top nibble of each scale word
        w = IQ1_M_SCALES // 2
        for k in range(4):
            words[:, w + k] = (words[:, w + k] & 0x0FFF) | (((ONE16 >> (4 * k)) & 0xF) << 12)
    else:
        for off in F16_SCALES[type_name]:
            words[:, off // 2] = ONE16
    return SimpleNamespace(tensor_type=qtype, data=b, name="t", block_size=block_size)


@pytest.mark.parametrize("type_name", [*F16_SCALES, "IQ1_M"])
def test_the_scale_table_is_gguf_pys(type_name):
    """Random blocks with the named scales set to 1.0 dequantize (gguf-py) to finite values,
    so no float field is missing (a random fp16 is NaN or inf 1 time in 32, and there are 512
    blocks); a NaN in any one named field makes gguf-py's output NaN and the check say so."""
    t = _blocks(type_name, 512)
    assert tensor_non_finite(t) is None
    assert np.isfinite(dequantize(t.data, t.tensor_type)).all()
    offsets = F16_SCALES.get(type_name, (None,))
    for off in offsets:
        bad = _blocks(type_name, 4)
        if off is None:  # IQ1_M: NaN 0x7E00's nibbles into the scale words' tops
            words = bad.data.view(np.uint16)
            for k in range(4):
                w = IQ1_M_SCALES // 2 + k
                words[2, w] = (words[2, w] & 0x0FFF) | (((NAN16 >> (4 * k)) & 0xF) << 12)
        else:
            bad.data.view(np.uint16)[2, off // 2] = NAN16
        assert np.isnan(dequantize(bad.data, bad.tensor_type)[2]).any()
        assert tensor_non_finite(bad) == "1 NaN block scales (first in block 2)"


def test_an_mxfp4_scale_0xff_is_refused():
    """E8M0 0xFF is NaN in the store's MXFP4 (gguf-py reads it as 2^127)."""
    qtype = GGMLQuantizationType.MXFP4
    b = np.zeros((3, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    b[:, 0] = 127
    t = SimpleNamespace(tensor_type=qtype, data=b, name="t")
    assert tensor_non_finite(t) is None
    b[1, 0] = 0xFF
    assert tensor_non_finite(t) == "1 E8M0 block scales 0xFF (NaN; first in block 1)"


@pytest.mark.parametrize("type_name, bits", [("BF16", 0x7FC0), ("BF16", 0xFF80), ("F16", 0xFC00)])
def test_float_tensors_by_their_bits(type_name, bits):
    qtype = GGMLQuantizationType[type_name]
    v = np.full(8, 0x3F80 if type_name == "BF16" else ONE16, dtype=np.uint16)
    t = SimpleNamespace(tensor_type=qtype, data=v.view(np.uint8).reshape(2, 8), name="t")
    assert tensor_non_finite(t) is None
    v[5] = bits
    kind = "NaN" if bits & (0x7F if type_name == "BF16" else 0x3FF) else "inf"
    assert tensor_non_finite(t) == f"1 {kind} values (first in element 5)"
