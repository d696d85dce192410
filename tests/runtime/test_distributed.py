"""Pipeline parallel (strata_mlx.runtime.distributed): processes on this machine joined by MLX's ring
backend over 127.0.0.1, each holding a contiguous range of layers, give logits and greedy
tokens bit-identical to one process, for a tiny model of every family; each rank reads only
its own layers' experts; a rank that dies or goes silent makes the others exit with one
line.

The ranks are started the way `mlx.launch` starts them (MLX_HOSTFILE, MLX_RANK), by this
file run as a script (`python tests/runtime/test_distributed.py RANK_OUT STORE...`), so that every
process has a deadline and its own exit code. One test runs the CLI under mlx.launch itself.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "qwen3_next", "glm4_moe", "deepseek_v3", "gpt_oss"]
PROMPT = 40  # tokens, in chunks of STEP: the second chunk's mask needs the sequence offset
STEP = 16
NEW_TOKENS = 6
DEADLINE = 120  # s, for a whole launch; nothing here should take a tenth of it


def _ids() -> list[int]:
    return np.random.default_rng(5).integers(0, 128, size=PROMPT).tolist()


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def start(n: int, argv: list[str], env: dict | None = None) -> list[subprocess.Popen]:
    """Start `n` ranks of `python argv...`, joined by the ring backend on localhost the way
    mlx.launch joins them (a hostfile of 127.0.0.1 entries, MLX_RANK)."""
    d = Path(tempfile.mkdtemp(prefix="strata-ring-"))
    atexit.register(shutil.rmtree, d, True)  # (the ranks read it as they start)
    hostfile = d / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in _free_ports(n)]))
    procs = []
    for rank in range(n):
        e = {**os.environ, **(env or {}), "MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(rank)}
        procs.append(
            subprocess.Popen(
                [sys.executable, *argv],
                env=e,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def finish(procs, timeout: float = DEADLINE, kill_rest: bool = False):
    """Each rank's (returncode, stdout, stderr), rank 0 first. `kill_rest`: once rank 0 has
    exited, kill the others (a rank told to hang)."""
    out = []
    try:
        for rank, p in enumerate(procs):
            if rank and kill_rest:
                p.kill()
            so, se = p.communicate(timeout=timeout)
            out.append((p.returncode, so, se))
    except subprocess.TimeoutExpired:
        pytest.fail(f"rank {len(out)} did not exit within {timeout} s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def launch(n: int, argv: list[str], env: dict | None = None, timeout: float = DEADLINE, **kw):
    return finish(start(n, argv, env), timeout, **kw)


def test_split_by_memory():
    from strata_mlx.runtime.distributed import split_layers

    assert split_layers([1] * 10, 2) == [range(0, 5), range(5, 10)]
    # rank 0 also holds the embedding and head: it takes fewer layers
    assert split_layers([1] * 10, 2, first_extra=4) == [range(0, 3), range(3, 10)]
    # the largest rank's bytes are the least any contiguous split gives
    assert split_layers([5, 1, 1, 1, 1, 1], 2) == [range(0, 1), range(1, 6)]
    # every rank gets a layer, even when one layer outweighs the rest
    assert split_layers([10, 1, 1, 1], 3) == [range(0, 1), range(1, 3), range(3, 4)]
    with pytest.raises(ValueError, match="3 ranks for 2 layers"):
        split_layers([1, 1], 3)


def test_split_given():
    from strata_mlx.runtime.distributed import parse_split

    assert parse_split("3, 5", 8, 2) == [range(0, 3), range(3, 8)]
    for text, why in [("3,4", "add up to the model's 8"), ("8", "1 entries for 2 ranks")]:
        with pytest.raises(ValueError, match=why):
            parse_split(text, 8, 2)
    with pytest.raises(ValueError, match="expected layer counts"):
        parse_split("a,b", 8, 2)


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--pipeline-split", "a,b"], "--pipeline-split: expected layer counts like 10,14"),
        (["--pipeline-split", "0"], "--pipeline-split: 0 must be positive"),
        (["--pipeline-split", "3,5"], "--pipeline-split: 2 entries for 1 ranks"),
        (["--pipeline-timeout", "nan"], "--pipeline-timeout nan: expected a finite number"),
        (["--pipeline-timeout", "0"], "--pipeline-timeout 0.0: expected a finite number"),
    ],
)
def test_pipeline_flags_are_checked_on_one_process_too(store, flags, words):
    """On one process neither flag is used, and `--pipeline-split a,b` or
    `--pipeline-timeout nan` ran without a word: one line, exit 2, before any load."""
    r = subprocess.run(
        [sys.executable, "-m", "strata_mlx", "generate", "--model", str(store("qwen3_moe")),
         "--prompt-tokens", "1,2", "-m", "1", "--pipeline", *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error: {words}"), r.stderr


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_pipeline_flags_without_pipeline_are_one_line_errors(store, command):
    """Without --pipeline, --pipeline-split would do nothing: refused, as a nonsense
    --pipeline-timeout is, in each command that has the flags."""
    model = ["--model", str(store("qwen3_moe"))]
    if command == "generate":
        model += ["--prompt-tokens", "1,2", "-m", "1"]
    for flags, words in [
        (["--pipeline-split", "4,4"], "--pipeline-split 4,4: only with --pipeline"),
        (["--pipeline-timeout", "nan"], "--pipeline-timeout nan: expected a finite number"),
    ]:
        r = subprocess.run(
            [sys.executable, "-m", "strata_mlx", command, *model, *flags],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert r.returncode == 2 and r.stderr.count("\n") == 1, (flags, r.stderr)
        assert r.stderr.startswith(f"error: {words}"), r.stderr


def test_layer_costs_put_experts_and_dense_weights_on_their_layer(store):
    import mlx.core as mx

    from strata_mlx.format.store import load_manifest
    from strata_mlx.models.base import normalize_config
    from strata_mlx.runtime.distributed import layer_costs
    from strata_mlx.runtime.loader import family

    path = store("deepseek_v3")  # layer 0 dense, layers 1-2 MoE
    m = load_manifest(path)
    args = family(m.model_type).ModelArgs.from_dict(normalize_config(m.config))
    weights = mx.load(str(path / "dense.safetensors"))
    costs, extra = layer_costs(weights, m, args, tokens=256)
    record = m.layout.record_bytes * m.num_experts
    assert costs[1] - costs[0] > record * 0.5 and costs[1] == costs[2]
    assert extra == sum(w.nbytes for k, w in weights.items() if not k.startswith("model.layers."))


@pytest.fixture(scope="module")
def ring():
    """Skip (with the reason) where MLX's ring backend cannot join two local processes."""
    import mlx.core as mx

    if not mx.distributed.is_available("ring"):
        pytest.skip("this MLX build has no ring backend")
    code = (
        "import mlx.core as mx; g = mx.distributed.init(backend='ring', strict=True); "
        "print(mx.distributed.all_sum(mx.array([1.0]), group=g).item())"
    )
    try:
        res = launch(2, ["-c", code], timeout=30)
    except pytest.fail.Exception as e:
        pytest.skip(f"ring backend on 127.0.0.1: {e}")
    if any(rc != 0 or so.strip() != "2.0" for rc, so, _ in res):
        pytest.skip(f"ring backend on 127.0.0.1 failed: {res[0][2].strip()[-200:]}")


