"""Measurement tools: KLD of logits, routing parity between runtime configurations, MoE dumps,
and their one-line errors."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import typer
from conftest import prompt_ids
from typer.testing import CliRunner

import strata_mlx
from strata_mlx.config import OptionError
from strata_mlx.format.store import load_manifest
from strata_mlx.generation.generate import teacher_forced_logits
from strata_mlx.generation.tools import (
    MoeDumper,
    dumps_equal,
    kld_report,
    load_logits,
    route_parity,
    traced_run,
)
from strata_mlx.runtime.experts import RoutingTrace
from strata_mlx.runtime.loader import RuntimeConfig

FAMILY = "qwen3_moe"
STEP = 8


def small_arena_gb(path, n_slots: int) -> float:
    return n_slots * load_manifest(path).layout.record_bytes / 1024**3


def full_arena_gb(path) -> float:
    m = load_manifest(path)
    return small_arena_gb(path, m.num_experts * len(m.moe_layers))


# Two exact configurations: every expert fits + lookahead, vs 3 slots + demand reads.
def configs(path):
    return (
        RuntimeConfig(arena_gb=full_arena_gb(path), read_ahead="lookahead", prefill_step_size=STEP),
        RuntimeConfig(
            arena_gb=small_arena_gb(path, 3), read_ahead="demand", prefill_step_size=STEP
        ),
    )


# ---- KLD -----------------------------------------------------------------------------------


def test_kld_of_a_run_against_itself_is_zero(store, tmp_path):
    path = store(FAMILY)
    model, _ = strata_mlx.load(path, read_ahead="demand")
    logits = teacher_forced_logits(model, prompt_ids(24, seed=1), STEP)
    model.expert_cache.close()
    f = tmp_path / "ref.npy"
    np.save(f, logits)
    rep = kld_report(load_logits(f), logits)
    assert rep.mean == 0.0 and rep.max == 0.0
    assert np.all(rep.per_position == 0.0) and rep.per_position.shape == (24,)
    assert rep.top1 == 1.0 and rep.top1_matches == 24
    assert "mean 0 nats" in rep.line() and "100.00%" in rep.line()


def test_kld_matches_numpy():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(16, 50)).astype(np.float32) * 3
    test = ref + rng.normal(size=ref.shape).astype(np.float32)
    rep = kld_report(ref, test)

    def softmax(a):
        e = np.exp(a.astype(np.float64) - a.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    p, q = softmax(ref), softmax(test)
    direct = (p * np.log(p / q)).sum(-1)
    assert rep.mean > 0
    np.testing.assert_allclose(rep.per_position, direct, rtol=1e-9, atol=1e-12)
    assert rep.max == pytest.approx(direct.max(), rel=1e-9)
    assert rep.top1 == pytest.approx(np.mean(ref.argmax(-1) == test.argmax(-1)))


def test_kld_shape_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r"\[4, 10\].*\[5, 10\]"):
        kld_report(np.zeros((4, 10)), np.zeros((5, 10)))


def test_bad_logits_files_name_the_file(tmp_path):
    missing = tmp_path / "missing.npy"
    text = tmp_path / "text.npy"
    text.write_text("not an array")
    flat = tmp_path / "flat.npy"
    np.save(flat, np.zeros(10, dtype=np.float32))
    ints = tmp_path / "ints.npy"
    np.save(ints, np.zeros((3, 10), dtype=np.int32))
    for f, why in [
        (missing, "no such file"),
        (text, "not a .npy"),
        (flat, "shape"),
        (ints, "dtype"),
    ]:
        with pytest.raises(ValueError, match=why) as e:
            load_logits(f)
        msg = str(e.value)
        assert str(f) in msg and "\n" not in msg


# ---- routing parity ------------------------------------------------------------------------


def test_route_parity_of_exact_configurations(store):
    path = store(FAMILY)
    ids = prompt_ids(40, seed=2)
    cfg_a, cfg_b = configs(path)
    trace_a, logits_a = traced_run(path, ids, cfg_a)
    trace_b, logits_b = traced_run(path, ids, cfg_b)
    rep = route_parity(trace_a, trace_b)
    assert rep.ok and rep.total_mismatches == 0
    assert sorted(rep.tokens) == load_manifest(path).moe_layers
    assert all(n == 40 for n in rep.tokens.values())
    assert "identical" in rep.line()
    assert np.array_equal(logits_a, logits_b)


def test_route_parity_counts_mismatches_and_ignores_order():
    a, b = RoutingTrace(), RoutingTrace()
    a.record(0, np.array([[1, 2], [3, 4], [5, 6]]))
    b.record(0, np.array([[2, 1]]))  # same set, other order; chunked differently
    b.record(0, np.array([[3, 4], [5, 7]]))
    a.record(1, np.array([[0, 1]]))
    b.record(1, np.array([[0, 1]]))
    rep = route_parity(a, b)
    assert rep.mismatches == {0: 1, 1: 0} and rep.tokens == {0: 3, 1: 1}
    assert not rep.ok and "layer 0" in rep.line()


# ---- MoE dumps -----------------------------------------------------------------------------


def test_moe_dumps_of_exact_configurations_are_byte_equal(store, tmp_path):
    path = store(FAMILY)
    ids = prompt_ids(20, seed=3)
    dirs = []
    for i, cfg in enumerate(configs(path)):
        model, _ = strata_mlx.load(path, config=cfg)
        d = tmp_path / f"dump{i}"
        model.expert_cache.dump = MoeDumper(d)
        teacher_forced_logits(model, ids, STEP)
        if i == 1:  # the small arena really streamed: more reads than slots
            assert model.expert_cache.stats.experts_read > model.expert_cache.arena.n_slots
        model.expert_cache.dump.close()
        model.expert_cache.close()
        dirs.append(d)
    names = sorted(p.name for p in dirs[0].glob("*.npy"))
    layers = load_manifest(path).moe_layers
    calls = -(-len(ids) // STEP)
    assert len(names) == len(layers) * calls * 4
    assert f"layer{layers[0]:03d}_call0000_ids.npy" in names
    ids0 = np.load(dirs[0] / f"layer{layers[0]:03d}_call0000_ids.npy")
    assert ids0.shape[-1] == 2 and np.all(np.diff(ids0, axis=-1) >= 0)
    assert np.load(dirs[0] / f"layer{layers[0]:03d}_call0000_y.npy").dtype == np.float32
    assert dumps_equal(*dirs) == []
    # a changed byte and a missing file both show
    victim = dirs[1] / names[0]
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 1
    victim.write_bytes(bytes(raw))
    (dirs[1] / names[1]).unlink()
    assert dumps_equal(*dirs) == sorted(names[:2])
    with pytest.raises(ValueError, match="nowhere"):
        dumps_equal(dirs[0], tmp_path / "nowhere")
    # a second dump into the first's directory would leave its extra calls behind
    with pytest.raises(OptionError, match="holds an earlier dump"):
        MoeDumper(dirs[0])


# ---- commands ------------------------------------------------------------------------------


def _app() -> typer.Typer:
    from strata_mlx.apps.cli.kld import kld
    from strata_mlx.apps.cli.route_parity import route_parity as command

    app = typer.Typer()
    app.command("kld")(kld)
    app.command("route-parity")(command)
    return app


def test_commands(store, tmp_path):
    path = store(FAMILY)
    runner = CliRunner()
    ref, test = tmp_path / "ref.npy", tmp_path / "test.npy"
    rng = np.random.default_rng(1)
    np.save(ref, rng.normal(size=(4, 16)).astype(np.float32))
    np.save(test, rng.normal(size=(4, 16)).astype(np.float32))
    r = runner.invoke(_app(), ["kld", "--ref", str(ref), "--test", str(test)])
    assert r.exit_code == 0 and r.output.startswith("KLD(ref||test) mean")

    r = runner.invoke(_app(), ["kld", "--ref", str(ref), "--test", str(tmp_path / "no.npy")])
    assert isinstance(r.exception, ValueError) and "no.npy" in str(r.exception)
    r = runner.invoke(_app(), ["kld", "--ref", str(ref), "--test", str(tmp_path)])
    assert str(r.exception) == f"{tmp_path}: is a directory; name a .npy file"  # ("no such")

    cfg_a, cfg_b = configs(path)
    r = runner.invoke(
        _app(),
        [
            "route-parity",
            "--model",
            str(path),
            "--prompt-tokens",
            ",".join(map(str, prompt_ids(16, seed=4))),
            "--arena-gb-a",
            str(cfg_a.arena_gb),
            "--arena-gb-b",
            str(cfg_b.arena_gb),
            "--read-ahead-a",
            "lookahead",
            "--read-ahead-b",
            "demand",
            "--prefill-step-size",
            str(STEP),
        ],
    )
    assert r.exit_code == 0, r.output
    assert "0/16 tokens differ" in r.output and "logits: bit-identical" in r.output


@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
def test_kld_of_non_finite_logits_is_refused(tmp_path, value):
    """+inf logits printed "mean nan" with exit 0: now one line through the CLI, exit 2."""
    rng = np.random.default_rng(2)
    ref, test = tmp_path / "ref.npy", tmp_path / "test.npy"
    good = rng.normal(size=(4, 16)).astype(np.float32)
    bad = good.copy()
    bad[2, 7] = value
    np.save(ref, good)
    np.save(test, bad)
    with pytest.raises(OptionError, match=f"{test}: logits hold 1 non-finite values .* position 2, "
                       "token 7"):  # fmt: skip
        load_logits(test)
    with pytest.raises(OptionError, match="test: logits hold 1 non-finite"):
        kld_report(good, bad)  # arrays, as generate --logits-ref passes its own
    r = subprocess.run([sys.executable, "-m", "strata_mlx", "kld", "--ref", str(ref), "--test",
                        str(test)], capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "non-finite" in r.stderr and "nan" not in r.stdout


@pytest.mark.parametrize(
    "args, says",
    [
        (["--arena-gb-a", "0"], "--arena-gb-a 0.0: expected a finite number"),
        (["--read-ahead-b", "bogus"], "--read-ahead-b 'bogus': one of demand"),
        (["--io-workers", "0"], "--io-workers 0: expected an integer"),
        # a 100 M-token prompt ran silent until killed: the context bounds it
        (["--random-tokens", "100000000"], "--random-tokens: 100000000 tokens, more than the"),
    ],
)
def test_route_parity_names_the_flag_at_fault(store, args, says):
    from strata_mlx.apps.cli import app

    r = CliRunner().invoke(app, ["route-parity", "--model", str(store(FAMILY)), *args])
    assert r.exit_code == 2
    assert r.stderr.startswith(f"error: {says}") and r.stderr.count("\n") == 1, r.stderr
