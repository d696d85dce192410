"""The CLI as a user runs it: generate, convert, bench, probe-ssd, and the one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import prompt_ids

import strata_mlx
from strata_mlx.generation.generate import teacher_forced_logits

CLI = [sys.executable, "-m", "strata_mlx"]


def run(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, *map(str, args)], capture_output=True, text=True, timeout=300, **kw
    )


def test_generate_with_prompt_tokens_and_logits_out(store, tmp_path):
    path = store("qwen3_moe")
    ids = prompt_ids(12, seed=7)
    out = tmp_path / "logits.npy"
    r = run(
        "generate",
        "--model",
        path,
        "--prompt-tokens",
        ",".join(map(str, ids)),
        "-m",
        "5",
        "--logits-out",
        out,
        "--arena-gb",
        0.0001,
        "--verbose",
    )
    assert r.returncode == 0, r.stderr
    assert "Prompt: 12 tokens" in r.stdout and "Generation: 5 tokens" in r.stdout
    assert "Peak memory" in r.stdout and "hit rate" in r.stdout
    assert "[chunk 0]" in r.stderr
    logits = np.load(out)
    assert logits.shape == (12, 128) and logits.dtype == np.float32
    model, _ = strata_mlx.load(path)
    np.testing.assert_array_equal(logits, teacher_forced_logits(model, ids))


def test_generate_greedy_tokens_match_the_api(store):
    path = store("qwen3_moe")
    ids = prompt_ids(8, seed=8)
    r = run("generate", "--model", path, "--prompt-tokens", ",".join(map(str, ids)), "-m", "6")
    assert r.returncode == 0, r.stderr
    model, _ = strata_mlx.load(path)
    expect = [x.token for x in strata_mlx.stream_generate(model, None, ids, max_tokens=6)]
    assert r.stdout.split("\n")[0].split() == [str(t) for t in expect]


def _error_line(r):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [l for l in r.stderr.strip().splitlines() if l]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr
    return lines[0]


def test_convert_errors_are_one_line_and_leave_nothing(hf_checkpoint, tmp_path):
    src = hf_checkpoint("qwen3_moe")
    # truncated safetensors
    bad = tmp_path / "trunc"
    shutil.copytree(src, bad)
    st = bad / "model.safetensors"
    os.truncate(st, st.stat().st_size // 2)
    out = tmp_path / "out1"
    line = _error_line(run("convert", "--hf-path", bad, "--mlx-path", out))
    assert "model.safetensors" in line and "truncated" in line
    assert not out.exists() and not list(tmp_path.glob(".out1*"))
    # missing config keys
    bad2 = tmp_path / "nokeys"
    shutil.copytree(src, bad2)
    cfg = json.loads((bad2 / "config.json").read_text())
    del cfg["hidden_size"]
    (bad2 / "config.json").write_text(json.dumps(cfg))
    line = _error_line(run("convert", "--hf-path", bad2, "--mlx-path", tmp_path / "out2"))
    assert "config.json" in line and "hidden_size" in line
    # unknown architecture
    cfg["hidden_size"] = 32
    cfg["model_type"] = "llama4_xl"
    (bad2 / "config.json").write_text(json.dumps(cfg))
    line = _error_line(run("convert", "--hf-path", bad2, "--mlx-path", tmp_path / "out3"))
    assert "config.json" in line and "llama4_xl" in line
    assert not (tmp_path / "out2").exists() and not (tmp_path / "out3").exists()


@pytest.mark.parametrize(
    "source, flags, says",
    [
        ("--synthetic", ["-q"], "-q: not taken by --synthetic (only by --hf-path)"),
        ("--synthetic", ["--split-experts", "4"], "--split-experts: not taken by --synthetic"),
        ("--gguf-path", ["--dtype", "bfloat16"], "--dtype: not taken by --gguf-path"),
        ("--hf-path", ["--set", "num_experts=4"], "--set: not taken by --hf-path"),
        ("--hf-path", ["--seed", "3"], "--seed: not taken by --hf-path (only by --synthetic)"),
    ],
)
def test_convert_refuses_a_flag_its_source_does_not_take(tmp_path, source, flags, says):
    """Each was ignored without a word, the store written as if it had not been given."""
    value = {"--synthetic": "bench-small", "--gguf-path": tmp_path / "m.gguf"}.get(source, tmp_path)
    out = tmp_path / "out"
    line = _error_line(run("convert", source, value, "--mlx-path", out, *flags))
    assert line == f"error: {says}" or line.startswith(f"error: {says} "), line
    assert not out.exists()


def test_convert_warns_without_tokenizer_and_quantizes(hf_checkpoint, tmp_path):
    out = tmp_path / "q"
    r = run(
        "convert",
        "--hf-path",
        hf_checkpoint("qwen3_moe"),
        "--mlx-path",
        out,
        "-q",
        "--q-bits",
        "4",
        "--q-group-size",
        "32",
        "--calibration-tokens",
        "16",
    )
    assert r.returncode == 0, r.stderr
    assert "no tokenizer" in r.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["quantization"]["bits"] == 4
    assert (out / "profile.json").is_file()


def test_convert_q_mode_mxfp4_is_convert_hfs(hf_checkpoint, tmp_path):
    """--q-mode mxfp4 with -q: the store convert_hf(..., quantize=True, q_mode="mxfp4") writes,
    byte for byte; an unknown mode, or a mode without -q, is one line and exit 2."""
    from strata_mlx.convert.hf import convert_hf

    src = hf_checkpoint("gpt_oss")
    out = tmp_path / "cli"
    args = ("--calibration-tokens", "0")
    r = run("convert", "--hf-path", src, "--mlx-path", out, "-q", "--q-mode", "mxfp4", *args)
    assert r.returncode == 0, r.stderr
    api = convert_hf(
        src, tmp_path / "api", quantize=True, q_mode="mxfp4", progress=False, calibration_tokens=0
    )
    manifest = json.loads((out / "manifest.json").read_text())
    # gate/up take 32 inputs (one block); down's 16 are not a block and stay float, as
    # convert_hf leaves them
    assert manifest["experts"]["quant"]["gate_proj"] == {"format": "mxfp4"}
    assert "quantization" not in manifest["config"]  # the dense layers stay float
    assert (out / "experts.bin").read_bytes() == (api / "experts.bin").read_bytes()
    line = _error_line(
        run("convert", "--hf-path", src, "--mlx-path", tmp_path / "x", "-q", "--q-mode", "nvfp4")
    )
    assert "--q-mode nvfp4" in line and "affine" in line and "mxfp4" in line
    line = _error_line(
        run("convert", "--hf-path", src, "--mlx-path", tmp_path / "y", "--q-mode", "mxfp4")
    )
    assert "--q-mode mxfp4" in line and "-q" in line
    # so are -q's width and group without it (a float store was written without a word)
    for flag, value in (("--q-bits", "3"), ("--q-group-size", "32")):
        line = _error_line(run("convert", "--hf-path", src, "--mlx-path", tmp_path / "z",
                               flag, value))  # fmt: skip
        assert line == f"error: {flag} {value}: a setting of -q; add -q (--quantize)"
    assert not (tmp_path / "z").exists()
    line = _error_line(run("convert", "--hf-path", src, "--mlx-path", tmp_path / "z", "-q",
                           "--q-mode", "mxfp4", "--q-bits", "3"))  # fmt: skip
    assert line == "error: --q-bits 3: affine's; --q-mode mxfp4 has its own"
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    r = run("convert", "--help")
    assert "--q-mode" in r.stdout and "mxfp4" in r.stdout


def test_store_with_bad_checksum_fails_unless_no_verify(store, tmp_path):
    path = tmp_path / "s"
    shutil.copytree(store("qwen3_moe"), path)
    with open(path / "experts.bin", "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xfe\xfd")
    line = _error_line(run("generate", "--model", path, "--prompt-tokens", "1,2,3", "-m", "2"))
    assert "experts.bin" in line and "checksum mismatch" in line
    r = run("generate", "--model", path, "--prompt-tokens", "1,2,3", "-m", "2", "--no-verify")
    assert r.returncode == 0, r.stderr


def test_generate_errors(store, tmp_path):
    line = _error_line(run("generate", "--model", tmp_path / "nope", "--prompt-tokens", "1"))
    assert "nope" in line
    line = _error_line(run("generate", "--model", store("qwen3_moe"), "-p", "hello"))
    assert "no tokenizer" in line
    line = _error_line(run("generate", "--model", store("qwen3_moe"), "--prompt-tokens", "1,x"))
    assert "--prompt-tokens" in line
    line = _error_line(run("generate", "--model", store("qwen3_moe"), "--prompt-tokens", "999"))
    assert "token ids" in line
    # token ids beside a text or system prompt: one of them was dropped without a word
    for command, flag, value in [
        ("generate", "--system-prompt", "You are a pirate"),
        ("generate", "-p", "hello"),
        ("cache-prompt", "--chat-template-config", "{}"),
    ]:
        out = ["--prompt-cache-file", tmp_path / "c.safetensors"] if command != "generate" else []
        line = _error_line(run(command, "--model", tmp_path / "nope", "--prompt-tokens", "1",
                               flag, value, *out))  # fmt: skip
        assert line.startswith("error: --prompt-tokens and --"), line
    assert not (tmp_path / "c.safetensors").exists()
    # ... or --chat, which has no text to template; nor --chat beside its opposite
    gen = ("generate", "--model", tmp_path / "nope")
    line = _error_line(run(*gen, "--prompt-tokens", "1", "--chat"))
    assert line.startswith("error: --prompt-tokens and --chat"), line
    line = _error_line(run(*gen, "-p", "hi", "--chat", "--ignore-chat-template"))
    assert line == "error: --ignore-chat-template and --chat: give one or the other"


def test_synthetic_store_and_bench(tmp_path):
    from strata_mlx.convert.synthetic import convert_synthetic, synthetic_config
    from strata_mlx.format.store import load_manifest, load_profile

    cfg = synthetic_config("bench-small")
    cfg.update(
        num_hidden_layers=3,
        num_experts=32,
        hidden_size=128,
        moe_intermediate_size=64,
        intermediate_size=256,
        vocab_size=256,
        num_attention_heads=2,
        head_dim=64,
        num_experts_per_tok=4,
    )
    path = convert_synthetic(
        "tiny",
        tmp_path / "synth",
        config=cfg,
        progress=False,
        dtype="float32",
        calibration_tokens=64,
    )
    m = load_manifest(path)
    counts = load_profile(path, m)
    assert counts.shape == (3, 32) and counts.sum() == 3 * 64 * 4
    # structured routing is skewed: the top quarter of experts takes most picks
    top = np.sort(counts, axis=1)[:, ::-1][:, :8].sum() / counts.sum()
    assert top > 0.4
    arena = 48 * m.layout.record_bytes / 1024**3  # half the experts: no expert-major groups
    r = run(
        "bench",
        "--model",
        path,
        "-p",
        "32",
        "-g",
        "4",
        "--prefill-step-size",
        "16",
        "--arena-gb",
        arena,
        "--json",
        tmp_path / "b.json",
        # through an emulated drive (a laptop's SSD standing in): the probes read through it
        env={**os.environ, "STRATA_MLX_DRIVE_GBPS": "0.5"},
    )
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "b.json").read_text())
    assert result["emulated_drive_gbps"] == 0.5
    # (this process's value, the package's default where the environment had none)
    assert result["cuda_device_max_connections"] == os.environ["CUDA_DEVICE_MAX_CONNECTIONS"]
    assert "an emulated drive of 0.5 GB/s" in r.stderr + r.stdout
    assert 0 < result["ssd_gbps"] <= 0.5 * 1.01 and result["data_path_gbps"] <= 0.5 * 1.01
    rows = {(x["policy"], x["phase"]): x for x in result["runs"]}
    assert set(rows) == {
        (p, ph) for p in ("demand", "static", "lookahead") for ph in ("cold", "warm")
    }
    assert rows[("demand", "cold")]["streamed_ahead_pct"] == 0
    assert rows[("lookahead", "cold")]["streamed_ahead_pct"] > 0
    # demand's decode misses: each read held by the 0.5 GB/s drive at least its record's time
    demand = rows[("demand", "cold")]
    assert demand["decode_miss_pct"] > 0
    assert demand["decode_miss_landing_us"] >= 0.9 * m.layout.record_bytes / 0.5e9 * 1e6
    assert "| policy |" in r.stdout
    # the data path's own probe sets the read floor; decode has a floor of its own
    assert result["data_path_gbps"] > 0 and "data path into the arena" in r.stderr + r.stdout
    for row in rows.values():
        assert row["path_floor_ratio"] > 0 and row["decode_floor_ratio"] > 0
        assert row["decode_floor_ms"] > 0
    assert rows[("demand", "cold")]["read_floor_ms"] > 0
    # decode's serial floor: the compute plus the misses' records over the data path; demand
    # predicts nothing, so every read is a miss and it is the sum of its floor's two parts
    compute = 1e3 / result["compute_decode_tps"]

    def misses_ms(row):
        return (
            row["decode_misses_per_token"] * m.layout.record_bytes / result["data_path_gbps"] / 1e6
        )

    floor, serial = demand["decode_floor_ms"], demand["decode_serial_floor_ms"]
    assert serial == pytest.approx(compute + misses_ms(demand))
    assert floor < serial <= 2 * floor
    assert demand["decode_serial_ratio"] < demand["decode_floor_ratio"]
    ahead = rows[("lookahead", "cold")]  # (its read-ahead overlaps: not counted, never < floor)
    assert ahead["decode_serial_floor_ms"] == pytest.approx(
        max(ahead["decode_floor_ms"], compute + misses_ms(ahead))
    )


def test_probe_ssd_cli(store):
    r = run(
        "probe-ssd",
        Path(store("qwen3_moe")) / "experts.bin",
        "--seconds",
        "0.2",
        "--workers",
        "1,2",
        "--record-bytes",
        "4096",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("GB/s") == 2
    assert "records of" not in r.stdout  # (the size asked for is the size read)
    # a size direct reads cannot take is read as 4 KB, and the output says so
    r = run("probe-ssd", Path(store("qwen3_moe")) / "experts.bin", "--seconds", "0.1",
            "--workers", "1", "--record-bytes", "3")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "records of 4096 bytes (--record-bytes 3, rounded" in r.stdout


@pytest.mark.parametrize(
    "args, names",
    [
        (["--workers", "0"], "--workers 0"),
        (["--workers", "1,300"], "--workers 300"),
        (["--workers", ","], "--workers: empty"),
        (["--workers", "1,,4"], "--workers '1,,4': an empty entry"),
        (["--record-bytes", "-5"], "--record-bytes"),
        (["--seconds", "0"], "--seconds"),
        (["--seconds", "nan"], "--seconds"),
    ],
)
def test_probe_ssd_ranges_are_one_line_errors(store, args, names):
    """Bad probe settings: one line, exit 2 (`--workers 0` was the reader's ValueError)."""
    line = _error_line(run("probe-ssd", Path(store("qwen3_moe")) / "experts.bin", *args))
    assert names in line


def test_probe_ssd_of_a_directory_says_what_it_is(tmp_path):
    line = _error_line(run("probe-ssd", tmp_path))  # it said "no such file"
    assert line == f"error: {tmp_path}: not a regular file; give a large file on the drive"


@pytest.mark.parametrize(
    "command, flag",
    [
        (["bench", "--json"], "--json"),
        (["bench", "--plot"], "--plot"),
        (["plan", "{model}", "--json"], "--json"),
        (["generate", "--prompt-tokens", "1", "--logits-out"], "--logits-out"),
        (["cache-prompt", "--prompt-tokens", "1", "--prompt-cache-file"], "--prompt-cache-file"),
    ],
)
def test_output_files_are_checked_before_anything_loads(tmp_path, command, flag):
    """An output a run could not write fails at once, not after the run: the model named here
    does not exist, and the error is the output's (a missing directory, a directory, a plot
    not named .png); nothing is written."""
    model = tmp_path / "no-such-store"
    cmd = [a.format(model=model) for a in command]
    opts = [] if "{model}" in command else ["--model", model]
    outputs = [tmp_path / "no-dir" / "out.png", tmp_path]
    if flag == "--plot":
        outputs.append(tmp_path / "out.svg")
    for out in outputs:
        line = _error_line(run(*cmd, out, *opts))
        assert line.startswith(f"error: {flag} {out}: "), line
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "args, names",
    [
        (["--kv-bits", "7"], "--kv-bits"),
        (["--max-kv-size", "2"], "--max-kv-size"),
        (["--pipeline", "--max-kv-size", "64"], "--pipeline"),
        # uvicorn failed on it once the model was up, and the server's worker kept the
        # process from exiting
        (["--log-level", "bogus"], "--log-level 'bogus': one of critical, error, warning"),
    ],
)
def test_serve_kv_flags_are_checked_before_loading(tmp_path, args, names):
    """serve's KV cache flags (mlx-lm's) and its log level fail in one line before a store
    is looked at."""
    line = _error_line(run("serve", "--model", tmp_path / "no-such-store", *args))
    assert names in line


