"""The `strata-mlx` command: a thin shell over the Python API.

Flag names follow mlx-lm where one exists. Every user error ends as one line on stderr
naming the file and what is wrong, with exit code 2.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import typer

from .store import StoreError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Run Mixture-of-Experts models larger than memory, experts streamed from SSD.",
)


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


def user_errors(fn):
    """Turn the errors a user can cause into one line and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except (
            StoreError,
            ValueError,
            FileNotFoundError,
            IsADirectoryError,
            PermissionError,
            ConnectionError,  # a lost rank of a pipeline (strata_mlx.distributed)
        ) as e:
            _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)

    return wrapper


RUNTIME_HELP = "Expert cache"


def runtime_options(
    arena_gb: float | None,
    io_workers: int,
    read_ahead: str,
    lookahead_min_tokens: int,
    static_cap: int,
    eviction: str,
    verify: bool,
    prefill_step_size: int | None,
    fake_stream: bool,
):
    from .loader import RuntimeConfig

    return RuntimeConfig(
        arena_gb=arena_gb,
        io_workers=io_workers,
        read_ahead=read_ahead,
        static_cap=static_cap,
        lookahead_min_tokens=lookahead_min_tokens,
        eviction=eviction,
        verify=verify,
        prefill_step_size=prefill_step_size,
        fake_stream=fake_stream,
    )


KV_FLAGS = {  # mlx-lm's KV cache flags, shared by generate and cache-prompt
    "max_kv_size": typer.Option(
        None, "--max-kv-size", help="Keep at most this many positions (a rotating KV cache)."
    ),
    "kv_bits": typer.Option(
        None, "--kv-bits", help="Bits of the quantized KV cache (default: not quantized)."
    ),
    "kv_group_size": typer.Option(
        64, "--kv-group-size", help="Group size of the KV cache's quantization."
    ),
    "quantized_kv_start": typer.Option(
        5000,
        "--quantized-kv-start",
        help="With --kv-bits: quantize a layer's cache once it holds this many positions.",
    ),
}


