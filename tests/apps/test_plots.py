"""`bench --plot`: per-layer counters that add up to the cache's own, and a
PNG that opens."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")


def test_bench_plot_writes_a_png_whose_layers_add_up(store, tmp_path):
    import matplotlib.image

    from strata_mlx.apps.bench import bench

    out = tmp_path / "bench.png"
    result = bench(
        store("qwen3_moe"),
        prompt_tokens=32,
        gen_tokens=3,
        prefill_step_size=16,
        policies=("lookahead",),
        probe_seconds=0.2,
        arena_gb=0.0005,
        log=lambda *_: None,
        plot=out,
    )
    img = matplotlib.image.imread(out)
    assert img.ndim == 3 and img.shape[0] > 300 and img.shape[1] > 300
    runs = {(r["policy"], r["phase"]): r for r in result["runs"]}
    for fig in result["plot"]:
        summary = runs[(fig["policy"], fig["phase"])]
        # Exact: the per-layer spans are cut where bench takes the chunks' and decode's stats
        # (the last prompt token's forward, in neither, is its own phase "first").
        for phase, pct in (("prefill", "miss_pct"), ("decode", "decode_miss_pct")):
            rows = fig["layers"][phase]
            assert rows and all(len(v) == 3 for v in rows.values())
            misses = sum(v[2] for v in rows.values())
            lookups = sum(sum(v) for v in rows.values())
            assert misses == pytest.approx(summary[pct] / 100 * lookups, abs=1e-6), phase
        prefill = fig["layers"]["prefill"]
        ahead = sum(v[1] for v in prefill.values()) / sum(sum(v) for v in prefill.values())
        assert 100 * ahead == pytest.approx(summary["streamed_ahead_pct"], abs=1e-6)
        assert len(fig["chunks"]) == 2 and all(c["gb_per_s"] >= 0 for c in fig["chunks"])
        assert set(fig["decode_ms"]) == {"wait", "sync", "host", "rest"}