def reference(path: Path) -> dict:
    """One process: teacher-forced logits, greedy tokens and their log-probabilities."""
    import strata_mlx
    from strata_mlx.generation.generate import stream_generate, teacher_forced_logits

    model, _ = strata_mlx.load(path, prefill_step_size=STEP)
    logits = teacher_forced_logits(model, _ids(), STEP)
    steps = list(stream_generate(model, None, _ids(), NEW_TOKENS, prefill_step_size=STEP))
    model.expert_cache.close()
    return {
        "logits": logits,
        "tokens": [r.token for r in steps],
        "logprobs": np.stack([np.array(r.logprobs) for r in steps]),
    }


# Three ranks need three layers: the tiny qwen3_moe, mixtral and olmoe have two.
@pytest.mark.parametrize("ranks", [2, 3])
def test_pipeline_is_bit_identical_for_every_family(store, ring, tmp_path, ranks):
    families = FAMILIES if ranks == 2 else ["qwen3_next", "glm4_moe", "deepseek_v3", "gpt_oss"]
    paths = [store(f) for f in families]
    res = launch(ranks, [__file__, str(tmp_path), *map(str, paths)])
    errors = [f"rank {r}: {se.strip()[-1500:]}" for r, (rc, _, se) in enumerate(res) if rc]
    assert not errors, "\n".join(errors)
    for family, path in zip(families, paths):
        ref = reference(path)
        got = np.load(tmp_path / f"{path.name}.npz")
        assert np.array_equal(got["logits"], ref["logits"]), family
        assert got["tokens"].tolist() == ref["tokens"], family
        assert np.array_equal(got["logprobs"], ref["logprobs"]), family
        rows = json.loads((tmp_path / f"{path.name}.json").read_text())
        from strata_mlx.format.store import load_manifest

        moe = load_manifest(path).moe_layers
        assert [r["rank"] for r in rows] == list(range(ranks))
        covered = []
        for r in rows:
            a, b = r["layers"]
            covered += range(a, b)
            own = [l for l in moe if a <= l < b]
            assert r["moe_layers"] == own, (family, r)  # the rank's cache knows only these
            assert set(r["resident_layers"]) <= set(own), (family, r)
            assert (r["stats"]["experts_read"] > 0) == bool(own), (family, r)
        assert covered == list(range(len(covered))) and covered[-1] + 1 >= max(moe), family