def test_runtime_preset(store):
    path = store("qwen3_moe")
    r = run(
        "generate",
        "--model",
        path,
        "--prompt-tokens",
        "1,2,3",
        "-m",
        "2",
        "--preset",
        "laptop-24gb",
    )
    assert r.returncode == 0, r.stderr
    line = _error_line(run("generate", "--model", path, "--prompt-tokens", "1", "--preset", "nope"))
    assert "nope.json" in line and "laptop-24gb" in line
    from strata_mlx.runtime.loader import RuntimeConfig, apply_preset

    cfg = apply_preset(RuntimeConfig(io_workers=4), "laptop-24gb")
    assert cfg.arena_gb == 6.5 and cfg.prefill_step_size == 2048 and cfg.io_workers == 4


def test_generate_decode_paths_print_the_same_tokens(store):
    """--decode sync (the per-layer handshake) and the default pipelined decode, as a user
    runs them: the same greedy token ids on stdout."""
    path = store("qwen3_moe")
    ids = ",".join(map(str, prompt_ids(10, seed=8)))
    outs = []
    for extra in (["--decode", "sync"], ["--decode-lag", "2"]):
        r = run(
            "generate",
            "--model",
            path,
            "--prompt-tokens",
            ids,
            "-m",
            "6",
            "--temp",
            "0",
            "--arena-gb",
            0.0001,
            *extra,
        )
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout.split("==========")[0])
    assert outs[0] == outs[1] and outs[0].strip()
    r = run("generate", "--model", path, "--prompt-tokens", ids, "--decode", "bogus")
    assert r.returncode != 0 and "--decode 'bogus'" in r.stderr


