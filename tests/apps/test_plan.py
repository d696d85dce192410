"""`strata-mlx plan`: the forecast from a store, a Hugging Face checkpoint or
a GGUF; the arena it names is the one load() allocates; the residency model against exact
counts; the comparison with a bench run on figures recorded on this machine."""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from strata_mlx.apps import plan
from strata_mlx.runtime.loader import GB
from strata_mlx.stream import memory

HERE = Path(__file__).parents[1]  # tests/
CLI = [str(Path(sys.executable).with_name("strata-mlx"))]


def _machine(ssd=1.0, mem=16 * GB, avail=8 * GB):
    return plan.Machine(mem, avail, ssd, ssd / 2, 8)


def test_store_hf_and_gguf_shapes_agree_with_their_stores(store, hf_checkpoint, tmp_path):
    """The HF checkpoint's forecast (headers only) sizes records and dense weights as the
    store converted from it has them."""
    s = plan.model_shape(store("qwen3_moe"))
    h = plan.model_shape(hf_checkpoint("qwen3_moe"))
    assert (s.source, h.source) == ("store", "hf")
    assert (h.num_experts, h.moe_layers, h.top_k) == (s.num_experts, s.moe_layers, s.top_k)
    assert h.record_bytes == s.record_bytes
    assert abs(h.dense_bytes - s.dense_bytes) <= 0.05 * s.dense_bytes
    assert s.profile is not None and h.profile is None

    sys.path.insert(0, str(HERE))
    import tiny_gguf

    meta, tensors = tiny_gguf.qwen3moe()
    g = tiny_gguf.write(tmp_path / "m.gguf", "qwen3moe", meta, tensors)
    from strata_mlx.convert.gguf import convert_gguf

    gs = plan.model_shape(convert_gguf(g, tmp_path / "gs", calibration_tokens=0, progress=False))
    gg = plan.model_shape(g)
    assert gg.source == "gguf" and gg.record_bytes == gs.record_bytes
    assert (gg.num_experts, gg.moe_layers, gg.top_k) == (gs.num_experts, gs.moe_layers, gs.top_k)


def test_plan_names_the_arena_load_allocates(store, monkeypatch):
    """Same store, same memory: plan's automatic arena and chunk are load()'s."""
    path = store("qwen3_moe")
    shape = plan.model_shape(path)
    from strata_mlx.runtime.loader import prefill_scratch_bytes

    other = prefill_scratch_bytes(shape.args, 64) + memory.kv_cache_bytes(shape.args, 64)
    # room for about half the experts once the guard keeps a quarter of it free
    avail = memory.RESERVE + other + shape.expert_bytes * 2 // 3
    monkeypatch.setattr(memory, "available_bytes", lambda: avail)
    f = plan.forecast(
        shape,
        plan.Machine(16 * GB, avail, 1.0, 0.5, 8),
        (1e-3, 1e-2),
        "test",
        prefill_step_size=64,
        prompt_tokens=128,
    )
    from strata_mlx.runtime.loader import load_model

    model = load_model(path, prefill_step_size=64)
    try:
        assert f.slots == model.expert_cache.arena.n_slots
        assert f.prefill_step_size == model.runtime.prefill_step_size
    finally:
        model.expert_cache.close()
    assert 0 < f.resident_share < 1


def test_does_not_fit_is_a_verdict_not_an_error(store):
    shape = plan.model_shape(store("qwen3_moe"))
    f = plan.forecast(shape, _machine(avail=0), (1e-3, 1e-2), "test", arena_gb=1.0)
    assert not f.fits and "does not fit" in f.verdict and "--arena-gb" in f.verdict


def test_reuse_gap_and_hits_match_an_lru_simulation():
    """The residency model (LRU over a layer-major sweep) against a simulated LRU arena."""
    from collections import OrderedDict

    rng = np.random.default_rng(0)
    L, E, k, T = 4, 64, 4, 32
    pop = rng.zipf(1.6, size=(L, E)).astype(float)
    p = np.clip(pop / pop.sum(axis=1, keepdims=True) * k, 0, 1)
    for slots in (40, 120, 200):
        lru, hits, need = OrderedDict(), 0, 0
        chunks = 40
        for c in range(chunks):
            for l in range(L):
                picked = set()
                for _ in range(T):
                    picked |= set(rng.choice(E, size=k, replace=False, p=p[l] / p[l].sum()))
                for e in sorted(picked):
                    hit = _lru_use(lru, slots, (l, e))
                    if c >= chunks // 2:
                        need += 1
                        hits += hit
        measured = hits / need
        # the model's steady-state chunk hit rate at this arena
        q = -np.expm1(np.log1p(-np.minimum(p.reshape(-1), 1 - 1e-12)) * T)
        gap = plan.reuse_gap(q, slots, chunks)
        model = float(np.sum(q * plan.hit_probability(q, gap)) / np.sum(q))
        assert abs(measured - model) <= 0.12, (slots, measured, model)


def test_experts_calibration_never_saw_still_count_in_a_longer_chunk():
    """Distinct experts a 1024-token chunk needs, forecast from 256 calibration tokens, against
    a simulation: popularity falling as rank^-1.5, each token picking k distinct experts by it
    (Gumbel top-k), so a chunk needs ~83 % of them. Counting only what calibration saw falls
    ~40 % short and ignoring the profile (k/E each) is ~20 % over; Good-Turing's unseen share
    lands between, ~10 % over (spread evenly, it overshoots a long tail)."""
    rng = np.random.default_rng(0)
    E, k = 512, 10
    logw = -1.5 * np.log(np.arange(1, E + 1))

    def tokens(T):
        return np.argpartition(-(logw + rng.gumbel(size=(T, E))), k, axis=1)[:, :k]

    counts = np.stack([np.bincount(tokens(256).ravel(), minlength=E) for _ in range(4)])
    shares = plan.smoothed_shares(counts)
    assert np.allclose(shares.sum(axis=1), 1.0)
    assert (shares[counts == 0] > 0).all()
    # no expert calibration missed outranks one it saw once
    assert shares[counts == 0].max() <= shares[counts == 1].min() + 1e-12
    p = np.clip(shares * k, 0, 1)
    forecast = np.sum(plan.hit_probability(p, 1024), axis=1).mean()
    truth = np.mean([len(np.unique(tokens(1024))) for _ in range(4)])
    seen = (counts > 0).sum(axis=1).mean()
    uniform = E * -np.expm1(np.log1p(-k / E) * 1024)
    assert seen < 0.7 * truth and uniform > 1.15 * truth  # neither extreme is near
    assert truth <= forecast <= 1.15 * truth, (forecast, truth)
    # a layer calibration never reached: every expert alike
    assert np.allclose(plan.smoothed_shares(np.zeros((1, 8), int)), 1 / 8)


RECORDED = HERE / "data" / "plan_vs_bench.json"


