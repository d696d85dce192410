"""Validation at the door: the manifest, profile, tokenizer files, chat
template, GGUF headers and every generate/serve option checked before anything is allocated
or computed; each failure one line naming the file and the field (or the option).

The manifest and GGUF cases are the crashing inputs the fuzzers found (tests/test_fuzz.py),
kept as regression tests: each used to end in a SIGFPE, an out-of-memory kill, a 24 GB
allocation, a hang or a TypeError/KeyError/OverflowError traceback."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tiny_gguf
from conftest import prompt_ids
from typer.testing import CliRunner

import strata_mlx
from strata_mlx.config import OptionError, check_sampling
from strata_mlx.format.store import StoreError, load_manifest, load_profile
from strata_mlx.generation.tokenizer import ChatTemplateError, Tokenizer

FAMILY = "qwen3_moe"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit(path: Path, fn) -> None:
    m = json.loads((path / "manifest.json").read_text())
    fn(m)
    (path / "manifest.json").write_text(json.dumps(m))


def _one_line(e: BaseException) -> str:
    msg = str(e)
    assert len(msg.splitlines()) == 1, msg
    return msg


def _set(*keys_and_value):
    *keys, value = keys_and_value

    def fn(m):
        node = m
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value

    return fn


# (id, quantized store?, edit, what the message must name)
MANIFEST_CASES = [
    # the issue's own list
    ("bits-0-sigfpe", True, _set("experts", "quant", "gate_proj", "bits", 0), "bits"),
    ("offset-string", False, _set("experts", "offsets", 0, 1, "4096"), "experts.offsets[0][1]"),
    ("offset-null", False, _set("experts", "offsets", 1, 0, None), "experts.offsets[1][0]"),
    ("offset-float", False, _set("experts", "offsets", 0, 2, 8192.0), "experts.offsets[0][2]"),
    ("config-null", False, _set("config", None), "config"),
    ("hidden-size-string", False, _set("config", "hidden_size", "32"), "config.hidden_size"),
    ("moe-layers-shifted", False, _set("experts", "moe_layers", [1, 2]), "moe_layers"),
    # found by fuzzing
    ("layers-2^31-oom", False, _set("config", "num_hidden_layers", 2**31 - 1), "num_hidden_layers"),
    ("head-dim-overflow", False, _set("config", "head_dim", 2**31 - 1), "head_dim"),
    ("group-size-3", True, _set("experts", "quant", "up_proj", "group_size", 3), "group_size"),
    ("bits-string", True, _set("experts", "quant", "up_proj", "bits", "4"), "bits"),
    ("dtype-int", False, _set("experts", "components", 2, "dtype", 7), "components[2].dtype"),
    ("shape-null", False, _set("experts", "components", 0, "shape", None), "components[0].shape"),
    ("nbytes-string", False, _set("experts", "components", 1, "nbytes", "4"), "nbytes"),
    ("offset-row-int", False, _set("experts", "offsets", 0, 7), "experts.offsets[0]"),
    ("format-nan", False, _set("experts", "quant", "down_proj", "format", math.nan), "format"),
    ("quant-int", False, _set("experts", "quant", "gate_proj", 6), "experts.quant.gate_proj"),
    ("dense-quant-string", True, _set("config", "quantization", "abc"), "config.quantization"),
    ("dense-group-1", True, _set("config", "quantization", "group_size", 1), "group_size"),
    ("dense-group-31", True, _set("config", "quantization", "group_size", 31), "group_size"),
    ("model-type-object", False, _set("model_type", {}), "model_type"),
    ("rope-theta-null", False, _set("config", "rope_theta", None), "config.rope_theta"),
    ("mlp-only-int", False, _set("config", "mlp_only_layers", 7), "mlp_only_layers"),
    ("sparse-step-0", False, _set("config", "decoder_sparse_step", 0), "decoder_sparse_step"),
    ("kv-heads-dict", False, _set("config", "num_key_value_heads", {"a": 1}), "num_key_value"),
    ("vocab-nan", False, _set("config", "vocab_size", math.nan), "vocab_size"),
    ("top-k-over-n", False, _set("config", "num_experts_per_tok", 9), "num_experts_per_tok"),
    ("experts-vs-config", False, _set("experts", "num_experts", 4), "experts"),
    ("hidden-vs-layout", False, _set("config", "hidden_size", 16), "gate_proj"),
    ("version-true", False, _set("version", True), "version"),
    ("record-bytes-huge", False, _set("experts", "record_bytes", 2**40), "record_bytes"),
    ("component-overlap", False, _set("experts", "components", 1, "offset", 0), "overlap"),
]


@pytest.mark.parametrize(
    "quantized,edit,field", [c[1:] for c in MANIFEST_CASES], ids=[c[0] for c in MANIFEST_CASES]
)
def test_bad_manifest_is_one_line_naming_the_field(store, tmp_path, quantized, edit, field):
    path = _copy(store(FAMILY, quantized), tmp_path / "s")
    _edit(path, edit)
    with pytest.raises(StoreError) as e:
        model, _ = strata_mlx.load(path)
        model.expert_cache.close()
    msg = _one_line(e.value)
    assert "manifest.json" in msg and field in msg, msg


def test_unreadable_manifests(store, tmp_path):
    path = _copy(store(FAMILY), tmp_path / "s")
    for text, why in (
        ("[" * 100_000 + "]" * 100_000, "unreadable"),  # RecursionError inside json
        ("[1, 2]", "not a strata-mlx manifest"),
        ('{"format": "strata-mlx-store", "version": NaN}', "version"),
        (b"\xff\xfe".decode("latin-1"), "unreadable"),
    ):
        (path / "manifest.json").write_text(text)
        with pytest.raises(StoreError, match=why) as e:
            load_manifest(path)
        _one_line(e.value)


@pytest.mark.parametrize(
    "profile,why",
    [
        ({"counts": "x"}, "counts"),
        ({"counts": [[1] * 8]}, "counts"),  # one layer of two
        ({"counts": [[1.5] * 8, [1] * 8]}, "counts[0][0]"),
        ({"counts": [["3"] * 8, [1] * 8]}, "counts[0][0]"),
        ({"counts": [[2**70] * 8, [1] * 8]}, "counts[0][0]"),
        ([[1] * 8, [1] * 8], "profile"),
    ],
)
def test_bad_profile_names_the_field(store, tmp_path, profile, why):
    path = _copy(store(FAMILY), tmp_path / "s")
    (path / "profile.json").write_text(json.dumps(profile))
    with pytest.raises(StoreError) as e:
        load_profile(path, load_manifest(path))
    msg = _one_line(e.value)
    assert "profile.json" in msg and why in msg, msg


def test_a_profile_that_is_a_directory_is_refused(store, tmp_path):
    """It read as a store without a profile: static read-ahead and profile eviction ran
    unranked without a word."""
    path = _copy(store(FAMILY), tmp_path / "s")
    (path / "profile.json").unlink(missing_ok=True)
    (path / "profile.json").mkdir()
    with pytest.raises(StoreError, match="profile.json: not a file"):
        load_profile(path, load_manifest(path))


# ---- tokenizer files and the chat template -------------------------------------------------


def _tokenizer_dir(d: Path, config: dict | None = None) -> Path:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    d.mkdir(exist_ok=True)
    vocab = {w: i for i, w in enumerate(["<unk>", "hello", "world", "<eos>"])}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    if config is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


def test_tokenizer_files_fail_at_load_naming_the_file(tmp_path):
    d = _tokenizer_dir(tmp_path / "t")
    (d / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(StoreError, match="tokenizer.json: unreadable tokenizer"):
        Tokenizer(d)
    cases = [
        ([], "tokenizer_config.json: expected a JSON object"),
        ({"chat_template": "{% for %}"}, "bad chat template"),
        ({"chat_template": 5}, "chat_template: expected a string"),
        ({"eos_token": 5}, "eos_token: expected a string"),
        ({"bos_token": {"content": ["x"]}}, "bos_token: expected a string"),
    ]
    for config, why in cases:
        d = _tokenizer_dir(tmp_path / f"t{len(why)}", config)
        with pytest.raises(StoreError, match=why) as e:
            Tokenizer(d)
        assert "tokenizer_config.json" in _one_line(e.value)
    d = _tokenizer_dir(tmp_path / "gen")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": ["x"]}))
    with pytest.raises(StoreError, match="generation_config.json: eos_token_id"):
        Tokenizer(d)


def test_chat_template_errors(tmp_path):
    msgs = [{"role": "user", "content": "hello"}]
    d = _tokenizer_dir(tmp_path / "a", {"chat_template": "{{ messages[3]['content'].x() }}"})
    with pytest.raises(StoreError, match="the chat template failed") as e:
        Tokenizer(d).apply_chat_template(msgs)
    _one_line(e.value)
    d = _tokenizer_dir(
        tmp_path / "b", {"chat_template": "{{ raise_exception('roles\nmust alternate') }}"}
    )
    with pytest.raises(ChatTemplateError, match="^roles$"):
        Tokenizer(d).apply_chat_template(msgs)
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ 1 }}"}]
    d = _tokenizer_dir(tmp_path / "c", {"chat_template": named})
    assert Tokenizer(d).apply_chat_template(msgs) == "D1"


def test_a_bad_tokenizer_fails_before_the_arena_is_built(store, tmp_path, monkeypatch):
    path = _copy(store(FAMILY), tmp_path / "s")
    _tokenizer_dir(path, {"chat_template": "{% if %}"})
    import strata_mlx.runtime.loader as loader

    monkeypatch.setattr(loader, "Arena", None)  # reaching the arena would raise TypeError
    with pytest.raises(StoreError, match="bad chat template"):
        strata_mlx.load(path)


# ---- options: one range per option, for generate, serve and the API ------------------------

CLI_CASES = [
    (["--arena-gb", "0"], "--arena-gb"),
    (["--arena-gb", "-1"], "--arena-gb"),
    (["--arena-gb", "inf"], "--arena-gb"),
    (["--prefill-step-size", "0"], "--prefill-step-size"),
    (["--prefill-step-size", "-1"], "--prefill-step-size"),
    (["-m", "0"], "--max-tokens"),
    (["-m", "-5"], "--max-tokens"),
    (["--temp", "-1"], "--temp"),
    (["--temp", "nan"], "--temp"),
    (["--top-p", "2"], "--top-p"),
    (["--top-p", "-1"], "--top-p"),
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2**66)], "--seed"),
    (["--io-workers", "0"], "--io-workers"),
    (["--lookahead-decode-min-miss", "nan"], "--lookahead-decode-min-miss"),
    (["--moce-bonus", "inf"], "--moce-bonus"),
    (["--eviction", "fifo"], "--eviction"),
    (["--read-ahead", "always"], "--read-ahead"),
]


def _cli(*args):
    from strata_mlx.apps.cli import app

    return CliRunner().invoke(app, list(map(str, args)))


@pytest.mark.parametrize("args,flag", CLI_CASES, ids=[" ".join(c[0]) for c in CLI_CASES])
def test_generate_options_out_of_range(store, monkeypatch, args, flag):
    import strata_mlx.runtime.loader as loader

    monkeypatch.setattr(loader, "load_manifest", None)  # refused before any store is read
    r = _cli("generate", "--model", store(FAMILY), "--prompt-tokens", "1,2", *args)
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith(f"error: {flag} "), r.output


def test_prompt_longer_than_the_context(store):
    path = store(FAMILY)  # max_position_embeddings 512
    r = _cli("generate", "--model", path, "--prompt-tokens", ",".join(["1"] * 513), "-m", "1")
    assert r.exit_code == 2 and "513 tokens, more than the model's context of 512" in r.output
    model, _ = strata_mlx.load(path)
    try:
        assert len(list(strata_mlx.stream_generate(model, None, [1] * 512, max_tokens=1))) == 1
    finally:
        model.expert_cache.close()


def test_api_refuses_the_same_values(store):
    path = store(FAMILY)
    for bad in ({"arena_gb": math.inf}, {"arena_gb": 0}, {"io_workers": 0}, {"decode": "x"}):
        with pytest.raises(OptionError):
            strata_mlx.load(path, **bad)
    for bad in (-4, 6):  # split reads: parts of whole 4 KB blocks
        with pytest.raises(OptionError, match="read_split_kb"):
            strata_mlx.load(path, read_split_kb=bad)
    model, _ = strata_mlx.load(path)
    try:
        ids = prompt_ids(6)
        for kw in (
            {"max_tokens": 0},
            {"temp": math.nan},
            {"temp": -1.0},
            {"top_p": 1.5},
            {"seed": -1},
            {"seed": 2**64},
            {"max_tokens": 2.5},
        ):
            with pytest.raises(OptionError) as e:
                next(strata_mlx.stream_generate(model, None, ids, **kw))
            assert next(iter(kw)) in _one_line(e.value)
        # top_p 0 is the limit of a shrinking nucleus: the most likely token, as in serve.
        greedy = [r.token for r in strata_mlx.stream_generate(model, None, ids, max_tokens=4)]
        nucleus0 = strata_mlx.stream_generate(model, None, ids, max_tokens=4, temp=1.0, top_p=0)
        assert [r.token for r in nucleus0] == greedy
    finally:
        model.expert_cache.close()
    check_sampling(1, 0.0, 1.0, 2**64 - 1)  # the largest seed MLX takes


def test_numbers_too_large_for_mlx_are_refused(store):
    """Integers past int64 reached MLX as "std::bad_cast" RuntimeErrors (temp, moce_bonus,
    the penalties) and an arena of 1e308 GB overflowed converting to bytes."""
    from strata_mlx.generation.sampling import make_logits_processors, make_sampler

    path = store(FAMILY)
    for bad in ({"arena_gb": 1e308}, {"moce_bonus": 2**63}):
        with pytest.raises(OptionError, match=next(iter(bad))) as e:
            strata_mlx.load(path, **bad)
        _one_line(e.value)
    with pytest.raises(OptionError, match="temp 9223372036854775808: expected a finite number"):
        make_sampler(temp=2**63)
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        with pytest.raises(OptionError, match=name):
            make_logits_processors(**{name: 2**63})
    r = _cli("generate", "--model", path, "--prompt-tokens", "1,2", "--arena-gb", "1e308")
    assert r.exit_code == 2 and "--arena-gb 1e+308: expected a finite number" in r.output


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"target_memory_gb": math.nan}, "--target-memory nan"),
        ({"target_memory_gb": math.inf}, "--target-memory inf"),
        ({"target_memory_gb": 0}, "--target-memory 0"),
        ({"target_memory_gb": -1}, "--target-memory -1"),
        ({"target_ssd_gbps": 0}, "--target-ssd-gbps 0"),
        ({"target_tflops": math.nan}, "--target-tflops nan"),
        ({"io_workers": 0}, "--io-workers 0"),
        ({"arena_gb": math.nan}, "--arena-gb nan"),
        ({"prompt_tokens": 0}, "--prompt-tokens 0"),
        ({"gen_tokens": -1}, "--generation-tokens -1"),
    ],
)
def test_plan_arguments_out_of_range(kw, words):
    """plan's targets: nan and inf memory were a ValueError converting to bytes, a drive of 0
    GB/s a ZeroDivisionError, --io-workers 0 the native reader's ValueError."""
    from strata_mlx.config import check_plan

    with pytest.raises(OptionError, match=words) as e:
        check_plan(**kw, cli=True)
    _one_line(e.value)
    check_plan(target_memory_gb=24, target_ssd_gbps=8, target_tflops=3, cli=True)


