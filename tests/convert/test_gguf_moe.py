"""GGUF import of the MoE families (olmoe, qwen3next, Mixtral as llama with ffn_*_exps) from
files written by llama.cpp's own converter, against transformers on the same tiny models.

- F32 GGUFs: logits within float noise of transformers' on the checkpoint itself.
- Q8_0 GGUFs (`--outtype q8_0`): against transformers on the checkpoint with every tensor that
  llama.cpp quantized replaced by its Q8_0 round trip (gguf-py's quantize then dequantize,
  the functions llama.cpp's converter calls). Our import repacks Q8_0 to MLX affine 8-bit
  with the same values exactly ((q + 128) * d - 128 * d = q * d: every term is exact in
  float32), so what is left is float32 summation order: the same bound as for F32.
- k-quant and i-quant experts (Q2_K..Q6_K, IQ2_XS, IQ3_S; each layer its own types, as a
  Q4_K_M file's are): the expert tensors and lm_head of a llama.cpp F32 GGUF (hidden and
  expert width 256, a whole block) are replaced by random blocks (gguf-py cannot quantize
  these types); the store's records must hold the file's blocks byte for byte, and logits
  match transformers with those tensors set to gguf-py's dequantization of the blocks. Our
  expert kernels decode the blocks bit-identically to gguf-py (test_gguf_quants), so again
  only summation order differs.

- gpt-oss: F32, Q8_0 and MXFP4 GGUFs (the last from a checkpoint as OpenAI ships GPT-OSS,
  whose MXFP4 blocks llama.cpp's converter repacks into ggml's nibble order): MXFP4 records
  byte for byte those of the checkpoint converted directly, decoded they are gguf-py's
  dequantization, logits transformers'.

Also: the rebuilt tokenizers (byte-level BPE; SentencePiece, against sentencepiece itself),
llama.cpp's --fuse-gate-up-exps and early-2024 one-tensor-per-expert Mixtral files (same
records as the stacked file's), and the one-line errors for files we cannot convert.

Tolerance: |ours - ref| <= 1e-4 (1 + |ref|), test_families' float32 bound; measured maxima
are 1e-7 to 7e-6 (see ATOL's comment).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import llama_cpp_gguf as lc
import numpy as np
import pytest
import tiny_gguf

import strata_mlx
from strata_mlx.convert.gguf import convert_gguf
from strata_mlx.format.store import EXPERTS, StoreError, load_manifest
from strata_mlx.generation.generate import teacher_forced_logits

FAMILIES = ["mixtral", "olmoe", "qwen3_next"]
# Sigmoid-routed families (glm4moe, deepseek2): F32 and k/i-quant experts; their Q8_0 oracle
# (llama.cpp quantizes DeepSeek's split attn_k_b / attn_v_b, not kv_b_proj) is not written yet.
SIGMOID = ["glm4_moe", "deepseek_v3"]
# llama.cpp's converter has --fuse-gate-up-exps (ffn_gate_up_exps) for these only.
FUSED = ["qwen3_next"]
# Measured max |ours - ref| / (1 + |ref|), logits of |ref| <= 1.5: F32 and Q8_0 0.9-1.4e-7;
# k/i-quant experts (256-wide) 0.6-1.0e-6, Qwen3-Next's 1.3e-6 and 6.8e-6 (its delta-net
# recurrence carries rounding along the sequence). 1e-4 is test_families' float32 bound.
ATOL = 1e-4

# Expert types per layer (even, odd) and projection: every ggml block type the runtime keeps.
QUANT_VARIANTS = {
    "kquants": [("Q4_K", "Q5_K", "Q6_K"), ("Q2_K", "Q3_K", "Q4_K")],
    "iquants": [("IQ2_XS", "IQ3_S", "Q2_K"), ("IQ3_S", "IQ2_XS", "IQ3_S")],
}


def _extra(family: str) -> tuple[str, ...]:
    return ("--no-mtp",) if family == "qwen3_next" else ()


@pytest.fixture(scope="session")
def llama_cpp(tmp_path_factory):
    """(family, variant) -> (GGUF path, the transformers model it was made from): every GGUF
    written by one run of llama.cpp's converter (torch imported once)."""
    src = lc.converter_dir()
    if src is None:
        pytest.skip("llama.cpp's convert_hf_to_gguf.py: pip could not fetch llama-cpp-python")
    root = tmp_path_factory.mktemp("llama_cpp")
    made, jobs = {}, []
    for family in FAMILIES + SIGMOID:
        small = lc.hf_model(family)
        wide = lc.hf_model(family, hidden=256, expert=256, seed=1)
        ck_small = lc.save_checkpoint(small, root / f"{family}-small")
        ck_wide = lc.save_checkpoint(wide, root / f"{family}-wide")
        variants = [
            ("f32", ck_small, small, "f32", ()),
            ("wide", ck_wide, wide, "f32", ()),
        ]
        if family in FAMILIES:
            variants.append(("q8_0", ck_small, small, "q8_0", ()))
        if family == "mixtral":  # Mixtral's own tokenizer is SentencePiece
            spm = lc.hf_model(family, vocab=400, bos_eos=(1, 2), seed=2)
            ck_spm = lc.save_checkpoint(spm, root / f"{family}-spm", sentencepiece=True)
            variants.append(("spm", ck_spm, spm, "f32", ()))
        if family in FUSED:
            variants.append(("fused", ck_small, small, "f32", ("--fuse-gate-up-exps",)))
        for variant, ck, model, outtype, extra in variants:
            out = root / f"{family}-{variant}.gguf"
            jobs.append((ck, out, outtype, (*extra, *_extra(family))))
            made[family, variant] = (out, model)
    lc.convert_many(src, jobs)
    return made


