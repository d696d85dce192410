"""MXFP4 experts (GPT-OSS's format, kept as its blocks in the store): the reference decoder
against mlx's own mxfp4 mode and transformers' dequantizer, the reference expert computation
against mx.gather_qmm(mode="mxfp4"), conversion of an MXFP4 checkpoint (byte for byte) and of a
float one (mx.quantize's mxfp4), logits against transformers and mlx-lm on the same checkpoint,
cached decode, and bit-identical streaming across arenas, steps and policies. The formats.h
decoder and the kernels against the reference are in tests/runtime/test_kernels.py."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import TINY, prompt_ids

import strata_mlx
from strata_mlx.format.quant import (
    component_views,
    dequantize_mxfp4,
    expert_tensors,
    layout_for,
    switch_glu_reference,
    to_numpy,
)
from strata_mlx.format.store import PROJECTIONS, StoreError, load_manifest, read_record
from strata_mlx.generation.generate import stream_generate, teacher_forced_logits

# ---- the decoder ---------------------------------------------------------------------------


def _codes_and_every_scale(rows: int = 256, blocks: int = 4, seed: int = 0):
    """uint8 codes [rows, 16 * blocks] (random bytes: every E2M1 code in both nibbles) and
    scales [rows, blocks] where row r's scale byte is r (every E8M0 value, 0 and 255 too)."""
    codes = np.random.default_rng(seed).integers(0, 256, (rows, 16 * blocks), dtype=np.uint8)
    scales = np.repeat((np.arange(rows) % 256).astype(np.uint8)[:, None], blocks, axis=1)
    return codes, scales


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16 if a.dtype in (mx.float16, mx.bfloat16) else mx.uint32))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_dequantize_is_mlx_mxfp4_bit_for_bit(dtype):
    codes, scales = _codes_and_every_scale()
    with mx.stream(mx.cpu):
        ours = dequantize_mxfp4(mx.array(codes), mx.array(scales), dtype)
        ref = mx.dequantize(
            mx.array(codes).view(mx.uint32), mx.array(scales), mode="mxfp4", dtype=dtype
        )
    keep = np.ones(256, bool)  # rows, one a scale byte
    if dtype == mx.float16:
        # mlx multiplies in fp16 with the scale itself rounded to fp16: 2^(s-127) underflows
        # below s = 103 (2^-24) and is inf from s = 143 (2^16), where its 0 * inf is NaN and
        # its tiny weights 0. Ours rounds the exact float32 weight once. Where the scale is an
        # fp16 number (every scale of a real checkpoint: GPT-OSS's lie in ~110-125) both are
        # that one rounding, bit for bit.
        keep = (np.arange(256) >= 103) & (np.arange(256) <= 142)
    o, r = _bits(ours)[keep], _bits(ref)[keep]
    # 0 * 2^128 (scale 255) is NaN on both sides, perhaps of other signs: the rest bit for bit
    nan = np.isnan(np.array(ours.astype(mx.float32)))[keep]
    assert np.array_equal(nan, np.isnan(np.array(ref.astype(mx.float32)))[keep])
    np.testing.assert_array_equal(o[~nan], r[~nan])


