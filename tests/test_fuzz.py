"""Fuzzing and fault injection, property-based with hypothesis, bounded in
time (well under a minute each on two cores): every input ends in success or in one of our
one-line error types (StoreError, OptionError, PromptCacheError), never another exception, a
native crash or a hang.

- mutated manifests of tiny stores (an HF store with affine experts and quantized dense
  layers; a GGUF store with per-layer layouts and a tokenizer) through load() and two
  generated tokens;
- mutated GGUF headers (typed metadata values, raw header bytes) through convert_gguf, then
  load() and generation of whatever converted;
- a conversion killed with SIGKILL at a random point, then run again: the output is at every
  moment absent or a whole store (never a partial one), and the rerun leaves no temporary
  directory behind;
- the rope and routing fields of store configs (a manifest's config, through load() and three
  tokens whose log-probabilities must be numbers) and of Hugging Face config.json files
  (through convert, which leaves no store behind when it refuses);
- prompt-cache files: random bytes (refused, or the answer of a cold run), and crafted files
  whose checksum matches: arrays of the wrong shape or dtype, missing, renamed or extra ones,
  metadata of the wrong type.

Inputs that crashed before the fixes are kept as regression tests in test_validation.py.
In CI (CI=true) the examples are derandomized, so a run is reproducible; locally each run
draws new ones.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import tiny_gguf
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import strata_mlx
from strata_mlx.config import OptionError
from strata_mlx.convert.gguf import convert_gguf
from strata_mlx.format.store import StoreError, load_manifest

OURS = (StoreError, OptionError)
FUZZ = dict(
    deadline=None,
    database=None,
    derandomize=bool(os.environ.get("CI")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture
def bounded_memory():
    """A memory blow-up fails the test with a MemoryError instead of summoning the machine's
    OOM killer (the first GGUF header fuzz run grew to 20 GB before it was killed)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    vm = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = vm + (4 << 30)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _one_line(e: BaseException) -> None:
    assert len(str(e).splitlines()) == 1, str(e)


def _generate(path: Path) -> None:
    """load() and two tokens; only our error types may come out."""
    try:
        model, tok = strata_mlx.load(path, arena_gb=3 * 4096 / 1024**3)
    except OURS as e:
        _one_line(e)
        event("refused at load")
        return
    try:
        ids = (tok.encode("hello") if tok is not None else None) or [1, 2, 3]
        for _ in strata_mlx.stream_generate(model, tok, ids, max_tokens=2):
            pass
        if tok is not None and tok.chat_template:
            tok.apply_chat_template([{"role": "user", "content": "hi"}])
        event("generated")
    except OURS as e:
        _one_line(e)
        event("refused in generation")
    finally:
        model.expert_cache.close()


# ---- manifests -----------------------------------------------------------------------------

EDGE_INTS = [0, 1, -1, 2, 3, 5, 6, 7, 8, 16, 31, 32, 64, 4095, 4096, 2**31 - 1, 2**32, 2**63]
json_values = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(EDGE_INTS),
    st.integers(min_value=-(2**66), max_value=2**66),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "4", "float", "affine", "gguf", "Q4_K", "uint32", "bfloat16", "llama"]),
    st.text(max_size=6),
    st.lists(st.sampled_from(EDGE_INTS), max_size=3),
    st.dictionaries(
        st.sampled_from(["a", "bits", "format"]), st.sampled_from(EDGE_INTS), max_size=2
    ),
)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


def _mutate(m, data) -> None:
    """One change at a path of the JSON tree: replace, delete, nudge a number, shift or cut
    a list (a shifted moe_layers), or swap in a value from elsewhere in the manifest."""
    paths = list(_paths(m))[1:]
    path = data.draw(st.sampled_from(paths))
    parent = m
    for k in path[:-1]:
        parent = parent[k]
    key, value = path[-1], parent[path[-1]]
    kind = data.draw(st.sampled_from(["replace", "delete", "nudge", "shift", "cut", "swap"]))
    if kind == "delete" and isinstance(parent, dict):
        del parent[key]
    elif kind == "nudge" and isinstance(value, (int, float)) and not isinstance(value, bool):
        parent[key] = data.draw(
            st.sampled_from([value + 1, value - 1, value * 2, -value, value / 2])
        )
    elif kind == "shift" and isinstance(value, list) and value:
        parent[key] = value[1:] + value[:1] if len(value) > 1 else [value[0], value[0]]
    elif kind == "cut" and isinstance(value, list):
        parent[key] = value[: data.draw(st.integers(0, max(len(value) - 1, 0)))]
    elif kind == "swap":
        other = m
        for k in data.draw(st.sampled_from(paths)):
            other = other[k]
        parent[key] = copy.deepcopy(other)
    else:
        parent[key] = data.draw(json_values)


