"""Routing trace files (strata_mlx.stream.trace): what a live run records is what the file holds,
written by load(trace=...), generate --trace and bench --trace, and read back whole."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import prompt_ids

import strata_mlx
from strata_mlx.apps import cache_sim
from strata_mlx.config import OptionError
from strata_mlx.format.store import load_manifest
from strata_mlx.generation.generate import stream_generate
from strata_mlx.stream import trace
from strata_mlx.stream.stats import RoutingTrace

# The decoder marks decode's spans in the trace (RoutingTrace.begin_decode / end_decode)

FAMILY = "qwen3_moe"


def small_arena_gb(path, slots: int) -> float:
    return slots * load_manifest(path).layout.record_bytes / 1024**3


def test_a_live_run_s_trace_round_trips_with_the_store_s_fields(store, tmp_path):
    path = store(FAMILY)
    m = load_manifest(path)
    model, _ = strata_mlx.load(path, trace=RoutingTrace(), read_ahead="lookahead")
    ids = prompt_ids(20, seed=2)
    list(stream_generate(model, None, ids, max_tokens=5, prefill_step_size=8))
    t = trace.of_model(model)
    out = tmp_path / "run.npz"
    trace.write(out, t)
    back = trace.read(out)
    assert back.layers == list(m.moe_layers) and back.num_experts == m.num_experts
    assert back.record_bytes == m.layout.record_bytes
    # chunks of 8, 8, 3 (the prompt but its last token), the last token, 4 decode steps
    assert [len(c) for c in back.ids[back.layers[0]]] == [8, 8, 3, 1, 1, 1, 1, 1]
    assert back.decode_from == 4 and back.decode_tokens == 4
    for layer in back.layers:
        for a, b in zip(t.ids[layer], back.ids[layer]):
            np.testing.assert_array_equal(a, b)
    assert back.predicted and set(back.predicted) <= set(back.layers)
    np.testing.assert_array_equal(back.profile, model.expert_cache.predictor.profile)
    model.expert_cache.close()


def test_lookups_are_each_call_s_distinct_experts_layer_by_layer():
    ids = {
        3: [np.array([[1, 2], [2, 5]]), np.array([[4, 1]]), np.array([[3, 1]])],
        7: [np.array([[0, 0], [1, 1]]), np.array([[6, 6]]), np.array([[2, 0]])],
    }
    t = trace.Trace([3, 7], 8, 4096, ids)
    assert t.decode_from == 2  # the one-token call after the prompt's last token
    got = [(d, l, e.tolist()) for d, l, e in t.lookups()]
    assert got == [
        (False, 3, [1, 2, 5]),
        (False, 7, [0, 1]),
        (False, 3, [1, 4]),
        (False, 7, [6]),
        (True, 3, [1, 3]),
        (True, 7, [0, 2]),
    ]


def test_files_of_the_decode_benchmark_are_read(tmp_path):
    """benchmarks/decode.py writes the L/P arrays alone: the store fields are guessed."""
    f = tmp_path / "old.npz"
    np.savez_compressed(
        f,
        L2=np.array([[0, 1], [1, 3], [2, 2]], np.int16),
        L2_T=np.array([2, 1], np.int32),
    )
    t = trace.read(f)
    assert t.layers == [2] and t.num_experts == 4 and t.record_bytes == 0 and t.calls == 2


ONE = {
    "L0": np.array([[0, 1], [1, 3], [2, 2]]),
    "L0_T": np.array([2, 1]),
    "num_experts": np.array(4),
}


@pytest.mark.parametrize(
    "content, says",
    [
        (None, "no such trace file"),
        (b"not a zip", "not a trace file"),
        ({"L0": np.zeros((3, 2), np.int16), "L0_T": np.array([2], np.int32)}, "does not add up"),
        ({"format": np.array("other")}, "format 'other'"),
        ({"x": np.zeros(2)}, "no routing ids"),
        # each below was read, and gave a traceback or figures that meant nothing
        ({**ONE, "profile": np.ones((1, 3))}, r"profile \[1, 3\]: expected \[1 layers, 4"),
        ({**ONE, "profile": np.full((1, 4), np.nan)}, "profile: not finite"),
        ({**ONE, "decode_from": np.array(-1)}, "decode_from -1: outside the trace's 2 calls"),
        ({**ONE, "decode_from": np.array(1000)}, "decode_from 1000: outside"),
        ({**ONE, "record_bytes": np.array(-1)}, "record_bytes -1: negative"),
        ({**ONE, "num_experts": np.array(2.5)}, "num_experts: float64 .*not an integer"),
        ({"L0": np.arange(3), "L0_T": np.array([2, 1])}, r"L0: int64 \[3\], not integer ids"),
        ({"L0": np.zeros((3, 2)), "L0_T": np.array([2, 1])}, "L0: float64 .*not integer ids"),
        ({**ONE, "version": np.array([1, 2])}, r"version: int64 \[2\], not an integer"),
        ({**ONE, "version": np.array(3)}, "version 3; this strata-mlx reads 1 to 2"),
        ({**ONE, "layers": np.array([[0]])}, r"layers: int64 \[1, 1\], not a list of layer"),
        ({**ONE, "layers": np.array([0.0])}, "layers: float64 .*not a list of layer numbers"),
        ({**ONE, "layers": np.array([0, 0])}, "layers: a layer named twice"),
        ({**ONE, "layers": np.array([0, 1])}, "L1: missing"),
        ({**ONE, "num_experts": np.array(10**15)}, "num_experts 1000000000000000: expected 1 to"),
        ({**ONE, "profile": -np.ones((1, 4))}, "profile: negative counts"),
        (
            {**ONE, "P0": np.array([[50], [90]]), "P0_T": np.array([1, 1])},
            r"P0: expert ids outside \[0, 4\)",
        ),
        ({**ONE, "P5": np.array([[1]]), "P5_T": np.array([1])}, "P5: predictions for layer 5"),
        ({**ONE, "decode_spans": np.array([[1, 1]])}, "decode_spans .*not ordered"),
        ({**ONE, "decode_spans": np.array([[0, 1], [0, 2]])}, "decode_spans .*not ordered"),
        ({**ONE, "decode_spans": np.array([0, 1])}, r"decode_spans: int64 \[2\], not"),
        ({**ONE, "decode_spans": np.array([[1, 3]])}, "decode_spans: past the trace's 2 calls"),
    ],
)
def test_a_file_that_is_not_a_trace_is_a_one_line_error(tmp_path, content, says):
    f = tmp_path / "t.npz"
    if isinstance(content, bytes):
        f.write_bytes(content)
    elif content is not None:
        np.savez(f, **content)
    with pytest.raises(OptionError, match=says) as e:
        trace.read(f)
    assert str(f) in str(e.value) and "\n" not in str(e.value)


def test_generate_and_bench_write_traces(store, tmp_path):
    path = store(FAMILY)
    out = tmp_path / "gen.npz"
    tokens = ",".join(map(str, prompt_ids(12, seed=1)))
    cmd = [sys.executable, "-m", "strata_mlx", "generate", "--model", str(path)]
    r = subprocess.run(
        [*cmd, "--prompt-tokens", tokens, "-m", "4", "--trace", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    t = trace.read(out)
    assert t.decode_tokens == 3 and t.num_experts == load_manifest(path).num_experts

    r = subprocess.run(
        [
            *cmd[:3], "bench", "--model", str(path), "-p", "16", "-g", "3",
            "--prefill-step-size", "8", "--arena-gb", str(small_arena_gb(path, 12)),
            "--policies", "demand,lookahead", "--trace", str(tmp_path / "b.npz"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert f"trace: {tmp_path / 'b-demand-r0.npz'}" in r.stdout
    for policy in ("demand", "lookahead"):
        t = trace.read(tmp_path / f"b-{policy}-r0.npz")
        # the cold run alone: 2 chunks, the last prompt token, 3 decode calls
        assert t.calls == 6 and t.decode_tokens == 3


@dataclass
class Marked(RoutingTrace):
    """A recorder with the decoder's marks: (calls recorded by then, decode begins)."""

    decode_marks: list = field(default_factory=list)