def test_dequantize_is_transformers_mxfp4():
    """transformers' own dequantizer (a lookup table and ldexp; what loads GPT-OSS on a CPU)
    gives the same float32 weights; scales of real checkpoints (s < 255: no infinities)."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    codes, scales = _codes_and_every_scale(rows=255, blocks=4, seed=1)
    with mx.stream(mx.cpu):
        ours = np.array(dequantize_mxfp4(mx.array(codes), mx.array(scales)))
    blocks = torch.from_numpy(codes.reshape(1, 255, 4, 16))
    theirs = convert_moe_packed_tensors(
        blocks, torch.from_numpy(scales[None]), dtype=torch.float32
    )  # [1, in, out]
    np.testing.assert_array_equal(
        theirs[0].T.contiguous().numpy().view(np.uint32), ours.view(np.uint32)
    )


def test_expert_tensors_keep_mx_quantize_bytes():
    w = {p: mx.random.normal((48, 64), key=mx.random.key(i)) for i, p in enumerate(PROJECTIONS)}
    w["down_proj"] = w["down_proj"][:, :40]  # 40 inputs: no whole blocks, stays float (as mlx-lm)
    tensors, table = expert_tensors(w, {"mode": "mxfp4"}, mx.float32)
    assert table == {
        "gate_proj": {"format": "mxfp4"},
        "up_proj": {"format": "mxfp4"},
        "down_proj": {"format": "float"},
    }
    q, s = mx.quantize(w["gate_proj"], mode="mxfp4")
    assert tensors["gate_proj.weight"].dtype == mx.uint8
    assert tensors["gate_proj.weight"].shape == (48, 32)
    np.testing.assert_array_equal(np.array(tensors["gate_proj.weight"]), np.array(q.view(mx.uint8)))
    np.testing.assert_array_equal(np.array(tensors["gate_proj.scales"]), np.array(s))


# ---- the reference expert computation against mlx's own mxfp4 matmul ------------------------


def _records(n: int, d: int, inter: int, seed: int):
    keys = mx.random.split(mx.random.key(seed), 6)
    shapes = {"gate_proj": (inter, d), "up_proj": (inter, d), "down_proj": (d, inter)}
    w = {}
    for j, (p, (o, i)) in enumerate(shapes.items()):
        w[p] = mx.random.normal((n, o, i), key=keys[j]) / np.sqrt(i)
        w[f"{p}.bias"] = mx.random.normal((n, o), key=keys[3 + j]) * 0.1
    tensors, table = expert_tensors(w, {"mode": "mxfp4"}, mx.float32)
    activation = {"name": "swiglu_oai", "alpha": 1.702, "limit": 7.0}
    layout = layout_for({k: v[0] for k, v in tensors.items()}, table, activation)
    arrays = {k: to_numpy(v) for k, v in tensors.items()}
    recs = [layout.pack({k: v[e] for k, v in arrays.items()}) for e in range(n)]
    return layout, mx.array(np.stack([np.frombuffer(r, np.uint8) for r in recs]))


def _gather_qmm_switch_glu(x, records, layout, idx):
    """mlx-lm's QuantizedSwitchLinear arithmetic in mode mxfp4 over the same records."""
    from strata_mlx.format.quant import activation_fn

    views = component_views(records, layout)
    x = mx.expand_dims(x, (-2, -3))

    def proj(a, p):
        y = mx.gather_qmm(
            a,
            views[f"{p}.weight"].view(mx.uint32),
            views[f"{p}.scales"],
            rhs_indices=idx,
            transpose=True,
            mode="mxfp4",
        )
        return y + mx.expand_dims(views[f"{p}.bias"][idx], -2)

    h = activation_fn(layout.activation)(proj(x, "gate_proj"), proj(x, "up_proj"))
    return proj(h, "down_proj").squeeze(-2)


@pytest.mark.parametrize("n_tokens", [3, 40])  # 40 x 2 pairs: the reference sorts by expert
def test_reference_matches_mlx_gather_qmm_mxfp4(n_tokens):
    layout, records = _records(6, 64, 96, seed=2)
    rng = np.random.default_rng(n_tokens)
    idx = mx.array(np.stack([rng.choice(6, 2, replace=False) for _ in range(n_tokens)]))
    x = mx.array(rng.standard_normal((n_tokens, 64)).astype(np.float32))
    with mx.stream(mx.cpu):
        ours = np.array(switch_glu_reference(x, records, layout, idx))
        ref = np.array(_gather_qmm_switch_glu(x, records, layout, idx))
    # the same float32 weights on both sides (mlx decodes them inside its matmul): only the
    # order of the float32 sums differs, ~1e-7 of the output's scale
    rms = float(np.sqrt(np.mean(ref.astype(np.float64) ** 2)))
    assert np.abs(ours - ref).max() <= 1e-5 * rms, np.abs(ours - ref).max() / rms


# ---- a tiny GPT-OSS, float and as OpenAI ships it ------------------------------------------


