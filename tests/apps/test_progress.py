"""Long steps a user starts show progress on stderr: conversion's calibration pass, warm(),
a prefill that outlasts its delay (generate's prompt bar), and bench's runs."""

from __future__ import annotations

import io
import re
import time

from strata_mlx.apps.cli.generate import PrefillBar
from strata_mlx.progress import StatusLine
from strata_mlx.runtime import experts


def test_conversions_calibration_pass_shows_a_bar(hf_checkpoint, tmp_path, capsys):
    from strata_mlx.convert.hf import convert_hf

    convert_hf(hf_checkpoint("qwen3_moe"), tmp_path / "s", calibration_tokens=16, progress=True)
    assert "calibration" in capsys.readouterr().err
    convert_hf(hf_checkpoint("qwen3_moe"), tmp_path / "t", calibration_tokens=16, progress=False)
    assert "calibration" not in capsys.readouterr().err


def test_warm_shows_a_bar_once_it_outlasts_its_delay(store, monkeypatch, capsys):
    from strata_mlx.runtime.loader import load_model

    model = load_model(store("qwen3_moe"), arena_gb=0.01)
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
    monkeypatch.setattr(StatusLine, "DELAY_S", 0.05)
    bar = PrefillBar()
    bar.update(0, 100)
    err = []  # the timer draws it while the one chunk runs
    assert until(lambda: err.append(capsys.readouterr().err) or "prefill" in "".join(err))
    bar.update(50, 100)
    bar.close()
    assert "50/100" in capsys.readouterr().err


def test_the_prefill_bar_names_the_moe_layer_a_chunk_has_reached(store, monkeypatch, capsys):
    """A chunk of a long prompt takes seconds and its bar moved a chunk at a time (a 371-token
    prompt sat at 0 % for 14 s): each draw names the chunk's MoE layer."""
    from strata_mlx.apps.cli.generate import where_in_chunk
    from strata_mlx.runtime.loader import load_model

    model = load_model(store("qwen3_moe"), arena_gb=0.01)
    try:
        where, layers = where_in_chunk(model), model.expert_cache.layers
        assert where() == ""  # (no handshake yet)
        model.expert_cache.arena.set_layer(layers[-1])
        assert where() == f"layer {len(layers)}/{len(layers)}"
        monkeypatch.setattr(StatusLine, "DELAY_S", 0.05)
        bar = PrefillBar(where)
        bar.update(0, 100)
        err = []  # the timer draws it while the one chunk runs
        assert until(lambda: err.append(capsys.readouterr().err) or "layer 2/2" in "".join(err))
        bar.close()
    finally:
        model.expert_cache.close()


def test_a_long_step_without_progress_of_its_own_ticks(capsys):
    """gguf-py's header parse reports nothing for seconds: its bar shows the time elapsed."""
    from tqdm import tqdm

    from strata_mlx.progress import ticking

    with ticking("reading model.gguf"):
        time.sleep(1.3)
    err = capsys.readouterr().err
    assert re.search(r"reading model.gguf: 00:0[12]", err), err
    assert err.endswith("\n") and "\n" not in err[:-1]  # kept, as conversion's bars are
    assert not tqdm._instances  # (a kept line let go of by tqdm too)
    with ticking("reading model.gguf", enabled=False):
        pass
    assert capsys.readouterr().err == ""


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def until(test, seconds: float = 5.0) -> bool:
    """Polls `test` until it holds (a timer thread draws about once a second)."""
    end = time.monotonic() + seconds
    while not test():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def test_status_line_shows_past_its_delay_and_clears_itself(monkeypatch, capsys):
    out = Terminal()
    line = StatusLine(file=out)  # on by default on a terminal
    line.set("demand cold: prefill 0/64 tok")
    line.echo("a figure")
    line.close()
    assert out.getvalue() == ""  # a quick command prints no status
    assert capsys.readouterr().out == "a figure\n"  # its output goes to stdout
    monkeypatch.setattr(StatusLine, "DELAY_S", 0.05)
    out = Terminal()
    line = StatusLine(file=out)
    line.set("demand cold: prefill 0/64 tok")
    # one step with no news: the timer draws the time elapsed
    assert until(lambda: "demand cold: prefill 0/64 tok [00:0" in out.getvalue())
    shown = len(out.getvalue())
    line.echo("a figure")  # cleared, printed on stdout, drawn again
    assert capsys.readouterr().out == "a figure\n"
    again = out.getvalue()[shown:]
    assert again.startswith("\r") and re.search(r"prefill 0/64 tok \[00:\d\d\]$", again)
    line.set("demand cold: decode 3/8 tok")
    assert until(lambda: "decode 3/8 tok" in out.getvalue())
    line.close()
    assert out.getvalue().endswith("\r")  # the line cleared, the cursor back at its start
    assert capsys.readouterr().out == ""
    assert StatusLine(file=io.StringIO()).bar.disable  # not a terminal: no status by default