def test_compare_on_figures_recorded_on_this_machine():
    """`plan --json` and `bench --json` of the same store, recorded (docs/benchmarks.md,
    "Forecasts"): the comparison logic, and the forecasts that were within +-25 %."""
    rec = json.loads(RECORDED.read_text())
    for case in rec["cases"]:
        rows = {r["figure"]: r for r in plan.compare(case["plan"], case["bench"])}
        for name in case["within"]:
            assert rows[name]["within"], (case["name"], rows[name])
        for r in rows.values():
            assert r["ratio"] == pytest.approx(r["measured"] / r["forecast"])
    first = rec["cases"][0]
    f = dict(first["plan"])
    bad = {"prompt_tokens": f["prompt_tokens"], "prefill_step_size": 64, "runs": []}
    with pytest.raises(ValueError, match="no cold lookahead"):
        plan.compare(f, bad)
    # a forecast of another run's shape is refused, not compared
    f["gen_tokens"] = 128
    for key, flag in (("prompt_tokens", "-p"), ("gen_tokens", "-g")):
        other = {**first["bench"], key: 7}
        with pytest.raises(ValueError, match=f"forecast is for {flag} "):
            plan.compare(f, other)


def test_cli_plan_prints_the_forecast_and_a_target_machine(store, tmp_path):
    path = store("qwen3_moe")
    out = tmp_path / "f.json"
    env = {**os.environ, "STRATA_MLX_HOME": str(tmp_path / "home")}
    run = dict(capture_output=True, text=True, timeout=300, env=env)
    r = subprocess.run(
        [*CLI, "plan", str(path), "-p", "64", "--prefill-step-size", "32", "--json", str(out)],
        **run,
    )
    assert r.returncode == 0, r.stderr
    assert "fits" in r.stdout and "prefill" in r.stdout and "decode" in r.stdout
    f = json.loads(out.read_text())
    assert f["prefill_tps"] > 0 and f["decode_tps"] > 0
    assert f["compute_source"] == "calibrated now, cached"
    assert "--arena-gb" in f["recommendation"] and "--prefill-step-size 32" in f["recommendation"]
    r = subprocess.run(
        [*CLI, "plan", str(path), "-p", "64", "--prefill-step-size", "32", "--measure"],
        **run,
    )
    assert r.returncode == 0, r.stderr
    assert "fake-stream" in r.stdout and "plan --measure" in r.stderr  # its progress bar
    r = subprocess.run(
        [*CLI, "plan", str(path), "-p", "256", "--target-memory", "24", "--target-ssd-gbps", "8"],
        **run,
    )
    assert r.returncode == 0, r.stderr
    assert "a 24 GB machine" in r.stdout and "8.00 GB/s" in r.stdout
    r = subprocess.run([*CLI, "plan", str(tmp_path / "nope")], capture_output=True, text=True)
    assert r.returncode == 2 and "no such file" in r.stderr


def _shape(layers=4, experts=16, k=2, record=4096):
    return plan.ModelShape("store", "x", "qwen3_moe", record, experts, layers, k, 0, 1)


def test_decode_forecast_follows_the_decoders_modes():
    """Every expert resident: whole tokens ("token" mode) at the fake-stream decode time. An
    arena of a quarter of them: lookahead's recall decides streamed-ahead against misses (the
    first layers of a token have nothing before them to be predicted from), the decoder goes
    from "layers" to "sync" as its running share of layers with a miss passes 0.3, and each
    mode costs its own measured time."""
    shape = _shape()
    p = plan.pick_probabilities(shape)
    c = plan.Compute(1e-3, 0.010, 0.020, 0.030, handshake_s=0.0, recall={1: 1.0, 2: 1.0})
    d = plan.decode_forecast(shape, _machine(), c, p, shape.n_records, 64, 200, 64)
    # all resident: decode predicts until its running miss rate falls below 2 % (~100 tokens
    # of 4 layers), then whole
    # tokens go unsynced
    assert sum(d["modes"].values()) == 200 and d["modes"]["token"] > 0
    assert d["shares"][0] == pytest.approx(1.0, abs=1e-3) and d["misses_per_token"] < 1e-3

    d = plan.decode_forecast(shape, _machine(ssd=1e9), c, p, 16, 64, 64, 64)
    hit, ahead, missed = d["shares"]
    assert hit + ahead + missed == pytest.approx(1.0)
    # recall 1: only the first layer (sync, distance 1) or two ("layers", distance 2) miss
    assert (1 - hit) / 4 <= missed <= (1 - hit) / 2
    assert d["modes"]["layers"] >= 1 and d["modes"]["sync"] >= 1
    assert list(d["modes"]) == ["layers", "sync"]  # once synced, it stays so
    assert 0.020 < d["s_per_token"] < 0.030 + 4 * 0.030 / 4

    none = plan.decode_forecast(
        shape, _machine(ssd=1e9), plan.Compute.of((1e-3, 0.01)), p, 16, 64, 64, 64
    )
    assert none["shares"][1] == 0.0 and none["shares"][2] == pytest.approx(1 - hit)


def test_read_ahead_share_follows_the_distances_the_runtime_predicts_from():
    """With the arena far too small, decode soon runs the sync handshake, which predicts each
    layer from the `depth` (2) layers before it: with recall 0.5 at both distances the four
    layers are covered 0, 0.5, 0.75, 0.75 (independent guesses, when the union is not
    measured), so half of what is absent is read ahead; with distance 1 only, 0, 0.5, 0.5,
    0.5; with the union measured as no better than one guess (both miss alike), the same."""
    shape = _shape()
    p = plan.pick_probabilities(shape)
    for recall, union, share in (
        ({1: 0.5, 2: 0.5}, {}, 0.5),
        ({1: 0.5}, {}, 0.375),
        ({1: 0.5, 2: 0.5}, {1: 0.5, 2: 0.5}, 0.375),
        ({1: 0.5, 2: 0.5}, {1: 0.5, 2: 0.9}, (0.5 + 0.9 + 0.9) / 4),
    ):
        c = plan.Compute(
            1e-3, 0.010, 0.020, 0.030, handshake_s=0.0, recall=recall, recall_union=union
        )
        d = plan.decode_forecast(shape, _machine(ssd=1e9), c, p, 1, 64, 400, 64)
        hit, ahead, missed = d["shares"]
        assert d["modes"]["sync"] > 0.95 * 400
        assert ahead / (1 - hit) == pytest.approx(share, abs=0.01)


def _lru_use(lru, slots: int, key) -> bool:
    """One lookup in an LRU arena of `slots`: was it resident (then it is, most recent)."""
    hit = key in lru
    lru[key] = True
    lru.move_to_end(key)
    if len(lru) > slots:
        lru.popitem(last=False)
    return hit


