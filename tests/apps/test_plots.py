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


def _result(n_chunks: int) -> dict:
    def run(policy, phase, scale):
        return {
            "policy": policy,
            "phase": phase,
            "layers": {"prefill": {"0": [5, 2, 1], "1": [4, 3, 1]}},
            "chunks": [
                {
                    "gb_per_s": 0.02 * scale,
                    "ms": 5.0 * scale,
                    "ssd_floor_ms": 0.5,
                    "compute_floor_ms": 2.0,
                }  # fmt: skip
                for _ in range(n_chunks)
            ],
            "decode_ms": {"wait": 0.1, "sync": 0.2, "host": 0.3, "rest": 1.0},
        }

    runs = [run(p, ph, i + 1) for i, p in enumerate(("demand", "lookahead"))
            for ph in ("cold", "warm")]  # fmt: skip
    return {"store": "s", "prompt_tokens": 16 * n_chunks, "prefill_step_size": 16,
            "arena_gb": 0.1, "expert_gb": 1.0, "ssd_gbps": 0.3, "plot": runs}  # fmt: skip


@pytest.mark.parametrize("n_chunks", [1, 12])
def test_bench_plot_reads_alike_for_one_chunk_and_many(n_chunks, tmp_path, monkeypatch):
    """Looked at as a person would: whole-numbered chunk ticks, y axes from 0 (one chunk is
    not a lone dot on a +-4 % band), one colour per policy in every panel, legends beside
    the panels rather than over the data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from strata_mlx.apps.plots import plot_bench

    figs = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda f=None: (figs.append(f), close(f)))
    plot_bench(_result(n_chunks), tmp_path / "p.png")
    (fig,) = figs
    fig.canvas.draw()
    ax = fig.axes
    gbps, chunk_ms = ax[1], ax[2]
    colours = {}
    for a in (gbps, chunk_ms):
        assert a.get_ylim()[0] == 0
        ticks = [t for t in a.get_xticks() if a.get_xlim()[0] <= t <= a.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
        for line in a.get_lines():
            policy = line.get_label().split()[0]
            if policy in ("demand", "lookahead"):
                colours.setdefault(policy, set()).add(matplotlib.colors.to_hex(line.get_color()))
    assert all(len(c) == 1 for c in colours.values()) and len(colours) == 2, colours
    for a in ax:
        legend = a.get_legend()
        if legend is not None:
            box, panel = legend.get_window_extent(), a.get_window_extent()
            assert box.x0 >= panel.x1 - 1, a.get_title()
