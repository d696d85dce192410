"""mlx-lm's own model built from our stores (strata_mlx.baseline) against strata-mlx's fully
resident model: the same logits, bit for bit, and the same greedy tokens; the bench's
side-by-side run."""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from conftest import prompt_ids

import strata_mlx
from strata_mlx.baseline import load_mlx_lm, run_mlx_lm
from strata_mlx.generate import stream_generate, teacher_forced_logits
from strata_mlx.store import StoreError, load_manifest

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


def test_stores_mlx_lm_cannot_run_fail_in_one_line(store):
    from strata_mlx.baseline import _check_runnable

    path = store("qwen3_moe")
    m = load_manifest(path)  # edited in memory: what a GGUF or llama-split store's says
    m.layout.quant["down_proj"] = {"format": "gguf", "type": "IQ2_XS", "in_features": 16}
    with pytest.raises(StoreError, match="IQ2_XS") as e:
        _check_runnable(path, m)
    assert "\n" not in str(e.value) and str(path) in str(e.value)
    m.model_type = "llama"
    with pytest.raises(StoreError, match="llama split"):
        _check_runnable(path, m)


def test_missing_mlx_lm_is_one_clear_line(store, monkeypatch):
    from strata_mlx.baseline import check_runnable

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