def parse_tokens(text: str, flag: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise ValueError(f"{flag}: no token ids")
    return ids


@app.command()
@user_errors
def generate(
    model: Path | None = typer.Option(
        None, "--model", help="A strata-mlx store (default: the built-in model)."
    ),
    prompt: str | None = typer.Option(
        None, "--prompt", "-p", help="Prompt text ('-' reads stdin)."
    ),
    prompt_tokens: str | None = typer.Option(
        None, "--prompt-tokens", help="Prompt as token ids: 1,2,3."
    ),
    max_tokens: int = typer.Option(100, "--max-tokens", "-m"),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature (0: greedy)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Sampling top-p (1: off)."),
    min_p: float = typer.Option(0.0, "--min-p", help="Sampling min-p (0: off)."),
    top_k: int = typer.Option(0, "--top-k", help="Sampling top-k (0: off)."),
    min_tokens_to_keep: int = typer.Option(
        1, "--min-tokens-to-keep", help="Minimum tokens to keep for min-p sampling."
    ),
    xtc_probability: float = typer.Option(
        0.0, "--xtc-probability", help="Probability of XTC sampling at each token."
    ),
    xtc_threshold: float = typer.Option(
        0.1, "--xtc-threshold", help="XTC drops the tokens above this probability but one."
    ),
    repetition_penalty: float | None = typer.Option(
        None, "--repetition-penalty", help="Penalty on the logits of recent tokens (1: none)."
    ),
    repetition_context_size: int = typer.Option(
        20, "--repetition-context-size", help="Tokens the repetition penalty looks back."
    ),
    seed: int | None = typer.Option(None, "--seed", help="PRNG seed."),
    chat: bool | None = typer.Option(
        None,
        "--chat/--no-chat",
        help="Wrap the prompt in the chat template (default: with --system-prompt or "
        "--chat-template-config).",
    ),
    system_prompt: str | None = typer.Option(
        None, "--system-prompt", help="A system message before the prompt (implies --chat)."
    ),
    chat_template_config: str | None = typer.Option(
        None,
        "--chat-template-config",
        help="More variables for the chat template, as a JSON object (implies --chat).",
    ),
    logits_out: Path | None = typer.Option(
        None, "--logits-out", help="Write teacher-forced prompt logits [T, vocab] float32 .npy."
    ),
    logits_ref: Path | None = typer.Option(
        None, "--logits-ref", help="Compare prompt logits with a .npy (KLD, top-1)."
    ),
    experts_per_token: int | None = typer.Option(
        None, "--experts-per-token", help="Override the store's experts per token."
    ),
    dump_moe: Path | None = typer.Option(
        None, "--dump-moe", help="Write per-layer MoE state (.npy) here."
    ),
    moce_bonus: float = typer.Option(
        0.0,
        "--moce-bonus",
        help="Cache-aware routing: bonus on resident experts' logits in decode.",
    ),
    verbose: bool = typer.Option(False, "--verbose", help="One trace line per prefill chunk."),
    arena_gb: float | None = typer.Option(
        None, "--arena-gb", help="Arena size (default: from memory)."
    ),
    io_workers: int = typer.Option(8, "--io-workers"),
    read_ahead: str = typer.Option("lookahead", "--read-ahead", help="demand | static | lookahead"),
    lookahead_min_tokens: int = typer.Option(1, "--lookahead-min-tokens"),
    lookahead_decode_min_miss: float = typer.Option(
        0.02,
        "--lookahead-decode-min-miss",
        help="Decode predicts while its miss rate is above this.",
    ),
    static_cap: int = typer.Option(256, "--static-cap"),
    eviction: str = typer.Option("lru", "--eviction", help="lru | lfu | profile | layer"),
    verify: bool = typer.Option(
        True,
        "--verify/--no-verify",
        help="Checksums of the dense weights (once) and of every expert record as it is read.",
    ),
    prefill_step_size: int | None = typer.Option(None, "--prefill-step-size"),
    fake_stream: bool = typer.Option(
        False, "--fake-stream", help="Every expert counts as resident: times compute alone."
    ),
    decode: str = typer.Option(
        "pipelined",
        "--decode",
        help="pipelined (routing checked a layer late, no per-layer sync) | sync (the old path)",
    ),
    decode_lag: int = typer.Option(1, "--decode-lag", help="Pipelined: layers of lag."),
    preset: str | None = typer.Option(
        None, "--preset", help="A runtime preset from configs/runtime/ (e.g. laptop-24gb)."
    ),
    pipeline: bool = typer.Option(
        False, "--pipeline", help="Layers pipelined over the ranks of mlx.launch (mx.distributed)."
    ),
    pipeline_split: str | None = typer.Option(
        None, "--pipeline-split", help="Layers per rank, e.g. 20,28 (default: by memory)."
    ),
    pipeline_timeout: float = typer.Option(
        300.0, "--pipeline-timeout", help="Seconds a pipeline step may wait on another rank."
    ),
    prompt_cache_file: Path | None = typer.Option(
        None,
        "--prompt-cache-file",
        help="Start from a prompt cache written by cache-prompt (the prompt continues it).",
    ),
    max_kv_size: int | None = KV_FLAGS["max_kv_size"],
    kv_bits: int | None = KV_FLAGS["kv_bits"],
    kv_group_size: int = KV_FLAGS["kv_group_size"],
    quantized_kv_start: int = KV_FLAGS["quantized_kv_start"],
):
    """Generate text from a store, streaming experts through the arena."""

    from .generate import stream_generate, summary, teacher_forced_logits
    from .loader import load

    if prompt is None and prompt_tokens is None:
        prompt = "The capital of France is" if model is None else None
        if prompt is None:
            raise ValueError("give --prompt/-p or --prompt-tokens")
    from .options import check_number, check_runtime, check_sampling
    from .sampling import SamplingOptions

    sampling = SamplingOptions(
        temp=temp,
        top_p=top_p,
        min_p=min_p,
        min_tokens_to_keep=min_tokens_to_keep,
        top_k=top_k,
        xtc_probability=xtc_probability,
        xtc_threshold=xtc_threshold,
        repetition_penalty=repetition_penalty,
        repetition_context_size=repetition_context_size,
    )
    check_sampling(max_tokens, temp, top_p, seed, cli=True)  # before a model is loaded
    sampling.check(cli=True)
    check_number("moce_bonus", moce_bonus, 0, cli=True)
    from .prompt_cache import KVOptions

    kv = KVOptions(max_kv_size, kv_bits, kv_group_size, quantized_kv_start)
    kv.check(cli=True)
    template_kwargs = _template_config(chat_template_config)
    wants_chat = system_prompt is not None or chat_template_config is not None
    if chat is False and wants_chat:
        raise ValueError("--system-prompt and --chat-template-config need the chat template")
    chat = wants_chat if chat is None else chat
    if model is None:
        from .default_model import default_store

        model = default_store()
        if arena_gb is None:
            from .default_model import DEFAULT_ARENA_GB

            arena_gb = DEFAULT_ARENA_GB
    cfg = runtime_options(
        arena_gb,
        io_workers,
        read_ahead,
        lookahead_min_tokens,
        static_cap,
        eviction,
        verify,
        prefill_step_size,
        fake_stream,
    )
    cfg.lookahead_decode_min_miss = lookahead_decode_min_miss
    cfg.decode, cfg.decode_lag = decode, decode_lag
    if preset is not None:
        from .loader import apply_preset

        apply_preset(cfg, preset)
    check_runtime(cfg, cli=True)
    pipe = None
    if pipeline:
        from .distributed import Pipeline, serve_stage

        if kv.max_kv_size or kv.kv_bits or prompt_cache_file:  # each rank has its own cache
            raise ValueError(
                "--pipeline: --max-kv-size, --kv-bits and --prompt-cache-file are not pipelined yet"
            )
        pipe = Pipeline(split=pipeline_split, timeout_s=pipeline_timeout)
    m, tok = load(model, config=cfg, pipeline=pipe)
    if experts_per_token is not None:
        _set_experts_per_token(m, experts_per_token)
    cache = m.expert_cache
    cache.route_bonus = moce_bonus
    if pipe is not None and pipe.size > 1:
        if pipe.rank != 0:  # rank 0 prompts, samples and prints; the others compute
            serve_stage(m)
            return
        m.wait_ready()
    else:
        pipe = None
    if prompt == "-":
        prompt = sys.stdin.read()
    if prompt_tokens is not None:
        ids = parse_tokens(prompt_tokens, "--prompt-tokens")
    else:
        if tok is None:
            raise ValueError(f"{model}: the store has no tokenizer; use --prompt-tokens")
        messages = [{"role": "user", "content": prompt}]
        if system_prompt is not None:
            messages.insert(0, {"role": "system", "content": system_prompt})
        text = tok.apply_chat_template(messages, **template_kwargs) if chat else prompt
        ids = tok.encode(text, add_special_tokens=not chat)  # a template carries its own BOS
    if dump_moe is not None:
        from .tools import MoeDumper

        cache.dump = MoeDumper(dump_moe)
    if logits_out is not None or logits_ref is not None:
        logits = teacher_forced_logits(m, ids, cfg.prefill_step_size)
        if logits_out is not None:
            _save_npy(logits_out, logits)
        if logits_ref is not None:
            from .tools import kld_report, load_logits

            typer.echo(kld_report(load_logits(logits_ref), logits).line())
        if dump_moe is not None:
            cache.dump.close()
            cache.dump = None
    last = None
    prompt_cache, cached = _resume(m, tok, prompt_cache_file, kv, ids, prompt, prompt_tokens, chat)
    if prompt_cache is not None and ids[: len(cached)] == cached:
        ids = ids[len(cached) :]

    for last in stream_generate(
        m,
        tok,
        ids,
        max_tokens=max_tokens,
        seed=seed,
        prefill_step_size=cfg.prefill_step_size,
        sampler=sampling.sampler(tok),
        logits_processors=sampling.logits_processors(m.args.vocab_size),
        prompt_cache=prompt_cache,
        cached_tokens=cached,
        max_kv_size=kv.max_kv_size,
        kv_bits=kv.kv_bits,
        kv_group_size=kv.kv_group_size,
        quantized_kv_start=kv.quantized_kv_start,
    ):
        if tok is not None:
            typer.echo(last.text, nl=False)
        else:
            typer.echo(f"{last.token} ", nl=False)
    typer.echo("")
    if last is not None:
        if verbose:
            for i, c in enumerate(last.chunks):
                typer.echo(chunk_line(i, c), err=True)
        typer.echo(summary(last))
    if pipe is not None:
        from .distributed import rank_lines

        for line in rank_lines(m.rank_stats()):
            typer.echo(line)
        m.close()
    if cache.dump is not None:
        cache.dump.close()
    cache.close()


@app.command("cache-prompt")
@user_errors
def cache_prompt(
    prompt_cache_file: Path = typer.Option(
        ..., "--prompt-cache-file", help="The .safetensors file to write."
    ),
    model: Path | None = typer.Option(
        None, "--model", help="A strata-mlx store (default: the built-in model)."
    ),
    prompt: str | None = typer.Option(
        None, "--prompt", "-p", help="Prompt text ('-' reads stdin)."
    ),
    prompt_tokens: str | None = typer.Option(
        None, "--prompt-tokens", help="Prompt as token ids: 1,2,3."
    ),
    system_prompt: str | None = typer.Option(
        None, "--system-prompt", help="A system message (rendered by the chat template)."
    ),
    chat: bool | None = typer.Option(
        None,
        "--chat/--no-chat",
        help="Render through the chat template (default: with "
        "--system-prompt or --chat-template-config), without the generation prompt.",
    ),
    chat_template_config: str | None = typer.Option(
        None, "--chat-template-config", help="More chat template variables (JSON object)."
    ),
    max_kv_size: int | None = KV_FLAGS["max_kv_size"],
    kv_bits: int | None = KV_FLAGS["kv_bits"],
    kv_group_size: int = KV_FLAGS["kv_group_size"],
    quantized_kv_start: int = KV_FLAGS["quantized_kv_start"],
    arena_gb: float | None = typer.Option(
        None, "--arena-gb", help="Arena size (default: from memory)."
    ),
    io_workers: int = typer.Option(8, "--io-workers"),
    read_ahead: str = typer.Option("lookahead", "--read-ahead", help="demand | static | lookahead"),
    prefill_step_size: int | None = typer.Option(None, "--prefill-step-size"),
    verify: bool = typer.Option(True, "--verify/--no-verify"),
    preset: str | None = typer.Option(
        None, "--preset", help="A runtime preset from configs/runtime/."
    ),
):
    """Run a prompt once and save its KV / recurrent state (mlx-lm's cache_prompt); generate
    and serve start from it with --prompt-cache-file."""
    import json
    import time

    from .generate import cache_prompt as run_prompt
    from .loader import load
    from .options import check_runtime
    from .prompt_cache import KVOptions, save_prompt_cache

    kv = KVOptions(max_kv_size, kv_bits, kv_group_size, quantized_kv_start)
    kv.check(cli=True)
    template_kwargs = _template_config(chat_template_config)
    wants_chat = system_prompt is not None or chat_template_config is not None
    if chat is False and wants_chat:
        raise ValueError("--system-prompt and --chat-template-config need the chat template")
    chat = wants_chat if chat is None else chat
    if prompt is None and prompt_tokens is None and system_prompt is None:
        raise ValueError("give --prompt/-p, --prompt-tokens or --system-prompt")
    if model is None:
        from .default_model import DEFAULT_ARENA_GB, default_store

        model = default_store()
        arena_gb = DEFAULT_ARENA_GB if arena_gb is None else arena_gb
    cfg = runtime_options(arena_gb, io_workers, read_ahead, 1, 256, "lru", verify,
                          prefill_step_size, False)  # fmt: skip
    if preset is not None:
        from .loader import apply_preset

        apply_preset(cfg, preset)
    check_runtime(cfg, cli=True)
    m, tok = load(model, config=cfg)
    if prompt == "-":
        prompt = sys.stdin.read()
    if prompt_tokens is not None:
        ids = parse_tokens(prompt_tokens, "--prompt-tokens")
    elif tok is None:
        raise ValueError(f"{model}: the store has no tokenizer; use --prompt-tokens")
    elif chat:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        if prompt is not None:
            messages.append({"role": "user", "content": prompt})
        text = tok.apply_chat_template(messages, add_generation_prompt=False, **template_kwargs)
        ids = tok.encode(text, add_special_tokens=False)
    else:
        ids = tok.encode(prompt)
    vocab = m.args.vocab_size
    if any(not 0 <= i < vocab for i in ids):
        raise ValueError(f"prompt token ids must lie in [0, {vocab})")
    t = time.perf_counter()
    cache = run_prompt(m, ids, kv, cfg.prefill_step_size)
    dt = time.perf_counter() - t
    save_prompt_cache(prompt_cache_file, cache, m, ids,
                      {"chat_template_config": json.dumps(template_kwargs)})  # fmt: skip
    import mlx.core as mx

    typer.echo(f"Prompt: {len(ids)} tokens, {len(ids) / max(dt, 1e-9):.3f} tokens-per-sec")
    typer.echo(f"Peak memory: {mx.get_peak_memory() / 1e9:.3f} GB")
    typer.echo(f"Saved {prompt_cache_file}")
    m.expert_cache.close()


def _resume(model, tok, path, kv, ids, prompt, prompt_tokens, chat):
    """--prompt-cache-file: (cache, the tokens it covers), or (None, None). A prompt whose
    tokens begin with the cached ones skips them; any other prompt continues the cache (raw
    text encoded without a BOS, as mlx-lm's generate continues one)."""
    if path is None:
        return None, None
    from .prompt_cache import check_kv_matches, load_prompt_cache

    cache, cached, _ = load_prompt_cache(path, model)
    check_kv_matches(path, cache, kv, cli=True)
    if ids[: len(cached)] == cached and len(ids) > len(cached):
        return cache, cached
    if chat:
        raise ValueError(
            f"{path}: the cached tokens are not the beginning of this prompt as the chat "
            "template renders it (cache-prompt it with the same --system-prompt)"
        )
    if prompt_tokens is None and tok is not None:
        ids[:] = tok.encode(prompt, add_special_tokens=False)
    return cache, cached


def chunk_line(i: int, c) -> str:
    return (
        f"[chunk {i}] {c.tokens} tok {c.wall_s * 1e3:.1f} ms ({c.tokens / max(c.wall_s, 1e-9):.1f} tok/s) "
        f"ahead {c.streamed_ahead_pct:.1f}% miss {c.miss_pct:.1f}% wait {c.exposed_wait_s * 1e3:.1f} ms "
        f"read {c.experts_read} ({c.gb_read:.3f} GB, {c.gb_per_s:.2f} GB/s) wasted {c.wasted_readahead} "
        f"dropped {c.readahead_dropped} sync {c.route_sync_s * 1e3:.1f} ms host {c.host_s * 1e3:.1f} ms"
    )


def _template_config(text: str | None) -> dict:
    """--chat-template-config: a JSON object of template variables (mlx-lm's flag)."""
    if text is None:
        return {}
    import json

    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--chat-template-config: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError("--chat-template-config: expected a JSON object of template variables")
    taken = sorted({"messages", "add_generation_prompt", "bos_token", "eos_token"} & set(config))
    if taken:
        raise ValueError(f"--chat-template-config: {', '.join(taken)} are set by strata-mlx")
    return config


def _set_experts_per_token(model, k: int) -> None:
    n = model.args.num_experts if hasattr(model.args, "num_experts") else None
    if k < 1 or (n and k > n):
        raise ValueError(f"--experts-per-token {k}: must lie in [1, {n}]")
    for block in model.moe_blocks().values():
        block.top_k = k


def _save_npy(path: Path, array) -> None:
    import os

    import numpy as np

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.npy")
    np.save(tmp, array)
    os.replace(tmp, path)


@app.command()
@user_errors
def convert(
    hf_path: Path | None = typer.Option(
        None, "--hf-path", help="Hugging Face checkpoint directory."
    ),
    gguf_path: Path | None = typer.Option(None, "--gguf-path", help="A GGUF file."),
    synthetic: str | None = typer.Option(
        None, "--synthetic", help="A named shape from configs/ (random weights)."
    ),
    mlx_path: Path = typer.Option(..., "--mlx-path", help="Output store directory."),
    quantize: bool = typer.Option(False, "--quantize", "-q"),
    q_bits: int = typer.Option(4, "--q-bits"),
    q_group_size: int = typer.Option(64, "--q-group-size"),
    dtype: str | None = typer.Option(None, "--dtype", help="float16 | bfloat16 | float32"),
    calibration_tokens: int = typer.Option(
        256, "--calibration-tokens", help="Tokens for the routing profile (0: none)."
    ),
    split_experts: int | None = typer.Option(
        None, "--split-experts", help="Dense GGUF: split each MLP into E experts."
    ),
    router: str = typer.Option(
        "structured",
        "--router",
        help="Synthetic routing: structured (skewed, correlated) | uniform.",
    ),
    set_: list[str] | None = typer.Option(
        None, "--set", help="Synthetic shape override, e.g. --set num_hidden_layers=8."
    ),
    seed: int = typer.Option(0, "--seed"),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Replace an existing store at --mlx-path (kept until the new one is complete).",
    ),
):
    """Convert a checkpoint into a strata-mlx store."""
    sources = [s for s in (hf_path, gguf_path, synthetic) if s is not None]
    if len(sources) != 1:
        raise ValueError("give exactly one of --hf-path, --gguf-path, --synthetic")
    from .convert.common import check_output, overwriting

    check_output(mlx_path, *(s for s in (hf_path, gguf_path) if s), overwrite=overwrite)
    _exit_on_sigterm()  # SIGTERM unwinds: the temporary directory is removed on the way out
    if q_bits not in (2, 3, 4, 8):
        raise ValueError(f"--q-bits {q_bits}: one of 2, 3, 4, 8")
    if q_group_size not in (32, 64, 128):
        raise ValueError(f"--q-group-size {q_group_size}: one of 32, 64, 128")
    from .options import MAX_SEED, check_int

    check_int("calibration_tokens", calibration_tokens, 0, 1 << 20, cli=True)
    check_int("seed", seed, 0, MAX_SEED, cli=True)
    with overwriting(overwrite):
        out = _convert(
            hf_path,
            gguf_path,
            synthetic,
            mlx_path,
            quantize,
            q_bits,
            q_group_size,
            dtype,
            calibration_tokens,
            split_experts,
            router,
            set_,
            seed,
        )
    typer.echo(f"wrote {out}")