def _hf_model():
    import torch
    import transformers as T

    torch.manual_seed(0)
    # Every expert axis a multiple of 32 (MXFP4 blocks), and what mlx-lm's gpt_oss fixes
    # (swiglu alpha and limit at their defaults, YaRN with truncate), so the same checkpoint
    # runs under transformers, mlx-lm and strata-mlx. The clamps biting is conftest's model.
    cfg = T.GptOssConfig(
        **{**TINY, "num_hidden_layers": 3},
        intermediate_size=32,
        head_dim=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=5,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": True,
            "original_max_position_embeddings": 4096,
        },
    )
    return T.GptOssForCausalLM(cfg)


def mxfp4_checkpoint(float_checkpoint: Path, out: Path) -> Path:
    """`float_checkpoint` as transformers' Mxfp4 quantizer saves GPT-OSS (OpenAI's layout):
    experts.{gate_up,down}_proj_blocks [E, out, in/32, 16] and _scales [E, out, in/32] uint8
    (rows [out, in]: the transpose of the float parameters), quantized by mx.quantize."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(float_checkpoint, out)
    w = load_file(out / "model.safetensors")
    for k in [k for k in w if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows = np.ascontiguousarray(w.pop(k).swapaxes(-1, -2))  # [E, out, in]
        q, s = mx.quantize(mx.array(rows), mode="mxfp4")
        w[f"{k}_blocks"] = np.array(q.view(mx.uint8)).reshape(*rows.shape[:2], -1, 16)
        w[f"{k}_scales"] = np.array(s)
    save_file(w, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, randomize_norms) -> dict[str, Path]:
    import torch

    d = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    m = _hf_model().to(torch.float32).eval()
    randomize_norms(m)
    m.save_pretrained(d / "float")
    return {"float": d / "float", "mxfp4": mxfp4_checkpoint(d / "float", d / "mxfp4")}


@pytest.fixture(scope="module")
def stores(checkpoints, tmp_path_factory) -> dict[str, Path]:
    """ "mxfp4": the MXFP4 checkpoint converted; "quantized": the float one with q_mode mxfp4."""
    from strata_mlx.convert.hf import convert_hf

    d = tmp_path_factory.mktemp("gpt_oss_mxfp4_stores")
    kw = dict(progress=False, calibration_tokens=64)
    return {
        "mxfp4": convert_hf(checkpoints["mxfp4"], d / "mxfp4", **kw),
        "quantized": convert_hf(
            checkpoints["float"], d / "quantized", quantize=True, q_mode="mxfp4", **kw
        ),
    }


def test_checkpoint_blocks_are_kept_byte_for_byte(checkpoints, stores):
    from safetensors.numpy import load_file

    w = load_file(checkpoints["mxfp4"] / "model.safetensors")
    path = stores["mxfp4"]
    m = load_manifest(path)
    assert m.layout.quant == dict.fromkeys(PROJECTIONS, {"format": "mxfp4"})
    assert "quantization_config" not in m.config and "quantization" not in m.config
    for layer, e in itertools.product(m.moe_layers, range(m.num_experts)):
        rec = np.frombuffer(read_record(path, m, layer, e), np.uint8)
        base = f"model.layers.{layer}.mlp.experts"
        rows = {
            "gate_proj": (f"{base}.gate_up_proj", slice(0, None, 2)),
            "up_proj": (f"{base}.gate_up_proj", slice(1, None, 2)),
            "down_proj": (f"{base}.down_proj", slice(None)),
        }
        for p, (name, sel) in rows.items():
            for comp, suffix in (("weight", "_blocks"), ("scales", "_scales")):
                c = m.layout.component(f"{p}.{comp}")
                want = w[name + suffix][e][sel].reshape(-1)
                np.testing.assert_array_equal(rec[c.offset : c.offset + c.nbytes], want)


def test_float_checkpoint_quantizes_to_the_same_store(stores):
    """mx.quantize(mode="mxfp4") at conversion: the same records as the MXFP4 checkpoint's
    (which mx.quantize made from the same float32 rows), and the same dense weights."""
    a, b = (load_manifest(stores[k]) for k in ("mxfp4", "quantized"))
    assert a.layout == b.layout
    for layer, e in itertools.product(a.moe_layers, range(a.num_experts)):
        assert read_record(stores["mxfp4"], a, layer, e) == read_record(
            stores["quantized"], b, layer, e
        )
    da, db = (mx.load(str(stores[k] / "dense.safetensors")) for k in ("mxfp4", "quantized"))
    assert sorted(da) == sorted(db)
    for k in da:
        np.testing.assert_array_equal(np.array(da[k]), np.array(db[k]), err_msg=k)


def _transformers_logits(checkpoint: Path, ids: list[int]) -> np.ndarray:
    """transformers on a CPU loads an MXFP4 checkpoint by dequantizing the experts into the
    model's dtype (float32 here): its own reading of the blocks."""
    import torch
    import transformers as T

    m = T.AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, quantization_config=T.Mxfp4Config(dequantize=True)
    ).eval()
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].float().numpy()