def test_decode_after_a_cold_prompt_matches_an_lru_simulation():
    """decode_hits (what the arena holds token by token after a cold prefill) against a
    simulated LRU arena fed the same way: the prompt's chunks swept layer by layer, then decode
    tokens. The first tokens find only what the prefill's sweep left; the share climbs to
    decode's own steady state."""
    from collections import OrderedDict

    rng = np.random.default_rng(1)
    L, E, k, gen, trials = 4, 64, 4, 40, 12
    pop = rng.zipf(2.0, size=(L, E)).astype(float)
    w = pop / pop.sum(axis=1, keepdims=True)
    # a token picks k distinct experts by w: the chance it picks each is not k w (measure it)
    p = np.stack(
        [
            np.bincount(
                np.concatenate([rng.choice(E, k, False, w[l]) for _ in range(4000)]), None, E
            )
            / 4000
            for l in range(L)
        ]
    )
    # prompts of whole chunks and with a short last chunk (what the chunk before it left counts)
    for (prompt, step), slots in itertools.product(
        ((96, 32), (97, 32), (129, 128)), (48, 100, 180)
    ):
        hits = np.zeros(gen)
        for _ in range(trials):
            lru: OrderedDict = OrderedDict()
            use = functools.partial(_lru_use, lru, slots)
            for c in range(0, prompt, step):
                for l in range(L):
                    picked = set()
                    for _ in range(min(step, prompt - c)):
                        picked |= set(rng.choice(E, size=k, replace=False, p=w[l]))
                    for e in sorted(picked):
                        use((l, e))
            for t in range(gen):
                for l in range(L):
                    hits[t] += sum(
                        use((l, e)) for e in rng.choice(E, size=k, replace=False, p=w[l])
                    )
        measured = hits / (trials * L * k)
        model = plan.decode_hits(p.reshape(-1), L, slots, prompt, step, gen)
        for span in (slice(0, 4), slice(0, gen), slice(gen - 10, gen)):
            m, f = measured[span].mean(), model[span].mean()
            # 12 trials x 16 lookups a token: the measured mean is good to ~0.03 over 4 tokens
            assert abs(m - f) <= 0.08, (prompt, step, slots, span, m, f)
        if (prompt, slots) == (96, 48):  # the case the model is for: the first tokens find less
            assert measured[:4].mean() < measured[gen - 10 :].mean() - 0.1


def test_compare_reads_the_miss_rate_or_older_forecasts_hit_rate():
    f = {"prefill_tps": 1.0, "decode_tps": 1.0, "gb_read_per_chunk": 1.0, "decode_hit_rate": 0.5}
    b = {
        "prompt_tokens": 64,
        "prefill_step_size": 64,
        "runs": [
            {
                "policy": "lookahead",
                "phase": "cold",
                "prefill_tps": 1.0,
                "decode_tps": 1.0,
                "gb_read": 1.0,
                "decode_miss_pct": 20.0,
            }
        ],
    }
    rows = {r["figure"]: r for r in plan.compare(f, b)}
    assert rows["decode miss %"]["forecast"] == pytest.approx(50.0)
    rows = {r["figure"]: r for r in plan.compare({**f, "decode_miss_rate": 0.2}, b)}
    assert rows["decode miss %"]["within"] and rows["decode miss %"]["ratio"] == pytest.approx(1)


# ---- every GGUF architecture convert imports ----------------------------------------------


@pytest.fixture(scope="module")
def llama_cpp_ggufs(tmp_path_factory):
    """name -> (GGUF, split_experts): files written by one run of llama.cpp's converter on
    tiny transformers models of every MoE family convert imports (F32; Q8_0 for affine
    records; GPT-OSS as OpenAI ships it, MXFP4; OLMoE's experts as k-quant blocks, a type a
    layer), plus a dense llama (tiny_gguf) split into experts."""
    sys.path.insert(0, str(HERE))
    import llama_cpp_gguf as lc
    import tiny_gguf

    src = lc.converter_dir()
    if src is None:
        pytest.skip("llama.cpp's convert_hf_to_gguf.py: pip could not fetch llama-cpp-python")
    from test_mxfp4 import mxfp4_checkpoint

    root = tmp_path_factory.mktemp("plan_gguf")
    jobs, made = [], {}
    for family in ("mixtral", "olmoe", "qwen3_next", "glm4_moe", "deepseek_v3", "gpt_oss"):
        ck = lc.save_checkpoint(lc.hf_model(family), root / family)
        extra = ("--no-mtp",) if family == "qwen3_next" else ()
        for outtype in ("f32", "q8_0") if family == "olmoe" else ("f32",):
            made[f"{family}-{outtype}"] = (root / f"{family}-{outtype}.gguf", None)
            jobs.append((ck, made[f"{family}-{outtype}"][0], outtype, extra))
    mx4 = mxfp4_checkpoint(root / "gpt_oss", root / "gpt_oss-mxfp4")
    made["gpt_oss-mxfp4"] = (root / "gpt_oss-mxfp4.gguf", None)
    jobs.append((mx4, made["gpt_oss-mxfp4"][0], "f32", ()))
    wide = lc.save_checkpoint(lc.hf_model("olmoe", hidden=256, expert=256), root / "olmoe-wide")
    jobs.append((wide, root / "olmoe-wide.gguf", "f32", ()))
    lc.convert_many(src, jobs)

    from gguf import GGMLQuantizationType, GGUFReader

    rng = np.random.default_rng(0)
    tensors = {t.name: t for t in GGUFReader(str(root / "olmoe-wide.gguf")).tensors}
    replace = {}
    for i, types in enumerate((("Q4_K", "Q5_K", "Q6_K"), ("Q2_K", "IQ3_S", "Q4_K"))):
        for gp, qtype in zip(("ffn_gate", "ffn_up", "ffn_down"), types):
            name = f"blk.{i}.{gp}_exps.weight"
            shape = tuple(int(x) for x in reversed(tensors[name].shape))
            blocks, _ = tiny_gguf.random_blocks(qtype, shape, rng, std=0.02)
            replace[name] = (blocks, GGMLQuantizationType[qtype])
    kq = tiny_gguf.rewrite(root / "olmoe-wide.gguf", root / "olmoe-kquants.gguf", replace)
    made["olmoe-kquants"] = (kq, None)
    meta, t = tiny_gguf.llama()
    made["llama-split"] = (tiny_gguf.write(root / "llama.gguf", "llama", meta, t), 4)
    return made


PLAN_GGUFS = [
    "mixtral-f32",
    "olmoe-f32",
    "olmoe-q8_0",
    "olmoe-kquants",
    "qwen3_next-f32",
    "glm4_moe-f32",
    "deepseek_v3-f32",
    "gpt_oss-f32",
    "gpt_oss-mxfp4",
    "llama-split",
]


