"""KV caches as mlx-lm has them (strata_mlx.generation.prompt_cache, models/base.py): a rotating cache
(--max-kv-size) and a quantized one (--kv-bits) give mlx-lm's own tokens and log-probabilities
on the same checkpoint, stay exact under the pipelined decoder's rollback, and a prompt cache
saved by cache-prompt resumes to the outputs of a cold run while prefilling only the new
tokens."""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from conftest import TINY, prompt_ids
from test_decode import VARIANTS, arena_for, decode
from test_server import tiny  # noqa: F401 (a fixture: the tiny store with a tokenizer)

import strata_mlx
from strata_mlx.config import OptionError
from strata_mlx.format.store import load_manifest
from strata_mlx.generation.generate import cache_prompt, stream_generate
from strata_mlx.generation.prompt_cache import (
    KVOptions,
    PromptCacheError,
    PromptCacheLRU,
    check_kv_matches,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
)

pytest.importorskip("mlx_lm")

CLI = [sys.executable, "-m", "strata_mlx"]


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=300)


def resident(path, **kw):
    m = load_manifest(path)
    model, _ = strata_mlx.load(path, arena_gb=m.expert_bytes / 1024**3, read_ahead="demand", **kw)
    model.expert_cache.warm()
    return model


@pytest.fixture(scope="module")
def wide_store(tmp_path_factory):
    """qwen3_moe with head_dim 32: a KV group of 32 fits (the shared tiny models have 8)."""
    import torch
    import transformers as T

    from strata_mlx.convert.hf import convert_hf

    torch.manual_seed(1)
    cfg = T.Qwen3MoeConfig(
        **TINY,
        intermediate_size=64,
        moe_intermediate_size=16,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    )
    hf = tmp_path_factory.mktemp("hf_wide")
    T.Qwen3MoeForCausalLM(cfg).to(torch.float32).eval().save_pretrained(hf)
    out = tmp_path_factory.mktemp("stores") / "qwen3_moe-wide-q4"
    convert_hf(hf, out, quantize=True, q_bits=4, q_group_size=32, progress=False,
               calibration_tokens=32)  # fmt: skip
    return out


def mlx_lm_run(ref, ids, n, step, **kw):
    from mlx_lm.generate import generate_step

    out = list(generate_step(mx.array(ids), ref, max_tokens=n, prefill_step_size=step, **kw))
    return [t for t, _ in out], np.stack([np.array(lp) for _, lp in out])


def ours(model, ids, n, step, **kw):
    out = [
        (r.token, np.array(r.logprobs))
        for r in stream_generate(model, None, ids, n, prefill_step_size=step, **kw)
    ]
    return [t for t, _ in out], np.stack([lp for _, lp in out])


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_rotating_cache_equals_mlx_lm(store, family):
    """40 prompt tokens in chunks of 16 through a 16-position window (explicit windowed
    masks), then 12 tokens that wrap the ring: mlx-lm's RotatingKVCache, bit for bit."""
    from mlx_lm.models.cache import RotatingKVCache

    from strata_mlx.apps.baseline import load_mlx_lm

    path = store(family, quantize=True, bits=4)
    ref = load_mlx_lm(path)
    ids = prompt_ids(40, seed=21)
    theirs = mlx_lm_run(
        ref, ids, 12, 16, prompt_cache=[RotatingKVCache(16, keep=4) for _ in ref.layers]
    )
    model = resident(path)
    got = ours(model, ids, 12, 16, max_kv_size=16)
    assert got[0] == theirs[0]
    assert np.array_equal(got[1], theirs[1]), np.abs(got[1] - theirs[1]).max()
    full = ours(model, ids, 12, 16)
    assert not np.array_equal(full[1], got[1])  # the window changed the outputs
    model.expert_cache.close()


@pytest.mark.parametrize("start", [0, 44])
def test_quantized_cache_equals_mlx_lm(wide_store, start):
    """--kv-bits 4 --kv-group-size 32, quantized from the start or from position 44 (in
    decode, after 40 prompt tokens): mlx-lm's QuantizedKVCache and its quantized attention."""
    from strata_mlx.apps.baseline import load_mlx_lm

    ref = load_mlx_lm(wide_store)
    ids = prompt_ids(40, seed=22)
    kv = dict(kv_bits=4, kv_group_size=32, quantized_kv_start=start)
    theirs = mlx_lm_run(ref, ids, 10, 16, **kv)
    model = resident(wide_store)
    got = ours(model, ids, 10, 16, **kv)
    assert got[0] == theirs[0]
    assert np.array_equal(got[1], theirs[1]), np.abs(got[1] - theirs[1]).max()
    full = ours(model, ids, 10, 16)
    assert not np.array_equal(full[1], got[1])
    model.expert_cache.close()


