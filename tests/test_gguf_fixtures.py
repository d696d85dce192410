"""GGUF files made by llama.cpp itself (tests/data/gguf/, by tests/make_quantized_fixtures.py:
its convert_hf_to_gguf.py, then its llama-quantize to Q8_0, Q4_K_M, Q2_K, and with an
importance matrix from its llama-imatrix, IQ3_S and IQ2_XS): each converts, its expert records
hold the file's blocks byte for byte, and its logits are transformers' on exactly the file's
weights.

The oracle: the transformers model rebuilt from the fixture's JSON (class, config, seed; the
weights' digest proves it is the one the file was made from), with every quantized tensor of
the file replaced by gguf-py's dequantization of it (gguf.quants.dequantize), mapped back to
transformers' names and layout (`hf_weights`: llama's q/k row permutation, Qwen3-Next's
regrouped qkvz, experts stacked gate | up). The file's F32 tensors (norms, routers, ...) are
the model's own values (the converter ran at F32), so transformers keeps those.

Tolerance: test_gguf_moe's, |ours - ref| <= 1e-4 (1 + |ref|); measured 4.6e-7 to 1.2e-6 over
the 29 files (float32 summation order: the expert kernels decode blocks as gguf-py does).
"""

from __future__ import annotations

import copy
import functools
import json

import llama_cpp_gguf as lc
import numpy as np
import pytest
from make_quantized_fixtures import DATA, build_model, weights_digest

import strata_mlx
from strata_mlx.convert.gguf import convert_gguf
from strata_mlx.generate import teacher_forced_logits
from strata_mlx.store import EXPERTS, load_manifest