def _ids(n: int = 48, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, len(lc.TOKENS), size=n).tolist()


def _hf_logits(model, ids: list[int], replace: dict | None = None) -> np.ndarray:
    import torch

    if replace:
        model = copy.deepcopy(model)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in replace.items():
                params[name].copy_(torch.from_numpy(np.asarray(value, np.float32)))
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def _ours(store: Path, ids: list[int]) -> np.ndarray:
    model, _ = strata_mlx.load(store)
    return teacher_forced_logits(model, ids, step=64)


def _close(ours: np.ndarray, ref: np.ndarray) -> None:
    err = np.abs(ours - ref) / (1 + np.abs(ref))
    assert err.max() <= ATOL, f"max error {err.max():.3g}"


def _convert(path: Path, out: Path, **kw) -> Path:
    return convert_gguf(path, out, progress=False, calibration_tokens=0, **kw)


# ---- float and Q8_0, as llama.cpp's converter writes them ---------------------------------


@pytest.mark.parametrize("family", FAMILIES + SIGMOID)
def test_f32_gguf_matches_transformers(family, llama_cpp, tmp_path):
    path, model = llama_cpp[family, "f32"]
    store = _convert(path, tmp_path / "s")
    assert load_manifest(store).model_type == family
    ids = _ids()
    _close(_ours(store, ids), _hf_logits(model, ids))