@pytest.mark.parametrize(
    "case",
    [
        ("qwen3_moe", dict(max_kv_size=12)),
        ("wide", dict(kv_bits=4, kv_group_size=32, quantized_kv_start=30)),
    ],
    ids=["rotating", "quantized"],
)
def test_new_caches_pipelined_equal_sync(store, wide_store, case):
    """A quarter arena (layers miss, tokens are discarded and recomputed): the rotating ring
    wraps and the cache is quantized mid-decode, and every pipelined variant still equals the
    per-layer-sync path bit for bit."""
    family, kv = case
    path = wide_store if family == "wide" else store(family)
    ids = prompt_ids(24, seed=23)
    gb = arena_for(path, 0.25)
    sync, _ = strata_mlx.load(path, arena_gb=gb, decode="sync", read_ahead="demand")
    ref = decode(sync, ids, 16, **kv)
    sync.expert_cache.close()
    recomputed = 0
    for name in ("layers-lag0", "layers-lag2", "token-chunk1", "token-chunk3"):
        model, _ = strata_mlx.load(path, arena_gb=gb, read_ahead="demand", **VARIANTS[name])
        tokens, lp = decode(model, ids, 16, **kv)
        assert tokens == ref[0], name
        assert np.array_equal(lp, ref[1]), name
        recomputed += model.expert_cache.stats.recomputed_layers
        model.expert_cache.close()
    assert recomputed > 0  # the rollback was exercised


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next", "deepseek_v3"])
def test_saved_cache_resumes_as_a_cold_run(store, tmp_path, family):
    """KV, gated-delta-net and latent caches: saved after 20 tokens, loaded, continued by 9
    more: the tokens and log-probabilities of a cold run of all 29, and only the 9 prefilled
    (the chunks' own token counts)."""
    path = store(family)
    ids = prompt_ids(29, seed=24)
    head, tail = ids[:20], ids[20:]
    model = resident(path)
    cold = list(stream_generate(model, None, ids, 8, prefill_step_size=8))
    f = tmp_path / "p.safetensors"
    save_prompt_cache(f, cache_prompt(model, head, prefill_step_size=8), model, head)
    cache, tokens, meta = load_prompt_cache(f, model)
    assert tokens == head and meta["store_id"]
    warm = list(
        stream_generate(
            model, None, tail, 8, prefill_step_size=8, prompt_cache=cache, cached_tokens=tokens
        )  # fmt: skip
    )
    assert [r.token for r in warm] == [r.token for r in cold]
    lp = [np.array(r.logprobs) for r in warm], [np.array(r.logprobs) for r in cold]
    np.testing.assert_allclose(np.stack(lp[0]), np.stack(lp[1]), atol=1e-5)
    assert sum(c.tokens for c in warm[-1].chunks) == len(tail) - 1
    assert sum(c.tokens for c in cold[-1].chunks) == len(ids) - 1
    assert warm[-1].prompt_tokens == len(tail)
    model.expert_cache.close()


def test_rotating_and_quantized_caches_round_trip(store, wide_store, tmp_path):
    for path, kv in ((store("qwen3_moe"), KVOptions(max_kv_size=12)),
                     (wide_store, KVOptions(kv_bits=8, kv_group_size=32, quantized_kv_start=0))):  # fmt: skip
        model = resident(path)
        ids = prompt_ids(30, seed=25)
        cold = [r.token for r in stream_generate(model, None, ids, 6, prefill_step_size=8,
                                                 **vars(kv))]  # fmt: skip
        f = tmp_path / "c.safetensors"
        save_prompt_cache(f, cache_prompt(model, ids[:20], kv, 8), model, ids[:20])
        cache, tokens, _ = load_prompt_cache(f, model)
        assert {type(c).__name__ for c in cache} <= {"RotatingKVCache", "QuantizedKVCache"}
        warm = stream_generate(model, None, ids[20:], 6, prefill_step_size=8, prompt_cache=cache,
                               cached_tokens=tokens, **vars(kv))  # fmt: skip
        assert [r.token for r in warm] == cold
        if kv.kv_bits is not None:  # other bits asked for than the saved cache's: refused
            check_kv_matches(f, cache, kv)
            with pytest.raises(PromptCacheError, match="quantized to 8 bits in groups of 32; "
                                                       "kv_bits 4 kv_group_size 32"):  # fmt: skip
                check_kv_matches(f, cache, KVOptions(kv_bits=4, kv_group_size=32))
        model.expert_cache.close()


