"""`strata-mlx plan` at the edges of what it is asked: the model's context, the KV cache of a
long context, a prompt shorter than a chunk, one target flag alone, --measure where it cannot
time anything, and -p / -g in the millions (a forecast's cost bounded, not a token each)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from test_plan import _machine, _shape
from typer.testing import CliRunner

from strata_mlx.apps import plan
from strata_mlx.apps.plan import residency
from strata_mlx.config import OptionError
from strata_mlx.runtime.loader import GB
from strata_mlx.stream import memory


@pytest.fixture
def canned(monkeypatch, tmp_path):
    """plan() without this machine's calibration (seconds): a fixed compute."""
    monkeypatch.setenv("STRATA_MLX_HOME", str(tmp_path))
    compute = (plan.Compute.of((1e-3, 5e-3)), "fake-stream (canned)", "calibration: canned")
    monkeypatch.setattr(plan, "_calibrated", lambda *a: compute)


def test_the_kv_cache_of_prompt_and_generated_tokens_counts_in_the_verdict(store):
    """The KV cache grows to -p + -g positions, not one chunk's: where it cannot be held
    beside one expert the verdict says so and names -p / -g; where it can, the automatic arena
    leaves it room and a note says load()'s own counts one chunk."""
    from strata_mlx.runtime.loader import prefill_scratch_bytes

    shape = plan.model_shape(store("qwen3_moe"))
    kv = functools.partial(memory.kv_cache_bytes, shape.args, itemsize=shape.kv_itemsize)
    assert kv(256) == 256 * 256  # 2 layers of 2 KV heads of 8, float32: 256 bytes a position
    one_chunk = prefill_scratch_bytes(shape.args, 64) + kv(64)
    # 200 KiB beside one chunk's KV cache: with a quarter kept free, every expert (16 of 8 KiB)
    machine = _machine(avail=memory.RESERVE + one_chunk + 200 * 1024)
    short = plan.forecast(shape, machine, (1e-3, 1e-2), "test", None, 64, 64, 8)
    assert short.fits and short.slots == shape.n_records
    assert not any("one chunk's KV cache" in n for n in short.notes)

    f = plan.forecast(shape, machine, (1e-3, 1e-2), "test", None, 64, 400, 8)  # 64 KiB more
    assert f.fits and f.slots < shape.n_records
    assert any("one chunk's KV cache" in n for n in f.notes)
    assert f.kv_cache_gb == pytest.approx(kv(408) / 1024**3)  # (GiB, as the arena's)
    assert f"KV cache {f.kv_cache_gb:.2f} GB (408 positions)" in "\n".join(f.lines())

    f = plan.forecast(shape, machine, (1e-3, 1e-2), "test", None, 64, 2000, 8)  # 448 KiB more
    assert not f.fits
    assert "the KV cache of -p 2000 + -g 8 tokens" in f.verdict
    assert "shorten -p or -g" in f.verdict
    # an arena given (8 experts' worth) fits beside one chunk's KV cache, not beside -p + -g's:
    # the verdict names them, not the memory guard's smaller --arena-gb
    f = plan.forecast(shape, machine, (1e-3, 1e-2), "test", 8 * 8192 / 1024**3, 64, 2000, 8)
    assert not f.fits and "the KV cache of -p 2000 + -g 8 tokens" in f.verdict


def test_plan_refuses_a_prompt_and_generation_past_the_models_context(store, canned):
    """As generate does: one line naming -p (and -g), and the context (512 here)."""
    from strata_mlx.apps.cli import app

    path = str(store("qwen3_moe"))
    r = CliRunner().invoke(app, ["plan", path, "-p", "600", "--target-memory", "24"])
    assert r.exit_code == 2 and "-p" in r.output and "context of 512" in r.output
    assert len(r.output.strip().splitlines()) == 1
    r = CliRunner().invoke(app, ["plan", path, "-p", "500", "-g", "20", "--target-memory", "24"])
    assert r.exit_code == 2 and "-p 500 + -g 20" in r.output and "context of 512" in r.output
    with pytest.raises(OptionError, match="gen_tokens 20"):
        plan.plan(path, prompt_tokens=500, gen_tokens=20, target_memory_gb=24)
    f = plan.plan(path, prompt_tokens=500, gen_tokens=12, target_memory_gb=24, probe_seconds=0.05)
    assert f.fits


def test_a_prompt_shorter_than_a_chunk_needs_at_most_its_own_experts():
    """One token of top-2 in 4 layers needs 8 experts, not a 64-token chunk's; with 2 slots a
    layer's 2 fit: no note of expert-major groups."""
    shape = _shape(layers=4, experts=16, k=2)
    arena_gb = 2 * shape.record_bytes / GB
    f = plan.forecast(shape, _machine(), (1e-3, 1e-2), "test", arena_gb, 64, 1, 4)
    assert f.slots == 2
    assert f.distinct_per_chunk == pytest.approx(8.0)
    assert not any("expert-major" in n for n in f.notes)
    whole = plan.forecast(shape, _machine(), (1e-3, 1e-2), "test", arena_gb, 64, 64, 4)
    assert whole.distinct_per_chunk > 50
    assert any("expert-major" in n for n in whole.notes)