@pytest.mark.parametrize("name", PLAN_GGUFS)
def test_gguf_shape_is_the_store_convert_writes(name, llama_cpp_ggufs, tmp_path):
    """plan on a GGUF (its header) describes the store convert writes from it: the same
    record size, experts, MoE layers, top-k and active parameters, and the dense weights'
    bytes (the store's file less its safetensors header)."""
    import struct

    from strata_mlx.convert.gguf import convert_gguf
    from strata_mlx.format.store import DENSE

    path, split = llama_cpp_ggufs[name]
    gg = plan.model_shape(path, split_experts=split)
    store = convert_gguf(
        path, tmp_path / "s", split_experts=split, calibration_tokens=0, progress=False
    )
    s = plan.model_shape(store)
    assert gg.source == "gguf" and gg.model_type == s.model_type
    assert (gg.record_bytes, gg.num_experts, gg.moe_layers, gg.top_k) == (
        s.record_bytes,
        s.num_experts,
        s.moe_layers,
        s.top_k,
    )
    assert gg.active_params == s.active_params
    with open(store / DENSE, "rb") as f:
        (header,) = struct.unpack("<Q", f.read(8))
    assert gg.dense_bytes == pytest.approx(s.dense_bytes - 8 - header, rel=0.01)
    f = plan.forecast(gg, _machine(), (1e-3, 1e-2), "test", prefill_step_size=64)
    assert f.fits and f.prefill_tps > 0 and f.decode_tps > 0


def test_gguf_of_an_architecture_convert_refuses_is_one_line(tmp_path):
    sys.path.insert(0, str(HERE))
    import tiny_gguf

    meta, tensors = tiny_gguf.qwen3moe()
    path = tiny_gguf.write(tmp_path / "m.gguf", "grok", meta, tensors)
    with pytest.raises(plan.StoreError) as e:
        plan.model_shape(path)
    msg = str(e.value)
    assert msg.startswith(str(path)) and "'grok'" in msg and "\n" not in msg, msg


def test_lookahead_recall_measures_the_union_not_independent_guesses():
    """lookahead_recall on scripted routing (3 layers, top-2, 2 tokens): recall at each
    distance, and the union of the predictions from the layers before a layer, counted pick
    by pick, where two guesses that miss the same expert find no more than one."""
    import mlx.core as mx

    truth = {0: [[0, 1], [2, 3]], 1: [[0, 1], [2, 3]], 2: [[0, 1], [2, 3]]}
    # router of layer t on the input of layer s: what it picks for each token
    picks = {(1, 0): [[0, 1], [2, 5]], (2, 1): [[0, 5], [2, 5]], (2, 0): [[0, 6], [3, 6]]}

    class Cache:
        layers = [0, 1, 2]
        dump = None

        def __init__(self):
            self.routers = {t: (lambda x, t=t: mx.array(picks[t, int(x.item())])) for t in (1, 2)}

        @contextlib.contextmanager
        def dumping(self, dump):  # ExpertCache.dumping
            self.dump = dump
            try:
                yield
            finally:
                self.dump = None

    class Model:
        expert_cache = Cache()

        def make_cache(self):
            return None

        def __call__(self, ids, cache=None):
            for layer in self.expert_cache.layers:
                self.expert_cache.dump(layer, mx.array(layer), mx.array(truth[layer]), None, None)

    recall, union = plan.lookahead_recall(Model(), [1, 2], 2, [1, 2], depth=2)
    # from 1 before: layer 1 finds 3 of its 4 picks, layer 2 2 of 4; layer 2 from 2 before: 2
    assert recall == {1: 5 / 8, 2: 0.5}
    # union at a = 1 is recall at distance 1 over the same layers (1 and 2); at a = 2 over
    # layer 2 alone (the only one with two before it): {0,5,6} and {2,3,5,6} find 0, 2 and 3
    # of 0, 1, 2, 3: 3 of 4, as independent guesses at 0.5 each would
    assert union == {1: 5 / 8, 2: 0.75}
    picks[2, 0] = [[0, 5], [2, 5]]  # now layer 2's two guesses miss alike
    recall, union = plan.lookahead_recall(Model(), [1, 2], 2, [1, 2], depth=2)
    assert recall == {1: 5 / 8, 2: 0.5} and union == {1: 5 / 8, 2: 0.5}  # independence: 0.75


def test_a_measured_absent_lookup_cost_replaces_the_probes():
    """With what an absent lookup cost in plan's short real decode, every token costs its mode's
    compute, the handshake, and that cost for each lookup not resident (missed or streamed
    ahead alike), in place of reads costed from the probe; a decode that read too little, or
    ran no slower than compute, gives no such cost."""
    shape = _shape()
    p = plan.pick_probabilities(shape)
    kw = dict(handshake_s=1e-4, recall={1: 0.5, 2: 0.5}, recall_union={1: 0.5, 2: 0.6})
    c = plan.Compute(1e-3, 0.010, 0.020, 0.030, absent_s=2e-3, **kw)
    d = plan.decode_forecast(shape, _machine(ssd=1e9), c, p, 1, 64, 400, 64)
    hit, ahead, missed = d["shares"]
    assert set(d["modes"]) == {"layers", "sync"} and d["modes"]["sync"] > 0.95 * 400
    # the arena of one slot: sync mode nearly throughout, where nothing is recomputed
    per_token = 0.030 + 4 * 1e-4 + 4 * 2 * (1 - hit) * 2e-3
    assert d["s_per_token"] == pytest.approx(per_token, rel=0.02)
    probe = plan.decode_forecast(
        shape, _machine(ssd=1e9), plan.Compute(1e-3, 0.010, 0.020, 0.030, **kw), p, 1, 64, 400, 64
    )
    assert probe["shares"] == d["shares"] and probe["s_per_token"] < d["s_per_token"]

    real = plan.RealDecode(1e-4, {}, {}, 0.050, 10.0, 4, 8)  # 80 absent lookups in 8 tokens
    assert real.absent_s(0.030) == pytest.approx((0.050 - 0.030 - 4 * 1e-4) / 10)
    assert real.absent_s(0.060) == 0.0  # no slower than compute: they cost nothing seen
    assert plan.RealDecode(1e-4, {}, {}, 0.050, 2.0, 4, 8).absent_s(0.030) is None  # 16 seen


def test_plans_real_decode_sees_the_lookups_it_reads(store):
    """measure_real on a store whose arena holds a third of the experts: its decode's absent
    lookups (streamed ahead or missed) are counted and give a cost; with room for every
    expert, only first uses are absent: fewer."""
    from strata_mlx.format.store import load_manifest

    path = store("qwen3_next")
    m = load_manifest(path)
    ids = np.random.default_rng(0).integers(0, m.config["vocab_size"], 32).tolist()
    small = plan.measure_real(path, ids, 16, 8, m.expert_bytes * 0.3 / plan.GB)
    assert small.tokens == 8 and small.layers == len(m.moe_layers)
    assert small.absent_per_token * small.tokens >= plan.MIN_ABSENT
    assert small.absent_s(0.0) > 0 and 0 < small.union[1] <= 1
    whole = plan.measure_real(path, ids, 16, 8, m.expert_bytes * 1.5 / plan.GB)
    assert whole.absent_per_token < small.absent_per_token