# ---- sampling and chat flags as mlx-lm spells them -----------------------------------------


def first_line_tokens(r) -> list[str]:
    assert r.returncode == 0, r.stderr
    return r.stdout.split("\n")[0].split()


def test_top_k_samples_and_experts_per_token_routes(store, tmp_path):
    """--top-k is top-k sampling (mlx-lm's flag): 1 is greedy at any temperature, 5 draws what
    the API's sampler draws from the same seed; --min-p and --repetition-penalty as the API;
    --experts-per-token is the routing override --top-k used to be."""
    from strata_mlx.generation.sampling import make_logits_processors, make_sampler

    path = store("qwen3_moe")
    ids = prompt_ids(8, seed=8)
    base = ["generate", "--model", path, "--prompt-tokens", ",".join(map(str, ids)), "-m", "8"]
    model, _ = strata_mlx.load(path)

    def api(**kw) -> list[str]:
        return [str(r.token) for r in strata_mlx.stream_generate(model, None, ids, 8, **kw)]

    greedy = first_line_tokens(run(*base))
    assert greedy == api()
    for flags in (["--top-k", "1"], ["--min-p", "1"]):
        assert first_line_tokens(run(*base, "--temp", "1", "--seed", "4", *flags)) == greedy
    top5 = first_line_tokens(run(*base, "--temp", "1", "--top-k", "5", "--seed", "4"))
    assert top5 == api(seed=4, sampler=make_sampler(1.0, top_k=5)) and top5 != greedy
    mixed = ["--temp", "0.8", "--top-p", "0.9", "--min-p", "0.05", "--seed", "9"]
    mixed += ["--repetition-penalty", "1.4", "--repetition-context-size", "6"]
    assert first_line_tokens(run(*base, *mixed)) == api(
        seed=9,
        sampler=make_sampler(0.8, top_p=0.9, min_p=0.05),
        logits_processors=make_logits_processors(repetition_penalty=1.4, repetition_context_size=6),
    )
    out = tmp_path / "k1.npy"
    assert first_line_tokens(run(*base, "--experts-per-token", "1", "--logits-out", out))
    default = teacher_forced_logits(model, ids)
    for block in model.moe_blocks().values():
        block.top_k = 1
    k1 = teacher_forced_logits(model, ids)
    np.testing.assert_array_equal(np.load(out), k1)
    assert not np.array_equal(k1, default)
    model.expert_cache.close()