@pytest.fixture(scope="module")
def manifest_bases(store, tmp_path_factory):
    """name -> (working copy of a tiny store, its original manifest)."""
    root = tmp_path_factory.mktemp("fuzz-manifests")
    gguf = tiny_gguf.write(root / "m.gguf", "qwen3moe", *tiny_gguf.qwen3moe(f32_down=(1,)))
    made = convert_gguf(gguf, root / "gguf-src", progress=False, calibration_tokens=8)
    assert load_manifest(made).layer_layouts is not None
    bases = {}
    for name, src in (("hf-affine", store("qwen3_moe", True)), ("gguf-per-layer", made)):
        work = shutil.copytree(src, root / name)
        bases[name] = (work, json.loads((work / "manifest.json").read_text()))
    return bases


@settings(max_examples=1000, **FUZZ)
@given(data=st.data())
def test_mutated_manifests_load_or_fail_in_one_line(manifest_bases, bounded_memory, data):
    name = data.draw(st.sampled_from(sorted(manifest_bases)))
    path, original = manifest_bases[name]
    m = copy.deepcopy(original)
    for _ in range(data.draw(st.integers(1, 3))):
        _mutate(m, data)
    (path / "manifest.json").write_text(json.dumps(m))
    _generate(path)


# ---- GGUF headers --------------------------------------------------------------------------

V = tiny_gguf.V
typed_values = st.one_of(
    st.tuples(
        st.sampled_from([0, 1, 2, 3, 16, 31, 33, 64, 259, 2**24, 2**31 - 1]), st.just(V.UINT32)
    ),
    st.tuples(st.sampled_from([-1, -(2**31)]), st.just(V.INT32)),
    st.tuples(st.sampled_from([2**32, 2**63 - 1]), st.just(V.UINT64)),
    st.tuples(st.sampled_from([0.0, -1.0, math.nan, math.inf, 1e-30, 1e30]), st.just(V.FLOAT32)),
    st.tuples(
        st.sampled_from(["", "abc", "llama", "gpt2", "linear", "{% for %}", "{{ x.y() }}"]),
        st.just(V.STRING),
    ),
    st.tuples(st.booleans(), st.just(V.BOOL)),
)
EXTRA_KEYS = [
    "{a}.rope.scaling.type",
    "{a}.rope.scaling.factor",
    "{a}.vocab_size",
    "{a}.attention.key_length",
    "{a}.rope.dimension_count",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.add_eos_token",
]


def _mutate_meta(meta: dict, arch: str, data) -> None:
    key = data.draw(st.sampled_from(sorted(meta) + [k.format(a=arch) for k in EXTRA_KEYS]))
    kind = data.draw(st.sampled_from(["replace", "delete", "array"]))
    if kind == "delete" and key in meta:
        del meta[key]
    elif kind == "array" and key in meta and meta[key][1] == V.ARRAY:
        value, vtype, sub = meta[key]
        value = list(value)
        cut = data.draw(st.integers(1, len(value)))
        if data.draw(st.booleans()):
            value = value[:cut]
        else:
            item = data.draw(st.sampled_from(["", "a b c", "x"] if sub == V.STRING else [0, 4, 9]))
            value[cut - 1] = item
        meta[key] = (value, vtype, sub)
    else:
        value, vtype = data.draw(typed_values)
        meta[key] = (value, vtype, None)