def tokens_of(stdout: str) -> list[int]:
    return [int(t) for t in stdout.split("==========")[0].split()]


def test_cli_cache_prompt_then_generate(store, tmp_path):
    path = store("qwen3_moe")
    ids = prompt_ids(30, seed=26)
    f = tmp_path / "sys.safetensors"
    r = run("cache-prompt", "--model", path, "--prompt-tokens", ",".join(map(str, ids[:22])),
            "--prompt-cache-file", f, "--prefill-step-size", 8)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "Prompt: 22 tokens" in r.stdout and f.is_file()
    assert not list(tmp_path.glob("*.tmp*"))
    common = ("generate", "--model", path, "-m", 6, "--prefill-step-size", 8)
    cold = run(*common, "--prompt-tokens", ",".join(map(str, ids)))
    assert cold.returncode == 0, cold.stderr
    # The whole prompt (its cached beginning skipped) or only its continuation: the same run.
    for given in (ids, ids[22:]):
        warm = run(*common, "--prompt-tokens", ",".join(map(str, given)), "--prompt-cache-file", f)
        assert warm.returncode == 0, warm.stderr
        assert tokens_of(warm.stdout) == tokens_of(cold.stdout)
        assert "Prompt: 8 tokens" in warm.stdout


def test_cli_prompt_cache_errors_are_one_line(store, tmp_path):
    qwen, olmoe = store("qwen3_moe"), store("olmoe")
    f = tmp_path / "q.safetensors"
    assert run("cache-prompt", "--model", qwen, "--prompt-tokens", "1,2,3",
               "--prompt-cache-file", f).returncode == 0  # fmt: skip
    junk = tmp_path / "junk.safetensors"
    mx.save_safetensors(str(junk), {"a": mx.zeros(2)})
    text = tmp_path / "text.safetensors"
    text.write_text("not safetensors")
    damaged = tmp_path / "damaged.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0xFF  # a payload byte
    damaged.write_bytes(bytes(raw))
    cases = [
        (qwen, ["--prompt-cache-file", damaged], "checksum mismatch"),
        (olmoe, ["--prompt-cache-file", f], "made by another model"),
        (qwen, ["--prompt-cache-file", tmp_path / "none.safetensors"], "no such prompt cache"),
        (qwen, ["--prompt-cache-file", junk], "not a strata-mlx prompt cache"),
        (qwen, ["--prompt-cache-file", text], "not a readable safetensors"),
        (qwen, ["--prompt-cache-file", f, "--max-kv-size", 16], "not rotating"),
        (qwen, ["--max-kv-size", 16, "--kv-bits", 4], "not quantized"),
        (qwen, ["--kv-bits", 7], "--kv-bits 7"),
        (qwen, ["--max-kv-size", 3], "--max-kv-size 3"),
        (store("qwen3_next"), ["--max-kv-size", 16], "recurrent state"),
        (store("deepseek_v3"), ["--kv-bits", 4], "cannot be quantized"),
        (qwen, ["--kv-bits", 4, "--quantized-kv-start", 0], "kv_group_size 64"),
    ]
    for model, flags, words in cases:
        r = run("generate", "--model", model, "--prompt-tokens", "4,5,6", "-m", 2, *flags)
        assert r.returncode == 2, (flags, r.stdout, r.stderr)
        assert r.stderr.count("\n") == 1 and words in r.stderr, (flags, r.stderr)
        if "--prompt-cache-file" in flags and "none" not in str(flags[1]):
            assert str(flags[1]) in r.stderr


def test_make_prompt_cache_refusals(store):
    model, _ = strata_mlx.load(store("qwen3_next"), read_ahead="demand")
    with pytest.raises(ValueError, match="max_kv_size: qwen3_next keeps recurrent state"):
        make_prompt_cache(model, KVOptions(max_kv_size=16))
    assert len(make_prompt_cache(model, KVOptions(kv_bits=4))) == len(model.layers)
    model.expert_cache.close()