def calls_of(*sizes) -> list:
    return [np.zeros((n, 2), np.int64) for n in sizes]


def test_the_decode_split_is_the_decoder_s_marks_not_a_guess(tmp_path):
    # A prompt of 18 tokens in chunks of 16: 16, 1, the last token, then 3 decode steps;
    # a second generation of the same model: 16, 1, its last token, 2 steps. The guess
    # (the call after the first one-token call) took the first one-token chunk for the
    # prompt's last token, and the second generation's prompt for decode.
    sizes = (16, 1, 1, 1, 1, 1, 16, 1, 1, 1, 1)
    manifest = SimpleNamespace(moe_layers=[0, 1], num_experts=4,
                               layout=SimpleNamespace(record_bytes=4096))  # fmt: skip
    marks = [(3, True), (6, False), (9, True), (11, False)]
    rt = Marked(ids={0: calls_of(*sizes), 1: calls_of(*sizes)}, decode_marks=marks)
    t = trace.of_routing(rt, manifest)
    assert t.decode_spans == [(3, 6), (9, 11)]
    assert (t.decode_from, t.decode_tokens, t.prompt_calls) == (3, 5, 6)
    f = tmp_path / "t.npz"
    trace.write(f, t)
    back = trace.read(f)
    assert back.decode_spans == [(3, 6), (9, 11)]
    assert [d for d, l, _ in back.lookups() if l == 0] == [c in (3, 4, 5, 9, 10) for c in range(11)]
    # a decode left open (the run's trace taken mid-generation) ends with the trace; a
    # recorder that marks nothing gets the guess
    rt.decode_marks = [(3, True)]
    assert trace.of_routing(rt, manifest).decode_spans == [(3, 11)]
    unmarked = SimpleNamespace(ids={0: calls_of(*sizes), 1: calls_of(*sizes)}, predicted={})
    assert trace.of_routing(unmarked, manifest).decode_spans == [(2, 11)]