def _exit_on_sigterm() -> None:
    import signal

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def _convert(
    hf_path,
    gguf_path,
    synthetic,
    mlx_path,
    quantize,
    q_bits,
    q_group_size,
    dtype,
    calibration_tokens,
    split_experts,
    router,
    set_,
    seed,
):
    if hf_path is not None:
        from .convert.hf import convert_hf

        out = convert_hf(
            hf_path, mlx_path, quantize, q_bits, q_group_size, dtype, calibration_tokens
        )
    elif gguf_path is not None:
        from .convert.gguf import convert_gguf

        out = convert_gguf(
            gguf_path, mlx_path, split_experts=split_experts, calibration_tokens=calibration_tokens
        )
    else:
        from .convert.synthetic import convert_synthetic, synthetic_config

        config = synthetic_config(synthetic)
        for item in set_ or []:
            key, sep, value = item.partition("=")
            if not sep or key not in config:
                raise ValueError(
                    f"--set {item}: expected KEY=VALUE with KEY one of {sorted(config)}"
                )
            config[key] = type(config[key])(value)
        out = convert_synthetic(
            synthetic,
            mlx_path,
            config=config,
            router=router,
            seed=seed,
            calibration_tokens=calibration_tokens,
            dtype=dtype or "float16",
        )
    return out