def test_plan_calibrates_once_then_answers_from_the_cache(store, tmp_path, monkeypatch):
    """The default forecast measures nothing of the store's own chunk (no measure_compute):
    the first plan of a shape calibrates and caches it, the next answers from the cache, for
    any store of that shape, with an arena and chunk recommended."""
    from strata_mlx.apps.plan import calibration

    monkeypatch.setenv("STRATA_MLX_HOME", str(tmp_path))
    path = store("qwen3_moe")

    def no_measure(*a, **k):
        raise AssertionError("the default plan ran the long measurement")

    monkeypatch.setattr(plan, "measure_compute", no_measure)
    first = plan.plan(path, prompt_tokens=64, prefill_step_size=32, gen_tokens=8)
    assert first.compute_source == "calibrated now, cached"
    assert calibration.cache_file().is_file()
    assert str(tmp_path) in str(calibration.cache_file())
    monkeypatch.setattr(calibration, "calibrate", no_measure)
    again = plan.plan(path, prompt_tokens=64, prefill_step_size=32, gen_tokens=8)
    assert again.compute_source == "calibrated, cached"
    assert again.compute_floor_s == pytest.approx(first.compute_floor_s)
    assert "--arena-gb" in again.recommendation and "recommended:" in "\n".join(again.lines())


def test_plan_without_a_model_plans_the_builtin_one(store, tmp_path, monkeypatch):
    """`strata-mlx plan` with no argument: the built-in model and its arena, as generate."""
    from typer.testing import CliRunner

    from strata_mlx.apps import default_model
    from strata_mlx.apps.cli import app

    monkeypatch.setenv("STRATA_MLX_HOME", str(tmp_path))
    path = store("qwen3_moe")
    monkeypatch.setattr(default_model, "default_store", lambda: path)
    monkeypatch.setattr(default_model, "default_arena_gb", lambda _s: 0.0001)
    r = CliRunner().invoke(app, ["plan", "-p", "16", "--prefill-step-size", "16", "-g", "4"])
    assert r.exit_code == 0, r.output
    assert path.name in r.output and "calibrated now" in r.output
    # the forecast's arena is generate's, the recommendation load()'s: said, not left to read
    # as a contradiction
    assert "note: the built-in model runs with a quarter of its experts resident" in r.output


def test_bench_without_a_model_benches_the_builtin_one(store, tmp_path, monkeypatch):
    """`strata-mlx bench` with no --model: the built-in model and its arena, as plan and
    generate (bench's own run is replaced: only which store and arena it gets is checked)."""
    from typer.testing import CliRunner

    from strata_mlx.apps import bench as bench_mod
    from strata_mlx.apps import default_model
    from strata_mlx.apps.cli import app

    path = store("qwen3_moe")
    monkeypatch.setattr(default_model, "default_store", lambda: path)
    monkeypatch.setattr(default_model, "default_arena_gb", lambda _s: 0.0001)
    seen = {}

    def fake_bench(model, prompt_tokens, gen_tokens, arena_gb, *args, config=None, **kw):
        seen.update(model=model, arena_gb=arena_gb, config_arena=config.arena_gb)
        return None

    monkeypatch.setattr(bench_mod, "bench", fake_bench)
    r = CliRunner().invoke(app, ["bench", "-p", "16", "-g", "4", "--policies", "demand"])
    assert r.exit_code == 0, r.output
    assert seen == {"model": path, "arena_gb": 0.0001, "config_arena": 0.0001}


def test_a_gpu_calibrates_on_a_chunk_of_the_forecasts_size_the_cpu_on_a_line():
    """On a GPU a small chunk's time is the weight traffic of the experts it touches, which
    saturates: one chunk of the forecast's own size (capped by the prompt) is timed there; on
    the CPU a line through two short chunks. Each is cached under what it timed."""
    from strata_mlx.apps.plan import calibration as cal

    gpu = cal.calibration_plan("gpu", 1024, 2048)
    assert gpu.kind == "chunk" and gpu.chunk_tokens == (1024,) and gpu.sync_per_layer
    assert cal.calibration_plan("gpu", 1024, 300).chunk_tokens == (300,)
    cpu = cal.calibration_plan("cpu", 1024, 2048)
    assert cpu.kind == "slope" and cpu.chunk_tokens == (cal.SHORT_TOKENS, cal.LONG_CAP)
    assert not cpu.sync_per_layer  # the CPU keeps its decode model
    # the line's long chunk is the forecast's own, within LONG_TOKENS..LONG_CAP
    assert cal.calibration_plan("cpu", 64, 2048).chunk_tokens == (cal.SHORT_TOKENS, 64)
    assert cal.calibration_plan("cpu", 256, 100).chunk_tokens == (cal.SHORT_TOKENS, 100)
    assert cal.calibration_plan("cpu", 16, 64).chunk_tokens == (cal.SHORT_TOKENS, cal.LONG_TOKENS)
    keys = {p.key for p in (gpu, cpu, cal.calibration_plan("gpu", 512, 2048))}
    assert len(keys) == 3


def test_a_cached_calibration_answers_only_for_what_it_timed(tmp_path, monkeypatch):
    """A CPU-style entry is never the answer for a GPU-style forecast, nor one chunk size's
    for another's."""
    from strata_mlx.apps.plan import calibration as cal

    monkeypatch.setenv("STRATA_MLX_HOME", str(tmp_path))
    shape = _shape()
    entry = cal.Calibration(1e-3, 1e-4, 0.01, 0.02, 0.03, 1e-4, calibrated="slope-8-32")
    cpu, gpu = cal.calibration_plan("cpu", 64, 64), cal.calibration_plan("gpu", 64, 64)
    cal.store(shape, cpu, entry)
    assert cal.cached(shape, cpu) == entry
    assert cal.cached(shape, gpu) is None
    cal.store(shape, gpu, cal.Calibration(0.0, 2e-4, 0.01, 0.02, 0.03, 1e-4))
    assert cal.cached(shape, gpu).prefill_token_s == 2e-4
    assert cal.cached(shape, cpu) == entry  # both kept, each under its own key
    assert cal.cached(shape, cal.calibration_plan("gpu", 32, 64)) is None