def test_sampling_flag_errors(store):
    path = store("qwen3_moe")
    base = ["generate", "--model", path, "--prompt-tokens", "1,2", "-m", "2"]
    for flags, flag in [
        (["--top-k", "-1"], "--top-k"),
        (["--min-p", "2"], "--min-p"),
        (["--min-tokens-to-keep", "0"], "--min-tokens-to-keep"),
        (["--repetition-penalty", "-1"], "--repetition-penalty"),
        (["--repetition-context-size", "0"], "--repetition-context-size"),
        (["--xtc-threshold", "0.7"], "--xtc-threshold"),
        (["--experts-per-token", "99"], "--experts-per-token 99"),
        (["--chat-template-config", "[1]"], "--chat-template-config"),
        (["--chat-template-config", "{nope"], "--chat-template-config"),
        (["--chat-template-config", '{"messages": 1}'], "--chat-template-config"),
        (["--no-chat", "--system-prompt", "hi"], "--system-prompt"),
    ]:
        assert flag in _error_line(run(*base, *flags)), flags
    # every family's bound, Mixtral's too (its args name num_local_experts)
    base[2] = store("mixtral")
    assert "--experts-per-token 99" in _error_line(run(*base, "--experts-per-token", "99"))


def test_system_prompt_and_chat_template_config(store, tmp_path):
    """--system-prompt puts a system message before the prompt and --chat-template-config
    passes variables to the template (both imply --chat): the prompt the summary counts is
    the API's, and so is the text."""
    from test_server import write_tokenizer

    path = tmp_path / "chat"
    shutil.copytree(store("qwen3_moe"), path)
    write_tokenizer(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% if topic is defined %}{{ topic }} {% endif %}" + (config["chat_template"])
    )
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    model, tok = strata_mlx.load(path)
    user = {"role": "user", "content": "the cat sat"}
    system = {"role": "system", "content": "paris is a city"}
    for flags, text in [
        ([], tok.apply_chat_template([user])),  # the template by default, as mlx-lm
        (["--ignore-chat-template"], user["content"]),
        (["--no-chat"], user["content"]),
        (["--chat"], tok.apply_chat_template([user])),
        (["--system-prompt", system["content"]], tok.apply_chat_template([system, user])),
        (
            ["--chat-template-config", '{"topic": "fox"}'],
            tok.apply_chat_template([user], topic="fox"),
        ),
    ]:
        ids = tok.encode(text, add_special_tokens=text == user["content"])
        r = run("generate", "--model", path, "-p", "the cat sat", "-m", "4", *flags)
        assert r.returncode == 0, r.stderr
        assert f"Prompt: {len(ids)} tokens" in r.stdout, (flags, r.stdout)
        assert r.stdout.startswith(strata_mlx.generate(model, tok, ids, max_tokens=4)), flags
    assert tok.apply_chat_template([user], topic="fox").startswith("fox <|im_start|>user")
    model.expert_cache.close()