def test_logits_match_transformers_on_the_mxfp4_checkpoint(checkpoints, stores):
    ids = prompt_ids(64)
    ref = _transformers_logits(checkpoints["mxfp4"], ids)
    model, _ = strata_mlx.load(stores["mxfp4"])
    ours = teacher_forced_logits(model, ids, step=64)
    # Both run float32 on the same weights (MXFP4 decodes exactly in float32): only the order
    # of float32 sums differs (measured: 9e-8 at most, logits up to 0.34), well inside the
    # suite's 1e-4 for float families. A decoding error is far outside it: the float model's
    # logits differ from these by up to 7e-3.
    np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=1e-5)


def test_logits_match_mlx_lm_on_the_mxfp4_checkpoint(checkpoints, stores):
    """mlx-lm loads the same checkpoint as mxfp4-quantized SwitchGLUs (mx.gather_qmm)."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    from strata_mlx.models.base import normalize_config

    config = normalize_config(json.loads((checkpoints["mxfp4"] / "config.json").read_text()))
    patch = {k: config[k] for k in ("rope_theta", "rope_scaling", "num_local_experts")}
    ref_model, _ = load_model(checkpoints["mxfp4"], model_config=patch)
    ids = prompt_ids(64)
    ref = np.array(ref_model(mx.array([ids]), cache=make_prompt_cache(ref_model))[0])
    model, _ = strata_mlx.load(stores["mxfp4"])
    ours = teacher_forced_logits(model, ids, step=64)
    # the same float32 weights; mlx decodes them inside its matmul, we before gather_mm: the
    # sums' order may differ (measured on the CPU: bit-identical logits)
    np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=1e-5)


def test_cached_decode_matches_full_recompute(stores):
    ids = prompt_ids(24, seed=1)
    model, _ = strata_mlx.load(stores["mxfp4"])
    full = teacher_forced_logits(model, ids, step=64)
    cache = model.make_cache()
    model(mx.array([ids[:16]]), cache=cache)
    steps = [np.array(model(mx.array([[t]]), cache=cache)[0, -1]) for t in ids[16:]]
    np.testing.assert_allclose(np.stack(steps), full[16:], atol=1e-5, rtol=1e-5)


def test_bf16_conversion_runs_on_the_cpu(checkpoints, stores, tmp_path):
    """GPT-OSS ships bf16: quantized from bf16 weights and run with bf16 activations (the CPU's
    gather_mm is float32 only: the reference multiplies in float32 there), the logits stay
    within bf16 noise of the float32 store's: measured 3.3e-3 on logits up to 0.32, against
    a bound of 8 bf16 epsilons (2^-8) of the logits' scale."""
    from strata_mlx.convert.hf import convert_hf

    out = convert_hf(
        checkpoints["float"],
        tmp_path / "bf16",
        quantize=True,
        q_mode="mxfp4",
        dtype="bfloat16",
        progress=False,
        calibration_tokens=0,
    )
    ids = prompt_ids(24, seed=2)
    ref = teacher_forced_logits(strata_mlx.load(stores["quantized"])[0], ids, step=64)
    model, _ = strata_mlx.load(out)
    ours = teacher_forced_logits(model, ids, step=64)
    assert np.abs(ours - ref).max() <= 8 * 2.0**-8 * np.abs(ref).max()


def _arena_gb(path: Path, fraction: float) -> float:
    m = load_manifest(path)
    slots = max(1, round(fraction * m.num_experts * len(m.moe_layers)))
    return slots * m.layout.record_bytes / 1024**3