def test_plan_on_a_gpu_times_one_chunk_of_its_size(store, tmp_path, monkeypatch):
    """plan's default forecast with the backend reported as a GPU: the calibration times one
    fake-stream chunk of the forecast's size (its per-token time, no fixed part) and says so;
    back on the CPU that entry is not reused: the line is calibrated."""
    from strata_mlx.apps.plan import calibration as cal

    monkeypatch.setenv("STRATA_MLX_HOME", str(tmp_path))
    path = store("qwen3_moe")
    seen = []
    calibrate = cal.calibrate

    def spy(p, arena_gb, progress=None, plan_=None):
        seen.append(plan_)
        return calibrate(p, arena_gb, progress, plan_)

    monkeypatch.setattr(cal, "calibrate", spy)
    monkeypatch.setattr(cal, "backend", lambda: "gpu")
    f = plan.plan(path, prompt_tokens=64, prefill_step_size=16, gen_tokens=4)
    assert seen == [cal.CalibrationPlan("chunk", (16,), sync_per_layer=True)]
    assert "one chunk of 16 tokens timed" in "\n".join(f.notes)
    entry = cal.cached(plan.model_shape(path), seen[0])
    assert entry.chunk_fixed_s == 0.0 and entry.prefill_token_s > 0
    assert entry.calibrated == "chunk-16-sync"
    monkeypatch.setattr(cal, "backend", lambda: "cpu")
    f = plan.plan(path, prompt_tokens=64, prefill_step_size=16, gen_tokens=4)
    assert seen[1].kind == "slope" and f.compute_source == "calibrated now, cached"
    assert cal.cached(plan.model_shape(path), seen[1]).sync_beyond_s == 0.0


def test_the_cpu_line_times_a_chunk_of_the_forecasts_size(store, tmp_path, monkeypatch):
    """On the CPU the line's long chunk is the forecast's own (a chunk's cost a token grows with
    its tokens there): its chunks hold 8 and 48 tokens for a 48-token chunk, and the entry is
    keyed on them, so a forecast with another chunk calibrates again."""
    from strata_mlx.apps import bench as bench_mod
    from strata_mlx.apps.plan import calibration as cal

    monkeypatch.setenv("STRATA_MLX_HOME", str(tmp_path))
    monkeypatch.setattr(cal, "backend", lambda: "cpu")
    path = store("qwen3_moe")
    timed = []
    run_policy = bench_mod.run_policy

    def spy(model, ids, gen, step, policy, phase, layers=None):
        run = run_policy(model, ids, gen, step, policy, phase, layers)
        if policy in ("short", "long"):
            timed.append(sum(c.tokens for c in run.chunks))
        return run

    monkeypatch.setattr(bench_mod, "run_policy", spy)
    f = plan.plan(path, prompt_tokens=96, prefill_step_size=48, gen_tokens=4)
    assert timed == [8, 48]
    assert "chunks of 8 and 48 tokens" in "\n".join(f.notes)
    assert cal.cached(plan.model_shape(path), cal.calibration_plan("cpu", 48, 96)) is not None
    assert cal.cached(plan.model_shape(path), cal.calibration_plan("cpu", 64, 96)) is None


def test_plan_through_an_emulated_drive_says_so_and_calibrates_apart(store, tmp_path, monkeypatch):
    """STRATA_MLX_DRIVE_GBPS: plan's probes read through the emulated drive, its notes say so,
    and its calibration (an absent lookup's cost is the drive's) is kept apart from the real
    drive's."""
    from strata_mlx.apps.plan import calibration as cal
    from strata_mlx.stream.reader import limit_drive

    monkeypatch.setenv("STRATA_MLX_HOME", str(tmp_path))
    monkeypatch.setattr(cal, "backend", lambda: "cpu")
    path = store("qwen3_moe")
    key = plan.model_shape(path), cal.calibration_plan("cpu", 48, 96)
    monkeypatch.setenv("STRATA_MLX_DRIVE_GBPS", "3")
    try:
        f = plan.plan(path, prompt_tokens=96, prefill_step_size=48, gen_tokens=4)
        assert "reads through an emulated drive of 3 GB/s (STRATA_MLX_DRIVE_GBPS)" in f.notes
        assert f.ssd_gbps <= 3 * 1.01  # the emulated drive's, not the machine's
        assert cal.cached(*key) is not None
        monkeypatch.delenv("STRATA_MLX_DRIVE_GBPS")
        limit_drive(None)
        assert cal.cached(*key) is None
    finally:
        limit_drive(None)


def test_the_read_floor_is_the_data_paths_where_reads_bounce():
    """Where the cache reads through a bounce buffer or the CUDA device copy, the drive's own
    figure overstates what lands in the arena: the data path's probe sets the floor there, and
    probe-ssd's elsewhere (or where there is no store to read as the cache does)."""
    from strata_mlx.apps.plan.machine import read_floor_source

    assert read_floor_source(False, False, True) == "probe-ssd"
    assert read_floor_source(True, False, True) == "data path"
    assert read_floor_source(True, True, True) == "data path"
    assert read_floor_source(False, True, True) == "data path"
    assert read_floor_source(True, True, False).startswith("probe-ssd (no store")


def test_this_machine_probes_what_the_backend_reads_through(store, monkeypatch):
    """The backend query mocked: with a bounce buffer the data path is probed at one and at
    the I/O worker count (and probe-ssd not at all); without, probe-ssd alone."""
    from strata_mlx.apps.plan.machine import this_machine
    from strata_mlx.runtime.loader import RuntimeConfig
    from strata_mlx.stream import probe, reader

    path = store("qwen3_moe")
    shape = plan.model_shape(path)
    calls, options = [], []

    def data_path(store_, m, workers, seconds, **kw):
        calls.append(("data path", workers))
        options.append(kw)
        return {"gb_per_s": 0.5 * workers}

    def ssd(file, record_bytes, workers_list, seconds):
        calls.append(("probe-ssd", tuple(workers_list)))
        return [{"gb_per_s": 10.0 * w} for w in workers_list]

    monkeypatch.setattr(probe, "probe_data_path", data_path)
    monkeypatch.setattr(probe, "probe_ssd", ssd)
    monkeypatch.setattr(reader, "uses_device_copy", lambda: False)
    monkeypatch.setattr(reader, "needs_bounce", lambda: True)
    m = this_machine(shape, io_workers=4, probe_seconds=0.2)
    assert calls == [("data path", 1), ("data path", 4)]
    assert (m.ssd_gbps_one, m.ssd_gbps, m.read_source) == (0.5, 2.0, "data path")
    # through what the cache's reads go through, as bench's probe: its copy-behind included
    cfg = RuntimeConfig()
    want = dict(
        overlap=cfg.read_overlap, device_memory=cfg.device_arena, copy_behind=cfg.copy_behind
    )
    assert all(kw.items() >= want.items() for kw in options)
    calls.clear()
    monkeypatch.setattr(reader, "needs_bounce", lambda: False)
    m = this_machine(shape, io_workers=4, probe_seconds=0.2)
    assert calls == [("probe-ssd", (1, 4))]
    assert (m.ssd_gbps_one, m.ssd_gbps, m.read_source) == (10.0, 40.0, "probe-ssd")