def _q8_0_round_trip(model) -> dict[str, np.ndarray]:
    """Every parameter llama.cpp's converter writes as Q8_0 (matrices but the routers, the
    shared-expert gate and the delta-net's conv kernel), through gguf-py's Q8_0 round trip:
    blocks of 32 along each row, as llama.cpp's converter (gguf.quants.quantize) makes them;
    its row permutations (llama's q/k, Qwen3-Next's qkvz split) move whole rows."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    q8 = GGMLQuantizationType.Q8_0
    out = {}
    for name, p in model.named_parameters():
        if p.dim() < 2 or name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
            continue
        if "conv1d" in name:
            continue
        w = p.detach().numpy().astype(np.float32)
        out[name] = dequantize(quantize(w, q8), q8).reshape(w.shape)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_q8_0_gguf_matches_transformers_on_dequantized_weights(family, llama_cpp, tmp_path):
    path, model = llama_cpp[family, "q8_0"]
    store = _convert(path, tmp_path / "s")
    m = load_manifest(store)
    assert {q["format"] for q in m.layout.quant.values()} == {"affine"}
    assert all(q["bits"] == 8 for q in m.layout.quant.values())
    ids = _ids()
    ours = _ours(store, ids)
    _close(ours, _hf_logits(model, ids, _q8_0_round_trip(model)))
    # The oracle tells Q8_0 from float: the unquantized checkpoint is far outside the bound.
    assert np.abs(ours - _hf_logits(model, ids)).max() > 10 * ATOL


def _cached_decode_matches_full_recompute(store: Path) -> None:
    """Decoding token by token over the KV cache gives the full forward's logits."""
    import mlx.core as mx

    model, _ = strata_mlx.load(store)
    ids = _ids(24, seed=1)
    full = teacher_forced_logits(model, ids, step=64)
    cache = model.make_cache()
    model(mx.array([ids[:16]]), cache=cache)
    steps = [np.array(model(mx.array([[t]]), cache=cache)[0, -1]) for t in ids[16:]]
    np.testing.assert_allclose(np.stack(steps), full[16:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES + SIGMOID)
def test_cached_decode_matches_full_recompute(family, llama_cpp, tmp_path):
    path, _ = llama_cpp[family, "q8_0" if family in FAMILIES else "f32"]
    _cached_decode_matches_full_recompute(_convert(path, tmp_path / "s"))


@pytest.mark.parametrize("family", FUSED)
def test_fused_gate_up_experts_equal_separate_ones(family, llama_cpp, tmp_path):
    """llama.cpp's --fuse-gate-up-exps writes ffn_gate_up_exps [E, 2I, D]: the same records,
    so the same logits bit for bit."""
    fused = _convert(llama_cpp[family, "fused"][0], tmp_path / "fused")
    plain = _convert(llama_cpp[family, "f32"][0], tmp_path / "plain")
    assert (fused / EXPERTS).read_bytes() == (plain / EXPERTS).read_bytes()
    ids = _ids()
    np.testing.assert_array_equal(_ours(fused, ids), _ours(plain, ids))


def test_tokenizer_is_the_checkpoints(llama_cpp, tmp_path):
    """The byte-level BPE rebuilt from GGUF metadata (pre-tokenizer "gpt-2") encodes as the
    checkpoint's own tokenizer."""
    import transformers as T

    from strata_mlx.generation.tokenizer import load_tokenizer

    path, _ = llama_cpp["olmoe", "f32"]
    hf = T.AutoTokenizer.from_pretrained(path.parent / "olmoe-small")
    tok = load_tokenizer(_convert(path, tmp_path / "s"))
    for s in ["the cat in the hat", "  Hello,\tworld!\n\nIt's naïve — café ☕ 2024", lc.EOT]:
        assert tok.encode(s) == hf(s).input_ids, s
    assert tok.eos_token_ids == {len(lc.TOKENS) - 1}


def test_sentencepiece_tokenizer_is_the_checkpoints(llama_cpp, tmp_path):
    """A SentencePiece vocabulary (tokenizer.ggml.model "llama": tokens and scores, as
    llama.cpp writes Mixtral's) rebuilt as a BPE encodes as sentencepiece itself does, BOS
    first; control tokens in the text are matched whole, as llama.cpp does."""
    import sentencepiece as spm

    from strata_mlx.convert.common import CALIBRATION_TEXT
    from strata_mlx.generation.tokenizer import load_tokenizer

    path, model = llama_cpp["mixtral", "spm"]
    store = _convert(path, tmp_path / "s")
    tok = load_tokenizer(store)
    sp = spm.SentencePieceProcessor(model_file=str(path.parent / "mixtral-spm" / "tokenizer.model"))
    samples = [
        "the cat in the hat",
        "  Hello,\tworld!\n\nIt's naïve — café ☕ 2024",
        " leading space",
        "double  space",
        "ünïcödé 漢字",
        CALIBRATION_TEXT,
    ]
    for s in samples:
        ids = tok.encode(s)
        assert ids == [1, *sp.encode(s)], s
        assert tok.decode(ids, skip_special_tokens=True) == s
    assert tok.encode("</s> x")[:2] == [1, 2]
    assert tok.eos_token_ids == {2}
    ids = tok.encode("Every winter the harbour froze")
    _close(_ours(store, ids), _hf_logits(model, ids))


# ---- k-quant and i-quant experts, kept as blocks ------------------------------------------


def _requantized(family: str, variant: str, llama_cpp, tmp_path: Path):
    """The wide F32 GGUF with its experts (and lm_head, Q6_K) as random `variant` blocks;
    returns (path, {GGUF tensor: raw blocks}, {transformers parameter: float values})."""
    path, model = llama_cpp[family, "wide"]
    from gguf import GGUFReader

    rng = np.random.default_rng(7)
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    replace, raw, hf = {}, {}, {}

    def put(name: str, qtype: str):
        from gguf import GGMLQuantizationType

        shape = tuple(int(x) for x in reversed(tensors[name].shape))
        blocks, values = tiny_gguf.random_blocks(qtype, shape, rng, std=0.02)
        replace[name] = (blocks, GGMLQuantizationType[qtype])
        raw[name] = blocks
        return values

    hf["lm_head.weight"] = put("output.weight", "Q6_K")
    layers = model.config.num_hidden_layers
    for i in range(layers):
        if f"blk.{i}.ffn_gate_exps.weight" not in tensors:  # a leading dense layer
            continue
        gate_t, up_t, down_t = QUANT_VARIANTS[variant][i % 2]
        gate = put(f"blk.{i}.ffn_gate_exps.weight", gate_t)
        up = put(f"blk.{i}.ffn_up_exps.weight", up_t)
        hf[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.concatenate([gate, up], axis=1)
        hf[f"model.layers.{i}.mlp.experts.down_proj"] = put(f"blk.{i}.ffn_down_exps.weight", down_t)
    out = tiny_gguf.rewrite(path, tmp_path / f"{family}-{variant}.gguf", replace)
    return out, raw, hf


@pytest.mark.parametrize("variant", list(QUANT_VARIANTS))
@pytest.mark.parametrize("family", FAMILIES + SIGMOID)
def test_quantized_experts_keep_their_blocks(family, variant, llama_cpp, tmp_path):
    path, raw, hf = _requantized(family, variant, llama_cpp, tmp_path)
    store = _convert(path, tmp_path / "s")
    m = load_manifest(store)
    experts = np.fromfile(store / EXPERTS, np.uint8)
    for i in m.moe_layers:
        layout = m.layout_of(i)
        for p, (gp, want) in zip(
            ("gate_proj", "up_proj", "down_proj"),
            zip(("ffn_gate", "ffn_up", "ffn_down"), QUANT_VARIANTS[variant][i % 2]),
        ):
            assert layout.quant[p] == {"format": "gguf", "type": want, "in_features": 256}
            c = layout.component(f"{p}.weight")
            blocks = raw[f"blk.{i}.{gp}_exps.weight"]
            for e in (0, m.num_experts - 1):
                off = m.offsets[m.layer_position(i)][e] + c.offset
                got = experts[off : off + c.nbytes]
                assert got.tobytes() == blocks[e].tobytes(), (i, p, e)
    ids = _ids()
    _close(_ours(store, ids), _hf_logits(llama_cpp[family, "wide"][1], ids, hf))


# ---- what is refused, and how --------------------------------------------------------------


def test_mixtral_is_never_called_dense(llama_cpp, tmp_path):
    path, _ = llama_cpp["mixtral", "f32"]
    with pytest.raises(StoreError) as e:
        _convert(path, tmp_path / "s", split_experts=8)
    msg = str(e.value)
    assert str(path) in msg and "has experts" in msg and "\n" not in msg


def _edited(
    src: Path, dst: Path, drop: tuple[str, ...] = (), arch: str | None = None, unstack=False
) -> Path:
    """`src` without the tensors and metadata keys named in `drop`, under `arch`; with
    `unstack`, each blk.N.ffn_*_exps tensor as one blk.N.ffn_*.E.weight per expert (how
    llama.cpp wrote Mixtral before it stacked experts, early 2024)."""
    import re

    from gguf import GGUFReader

    r = GGUFReader(str(src))
    old = r.fields["general.architecture"].contents()
    arch = arch or old
    meta, tensors = {}, {}
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in drop:
            continue
        vtype = tiny_gguf.V(f.types[0])
        sub = tiny_gguf.V(f.types[1]) if vtype == tiny_gguf.V.ARRAY else None
        meta[name.replace(f"{old}.", f"{arch}.", 1)] = (f.contents(), vtype, sub)
    for t in r.tensors:
        if t.name in drop:
            continue
        raw = None if t.tensor_type.name in ("F32", "F16") else t.tensor_type
        m = re.fullmatch(r"blk\.(\d+)\.(ffn_\w+)_exps\.weight", t.name)
        if unstack and m:
            for e, rows in enumerate(np.array(t.data)):
                tensors[f"blk.{m[1]}.{m[2]}.{e}.weight"] = (rows, raw)
        else:
            tensors[t.name] = (np.array(t.data), raw)
    return tiny_gguf.write(dst, arch, meta, tensors)


@pytest.mark.parametrize("variant", ["f32", "q8_0"])
def test_mixtral_with_one_tensor_per_expert(variant, llama_cpp, tmp_path):
    """Early-2024 Mixtral GGUFs (blk.N.ffn_gate.E.weight, one tensor per expert): the same
    records as the stacked file's, so the same logits bit for bit."""
    path = llama_cpp["mixtral", variant][0]
    legacy = _edited(path, tmp_path / "legacy.gguf", unstack=True)
    from gguf import GGUFReader

    assert "blk.0.ffn_gate.7.weight" in {t.name for t in GGUFReader(str(legacy)).tensors}
    old = _convert(legacy, tmp_path / "old")
    new = _convert(path, tmp_path / "new")
    assert (old / EXPERTS).read_bytes() == (new / EXPERTS).read_bytes()
    ids = _ids()
    np.testing.assert_array_equal(_ours(old, ids), _ours(new, ids))


@pytest.mark.parametrize(
    "family,drop,arch,words",
    [
        ("olmoe", (), "grok", ["architecture 'grok' is not supported", "olmoe", "qwen3next"]),
        ("mixtral", ("blk.1.ffn_up_exps.weight",), None, ["blk.1.ffn_up_exps.weight not found"]),
        ("olmoe", ("olmoe.expert_count",), None, ["olmoe.expert_count"]),
        ("qwen3_next", ("qwen3next.ssm.group_count",), None, ["qwen3next.ssm.group_count"]),
        ("qwen3_next", ("blk.0.ssm_a",), None, ["blk.0.ssm_a not found"]),
    ],
)
def test_bad_files_name_the_file_and_what_is_missing(
    family, drop, arch, words, llama_cpp, tmp_path
):
    path = _edited(llama_cpp[family, "f32"][0], tmp_path / "m.gguf", drop, arch)
    with pytest.raises(StoreError) as e:
        _convert(path, tmp_path / "s")
    msg = str(e.value)
    assert msg.startswith(str(path)) and "\n" not in msg, msg
    for w in words:
        assert w in msg, msg
    assert not (tmp_path / "s").exists()


def test_cli_unsupported_architecture_exits_2(llama_cpp, tmp_path):
    path = _edited(llama_cpp["olmoe", "f32"][0], tmp_path / "m.gguf", arch="grok")
    cmd = [sys.executable, "-m", "strata_mlx", "convert", "--gguf-path", str(path)]
    r = subprocess.run(
        [*cmd, "--mlx-path", str(tmp_path / "s")], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 2, (r.stdout, r.stderr)
    line = r.stderr.strip().splitlines()[-1]
    assert str(path) in line and "'grok'" in line and "olmoe" in line, r.stderr


def test_the_fixtures_are_llama_cpps(llama_cpp):
    """What the tests above lean on: the files are the converter's (its metadata keys, its
    quirks), not ours."""
    from gguf import GGUFReader

    r = GGUFReader(str(llama_cpp["mixtral", "f32"][0]))
    assert r.fields["general.architecture"].contents() == "llama"
    assert "blk.0.ffn_gate_exps.weight" in {t.name for t in r.tensors}
    r = GGUFReader(str(llama_cpp["qwen3_next", "f32"][0]))
    names = {t.name for t in r.tensors}
    assert {"blk.0.attn_qkv.weight", "blk.0.attn_gate.weight", "blk.0.ssm_a"} <= names
    cfg = json.loads(
        (llama_cpp["qwen3_next", "f32"][0].parent / "qwen3_next-small" / "config.json").read_text()
    )
    assert "layer_types" in cfg


# ---- gpt-oss: MXFP4 experts, as llama.cpp's converter writes them -----------------------


@pytest.fixture(scope="session")
def gpt_oss_ggufs(tmp_path_factory):
    """variant -> (GGUF, its checkpoint, the transformers model): llama.cpp's converter run on
    a tiny GptOssForCausalLM saved float32 ("f32", "q8_0") and as OpenAI ships GPT-OSS, its
    experts MXFP4 blocks ("mxfp4": the converter keeps them as ggml MXFP4)."""
    from test_mxfp4 import mxfp4_checkpoint

    src = lc.converter_dir()
    if src is None:
        pytest.skip("llama.cpp's convert_hf_to_gguf.py: pip could not fetch llama-cpp-python")
    root = tmp_path_factory.mktemp("llama_cpp_gpt_oss")
    model = lc.hf_model("gpt_oss")
    ck = lc.save_checkpoint(model, root / "float")
    mx4 = mxfp4_checkpoint(ck, root / "mxfp4")
    made = {
        "f32": (root / "f32.gguf", ck, model),
        "q8_0": (root / "q8_0.gguf", ck, model),
        "mxfp4": (root / "mxfp4.gguf", mx4, None),
    }
    lc.convert_many(
        src, [(c, g, "q8_0" if v == "q8_0" else "f32", ()) for v, (g, c, _) in made.items()]
    )
    return made


def _gpt_oss_transformers(checkpoint: Path, ids: list[int]) -> np.ndarray:
    """transformers on the MXFP4 checkpoint (its own dequantizer, float32)."""
    import torch
    import transformers as T

    m = T.AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, quantization_config=T.Mxfp4Config(dequantize=True)
    ).eval()
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].float().numpy()


def test_gpt_oss_fixtures_are_llama_cpps(gpt_oss_ggufs):
    from gguf import GGUFReader

    r = GGUFReader(str(gpt_oss_ggufs["mxfp4"][0]))
    assert r.fields["general.architecture"].contents() == "gpt-oss"
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert {types[f"blk.0.ffn_{p}_exps.weight"] for p in ("gate", "up", "down")} == {"MXFP4"}
    assert {"blk.0.attn_sinks.weight", "blk.0.ffn_gate_inp.bias", "blk.0.ffn_up_exps.bias"} <= set(
        types
    )
    assert r.fields["gpt-oss.attention.sliding_window"].contents() == 5


def test_gpt_oss_f32_gguf_matches_transformers(gpt_oss_ggufs, tmp_path):
    path, _, model = gpt_oss_ggufs["f32"]
    store = _convert(path, tmp_path / "s")
    m = load_manifest(store)
    assert m.model_type == "gpt_oss"
    assert m.layout.activation == {"name": "swiglu_oai", "alpha": 1.702, "limit": 7.0}
    assert m.config["layer_types"] == model.config.layer_types
    assert m.config["sliding_window"] == model.config.sliding_window
    ids = _ids()
    _close(_ours(store, ids), _hf_logits(model, ids))


def test_gpt_oss_mxfp4_gguf_keeps_the_checkpoints_bytes(gpt_oss_ggufs, tmp_path):
    """llama.cpp's converter moves OpenAI's nibbles into ggml's block order (scale byte first,
    elements j and j + 16 in byte j); the import moves them back: the records are those of
    the MXFP4 checkpoint converted directly, byte for byte, and the logits transformers'."""
    from strata_mlx.convert.hf import convert_hf

    path, ck, _ = gpt_oss_ggufs["mxfp4"]
    store = _convert(path, tmp_path / "s")
    direct = convert_hf(ck, tmp_path / "hf", progress=False, calibration_tokens=0)
    a, b = load_manifest(store), load_manifest(direct)
    assert a.layout.quant == dict.fromkeys(
        ("gate_proj", "up_proj", "down_proj"), {"format": "mxfp4"}
    )
    assert a.layout == b.layout
    assert (store / EXPERTS).read_bytes() == (direct / EXPERTS).read_bytes()
    ids = _ids()
    _close(_ours(store, ids), _gpt_oss_transformers(ck, ids))


def test_gpt_oss_mxfp4_records_decode_as_gguf_py(gpt_oss_ggufs, tmp_path):
    """Each record's weight, decoded by our reference (quant.dequantize_mxfp4), equals gguf-py's
    dequantization of the file's MXFP4 rows, bit for bit (float32; zeros' sign aside)."""
    import mlx.core as mx
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    from strata_mlx.format.quant import dequantize_mxfp4
    from strata_mlx.format.store import read_record

    path = gpt_oss_ggufs["mxfp4"][0]
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    store = _convert(path, tmp_path / "s")
    m = load_manifest(store)
    for layer in m.moe_layers:
        for p, gp in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
            rows = np.asarray(tensors[f"blk.{layer}.{gp}_exps.weight"].data)
            want = dequantize(rows, GGMLQuantizationType.MXFP4)  # [E, out, in]
            for e in range(m.num_experts):
                rec = np.frombuffer(read_record(store, m, layer, e), np.uint8)
                w, s = (m.layout.component(f"{p}.{c}") for c in ("weight", "scales"))
                codes = rec[w.offset : w.offset + w.nbytes].reshape(w.shape)
                scales = rec[s.offset : s.offset + s.nbytes].reshape(s.shape)
                with mx.stream(mx.cpu):
                    got = np.array(dequantize_mxfp4(mx.array(codes), mx.array(scales)))
                _same_bits_but_zeros_sign(got, want[e])


def test_mxfp4_repack_is_gguf_py_on_every_scale_and_code():
    """repack_mxfp4 on random ggml blocks whose scale byte runs over 0..254 (every E8M0 value
    but 255, NaN in OCP MXFP4: ggml reads it as 2^127, its 0 x 2^127 = 0 where ours is NaN):
    decoded, gguf-py's dequantization bit for bit, zeros' sign aside."""
    import mlx.core as mx
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from strata_mlx.convert.gguf.blocks import repack_mxfp4
    from strata_mlx.format.quant import dequantize_mxfp4

    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 256, (255, 4, 17), dtype=np.uint8)
    blocks[..., 0] = np.arange(255, dtype=np.uint8)[:, None]
    rows = blocks.reshape(255, -1)
    codes, scales = repack_mxfp4(rows)
    assert codes.shape == (255, 64) and scales.shape == (255, 4)
    with mx.stream(mx.cpu):
        got = np.array(dequantize_mxfp4(mx.array(codes), mx.array(scales)))
    with np.errstate(over="ignore"):  # scales from 2^127 on: inf, on both sides
        want = dequantize(rows, GGMLQuantizationType.MXFP4)
    _same_bits_but_zeros_sign(got, want)


