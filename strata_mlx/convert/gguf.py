"""GGUF files (llama.cpp) -> a store, read with gguf-py's GGUFReader.

Dense Llama GGUF with `split_experts=E` (the built-in model is SmolLM2-135M-Instruct)
---------------------------------------------------------------------------------
Each layer's MLP, down(silu(gate(x)) * up(x)) over I neurons, becomes E SwiGLU experts of
I/E neurons; the store is an ordinary MoE store, so the whole streaming path runs on it.

*Grouping: contiguous neuron ranges* (expert e owns neurons [e*I/E, (e+1)*I/E)). Any
partition of the neurons reproduces the dense MLP exactly when all E experts run, since the
down projection sums over neurons. Contiguous ranges are the only partition that keeps the
GGUF blocks intact: ggml blocks run along each row's input dimension, so gate/up experts are
whole rows (any grouping would do for them), but down's blocks run along the neuron axis, and
only a contiguous range whose width is a multiple of the block size (32 for Q4_0/Q4_1/Q8_0,
256 for K-quants) cuts whole blocks. A neuron permutation (e.g. clustering co-firing
neurons, which could help top-k < E) would force down to be requantized or stored in float.
Widths that are not a block multiple (e.g. E=32 for I=1536: 48 neurons) still convert: down
is then stored dequantized in float, exactly, at about 6x the bytes.

*Router: least squares.* Only used when a run asks for fewer than E experts (`--top-k`;
the default selects all E and is exact). For each layer the converter runs the model (all
E experts) over calibration text, records the MLP input x and each expert's output norm
||y_e(x)||, and fits logits = W x + b by ridge-regularised least squares to those norms; the
top-k logits then pick the experts predicted to contribute most. It is a linear probe fitted
in seconds, not a trained router: quality below E is a research question (docs/top_k.md).

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

llama.cpp's converter permutes q/k rows for its interleaved rotary; they are un-permuted here
(whole rows move, so quantized blocks survive) and the model uses transformers' rotary.

The tokenizer is rebuilt from the GGUF metadata (tokenizer.ggml.model "gpt2": byte-level BPE
with the pre-tokenizer named by tokenizer.ggml.pre; "llama": SentencePiece BPE, merges from
the scores, byte fallback) and written as tokenizer.json and tokenizer_config.json with the
chat template.

MoE GGUFs keep each expert's ggml blocks as they are, with each layer's own types (a Q4_K_M
file's down projection is Q6_K in some layers and Q4_K in others): the store then has
per-layer record layouts, padded to one record size. Architectures, as llama.cpp's
convert_hf_to_gguf.py writes them (tests/convert/test_gguf_moe.py runs it): "qwen3moe", "qwen3next"
(its changes to the delta-net tensors undone: _convert_qwen3next), "olmoe", "glm4moe",
"deepseek2", "gpt-oss" (MXFP4 experts, biases, sinks: _convert_gpt_oss), and "llama" with
blk.N.ffn_*_exps tensors, which is Mixtral: a llama GGUF is called dense only when it has no
expert tensors and no expert_count.

Each architecture's header is read in one place, before any tensor data: `gguf_config` gives
the store's config, its MoE layers, each layer's record formats and layout, and which tensors
become experts and which dense weights (a `_<arch>_config` each); the `_convert_<arch>` writers
take it from there, and `strata-mlx plan FILE.gguf` forecasts from the same reading.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..format.store import PROJECTIONS, RecordLayout, StoreError, StoreWriter, save_profile
from .common import CALIBRATION_TEXT, check_output

GGUF_PROJ = {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
AFFINE_TYPES = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
GROUP = 32
MAX_DIM = 1 << 24  # any width, head count or layer count read from a header
MAX_LAYERS = 1 << 12

# Extra prose for fitting the routers (with the shared calibration text: ~770 SmolLM2 tokens).
ROUTER_TEXT = (
    "Every winter the harbour froze for a few weeks, and the fishing boats were pulled up on "
    "the shingle and turned over like beetles. The children skated between them. Their "
    "grandparents remembered a year when the ice reached the lighthouse and a man walked out "
    "to it with a sack of coal on his back. Nobody believed him, but the story was told again "
    "every time the cold came back.\n\n"
    "A good recipe for bread needs only flour, water, salt and yeast. Mix them, knead the "
    "dough for ten minutes until it is smooth, and leave it somewhere warm until it has "
    "doubled in size. Shape the loaf, let it rise once more, and bake it in a hot oven for "
    "about forty minutes. The crust should sound hollow when you tap the bottom.\n\n"
    "The committee met on Tuesday to discuss the budget. Several members argued that the "
    "library should stay open in the evenings, because students and workers have no other "
    "quiet place to study. Others pointed out that heating and staff cost money and that the "
    "roof still leaks. In the end they agreed to try late opening on two nights a week and to "
    "count the visitors before deciding anything more.\n\n"
    "Light travels at about three hundred thousand kilometres per second. Sunlight takes a "
    "little over eight minutes to reach the Earth, and the light from the nearest star other "
    "than the Sun has been travelling for more than four years. When we look at the night "
    "sky we are looking into the past.\n\n"
    "User: Can you explain what a prime number is?\nAssistant: A prime number is a whole "
    "number greater than one whose only divisors are one and itself, such as 2, 3, 5, 7 and "
    "11. Every other whole number greater than one can be written as a product of primes.\n"
    "User: Write a short poem about autumn.\nAssistant: The maple lets its letters fall, / "
    "red notes the wind forgets to read; / the garden keeps them, one and all, / and folds "
    "them in around the seed.\n\n"
    "import json\n\ndef load(path):\n    with open(path) as f:\n        return json.load(f)\n\n"
    "for name, value in sorted(load('settings.json').items()):\n    print(name, value)\n\n"
    "History is not only the record of kings and battles. It is also the price of grain, the "
    "letters of merchants, the songs that farmers sang, and the tools that were found in the "
    "mud of a riverbank. Historians piece these things together to understand how ordinary "
    "people lived, what they feared, and what they hoped for their children.\n"
)


# ---- reading ------------------------------------------------------------------------------


class _Gguf:
    """A GGUF file's metadata and tensors, with StoreErrors that name the file."""

    def __init__(self, path: Path):
        from gguf import GGUFReader

        if not path.is_file():
            raise StoreError(f"{path}: no such file")
        check_header(path)
        try:
            self.reader = GGUFReader(str(path))
        except MemoryError:
            raise  # a header that slipped past check_header: a bug of ours, not the file's
        except Exception as e:  # gguf-py raises ValueError/struct.error/IndexError
            raise StoreError(
                f"{path}: not a readable GGUF file ({type(e).__name__}: {e})"
            ) from None
        self.path = path
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.arch = self.str("general.architecture")
        if self.arch is None:
            raise StoreError(f"{path}: GGUF metadata has no general.architecture")

    def get(self, key: str, default=None):
        f = self.reader.fields.get(key)
        if f is None:
            return default
        try:
            return f.contents()
        except (ValueError, IndexError) as e:  # bad UTF-8, a value cut short
            raise StoreError(f"{self.path}: metadata {key}: unreadable ({e})") from None

    def need(self, key: str):
        v = self.get(key)
        if v is None:
            raise StoreError(f"{self.path}: GGUF metadata lacks {key}")
        return v

    def fail(self, key: str, msg: str):
        raise StoreError(f"{self.path}: metadata {key}: {msg}")

    def int(self, key: str, default: int | None = None, lo: int = 1, hi: int = MAX_DIM) -> int:
        """An integer field in [lo, hi] (needed when `default` is None)."""
        v = self.need(key) if default is None else self.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool):
            self.fail(key, f"expected an integer, got {type(v).__name__} {v!r:.40}")
        if not lo <= v <= hi:
            self.fail(key, f"{v} outside [{lo}, {hi}]")
        return v

    def float(self, key: str, default: float | None = None) -> float:
        """A finite number > 0 (epsilons, rope bases and factors)."""
        v = self.need(key) if default is None else self.get(key, default)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < float("inf"):
            self.fail(key, f"expected a number > 0, got {type(v).__name__} {v!r:.40}")
        return float(v)

    def str(self, key: str, default: str | None = None) -> str | None:
        v = self.get(key, default)
        if v is not None and not isinstance(v, str):
            self.fail(key, f"expected a string, got {type(v).__name__}")
        return v

    def tensor(self, name: str, shape: tuple[int, ...] | None = None):
        """Tensor `name`; with `shape` ([rows, cols] order, as numpy), checked against it."""
        t = self.tensors.get(name)
        if t is None:
            raise StoreError(f"{self.path}: tensor {name} not found")
        if shape is not None:
            have = tuple(int(x) for x in reversed(t.shape))
            # ggml drops a tensor's trailing size-1 dims (ggml_n_dims) when llama-quantize
            # writes it: Qwen3-Next's [1, D] shared-expert gate comes back as [D].
            if _outer_ones_dropped(have) != _outer_ones_dropped(tuple(shape)):
                raise StoreError(
                    f"{self.path}: tensor {name} is {list(have)}, the metadata implies {list(shape)}"
                )
        return t


# GGUF value types (gguf-py's GGUFValueType): scalar sizes in bytes, then STRING and ARRAY.
def _outer_ones_dropped(shape: tuple[int, ...]) -> tuple[int, ...]:
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return shape