@app.command()
@user_errors
def bench(
    model: Path = typer.Option(..., "--model"),
    prompt_tokens: int = typer.Option(2048, "-p", "--prompt-tokens"),
    generation_tokens: int = typer.Option(128, "-g", "--generation-tokens"),
    arena_gb: float | None = typer.Option(None, "--arena-gb"),
    prefill_step_size: int = typer.Option(1024, "--prefill-step-size"),
    policies: str = typer.Option("demand,static,lookahead", "--policies"),
    repeats: int = typer.Option(1, "--repeats", help="A/B rounds; the order rotates each round."),
    io_workers: int = typer.Option(8, "--io-workers"),
    static_cap: int = typer.Option(256, "--static-cap"),
    json_out: Path | None = typer.Option(None, "--json", help="Write all figures as JSON."),
    eviction: str = typer.Option("lru", "--eviction", help="lru | lfu | profile | layer"),
    baseline: str | None = typer.Option(
        None,
        "--baseline",
        help="mlx-lm: then mlx-lm's own model and ours on the same prompt, with ratios.",
    ),
    plot: Path | None = typer.Option(
        None, "--plot", help='Write a PNG of the run (pip install "strata-mlx[plot]").'
    ),
):
    """Prefill and decode, cold and warm, read-ahead policies side by side.

    Caches: before each cold run the store's own files are evicted from the OS page cache
    (posix_fadvise DONTNEED on each file, Linux); nothing else on the machine is touched.
    """
    from .bench import bench as run_bench
    from .bench import markdown_table, policy_options, save
    from .loader import RuntimeConfig
    from .options import OptionError, check_int, check_runtime
    from .prediction import READ_AHEAD_POLICIES

    check_int("prompt_tokens", prompt_tokens, 2, 1 << 24, cli=True)  # one chunk and a rest
    check_int("generation_tokens", generation_tokens, 1, 1 << 20, cli=True)
    check_int("repeats", repeats, 1, 1000, cli=True)
    names = tuple(p for p in policies.split(",") if p)
    if not names:
        raise ValueError("--policies: name at least one (demand, static, lookahead)")
    for name in names:  # each policy's runtime, checked before anything is loaded
        cfg = RuntimeConfig(
            arena_gb=arena_gb,
            io_workers=io_workers,
            prefill_step_size=prefill_step_size,
            static_cap=static_cap,
            eviction=eviction,
            **policy_options(name),
        )
        try:
            check_runtime(cfg, cli=True)
        except OptionError as e:
            if e.param != "read_ahead":
                raise
            known = ", ".join(READ_AHEAD_POLICIES)
            raise OptionError(
                f"--policies {name!r}: a policy is one of {known}", "policies"
            ) from None
    if plot is not None:
        from .plots import require

        require()
    result = run_bench(
        model,
        prompt_tokens,
        generation_tokens,
        arena_gb,
        prefill_step_size,
        names,
        repeats,
        io_workers,
        static_cap,
        eviction=eviction,
        log=typer.echo,
        baseline=baseline,
        plot=plot,
    )
    typer.echo(markdown_table(result))
    if json_out is not None:
        save(result, json_out)