@pytest.mark.parametrize("decode", ["pipelined", "sync"])
def test_a_live_run_s_decode_spans_are_each_generation_s_decode_steps(store, decode):
    path = store(FAMILY)
    model, _ = strata_mlx.load(path, trace=RoutingTrace(), read_ahead="demand", decode=decode)
    for seed in (2, 3):  # 18 tokens in chunks of 8: 8, 8, 1, the last token, 3 decode steps
        ids = prompt_ids(18, seed=seed)
        list(stream_generate(model, None, ids, max_tokens=4, prefill_step_size=8))
    t = trace.of_model(model)
    model.expert_cache.close()
    assert [len(c) for c in t.ids[t.layers[0]]] == [8, 8, 1, 1, 1, 1, 1] * 2
    assert t.decode_spans == [(4, 7), (11, 14)]


def test_a_script_s_own_recorder_without_marks_still_records(store):
    """A recorder of a research script's own (record and record_prediction only) is taken:
    the decoder tells marks only where a recorder takes them, and the split is guessed."""

    class Mine:
        def __init__(self):
            self.ids, self.predicted = {}, {}

        def record(self, layer, ids):
            self.ids.setdefault(layer, []).append(ids)

        def record_prediction(self, layer, ids):
            self.predicted.setdefault(layer, []).append(ids)

    model, _ = strata_mlx.load(store(FAMILY), trace=Mine(), read_ahead="demand")
    # 19 tokens in chunks of 8: 8, 8, 2, the last token, 3 decode steps (a length the guess,
    # decode from the call after the first one-token call, reads right)
    list(stream_generate(model, None, prompt_ids(19, seed=2), max_tokens=4, prefill_step_size=8))
    t = trace.of_model(model)
    model.expert_cache.close()
    assert [len(c) for c in t.ids[t.layers[0]]] == [8, 8, 2, 1, 1, 1, 1]
    assert t.decode_spans == [(4, 7)]


def test_a_trace_of_no_call_yet_round_trips(tmp_path):
    f = tmp_path / "empty.npz"
    trace.write(f, trace.Trace([3, 7], 8, 4096, {3: [], 7: []}))
    back = trace.read(f)
    assert (back.layers, back.calls, back.decode_tokens, back.decode_spans) == ([3, 7], 0, 0, [])
    assert back.num_experts == 8 and back.record_bytes == 4096
    r = cache_sim.replay(back, 2, "lru")
    assert r.prefill_lookups == r.decode_lookups == r.decode_tokens == 0
    with pytest.raises(OptionError, match="a trace of no MoE layers; nothing to write"):
        trace.write(tmp_path / "none.npz", trace.Trace([], 8, 4096, {}))


def test_every_import_docs_research_shows_works():
    doc = (Path(__file__).parents[2] / "docs" / "research.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, re.S)
    lines = [l.strip() for b in blocks for l in b.splitlines()]
    imports = [l for l in lines if re.match(r"(from strata_mlx\S* import|import strata_mlx)", l)]
    assert len(imports) >= 5
    for line in imports:
        exec(line, {})
