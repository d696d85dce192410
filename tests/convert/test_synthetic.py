"""Synthetic stores: their outputs depend on their experts, so a wrong expert
byte shows in logits and tokens, as it would on a real model."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
from conftest import prompt_ids

import strata_mlx
from strata_mlx.format.store import EXPERTS, load_manifest
from strata_mlx.generation.generate import stream_generate, teacher_forced_logits

# bench-small's recipe (2-bit experts, group 64, structured router) at a CPU-test size.
TINY = dict(
    num_hidden_layers=3,
    num_experts=32,
    num_experts_per_tok=4,
    hidden_size=128,
    moe_intermediate_size=64,
    intermediate_size=256,
    vocab_size=256,
    num_attention_heads=2,
    head_dim=64,
)


def tiny_synthetic(path, *extra):
    sets = [arg for k, v in TINY.items() for arg in ("--set", f"{k}={v}")] + list(extra)
    r = subprocess.run(
        [sys.executable, "-m", "strata_mlx", "convert", "--synthetic", "bench-small"]
        + ["--mlx-path", str(path), "--dtype", "float32", "--calibration-tokens", "32", *sets],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    return path


def zero_layer(src, dst, layer: int):
    """A copy of the store whose `layer` experts' records are all zero bytes (weights, scales
    and biases 0: every expert of the layer outputs 0). Checksums are left stale."""
    shutil.copytree(src, dst)
    m = load_manifest(dst)
    with open(dst / EXPERTS, "r+b") as f:
        for e in range(m.num_experts):
            off, _ = m.record(layer, e)
            f.seek(off)
            f.write(bytes(m.layout.record_bytes))
    return dst


def intact_and_broken(path, tmp_path):
    """Logits and greedy tokens of the store at `path` and of its copy with layer 1 zeroed."""
    broken = zero_layer(path, tmp_path / "broken", layer=1)
    ids = prompt_ids(32, seed=4, vocab=256)
    runs = {}
    for name, p in (("intact", path), ("broken", broken)):
        model, _ = strata_mlx.load(p, verify=False)  # the broken copy's checksums are stale
        logits = teacher_forced_logits(model, ids, step=16)
        tokens = [r.token for r in stream_generate(model, None, ids, max_tokens=16)]
        runs[name] = logits, tokens
        model.expert_cache.close()
    return runs["intact"], runs["broken"]


def test_corrupt_experts_change_logits_and_tokens(tmp_path):
    path = tiny_synthetic(tmp_path / "synth")
    manifest = json.loads((path / "manifest.json").read_text())
    assert all(manifest["config"][k] == v for k, v in TINY.items())
    assert manifest["config"]["synthetic"]["recipe"] == "default"
    (ref, ref_tokens), (bad, bad_tokens) = intact_and_broken(path, tmp_path)
    diff = np.abs(bad - ref)
    # Numerical noise here is ~1e-6 (float32 logits of magnitude ~1; CPU runs are bit-exact);
    # one layer's experts move the logits by a sizeable share of their own spread.
    assert diff.max() > 0.1 * ref.std() > 1e4 * np.finfo(np.float32).eps * np.abs(ref).max()
    assert np.sqrt(np.mean(diff**2)) > 0.05 * ref.std()
    assert np.mean(bad.argmax(-1) != ref.argmax(-1)) > 0.1  # teacher-forced top-1 moves
    assert bad_tokens != ref_tokens


def test_recipe_weak_experts_is_the_store_whose_experts_hardly_matter(tmp_path):
    """`--recipe weak-experts`: zeroing a layer's experts leaves its greedy tokens as they
    were."""
    path = tiny_synthetic(tmp_path / "old", "--recipe", "weak-experts")
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["config"]["synthetic"]["recipe"] == "weak-experts"
    (ref, ref_tokens), (bad, bad_tokens) = intact_and_broken(path, tmp_path)
    # Every residual update is x0.02 of the default recipe's: zeroing layer 1 moved the logits
    # by at most 4e-5 here (spread 0.55), the default recipe's by 1.29; 0.02 of the spread
    # sits between the two by orders of magnitude either side.
    diff = np.abs(bad - ref)
    assert diff.max() < 0.02 * ref.std(), (diff.max(), ref.std())
    assert bad_tokens == ref_tokens


def test_recipe_before_issue_17_is_the_old_name_of_weak_experts():
    """The recipe's earlier name stays accepted; the store records the current one."""
    from strata_mlx.convert.synthetic import Recipe

    old = Recipe.named("before-issue-17")
    assert old == Recipe.named("weak-experts") == Recipe.weak_experts() != Recipe()
    assert old.manifest_entry() == "weak-experts"


def _convert(path, *extra) -> subprocess.CompletedProcess:
    sets = [arg for k, v in TINY.items() for arg in ("--set", f"{k}={v}")] + list(extra)
    return subprocess.run(
        [sys.executable, "-m", "strata_mlx", "convert", "--synthetic", "bench-small"]
        + ["--mlx-path", str(path), "--calibration-tokens", "4", *sets],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_set_takes_a_bool_as_a_word_and_refuses_shapes_no_expert_fits(tmp_path):
    """--set norm_topk_prob=false wrote true (bool("false")); an expert width or group the
    experts cannot take was a ZeroDivisionError, or failed after the whole conversion."""
    r = _convert(tmp_path / "s", "--set", "norm_topk_prob=false")
    assert r.returncode == 0, r.stderr
    assert load_manifest(tmp_path / "s").config["norm_topk_prob"] is False
    for bad, says in [
        ("expert_group_size=0", "expert_group_size 0: one of"),
        ("expert_bits=0", "expert_bits 0: one of"),
        ("hidden_size=100", "hidden_size 100: expert inputs come in groups"),
        ("norm_topk_prob=maybe", "'maybe' is not a valid bool"),
    ]:
        r = _convert(tmp_path / "bad", "--set", bad)
        assert r.returncode == 2 and says in r.stderr, (bad, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "bad").exists()


def test_a_synthetic_shape_is_a_name_not_a_path(tmp_path):
    for name in ("../runtime/h200", str(tmp_path / "x")):
        r = subprocess.run(
            [sys.executable, "-m", "strata_mlx", "convert", "--synthetic", name]
            + ["--mlx-path", str(tmp_path / "s")],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert r.returncode != 0 and "no such synthetic shape" in r.stderr, r.stderr