@pytest.mark.parametrize(
    "args, names",
    [
        (["-p", "1"], "--prompt-tokens"),
        (["-g", "0"], "--generation-tokens"),
        (["--repeats", "0"], "--repeats"),
        (["--prefill-step-size", "0"], "--prefill-step-size"),
        (["--policies", "demand,sideways"], "sideways"),
        (["--policies", "lookahead:d0x"], "d0x"),
        (["--policies", ","], "--policies"),
        (["--scheduler", "eager"], "--scheduler"),
        (["--lookahead-depth", "0"], "--lookahead-depth"),
    ],
)
def test_bench_ranges_are_one_line_errors(store, args, names):
    """Bad bench settings fail in one line, exit 2, before the store is loaded."""
    line = _error_line(run("bench", "--model", store("qwen3_moe"), *args))
    assert names in line


def test_scheduler_and_lookahead_depth_flags(store):
    """--scheduler and --lookahead-depth reach the runtime: both schedulers print the same
    tokens (the scheduler changes when experts are read, never what is computed)."""
    path = store("qwen3_moe")
    base = ("generate", "--model", path, "--prompt-tokens", "1,2,3,4", "-m", "3")
    outs = [
        run(*base, "--scheduler", s, "--lookahead-depth", d)
        for s, d in (("sync", "1"), ("loop", "3"))
    ]
    assert all(r.returncode == 0 for r in outs), [r.stderr for r in outs]
    assert outs[0].stdout.splitlines()[0] == outs[1].stdout.splitlines()[0]
    assert "--scheduler" in _error_line(run(*base, "--scheduler", "eager"))
    assert "--lookahead-depth" in _error_line(run(*base, "--lookahead-depth", "0"))


def test_runtime_config_from_arguments_and_preset():
    """Flags given win over the preset, the preset over RuntimeConfig's defaults."""
    from strata_mlx.apps.cli.common import runtime_config
    from strata_mlx.runtime.loader import RuntimeConfig

    cfg = runtime_config({"io_workers": 3}, "laptop-24gb")
    assert cfg.io_workers == 3 and cfg.arena_gb == 6.5 and cfg.prefill_step_size == 2048
    assert runtime_config({}) == RuntimeConfig()


def test_user_errors_keep_a_bug_s_traceback():
    """Our own error types are one line; another exception (a bug) is not hidden as one."""
    import typer

    from strata_mlx.apps.cli.common import user_errors
    from strata_mlx.config import OptionError, check_int

    @user_errors
    def refused():
        check_int("io_workers", 0, 1, cli=True)

    with pytest.raises(typer.Exit):
        refused()

    @user_errors
    def buggy():
        return int("not a number")  # a ValueError from a builtin: a bug, not a user's error

    with pytest.raises(ValueError, match="invalid literal"):
        buggy()
    assert issubclass(OptionError, ValueError)


def test_a_file_system_refusing_an_output_is_one_line(capsys):
    """A full disk, a read-only or over-quota file system, a path through a file: one line
    naming the file (--dump-moe's .npy files, --trace under a full disk were tracebacks);
    a library's message whose first line ends in a colon keeps the names on its next."""
    import errno

    import typer

    from strata_mlx.apps.cli.common import user_errors
    from strata_mlx.format.store import StoreError

    for code, words in ((errno.ENOSPC, "No space left on device"),
                        (errno.EROFS, "Read-only file system")):  # fmt: skip

        @user_errors
        def refused(code=code, words=words):
            raise OSError(code, words, "dump/layer000_call0000_x.npy")

        with pytest.raises(typer.Exit) as e:
            refused()
        assert e.value.exit_code == 2
        assert capsys.readouterr().err == f"error: dump/layer000_call0000_x.npy: {words}\n"

    @user_errors
    def missing():
        raise StoreError("d/dense.safetensors: Missing 1 parameters: \nlm_head.weight.")

    with pytest.raises(typer.Exit):
        missing()
    assert capsys.readouterr().err == (
        "error: d/dense.safetensors: Missing 1 parameters: lm_head.weight.\n"
    )

    @user_errors
    def other():  # (an OSError of another kind, from our code or a library's: a bug)
        raise OSError(errno.EBADF, "Bad file descriptor")

    with pytest.raises(OSError, match="Bad file"):
        other()


def test_an_output_flag_naming_a_pipe_or_device_is_refused(store, tmp_path):
    """`--json /dev/null` replaced the device with a regular file: a path that exists and is
    no regular file (a pipe here) is refused before anything runs, and left as it was."""
    import stat

    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    line = _error_line(run("plan", store("qwen3_moe"), "--json", fifo))
    assert line == f"error: --json {fifo}: not a regular file (a device, a pipe); name a file"
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_a_bad_kernels_variable_is_one_line_and_exit_2(store):
    env = {**os.environ, "STRATA_MLX_KERNELS": "bogus"}
    r = run("generate", "--model", store("qwen3_moe"), "--prompt-tokens", "1,2", "-m", "1", env=env)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == "error: STRATA_MLX_KERNELS='bogus': one of reference, cuda, metal"