ATOL = 1e-4
RECORDS = {p.stem: json.loads(p.read_text()) for p in sorted(DATA.glob("*.json"))}
CASES = [(family, name) for family, rec in RECORDS.items() for name in rec["files"]]
PROJ = {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


@functools.cache
def model(family: str):
    rec = RECORDS[family]
    return build_model(rec["class"], rec["config"], rec["seed"])


@functools.cache
def tensors(name: str) -> dict:
    from gguf import GGUFReader

    return {t.name: t for t in GGUFReader(str(DATA / name)).tensors}


def dequantized(t) -> np.ndarray:
    from gguf.quants import dequantize

    shape = tuple(int(x) for x in reversed(t.shape))
    return dequantize(np.asarray(t.data), t.tensor_type).reshape(shape).astype(np.float32)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's LlamaModel.permute (rotary halves -> interleaved pairs) of q/k rows."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def hf_weights(family: str, gguf: dict) -> dict[str, np.ndarray]:
    """transformers parameter -> values, for every tensor of `gguf` that llama-quantize did not
    leave F32, dequantized and put back in transformers' layout. Raises KeyError on a
    quantized tensor it has no name for (so none is left out of the oracle)."""
    cfg = RECORDS[family]["config"]
    out: dict[str, np.ndarray] = {}
    quantized = {n: t for n, t in gguf.items() if t.tensor_type.name != "F32"}
    top = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}
    attn = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj"}
    attn |= {"attn_q_a": "q_a_proj", "attn_q_b": "q_b_proj", "attn_kv_a_mqa": "kv_a_proj_with_mqa"}
    shared = "shared_expert" if family == "qwen3_next" else "shared_experts"
    mlp = {f"ffn_{p}_shexp": f"{shared}.{p}_proj" for p in ("gate", "up", "down")}
    mlp |= {f"ffn_{p}": f"{p}_proj" for p in ("gate", "up", "down")}  # a leading dense layer
    done = set()
    for name, t in quantized.items():
        if name in done:
            continue
        w = dequantized(t)
        if name in top:
            out[top[name]] = w
            continue
        _, i, kind, _ = name.split(".")
        pre = f"model.layers.{i}"
        if kind in attn:
            if family == "mixtral" and kind in ("attn_q", "attn_k"):
                heads = cfg["num_attention_heads" if kind == "attn_q" else "num_key_value_heads"]
                w = _unpermute(w, heads)
            out[f"{pre}.self_attn.{attn[kind]}.weight"] = w
        elif kind in ("ffn_gate_exps", "ffn_up_exps"):
            gate = dequantized(gguf[f"blk.{i}.ffn_gate_exps.weight"])
            up = dequantized(gguf[f"blk.{i}.ffn_up_exps.weight"])
            if family == "gpt_oss":  # [E, in, out], gate and up interleaved along out
                gate_up = np.empty((*gate.shape[:1], gate.shape[2], 2 * gate.shape[1]), np.float32)
                gate_up[..., ::2], gate_up[..., 1::2] = gate.swapaxes(1, 2), up.swapaxes(1, 2)
            else:
                gate_up = np.concatenate([gate, up], axis=1)
            out[f"{pre}.mlp.experts.gate_up_proj"] = gate_up
            done |= {f"blk.{i}.ffn_gate_exps.weight", f"blk.{i}.ffn_up_exps.weight"}
        elif kind == "ffn_down_exps":
            out[f"{pre}.mlp.experts.down_proj"] = w.swapaxes(1, 2) if family == "gpt_oss" else w
        elif kind in mlp:
            out[f"{pre}.mlp.{mlp[kind]}.weight"] = w
        elif kind in ("attn_k_b", "attn_v_b"):
            # DeepSeek's kv_b_proj [H (nope + v), lora], split by the converter into
            # attn_k_b [H, lora, nope] (each head's k part transposed) and attn_v_b [H, v, lora].
            k_b = dequantized(gguf[f"blk.{i}.attn_k_b.weight"])
            v_b = dequantized(gguf[f"blk.{i}.attn_v_b.weight"])
            kv_b = np.concatenate([k_b.swapaxes(1, 2), v_b], axis=1)
            out[f"{pre}.self_attn.kv_b_proj.weight"] = kv_b.reshape(-1, kv_b.shape[-1])
            done |= {f"blk.{i}.attn_k_b.weight", f"blk.{i}.attn_v_b.weight"}
        elif kind == "ssm_out":
            out[f"{pre}.linear_attn.out_proj.weight"] = w
        elif kind == "ssm_ba":
            out[f"{pre}.linear_attn.in_proj_ba.weight"] = w
        elif kind in ("attn_qkv", "attn_gate"):
            # The converter's split of in_proj_qkvz ([q k v z] per key head) into attn_qkv
            # ([all q | all k | all v]) and attn_gate ([all z]), undone.
            n_k, dk = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
            dv = cfg["linear_num_value_heads"] // n_k * cfg["linear_value_head_dim"]
            qkv = dequantized(gguf[f"blk.{i}.attn_qkv.weight"])
            z = dequantized(gguf[f"blk.{i}.attn_gate.weight"])
            q, k, v = np.split(qkv, [n_k * dk, 2 * n_k * dk])
            parts = [x.reshape(n_k, -1, x.shape[-1]) for x in (q, k, v, z)]
            assert [p.shape[1] for p in parts] == [dk, dk, dv, dv]
            out[f"{pre}.linear_attn.in_proj_qkvz.weight"] = np.concatenate(parts, 1).reshape(
                -1, qkv.shape[-1]
            )
            done |= {f"blk.{i}.attn_qkv.weight", f"blk.{i}.attn_gate.weight"}
        else:
            raise KeyError(f"{name} ({t.tensor_type.name}): no transformers name")
    return out


def _hf_logits(m, ids: list[int], replace: dict[str, np.ndarray]) -> np.ndarray:
    import torch

    m = copy.deepcopy(m)
    params = dict(m.named_parameters())
    with torch.no_grad():
        for name, value in replace.items():
            params[name].copy_(torch.from_numpy(value))
        return m(torch.tensor([ids])).logits[0].float().numpy()


def _ids(n: int = 32, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, len(lc.TOKENS), size=n).tolist()


