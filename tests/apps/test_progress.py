"""Long steps a user starts show progress on stderr: conversion's calibration pass, warm(),
and a prefill that outlasts its delay (generate's prompt bar)."""

from __future__ import annotations

import time

from strata_mlx.apps.cli.generate import PrefillBar
from strata_mlx.runtime import experts


def test_conversions_calibration_pass_shows_a_bar(hf_checkpoint, tmp_path, capsys):
    from strata_mlx.convert.hf import convert_hf

    convert_hf(hf_checkpoint("qwen3_moe"), tmp_path / "s", calibration_tokens=16, progress=True)
    assert "calibration" in capsys.readouterr().err
    convert_hf(hf_checkpoint("qwen3_moe"), tmp_path / "t", calibration_tokens=16, progress=False)
    assert "calibration" not in capsys.readouterr().err


def test_warm_shows_a_bar_once_it_outlasts_its_delay(store, monkeypatch, capsys):
    from strata_mlx.runtime.loader import load

    model, _ = load(store("qwen3_moe"), arena_gb=0.01)
    try:
        monkeypatch.setattr(experts, "WARM_BAR_DELAY_S", 0.0)
        model.expert_cache.warm()
    finally:
        model.expert_cache.close()
    assert "warm" in capsys.readouterr().err


def test_prefill_bar_speaks_only_past_its_delay(monkeypatch, capsys):
    bar = PrefillBar()
    bar.update(0, 100)
    bar.update(100, 100)
    bar.close()
    assert "prefill" not in capsys.readouterr().err  # a short prefill stays quiet
    monkeypatch.setattr(PrefillBar, "DELAY_S", 0.05)
    bar = PrefillBar()
    bar.update(0, 100)
    time.sleep(1.2)  # the timer redraws it while the one chunk runs
    assert "prefill" in capsys.readouterr().err
    bar.update(50, 100)
    bar.close()
    assert "50/100" in capsys.readouterr().err


def test_a_long_step_without_progress_of_its_own_ticks(capsys):
    """gguf-py's header parse reports nothing for seconds: its bar shows the time elapsed."""
    from strata_mlx.convert.common import ticking

    with ticking("reading model.gguf"):
        time.sleep(1.3)
    err = capsys.readouterr().err
    assert "reading model.gguf: 00:01" in err, err
    with ticking("reading model.gguf", enabled=False):
        pass
    assert capsys.readouterr().err == ""