# ---- help and the runtime options' one declaration ---------------------------------------


def _invoke(*args: str):
    from typer.testing import CliRunner

    from strata_mlx.apps.cli import app

    return CliRunner().invoke(app, list(args), env={"COLUMNS": "100"})


def test_generate_help_fits_a_screen_in_its_first_panel():
    """Basics first (model, prompt, tokens, chat), each flag with one default; the first
    panel fits 40 lines at 100 columns; -h is --help on every command; --version prints the
    package's version; switches take no value."""
    import re

    import typer

    from strata_mlx.apps.cli import app

    text = _invoke("generate", "--help").stdout
    first = text.splitlines()
    first = first[: next(i for i, line in enumerate(first) if line.startswith("╰")) + 1]
    assert len(first) <= 40, "\n".join(first)
    assert all(f in "\n".join(first) for f in ("--model", "--prompt", "--max-tokens", "--chat"))
    panels = [line.split("─")[1].strip() for line in text.splitlines() if line.startswith("╭")]
    assert panels == ["Options", "Sampling", "Memory and streaming", "Research"]
    flat = " ".join(text.replace("│", " ").split())
    assert "<bool>" not in flat
    assert not re.search(r"\(default[^)]*\)\.? \[default", flat)
    commands = typer.main.get_command(app).commands
    # the listing: each command's first paragraph, wrapped to the panel, not cut at the
    # docstring's own line breaks (typer's rich listing keeps them)
    listing = _invoke("--help").stdout
    for name, c in commands.items():
        if name != "kernels":  # (a group: its one-line help is its own)
            assert c.short_help and "\n" not in c.short_help, name
            assert c.short_help.split()[-1] in listing, name
    for args in [[], *([name] for name in commands), ["kernels", "show"]]:
        r = _invoke(*args, "-h")
        assert r.exit_code == 0 and "Usage:" in r.stdout and "<bool>" not in r.stdout, args
    verbose = next(p for p in commands["generate"].params if p.name == "verbose")
    assert verbose.is_flag
    r = _invoke("--version")
    assert r.exit_code == 0 and r.stdout.strip() == f"strata-mlx {strata_mlx.__version__}"
    bench = " ".join(_invoke("bench", "-h").stdout.replace("│", " ").split())
    assert 'pip install "strata-mlx[plot]"' in bench


def test_a_runtime_option_declared_once_is_a_flag_a_preset_key_and_a_bench_variant(monkeypatch):
    """lookahead_depth, declared once on ReadAhead: the flag of every runtime command with the
    declaration's help and default, a preset key, bench's `:dN`, its range held everywhere
    with a one-line error naming the flag."""
    import typer

    from strata_mlx import configs
    from strata_mlx.apps.bench import policy_options
    from strata_mlx.apps.cli import app
    from strata_mlx.config import OptionError, check_runtime, runtime_options
    from strata_mlx.runtime.loader import RuntimeConfig, apply_preset

    option = next(o for o in runtime_options(RuntimeConfig) if o.name == "lookahead_depth")
    assert option.path == ("read_ahead", "depth") and option.default == 2
    commands = typer.main.get_command(app).commands
    for name in ("generate", "serve", "bench", "cache-prompt"):
        params = {p.name: p for p in commands[name].params}
        assert params["lookahead_depth"].opts == ["--lookahead-depth"], name
        assert params["lookahead_depth"].help.startswith(option.option.help), name
        assert params["lookahead_depth"].help.endswith("[default: 2]"), name
    monkeypatch.setattr(configs, "read", lambda kind, name: {"lookahead_depth": 3})
    assert apply_preset(RuntimeConfig(), "any").read_ahead.depth == 3
    assert policy_options("lookahead:d5:sync")["lookahead_depth"] == 5
    with pytest.raises(OptionError, match="^--lookahead-depth 0: expected an integer in"):
        check_runtime(RuntimeConfig().replace(**policy_options("lookahead:d0")), cli=True)
    for args in (["generate", "--lookahead-depth", "0"],
                 ["bench", "--model", ".", "--policies", "lookahead:d0"]):  # fmt: skip
        r = _invoke(*args)
        assert r.exit_code == 2, (args, r.output)
        lines = r.output.strip().splitlines()
        assert len(lines) == 1 and "--lookahead-depth 0" in lines[0], r.output
    # every option: a flag, a preset key, and its bench variant where it declares one
    for o in runtime_options(RuntimeConfig):
        assert o.name in {p.name for p in commands["generate"].params}
        monkeypatch.setattr(configs, "read", lambda kind, name, o=o: {o.name: o.default})
        apply_preset(RuntimeConfig(), "any")
        if o.option.variant not in (None, "choices"):
            value = "1" if o.is_switch else "7"
            got = policy_options(f"demand:{o.option.variant}{value}")[o.name]
            assert got == (True if o.is_switch else 7), o.name


@pytest.mark.parametrize(
    "args, names",
    [
        (["--allowed-origins", "not an origin,,"], "--allowed-origins"),
        (["--allowed-origins", "ftp://x.example"], "--allowed-origins"),
        (["--allowed-hosts", "http://myhost"], "--allowed-hosts"),
        (["--allowed-hosts", ","], "--allowed-hosts"),
        (["--max-body-bytes", "0"], "--max-body-bytes"),
        (["--host", "no host here"], "--host"),
    ],
)
def test_serve_guard_flags_and_a_bad_host_are_one_line(store, args, names):
    """Before the model loads: the Host / Origin lists, the body limit, an unknown host."""
    line = _error_line(run("serve", "--model", store("qwen3_moe"), *args))
    assert names in line