def test_target_tflops_alone_sets_the_compute(store, canned):
    """--target-tflops without a target memory or drive: this machine's, at that rate."""
    path = store("qwen3_moe")
    kw = dict(prompt_tokens=64, prefill_step_size=32, gen_tokens=4, probe_seconds=0.05)
    slow = plan.plan(path, target_tflops=0.001, **kw)
    fast = plan.plan(path, target_tflops=1000, **kw)
    assert slow.machine == fast.machine == "this machine"
    assert "0.001 TFLOP/s" in slow.compute_source and "1e+03 TFLOP/s" in fast.compute_source
    assert slow.compute_floor_s > 1e5 * fast.compute_floor_s
    assert slow.prefill_tps < fast.prefill_tps


def test_measure_where_it_cannot_time_anything_is_refused(store, hf_checkpoint, canned):
    """--measure times this store's own chunk on this machine: with a target, or of a
    checkpoint, it is refused in one line naming it, not dropped."""
    from strata_mlx.apps.cli import app

    path = str(store("qwen3_moe"))
    for target in ("--target-memory", "--target-ssd-gbps", "--target-tflops"):
        r = CliRunner().invoke(app, ["plan", path, "-p", "64", "--measure", target, "8"])
        assert r.exit_code == 2 and "--measure" in r.output and target in r.output
    with pytest.raises(OptionError, match="measure times a store's own chunk.*Hugging Face"):
        plan.plan(hf_checkpoint("qwen3_moe"), prompt_tokens=64, measure=True)


def test_a_forecasts_cost_does_not_grow_with_g_or_the_chunks(monkeypatch):
    """-g 16 M is simulated in ~1,650 runs of tokens, the decoder's rule a few times each
    (not 16 M times); a prompt of 200,000 one-token chunks in ~1,370 runs; the tokens and
    chunks they stand for add up."""
    import strata_mlx.runtime.decode as decode

    calls = []
    choose = decode.choose_mode

    def counted(*a, **kw):
        calls.append(1)
        assert len(calls) < 20_000, "the decoder's rule run token by token"
        return choose(*a, **kw)

    monkeypatch.setattr(decode, "choose_mode", counted)
    hit_probability = residency.hit_probability

    def counted_hits(*a, **kw):  # decode_hits' residency: twice a token it evaluates
        calls.append(1)
        assert len(calls) < 20_000, "the residency evaluated token by token"
        return hit_probability(*a, **kw)

    monkeypatch.setattr(residency, "hit_probability", counted_hits)
    shape = _shape()
    p = plan.pick_probabilities(shape)
    c = plan.Compute(1e-3, 0.010, 0.020, 0.030, handshake_s=1e-4, recall={1: 0.5})
    for slots in (shape.n_records, 16):
        d = plan.decode_forecast(shape, _machine(ssd=1e9), c, p, slots, 64, 1 << 24, 64)
        assert sum(d["modes"].values()) == 1 << 24
        assert 0 < d["s_per_token"] < 1
        calls.clear()
    chunks = residency.prefill_reads(p, 16, 200_000, 1)
    assert len(chunks) < 1400 and sum(n * t for _, n, t, _ in chunks) == 200_000
    assert len(residency.runs(1 << 24)) < 1700


def test_decode_in_runs_matches_decode_token_by_token():
    """Past the first tokens, runs of tokens give what the decoder's rule gives token by token
    (here: the same forecast with every token exact, on an arena where the decoder's mode
    alternates near its threshold)."""
    rng = np.random.default_rng(0)
    L, E, k = 12, 128, 8
    prof = rng.zipf(1.8, size=(L, E)).astype(float)
    shape = plan.ModelShape("store", "x", "qwen3_moe", 1 << 20, E, L, k, 0, 1, profile=prof)
    p = plan.pick_probabilities(shape)
    c = plan.Compute(
        1e-3, 0.010, 0.020, 0.030, handshake_s=1e-4, recall={1: 0.6, 2: 0.5}, position_s=1e-7
    )
    args = (shape, _machine(ssd=2.0), c, p, L * E // 2, 2048, 4000, 512)
    runs = plan.decode_forecast(*args)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(residency, "EXACT_STEPS", 10**9)
        exact = plan.decode_forecast(*args)
    assert len(runs["modes"]) == 2  # it does alternate
    assert runs["s_per_token"] == pytest.approx(exact["s_per_token"], rel=0.01)
    for mode, n in exact["modes"].items():
        assert runs["modes"][mode] == pytest.approx(n, rel=0.02)
    assert runs["shares"] == pytest.approx(exact["shares"], abs=1e-3)