def _greedy(model, ids, step):
    return [
        r.token for r in stream_generate(model, None, ids, max_tokens=8, prefill_step_size=step)
    ]


@pytest.mark.parametrize("step", [1, 7, 64])
def test_bit_identical_across_arenas_and_policies(stores, step):
    path = stores["mxfp4"]
    ids = prompt_ids(40, seed=3)
    ref_model, _ = strata_mlx.load(path, arena_gb=_arena_gb(path, 1.0), read_ahead="demand")
    ref_model.expert_cache.warm()
    ref = teacher_forced_logits(ref_model, ids, step)
    ref_tokens = _greedy(ref_model, ids, step)
    assert ref_model.expert_cache.stats.misses == 0  # truly resident
    ref_model.expert_cache.close()
    for fraction, policy in itertools.product([0.05, 0.25, 1.0], ["demand", "static", "lookahead"]):
        model, _ = strata_mlx.load(path, arena_gb=_arena_gb(path, fraction), read_ahead=policy)
        assert np.array_equal(teacher_forced_logits(model, ids, step), ref), (fraction, policy)
        assert _greedy(model, ids, step) == ref_tokens, (fraction, policy)
        model.expert_cache.close()


def test_host_kernel_runs_the_store_experts(stores):
    """The one algorithm's kernels (host dialect) on the store's own records: biases, the
    clamped SwiGLU and MXFP4 rows, against the reference; they pass their self-check, so on
    CUDA and Metal these layouts run the kernels, not the reference."""
    from custom_kernels import dispatch
    from strata_mlx.runtime import kernels

    path = stores["mxfp4"]
    m = load_manifest(path)
    layout = m.layout_of(m.moe_layers[0])
    assert kernels.expert_kernel(layout, "host").__name__ != "reference"
    arena = mx.array(
        np.stack([np.frombuffer(read_record(path, m, 0, e), np.uint8) for e in range(8)])
    )
    rng = np.random.default_rng(0)
    fn = dispatch.kernel_for("host", layout)
    for n_tokens, strategy in ((2, "fused"), (12, "dequant"), (12, "fused")):
        ids = np.stack([rng.choice(8, 2, replace=False) for _ in range(n_tokens)])
        slots = mx.array(np.unique(ids).astype(np.uint32))
        idx = mx.array(np.searchsorted(np.unique(ids), ids).astype(np.uint32))
        x = mx.array(rng.standard_normal((n_tokens, 32)).astype(np.float32))
        y = np.array(fn(x, arena, slots, idx, layout, strategy=strategy))
        with mx.stream(mx.cpu):
            ref = np.array(switch_glu_reference(x, arena[slots], layout, idx))
        rms = float(np.sqrt(np.mean(ref.astype(np.float64) ** 2)))
        assert np.abs(y - ref).max() <= 1e-5 * rms, (n_tokens, strategy)


# ---- refusals, one line each ---------------------------------------------------------------


def test_quantizing_an_mxfp4_checkpoint_is_refused(checkpoints, tmp_path):
    from strata_mlx.convert.hf import convert_hf

    with pytest.raises(StoreError, match=r"already quantized \(MXFP4 experts\); drop -q"):
        convert_hf(checkpoints["mxfp4"], tmp_path / "s", quantize=True, progress=False)
    with pytest.raises(StoreError, match="--q-mode nf4: expected affine or mxfp4"):
        convert_hf(checkpoints["float"], tmp_path / "s", quantize=True, q_mode="nf4")


@pytest.mark.parametrize(
    "component, shape, message",
    [
        ("down_proj.scales", [32, 2], r"down_proj\.scales is not \[32, 1\]"),
        ("gate_proj.weight", [32, 8], "not whole blocks of 32"),
    ],
)
def test_bad_mxfp4_component_is_one_line(stores, tmp_path, component, shape, message):
    path = tmp_path / "s"
    shutil.copytree(stores["mxfp4"], path)
    manifest = json.loads((path / "manifest.json").read_text())
    for c in manifest["experts"]["components"]:
        if c["name"] == component:
            c["shape"], c["nbytes"] = shape, int(np.prod(shape))
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match=message) as e:
        strata_mlx.load(path)
    assert "\n" not in str(e.value)