def test_serve_on_a_port_in_use_is_one_line(store):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        line = _error_line(run("serve", "--model", store("qwen3_moe"), "--port", port))
    assert f"--port {port}" in line and "in use" in line


@pytest.mark.parametrize("command", ["generate", "cache-prompt"])
def test_a_non_utf8_prompt_on_stdin_is_one_line(store, tmp_path, command):
    extra = ["--prompt-cache-file", tmp_path / "c.safetensors"] if command == "cache-prompt" else []
    r = subprocess.run([*CLI, command, "--model", str(store("qwen3_moe")), "-p", "-", *map(str, extra)],
                       input=b"caf\xe9", capture_output=True, timeout=300)  # fmt: skip
    r.stderr, r.stdout = r.stderr.decode(), r.stdout.decode()
    line = _error_line(r)
    assert "--prompt -" in line and "not UTF-8" in line
    assert not (tmp_path / "c.safetensors").exists()


def test_prompt_and_max_tokens_past_the_context_are_refused(store, tmp_path):
    """The tiny stores' context is 512 positions: past it, unless a rotating cache is chosen."""
    path = store("qwen3_moe")
    ids = ",".join(["5"] * 500)
    line = _error_line(run("generate", "--model", path, "--prompt-tokens", ids, "-m", 20))
    assert "context of 512" in line and "--max-tokens 20" in line and "--max-kv-size" in line
    r = run("generate", "--model", path, "--prompt-tokens", ids, "-m", 20, "--max-kv-size", 256)
    assert r.returncode == 0, r.stderr
    line = _error_line(run("generate", "--model", path, "-p", "x", "-m", 2**40))
    assert "--max-tokens" in line
    out = tmp_path / "c.safetensors"
    long = ",".join(["5"] * 600)
    line = _error_line(run("cache-prompt", "--model", path, "--prompt-tokens", long,
                           "--prompt-cache-file", out))  # fmt: skip
    assert "context of 512" in line and not out.exists()
    # bench runs what generate would: refused as it is (it ran past the context without a word)
    line = _error_line(run("bench", "--model", path, "-p", 500, "-g", 20, "--json", out))
    assert line.endswith(
        "past the model's context of 512 (max_position_embeddings): shorten -p or -g"
    )
    assert not out.exists()


@pytest.mark.parametrize("flag", ["--target-memory", "--target-ssd-gbps", "--arena-gb"])
def test_plan_targets_name_their_flag(store, flag):
    line = _error_line(run("plan", store("qwen3_moe"), flag, "nan", "--no-measure"))
    assert flag in line


@pytest.mark.parametrize("command", ["generate", "cache-prompt"])
@pytest.mark.parametrize("flag", ["--max-kv-size", "--kv-bits"])
def test_gpt_oss_kv_refusals_name_the_flag(store, tmp_path, command, flag):
    extra = ["--prompt-cache-file", tmp_path / "c.safetensors"] if command == "cache-prompt" else []
    value = 64 if flag == "--max-kv-size" else 4
    r = run(command, "--model", store("gpt_oss"), "--prompt-tokens", "1,2,3", flag, value, *extra)
    assert f"error: {flag}: gpt_oss keeps a plain KV cache" in _error_line(r)


def test_the_docs_list_the_q_bits_convert_takes(hf_checkpoint, tmp_path):
    """docs/usage.md's formats table gives -q's bit widths (affine stores of 5 and 6 bits come
    from mlx-lm checkpoints only); convert refuses any other in one line listing the same."""
    import re

    table = (Path(__file__).parents[2] / "docs" / "usage.md").read_text()
    listed = re.search(r"\(`--q-bits` ([0-9/]+)\)", table).group(1).split("/")
    src = hf_checkpoint("qwen3_moe")
    r = run("convert", "--hf-path", src, "--mlx-path", tmp_path / "s", "-q", "--q-bits", 5)
    assert f"--q-bits 5: one of {', '.join(listed)}" in _error_line(r)
    assert not (tmp_path / "s").exists()


def test_outputs_into_the_store_or_onto_each_other_are_refused(store, tmp_path):
    """`--trace STORE/manifest.json` wrote over the store's manifest (unreadable after),
    `--trace x --logits-out x` kept the trace alone, and an output over a file the command
    reads destroyed it; each refused before anything runs."""
    path = Path(store("qwen3_moe"))
    gen = ("generate", "--model", path, "--prompt-tokens", "1,2,3", "-m", "1")
    line = _error_line(run(*gen, "--trace", path / "manifest.json"))
    assert f"--trace {path / 'manifest.json'}: inside the store" in line
    same = tmp_path / "x"
    line = _error_line(run(*gen, "--trace", same, "--logits-out", same))
    assert f"--trace {same}: --logits-out writes there too" in line
    line = _error_line(run("plan", path, "--json", path / "plan.json"))
    assert "--json" in line and "inside the store" in line
    # an output over a file the command reads: a prompt cache, the reference logits
    cache, ref = tmp_path / "c.safetensors", tmp_path / "ref.npy"
    cache.write_bytes(b"a cache"), ref.write_bytes(b"logits")
    line = _error_line(run(*gen, "--prompt-cache-file", cache, "--logits-out", cache))
    assert f"--logits-out {cache}: --prompt-cache-file reads it; give each its own file" in line
    line = _error_line(run(*gen, "--logits-ref", ref, "--trace", ref))
    assert f"--trace {ref}: --logits-ref reads it" in line
    assert cache.read_bytes() == b"a cache" and ref.read_bytes() == b"logits"
    # the built-in model (no --model): its store, in strata-mlx's cache directory
    home = tmp_path / "home"
    (home / "store").mkdir(parents=True)
    (home / "store" / "manifest.json").write_text("{}")
    env = {**os.environ, "STRATA_MLX_HOME": str(home)}
    line = _error_line(run("cache-prompt", "-p", "hi", "--prompt-cache-file",
                           home / "store" / "manifest.json", env=env))  # fmt: skip
    assert f"inside the built-in model's store {home.resolve() / 'store'}" in line
    assert sorted(p.name for p in home.rglob("*")) == ["manifest.json", "store"]
    assert (home / "store" / "manifest.json").read_text() == "{}"
    from strata_mlx.format.store import load_manifest

    assert not same.exists() and not (path / "plan.json").exists()
    assert load_manifest(path).num_experts > 0


