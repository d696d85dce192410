"""Synthetic routing traces (strata_mlx.stream.synthetic_trace): each knob moves the statistic it
names, the published preset hits what it is matched to, and the file is a trace cache-sim
reads."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from strata_mlx.apps import cache_sim
from strata_mlx.config import OptionError
from strata_mlx.format.store import write_atomic
from strata_mlx.stream import trace
from strata_mlx.stream.synthetic_trace import (
    PRESETS,
    RoutingKnobs,
    check,
    main,
    make_trace,
    routing,
    summary,
)

SMALL = RoutingKnobs(num_experts=512, top_k=10, layers=4)


def stats(**knobs) -> dict:
    k = dataclasses.replace(SMALL, **knobs)
    return summary(make_trace(k, 256, 256, 128), k)


def overlap_of_consecutive_layers(**knobs) -> float:
    ids, _ = routing(dataclasses.replace(SMALL, **knobs), 256)
    return float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(ids[0], ids[1])]))


def test_each_knob_moves_what_it_names():
    assert (
        stats(reuse=0.95, context=0.9)["lru128_hit"]
        > stats(reuse=0.0, context=0.9)["lru128_hit"] + 0.1
    )
    assert stats(skew=4.0)["top64_share"] > stats(skew=0.0)["top64_share"] + 0.1
    assert (
        overlap_of_consecutive_layers(layer_corr=0.99)
        > overlap_of_consecutive_layers(layer_corr=0.0) + 0.2
    )
    assert stats(drift=0.1)["lookahead_recall"] > stats(drift=1.0)["lookahead_recall"] + 0.1


def test_the_published_preset_hits_81_percent_in_a_per_layer_lru_of_128():
    published, store = (dataclasses.replace(PRESETS[p], layers=12) for p in ("published", "store"))
    s = summary(make_trace(published), published)
    assert 0.78 < s["lru128_hit"] < 0.84
    assert 0.65 < s["lookahead_recall"] < 0.8
    assert s["lru128_hit"] > summary(make_trace(store), store)["lru128_hit"] + 0.15


def test_a_synthetic_trace_is_shaped_as_a_run_records_it(tmp_path):
    t = make_trace(SMALL, prompt_tokens=20, decode_tokens=5, prefill_step_size=8, record_bytes=4096)
    # the prompt but its last token in chunks of 8, that token, then 5 decode calls
    assert [len(c) for c in t.ids[0]] == [8, 8, 3, 1, 1, 1, 1, 1, 1]
    assert t.decode_from == 4 and t.decode_tokens == 5
    assert set(t.predicted) == {1, 2, 3}
    f = tmp_path / "s.npz"
    main([str(f), "--preset", "store", "--prompt-tokens", "64", "--decode-tokens", "8",
          "--set", "layers=3", "--record-bytes", "4096"])  # fmt: skip
    back = trace.read(f)
    assert back.layers == [0, 1, 2] and back.decode_tokens == 8 and back.record_bytes == 4096
    r = cache_sim.replay(back, 600, "lru")
    assert r.decode_lookups == 8 * 3 * 10  # one token's top-10 are distinct


def test_bad_knobs_are_refused():
    with pytest.raises(OptionError, match="reuse"):
        routing(dataclasses.replace(SMALL, reuse=1.5), 10)
    with pytest.raises(SystemExit, match="error: --set nope=1: no such knob"):
        main(["/tmp/unused.npz", "--set", "nope=1"])
    with pytest.raises(SystemExit, match="error: reuse 2.0"):
        main(["/tmp/unused.npz", "--set", "reuse=2"])


@pytest.mark.parametrize(
    "args, says",
    [
        (["--set", "skew=nan"], "error: skew nan: expected a number from 0 to"),
        (["--set", "skew=inf"], "error: skew inf: expected a number from 0 to"),
        (["--set", "drift=nan"], "error: drift nan: expected a number from 0 to"),
        (["--record-bytes", "-5"], "error: --record-bytes -5: expected a number of bytes >= 0"),
    ],
)
def test_bad_flags_are_one_line_and_write_nothing(tmp_path, args, says):
    out = tmp_path / "t.npz"
    with pytest.raises(SystemExit, match=says):
        main([str(out), *args])
    assert not out.exists()


def test_a_trace_holds_at_most_a_store_s_experts_a_layer():
    # (past it the file written is one the reader refuses)
    with pytest.raises(OptionError, match="num_experts 2000000: expected 1 to 1048576"):
        check(dataclasses.replace(SMALL, num_experts=2_000_000))


def test_an_output_that_cannot_be_written_is_one_line(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match=f"error: {tmp_path}: is a directory; name a file"):
        main([str(tmp_path)])
    with pytest.raises(SystemExit, match=f"error: {tmp_path / 'no' / 't.npz'}: no directory"):
        main([str(tmp_path / "no" / "t.npz")])

    def full_disk(tmp):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(trace, "write_atomic", lambda path, save: write_atomic(path, full_disk))
    with pytest.raises(SystemExit, match="error: .*t.npz: cannot write it"):
        main([str(tmp_path / "t.npz"), "--prompt-tokens", "8", "--decode-tokens", "2",
              "--set", "layers=2"])  # fmt: skip


def test_ctrl_c_exits_130_and_leaves_no_file(tmp_path, monkeypatch):
    out = tmp_path / "t.npz"

    def interrupted(f, **arrays):
        f.write(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez_compressed", interrupted)
    try:
        main([str(out), "--prompt-tokens", "8", "--decode-tokens", "2", "--set", "layers=2"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C ended in a KeyboardInterrupt traceback")
    except SystemExit as e:
        assert e.code == 130
    assert list(tmp_path.iterdir()) == []