def _convert_and_run(path: Path, out: Path, arch: str, calibration: int) -> None:
    shutil.rmtree(out, ignore_errors=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an unknown pre-tokenizer or tokenizer model
            store = convert_gguf(
                path,
                out,
                split_experts=2 if arch == "llama" else None,
                progress=False,
                calibration_tokens=calibration,
            )
    except OURS as e:
        _one_line(e)
        event("refused at convert")
        assert not out.exists()
    else:
        _generate(store)
    assert not list(out.parent.glob(f".{out.name}.*")), "a temporary directory was left"


@settings(max_examples=150, **FUZZ)
@given(data=st.data())
def test_mutated_gguf_metadata_converts_or_fails_in_one_line(
    tmp_path_factory, bounded_memory, data
):
    arch = data.draw(st.sampled_from(["qwen3moe", "llama"]))
    meta, tensors = (tiny_gguf.qwen3moe if arch == "qwen3moe" else tiny_gguf.llama)()
    for _ in range(data.draw(st.integers(1, 2))):
        _mutate_meta(meta, arch, data)
    d = tmp_path_factory.mktemp("gguf-meta")
    try:
        path = tiny_gguf.write(d / "m.gguf", arch, meta, tensors)
    except (ValueError, TypeError, OverflowError, KeyError):
        return  # gguf-py would not write it; not a file anyone can hand us
    calibration = data.draw(st.sampled_from([0, 8])) if arch == "qwen3moe" else 0
    _convert_and_run(path, d / "out", arch, calibration)


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """arch -> (file bytes, where tensor data starts, {"count": offsets of the header's counts
    and lengths (metadata and tensor counts, key and string lengths, array lengths, tensor
    dimensions and offsets), "type": offsets of value types, array item types, tensor types,
    "array": offsets of array headers (item type, then length)})."""
    from gguf import GGUFReader

    d = tmp_path_factory.mktemp("gguf-bytes")
    files = {}
    for arch, build in (("qwen3moe", tiny_gguf.qwen3moe), ("llama", tiny_gguf.llama)):
        path = tiny_gguf.write(d / f"{arch}.gguf", arch, *build())
        r = GGUFReader(str(path))
        base = r.data.__array_interface__["data"][0]

        def at(part, base=base) -> int:
            return part.__array_interface__["data"][0] - base

        points: dict[str, set[int]] = {"count": {8, 16}, "type": set(), "array": set()}
        for f in r.fields.values():
            if f.name.startswith("GGUF."):
                continue
            points["count"].add(at(f.parts[0]))
            points["type"].add(at(f.parts[2]))
            if f.types[0] == V.ARRAY:
                points["type"].add(at(f.parts[3]))
                points["count"].add(at(f.parts[4]))
                points["array"].add(at(f.parts[3]))  # item type, then the length
            elif f.types[0] == V.STRING:
                points["count"].add(at(f.parts[3]))
        for t in r.tensors:
            name_len, _, n_dims, dims, ggml_type, offset = t.field.parts
            points["count"].update(at(x) for x in (name_len, n_dims, dims, offset))
            points["type"].add(at(ggml_type))
        header = min(t.data_offset for t in r.tensors)
        files[arch] = (path.read_bytes(), header, {k: sorted(v) for k, v in points.items()})
    return files


@settings(max_examples=300, **FUZZ)
@given(data=st.data())
def test_mutated_gguf_header_bytes_convert_or_fail_in_one_line(
    gguf_files, tmp_path_factory, bounded_memory, data
):
    """Raw header bytes (counts, lengths, types, offsets) overwritten: sizes computed from the
    header must be checked against the file before anything is allocated."""
    arch = data.draw(st.sampled_from(sorted(gguf_files)))
    raw, header, points = gguf_files[arch]
    b = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 3))):
        kind = data.draw(st.sampled_from(["count", "type", "array", "byte"]))
        if kind == "array":  # an array's item type and length together
            at = data.draw(st.sampled_from(points["array"]))
            b[at : at + 4] = data.draw(st.integers(0, 12)).to_bytes(4, "little")
            v = data.draw(st.sampled_from([2**32, 2**63, 2**64 - 1]))
            b[at + 4 : at + 12] = v.to_bytes(8, "little")
        elif kind == "count":  # a count or length of the header itself (uint64)
            at = data.draw(st.sampled_from(points["count"]))
            v = data.draw(st.sampled_from([0, 1, 2, 2**31 - 1, 2**32, 2**63, 2**64 - 1]))
            b[at : at + 8] = v.to_bytes(8, "little")
        elif kind == "type":  # a value, item or tensor type (uint32)
            at = data.draw(st.sampled_from(points["type"]))
            b[at : at + 4] = data.draw(st.integers(0, 40)).to_bytes(4, "little")
        else:
            b[data.draw(st.integers(0, header - 1))] = data.draw(st.integers(0, 255))
    d = tmp_path_factory.mktemp("gguf-bytes-case")
    (d / "m.gguf").write_bytes(bytes(b))
    _convert_and_run(d / "m.gguf", d / "out", arch, 0)


# ---- a conversion killed at random points --------------------------------------------------

CLI = [sys.executable, "-m", "strata_mlx"]