def test_plan_says_which_probe_set_its_read_floor(store, tmp_path, monkeypatch):
    """A real bounce-buffer data path (STRATA_MLX_BOUNCE=1 on the CPU): plan probes it and
    says so beside the floor and in a note."""
    monkeypatch.setenv("STRATA_MLX_HOME", str(tmp_path))
    monkeypatch.setenv("STRATA_MLX_BOUNCE", "1")
    path = store("qwen3_moe")
    f = plan.plan(path, prompt_tokens=32, prefill_step_size=16, gen_tokens=4, probe_seconds=0.4)
    assert f.read_source == "data path" and f.ssd_gbps > 0
    text = "\n".join(f.lines())
    assert "GB/s (data path)" in text and "not probe-ssd's" in text
    monkeypatch.setenv("STRATA_MLX_BOUNCE", "0")
    f = plan.plan(path, prompt_tokens=32, prefill_step_size=16, gen_tokens=4, probe_seconds=0.4)
    assert f.read_source == "probe-ssd" and "GB/s (probe-ssd)" in "\n".join(f.lines())


def test_the_handshakes_sync_beyond_the_compute_is_a_cost_of_every_synced_layer():
    """The real decode's route sync a layer beyond the device's compute of a layer
    (fake-stream's sync-mode token over the layers, which the forecast charges already) is
    charged to each synced layer, not spread over the absent lookups: at the calibration's own
    share of absent lookups the token is the same, at a smaller share the forecast keeps that
    per-layer cost."""
    real = plan.RealDecode(1e-4, {}, {}, 0.050, 10.0, 4, 8, sync_s=6e-4)
    beyond = real.sync_beyond_s(8e-4)  # 2e-4 of compute a layer
    assert beyond == pytest.approx(4e-4)
    assert real.sync_beyond_s(None) == 0.0 and real.sync_beyond_s(4e-3) == 0.0
    with_beyond = real.absent_s(0.030, beyond)
    assert with_beyond == pytest.approx((0.050 - 0.030 - 4 * (1e-4 + 4e-4)) / 10)
    # the calibration's own token, both ways: compute + layers x (handshake + beyond) + absent
    assert 0.030 + 4 * (1e-4 + beyond) + 10 * with_beyond == pytest.approx(0.050)
    assert 0.030 + 4 * 1e-4 + 10 * real.absent_s(0.030) == pytest.approx(0.050)

    shape = _shape()
    p = plan.pick_probabilities(shape)
    kw = dict(handshake_s=1e-4, recall={1: 0.5, 2: 0.5}, recall_union={1: 0.5, 2: 0.6})
    c = plan.Compute(1e-3, 0.010, 0.020, 0.030, absent_s=with_beyond, sync_beyond_s=beyond, **kw)
    d = plan.decode_forecast(shape, _machine(ssd=1e9), c, p, 1, 64, 400, 64)
    hit = d["shares"][0]
    assert d["modes"]["sync"] > 0.95 * 400
    per_token = 0.030 + 4 * (1e-4 + beyond) + 4 * 2 * (1 - hit) * with_beyond
    assert d["s_per_token"] == pytest.approx(per_token, rel=0.02)
    assert d["handshake_s"] == pytest.approx(4 * (1e-4 + beyond), rel=0.02)
    # fewer absent lookups (an arena of half the experts): the per-layer part stays whole
    old = plan.Compute(1e-3, 0.010, 0.020, 0.030, absent_s=real.absent_s(0.030), **kw)
    half = [plan.decode_forecast(shape, _machine(ssd=1e9), x, p, 32, 64, 400, 64) for x in (c, old)]
    assert half[0]["shares"] == half[1]["shares"] and half[0]["shares"][0] > 0.3
    assert half[0]["s_per_token"] > half[1]["s_per_token"]


def test_decode_runs_the_prompts_last_token_first_untimed(monkeypatch):
    """The prompt's last token goes through the decoder outside any chunk and before bench's
    decode time starts: the simulation runs it first (the arena and the decoder's averages move)
    and charges nothing for it. Here that token finds nothing resident and every later one finds
    everything: no miss and no absent lookup's cost is charged, but the decoder, which saw the
    misses, is in "sync" mode at the first timed token (62 % of its 48 layers' running share
    missed, above decode_sync_above)."""
    from strata_mlx.apps.plan import forecasting

    asked = []

    def hits(p, layers, slots, prompt, step, n, tokens=None):
        asked.append(n)
        return np.array([0.0 if t == 0 else 1.0 for t in (range(n) if tokens is None else tokens)])

    monkeypatch.setattr(forecasting, "decode_hits", hits)
    shape = _shape(layers=48)
    p = plan.pick_probabilities(shape)
    c = plan.Compute(1e-3, 0.010, 0.020, 0.030, handshake_s=1e-4, absent_s=0.5)
    d = plan.decode_forecast(shape, _machine(ssd=1e9), c, p, 4, 64, 1, 64)
    assert asked == [2]
    assert d["misses_per_token"] == 0.0 and d["shares"] == (1.0, 0.0, 0.0)
    assert d["modes"] == {"sync": 1}  # the untimed token's misses set the decoder's mode
    assert d["s_per_token"] == pytest.approx(0.030 + 48 * 1e-4)
    d = plan.decode_forecast(shape, _machine(ssd=1e9), c, p, 4, 64, 6, 64)
    assert asked[-1] == 7 and sum(d["modes"].values()) == 6 and d["misses_per_token"] == 0.0


def test_the_cpu_line_takes_the_attentions_growth_from_a_chunk_after_a_prefix(monkeypatch):
    """A chunk's time a + b * n + c * n * (start + n): chunks of 8 and L tokens at the
    prompt's start and one of POSITION_TOKENS after PREFIX_TOKENS give back a, b and c."""
    from types import SimpleNamespace

    from strata_mlx.apps import bench as bench_mod
    from strata_mlx.apps.plan import calibration as cal

    a, b, c = 0.05, 0.02, 1.8e-5

    def t(n, start=0):
        return a + b * n + c * n * (start + n)

    def run_policy(model, ids, gen, step, policy, phase, layers=None):
        n = len(ids) - 1  # the last prompt token runs outside the chunks
        chunks = [SimpleNamespace(tokens=n, wall_s=t(n))]
        return SimpleNamespace(chunks=chunks, decode_s=0.1 * gen)

    monkeypatch.setattr(bench_mod, "run_policy", run_policy)
    monkeypatch.setattr(cal, "_time_after_prefix", lambda m, ids, prefix, n: t(n, prefix))
    p = cal.calibration_plan("cpu", 2048, 2048)
    assert p.prefix == cal.PREFIX_TOKENS and p.key.endswith(f"-at{cal.PREFIX_TOKENS}")
    fixed, slope, position, token_s = cal._time_prefill(None, list(range(200)), p, print)
    assert (fixed, slope, position) == pytest.approx((a, b, c), rel=1e-6)
    assert token_s == pytest.approx(0.1)
    # without the third chunk the attention is left in the line, as before
    two = cal.CalibrationPlan("slope", p.chunk_tokens)
    assert cal._time_prefill(None, list(range(200)), two, print)[2] == 0.0