@app.command()
@user_errors
def plan(
    model: Path = typer.Argument(..., help="A store, a Hugging Face checkpoint or a GGUF file."),
    arena_gb: float | None = typer.Option(None, "--arena-gb", help="Default: automatic."),
    prefill_step_size: int | None = typer.Option(None, "--prefill-step-size"),
    prompt_tokens: int = typer.Option(2048, "-p", "--prompt-tokens"),
    io_workers: int = typer.Option(8, "--io-workers"),
    target_memory: float | None = typer.Option(
        None, "--target-memory", help="GB, another machine."
    ),
    target_ssd_gbps: float | None = typer.Option(None, "--target-ssd-gbps"),
    target_tflops: float | None = typer.Option(None, "--target-tflops"),
    measure: bool = typer.Option(True, "--measure/--no-measure", help="Fake-stream compute run."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the forecast as JSON."),
):
    """Will MODEL fit, with what arena and chunk, and how fast: prefill and decode tok/s."""
    from .plan import plan as run_plan
    from .plan import save

    f = run_plan(model, arena_gb, prefill_step_size, prompt_tokens, 128, io_workers,
                 target_memory, target_ssd_gbps, target_tflops, measure)  # fmt: skip
    typer.echo("\n".join(f.lines()))
    if json_out is not None:
        save(f, json_out)


@app.command("probe-ssd")
@user_errors
def probe_ssd(
    path: Path = typer.Argument(
        ..., help="A large file on the drive (e.g. a store's experts.bin)."
    ),
    record_bytes: int = typer.Option(1_474_560, "--record-bytes"),
    seconds: float = typer.Option(2.0, "--seconds"),
    workers: str = typer.Option("1,4,8,16", "--workers"),
):
    """Random record-sized direct reads at several worker counts: GB/s."""
    from .probe import probe_ssd as probe

    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    for row in probe(
        path,
        record_bytes=record_bytes,
        seconds=seconds,
        workers_list=tuple(parse_tokens(workers, "--workers")),
    ):
        typer.echo(
            f"workers {row['workers']:>3}: {row['gb_per_s']:.2f} GB/s ({row['reads']} reads, direct={row['direct']})"
        )


kernels_app = typer.Typer(no_args_is_help=True, help="The expert kernels' source.")
app.add_typer(kernels_app, name="kernels")


@kernels_app.command("show")
def kernels_show(
    fmt: str = typer.Argument(
        ..., metavar="FORMAT", help="Q4_K, Q2_K, IQ2_XS, IQ3_S or affine{bits}-g{group}."
    ),
    dialect: str = typer.Option("metal", "--dialect", help="metal | cuda | host"),
    down: str | None = typer.Option(None, "--down", help="down_proj's format (default FORMAT)."),
    hidden: int = typer.Option(2048, "--hidden", help="Model width D."),
    inter: int = typer.Option(512, "--inter", help="Expert width."),
    top_k: int = typer.Option(10, "--top-k", help="Experts per token."),
    tile: int = typer.Option(1, "--tile", help="Pairs per warp: 1 in decode, 8 in prefill."),
):
    """Print the exact source each expert kernel of FORMAT compiles on DIALECT."""
    from .kernels import example_layout, kernel_source_text

    if dialect not in ("metal", "cuda", "host"):
        _fail(f"--dialect {dialect!r}: one of metal, cuda, host")
    try:
        layout = example_layout(fmt, hidden, inter, down)
        typer.echo(kernel_source_text(layout, dialect, top_k, tile))
    except (KeyError, ValueError) as e:
        _fail(str(e).strip("'\""))


def _register_tools() -> None:
    from .tools import kld_command, route_parity_command

    app.command("kld", help="KLD and top-1 agreement between two logits files.")(
        user_errors(kld_command)
    )
    app.command("route-parity", help="Routing of two configurations, per layer and token.")(
        user_errors(route_parity_command)
    )
    try:
        from .server import serve_command
    except ImportError as e:  # a machine without the server stack still runs everything else
        missing = e.name

        @app.command("serve", help="An OpenAI-compatible server.")
        def serve_unavailable():
            _fail(f"serve needs {missing}: pip install -e . installs it")

        return
    app.command("serve", help="An OpenAI-compatible server.")(user_errors(serve_command))


_register_tools()