def _temps(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f".{out.name}.*"))


def _convert_cmd(src: Path, out: Path) -> list[str]:
    return [*CLI, "convert", "--gguf-path", str(src), "--mlx-path", str(out), "--overwrite"]


@pytest.fixture(scope="module")
def kill_setup(tmp_path_factory):
    """A GGUF, and how long a conversion of it takes once its temporary directory exists."""
    d = tmp_path_factory.mktemp("kill")
    src = tiny_gguf.write(d / "m.gguf", "qwen3moe", *tiny_gguf.qwen3moe())
    out = d / "probe"
    p = subprocess.Popen(_convert_cmd(src, out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    while not _temps(out) and p.poll() is None:
        time.sleep(0.002)
    t = time.monotonic()
    assert p.wait(120) == 0, p.stderr.read()
    return src, time.monotonic() - t


@settings(max_examples=8, **FUZZ)
@given(fraction=st.floats(0.0, 1.2), replace=st.booleans())
def test_convert_killed_at_a_random_point_then_rerun(
    kill_setup, tmp_path_factory, fraction, replace
):
    src, span = kill_setup
    out = tmp_path_factory.mktemp("killed") / "s"
    if replace:
        assert subprocess.run(_convert_cmd(src, out), capture_output=True).returncode == 0
    before = (out / "manifest.json").read_bytes() if replace else None
    p = subprocess.Popen(
        _convert_cmd(src, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    while not _temps(out) and p.poll() is None:
        time.sleep(0.002)
    time.sleep(fraction * span)
    p.send_signal(signal.SIGKILL)
    p.wait(60)
    # At every moment the output is absent (a first conversion) or a whole store.
    if out.exists():
        load_manifest(out)
    else:
        assert not replace or any((t / ".replaced").is_dir() for t in _temps(out)), _temps(out)
    r = subprocess.run(_convert_cmd(src, out), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert not _temps(out), _temps(out)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) in (
        [],
        [".verified.json"],
    )
    load_manifest(out)
    if before is not None:
        assert (out / "manifest.json").read_bytes() == before  # the same source, the same store


# ---- store configs: rope and routing fields ------------------------------------------------

# The config fields the rotary embeddings and the routers read, per kind of model.
ROPE_KEYS = ["rope_type", "type", "factor", "original_max_position_embeddings", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate",
             "low_freq_factor", "high_freq_factor"]  # fmt: skip
CONFIG_KEYS = ["rope_scaling", "rope_parameters", "rope_theta", "partial_rotary_factor",
               "rope_interleave", "rope_traditional", "num_experts_per_tok", "n_group",
               "topk_group", "routed_scaling_factor", "norm_topk_prob", "scoring_func",
               "topk_method", "first_k_dense_replace", "moe_layer_freq", "n_routed_experts",
               "n_shared_experts", "num_experts", "num_local_experts", "decoder_sparse_step",
               "mlp_only_layers", "swiglu_limit", "swiglu_alpha", "sliding_window",
               "layer_types", "qk_rope_head_dim", "max_position_embeddings"]  # fmt: skip
config_values = st.one_of(
    json_values,
    st.floats(min_value=0, max_value=1e6),
    st.sampled_from(
        [
            "yarn",
            "llama3",
            "linear",
            "deepseek_yarn",
            "default",
            "dynamic",
            "sigmoid",
            "softmax",
            "noaux_tc",
            "greedy",
        ]
    ),  # fmt: skip
)


def _mutate_config(config: dict, data) -> None:
    """Set or delete one rope_scaling key (a scaling dict made if there is none) or one
    rope / routing field of the config."""
    if data.draw(st.booleans()):
        scaling = config.get("rope_scaling")
        if not isinstance(scaling, dict):
            scaling = config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0,
                                                "original_max_position_embeddings": 128}  # fmt: skip
        key = data.draw(st.sampled_from(ROPE_KEYS))
        where = scaling
    else:
        key = data.draw(st.sampled_from(CONFIG_KEYS))
        where = config
    if data.draw(st.integers(0, 4)) == 0:
        where.pop(key, None)
    else:
        where[key] = data.draw(config_values)


def _generate_finite(path: Path) -> None:
    """load() and three tokens: only our error types, and log-probabilities that are numbers
    (a NaN answer is a silent wrong one)."""
    import numpy as np

    try:
        model, _ = strata_mlx.load(path, arena_gb=3 * 4096 / 1024**3)
    except OURS as e:
        _one_line(e)
        event("refused at load")
        return
    try:
        for r in strata_mlx.stream_generate(model, None, [1, 2, 3, 4, 5], max_tokens=3):
            assert np.isfinite(np.array(r.logprobs)).all(), "non-finite log-probabilities"
        event("generated")
    except OURS as e:
        _one_line(e)
        event("refused in generation")
    finally:
        model.expert_cache.close()


@pytest.fixture(scope="module")
def config_bases(store, tmp_path_factory):
    """family -> (working copy of its tiny store, its original manifest): YaRN and group
    routing (deepseek_v3), YaRN and sliding windows (gpt_oss), top-k routing (qwen3_moe)."""
    root = tmp_path_factory.mktemp("fuzz-configs")
    bases = {}
    for family in ("deepseek_v3", "gpt_oss", "qwen3_moe"):
        work = shutil.copytree(store(family), root / family)
        bases[family] = (work, json.loads((work / "manifest.json").read_text()))
    return bases


@settings(max_examples=300, **FUZZ)
@given(data=st.data())
def test_store_configs_rope_and_routing_fields_load_or_fail_in_one_line(
    config_bases, bounded_memory, data
):
    family = data.draw(st.sampled_from(sorted(config_bases)))
    path, original = config_bases[family]
    m = copy.deepcopy(original)
    for _ in range(data.draw(st.integers(1, 3))):
        _mutate_config(m["config"], data)
    (path / "manifest.json").write_text(json.dumps(m))
    _generate_finite(path)


@settings(max_examples=60, **FUZZ)
@given(data=st.data())
def test_checkpoint_configs_rope_and_routing_fields_convert_or_fail_in_one_line(
    hf_checkpoint, tmp_path_factory, bounded_memory, data
):
    """The same fields in a Hugging Face config.json, through convert: one line and no
    store (nor a temporary directory) left, or a store that loads and generates."""
    from strata_mlx.convert.hf import convert_hf

    family = data.draw(st.sampled_from(["deepseek_v3", "gpt_oss"]))
    d = tmp_path_factory.mktemp("fuzz-hf")
    src = shutil.copytree(hf_checkpoint(family), d / "src")
    config = json.loads((src / "config.json").read_text())
    for _ in range(data.draw(st.integers(1, 2))):
        _mutate_config(config, data)
    (src / "config.json").write_text(json.dumps(config))
    out = d / "out"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no tokenizer files
            made = convert_hf(src, out, progress=False, calibration_tokens=0)
    except OURS as e:
        _one_line(e)
        event("refused at convert")
        assert not out.exists()
    else:
        _generate_finite(made)
    assert not list(out.parent.glob(f".{out.name}.*")), "a temporary directory was left"


# ---- prompt-cache files --------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompt_caches(store, tmp_path_factory):
    """family -> (a resident model, a saved cache of 12 tokens: its bytes, arrays and
    metadata, the prompt's remaining tokens, the tokens a cold run of the whole prompt
    generates). KV layers (qwen3_moe) and recurrent ones (qwen3_next)."""
    import mlx.core as mx

    from strata_mlx.generation.generate import cache_prompt
    from strata_mlx.generation.prompt_cache import save_prompt_cache

    d = tmp_path_factory.mktemp("fuzz-caches")
    made = {}
    for family in ("qwen3_moe", "qwen3_next"):
        path = store(family)
        size = load_manifest(path).expert_bytes
        model, _ = strata_mlx.load(path, arena_gb=size / 1024**3, read_ahead="demand")
        model.expert_cache.warm()
        ids = list(range(3, 23))
        cold = [r.token for r in strata_mlx.stream_generate(model, None, ids, 3)]
        f = d / f"{family}.safetensors"
        save_prompt_cache(f, cache_prompt(model, ids[:12]), model, ids[:12])
        arrays, meta = mx.load(str(f), return_metadata=True)
        made[family] = (model, f.read_bytes(), dict(arrays), dict(meta), ids[12:], cold)
    yield made
    for model, *_ in made.values():
        model.expert_cache.close()


def _mutated_arrays(arrays: dict, data) -> dict:
    """One array of the wrong shape or dtype, or one missing, renamed or added."""
    import mlx.core as mx

    arrays = dict(arrays)
    name = data.draw(st.sampled_from(sorted(arrays)))
    a = arrays[name]
    kind = data.draw(st.sampled_from(["slice", "grow", "transpose", "flat", "dtype", "drop",
                                      "rename", "add"]))  # fmt: skip
    axis = data.draw(st.integers(0, a.ndim - 1)) if a.ndim else 0
    if kind == "slice" and a.ndim and a.shape[axis] > 1:
        arrays[name] = mx.split(a, [a.shape[axis] - 1], axis=axis)[0]
    elif kind == "grow" and a.ndim:
        arrays[name] = mx.concatenate([a, a], axis=axis)
    elif kind == "transpose" and a.ndim > 1:
        arrays[name] = mx.swapaxes(a, 0, a.ndim - 1)
    elif kind == "flat":
        arrays[name] = a.reshape(-1)
    elif kind == "dtype":
        dtype = data.draw(st.sampled_from([mx.float16, mx.bfloat16, mx.int32, mx.uint32,
                                           mx.uint8, mx.bool_]))  # fmt: skip
        arrays[name] = a.astype(dtype)
    elif kind == "drop":
        del arrays[name]
    elif kind == "rename":
        new = data.draw(
            st.sampled_from(["0.keys", "9.keys", "x", "1.", "0.0", "01.keys", "٣.keys"])
        )
        arrays[new] = arrays.pop(name)
    else:
        arrays[data.draw(st.sampled_from(["0.extra", "5.keys", "0.7"]))] = a
    return arrays


def _mutated_metadata(meta: dict, data) -> dict:
    """One metadata entry replaced by other text, or one field of a layer's entry by a JSON
    value of another type or range."""
    meta = dict(meta)
    key = data.draw(st.sampled_from(sorted(meta)))
    if key == "layers" and data.draw(st.booleans()):
        layers = json.loads(meta["layers"])
        i = data.draw(st.integers(0, len(layers) - 1))
        field = data.draw(st.sampled_from(sorted(layers[i]) + ["type", "bits", "size"]))
        layers[i][field] = data.draw(json_values)
        meta["layers"] = json.dumps(layers)
    elif data.draw(st.booleans()):
        meta[key] = json.dumps(data.draw(json_values))
    else:
        meta[key] = data.draw(st.text(max_size=12))
    return meta


def _resume(model, f: Path, rest: list[int]) -> list[int] | None:
    """The tokens generated from the cache in `f`, or None where it is refused in one line."""
    from strata_mlx.generation.prompt_cache import PromptCacheError, load_prompt_cache

    try:
        cache, tokens, _ = load_prompt_cache(f, model)
        out = strata_mlx.stream_generate(model, None, rest, 3, prompt_cache=cache,
                                         cached_tokens=tokens)  # fmt: skip
        return [r.token for r in out]
    except (*OURS, PromptCacheError) as e:
        _one_line(e)
        event(f"refused: {type(e).__name__}")
        return None


@settings(max_examples=300, **FUZZ)
@given(data=st.data())
def test_prompt_cache_files_load_or_fail_in_one_line(prompt_caches, tmp_path_factory, data):
    """Random bytes anywhere in the file (the checksum must catch every change that matters:
    the tokens are then those of a cold run), and crafted files whose checksum matches:
    arrays of the wrong shape or dtype, missing or extra ones, metadata of the wrong type."""
    import mlx.core as mx

    from strata_mlx.generation.prompt_cache import payload_checksum

    family = data.draw(st.sampled_from(sorted(prompt_caches)))
    model, raw, arrays, meta, rest, cold = prompt_caches[family]
    f = tmp_path_factory.mktemp("fuzz-cache") / "c.safetensors"
    kind = data.draw(st.sampled_from(["bytes", "arrays", "metadata"]))
    if kind == "bytes":
        b = bytearray(raw)
        for _ in range(data.draw(st.integers(1, 40))):
            b[data.draw(st.integers(0, len(b) - 1))] = data.draw(st.integers(0, 255))
        if data.draw(st.integers(0, 9)) == 0:
            b = b[: data.draw(st.integers(0, len(b) - 1))]  # truncated
        f.write_bytes(bytes(b))
        got = _resume(model, f, rest)
        assert got is None or got == cold, "a damaged file changed the answer"
        return
    if kind == "arrays":
        arrays = _mutated_arrays(arrays, data)
    else:
        meta = _mutated_metadata(meta, data)
    if data.draw(st.integers(0, 4)):  # most crafted files carry a matching checksum
        meta["checksum"] = payload_checksum(arrays, meta)
    mx.save_safetensors(str(f), arrays, meta)
    _resume(model, f, rest)