def test_a_rank_that_dies_makes_rank_0_exit_with_one_line(store, ring, tmp_path):
    path = store("qwen3_moe")
    res = launch(2, [__file__, str(tmp_path), str(path)], env={"STRATA_TEST_RANK_1": "die"})
    rc, _, err = res[0]
    assert rc == 2 and res[1][0] == 5
    # MLX's ring backend logs its own "[ring] Socket ... closed" lines; then ours, one line.
    lines = [l for l in err.strip().splitlines() if not l.startswith("[ring]") and l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: pipeline rank 0"), err


def test_rank_0_dying_makes_the_others_exit_with_one_line(store, ring, tmp_path):
    path = store("qwen3_moe")
    res = launch(2, [__file__, str(tmp_path), str(path)], env={"STRATA_TEST_RANK_0": "die"})
    assert res[0][0] == 5 and res[1][0] == 2
    lines = [l for l in res[1][2].strip().splitlines() if not l.startswith("[ring]") and l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: pipeline rank 1"), res[1][2]


def test_a_silent_rank_trips_the_deadline(store, ring, tmp_path):
    path = store("qwen3_moe")
    res = launch(
        2,
        [__file__, str(tmp_path), str(path)],
        env={"STRATA_TEST_RANK_1": "hang", "STRATA_TEST_TIMEOUT": "3"},
        timeout=60,
        kill_rest=True,
    )
    rc, _, err = res[0]
    assert rc == 3
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "no answer in 3 s" in lines[0], err


def test_generate_under_mlx_launch(store, ring, tmp_path):
    """The CLI as a user runs it: `mlx.launch -n 2 -- strata-mlx generate --pipeline`."""
    import shutil

    launcher = shutil.which("mlx.launch") or str(Path(sys.executable).parent / "mlx.launch")
    if not Path(launcher).exists():
        pytest.skip("mlx.launch is not installed")
    path = store("qwen3_moe")
    ids = ",".join(map(str, _ids()))
    (port,) = _free_ports(1)
    cmd = [launcher, "-n", "2", "--starting-port", str(port), "--", sys.executable, "-m"]
    cmd += ["strata_mlx", "generate", "--pipeline", "--model", str(path), "--prompt-tokens"]
    cmd += [ids, "-m", str(NEW_TOKENS), "--prefill-step-size", str(STEP)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=DEADLINE)
    ref = reference(path)
    assert p.stdout.split()[:NEW_TOKENS] == [str(t) for t in ref["tokens"]], p.stdout + p.stderr
    assert "Rank 1: layers 1-1" in p.stdout, p.stdout


def test_bench_under_mlx_launch_reports_per_rank_figures(store, ring, tmp_path):
    """`mlx.launch -n 2 -- strata-mlx bench --pipeline`: each run has one row per rank, each
    rank's layers are its split, and the ranks' lookups add up to one process's."""
    import shutil

    import strata_mlx
    from strata_mlx.apps.bench import run_policy

    launcher = shutil.which("mlx.launch") or str(Path(sys.executable).parent / "mlx.launch")
    if not Path(launcher).exists():
        pytest.skip("mlx.launch is not installed")
    path = store("qwen3_moe")
    out = tmp_path / "bench.json"
    (port,) = _free_ports(1)
    cmd = [launcher, "-n", "2", "--starting-port", str(port), "--", sys.executable, "-m"]
    cmd += ["strata_mlx", "bench", "--pipeline", "--model", str(path), "-p", str(PROMPT)]
    cmd += ["-g", "4", "--prefill-step-size", str(STEP), "--policies", "demand,lookahead"]
    cmd += ["--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=DEADLINE)
    assert p.returncode == 0 and out.exists(), p.stdout + p.stderr
    assert "    rank 1: layers 1-1" in p.stdout, p.stdout
    result = json.loads(out.read_text())

    # one process, the same prompt (bench's: seed 0) and chunks
    vocab = json.loads((path / "manifest.json").read_text())["config"]["vocab_size"]
    ids = np.random.default_rng(0).integers(0, vocab, size=PROMPT).tolist()
    model, _ = strata_mlx.load(path, prefill_step_size=STEP, read_ahead="demand")
    before = model.expert_cache.stats.copy()
    run_policy(model, ids, 4, STEP, "demand", "cold")
    one = model.expert_cache.stats.minus(before)
    model.expert_cache.close()

    assert [r["policy"] for r in result["runs"]] == ["demand"] * 2 + ["lookahead"] * 2
    for run in [{"ranks": result["compute_ranks"]}] + result["runs"]:
        ranks = run["ranks"]
        assert [r["layers"] for r in ranks] == [[0, 1], [1, 2]], ranks
        assert [r["moe_layers"] for r in ranks] == [[0], [1]], ranks
        assert sum(r["lookups"] for r in ranks) == one.lookups > 0, (ranks, one)
        assert all(r["stage_ms"] > 0 for r in ranks), ranks
    cold = result["runs"][0]["ranks"]
    assert all(r["experts_read"] > 0 and r["gb_read"] > 0 for r in cold), cold
    assert sum(r["misses"] for r in cold) == one.misses, (cold, one)


def test_serve_pipelined(store, ring, tmp_path):
    """`strata-mlx serve --pipeline`: rank 0 answers HTTP, rank 1 computes; the completion
    equals one process's; SIGTERM on rank 0 stops both."""
    import shutil
    import signal

    import httpx2 as httpx  # the HTTP client the openai package is built on
    from conftest import wait_until_serving
    from test_server import write_tokenizer

    import strata_mlx

    d = tmp_path / "tiny"
    shutil.copytree(store("qwen3_moe"), d)
    write_tokenizer(d)
    model, tok = strata_mlx.load(d)
    want = strata_mlx.generate(model, tok, "paris is a city in", max_tokens=NEW_TOKENS)
    model.expert_cache.close()
    (port,) = _free_ports(1)
    argv = ["-m", "strata_mlx", "serve", "--pipeline", "--model", str(d), "--port", str(port)]
    procs = start(2, argv + ["--log-level", "warning"])
    try:
        r = wait_until_serving(
            procs,
            lambda: httpx.post(
                f"http://127.0.0.1:{port}/v1/completions",
                json={"prompt": "paris is a city in", "max_tokens": NEW_TOKENS, "temperature": 0},
                timeout=30,
                trust_env=False,
            ),
            timeout=60,
            output=lambda: str(finish(procs, 10)),
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
    finally:
        procs[0].send_signal(signal.SIGTERM)
        res = finish(procs, 30)
    # uvicorn re-raises SIGTERM once it has shut down; rank 1 was told to stop first
    assert res[0][0] in (0, -signal.SIGTERM) and res[1][0] == 0, res


# ---- one rank (this file run as a script) ------------------------------------------------------


def _rank_main(out: Path, stores: list[str]) -> None:
    import mlx.core as mx

    import strata_mlx
    from strata_mlx.generation.generate import stream_generate, teacher_forced_logits
    from strata_mlx.runtime.distributed import Pipeline, serve_stage

    group = mx.distributed.init(backend="ring", strict=True)
    role = os.environ.get(f"STRATA_TEST_RANK_{group.rank()}", "")
    timeout = float(os.environ.get("STRATA_TEST_TIMEOUT", "60"))
    for path in stores:
        pipe = Pipeline(group, timeout_s=timeout, load_timeout_s=timeout)
        model, _ = strata_mlx.load(path, prefill_step_size=STEP, pipeline=pipe)
        if role == "die":
            os._exit(5)
        if role == "hang":
            import time

            time.sleep(timeout + 30)
            os._exit(0)
        if pipe.rank != 0:
            serve_stage(model)
            continue
        model.wait_ready()
        logits = teacher_forced_logits(model, _ids(), STEP)
        steps = list(stream_generate(model, None, _ids(), NEW_TOKENS, prefill_step_size=STEP))
        name = Path(path).name
        np.savez(
            out / f"{name}.npz",
            logits=logits,
            tokens=np.array([r.token for r in steps]),
            logprobs=np.stack([np.array(r.logprobs) for r in steps]),
        )
        (out / f"{name}.json").write_text(json.dumps(model.rank_stats()))
        model.close()
        model.expert_cache.close()


if __name__ == "__main__":
    try:
        _rank_main(Path(sys.argv[1]), sys.argv[2:])
    except ConnectionError as e:  # strata_mlx.runtime.distributed.PipelineError
        sys.stderr.write(f"error: {e}\n")
        sys.exit(2)