def test_lru_reuses_the_longest_prefix_and_respects_its_budget():
    from strata_mlx.models.base import ArraysCache, KVCache

    def kv(n):
        c = KVCache()
        c.update_and_fetch(mx.zeros((1, 1, n, 4)), mx.zeros((1, 1, n, 4)))
        return [c]

    lru = PromptCacheLRU(max_entries=2, max_bytes=1 << 20)
    lru.put([1, 2, 3, 4], kv(4))
    lru.put([1, 2, 9], kv(3))
    cache, n = lru.take([1, 2, 3, 7, 8])
    assert n == 3 and cache[0].offset == 3 and len(lru) == 1
    assert lru.take([5, 6]) == (None, 0)
    cache, n = lru.take([1, 2, 9])  # all of it: one token is left to run
    assert n == 2 and cache[0].offset == 2
    rec = ArraysCache(1)
    rec[0], rec.offset = mx.zeros(4), 3
    lru.put([1, 2, 3], [rec])
    assert lru.take([1, 2, 4, 4]) == (None, 0)  # a recurrent state cannot be cut back
    cache, n = lru.take([1, 2, 3, 4])
    assert n == 3 and cache == [rec]
    lru.put([1], kv(1))
    lru.put([2], kv(1))
    lru.put([3], kv(1))
    assert len(lru) == 2
    tight = PromptCacheLRU(max_entries=8, max_bytes=kv(256)[0].nbytes)
    tight.put([1], kv(256))
    tight.put([2], kv(256))
    assert len(tight) == 1


def test_load_refuses_a_cache_that_does_not_cover_its_tokens(store, tmp_path):
    path = store("qwen3_moe")
    model = resident(path)
    f = tmp_path / "bad.safetensors"
    save_prompt_cache(f, cache_prompt(model, [1, 2, 3]), model, [1, 2, 3, 4])
    with pytest.raises(PromptCacheError, match="holds 3 positions, the file covers 4 tokens"):
        load_prompt_cache(f, model)
    model.expert_cache.close()


def test_server_reuses_the_conversation_so_far(tiny):  # noqa: F811 (the fixture)
    """A chat that grows by one turn, through the openai client: the reply equals a cold
    generate()'s, and only the tokens after the common prefix with the last request's
    prompt-and-reply are prefilled (the server's counters)."""
    pytest.importorskip("openai")
    import httpx2 as httpx
    import openai
    from test_server import NAME, load_tiny, running

    from strata_mlx.apps.server import create_app
    from strata_mlx.generation.prompt_cache import common_prefix

    model, tok = load_tiny(tiny)

    def ids_of(messages):
        return tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)

    with running(create_app(model, tok, NAME)) as base:
        http = httpx.Client(trust_env=False, timeout=60)
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0,
                               http_client=http)  # fmt: skip
        messages = [{"role": "user", "content": "tell me about the sea"}]
        stats = []
        for turn in ("and the mountains", "and the sky above them"):
            ids = ids_of(messages)
            before = http.get(base + "/v1/stats").json()["server"]
            r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8,
                                               temperature=0)  # fmt: skip
            after = http.get(base + "/v1/stats").json()["server"]
            reply = r.choices[0].message.content
            cold = list(stream_generate(model, tok, ids, max_tokens=8))
            assert reply == "".join(c.text for c in cold)
            stats.append((ids, [c.token for c in cold], after["prefilled_tokens"]
                          - before["prefilled_tokens"]))  # fmt: skip
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": turn}]
        http.close()
    (ids1, gen1, prefilled1), (ids2, _, prefilled2) = stats
    assert prefilled1 == len(ids1)
    reused = min(common_prefix(ids1 + gen1[:-1], ids2), len(ids2) - 1)
    assert reused >= len(ids1)  # the whole first prompt at least
    assert prefilled2 == len(ids2) - reused
    model.expert_cache.close()


def test_cli_cached_system_prompt_then_chat(tiny, tmp_path):  # noqa: F811 (the fixture)
    """cache-prompt --system-prompt, then generate with the same system prompt and a user
    turn: the chat template's rendering begins with the cached tokens, so only the turn is
    prefilled, and the text is a cold run's."""
    f = tmp_path / "sys.safetensors"
    system = "you answer about the sea and the sky, in short words"
    r = run("cache-prompt", "--model", tiny, "--system-prompt", system, "--prompt-cache-file", f)
    assert r.returncode == 0, r.stderr
    cached = int(r.stdout.split("Prompt: ")[1].split()[0])
    common = ("generate", "--model", tiny, "--system-prompt", system, "-p", "the sea", "-m", 6)
    cold, warm = run(*common), run(*common, "--prompt-cache-file", f)
    assert cold.returncode == 0 and warm.returncode == 0, warm.stderr
    full = int(cold.stdout.split("Prompt: ")[1].split()[0])
    assert cold.stdout.split("==========")[0] == warm.stdout.split("==========")[0]
    assert f"Prompt: {full - cached} tokens" in warm.stdout and 0 < cached < full
    other = run("generate", "--model", tiny, "--system-prompt", "else", "-p", "x",
                "--prompt-cache-file", f)  # fmt: skip
    assert other.returncode == 2 and "not the beginning of this prompt" in other.stderr


