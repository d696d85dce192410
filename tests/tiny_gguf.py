"""Tiny GGUF files (qwen3moe and dense llama) built with gguf-py's writer, metadata as data;
and rewriting another writer's GGUF with some tensors replaced (random k-/i-quant blocks).

Metadata is a dict key -> (value, GGUFValueType, array item type or None), so tests and the
fuzzers can change a field's value or type and write the file again in milliseconds.
Matrices are Q8_0 (blocks of 32: the smallest widths that keep ggml blocks), norms F32; the
tokenizer is a byte-level BPE over the 256 GPT-2 byte symbols, two merges and an end-of-text token.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.quants import quantize

V = GGUFValueType
EOT = "<|endoftext|>"
VOCAB = 259  # 256 byte symbols, two merges, EOT


def byte_symbols() -> list[str]:
    """GPT-2's bytes_to_unicode(): one printable symbol per byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def tokenizer_meta() -> dict:
    tokens = byte_symbols() + ["Ġt", "he", EOT]
    return {
        "tokenizer.ggml.model": ("gpt2", V.STRING, None),
        "tokenizer.ggml.pre": ("default", V.STRING, None),
        "tokenizer.ggml.tokens": (tokens, V.ARRAY, V.STRING),
        "tokenizer.ggml.token_type": ([1] * 258 + [3], V.ARRAY, V.INT32),
        "tokenizer.ggml.merges": (["Ġ t", "h e"], V.ARRAY, V.STRING),
        "tokenizer.ggml.bos_token_id": (VOCAB - 1, V.UINT32, None),
        "tokenizer.ggml.eos_token_id": (VOCAB - 1, V.UINT32, None),
        "tokenizer.ggml.add_bos_token": (False, V.BOOL, None),
        "tokenizer.chat_template": (
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}",
            V.STRING,
            None,
        ),
    }