_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def check_header(path: Path) -> None:
    """Walk a GGUF header (metadata and tensor infos) checking every count and length against
    the bytes left in the file, before gguf-py parses it: gguf-py reads an array item by item
    and, past the end of the file, gets empty items that do not advance, so a flipped array
    length of 2^64 - 1 used to append empty items until the machine ran out of memory."""
    import mmap
    import struct

    size = path.stat().st_size
    if size < 24:
        raise StoreError(f"{path}: not a GGUF file ({size} bytes)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            raise StoreError(f"{path}: not a GGUF file (no GGUF magic)")
        order = ">" if struct.unpack_from("<I", m, 4)[0] & 0xFFFF == 0 else "<"
        pos = 8

        def need(n: int, what: str) -> None:
            if n < 0 or n > size - pos:
                raise StoreError(
                    f"{path}: {what} needs {n} bytes at offset {pos}, the file has "
                    f"{size - pos} left (corrupt or truncated header)"
                )

        def read(fmt: str, what: str) -> int:
            nonlocal pos
            n = struct.calcsize(fmt)
            need(n, what)
            (v,) = struct.unpack_from(order + fmt, m, pos)
            pos += n
            return v

        def skip(n: int, what: str) -> None:
            nonlocal pos
            need(n, what)
            pos += n

        def value(t: int, what: str, depth: int = 0) -> None:
            if t in _SCALAR_BYTES:
                skip(_SCALAR_BYTES[t], what)
            elif t == _STRING:
                skip(read("Q", what), what)
            elif t == _ARRAY and depth < 2:
                item, n = read("I", what), read("Q", what)
                if item in _SCALAR_BYTES:
                    skip(n * _SCALAR_BYTES[item], f"{what} ({n} items)")
                    return
                need(n * (8 if item == _STRING else 12), f"{what} ({n} items)")
                for _ in range(n):
                    value(item, what, depth + 1)
            else:
                raise StoreError(f"{path}: {what}: unknown GGUF value type {t}")

        n_tensors, n_kv = read("Q", "tensor count"), read("Q", "metadata count")
        need(n_kv * 13 + n_tensors * 24, f"{n_kv} metadata fields and {n_tensors} tensor infos")
        for i in range(n_kv):
            key_len = read("Q", f"metadata field {i}")
            skip(key_len, f"metadata field {i}'s key")
            key = repr(bytes(m[pos - key_len : pos][:40]).decode("utf-8", "replace"))
            value(read("I", f"metadata {key}"), f"metadata {key}")
        for i in range(n_tensors):
            skip(read("Q", f"tensor info {i}"), f"tensor info {i}'s name")
            n_dims = read("I", f"tensor info {i}")
            if n_dims > 4:  # GGML_MAX_DIMS
                raise StoreError(f"{path}: tensor info {i}: {n_dims} dimensions")
            skip(8 * n_dims + 4 + 8, f"tensor info {i}")


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
        from ..format.gguf_quants import FORMATS
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
    return {"weight": (spec["_dtype"], _to_dtype(w, spec["_dtype"]))}


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


def _to_dtype(a: np.ndarray, name: str) -> np.ndarray:
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


# ---- dense tensors ------------------------------------------------------------------------


class DenseWriter:
    """Dense weights as MLX arrays: affine-repacked where lossless, else float."""

    def __init__(self, dtype: str):
        self.dtype = dtype
        self.weights: dict[str, mx.array] = {}
        self.quantized: dict[str, dict[str, int]] = {}

    def add(self, name: str, t, data: np.ndarray | None = None, quantize: bool = True) -> None:
        """Module path `name` (e.g. model.layers.0.self_attn.q_proj) from tensor t."""
        data = raw_rows(t) if data is None else data
        qt = qtype_name(t)
        if quantize and qt in AFFINE_TYPES and data.ndim == 2:
            w, s, b = repack_affine(data, qt, np.float32)
            self.weights[f"{name}.weight"] = mx.array(w)
            self.weights[f"{name}.scales"] = mx.array(s).astype(_mx(self.dtype))
            self.weights[f"{name}.biases"] = mx.array(b).astype(_mx(self.dtype))
            self.quantized[name] = {"group_size": GROUP, "bits": AFFINE_TYPES[qt]}
            return
        self.add_array(f"{name}.weight", dequantize_rows(data, t))

    def add_array(self, key: str, a: np.ndarray) -> None:
        self.weights[key] = mx.array(np.ascontiguousarray(a, dtype=np.float32)).astype(
            _mx(self.dtype)
        )

    def quantization_config(self) -> dict[str, Any] | None:
        if not self.quantized:
            return None
        bits = [q["bits"] for q in self.quantized.values()]
        common = max(set(bits), key=bits.count)
        cfg: dict[str, Any] = {"group_size": GROUP, "bits": common, "mode": "affine"}
        for name, q in self.quantized.items():
            if q["bits"] != common:
                cfg[name] = q
        return cfg


def _mx(name: str):
    return {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}[name]


# ---- tokenizer ----------------------------------------------------------------------------

GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k's (GPT-4o's, and GPT-OSS's tokenizer.json), as llama.cpp's "gpt-4o" pre-tokenizer.
GPT4O_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (split digits one by one first?, split regex or None for GPT-2's).
# As llama.cpp's llama-vocab.cpp: "smollm" (and starcoder, refact, command-r) split every
# digit, then GPT-2's regex.
PRE_TOKENIZERS = {
    "gpt2": (False, None),
    "gpt-2": (False, None),
    "default": (False, None),
    "mpt": (False, None),
    "olmo": (False, None),
    "smollm": (True, None),
    "starcoder": (True, None),
    "refact": (True, None),
    "command-r": (True, None),
    "llama-bpe": (False, LLAMA3_PATTERN),
    "llama3": (False, LLAMA3_PATTERN),
    "dbrx": (False, LLAMA3_PATTERN),
    "smaug-bpe": (False, LLAMA3_PATTERN),
    "qwen2": (False, QWEN2_PATTERN),
    "qwen35": (False, QWEN2_PATTERN),
    "gpt-4o": (False, GPT4O_PATTERN),
}


def build_tokenizer(g: _Gguf, out: Path, vocab_size: int) -> bool:
    """tokenizer.json + tokenizer_config.json from GGUF metadata; False when there is none."""
    try:
        return _build_tokenizer(g, out, vocab_size)
    except (StoreError, MemoryError):
        raise
    except Exception as e:  # tokenizers raises bare Exceptions (a merge of unknown tokens)
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise StoreError(f"{g.path}: tokenizer metadata rejected by tokenizers ({msg})") from None


def _build_tokenizer(g: _Gguf, out: Path, vocab_size: int) -> bool:
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    kind = g.str("tokenizer.ggml.model")
    if kind is None:
        return False
    if kind not in ("gpt2", "llama"):
        warnings.warn(
            f"{g.path}: tokenizer model {kind!r} is not supported (gpt2 BPE and llama "
            "SentencePiece are); the store will need --prompt-tokens",
            stacklevel=3,
        )
        return False
    tokens = _str_list(g, "tokenizer.ggml.tokens", g.need("tokenizer.ggml.tokens"))
    if not 0 < len(tokens) <= vocab_size:
        g.fail("tokenizer.ggml.tokens", f"{len(tokens)} tokens for a vocabulary of {vocab_size}")
    types = g.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if not isinstance(types, list) or len(types) != len(tokens):
        g.fail("tokenizer.ggml.token_type", f"expected {len(tokens)} token types")
    if kind == "llama":
        tok = _sentencepiece_bpe(g, tokens)
    else:
        merges = _str_list(g, "tokenizer.ggml.merges", g.get("tokenizer.ggml.merges") or [])
        if any(" " not in m for m in merges):
            g.fail("tokenizer.ggml.merges", "a merge without a space")
        merges = [tuple(m.split(" ", 1)) for m in merges]
        vocab = {t: i for i, t in enumerate(tokens)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        pre = g.str("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            warnings.warn(f"{g.path}: pre-tokenizer {pre!r} unknown; using GPT-2's", stacklevel=3)
        digits, pattern = PRE_TOKENIZERS.get(pre, (False, None))
        steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
        if pattern is None:
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
        else:
            steps.append(pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False))
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        tok.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
        tok.decoder = decoders.ByteLevel()
    # ggml token types: 3 control (special), 4 user-defined (added, not special).
    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, ty in enumerate(types)
        if ty == 3
    ]
    user = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i, ty in enumerate(types)
        if ty == 4
    ]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)

    def tid(key):
        i = g.get(key)
        if i is not None and (not isinstance(i, int) or isinstance(i, bool)):
            g.fail(key, f"expected a token id, got {type(i).__name__}")
        return None if i is None or not 0 <= i < len(tokens) else i

    bos, eos = tid("tokenizer.ggml.bos_token_id"), tid("tokenizer.ggml.eos_token_id")
    unk, pad = tid("tokenizer.ggml.unknown_token_id"), tid("tokenizer.ggml.padding_token_id")
    # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
    add_bos = _bool(g, "tokenizer.ggml.add_bos_token", kind == "llama") and bos is not None
    add_eos = _bool(g, "tokenizer.ggml.add_eos_token") and eos is not None
    single, pair, sp = "$A", "$A $B", []
    if add_bos:
        single, pair = f"{tokens[bos]} {single}", f"{tokens[bos]} $A {tokens[bos]} $B"
        sp.append((tokens[bos], bos))
    if add_eos:
        single, pair = f"{single} {tokens[eos]}", f"{pair} {tokens[eos]}"
        if not add_bos or eos != bos:
            sp.append((tokens[eos], eos))
    if sp:
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=sp
        )
    tok.save(str(out / "tokenizer.json"))
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": g.int(f"{g.arch}.context_length", 2048, hi=1 << 31),
    }
    for name, i in (("bos_token", bos), ("eos_token", eos), ("unk_token", unk), ("pad_token", pad)):
        if i is not None:
            cfg[name] = tokens[i]
    template = g.str("tokenizer.chat_template")
    if template:
        cfg["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    if eos is not None:
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return True


def _sentencepiece_bpe(g: _Gguf, tokens: list[str]):
    """A SentencePiece BPE vocabulary (tokenizer.ggml.model "llama": tokens and scores, no
    merges) as a tokenizers BPE, the way Llama-2/Mistral/Mixtral's own tokenizer.json is:
    merges recovered from the scores (a token's merges rank by its score, best first, as
    transformers' generate_merges and llama.cpp's SPM tokenizer, which merges the
    best-scoring pair first), byte fallback to the <0xXX> tokens, spaces as U+2581 with one
    prefixed (unless tokenizer.ggml.add_space_prefix is false)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = g.need("tokenizer.ggml.scores")
    if (
        not isinstance(scores, list)
        or len(scores) != len(tokens)
        or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in scores)
    ):
        g.fail("tokenizer.ggml.scores", f"expected {len(tokens)} numbers")
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    ranked = []
    for t, i in vocab.items():
        for cut in range(1, len(t)):
            left, right = t[:cut], t[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], vocab[left], vocab[right], left, right))
    merges = [(left, right) for *_, left, right in sorted(ranked)]
    unk = g.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None
    tok = Tokenizer(
        models.BPE(
            vocab=vocab, merges=merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True
        )
    )
    space = "\u2581"
    steps = [normalizers.Replace(" ", space)]
    decode = [decoders.Replace(space, " "), decoders.ByteFallback(), decoders.Fuse()]
    if _bool(g, "tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend(space))
        decode.append(decoders.Strip(" ", 1, 0))
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence(decode)
    return tok


def _str_list(g: _Gguf, key: str, v) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        g.fail(key, "expected an array of strings")
    return v


def _bool(g: _Gguf, key: str, default: bool = False) -> bool:
    v = g.get(key, default)
    if not isinstance(v, bool):
        g.fail(key, f"expected true or false, got {type(v).__name__}")
    return v


# ---- llama (dense) with split experts -----------------------------------------------------


def llama_config(g: _Gguf, n_experts: int, dtype: str) -> dict[str, Any]:
    a = g.arch
    heads = g.int(f"{a}.attention.head_count")
    if isinstance(g.get(f"{a}.attention.head_count_kv"), list):
        raise StoreError(f"{g.path}: per-layer head counts are not supported")
    kv = g.int(f"{a}.attention.head_count_kv", heads)
    dim = g.int(f"{a}.embedding_length")
    head_dim = g.int(f"{a}.attention.key_length", max(dim // heads, 1))
    rope_dim = g.int(f"{a}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise StoreError(f"{g.path}: partial rotary ({rope_dim} of {head_dim}) is not supported")
    _check_heads(g, heads, kv, head_dim)
    emb = g.tensor("token_embd.weight")
    vocab = g.int(f"{a}.vocab_size", int(emb.shape[1]))
    g.tensor("token_embd.weight", (vocab, dim))
    cfg: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": dim,
        "num_hidden_layers": g.int(f"{a}.block_count", hi=MAX_LAYERS),
        "intermediate_size": g.int(f"{a}.feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "rms_norm_eps": g.float(f"{a}.attention.layer_norm_rms_epsilon", 1e-5),
        "vocab_size": vocab,
        "rope_theta": g.float(f"{a}.rope.freq_base", 10000.0),
        "max_position_embeddings": g.int(f"{a}.context_length", 2048, hi=1 << 31),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "attention_bias": "blk.0.attn_q.bias" in g.tensors,
        "num_experts": n_experts,
        "num_experts_per_tok": n_experts,
        "torch_dtype": dtype,
    }
    scaling = g.str(f"{a}.rope.scaling.type")
    if scaling == "linear":
        cfg["rope_scaling"] = {
            "rope_type": "linear",
            "factor": g.float(f"{a}.rope.scaling.factor"),
        }
    elif scaling not in (None, "none"):
        raise StoreError(f"{g.path}: rope scaling {scaling!r} is not supported")
    if "rope_freqs.weight" in g.tensors:
        t = g.tensor("rope_freqs.weight", (head_dim // 2,))
        factors = dequantize_rows(raw_rows(t), t).reshape(-1)
        if not (np.isfinite(factors) & (factors > 0)).all():
            raise StoreError(f"{g.path}: tensor rope_freqs.weight holds values that are not > 0")
        cfg["rope_freq_factors"] = factors.tolist()
    return cfg


def _check_heads(g: _Gguf, heads: int, kv: int, head_dim: int) -> None:
    if heads % kv:
        raise StoreError(f"{g.path}: {kv} key/value heads do not divide {heads} heads")
    if head_dim % 2 or heads * head_dim > MAX_DIM:
        raise StoreError(f"{g.path}: head size {head_dim} x {heads} heads is not a model shape")


def convert_gguf(
    gguf_path: str | Path,
    mlx_path: str | Path,
    split_experts: int | None = None,
    calibration_tokens: int = 256,
    progress: bool = True,
    overwrite: bool | None = None,
) -> Path:
    """Convert a GGUF file into a store at mlx_path; returns the store's path. An existing
    store there is replaced only with `overwrite` (common.check_output)."""
    src = Path(gguf_path)
    out = check_output(mlx_path, src, overwrite=overwrite)
    g = _Gguf(src)
    c = gguf_config(g, split_experts)
    if c.split_experts is not None:
        return _convert_llama(g, c, out, calibration_tokens, progress)
    write = {
        "qwen3moe": _convert_qk_norm_moe,
        "qwen3next": _convert_qwen3next,
        "olmoe": _convert_qk_norm_moe,
        "glm4moe": _convert_glm4moe,
        "deepseek2": _convert_deepseek2,
        "gpt-oss": _convert_gpt_oss,
        "llama": _convert_mixtral,
    }
    return write[g.arch](g, c, out, calibration_tokens, progress)


@dataclass
class GgufConfig:
    """What convert_gguf makes of a GGUF, from its header alone (no tensor data read): the
    store's config, its MoE layers and each one's record formats and layout, and which of
    the file's tensors become expert records and which dense weights. The converter writes
    the store from it and `strata-mlx plan` forecasts from it: one store, described once."""

    config: dict[str, Any]
    moe_layers: list[int]
    layer_specs: dict[int, dict[str, dict]]  # MoE layer -> projection -> record format
    layouts: list[RecordLayout]  # one per MoE layer, padded to one record size
    expert_tensors: set[str]  # GGUF tensors that become expert records
    dense_tensors: set[str]  # GGUF tensors that become dense weights (or feed them)
    split_experts: int | None = None  # a dense llama's MLPs split into this many experts

    @property
    def model_type(self) -> str:
        return self.config["model_type"]

    @property
    def num_experts(self) -> int:
        return self.config["num_experts"]

    @property
    def dtype(self) -> str:
        return self.config["torch_dtype"]

    @property
    def layer_layouts(self) -> list[RecordLayout] | None:
        """Per-layer layouts for the store, or None when every layer has the first's."""
        return None if all(lay == self.layouts[0] for lay in self.layouts) else self.layouts


def gguf_config(g: _Gguf, split_experts: int | None = None) -> GgufConfig:
    """The store `convert_gguf(g, split_experts=...)` writes, as far as the header says:
    every check the converter makes before reading tensor data, and its errors."""
    moe = {
        "qwen3moe": _qwen3moe_config,
        "qwen3next": _qwen3next_config,
        "olmoe": _olmoe_config,
        "glm4moe": _glm4moe_config,
        "deepseek2": _deepseek2_config,
        "gpt-oss": _gpt_oss_config,
    }
    if g.arch == "llama" and _has_experts(g):
        moe["llama"] = _mixtral_config
    if g.arch in moe:
        if split_experts is not None:
            raise StoreError(
                f"{g.path}: --split-experts is for dense models; this {g.arch} GGUF has experts"
            )
        cfg, moe_layers, read = moe[g.arch](g)
        return _moe_config(g, cfg, moe_layers, read)
    if g.arch == "llama":
        if split_experts is None:
            raise StoreError(
                f"{g.path}: a dense llama GGUF (no ffn_*_exps tensors) needs --split-experts E "
                "(e.g. 16): each MLP becomes E experts"
            )
        return _llama_split_config(g, int(split_experts))
    raise StoreError(
        f"{g.path}: GGUF architecture {g.arch!r} is not supported (MoE: "
        f"{', '.join(MOE_ARCHITECTURES)}; dense llama with --split-experts)"
    )


def _model_dtype(path: Path) -> str:
    return "float32" if path.stat().st_size < 2 * 1024**3 else "float16"


def _llama_split_config(g: _Gguf, E: int) -> GgufConfig:
    """A dense llama whose MLPs become E experts of contiguous neuron ranges."""
    dtype = _model_dtype(g.path)
    inter = g.int(f"{g.arch}.feed_forward_length")
    if E < 1 or inter % E:
        divisors = [d for d in range(1, min(inter, 64) + 1) if inter % d == 0]
        raise StoreError(
            f"{g.path}: --split-experts {E} must divide the MLP width {inter} "
            f"(one of {', '.join(map(str, divisors))}{', ...' if inter > 64 else ''})"
        )
    cfg = llama_config(g, E, dtype)
    L, D, n = cfg["num_hidden_layers"], cfg["hidden_size"], inter // E
    read = _check_shapes(
        g, cfg, {"ffn_gate": (inter, D), "ffn_up": (inter, D), "ffn_down": (D, inter)}
    )

    # One record format per projection, for every layer.
    specs = {}
    for p, gp in GGUF_PROJ.items():
        ts = [g.tensor(f"blk.{i}.{gp}.weight") for i in range(L)]
        types = {qtype_name(t) for t in ts}
        ok = (
            all(slice_cols(raw_rows(t), t, 0, n) is not None for t in ts)
            if p == "down_proj"
            else True
        )
        specs[p] = choose_format(types, ok, dtype)
        if specs[p]["format"] == "gguf":
            specs[p]["in_features"] = n if p == "down_proj" else D
    shapes = {
        p: projection_shapes(specs[p], g.tensor(f"blk.0.{gp}.weight"), *shape)
        for (p, gp), shape in zip(GGUF_PROJ.items(), ((n, D), (n, D), (D, n)))
    }
    layout = build_layout(shapes, specs)
    experts = {f"blk.{i}.{gp}.weight" for i in range(L) for gp in GGUF_PROJ.values()}
    return GgufConfig(
        cfg,
        list(range(L)),
        {i: specs for i in range(L)},
        [layout] * L,
        experts,
        read - experts,
        E,
    )


def _convert_llama(
    g: _Gguf, c: GgufConfig, out: Path, calibration_tokens: int, progress: bool
) -> Path:
    cfg, E, dtype, specs = c.config, c.num_experts, c.dtype, c.layer_specs[0]
    L, D = cfg["num_hidden_layers"], cfg["hidden_size"]
    n = cfg["intermediate_size"] // E
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    full: dict[str, Any] = {}  # the last down matrix dequantized whole

    def expert_parts(layer: int, e: int) -> dict[str, dict[str, tuple]]:
        parts = {}
        for p, gp in GGUF_PROJ.items():
            t = g.tensor(f"blk.{layer}.{gp}.weight")
            data = raw_rows(t)
            if p == "down_proj":
                cut = slice_cols(data, t, e * n, (e + 1) * n)
                if cut is None:  # through a block: dequantize the rows (once), then cut
                    if full.get("name") != t.name:
                        full.update(name=t.name, w=dequantize_rows(data, t))
                    cut = full["w"][:, e * n : (e + 1) * n]
                    parts[p] = {"weight": (specs[p]["_dtype"], _to_dtype(cut, specs[p]["_dtype"]))}
                    continue
                parts[p] = projection_tensors(specs[p], cut, t, D, n)
            else:
                parts[p] = projection_tensors(specs[p], data[e * n : (e + 1) * n], t, n, D)
        return parts

    layout = c.layouts[0]
    dense = DenseWriter(dtype)
    dense.add("model.embed_tokens", g.tensor("token_embd.weight"))
    if not cfg["tie_word_embeddings"]:
        dense.add("lm_head", g.tensor("output.weight"))
    dense.add_array(
        "model.norm.weight",
        dequantize_rows(raw_rows(g.tensor("output_norm.weight")), g.tensor("output_norm.weight")),
    )
    for i in range(L):
        pre = f"model.layers.{i}"
        for gname, hname in (
            ("attn_norm", "input_layernorm"),
            ("ffn_norm", "post_attention_layernorm"),
        ):
            t = g.tensor(f"blk.{i}.{gname}.weight")
            dense.add_array(f"{pre}.{hname}.weight", dequantize_rows(raw_rows(t), t))
        for gname, hname, nh in (
            ("attn_q", "q_proj", heads),
            ("attn_k", "k_proj", kv),
            ("attn_v", "v_proj", None),
            ("attn_output", "o_proj", None),
        ):
            t = g.tensor(f"blk.{i}.{gname}.weight")
            data = raw_rows(t)
            if nh is not None:
                data = unpermute_rows(data, nh)
            dense.add(f"{pre}.self_attn.{hname}", t, data)
            if f"blk.{i}.{gname}.bias" in g.tensors:
                tb = g.tensor(f"blk.{i}.{gname}.bias")
                b = dequantize_rows(raw_rows(tb), tb).reshape(-1)
                if nh is not None:
                    b = unpermute_rows(b, nh)
                dense.add_array(f"{pre}.self_attn.{hname}.bias", b)
        # Routers start at zero (unused while all experts run); fitted below.
        dense.add_array(f"{pre}.mlp.gate.weight", np.zeros((E, D), np.float32))
        dense.add_array(f"{pre}.mlp.gate.bias", np.zeros((E,), np.float32))
    qcfg = dense.quantization_config()
    if qcfg:
        cfg["quantization"] = qcfg

    writer = StoreWriter(out, "llama", cfg, layout, list(range(L)), E)
    with writer:
        writer.manifest.extra = {
            "source": {"gguf": g.path.name, "architecture": g.arch},
            "split": {
                "experts": E,
                "neurons_per_expert": n,
                "grouping": "contiguous",
                "router": "ridge least squares on ||expert output||, calibration text",
                "formats": {p: s.get("_src", s["format"]) for p, s in specs.items()},
            },
        }
        has_tok = build_tokenizer(g, writer.path, cfg["vocab_size"])
        if E > 1 and calibration_tokens > 0 and has_tok:
            from ..generation.tokenizer import load_tokenizer

            ids = calibration_ids(load_tokenizer(writer.path), calibration_tokens, g.path)
            fit_routers(dense, g, cfg, ids, n)
        writer.write_dense(dense.weights)
        _write_experts(writer, range(L), E, expert_parts, progress)
        if calibration_tokens > 0:
            # top_k == E by default: every token runs every expert, so the profile is flat.
            path = writer.finalize()
            save_profile(
                path,
                np.full((L, E), calibration_tokens),
                calibration_tokens,
                "split experts: every expert runs for every token at the default top_k",
            )
        return writer.commit()


def _check_shapes(
    g: _Gguf,
    cfg: dict[str, Any],
    per_layer: dict[str, tuple[int, ...]] | Callable[[int], dict[str, tuple[int, ...]]],
    attention: bool = True,
) -> set[str]:
    """Every tensor the converter reads against the shape the metadata implies, and its type
    against what can be decoded, before anything is read or allocated: a header that lies
    (an expert_count of 2^31 - 1) is an error naming the file, not a 24 GB allocation.
    Returns the names of those tensors.
    `per_layer`: the family's own tensors (blk.{i}.NAME.weight -> shape), or a function of
    the layer giving {NAME.weight or NAME.bias: shape}. `attention`: every layer has
    Llama-style attention and attn_norm/ffn_norm tensors (checked here)."""
    L, D, V = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (V, D), "output_norm.weight": (D,)}
    if "output.weight" in g.tensors:
        shapes["output.weight"] = (V, D)
    for i in range(L):
        if attention:
            for name, shape in _attention_shapes(g, cfg, i).items():
                shapes[f"blk.{i}.{name}"] = shape
            for name in ("attn_norm", "ffn_norm"):
                shapes[f"blk.{i}.{name}.weight"] = (D,)
        if callable(per_layer):
            for name, shape in per_layer(i).items():
                shapes[f"blk.{i}.{name}"] = shape
        else:
            for name, shape in per_layer.items():
                shapes[f"blk.{i}.{name}.weight"] = shape
    for name, shape in shapes.items():
        t = g.tensor(name, shape)
        if qtype_name(t) not in FLOAT_TYPES and not _dequantizable(t):
            raise StoreError(f"{g.path}: tensor {name}: type {qtype_name(t)} is not supported")
    return set(shapes)