# ---- damaged and hostile files: one line naming the file, before any state is used ------------


@pytest.fixture(scope="module")
def saved(store, tmp_path_factory):
    """family -> (a loaded resident model, a prompt cache file of 12 tokens, its arrays and
    metadata as saved, the tokens a cold run of 20 tokens generates)."""
    made = {}
    d = tmp_path_factory.mktemp("saved-caches")

    def get(family: str, kv: KVOptions | None = None):
        key = (family, None if kv is None else tuple(vars(kv).values()))
        if key not in made:
            model = resident(store(family))
            ids = prompt_ids(20, seed=31)
            kw = vars(kv) if kv is not None else {}
            cold = [
                r.token for r in stream_generate(model, None, ids, 4, prefill_step_size=8, **kw)
            ]
            f = d / f"{family}-{len(made)}.safetensors"
            save_prompt_cache(f, cache_prompt(model, ids[:12], kv, 8), model, ids[:12])
            arrays, meta = mx.load(str(f), return_metadata=True)
            made[key] = (model, f, arrays, meta, ids, cold)
        return made[key]

    yield get
    for model, *_ in made.values():
        model.expert_cache.close()


def _write(f, arrays, meta, checksum: bool = True) -> None:
    """The file with `arrays` and `meta`, its checksum recomputed (a crafted file) or not."""
    from strata_mlx.generation.prompt_cache import payload_checksum

    meta = dict(meta)
    if checksum:
        meta["checksum"] = payload_checksum(arrays, meta)
    mx.save_safetensors(str(f), arrays, meta)


def _resume(model, f, ids):
    cache, tokens, _ = load_prompt_cache(f, model)
    out = stream_generate(model, None, ids[12:], 4, prefill_step_size=8, prompt_cache=cache,
                          cached_tokens=tokens)  # fmt: skip
    return [r.token for r in out]


def test_damaged_payload_is_refused_by_its_checksum(saved, tmp_path):
    """1000 payload bytes randomized gave exit 0 and an empty answer: now a checksum
    mismatch naming the file. A token id changed in the metadata, the same."""
    model, f, arrays, meta, ids, cold = saved("qwen3_moe")
    assert meta["checksum"].startswith("crc32c:") and _resume(model, f, ids) == cold
    raw = np.frombuffer(f.read_bytes(), np.uint8).copy()
    header = 8 + int.from_bytes(raw[:8].tobytes(), "little")
    rng = np.random.default_rng(0)
    at = rng.choice(np.arange(header, len(raw)), 1000, replace=False)
    raw[at] = rng.integers(0, 256, 1000, dtype=np.uint8)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(raw.tobytes())
    with pytest.raises(PromptCacheError, match=f"{bad}: checksum mismatch") as e:
        load_prompt_cache(bad, model)
    assert "\n" not in str(e.value)
    tokens = meta["tokens"].replace("[", "[1", 1)
    _write(bad, arrays, {**meta, "tokens": tokens}, checksum=False)
    with pytest.raises(PromptCacheError, match="checksum mismatch"):
        load_prompt_cache(bad, model)
    with pytest.raises(PromptCacheError, match=f"{tmp_path}: is a directory"):  # ("no such")
        load_prompt_cache(tmp_path, model)


def test_files_without_a_checksum_are_refused_with_how_to_remake_them(saved, tmp_path):
    model, f, arrays, meta, *_ = saved("qwen3_moe")
    old = tmp_path / "old.safetensors"
    mx.save_safetensors(str(old), arrays, {k: v for k, v in meta.items() if k != "checksum"}
                        | {"version": "1"})  # fmt: skip
    with pytest.raises(PromptCacheError, match="before prompt caches carried a checksum; "
                       "re-create it with strata-mlx cache-prompt"):  # fmt: skip
        load_prompt_cache(old, model)
    unsummed = tmp_path / "unsummed.safetensors"
    _write(unsummed, arrays, {k: v for k, v in meta.items() if k != "checksum"}, checksum=False)
    with pytest.raises(PromptCacheError, match="no crc32c checksum"):
        load_prompt_cache(unsummed, model)