@pytest.mark.parametrize(
    "args, line",
    [
        (["serve", "--port", "abc"], "error: Invalid value for '--port': Input should be a valid "
         "integer, unable to parse string as an integer (strata-mlx serve -h for help)"),
        (["bogus"], "error: No such command 'bogus'. (strata-mlx -h for help)"),
        (["generate", "--nope"], "error: No such option: --nope (Possible options: --model, "
         "--top-k, --top-p) (strata-mlx generate -h for help)"),
        (["kernels", "show"], "error: Missing argument 'FORMAT'. (strata-mlx kernels show -h "
         "for help)"),
        (["convert", "--q-bits"], "error: Option '--q-bits' requires an argument."),
    ],
)  # fmt: skip
def test_usage_errors_are_one_line_as_every_user_error(args, line):
    """A flag's value of the wrong type, an unknown command or option, a missing argument:
    one line on stderr and exit 2 as our own errors (typer's were a five-line box), the
    command's help named where typer knows the command."""
    assert _error_line(run(*args)) == line


def test_no_arguments_show_the_help_and_exit_2():
    """No command (or a group with none): the help, on stdout, and exit 2 as typer had it."""
    for args in ([], ["kernels"]):
        r = run(*args)
        assert r.returncode == 2 and "Usage: strata-mlx" in r.stdout and not r.stderr.strip()


def test_route_parity_without_a_model_compares_the_builtin_one(store, monkeypatch):
    """`strata-mlx route-parity` with no --model: the built-in model, each configuration's
    arena its automatic one unless given (it was the one command that required --model)."""
    from typer.testing import CliRunner

    from strata_mlx.apps import default_model
    from strata_mlx.apps.cli import app
    from strata_mlx.generation import tools

    path = store("qwen3_moe")
    monkeypatch.setattr(default_model, "default_store", lambda: path)
    monkeypatch.setattr(default_model, "default_arena_gb", lambda _s: 0.0001)
    arenas, real = [], tools.traced_run
    monkeypatch.setattr(
        tools,
        "traced_run",
        lambda m, ids, cfg, *a: arenas.append((m, cfg.arena_gb)) or real(m, ids, cfg, *a),
    )
    r = CliRunner().invoke(app, ["route-parity", "--random-tokens", "8", "--arena-gb-b", "0.001"])
    assert r.exit_code == 0, r.output
    assert arenas == [(path, 0.0001), (path, 0.001)]
    assert "logits: bit-identical" in r.output


def test_ctrl_c_ends_the_line_prints_the_figures_and_writes_no_output(store, tmp_path):
    """Ctrl-C mid-generation: the text so far on a line of its own, the run's figures, exit
    130, and no --trace of a part of the run (the shell's prompt was glued to the text)."""
    import signal

    trace = tmp_path / "t.npz"
    p = subprocess.Popen(
        [*CLI, "generate", "--model", str(store("qwen3_moe")), "--prompt-tokens", "1,2,3",
         "-m", "500", "--decode", "sync", "--trace", str(trace)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert p.stdout.read(8)  # decoding (token ids: the store has no tokenizer)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    text, _, figures = out.partition("\n==========\n")
    assert figures, out  # (the text ended its line before the figures)
    generated = int(figures.split("Generation: ")[1].split(" tokens")[0])
    assert 0 < generated < 500
    assert not trace.exists() and "Traceback" not in err


def test_a_path_that_is_no_store_says_what_it_is_and_which_flag_takes_it(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    line = _error_line(run("generate", "--model", gguf, "-p", "hi"))
    assert line == (
        f"error: {gguf}: a GGUF file, not a strata-mlx store; convert it first: strata-mlx "
        f"convert --gguf-path {gguf} --mlx-path DIR"
    )
    out = tmp_path / "out"
    line = _error_line(run("convert", "--hf-path", gguf, "--mlx-path", out))
    assert line.endswith("not a Hugging Face checkpoint (convert takes it as --gguf-path)")
    nowhere = tmp_path / "nowhere"
    for args in (("generate", "--model", nowhere, "-p", "hi"), ("serve", "--model", nowhere)):
        line = _error_line(run(*args))
        assert line == f"error: {nowhere}: no such directory (expected a strata-mlx store)"
    assert not out.exists()


def test_generate_leaves_room_for_the_whole_kv_cache_of_its_prompt(store, monkeypatch):
    """load()'s arena leaves room for one chunk's KV cache; generate knows its prompt and
    max tokens before it loads and reserves the rest (a long prompt's cache grew past the room
    while an automatic arena held the rest of memory)."""
    from test_bench_cache import reserves
    from typer.testing import CliRunner

    from strata_mlx.apps.cli import app
    from strata_mlx.runtime import loader

    path = store("qwen3_moe")
    reserved = reserves(monkeypatch, loader)
    for n in (400, 8):  # (a KV cache grows 256 positions at a time)
        r = CliRunner().invoke(app, ["generate", "--model", str(path), "--prompt-tokens",
                                     ",".join(["5"] * n), "-m", "20", "--prefill-step-size", "16"])  # fmt: skip
        assert r.exit_code == 0, r.output
    chunk = loader.sequence_kv_bytes(path, 16)
    assert reserved == [loader.sequence_kv_bytes(path, 420) - chunk, 0]
    assert reserved[0] > 0