def _dequantizable(t) -> bool:
    import gguf.quants

    traits = getattr(gguf.quants, "_type_traits", None)  # gguf-py's dequantizers, by type
    return traits is None or t.tensor_type in traits or qtype_name(t) in gguf_record_types()


def _rope_inv_freq(cfg: dict[str, Any]) -> np.ndarray:
    d = cfg["head_dim"]
    inv = 1.0 / cfg["rope_theta"] ** (np.arange(0, d, 2, dtype=np.float64) / d)
    if cfg.get("rope_freq_factors"):
        inv = inv / np.asarray(cfg["rope_freq_factors"], dtype=np.float64)
    if (cfg.get("rope_scaling") or {}).get("rope_type") == "linear":
        inv = inv / cfg["rope_scaling"]["factor"]
    return inv


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def mlp_inputs(g: _Gguf, cfg: dict[str, Any], ids: list[int]):
    """Yield (layer, x [T, D], hidden [T, I], down [D, I]) of the dense model on `ids`: the MLP
    input, its SwiGLU activations and its down projection, float32, computed in numpy.

    A float32 reference forward of the GGUF's own (dequantized) weights: the routers are
    fitted on the activations the model really sees, and numpy's matmul is several times
    faster than MLX's CPU one, which keeps first-run conversion short.
    """
    L, H, KV = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, eps, T = cfg["head_dim"], cfg["rms_norm_eps"], len(ids)

    def deq(name, rows=None):
        t = g.tensor(name)
        data = raw_rows(t)
        return dequantize_rows(data if rows is None else data[rows], t)

    h = deq("token_embd.weight", np.asarray(ids))
    ang = np.arange(T)[:, None] * _rope_inv_freq(cfg)[None]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)

    def rope(x):  # [n, T, hd], transformers' rotate_half
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    causal = np.triu(np.full((T, T), -np.inf, dtype=np.float32), 1)
    for i in range(L):
        x = _rms(h, deq(f"blk.{i}.attn_norm.weight"), eps)
        proj = {}
        for gname, nh in (("attn_q", H), ("attn_k", KV), ("attn_v", None)):
            t = g.tensor(f"blk.{i}.{gname}.weight")
            w = dequantize_rows(raw_rows(t), t)
            if nh is not None:
                w = unpermute_rows(w, nh)
            y = x @ w.T
            if f"blk.{i}.{gname}.bias" in g.tensors:
                b = deq(f"blk.{i}.{gname}.bias").reshape(-1)
                y = y + (unpermute_rows(b, nh) if nh is not None else b)
            proj[gname] = y.reshape(T, -1, hd).transpose(1, 0, 2)
        q, k, v = rope(proj["attn_q"]), rope(proj["attn_k"]), proj["attn_v"]
        k, v = np.repeat(k, H // KV, axis=0), np.repeat(v, H // KV, axis=0)
        s = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + causal
        s = np.exp(s - s.max(-1, keepdims=True))
        o = (s / s.sum(-1, keepdims=True)) @ v  # [H, T, hd]
        h = h + o.transpose(1, 0, 2).reshape(T, -1) @ deq(f"blk.{i}.attn_output.weight").T
        x = _rms(h, deq(f"blk.{i}.ffn_norm.weight"), eps)
        gate = x @ deq(f"blk.{i}.ffn_gate.weight").T
        hid = gate / (1 + np.exp(-gate)) * (x @ deq(f"blk.{i}.ffn_up.weight").T)
        down = deq(f"blk.{i}.ffn_down.weight")
        yield i, x, hid, down
        h = h + hid @ down.T


def calibration_ids(tok, tokens: int, source: str | Path = "tokenizer") -> list[int]:
    ids = tok.encode(CALIBRATION_TEXT + "\n\n" + ROUTER_TEXT)
    if not ids:
        raise StoreError(f"{source}: the tokenizer encodes the calibration text as no tokens")
    while len(ids) < tokens:
        ids = ids + ids
    return ids[: max(tokens, len(ids) if tokens <= len(ids) else tokens)]


def fit_routers(
    dense: DenseWriter, g: _Gguf, cfg: dict[str, Any], ids: list[int], n: int, ridge: float = 1e-2
) -> None:
    """Least-squares routers: logits_e = w_e . x + b_e fitted to ||expert e's output||."""
    E = cfg["num_experts"]
    for layer, x, hid, down in mlp_inputs(g, cfg, ids):
        X = x.astype(np.float64)
        norms = np.stack(
            [
                np.linalg.norm(
                    hid[:, e * n : (e + 1) * n] @ down[:, e * n : (e + 1) * n].T, axis=-1
                )
                for e in range(E)
            ],
            axis=-1,
        )  # [T, E]
        A = np.concatenate([X, np.ones((X.shape[0], 1))], axis=1)
        gram = A.T @ A
        reg = ridge * np.trace(gram) / A.shape[1] * np.eye(A.shape[1])
        reg[-1, -1] = 0.0  # the bias is not shrunk
        W = np.linalg.solve(gram + reg, A.T @ norms.astype(np.float64))  # [D + 1, E]
        dense.add_array(f"model.layers.{layer}.mlp.gate.weight", W[:-1].T)
        dense.add_array(f"model.layers.{layer}.mlp.gate.bias", W[-1])


# ---- MoE architectures: experts keep their ggml blocks ------------------------------------
#
# qwen3moe, qwen3next, olmoe and Mixtral (architecture "llama" with ffn_*_exps tensors): each
# expert's gate/up/down rows are cut out of the stacked [E, rows, row_bytes] tensors as they
# are (no requantization), with each layer's own ggml types (a Q4_K_M file's down projection
# is Q6_K in some layers and Q4_K in others): per-layer record layouts, padded to one record
# size. llama.cpp's `--fuse-gate-up-exps` writes gate and up as one ffn_gate_up_exps tensor
# [E, 2 * I, D], gate rows first: whole rows, so its blocks are kept too. Routers stay float;
# dense tensors as above (Q4_0/Q4_1/Q8_0 repacked, others dequantized).

MOE_ARCHITECTURES = (
    "qwen3moe",
    "qwen3next",
    "olmoe",
    "glm4moe",
    "deepseek2 (sigmoid routing: DeepSeek-V3, Kimi K2)",
    "gpt-oss",
    "llama with ffn_*_exps (Mixtral)",
)


def _has_experts(g: _Gguf) -> bool:
    """Whether the file is a MoE model, by its tensors (any blk.N.ffn_*_exps) or its
    metadata ({arch}.expert_count > 0): a Mixtral GGUF is architecture "llama"."""
    if any(n.endswith("_exps.weight") for n in g.tensors):
        return True
    n = g.get(f"{g.arch}.expert_count", 0)
    return isinstance(n, int) and not isinstance(n, bool) and n > 0


def _moe_sizes(g: _Gguf) -> dict[str, int]:
    """What every MoE architecture's metadata says the same way."""
    a = g.arch
    heads = g.int(f"{a}.attention.head_count")
    if isinstance(g.get(f"{a}.attention.head_count_kv"), list):
        raise StoreError(f"{g.path}: per-layer head counts are not supported")
    dim = g.int(f"{a}.embedding_length")
    E = g.int(f"{a}.expert_count")
    if f"{a}.expert_feed_forward_length" in g.reader.fields:
        inter = g.int(f"{a}.expert_feed_forward_length")
    else:
        inter = g.int(f"{a}.feed_forward_length")
    kv = g.int(f"{a}.attention.head_count_kv", heads)
    head_dim = g.int(f"{a}.attention.key_length", max(dim // heads, 1))
    _check_heads(g, heads, kv, head_dim)
    top_k = g.int(f"{a}.expert_used_count")
    if top_k > E:
        g.fail(f"{a}.expert_used_count", f"{top_k} is more than expert_count {E}")
    emb = g.tensor("token_embd.weight")
    return {
        "hidden_size": dim,
        "num_hidden_layers": g.int(f"{a}.block_count", hi=MAX_LAYERS),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "num_experts": E,
        "num_experts_per_tok": top_k,
        "expert_size": inter,
        "vocab_size": g.int(f"{a}.vocab_size", int(emb.shape[1])),
    }


def _rope_scaling(g: _Gguf) -> dict[str, Any] | None:
    scaling = g.str(f"{g.arch}.rope.scaling.type")
    if scaling in (None, "none"):
        return None
    if scaling == "linear":
        return {"rope_type": "linear", "factor": g.float(f"{g.arch}.rope.scaling.factor")}
    raise StoreError(f"{g.path}: rope scaling {scaling!r} is not supported")


def _expert_rows(g: _Gguf, layer: int, proj: str, inter: int, e: int):
    """(tensor, raw rows) of expert e's `proj` in layer `layer`: a slice of its ffn_*_exps
    tensor, or a half of the fused ffn_gate_up_exps, or (GGUFs from before llama.cpp stacked
    experts, early 2024 Mixtral files) its own blk.N.ffn_*.E.weight tensor."""
    legacy = f"blk.{layer}.{GGUF_PROJ[proj]}.{e}.weight"
    if legacy in g.tensors:
        t = g.tensor(legacy)
        return t, raw_rows(t)
    fused = f"blk.{layer}.ffn_gate_up_exps.weight"
    if proj != "down_proj" and fused in g.tensors:
        rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
        t = g.tensor(fused)
        return t, raw_rows(t)[e][rows]
    t = g.tensor(f"blk.{layer}.{GGUF_PROJ[proj]}_exps.weight")
    return t, raw_rows(t)[e]


def _expert_shapes(g: _Gguf, layer: int, E: int, inter: int, dim: int) -> dict[str, tuple]:
    """Layer `layer`'s expert tensors (name without blk.N. and .weight -> shape)."""
    if f"blk.{layer}.ffn_gate.0.weight" in g.tensors:  # one tensor per expert
        shapes = {}
        for e in range(E):
            shapes[f"ffn_gate.{e}"] = (inter, dim)
            shapes[f"ffn_up.{e}"] = (inter, dim)
            shapes[f"ffn_down.{e}"] = (dim, inter)
        return {**shapes, "ffn_gate_inp": (E, dim)}
    if f"blk.{layer}.ffn_gate_up_exps.weight" in g.tensors:
        shapes = {"ffn_gate_up_exps": (E, 2 * inter, dim)}
    else:
        shapes = {"ffn_gate_exps": (E, inter, dim), "ffn_up_exps": (E, inter, dim)}
    return {**shapes, "ffn_down_exps": (E, dim, inter), "ffn_gate_inp": (E, dim)}


def _attention_shapes(g: _Gguf, cfg: dict[str, Any], i: int, q_rows: int | None = None) -> dict:
    """A Llama-style attention block's tensors (q/k/v/output, biases where present)."""
    D, H, KV, hd = (
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
    )
    shapes: dict[str, tuple] = {}
    rows = {"attn_q": q_rows or H * hd, "attn_k": KV * hd, "attn_v": KV * hd}
    for name, r in rows.items():
        shapes[f"{name}.weight"] = (r, D)
        if f"blk.{i}.{name}.bias" in g.tensors:
            shapes[f"{name}.bias"] = (r,)
    shapes["attn_output.weight"] = (D, H * hd)
    return shapes


def _projection_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Each projection's [out, in] in one expert of a MoE GGUF's store."""
    dim = cfg["hidden_size"]
    inter = cfg.get("moe_intermediate_size", cfg.get("intermediate_size"))
    return {"gate_proj": (inter, dim), "up_proj": (inter, dim), "down_proj": (dim, inter)}


def _moe_config(g: _Gguf, cfg: dict[str, Any], moe_layers: list[int], read: set[str]) -> GgufConfig:
    """A MoE GGUF's store: the experts of `moe_layers` keep their ggml blocks, one format per
    projection and layer (per-layer layouts where types differ, padded to one record size).
    Expert biases (blk.N.ffn_*_exps.bias [E, out], GPT-OSS's) become each record's
    `{proj}.bias` in the model's dtype. `read`: every tensor the converter reads."""
    E, dtype = cfg["num_experts"], cfg["torch_dtype"]
    shapes = _projection_shapes(cfg)
    inter = shapes["gate_proj"][0]
    activation = None
    if cfg["model_type"] == "gpt_oss":
        activation = {
            "name": "swiglu_oai",
            "alpha": cfg["swiglu_alpha"],
            "limit": cfg["swiglu_limit"],
        }
    layer_specs, layouts, experts = {}, [], set()
    for i in moe_layers:
        specs, parts = {}, {}
        for p in PROJECTIONS:
            # One type per projection and layer (per-expert tensors of mixed types: float).
            ts = [_expert_rows(g, i, p, inter, e)[0] for e in range(E)]
            experts |= {t.name for t in ts}
            specs[p] = choose_format({qtype_name(t) for t in ts}, True, dtype)
            if specs[p]["format"] == "gguf":
                specs[p]["in_features"] = shapes[p][1]
            parts[p] = projection_shapes(specs[p], ts[0], *shapes[p])
            bias = f"blk.{i}.{GGUF_PROJ[p]}_exps.bias"
            if bias in g.tensors:
                experts.add(bias)
                parts[p] = {"bias": (dtype, (shapes[p][0],)), **parts[p]}
        layer_specs[i] = specs
        layouts.append(build_layout(parts, specs, activation))
    record_bytes = max(lay.record_bytes for lay in layouts)
    layouts = [lay.padded(record_bytes) for lay in layouts]
    return GgufConfig(cfg, moe_layers, layer_specs, layouts, experts, read - experts)


def _convert_moe(
    g: _Gguf,
    c: GgufConfig,
    out: Path,
    dense: DenseWriter,
    calibration_tokens: int,
    progress: bool,
) -> Path:
    """Write the store `c` of a MoE GGUF whose dense weights are already in `dense`."""
    from .common import calibrate

    cfg, E, dtype = c.config, c.num_experts, c.dtype
    moe_layers, layer_specs = c.moe_layers, c.layer_specs
    shapes = _projection_shapes(cfg)
    inter = shapes["gate_proj"][0]

    def expert_parts(layer: int, e: int) -> dict[str, dict[str, tuple]]:
        parts = {}
        for p in PROJECTIONS:
            t, data = _expert_rows(g, layer, p, inter, e)
            parts[p] = projection_tensors(layer_specs[layer][p], data, t, *shapes[p])
            bias = f"blk.{layer}.{GGUF_PROJ[p]}_exps.bias"
            if bias in g.tensors:
                tb = g.tensor(bias)
                b = dequantize_rows(raw_rows(tb)[e], tb).reshape(-1)
                parts[p] = {"bias": (dtype, _to_dtype(b, dtype)), **parts[p]}
        return parts

    qcfg = dense.quantization_config()
    if qcfg:
        cfg["quantization"] = qcfg

    writer = StoreWriter(out, c.model_type, cfg, c.layouts[0], moe_layers, E, c.layer_layouts)
    with writer:
        writer.manifest.extra = {
            "source": {"gguf": g.path.name, "architecture": g.arch},
            "formats": [
                {p: s.get("_src", s["format"]) for p, s in layer_specs[i].items()}
                for i in moe_layers
            ],
        }
        writer.write_dense(dense.weights)
        build_tokenizer(g, writer.path, cfg["vocab_size"])
        _write_experts(writer, moe_layers, E, expert_parts, progress)
        calibrate(writer, calibration_tokens)
        return writer.commit()


def _add_attention(
    dense: DenseWriter, g: _Gguf, i: int, pre: str, unpermute: tuple[int, int] | None = None
) -> None:
    """blk.i.attn_{q,k,v,output} (and biases) -> {pre}.self_attn.{q,k,v,o}_proj; with
    `unpermute` = (heads, kv heads), q/k rows are un-permuted (llama.cpp's llama rotary)."""
    heads, kv = unpermute or (None, None)
    for gname, hname, nh in (
        ("attn_q", "q_proj", heads),
        ("attn_k", "k_proj", kv),
        ("attn_v", "v_proj", None),
        ("attn_output", "o_proj", None),
    ):
        t = g.tensor(f"blk.{i}.{gname}.weight")
        data = raw_rows(t)
        dense.add(f"{pre}.self_attn.{hname}", t, unpermute_rows(data, nh) if nh else data)
        if f"blk.{i}.{gname}.bias" in g.tensors:
            tb = g.tensor(f"blk.{i}.{gname}.bias")
            b = dequantize_rows(raw_rows(tb), tb).reshape(-1)
            dense.add_array(f"{pre}.self_attn.{hname}.bias", unpermute_rows(b, nh) if nh else b)


def _add_embeddings(dense: DenseWriter, g: _Gguf, cfg: dict[str, Any]) -> None:
    dense.add("model.embed_tokens", g.tensor("token_embd.weight"))
    if not cfg["tie_word_embeddings"]:
        dense.add("lm_head", g.tensor("output.weight"))
    _add_norm(dense, g, "output_norm.weight", "model.norm.weight")


def _qwen3moe_config(g: _Gguf) -> tuple[dict[str, Any], list[int], set[str]]:
    a, s = g.arch, _moe_sizes(g)
    dtype = _model_dtype(g.path)
    L, E, inter, dim = s["num_hidden_layers"], s["num_experts"], s["expert_size"], s["hidden_size"]
    cfg: dict[str, Any] = {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        **{k: v for k, v in s.items() if k != "expert_size"},
        "intermediate_size": g.int(f"{a}.feed_forward_length", inter),
        "moe_intermediate_size": inter,
        "norm_topk_prob": True,  # llama.cpp's qwen3moe graph always renormalizes the top-k
        "rms_norm_eps": g.float(f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": g.float(f"{a}.rope.freq_base", 1e6),
        "max_position_embeddings": g.int(f"{a}.context_length", 32768, hi=1 << 31),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "torch_dtype": dtype,
    }
    hd = s["head_dim"]

    def per_layer(i: int) -> dict:
        return {
            **{f"{n}.weight": sh for n, sh in _expert_shapes(g, i, E, inter, dim).items()},
            "attn_q_norm.weight": (hd,),
            "attn_k_norm.weight": (hd,),
        }

    return cfg, list(range(L)), _check_shapes(g, cfg, per_layer)


def _convert_qk_norm_moe(
    g: _Gguf, c: GgufConfig, out: Path, calibration_tokens: int, progress: bool
) -> Path:
    """qwen3moe and olmoe: the same tensors (q/k norms per head in qwen3moe, over the whole
    projection in olmoe: their shapes are the config's, checked by _check_shapes)."""
    cfg, L = c.config, c.config["num_hidden_layers"]
    dense = DenseWriter(c.dtype)
    _add_embeddings(dense, g, cfg)
    for i in range(L):
        pre = f"model.layers.{i}"
        _add_layer_norms(dense, g, i, "ffn_norm")
        _add_norm(dense, g, f"blk.{i}.attn_q_norm.weight", f"{pre}.self_attn.q_norm.weight")
        _add_norm(dense, g, f"blk.{i}.attn_k_norm.weight", f"{pre}.self_attn.k_norm.weight")
        # NeoX-rotary architectures in llama.cpp: q/k rows are not permuted.
        _add_attention(dense, g, i, pre)
        dense.add(f"{pre}.mlp.gate", g.tensor(f"blk.{i}.ffn_gate_inp.weight"), quantize=False)
    return _convert_moe(g, c, out, dense, calibration_tokens, progress)


def _olmoe_config(g: _Gguf) -> tuple[dict[str, Any], list[int], set[str]]:
    """OLMoE: norms over the whole q and k projections; softmax top-k without renormalizing
    (llama.cpp's olmoe graph has no switch for it). Note llama.cpp's converter writes the
    norm epsilon as 1e-5 whatever the checkpoint's config says (OLMoE's own is 1e-5)."""
    a, s = g.arch, _moe_sizes(g)
    dtype = _model_dtype(g.path)
    L, E, inter, dim = s["num_hidden_layers"], s["num_experts"], s["expert_size"], s["hidden_size"]
    rope_dim = g.int(f"{a}.rope.dimension_count", s["head_dim"])
    if rope_dim != s["head_dim"]:
        raise StoreError(f"{g.path}: partial rotary ({rope_dim} of {s['head_dim']}) in olmoe")
    cfg: dict[str, Any] = {
        "model_type": "olmoe",
        "architectures": ["OlmoeForCausalLM"],
        **{k: v for k, v in s.items() if k != "expert_size"},
        "intermediate_size": inter,
        "norm_topk_prob": False,
        "rms_norm_eps": g.float(f"{a}.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": g.float(f"{a}.rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(g),
        "max_position_embeddings": g.int(f"{a}.context_length", 4096, hi=1 << 31),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "attention_bias": "blk.0.attn_q.bias" in g.tensors,
        "torch_dtype": dtype,
    }
    if f"{a}.attention.clamp_kqv" in g.reader.fields:
        cfg["clip_qkv"] = g.float(f"{a}.attention.clamp_kqv")
    H, KV, hd = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]

    def per_layer(i: int) -> dict:
        return {
            **{f"{n}.weight": sh for n, sh in _expert_shapes(g, i, E, inter, dim).items()},
            "attn_q_norm.weight": (H * hd,),
            "attn_k_norm.weight": (KV * hd,),
        }

    return cfg, list(range(L)), _check_shapes(g, cfg, per_layer)


def _mixtral_config(g: _Gguf) -> tuple[dict[str, Any], list[int], set[str]]:
    """Mixtral, which llama.cpp writes as architecture "llama" with expert tensors: q/k rows
    un-permuted as for dense llama; top-k then softmax over the k (llama.cpp's softmax over
    all experts renormalized over the top-k: the same weights)."""
    a, s = g.arch, _moe_sizes(g)
    dtype = _model_dtype(g.path)
    L, E, inter, dim = s["num_hidden_layers"], s["num_experts"], s["expert_size"], s["hidden_size"]
    rope_dim = g.int(f"{a}.rope.dimension_count", s["head_dim"])
    if rope_dim != s["head_dim"]:
        raise StoreError(f"{g.path}: partial rotary ({rope_dim} of {s['head_dim']}) in mixtral")
    if "rope_freqs.weight" in g.tensors:
        raise StoreError(f"{g.path}: rope_freqs.weight (llama3 rope) in a MoE llama GGUF")
    cfg: dict[str, Any] = {
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        **{k: v for k, v in s.items() if k not in ("expert_size", "num_experts")},
        "num_local_experts": E,
        "num_experts": E,
        "intermediate_size": inter,
        "rms_norm_eps": g.float(f"{a}.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": g.float(f"{a}.rope.freq_base", 1e6),
        "rope_scaling": _rope_scaling(g),
        "max_position_embeddings": g.int(f"{a}.context_length", 32768, hi=1 << 31),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "torch_dtype": dtype,
    }
    if "blk.0.attn_q.bias" in g.tensors:
        raise StoreError(f"{g.path}: attention biases in a MoE llama GGUF (Mixtral has none)")

    def per_layer(i: int) -> dict:
        return {
            **{f"{n}.weight": sh for n, sh in _expert_shapes(g, i, E, inter, dim).items()},
        }

    return cfg, list(range(L)), _check_shapes(g, cfg, per_layer)


def _convert_mixtral(
    g: _Gguf, c: GgufConfig, out: Path, calibration_tokens: int, progress: bool
) -> Path:
    cfg, L = c.config, c.config["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dense = DenseWriter(c.dtype)
    _add_embeddings(dense, g, cfg)
    for i in range(L):
        pre = f"model.layers.{i}"
        _add_layer_norms(dense, g, i, "ffn_norm")
        _add_attention(dense, g, i, pre, unpermute=(heads, kv))
        t = g.tensor(f"blk.{i}.ffn_gate_inp.weight")
        dense.add(f"{pre}.block_sparse_moe.gate", t, quantize=False)
    return _convert_moe(g, c, out, dense, calibration_tokens, progress)


def _qwen3next_config(g: _Gguf) -> tuple[dict[str, Any], list[int], set[str]]:
    """Qwen3-Next, as llama.cpp's converter (convert_hf_to_gguf.py, Qwen3NextModel) writes it,
    each of its changes undone:
      in_proj_qkvz, grouped per key head [q k v z], is split into attn_qkv [all q | all k |
        all v] and attn_gate [all z]: rows are put back (whole rows: blocks survive);
      A_log is written as ssm_a = -exp(A_log): A_log = log(-ssm_a) (float64, ~1 ulp);
      conv1d [C, 1, K] is squeezed to [C, K]: back to [C, K, 1] (our sanitized layout);
      the (1 + w) norms get their 1 added, as our sanitize() does, so they are kept as they are
        (the gated delta-net's own ssm_norm, a plain weight, has none).
    Layer kinds come from {arch}.attention.recurrent_layers when present (transformers 5
    checkpoints give only layer_types, and then the written full_attention_interval is the
    default 4), else from full_attention_interval. The multi-token-prediction layers that
    the converter appends (without --no-mtp) are left out. Layers without expert tensors
    keep a dense MLP (ffn_gate/up/down)."""
    a, s = g.arch, _moe_sizes(g)
    dtype = _model_dtype(g.path)
    L, E, inter, dim = s["num_hidden_layers"], s["num_experts"], s["expert_size"], s["hidden_size"]
    H, hd = s["num_attention_heads"], s["head_dim"]
    nextn = g.int(f"{a}.nextn_predict_layers", 0, lo=0, hi=L - 1)
    L -= nextn
    n_k = g.int(f"{a}.ssm.group_count")
    n_v = g.int(f"{a}.ssm.time_step_rank")
    d_k = g.int(f"{a}.ssm.state_size")
    inner = g.int(f"{a}.ssm.inner_size")
    if inner % n_v or n_v % n_k:
        raise StoreError(
            f"{g.path}: ssm.inner_size {inner} over {n_v} value heads in {n_k} key groups "
            "is not a Qwen3-Next shape"
        )
    d_v, kernel = inner // n_v, g.int(f"{a}.ssm.conv_kernel")
    rope_dim = g.int(f"{a}.rope.dimension_count", hd)
    if rope_dim > hd or int(hd * (rope_dim / hd)) != rope_dim:
        raise StoreError(f"{g.path}: rope.dimension_count {rope_dim} of head size {hd}")
    recurrent = g.get(f"{a}.attention.recurrent_layers")
    if recurrent is not None:
        if not isinstance(recurrent, list) or len(recurrent) < L:
            g.fail(f"{a}.attention.recurrent_layers", f"expected {L} true/false values")
        linear = [bool(x) for x in recurrent[:L]]
    else:
        interval = g.int(f"{a}.full_attention_interval", 4)
        linear = [(i + 1) % interval != 0 for i in range(L)]
    moe_layers = [i for i in range(L) if _has_layer_experts(g, i)]
    cfg: dict[str, Any] = {
        "model_type": "qwen3_next",
        "architectures": ["Qwen3NextForCausalLM"],
        **{k: v for k, v in s.items() if k != "expert_size"},
        "num_hidden_layers": L,
        "intermediate_size": g.int(f"{a}.feed_forward_length", inter),
        "moe_intermediate_size": inter,
        "shared_expert_intermediate_size": g.int(f"{a}.expert_shared_feed_forward_length"),
        "linear_num_value_heads": n_v,
        "linear_num_key_heads": n_k,
        "linear_key_head_dim": d_k,
        "linear_value_head_dim": d_v,
        "linear_conv_kernel_dim": kernel,
        "layer_types": ["linear_attention" if x else "full_attention" for x in linear],
        "norm_topk_prob": True,  # llama.cpp's qwen3next graph always renormalizes the top-k
        "rms_norm_eps": g.float(f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": g.float(f"{a}.rope.freq_base", 10000.0),
        "partial_rotary_factor": rope_dim / hd,
        "rope_scaling": _rope_scaling(g),
        "max_position_embeddings": g.int(f"{a}.context_length", 32768, hi=1 << 31),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(L) if i not in moe_layers],
        "attention_bias": False,
        "torch_dtype": dtype,
    }
    key_dim, value_dim = n_k * d_k, n_v * d_v
    conv_dim = 2 * key_dim + value_dim
    shexp = cfg["shared_expert_intermediate_size"]
    dense_ffn = cfg["intermediate_size"]

    def per_layer(i: int) -> dict:
        shapes: dict[str, tuple] = {
            "attn_norm.weight": (dim,),
            "post_attention_norm.weight": (dim,),
        }
        if linear[i]:
            shapes.update(
                {
                    "attn_qkv.weight": (conv_dim, dim),
                    "attn_gate.weight": (value_dim, dim),
                    "ssm_ba.weight": (2 * n_v, dim),
                    "ssm_conv1d.weight": (conv_dim, kernel),
                    "ssm_a": (n_v,),
                    "ssm_dt.bias": (n_v,),
                    "ssm_norm.weight": (d_v,),
                    "ssm_out.weight": (dim, value_dim),
                }
            )
        else:
            shapes.update(_attention_shapes(g, cfg, i, q_rows=2 * H * hd))
            shapes.update({"attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,)})
        if i in moe_layers:
            shapes.update(
                {f"{n}.weight": sh for n, sh in _expert_shapes(g, i, E, inter, dim).items()}
            )
            shapes.update(
                {
                    "ffn_gate_shexp.weight": (shexp, dim),
                    "ffn_up_shexp.weight": (shexp, dim),
                    "ffn_down_shexp.weight": (dim, shexp),
                    "ffn_gate_inp_shexp.weight": (1, dim),
                }
            )
        else:
            shapes.update(
                {
                    "ffn_gate.weight": (dense_ffn, dim),
                    "ffn_up.weight": (dense_ffn, dim),
                    "ffn_down.weight": (dim, dense_ffn),
                }
            )
        return shapes

    if not moe_layers:
        raise StoreError(f"{g.path}: no layer has expert tensors (blk.N.ffn_gate_exps.weight)")
    return cfg, moe_layers, _check_shapes(g, cfg, per_layer, attention=False)


def _convert_qwen3next(
    g: _Gguf, c: GgufConfig, out: Path, calibration_tokens: int, progress: bool
) -> Path:
    cfg, moe_layers = c.config, c.moe_layers
    L = cfg["num_hidden_layers"]
    n_k, n_v = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    d_k, d_v = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    kernel = cfg["linear_conv_kernel_dim"]
    linear = [t == "linear_attention" for t in cfg["layer_types"]]
    key_dim, value_dim = n_k * d_k, n_v * d_v
    conv_dim = 2 * key_dim + value_dim
    dense = DenseWriter(c.dtype)
    _add_embeddings(dense, g, cfg)
    # in_proj_qkvz rows, group by key head: [q_g | k_g | v_g | z_g] out of [q | k | v] and z.
    r = n_v // n_k
    order = np.concatenate(
        [
            np.concatenate(
                [
                    np.arange(j * d_k, (j + 1) * d_k),
                    key_dim + np.arange(j * d_k, (j + 1) * d_k),
                    2 * key_dim + np.arange(j * r * d_v, (j + 1) * r * d_v),
                    conv_dim + np.arange(j * r * d_v, (j + 1) * r * d_v),
                ]
            )
            for j in range(n_k)
        ]
    )
    for i in range(L):
        pre = f"model.layers.{i}"
        _add_layer_norms(dense, g, i, "post_attention_norm")
        if linear[i]:
            la = f"{pre}.linear_attn"
            qkv, z = g.tensor(f"blk.{i}.attn_qkv.weight"), g.tensor(f"blk.{i}.attn_gate.weight")
            if qtype_name(qkv) == qtype_name(z):
                rows = np.concatenate([raw_rows(qkv), raw_rows(z)])[order]
                dense.add(f"{la}.in_proj_qkvz", qkv, rows)
            else:
                w = np.concatenate(
                    [dequantize_rows(raw_rows(qkv), qkv), dequantize_rows(raw_rows(z), z)]
                )
                dense.add_array(f"{la}.in_proj_qkvz.weight", w[order])
            dense.add(f"{la}.in_proj_ba", g.tensor(f"blk.{i}.ssm_ba.weight"))
            dense.add(f"{la}.out_proj", g.tensor(f"blk.{i}.ssm_out.weight"))
            t = g.tensor(f"blk.{i}.ssm_conv1d.weight")
            conv = dequantize_rows(raw_rows(t), t).reshape(conv_dim, kernel, 1)
            dense.add_array(f"{la}.conv1d.weight", conv)
            t = g.tensor(f"blk.{i}.ssm_a")
            A = dequantize_rows(raw_rows(t), t).reshape(-1).astype(np.float64)
            if not (np.isfinite(A) & (A < 0)).all():
                raise StoreError(f"{g.path}: tensor blk.{i}.ssm_a holds values that are not < 0")
            dense.add_array(f"{la}.A_log", np.log(-A))
            _add_norm(dense, g, f"blk.{i}.ssm_dt.bias", f"{la}.dt_bias")
            _add_norm(dense, g, f"blk.{i}.ssm_norm.weight", f"{la}.norm.weight")
        else:
            _add_norm(dense, g, f"blk.{i}.attn_q_norm.weight", f"{pre}.self_attn.q_norm.weight")
            _add_norm(dense, g, f"blk.{i}.attn_k_norm.weight", f"{pre}.self_attn.k_norm.weight")
            _add_attention(dense, g, i, pre)  # NeoX rotary: rows not permuted
        if i in moe_layers:
            mlp = f"{pre}.mlp"
            dense.add(f"{mlp}.gate", g.tensor(f"blk.{i}.ffn_gate_inp.weight"), quantize=False)
            for p, gp in GGUF_PROJ.items():
                dense.add(f"{mlp}.shared_expert.{p}", g.tensor(f"blk.{i}.{gp}_shexp.weight"))
            t = g.tensor(f"blk.{i}.ffn_gate_inp_shexp.weight")
            gate = raw_rows(t).reshape(1, -1)  # [D] in llama-quantize's files (one row)
            dense.add(f"{mlp}.shared_expert_gate", t, gate, quantize=False)
        else:
            for p, gp in GGUF_PROJ.items():
                dense.add(f"{pre}.mlp.{p}", g.tensor(f"blk.{i}.{gp}.weight"))
    return _convert_moe(g, c, out, dense, calibration_tokens, progress)


# ---- sigmoid-routed families: glm4moe (GLM-4.5), deepseek2 (DeepSeek-V3, Kimi K2) -----------

SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def _sigmoid_routing(g: _Gguf, L: int) -> dict[str, Any]:
    """The router settings llama.cpp's converter writes for GLM-4.5 and DeepSeek-V3 (sigmoid
    scores, correction bias exp_probs_b, group-limited top-k, scale, renormalization)."""
    a = g.arch
    func = g.int(f"{a}.expert_gating_func", 0, lo=0, hi=8)
    if func != SIGMOID:
        g.fail(
            f"{a}.expert_gating_func",
            f"{func or 'missing'}; only sigmoid routing ({SIGMOID}, DeepSeek-V3 and GLM-4.5's) "
            "is supported (llama.cpp's converter writes it from the config's scoring_func)",
        )
    E = g.int(f"{a}.expert_count")
    n_group = g.int(f"{a}.expert_group_count", 1, hi=E)
    return {
        "n_routed_experts": E,
        "n_group": n_group,
        "topk_group": g.int(f"{a}.expert_group_used_count", 1, hi=n_group),
        "routed_scaling_factor": g.float(f"{a}.expert_weights_scale", 1.0),
        "norm_topk_prob": _bool(g, f"{a}.expert_weights_norm", False),
        "n_shared_experts": g.int(f"{a}.expert_shared_count", 0, lo=0, hi=E),
        "first_k_dense_replace": g.int(f"{a}.leading_dense_block_count", 0, lo=0, hi=L),
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
    }


def _sigmoid_moe_shapes(g: _Gguf, cfg: dict[str, Any], i: int) -> dict[str, tuple]:
    """Layer i's feed-forward tensors: a dense MLP before first_k_dense_replace, else experts,
    router, correction bias and shared experts."""
    dim, E = cfg["hidden_size"], cfg["n_routed_experts"]
    inter, ff = cfg["moe_intermediate_size"], cfg["intermediate_size"]
    if i < cfg["first_k_dense_replace"]:
        return {
            "ffn_gate.weight": (ff, dim),
            "ffn_up.weight": (ff, dim),
            "ffn_down.weight": (dim, ff),
        }
    shapes = {f"{n}.weight": sh for n, sh in _expert_shapes(g, i, E, inter, dim).items()}
    shapes["exp_probs_b.bias"] = (E,)
    if cfg["n_shared_experts"]:
        sh = inter * cfg["n_shared_experts"]
        shapes.update(
            {
                "ffn_gate_shexp.weight": (sh, dim),
                "ffn_up_shexp.weight": (sh, dim),
                "ffn_down_shexp.weight": (dim, sh),
            }
        )
    return shapes


def _add_sigmoid_moe(dense: DenseWriter, g: _Gguf, cfg: dict[str, Any], i: int, pre: str) -> None:
    """Layer i's dense MLP, or its router (a bare float weight), float32 correction bias
    (it picks experts by differences in the fourth digit) and shared experts."""
    mlp = f"{pre}.mlp"
    if i < cfg["first_k_dense_replace"]:
        for p, gp in GGUF_PROJ.items():
            dense.add(f"{mlp}.{p}", g.tensor(f"blk.{i}.{gp}.weight"))
        return
    dense.add(f"{mlp}.gate", g.tensor(f"blk.{i}.ffn_gate_inp.weight"), quantize=False)
    t = g.tensor(f"blk.{i}.exp_probs_b.bias")
    bias = dequantize_rows(raw_rows(t), t).reshape(-1)
    dense.weights[f"{mlp}.gate.e_score_correction_bias"] = mx.array(bias.astype(np.float32))
    if cfg["n_shared_experts"]:
        for p, gp in GGUF_PROJ.items():
            dense.add(f"{mlp}.shared_experts.{p}", g.tensor(f"blk.{i}.{gp}_shexp.weight"))


def _glm4moe_config(g: _Gguf) -> tuple[dict[str, Any], list[int], set[str]]:
    """GLM-4.5 / 4.6 (glm4moe): NeoX rotary over the first rope.dimension_count dims of each
    head (rows not permuted), biased q/k/v, q/k norms where present; the converter's
    multi-token-prediction layers (nextn_predict_layers, appended to block_count) left out."""
    a, s = g.arch, _moe_sizes(g)
    dtype = _model_dtype(g.path)
    L = s["num_hidden_layers"] - g.int(
        f"{a}.nextn_predict_layers", 0, lo=0, hi=s["num_hidden_layers"] - 1
    )
    hd = s["head_dim"]
    rope_dim = g.int(f"{a}.rope.dimension_count", hd // 2, hi=hd)
    cfg: dict[str, Any] = {
        "model_type": "glm4_moe",
        "architectures": ["Glm4MoeForCausalLM"],
        **{k: v for k, v in s.items() if k != "expert_size"},
        **_sigmoid_routing(g, L),
        "num_hidden_layers": L,
        "intermediate_size": g.int(f"{a}.feed_forward_length"),
        "moe_intermediate_size": s["expert_size"],
        "partial_rotary_factor": rope_dim / hd,
        "use_qk_norm": "blk.0.attn_q_norm.weight" in g.tensors,
        "attention_bias": "blk.0.attn_q.bias" in g.tensors,
        "rms_norm_eps": g.float(f"{a}.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": g.float(f"{a}.rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(g),
        "max_position_embeddings": g.int(f"{a}.context_length", 131072, hi=1 << 31),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "torch_dtype": dtype,
    }
    if int(hd * cfg["partial_rotary_factor"]) != rope_dim:
        g.fail(f"{a}.rope.dimension_count", f"{rope_dim} of head size {hd}")

    def per_layer(i: int) -> dict:
        shapes = {
            **_attention_shapes(g, cfg, i),
            "attn_norm.weight": (s["hidden_size"],),
            "post_attention_norm.weight": (s["hidden_size"],),
            **_sigmoid_moe_shapes(g, cfg, i),
        }
        if cfg["use_qk_norm"]:
            shapes.update({"attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,)})
        return shapes

    moe_layers = list(range(cfg["first_k_dense_replace"], L))
    return cfg, moe_layers, _check_shapes(g, cfg, per_layer, attention=False)


def _convert_glm4moe(
    g: _Gguf, c: GgufConfig, out: Path, calibration_tokens: int, progress: bool
) -> Path:
    cfg, L = c.config, c.config["num_hidden_layers"]
    dense = DenseWriter(c.dtype)
    _add_embeddings(dense, g, cfg)
    for i in range(L):
        pre = f"model.layers.{i}"
        _add_layer_norms(dense, g, i, "post_attention_norm")
        if cfg["use_qk_norm"]:
            _add_norm(dense, g, f"blk.{i}.attn_q_norm.weight", f"{pre}.self_attn.q_norm.weight")
            _add_norm(dense, g, f"blk.{i}.attn_k_norm.weight", f"{pre}.self_attn.k_norm.weight")
        _add_attention(dense, g, i, pre)  # NeoX rotary: rows not permuted
        _add_sigmoid_moe(dense, g, cfg, i, pre)
    return _convert_moe(g, c, out, dense, calibration_tokens, progress)


def _deepseek2_config(g: _Gguf) -> tuple[dict[str, Any], list[int], set[str]]:
    """DeepSeek-V3 / Kimi K2 (deepseek2 with sigmoid routing), as llama.cpp's converter writes
    them: multi-head latent attention written as one-KV-head MQA (head_count_kv 1, key_length
    kv_lora_rank + rope dims); kv_b_proj split into attn_k_b [heads, rank, nope] and attn_v_b
    [heads, v, rank], which are our embed_q and unembed_out as they are; interleaved rotary
    (llama.cpp's "norm" rope: rows not permuted). YaRN's mscale comes back from
    yarn_log_multiplier (0.1 x mscale_all_dim), applied as llama.cpp does: to the attention
    scale only (mscale = mscale_all_dim, as DeepSeek-V3's own config says)."""
    a, s = g.arch, _moe_sizes(g)
    dtype = _model_dtype(g.path)
    L, H, dim = s["num_hidden_layers"], s["num_attention_heads"], s["hidden_size"]
    rank = g.int(f"{a}.attention.kv_lora_rank")
    rope = g.int(f"{a}.rope.dimension_count")
    nope = g.int(f"{a}.attention.key_length_mla") - rope
    if nope < 1 or s["head_dim"] != rank + rope:
        g.fail(f"{a}.attention.key_length_mla", f"{nope + rope} with rope dims {rope}")
    v_dim = g.int(f"{a}.attention.value_length_mla")
    q_rank = (
        g.int(f"{a}.attention.q_lora_rank")
        if f"{a}.attention.q_lora_rank" in g.reader.fields
        else None
    )
    cfg: dict[str, Any] = {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        **{k: v for k, v in s.items() if k not in ("expert_size", "head_dim")},
        **_sigmoid_routing(g, L),
        "num_key_value_heads": H,
        "intermediate_size": g.int(f"{a}.feed_forward_length"),
        "moe_intermediate_size": s["expert_size"],
        "kv_lora_rank": rank,
        "q_lora_rank": q_rank,
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": nope,
        "v_head_dim": v_dim,
        "rope_interleave": True,
        "attention_bias": False,
        "rms_norm_eps": g.float(f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": g.float(f"{a}.rope.freq_base", 10000.0),
        "rope_scaling": _deepseek2_rope_scaling(g),
        "max_position_embeddings": g.int(f"{a}.context_length", 163840, hi=1 << 31),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "torch_dtype": dtype,
    }
    q_out = H * (nope + rope)

    def per_layer(i: int) -> dict:
        shapes: dict[str, tuple] = {
            "attn_norm.weight": (dim,),
            "ffn_norm.weight": (dim,),
            "attn_kv_a_mqa.weight": (rank + rope, dim),
            "attn_kv_a_norm.weight": (rank,),
            "attn_k_b.weight": (H, rank, nope),
            "attn_v_b.weight": (H, v_dim, rank),
            "attn_output.weight": (dim, H * v_dim),
            **_sigmoid_moe_shapes(g, cfg, i),
        }
        if q_rank is None:
            shapes["attn_q.weight"] = (q_out, dim)
        else:
            shapes.update(
                {
                    "attn_q_a.weight": (q_rank, dim),
                    "attn_q_a_norm.weight": (q_rank,),
                    "attn_q_b.weight": (q_out, q_rank),
                }
            )
        return shapes

    moe_layers = list(range(cfg["first_k_dense_replace"], L))
    return cfg, moe_layers, _check_shapes(g, cfg, per_layer, attention=False)


def _convert_deepseek2(
    g: _Gguf, c: GgufConfig, out: Path, calibration_tokens: int, progress: bool
) -> Path:
    cfg, L, q_rank = c.config, c.config["num_hidden_layers"], c.config["q_lora_rank"]
    dense = DenseWriter(c.dtype)
    _add_embeddings(dense, g, cfg)
    for i in range(L):
        pre, blk = f"model.layers.{i}", f"blk.{i}"
        at = f"{pre}.self_attn"
        _add_layer_norms(dense, g, i, "ffn_norm")
        if q_rank is None:
            dense.add(f"{at}.q_proj", g.tensor(f"{blk}.attn_q.weight"))
        else:
            dense.add(f"{at}.q_a_proj", g.tensor(f"{blk}.attn_q_a.weight"))
            _add_norm(dense, g, f"{blk}.attn_q_a_norm.weight", f"{at}.q_a_layernorm.weight")
            dense.add(f"{at}.q_b_proj", g.tensor(f"{blk}.attn_q_b.weight"))
        dense.add(f"{at}.kv_a_proj_with_mqa", g.tensor(f"{blk}.attn_kv_a_mqa.weight"))
        _add_norm(dense, g, f"{blk}.attn_kv_a_norm.weight", f"{at}.kv_a_layernorm.weight")
        for gname, name in (("attn_k_b", "embed_q"), ("attn_v_b", "unembed_out")):
            t = g.tensor(f"{blk}.{gname}.weight")
            dense.add_array(f"{at}.{name}.weight", dequantize_rows(raw_rows(t), t))
        dense.add(f"{at}.o_proj", g.tensor(f"{blk}.attn_output.weight"))
        _add_sigmoid_moe(dense, g, cfg, i, pre)
    return _convert_moe(g, c, out, dense, calibration_tokens, progress)


def _deepseek2_rope_scaling(g: _Gguf) -> dict[str, Any] | None:
    a = g.arch
    if g.str(f"{a}.rope.scaling.type") != "yarn":
        return _rope_scaling(g)
    key = f"{a}.rope.scaling.yarn_log_multiplier"
    if key not in g.reader.fields:
        g.fail(key, "missing (yarn rotary without it is not DeepSeek-V3's)")
    m = g.float(key) / 0.1
    return {
        "rope_type": "yarn",
        "factor": g.float(f"{a}.rope.scaling.factor"),
        "original_max_position_embeddings": g.int(
            f"{a}.rope.scaling.original_context_length", hi=1 << 31
        ),
        "beta_fast": g.float(f"{a}.rope.scaling.yarn_beta_fast", 32.0),
        "beta_slow": g.float(f"{a}.rope.scaling.yarn_beta_slow", 1.0),
        "mscale": m,
        "mscale_all_dim": m,
    }


# ---- gpt-oss -------------------------------------------------------------------------------

# What llama.cpp's gpt-oss graph fixes and its converter therefore does not write: the clamped
# SwiGLU's alpha and limit (ggml_swiglu_oai(..., 1.702f, 7.0f)), and the layer pattern
# (set_swa_pattern(2): even layers sliding, odd ones full, as transformers' default).
GPT_OSS_SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}


def _gpt_oss_config(g: _Gguf) -> tuple[dict[str, Any], list[int], set[str]]:
    """GPT-OSS (gpt-oss), as llama.cpp's converter (conversion/gpt_oss.py) writes it: MXFP4
    experts (ffn_{gate,up,down}_exps, type MXFP4, gate and up de-interleaved from
    gate_up_proj) kept as the store's mxfp4 records, their nibbles moved back to our order
    (repack_mxfp4), or any other type as for the other families (a float checkpoint's
    converts to F32/F16/BF16/Q8_0 experts); expert biases (ffn_*_exps.bias), the router's
    bias (ffn_gate_inp.bias), attention biases and sinks (attn_sinks.weight); NeoX rotary
    (rows not permuted) with YaRN from rope.scaling.*; attention.sliding_window. The file
    has no `truncate` for YaRN: imported as GPT-OSS's config says (false), transformers'
    and OpenAI's reference rule (llama.cpp itself rounds the ramp's ends: docs/decisions.md)."""
    a, s = g.arch, _moe_sizes(g)
    # GPT-OSS is a bf16 model: a file too big for float32 keeps bf16's range, not fp16's.
    dtype = "float32" if g.path.stat().st_size < 2 * 1024**3 else "bfloat16"
    L, E, inter, dim = s["num_hidden_layers"], s["num_experts"], s["expert_size"], s["hidden_size"]
    H, hd = s["num_attention_heads"], s["head_dim"]
    rope_dim = g.int(f"{a}.rope.dimension_count", hd)
    if rope_dim != hd:
        raise StoreError(f"{g.path}: partial rotary ({rope_dim} of {hd}) in gpt-oss")
    cfg: dict[str, Any] = {
        "model_type": "gpt_oss",
        "architectures": ["GptOssForCausalLM"],
        **{k: v for k, v in s.items() if k not in ("expert_size", "num_experts")},
        "num_local_experts": E,
        "num_experts": E,
        "intermediate_size": inter,
        "sliding_window": g.int(f"{a}.attention.sliding_window"),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)],
        "rms_norm_eps": g.float(f"{a}.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": g.float(f"{a}.rope.freq_base", 150000.0),
        "rope_scaling": _gpt_oss_rope_scaling(g),
        "max_position_embeddings": g.int(f"{a}.context_length", 131072, hi=1 << 31),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "attention_bias": True,
        **GPT_OSS_SWIGLU,
        "torch_dtype": dtype,
    }

    def per_layer(i: int) -> dict:
        shapes = {
            **_attention_shapes(g, cfg, i),
            "attn_output.bias": (dim,),
            "attn_sinks.weight": (H,),
            "attn_norm.weight": (dim,),
            "post_attention_norm.weight": (dim,),
            **{f"{n}.weight": sh for n, sh in _expert_shapes(g, i, E, inter, dim).items()},
            "ffn_gate_inp.bias": (E,),
        }
        for gp, rows in (("ffn_gate", inter), ("ffn_up", inter), ("ffn_down", dim)):
            shapes[f"{gp}_exps.bias"] = (E, rows)
        for name in ("attn_q", "attn_k", "attn_v"):
            if f"{name}.bias" not in shapes:
                raise StoreError(f"{g.path}: tensor blk.{i}.{name}.bias not found")
        return shapes

    return cfg, list(range(L)), _check_shapes(g, cfg, per_layer, attention=False)


def _convert_gpt_oss(
    g: _Gguf, c: GgufConfig, out: Path, calibration_tokens: int, progress: bool
) -> Path:
    cfg, L = c.config, c.config["num_hidden_layers"]
    dense = DenseWriter(c.dtype)
    _add_embeddings(dense, g, cfg)
    for i in range(L):
        pre = f"model.layers.{i}"
        _add_layer_norms(dense, g, i, "post_attention_norm")
        _add_attention(dense, g, i, pre)  # NeoX rotary: rows not permuted
        _add_norm(dense, g, f"blk.{i}.attn_sinks.weight", f"{pre}.self_attn.sinks")
        dense.add(f"{pre}.mlp.router", g.tensor(f"blk.{i}.ffn_gate_inp.weight"), quantize=False)
        _add_norm(dense, g, f"blk.{i}.ffn_gate_inp.bias", f"{pre}.mlp.router.bias")
    return _convert_moe(g, c, out, dense, calibration_tokens, progress)


def _gpt_oss_rope_scaling(g: _Gguf) -> dict[str, Any] | None:
    a = g.arch
    if g.str(f"{a}.rope.scaling.type") != "yarn":
        return _rope_scaling(g)
    return {
        "rope_type": "yarn",
        "factor": g.float(f"{a}.rope.scaling.factor"),
        "original_max_position_embeddings": g.int(
            f"{a}.rope.scaling.original_context_length", hi=1 << 31
        ),
        "beta_fast": g.float(f"{a}.rope.scaling.yarn_beta_fast", 32.0),
        "beta_slow": g.float(f"{a}.rope.scaling.yarn_beta_slow", 1.0),
        "truncate": False,
    }


def _has_layer_experts(g: _Gguf, i: int) -> bool:
    return any(f"blk.{i}.{n}.weight" in g.tensors for n in ("ffn_gate_exps", "ffn_gate_up_exps"))


def _write_experts(writer: StoreWriter, layers, E: int, expert_parts, progress: bool) -> None:
    from tqdm import tqdm

    layers = list(layers)
    with tqdm(total=len(layers) * E, desc="experts", unit="expert", disable=not progress) as bar:
        for i in layers:
            for e in range(E):
                writer.add_expert(i, e, record_arrays(expert_parts(i, e)))
                bar.update(1)


def _add_layer_norms(dense: DenseWriter, g: _Gguf, i: int, post: str) -> None:
    """Layer i's two norms: attn_norm, and `post` (llama.cpp's name for the norm before the
    MLP: ffn_norm, or post_attention_norm in the architectures that call it so)."""
    pre = f"model.layers.{i}"
    _add_norm(dense, g, f"blk.{i}.attn_norm.weight", f"{pre}.input_layernorm.weight")
    _add_norm(dense, g, f"blk.{i}.{post}.weight", f"{pre}.post_attention_layernorm.weight")


def _add_norm(dense: DenseWriter, g: _Gguf, name: str, key: str) -> None:
    t = g.tensor(name)
    dense.add_array(key, dequantize_rows(raw_rows(t), t).reshape(-1))