def test_prefill_and_decode_forecasts_grow_with_the_position():
    """With a per-position cost the forecast sums each chunk's a + b * n + c * n * (start + n)
    (one chunk of 2048 costs more than sixteen of 128 over the same prompt, as measured on the
    CPU), and a decode token pays c for each position past the one decode was timed at."""
    shape = _shape()
    b, c = 0.02, 1.8e-5
    compute = plan.Compute(b, 0.1, position_s=c, decode_at=128)
    fast = _machine(ssd=1e9)
    f = {
        s: plan.forecast(shape, fast, compute, "t", prefill_step_size=s, prompt_tokens=2048)
        for s in (128, 2048)
    }
    one = 2048 * (b + c * 2048)
    sixteen = sum(128 * (b + c * (128 * i + 128)) for i in range(16))
    assert 2048 / f[2048].prefill_tps == pytest.approx(one)
    assert 2048 / f[128].prefill_tps == pytest.approx(sixteen)
    assert f[2048].compute_floor_s == pytest.approx(one)
    assert compute.decode_position_s(100) == 0.0
    assert compute.decode_position_s(2048) == pytest.approx(c * 1920)
    p = plan.pick_probabilities(shape)
    flat = plan.Compute(b, 0.1)
    near, far = (
        plan.decode_forecast(shape, fast, co, p, shape.n_records, 2048, 8, 2048)
        for co in (flat, compute)
    )
    assert far["compute_s"] - near["compute_s"] == pytest.approx(c * (2048 + 4.5 - 128))


def test_a_chunk_after_a_prefix_runs_at_that_position(store, monkeypatch):
    """The third calibration chunk: the KV caches hold the prefix (one real position, the
    rest filled without computing them) and the chunk lands after it."""
    from strata_mlx.apps.plan import calibration as cal
    from strata_mlx.generation import prompt_cache
    from strata_mlx.runtime.loader import RuntimeConfig, load_model

    made = []
    make = prompt_cache.make_prompt_cache
    monkeypatch.setattr(
        prompt_cache, "make_prompt_cache", lambda m: made.append(make(m)) or made[-1]
    )
    cfg = RuntimeConfig(arena_gb=0.01, read_ahead="demand", fake_stream=True)
    model = load_model(store("qwen3_moe"), config=cfg)
    try:
        assert cal._time_after_prefix(model, list(range(1, 40)), 64, 8) > 0
    finally:
        model.expert_cache.close()
    kv = [c for c in made[0] if getattr(c, "keys", None) is not None]
    assert kv and all(c.offset == 64 + 8 + 1 for c in kv)  # the prefix, the chunk, its last token


def test_a_layer_that_missed_costs_lag_plus_one_layers_again(monkeypatch):
    """ "layers" mode: a layer that missed is recomputed synced and the `lag` layers built on
    its wrong output are discarded (ExpertCache's recomputed_layers counts both): a forecast's
    extra compute over the whole-token time scales with lag + 1."""
    from dataclasses import replace

    from strata_mlx.runtime import loader

    shape = _shape()
    p = plan.pick_probabilities(shape)
    x = 0.01  # every mode's compute a token; reads, handshake and syncs cost nothing
    c = plan.Compute(x, x, x, x, recall={d: 0.0 for d in range(1, 6)}, absent_s=0.0)
    base = loader.RuntimeConfig
    extra = {}
    for lag in (1, 3):
        monkeypatch.setattr(
            loader, "RuntimeConfig", lambda lag=lag: replace(base(), decode_lag=lag)
        )
        d = plan.decode_forecast(shape, _machine(ssd=1e9), c, p, 16, 64, 64, 64)
        assert d["modes"].get("layers", 0) > 0
        extra[lag] = d["s_per_token"] - x
    assert extra[1] > 0 and extra[3] == pytest.approx(2 * extra[1])


def test_a_cached_calibration_holding_figures_no_run_gives_is_none(tmp_path, monkeypatch):
    """A cache entry holding NaN or a negative time forecast "nan tok/s" and a compute floor
    of minus 2 million ms: it is taken for none, and plan calibrates again."""
    import json

    from strata_mlx.apps.plan import calibration as cal

    monkeypatch.setenv("STRATA_MLX_HOME", str(tmp_path))
    shape, plan_ = _shape(), cal.calibration_plan("cpu", 64, 64)
    good = cal.Calibration(1e-3, 1e-4, 0.01, 0.02, 0.03, 1e-4, recall={1: 0.5})
    cal.store(shape, plan_, good)
    assert cal.cached(shape, plan_) == good
    for field, bad in [("decode_s", float("nan")), ("prefill_token_s", -1e-4),
                       ("chunk_fixed_s", float("inf")), ("handshake_s", -1.0),
                       ("recall", {"1": 1.5})]:  # fmt: skip
        entries = json.loads(cal.cache_file().read_text())
        (key,) = entries
        entries[key] = {**entries[key], field: bad}
        cal.cache_file().write_text(json.dumps(entries))
        assert cal.cached(shape, plan_) is None, field
        cal.store(shape, plan_, good)


def test_plan_on_a_device_that_gates_decode_says_its_forecast_is_ungated(store, monkeypatch):
    """Where the device gates decode (CUDA), plan's decode forecast is the per-layer
    handshake's (Metal's way; the gate's is not modelled): a note says so and names the flag
    that decodes as forecast; a target machine's plan, or a device without the gate, has none."""
    import strata_mlx.runtime.experts as experts
    from strata_mlx.apps.plan.machine import Compute

    path = store("qwen3_moe")
    canned = (Compute.of((1e-3, 5e-3)), "fake-stream (canned)", "calibration: canned")
    monkeypatch.setattr(plan, "_calibrated", lambda *a: canned)
    for gated in (True, False):
        monkeypatch.setattr(experts, "device_gate_available", lambda gated=gated: gated)
        here = plan.plan(path, prompt_tokens=96, prefill_step_size=48, gen_tokens=4,
                         probe_seconds=0.05)  # fmt: skip
        noted = [n for n in here.notes if "per-layer handshake" in n]
        assert len(noted) == gated and all("--no-decode-gate" in n for n in noted)
    target = plan.plan(path, prompt_tokens=96, prefill_step_size=48, gen_tokens=4,
                       target_memory_gb=24, target_ssd_gbps=6)  # fmt: skip
    assert not [n for n in target.notes if "per-layer handshake" in n]