def test_bench_tells_its_status_by_chunk_and_token(store):
    from strata_mlx.apps.bench import run_policy
    from strata_mlx.runtime.loader import load_model

    said = []
    model = load_model(store("qwen3_moe"), arena_gb=0.01)
    try:
        run_policy(model, list(range(1, 40)), 3, 16, "demand", "cold", status=said.append)
    finally:
        model.expert_cache.close()
    prefill = [s for s in said if "prefill" in s]
    assert prefill[0] == "demand cold: prefill 0/39 tok"
    assert "demand cold: prefill 16/39 tok" in prefill and prefill[-1].endswith("39/39 tok")
    assert [s for s in said if "decode" in s] == [
        f"demand cold: decode {i}/3 tok" for i in (1, 2, 3)
    ]


def test_cache_prompt_shows_the_prompts_progress(store, tmp_path, monkeypatch):
    """A long system prompt cached for an agent prefills for minutes on a large model: the
    command shows generate's prompt bar, fed by the prefill's chunks."""
    from typer.testing import CliRunner

    from strata_mlx.apps.cli import app
    from strata_mlx.generation.generate import cache_prompt
    from strata_mlx.runtime.loader import load_model

    model = load_model(store("qwen3_moe"), arena_gb=0.01)
    told = []
    try:
        cache_prompt(
            model, list(range(1, 40)), None, 16, prompt_progress_callback=lambda *a: told.append(a)
        )
    finally:
        model.expert_cache.close()
    assert told == [(0, 39), (16, 39), (32, 39), (38, 39), (39, 39)]
    monkeypatch.setattr(StatusLine, "DELAY_S", 0.0)
    out = tmp_path / "c.safetensors"
    ids = ",".join(str(i) for i in range(1, 40))
    args = ["cache-prompt", "--model", store("qwen3_moe"), "--prompt-tokens", ids]
    r = CliRunner().invoke(app, [*map(str, args), "--prompt-cache-file", str(out)])
    assert r.exit_code == 0, r.output
    assert "prefill" in r.stderr and "39/39" in r.stderr and out.exists()


def test_route_parity_tells_each_runs_positions(store, monkeypatch):
    """route-parity loads and teacher-forces a prompt twice (seconds on a real store, silent
    before): its status line names the run and the positions done, a chunk at a time."""
    from typer.testing import CliRunner

    from strata_mlx.apps.cli import app, route_parity

    said, closed = [], []

    class Recorded:
        def set(self, text):
            said.append(text)

        def close(self):
            closed.append(True)

    monkeypatch.setattr(route_parity, "StatusLine", Recorded)
    ids = ",".join(str(i) for i in range(1, 21))
    args = ["route-parity", "--model", store("qwen3_moe"), "--prompt-tokens", ids]
    r = CliRunner().invoke(app, [*map(str, args), "--prefill-step-size", "8"])
    assert r.exit_code == 0, r.output
    runs = [("a", "lookahead"), ("b", "demand")]
    assert said == [
        f"run {n} ({p}): {s}"
        for n, p in runs
        for s in ["loading", "8/20 positions", "16/20 positions", "20/20 positions"]
    ]
    assert closed == [True] and "logits: bit-identical" in r.stdout