def _q8(w: np.ndarray):
    return quantize(w.astype(np.float32), GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0


def _f32(w: np.ndarray):
    return w.astype(np.float32), None


def _attention(i: int, D: int, H: int, KV: int, hd: int, rng) -> dict:
    t = {}
    for name, rows in (("attn_q", H * hd), ("attn_k", KV * hd), ("attn_v", KV * hd)):
        t[f"blk.{i}.{name}.weight"] = _q8(rng.standard_normal((rows, D)) * 0.1)
    t[f"blk.{i}.attn_output.weight"] = _q8(rng.standard_normal((D, H * hd)) * 0.1)
    for name in ("attn_norm", "ffn_norm"):
        t[f"blk.{i}.{name}.weight"] = _f32(1 + 0.1 * rng.standard_normal(D))
    return t


def qwen3moe(
    seed: int = 0, L: int = 2, E: int = 4, K: int = 2, f32_down: tuple[int, ...] = ()
) -> tuple[dict, dict]:
    """(metadata, tensors) of a tiny qwen3moe model: D = I = 32, 2 heads of 16, 1 kv head.
    Layers in `f32_down` keep their experts' down projection in F32: the store then has
    per-layer record layouts (affine in some layers, float in others)."""
    rng = np.random.default_rng(seed)
    D, inter, H, KV, hd = 32, 32, 2, 1, 16
    vocab = VOCAB
    a = "qwen3moe"
    meta = {
        f"{a}.block_count": (L, V.UINT32, None),
        f"{a}.context_length": (256, V.UINT32, None),
        f"{a}.embedding_length": (D, V.UINT32, None),
        f"{a}.feed_forward_length": (inter, V.UINT32, None),
        f"{a}.expert_feed_forward_length": (inter, V.UINT32, None),
        f"{a}.attention.head_count": (H, V.UINT32, None),
        f"{a}.attention.head_count_kv": (KV, V.UINT32, None),
        f"{a}.attention.key_length": (hd, V.UINT32, None),
        f"{a}.attention.value_length": (hd, V.UINT32, None),
        f"{a}.rope.freq_base": (1e6, V.FLOAT32, None),
        f"{a}.attention.layer_norm_rms_epsilon": (1e-6, V.FLOAT32, None),
        f"{a}.expert_count": (E, V.UINT32, None),
        f"{a}.expert_used_count": (K, V.UINT32, None),
        **tokenizer_meta(),
    }
    tensors = {
        "token_embd.weight": _q8(rng.standard_normal((vocab, D)) * 0.5),
        "output_norm.weight": _f32(1 + 0.1 * rng.standard_normal(D)),
    }
    for i in range(L):
        tensors.update(_attention(i, D, H, KV, hd, rng))
        for name in ("attn_q_norm", "attn_k_norm"):
            tensors[f"blk.{i}.{name}.weight"] = _f32(1 + 0.1 * rng.standard_normal(hd))
        tensors[f"blk.{i}.ffn_gate_inp.weight"] = _f32(rng.standard_normal((E, D)))
        tensors[f"blk.{i}.ffn_gate_exps.weight"] = _q8(rng.standard_normal((E, inter, D)) * 0.2)
        tensors[f"blk.{i}.ffn_up_exps.weight"] = _q8(rng.standard_normal((E, inter, D)) * 0.2)
        down = rng.standard_normal((E, D, inter)) * 0.2
        tensors[f"blk.{i}.ffn_down_exps.weight"] = _f32(down) if i in f32_down else _q8(down)
    return meta, tensors


def llama(seed: int = 0, L: int = 2) -> tuple[dict, dict]:
    """(metadata, tensors) of a tiny dense llama: D = 32, MLP 64 (two experts of 32)."""
    rng = np.random.default_rng(seed)
    D, inter, H, KV, hd = 32, 64, 2, 1, 16
    vocab = VOCAB
    a = "llama"
    meta = {
        f"{a}.block_count": (L, V.UINT32, None),
        f"{a}.context_length": (256, V.UINT32, None),
        f"{a}.embedding_length": (D, V.UINT32, None),
        f"{a}.feed_forward_length": (inter, V.UINT32, None),
        f"{a}.attention.head_count": (H, V.UINT32, None),
        f"{a}.attention.head_count_kv": (KV, V.UINT32, None),
        f"{a}.rope.dimension_count": (hd, V.UINT32, None),
        f"{a}.rope.freq_base": (10000.0, V.FLOAT32, None),
        f"{a}.attention.layer_norm_rms_epsilon": (1e-5, V.FLOAT32, None),
        **tokenizer_meta(),
    }
    tensors = {
        "token_embd.weight": _q8(rng.standard_normal((vocab, D)) * 0.5),
        "output.weight": _q8(rng.standard_normal((vocab, D)) * 0.5),
        "output_norm.weight": _f32(1 + 0.1 * rng.standard_normal(D)),
    }
    for i in range(L):
        tensors.update(_attention(i, D, H, KV, hd, rng))
        tensors[f"blk.{i}.ffn_gate.weight"] = _q8(rng.standard_normal((inter, D)) * 0.2)
        tensors[f"blk.{i}.ffn_up.weight"] = _q8(rng.standard_normal((inter, D)) * 0.2)
        tensors[f"blk.{i}.ffn_down.weight"] = _q8(rng.standard_normal((D, inter)) * 0.2)
    return meta, tensors


def write(path: Path, arch: str, meta: dict, tensors: dict) -> Path:
    w = GGUFWriter(str(path), arch)
    for key, (value, vtype, sub) in meta.items():
        w.add_key_value(key, value, vtype, sub)
    for name, (array, raw) in tensors.items():
        w.add_tensor(name, array, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- rewriting a GGUF (another writer's file) with some tensors replaced -------------------


def rewrite(src: Path, dst: Path, replace: dict[str, tuple]) -> Path:
    """Copy GGUF `src` to `dst` (every metadata field with its own value types, every tensor
    in its order and type), with the tensors named in `replace` (name -> (array, raw ggml
    type or None)) written instead."""
    from gguf import GGUFReader

    r = GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    meta = {}
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = V(f.types[0])
        meta[name] = (f.contents(), vtype, V(f.types[1]) if vtype == V.ARRAY else None)
    tensors = {}
    for t in r.tensors:
        if t.name in replace:
            tensors[t.name] = replace[t.name]
        elif t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            tensors[t.name] = (np.array(t.data), None)
        else:
            tensors[t.name] = (np.array(t.data), t.tensor_type)
    return write(dst, arch, meta, tensors)


def random_blocks(qtype: str, shape: tuple[int, ...], rng, std: float = 0.05):
    """(raw blocks [..., rows, row_bytes] uint8, their float32 values by gguf-py's own
    dequantizer) of a `qtype` tensor of float `shape` [..., rows, cols]: random bytes (every
    bit pattern of a k-quant or i-quant block is a valid block) with the fp16 scales (d and
    dmin, set equal, so that the values scale with them) chosen for values of about `std`.
    gguf-py cannot quantize these types; random blocks are as good a test of kept blocks."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    from strata_mlx.format.gguf_quants import get_format

    t = GGMLQuantizationType[qtype]
    bs, ts = GGML_QUANT_SIZES[t]
    *lead, cols = shape
    raw = rng.integers(0, 256, size=(*lead, cols // bs, ts), dtype=np.uint8)
    f = get_format(qtype)
    scale_fields = [(off, n) for name, off, n in f.fields if name in ("d", "dmin")]

    def set_scale(value: float) -> None:
        bits = np.frombuffer(np.float16(value).tobytes(), np.uint8)
        for off, n in scale_fields:
            raw[..., off : off + n] = bits

    set_scale(1.0)
    unit = dequantize(raw.reshape(*lead, -1), t).std()
    set_scale(std / unit)
    raw = raw.reshape(*lead, cols // bs * ts)
    return raw, dequantize(raw, t).reshape(shape)