def _layers(meta, **change) -> str:
    import json

    layers = json.loads(meta["layers"])
    layers[0].update(change)
    return json.dumps(layers)


# (family, KV options, edit of (arrays, meta), words): each crashed with a raw error in
# from_saved or in the first attention, ran on with a state that does not fit the model (a
# different answer, or "0 0 0 0" from NaN values), or was refused with a misleading line.
CRAFTED = [
    ("qwen3_moe", None, lambda a, m: m.update(layers='{"a": 1}'), "layers is not a list"),
    ("qwen3_moe", None, lambda a, m: m.update(layers=_layers(m, offset="12")), "offset '12'"),
    ("qwen3_moe", None, lambda a, m: m.update(experts_per_token="[2"), "experts_per_token"),
    ("qwen3_moe", None, lambda a, m: a.update({"0.keys": a["0.keys"].astype(mx.int32)}),
     "0.keys is int32|keys is int32"),
    ("qwen3_moe", None, lambda a, m: a.pop("1.values"), "missing array 'values'"),
    ("qwen3_moe", None, lambda a, m: a.update({"0.junk": a["0.keys"]}), "unexpected array 'junk'"),
    ("qwen3_moe", None, lambda a, m: a.update({"0.keys": a["0.keys"][:, :, :5],
                                               "0.values": a["0.values"][:, :, :5]}),
     "5 positions saved, offset says 12"),
    ("qwen3_moe", None, lambda a, m: a.update({"1.keys": mx.concatenate([a["1.keys"]] * 2, 1),
                                               "1.values": mx.concatenate([a["1.values"]] * 2, 1)}),
     "layer 1 .*does not fit the model"),
    ("qwen3_moe", None, lambda a, m: a.update({"0.keys": a["0.keys"][..., :4]}),
     "does not fit the model"),
    ("qwen3_moe", None, lambda a, m: a.update({"0.values": a["0.values"] * float("nan")}),
     "does not fit the model \\(non-finite\\)"),
    ("qwen3_moe", KVOptions(max_kv_size=8), lambda a, m: m.update(layers=_layers(m, idx=50)),
     "idx 50 past"),
    ("qwen3_moe", KVOptions(max_kv_size=8), lambda a, m: m.update(layers=_layers(m, keep=9)),
     "keep 9 is not below max_size 8"),
    ("qwen3_next", None, lambda a, m: a.pop("0.1"), "1 of 2 slots saved"),
    ("qwen3_next", None, lambda a, m: a.update({"0.1": a["0.1"][..., :3]}),
     "does not fit the model"),
    ("qwen3_next", None, lambda a, m: m.update(layers=_layers(m, size=3)),
     "the model keeps a ArraysCache|3 slots|slots saved"),
]  # fmt: skip


@pytest.mark.parametrize("family, kv, edit, words", CRAFTED, ids=[c[3][:30] for c in CRAFTED])
def test_crafted_files_of_the_wrong_shape_or_types_are_one_line(saved, tmp_path, family, kv,
                                                                edit, words):  # fmt: skip
    """Files whose checksum matches (made to): every field and array is still checked."""
    model, f, arrays, meta, ids, cold = saved(family, kv)
    arrays, meta = dict(arrays), dict(meta)
    edit(arrays, meta)
    bad = tmp_path / "crafted.safetensors"
    _write(bad, arrays, meta)
    with pytest.raises(PromptCacheError, match=words) as e:
        load_prompt_cache(bad, model)
    assert "\n" not in str(e.value) and str(bad) in str(e.value)


def test_gpt_oss_takes_neither_a_rotating_nor_a_quantized_cache(store):
    """--max-kv-size on gpt_oss was a ValueError from inside its attention; --kv-bits spoke of
    a latent cache, which gpt_oss does not have."""
    model, _ = strata_mlx.load(store("gpt_oss"), read_ahead="demand")
    for kv, flag in (
        (KVOptions(max_kv_size=16), "--max-kv-size"),
        (KVOptions(kv_bits=4), "--kv-bits"),
    ):
        with pytest.raises(OptionError,
                           match=f"{flag}: gpt_oss keeps a plain KV cache, neither rotating nor "
                           "quantized") as e:  # fmt: skip
            make_prompt_cache(model, kv, cli=True)
        assert "latent" not in str(e.value)
    model.expert_cache.close()