def test_options_end_to_end_exit_code(store):
    """As a user runs it: one line on stderr, exit code 2, no model loaded."""
    r = subprocess.run(
        [sys.executable, "-m", "strata_mlx", "generate", "--model", str(store(FAMILY))]
        + ["--prompt-tokens", "1", "--arena-gb", "inf"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr.strip() == (
        "error: --arena-gb inf: expected a finite number in (0, 1e+09]"
    ), r.stderr


# ---- GGUF headers --------------------------------------------------------------------------

V = tiny_gguf.V


def _gguf_case(tmp_path, arch, key, value, vtype=V.UINT32, sub=None):
    meta, tensors = (tiny_gguf.qwen3moe if arch == "qwen3moe" else tiny_gguf.llama)()
    key = key.format(a=arch)
    if value is None:
        del meta[key]
    else:
        meta[key] = (value, vtype, sub)
    return tiny_gguf.write(tmp_path / f"{arch}.gguf", arch, meta, tensors)


GGUF_CASES = [
    ("qwen3moe", "{a}.expert_count", 2**31 - 1, V.UINT32, "expert_count"),  # was a 24 GB alloc
    ("qwen3moe", "{a}.expert_count", 2**24, V.UINT32, "ffn_gate_exps"),  # in range; tensors differ
    ("qwen3moe", "{a}.expert_count", 0, V.UINT32, "expert_count"),
    ("qwen3moe", "{a}.expert_used_count", 5, V.UINT32, "expert_used_count"),
    ("qwen3moe", "{a}.block_count", 2**31 - 1, V.UINT32, "block_count"),
    ("qwen3moe", "{a}.block_count", 3, V.UINT32, "blk.2"),
    ("qwen3moe", "{a}.embedding_length", "32", V.STRING, "embedding_length"),
    ("qwen3moe", "{a}.attention.head_count", 0, V.UINT32, "head_count"),
    ("qwen3moe", "{a}.attention.head_count_kv", 3, V.UINT32, "heads"),
    ("qwen3moe", "{a}.rope.freq_base", math.nan, V.FLOAT32, "freq_base"),
    ("llama", "{a}.feed_forward_length", None, None, "feed_forward_length"),
    ("llama", "{a}.vocab_size", 1000, V.UINT32, "token_embd"),
    ("llama", "{a}.rope.scaling.factor", 0.0, V.FLOAT32, None),  # unused without a type
    ("qwen3moe", "tokenizer.ggml.tokens", [f"t{i}" for i in range(300)], V.ARRAY, "300 tokens"),
    ("qwen3moe", "tokenizer.ggml.tokens", "abc", V.STRING, "tokenizer.ggml.tokens"),
    ("qwen3moe", "tokenizer.ggml.merges", ["nospace"], V.ARRAY, "merges"),
    ("qwen3moe", "tokenizer.ggml.pre", 3, V.UINT32, "tokenizer.ggml.pre"),
    ("qwen3moe", "tokenizer.ggml.bos_token_id", "x", V.STRING, "bos_token_id"),
    ("qwen3moe", "tokenizer.ggml.add_bos_token", "false", V.STRING, "add_bos_token"),
    ("qwen3moe", "tokenizer.ggml.token_type", [1, 2], V.ARRAY, "token_type"),
]


@pytest.mark.parametrize(
    "arch,key,value,vtype,field",
    GGUF_CASES,
    ids=[f"{c[0]}-{c[1].split('.')[-1]}-{str(c[2])[:12]}" for c in GGUF_CASES],
)
def test_gguf_header_fields(tmp_path, arch, key, value, vtype, field):
    from strata_mlx.convert.gguf import convert_gguf

    sub = V.STRING if key.endswith(("tokens", "merges")) else V.INT32
    path = _gguf_case(tmp_path, arch, key, value, vtype, sub if vtype == V.ARRAY else None)
    split = 2 if arch == "llama" else None
    t = time.perf_counter()
    if field is None:
        convert_gguf(
            path, tmp_path / "out", split_experts=split, progress=False, calibration_tokens=0
        )
        return
    with pytest.raises(StoreError) as e:
        convert_gguf(
            path, tmp_path / "out", split_experts=split, progress=False, calibration_tokens=0
        )
    msg = _one_line(e.value)
    assert str(path) in msg and field in msg, msg
    assert time.perf_counter() - t < 10  # refused from the header, nothing large read or built
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_gguf_merges_tokenizers_panics_on_fail_in_one_line(tmp_path):
    """A merge whose join is not a token, in a vocabulary this small: tokenizers panics
    (pyo3's PanicException, a BaseException) where a larger one gets its error; the
    conversion still fails in one line, nothing written."""
    from strata_mlx.convert.gguf import convert_gguf

    meta, tensors = tiny_gguf.qwen3moe()
    meta["tokenizer.ggml.tokens"] = (["h", "e"], V.ARRAY, V.STRING)
    meta["tokenizer.ggml.token_type"] = ([1, 1], V.ARRAY, V.INT32)
    meta["tokenizer.ggml.merges"] = (["h e"], V.ARRAY, V.STRING)
    path = tiny_gguf.write(tmp_path / "m.gguf", "qwen3moe", meta, tensors)
    with pytest.raises(StoreError) as e:
        convert_gguf(path, tmp_path / "out", progress=False, calibration_tokens=0)
    msg = _one_line(e.value)
    assert str(path) in msg and "rejected by tokenizers" in msg, msg
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_gguf_tokenizer_that_encodes_nothing_does_not_hang(tmp_path):
    """A vocabulary of control tokens only: the calibration text encodes to no ids, which
    used to loop forever doubling an empty list."""
    from strata_mlx.convert.gguf import convert_gguf

    meta, tensors = tiny_gguf.qwen3moe()
    n = tiny_gguf.VOCAB
    meta["tokenizer.ggml.tokens"] = ([f"<c{i}>" for i in range(n)], V.ARRAY, V.STRING)
    meta["tokenizer.ggml.token_type"] = ([3] * n, V.ARRAY, V.INT32)
    del meta["tokenizer.ggml.merges"]
    path = tiny_gguf.write(tmp_path / "m.gguf", "qwen3moe", meta, tensors)
    with pytest.raises(StoreError, match="calibration text encodes to no tokens"):
        convert_gguf(path, tmp_path / "out", progress=False, calibration_tokens=8)
    assert not list(tmp_path.glob(".out*"))


def _array_header(path: Path, key: str) -> int:
    """Offset of metadata `key`'s array item type (its length follows)."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    f = r.fields[key]
    return f.parts[3].__array_interface__["data"][0] - r.data.__array_interface__["data"][0]


@pytest.mark.parametrize("item_type", [0, 5])  # uint8, int32
def test_gguf_array_longer_than_the_file_is_refused_before_parsing(tmp_path, item_type):
    """Found by the header fuzzer: gguf-py reads an array item by item, and past the end of
    the file gets empty items that do not advance; an array length of 2^64 - 1 grew the
    process to 20 GB until the OOM killer took it."""
    from strata_mlx.convert.gguf import convert_gguf

    path = tiny_gguf.write(tmp_path / "m.gguf", "qwen3moe", *tiny_gguf.qwen3moe())
    b = bytearray(path.read_bytes())
    at = _array_header(path, "tokenizer.ggml.token_type")
    b[at : at + 12] = item_type.to_bytes(4, "little") + (2**64 - 1).to_bytes(8, "little")
    path.write_bytes(bytes(b))
    with pytest.raises(StoreError) as e:
        convert_gguf(path, tmp_path / "out", progress=False)
    msg = _one_line(e.value)
    assert "tokenizer.ggml.token_type" in msg and "18446744073709551615 items" in msg, msg


def test_gguf_key_length_past_the_file_is_one_line(tmp_path):
    """Found by the header fuzzer: a key length covering the rest of the file put the whole
    file, newlines and all, into the message."""
    from strata_mlx.convert.gguf import convert_gguf

    path = tiny_gguf.write(tmp_path / "m.gguf", "qwen3moe", *tiny_gguf.qwen3moe())
    b = bytearray(path.read_bytes())
    b[24:32] = (len(b) - 40).to_bytes(8, "little")  # the first key's length
    path.write_bytes(bytes(b))
    with pytest.raises(StoreError) as e:
        convert_gguf(path, tmp_path / "out", progress=False)
    assert len(_one_line(e.value)) < 300


def test_routing_options_are_runtime_settings_applied_by_load(store):
    """--experts-per-token and --moce-bonus are RuntimeConfig fields that load() applies
    (nothing patched onto the model afterwards); a top-k above the store's count is refused
    naming the store."""
    path = store("mixtral")  # its args name the expert count num_local_experts
    n = load_manifest(path).num_experts
    model, _ = strata_mlx.load(path, experts_per_token=1, moce_bonus=0.5)
    assert {b.top_k for b in model.moe_blocks().values()} == {1}
    assert model.expert_cache.route_bonus == 0.5
    model.expert_cache.close()
    with pytest.raises(OptionError, match=rf"{path}: experts_per_token {n + 1}"):
        strata_mlx.load(path, experts_per_token=n + 1)
    with pytest.raises(OptionError, match="moce_bonus"):
        strata_mlx.load(path, moce_bonus=-1.0)
