"""mlx-lm's own model built from our stores (strata_mlx.apps.baseline) against strata-mlx's fully
resident model: the same logits, bit for bit (MXFP4 experts: up to float32 sums' order), and
the same greedy tokens; the bench's side-by-side run."""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from conftest import prompt_ids

import strata_mlx
from strata_mlx.apps.baseline import load_mlx_lm, run_mlx_lm
from strata_mlx.format.store import StoreError, load_manifest
from strata_mlx.generation.generate import stream_generate, teacher_forced_logits

pytest.importorskip("mlx_lm")

FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "qwen3_next", "glm4_moe", "deepseek_v3"]


def resident(path):
    m = load_manifest(path)
    model, _ = strata_mlx.load(path, arena_gb=m.expert_bytes / 1024**3, read_ahead="demand")
    model.expert_cache.warm()
    return model


def mlx_lm_logits(model, ids: list[int], step: int) -> np.ndarray:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    out = [
        np.array(model(mx.array([ids[i : i + step]]), cache=cache)[0].astype(mx.float32))
        for i in range(0, len(ids), step)
    ]
    return np.concatenate(out, axis=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_mlx_lm_model_from_store_matches_resident_strata(family, store):
    path = store(family, quantize=True, bits=4)
    ref = load_mlx_lm(path)
    # Quantized where the store is: 4-bit affine gate/up, and what the store left float stays so
    # (these tiny experts' down projection has 16 inputs, fewer than a group of 32).
    layout = load_manifest(path).layout
    blocks = [l.mlp if family != "mixtral" else l.block_sparse_moe for l in ref.layers]
    sw = next(b for b in blocks if "switch_mlp" in b).switch_mlp  # GLM: layer 0 is dense
    assert (sw.gate_proj.bits, sw.gate_proj.group_size) == (4, 32)
    assert ("scales" in sw.down_proj) == (layout.quant["down_proj"]["format"] == "affine")

    model = resident(path)
    ids = prompt_ids(40, seed=5)
    for step in (40, 16):  # one chunk; several (the >= 64-pair sorted path and the unsorted one)
        ours = teacher_forced_logits(model, ids, step)
        theirs = mlx_lm_logits(ref, ids, step)
        assert np.array_equal(ours, theirs), (step, np.abs(ours - theirs).max())
    assert model.expert_cache.stats.misses == 0

    ours_tokens = [r.token for r in stream_generate(model, None, ids, max_tokens=8)]
    theirs_tokens = run_mlx_lm(ref, ids, 8, 16).tokens
    assert ours_tokens == theirs_tokens
    model.expert_cache.close()


@pytest.fixture(scope="module")
def gpt_oss_store(tmp_path_factory, randomize_norms):
    """experts' format -> a store of test_families' tiny GPT-OSS (swiglu_limit 7 and YaRN
    truncate true, which mlx-lm's gpt_oss fixes; every expert axis a multiple of 32): "float",
    "affine" (4-bit, g32; dense layers too) or "mxfp4" (-q --q-mode mxfp4; dense float)."""
    import torch
    from test_families import _hf_model_q

    from strata_mlx.convert.hf import convert_hf

    ckpt = tmp_path_factory.mktemp("hf_gpt_oss_mlx_lm")
    m = _hf_model_q("gpt_oss").to(torch.float32).eval()
    randomize_norms(m)
    m.save_pretrained(ckpt)
    made = {}

    def get(experts: str):
        if experts not in made:
            made[experts] = convert_hf(
                ckpt,
                tmp_path_factory.mktemp("stores") / f"gpt_oss-{experts}",
                quantize=experts != "float",
                q_mode="mxfp4" if experts == "mxfp4" else "affine",
                q_bits=4,
                q_group_size=32,
                progress=False,
                calibration_tokens=64,
            )
        return made[experts]

    return get


@pytest.mark.parametrize("experts", ["float", "affine", "mxfp4"])
def test_mlx_lm_gpt_oss_from_store_matches_resident_strata(experts, gpt_oss_store):
    path = gpt_oss_store(experts)
    assert {s["format"] for s in load_manifest(path).layout.quant.values()} == {experts}
    ref = load_mlx_lm(path)
    sw = ref.layers[0].mlp.experts  # mlx-lm's name for them, not switch_mlp
    assert sw.gate_proj.bias.shape == (8, 32) and sw.down_proj.bias.shape == (8, 64)
    if experts == "float":
        assert "scales" not in sw.gate_proj
    else:
        assert (sw.down_proj.mode, sw.down_proj.bits, sw.down_proj.group_size) == (experts, 4, 32)

    model = resident(path)
    ids = prompt_ids(40, seed=5)
    for step in (40, 16):  # one chunk; several (sliding window 5: mlx-lm's rotating cache)
        ours = teacher_forced_logits(model, ids, step)
        theirs = mlx_lm_logits(ref, ids, step)
        if experts != "mxfp4":
            assert np.array_equal(ours, theirs), (step, np.abs(ours - theirs).max())
        else:
            # The same float32 weights on both sides (MXFP4 decodes exactly in float32), but
            # mlx-lm's gather_qmm decodes inside its matmul and our reference before gather_mm:
            # the expert dots (<= 64 terms) sum in other orders (test_mxfp4 bounds one call at
            # ~1e-7 x RMS). Measured: 3 x eps x max|logit|. A decoding or routing error is O(1e-2)
            # (this store's logits are 8e-3 from its float experts'), thousands of times this.
            bound = 16 * np.finfo(np.float32).eps * np.abs(theirs).max()
            assert np.abs(ours - theirs).max() <= bound, (step, np.abs(ours - theirs).max())
    assert model.expert_cache.stats.misses == 0

    ours_tokens = [r.token for r in stream_generate(model, None, ids, max_tokens=8)]
    theirs_tokens = run_mlx_lm(ref, ids, 8, 16).tokens
    assert ours_tokens == theirs_tokens
    model.expert_cache.close()


def test_gpt_oss_compare_side_by_side(gpt_oss_store):
    from strata_mlx.apps.baseline import compare

    ids = prompt_ids(24, seed=2)
    r = compare(gpt_oss_store("mxfp4"), ids, gen=4, step=16, log=lambda line: None)
    assert r["tokens_agree"] == r["tokens"] == 4
    # Teacher-forced: the MXFP4 bound above (16 x eps x max|logit|, max|logit| ~0.5 here). The
    # timed runs feed the last prompt token as a decode step, over mlx-lm's wrapped ring of the
    # sliding layers (sums in ring order): measured 1e-6; a decoding or routing error is 1e-2.
    assert r["max_abs_logit_diff"] < 1e-6 and r["max_abs_logprob_diff"] < 1e-5


def test_gpt_oss_stores_mlx_lm_cannot_express_fail_in_one_line(store, gpt_oss_store):
    from strata_mlx.apps.baseline import _check_runnable

    path = store("gpt_oss")  # conftest's: swiglu_limit 0.05, so that the clamps bite
    with pytest.raises(StoreError, match="limit 0.05; mlx-lm's gpt_oss fixes") as e:
        load_mlx_lm(path)
    assert "\n" not in str(e.value) and str(path) in str(e.value)
    path = gpt_oss_store("float")
    m = load_manifest(path)  # edited in memory
    m.config["tie_word_embeddings"] = True
    with pytest.raises(StoreError, match="tied embeddings"):
        _check_runnable(path, m)
    m.config.update(tie_word_embeddings=False, attention_bias=False)
    with pytest.raises(StoreError, match="attention without biases"):
        _check_runnable(path, m)


def test_stores_mlx_lm_cannot_run_fail_in_one_line(store):
    from strata_mlx.apps.baseline import _check_runnable

    path = store("qwen3_moe")
    m = load_manifest(path)  # edited in memory: what a GGUF or llama-split store's says
    m.layout.quant["down_proj"] = {"format": "gguf", "type": "IQ2_XS", "in_features": 16}
    with pytest.raises(StoreError, match="IQ2_XS") as e:
        _check_runnable(path, m)
    assert "\n" not in str(e.value) and str(path) in str(e.value)
    m.model_type = "llama"
    with pytest.raises(StoreError, match="llama split"):
        _check_runnable(path, m)


def test_half_precision_float_experts_on_the_cpu_fail_in_one_line(store):
    """mlx-lm's gather_mm on MLX's CPU backend computes float32 only: a bfloat16 float store
    is refused in one line before mlx-lm is loaded (it raised inside GatherMM::eval)."""
    import mlx.core as mx

    from strata_mlx.apps.baseline import _check_runnable

    path = store("qwen3_moe")
    m = load_manifest(path)
    _check_runnable(path, m)  # float32 experts run
    for c in m.layout.components:  # edited in memory: what a bfloat16 conversion's says
        c.dtype = "bfloat16"
    if mx.default_device() == mx.cpu:
        with pytest.raises(StoreError, match="CPU backend computes in float32 only") as e:
            _check_runnable(path, m)
        assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_missing_mlx_lm_is_one_clear_line(store, monkeypatch):
    from strata_mlx.apps.baseline import check_runnable

    monkeypatch.setitem(sys.modules, "mlx_lm", None)  # import mlx_lm raises ImportError
    with pytest.raises(StoreError, match=r"needs mlx-lm: pip install"):
        check_runnable(store("qwen3_moe"))


def test_bench_baseline_cli(store, tmp_path):
    path = store("qwen3_moe", quantize=True, bits=4)
    out = tmp_path / "b.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "strata_mlx",
            "bench",
            "--model",
            str(path),
            "-p",
            "24",
            "-g",
            "4",
            "--prefill-step-size",
            "16",
            "--policies",
            "lookahead",
            "--baseline",
            "mlx-lm",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    lines = {l.split(":")[0]: l for l in r.stdout.splitlines() if l.startswith("baseline ")}
    assert "prefill tok/s x" in lines["baseline ratio strata/mlx-lm"]
    assert "decode ms/token x" in lines["baseline ratio strata/mlx-lm"]
    assert "greedy tokens agree 4/4" in lines["baseline parity"]
    assert "max |logit diff| 0 (timed runs' |logprob diff| 0)" in lines["baseline parity"]
    b = json.loads(out.read_text())["baseline"]
    assert b["max_abs_logit_diff"] == 0.0 and b["max_abs_logprob_diff"] == 0.0
    assert b["tokens_agree"] == b["tokens"] == 4
    assert b["mlx_lm_tokens"] == b["strata_tokens"]
    assert b["mlx_lm"]["prefill_tps"] > 0 and b["strata"]["decode_ms_per_token"] > 0
    assert b["prefill_tps_ratio"] == pytest.approx(
        b["strata"]["prefill_tps"] / b["mlx_lm"]["prefill_tps"]
    )