@pytest.mark.parametrize("family", list(RECORDS))
def test_the_model_is_the_fixtures(family):
    """The rebuilt transformers model is the one the files were made from (same digest), and
    the files' F32 routers are its own."""
    m = model(family)
    assert weights_digest(m) == RECORDS[family]["weights_sha256"]
    params = dict(m.named_parameters())
    name = next(n for n in RECORDS[family]["files"])
    g = tensors(name)
    for i in range(m.config.num_hidden_layers):
        t = g.get(f"blk.{i}.ffn_gate_inp.weight")
        if t is not None:
            assert t.tensor_type.name == "F32"
            router = "router" if family == "gpt_oss" else "gate"
            want = params[f"model.layers.{i}.mlp.{router}.weight"].detach().numpy()
            np.testing.assert_array_equal(dequantized(t), want)


@pytest.mark.parametrize("family,name", CASES)
def test_fixture_is_what_its_json_says(family, name):
    """The JSON's tensor types are the file's; the mapping back to transformers is right (each
    dequantized tensor correlates with the model's own values: a wrong permutation would not)."""
    rec = RECORDS[family]["files"][name]
    g = tensors(name)
    assert {n: t.tensor_type.name for n, t in g.items()} == rec["tensors"]
    assert (DATA / name).stat().st_size == rec["bytes"]
    params = dict(model(family).named_parameters())
    for hf, w in hf_weights(family, g).items():
        ref = params[hf].detach().numpy()
        assert w.shape == ref.shape, hf
        r = np.corrcoef(w.ravel(), ref.ravel())[0, 1]
        assert r > 0.5, (hf, r)


@pytest.mark.parametrize("family,name", CASES)
def test_fixture_matches_transformers_on_its_weights(family, name, tmp_path):
    path = DATA / name
    store = convert_gguf(path, tmp_path / "s", progress=False, calibration_tokens=0)
    m = load_manifest(store)
    assert m.model_type == family
    g = tensors(name)
    experts = np.fromfile(store / EXPERTS, np.uint8)
    kept = 0
    for i in m.moe_layers:
        layout = m.layout_of(i)
        for p, gp in PROJ.items():
            t = g[f"blk.{i}.{gp}_exps.weight"]
            q = layout.quant[p]
            if q["format"] != "gguf":  # Q8_0: repacked to MLX affine 8-bit, losslessly
                assert (t.tensor_type.name, q["format"], q["bits"]) == ("Q8_0", "affine", 8)
                continue
            assert q["type"] == t.tensor_type.name
            c = layout.component(f"{p}.weight")
            blocks = np.asarray(t.data)
            for e in range(m.num_experts):
                off = m.offsets[m.layer_position(i)][e] + c.offset
                assert experts[off : off + c.nbytes].tobytes() == blocks[e].tobytes(), (i, p, e)
                kept += 1
    assert kept or "Q8_0" in name
    ids = _ids()
    ours = teacher_forced_logits(strata_mlx.load(store)[0], ids, step=64)
    ref = _hf_logits(model(family), ids, hf_weights(family, g))
    err = np.abs(ours - ref) / (1 + np.abs(ref))
    assert err.max() <= ATOL, f"max error {err.max():.3g}"
    # The oracle tells the file's weights from the model's: the unquantized model is far
    # outside the bound (0.02 for Q8_0, 0.08-1.4 for the others).
    assert np.abs(ours - _hf_logits(model(family), ids, {})).max() > 10 * ATOL


def test_llama_quantize_drops_unit_dims():
    """llama-quantize writes a tensor with ggml's n_dims, which drops trailing 1s:
    Qwen3-Next's shared-expert gate [1, D] (the converter's F32 file) is [D] in its output,
    which the import once refused ("is [256], the metadata implies [1, 256]")."""
    for name in RECORDS.get("qwen3_next", {}).get("files", ()):
        t = tensors(name)["blk.0.ffn_gate_inp_shexp.weight"]
        assert [int(x) for x in t.shape] == [RECORDS["qwen3_next"]["config"]["hidden_size"]]