def _same_bits_but_zeros_sign(got: np.ndarray, want: np.ndarray) -> None:
    """float32 arrays equal bit for bit, but that a zero may be -0 on one side: E2M1's code 8
    is -0 in OCP MXFP4 (and mx.dequantize, and ours) and ggml's kvalue 0 (+0)."""
    np.testing.assert_array_equal(got, want)  # -0 == +0
    nonzero = want != 0
    np.testing.assert_array_equal(got.view(np.uint32)[nonzero], want.view(np.uint32)[nonzero])


def _gpt_oss_q8_0_round_trip(model) -> dict[str, np.ndarray]:
    """What llama.cpp's converter writes as Q8_0 for gpt-oss (attention, embeddings, lm_head
    and experts; not the router, norms, sinks or biases), through gguf-py's round trip along
    each GGUF row: transformers' expert tensors are [E, in, out], so they are transposed to
    rows first (gate and up de-interleaved along out: whole rows, so no matter)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    q8 = GGMLQuantizationType.Q8_0
    out = {}
    for name, p in model.named_parameters():
        if p.dim() < 2 or "router" in name or name.endswith("_bias"):
            continue
        w = p.detach().numpy().astype(np.float32)
        rows = np.ascontiguousarray(w.swapaxes(-1, -2)) if "experts" in name else w
        back = dequantize(quantize(rows, q8), q8).reshape(rows.shape)
        out[name] = back.swapaxes(-1, -2) if "experts" in name else back
    return out


def test_gpt_oss_q8_0_gguf_matches_transformers_on_dequantized_weights(gpt_oss_ggufs, tmp_path):
    path, _, model = gpt_oss_ggufs["q8_0"]
    store = _convert(path, tmp_path / "s")
    m = load_manifest(store)
    assert {q["format"] for q in m.layout.quant.values()} == {"affine"}
    ids = _ids()
    ours = _ours(store, ids)
    _close(ours, _hf_logits(model, ids, _gpt_oss_q8_0_round_trip(model)))
    assert np.abs(ours - _hf_logits(model, ids)).max() > 10 * ATOL


def test_gpt_oss_cached_decode_matches_full_recompute(gpt_oss_ggufs, tmp_path):
    _cached_decode_matches_full_recompute(_convert(gpt_oss_ggufs["mxfp4"][0], tmp_path / "s"))


@pytest.mark.parametrize(
    "drop,words",
    [
        (("gpt-oss.attention.sliding_window",), ["gpt-oss.attention.sliding_window"]),
        (("blk.1.attn_sinks.weight",), ["blk.1.attn_sinks.weight not found"]),
        (("blk.0.ffn_up_exps.bias",), ["blk.0.ffn_up_exps.bias not found"]),
    ],
)
def test_gpt_oss_bad_files_name_the_file_and_what_is_missing(drop, words, gpt_oss_ggufs, tmp_path):
    path = _edited(gpt_oss_ggufs["mxfp4"][0], tmp_path / "m.gguf", drop)
    with pytest.raises(StoreError) as e:
        _convert(path, tmp_path / "s")
    msg = str(e.value)
    assert msg.startswith(str(path)) and "\n" not in msg, msg
    for w in words:
        assert w in msg, msg
