"""The `strata-mlx` command: a thin shell over the Python API.

Flag names follow mlx-lm where one exists. Every user error ends as one line on stderr
naming the file and what is wrong, with exit code 2.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Annotated

import typer

from ..config import (
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_TOKENS,
    DEFAULT_SHUTDOWN_TIMEOUT,
    OptionError,
    parse_tokens,
)
from ..format.store import StoreError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Run Mixture-of-Experts models larger than memory, experts streamed from SSD.",
)


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


def _user_error_types() -> tuple[type[BaseException], ...]:
    from ..generation.prompt_cache import PromptCacheError
    from ..generation.tokenizer import ChatTemplateError
    from ..runtime.distributed import PipelineError

    # StoreError covers ExpertReadError and MemoryGuardError; the OS errors name a user's path
    return (StoreError, OptionError, PromptCacheError, ChatTemplateError, PipelineError,
            FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)  # fmt: skip


def user_errors(fn):
    """Turn the errors a user can cause, our own types, into one line and exit code 2;
    anything else (a plain ValueError included, ours or a library's) is a bug and keeps its
    traceback."""

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        try:
            return fn(*a, **kw)
        except Exception as e:
            if not isinstance(e, _user_error_types()):
                raise
            _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)

    return wrapper


# ---- options declared once -----------------------------------------------------------------
# The runtime flags (RuntimeConfig's fields, same names) default to None, "not given": the
# config is RuntimeConfig's defaults, then --preset's values, then the flags given.

Model = Annotated[
    Path | None, typer.Option("--model", help="A strata-mlx store (default: the built-in model).")
]
ArenaGB = Annotated[
    float | None, typer.Option("--arena-gb", help="Arena size in GB (default: from memory).")
]
IOWorkers = Annotated[int | None, typer.Option("--io-workers", help="Reader threads (default 8).")]
ReadAhead = Annotated[
    str | None,
    typer.Option("--read-ahead", help="demand | static | lookahead (default lookahead)."),
]
StaticCap = Annotated[
    int | None, typer.Option("--static-cap", help="static: experts read ahead per layer (256).")
]
LookaheadMinTokens = Annotated[
    int | None,
    typer.Option("--lookahead-min-tokens", help="lookahead: predict in chunks of at least this."),
]
LookaheadDecodeMinMiss = Annotated[
    float | None,
    typer.Option(
        "--lookahead-decode-min-miss",
        help="Decode predicts while its miss rate is above this (default 0.02).",
    ),
]
LookaheadDepth = Annotated[
    int | None,
    typer.Option(
        "--lookahead-depth", help="Layers predicted ahead from each layer's input (default 2)."
    ),
]
Scheduler = Annotated[
    str | None,
    typer.Option(
        "--scheduler",
        help="loop (an asyncio loop keeps the drive busy between handshakes, the default) | "
        "sync (reads scheduled inside the handshake only).",
    ),
]
Eviction = Annotated[
    str | None,
    typer.Option(
        "--eviction",
        help="lru | lfu | profile | layer (default lru), a candidate of strata_mlx.stream.policies, "
        "or module:Class (a plug-in).",
    ),
]
Verify = Annotated[
    bool | None,
    typer.Option(
        "--verify/--no-verify",
        help="Checksums of the dense weights (once) and of every expert record as it is read "
        "(default on).",
    ),
]
PrefillStepSize = Annotated[
    int | None,
    typer.Option("--prefill-step-size", help="Prompt tokens per chunk (default: from memory)."),
]
FakeStream = Annotated[
    bool | None,
    typer.Option("--fake-stream", help="Every expert counts as resident: times compute alone."),
]
Decode = Annotated[
    str | None,
    typer.Option(
        "--decode",
        help="pipelined (routing checked a layer late, no per-layer sync; the default) | sync",
    ),
]
DecodeLag = Annotated[
    int | None, typer.Option("--decode-lag", help="Pipelined: layers of lag (default 1).")
]
TraceFile = Annotated[
    Path | None,
    typer.Option(
        "--trace",
        help="Write the routing trace (.npz, strata_mlx.stream.trace) for strata-mlx cache-sim; "
        "bench: each cold run's.",
    ),
]
Preset = Annotated[
    str | None,
    typer.Option("--preset", help="A runtime preset from configs/runtime/ (e.g. laptop-24gb)."),
]
Pipeline = Annotated[
    bool,
    typer.Option(
        "--pipeline", help="Layers pipelined over the ranks of mlx.launch (mx.distributed)."
    ),
]
PipelineSplit = Annotated[
    str | None,
    typer.Option("--pipeline-split", help="Layers per rank, e.g. 20,28 (default: by memory)."),
]
PipelineTimeout = Annotated[
    float,
    typer.Option("--pipeline-timeout", help="Seconds a pipeline step may wait on another rank."),
]


def runtime_config(options: dict, preset: str | None = None):
    """A checked RuntimeConfig: its defaults, then `preset`'s values, then the entries of
    `options` (a command's arguments, by RuntimeConfig's field names) that were given."""
    from ..config import check_runtime
    from ..runtime.loader import RuntimeConfig, apply_preset

    cfg = RuntimeConfig()
    if preset is not None:
        cfg = apply_preset(cfg, preset)
    names = cfg.options()
    cfg = cfg.replace(**{k: v for k, v in options.items() if k in names and v is not None})
    check_runtime(cfg, cli=True)
    return cfg


def builtin_model(model: Path | None, arena_gb: float | None) -> tuple[Path, float | None]:
    """--model and --arena-gb, the built-in model's store and arena when not given."""
    if model is not None:
        return model, arena_gb
    from .default_model import default_arena_gb, default_store

    store = default_store()
    return store, default_arena_gb(store) if arena_gb is None else arena_gb


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


@app.command()
@user_errors
def generate(
    model: Model = None,
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
    trace_file: TraceFile = None,
    arena_gb: ArenaGB = None,
    io_workers: IOWorkers = None,
    read_ahead: ReadAhead = None,
    lookahead_min_tokens: LookaheadMinTokens = None,
    lookahead_decode_min_miss: LookaheadDecodeMinMiss = None,
    lookahead_depth: LookaheadDepth = None,
    scheduler: Scheduler = None,
    static_cap: StaticCap = None,
    eviction: Eviction = None,
    verify: Verify = None,
    prefill_step_size: PrefillStepSize = None,
    fake_stream: FakeStream = None,
    decode: Decode = None,
    decode_lag: DecodeLag = None,
    preset: Preset = None,
    pipeline: Pipeline = False,
    pipeline_split: PipelineSplit = None,
    pipeline_timeout: PipelineTimeout = 300.0,
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
    runtime = dict(locals())  # the arguments; runtime_config() takes RuntimeConfig's fields
    from ..generation.generate import stream_generate, summary, teacher_forced_logits
    from ..runtime.loader import load

    if prompt is None and prompt_tokens is None:
        prompt = "The capital of France is" if model is None else None
        if prompt is None:
            raise OptionError("give --prompt/-p or --prompt-tokens")
    from ..config import check_int, check_sampling
    from ..generation.sampling import SamplingOptions

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
    check_output_file(logits_out, "--logits-out")
    check_output_file(trace_file, "--trace")
    from ..generation.prompt_cache import KVOptions

    kv = KVOptions(max_kv_size, kv_bits, kv_group_size, quantized_kv_start)
    kv.check(cli=True)
    template_kwargs = _template_config(chat_template_config)
    wants_chat = system_prompt is not None or chat_template_config is not None
    if chat is False and wants_chat:
        raise OptionError("--system-prompt and --chat-template-config need the chat template")
    chat = wants_chat if chat is None else chat
    model, runtime["arena_gb"] = builtin_model(model, arena_gb)
    cfg = runtime_config(runtime, preset)
    if experts_per_token is not None:  # the store's count bounds it, in every family
        from ..format.store import load_manifest

        n = load_manifest(model).num_experts
        check_int("experts_per_token", experts_per_token, 1, n, cli=True)
    pipe = None
    if pipeline:
        from ..runtime.distributed import Pipeline, serve_stage

        if kv.max_kv_size or kv.kv_bits or prompt_cache_file:  # each rank has its own cache
            raise OptionError(
                "--pipeline: --max-kv-size, --kv-bits and --prompt-cache-file are not pipelined yet"
            )
        pipe = Pipeline(split=pipeline_split, timeout_s=pipeline_timeout)
    if dump_moe is not None:
        from ..generation.tools import MoeDumper

        cfg = cfg.replace(dump=MoeDumper(dump_moe))
    if trace_file is not None:
        if pipe is not None:
            raise OptionError("--trace: a pipelined run's routing is not traced yet")
        from ..stream.stats import RoutingTrace

        cfg = cfg.replace(trace=RoutingTrace())
    m, tok = load(model, config=cfg, pipeline=pipe)
    cache = m.expert_cache
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
            raise OptionError(f"{model}: the store has no tokenizer; use --prompt-tokens")
        messages = [{"role": "user", "content": prompt}]
        if system_prompt is not None:
            messages.insert(0, {"role": "system", "content": system_prompt})
        text = tok.apply_chat_template(messages, **template_kwargs) if chat else prompt
        ids = tok.encode(text, add_special_tokens=not chat)  # a template carries its own BOS
    if logits_out is not None or logits_ref is not None:
        logits = teacher_forced_logits(m, ids, cfg.prefill_step_size)
        if logits_out is not None:
            _save_npy(logits_out, logits)
        if logits_ref is not None:
            from ..generation.tools import kld_report, load_logits

            typer.echo(kld_report(load_logits(logits_ref), logits).line())
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
        from ..runtime.distributed import rank_lines

        for line in rank_lines(m.rank_stats()):
            typer.echo(line)
        m.close()
    if cfg.dump is not None:
        cfg.dump.close()
    if trace_file is not None:
        from ..stream import trace

        trace.write(trace_file, trace.of_model(m))
    cache.close()


@app.command("cache-prompt")
@user_errors
def cache_prompt(
    prompt_cache_file: Path = typer.Option(
        ..., "--prompt-cache-file", help="The .safetensors file to write."
    ),
    model: Model = None,
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
    arena_gb: ArenaGB = None,
    io_workers: IOWorkers = None,
    read_ahead: ReadAhead = None,
    prefill_step_size: PrefillStepSize = None,
    verify: Verify = None,
    preset: Preset = None,
):
    """Run a prompt once and save its KV / recurrent state (mlx-lm's cache_prompt); generate
    and serve start from it with --prompt-cache-file."""
    runtime = dict(locals())
    import json
    import time

    from ..generation.generate import cache_prompt as run_prompt
    from ..generation.prompt_cache import KVOptions, save_prompt_cache
    from ..runtime.loader import load

    kv = KVOptions(max_kv_size, kv_bits, kv_group_size, quantized_kv_start)
    kv.check(cli=True)
    check_output_file(prompt_cache_file, "--prompt-cache-file")
    template_kwargs = _template_config(chat_template_config)
    wants_chat = system_prompt is not None or chat_template_config is not None
    if chat is False and wants_chat:
        raise OptionError("--system-prompt and --chat-template-config need the chat template")
    chat = wants_chat if chat is None else chat
    if prompt is None and prompt_tokens is None and system_prompt is None:
        raise OptionError("give --prompt/-p, --prompt-tokens or --system-prompt")
    model, runtime["arena_gb"] = builtin_model(model, arena_gb)
    cfg = runtime_config(runtime, preset)
    m, tok = load(model, config=cfg)
    if prompt == "-":
        prompt = sys.stdin.read()
    if prompt_tokens is not None:
        ids = parse_tokens(prompt_tokens, "--prompt-tokens")
    elif tok is None:
        raise OptionError(f"{model}: the store has no tokenizer; use --prompt-tokens")
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
        raise OptionError(f"prompt token ids must lie in [0, {vocab})")
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
    from ..generation.prompt_cache import check_kv_matches, load_prompt_cache

    cache, cached, _ = load_prompt_cache(path, model)
    check_kv_matches(path, cache, kv, cli=True)
    if ids[: len(cached)] == cached and len(ids) > len(cached):
        return cache, cached
    if chat:
        raise OptionError(
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
        raise OptionError(f"--chat-template-config: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise OptionError("--chat-template-config: expected a JSON object of template variables")
    taken = sorted({"messages", "add_generation_prompt", "bos_token", "eos_token"} & set(config))
    if taken:
        raise OptionError(f"--chat-template-config: {', '.join(taken)} are set by strata-mlx")
    return config


def _save_npy(path: Path, array) -> None:
    import numpy as np

    from ..format.store import write_atomic

    write_atomic(path, lambda tmp: np.save(tmp, array), tmp_suffix=".tmp.npy")  # np.save adds .npy


def check_output_file(path: Path | None, flag: str, suffix: str | None = None) -> None:
    """Before anything is loaded or run: an output file `flag` names can be written where it
    says (its directory exists and is writable, it is not a directory itself)."""
    import os

    if path is None:
        return
    where = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise OptionError(f"{flag} {path}: is a directory; name a file")
    if not where.is_dir():
        raise OptionError(f"{flag} {path}: no directory {where}")
    if not os.access(where, os.W_OK | os.X_OK):
        raise OptionError(f"{flag} {path}: cannot write in {where}")
    if suffix is not None and path.suffix.lower() != suffix:
        raise OptionError(
            f"{flag} {path}: writes {suffix[1:].upper()}; give a name ending in {suffix}"
        )


Q_MODES = ("affine", "mxfp4")  # convert_hf's q_mode


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
    q_mode: str | None = typer.Option(
        None,
        "--q-mode",
        help="With -q (--hf-path): affine (MLX affine, --q-bits/--q-group-size; the default) "
        "| mxfp4 (experts in OCP MXFP4, 4 bits in blocks of 32, as GPT-OSS ships; dense "
        "layers stay float).",
    ),
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
    recipe: str = typer.Option(
        "default",
        "--recipe",
        help="Synthetic weights: default (outputs depend on the experts) | before-issue-17 "
        "(every residual update x0.02: experts hardly matter, routing drifts little between "
        "tokens; the store the first wave's decode figures were measured on).",
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
    flags = dict(locals())  # the arguments; _convert passes each converter the ones it takes
    sources = [s for s in (hf_path, gguf_path, synthetic) if s is not None]
    if len(sources) != 1:
        raise OptionError("give exactly one of --hf-path, --gguf-path, --synthetic")
    if synthetic is not None:
        from ..convert.synthetic import Recipe

        flags["recipe"] = Recipe.named(recipe)  # a bad name: refused before any output
    from ..convert.common import check_output, overwriting

    check_output(mlx_path, *(s for s in (hf_path, gguf_path) if s), overwrite=overwrite)
    _exit_on_sigterm()  # SIGTERM unwinds: the temporary directory is removed on the way out
    if q_mode is not None and q_mode not in Q_MODES:
        raise OptionError(f"--q-mode {q_mode}: one of {', '.join(Q_MODES)}")
    if q_mode is not None and not quantize:
        raise OptionError(f"--q-mode {q_mode}: the mode of -q; add -q (--quantize)")
    if q_bits not in (2, 3, 4, 8):
        raise OptionError(f"--q-bits {q_bits}: one of 2, 3, 4, 8")
    if q_group_size not in (32, 64, 128):
        raise OptionError(f"--q-group-size {q_group_size}: one of 32, 64, 128")
    from ..config import MAX_SEED, check_int

    check_int("calibration_tokens", calibration_tokens, 0, 1 << 20, cli=True)
    check_int("seed", seed, 0, MAX_SEED, cli=True)
    with overwriting(overwrite):
        out = _convert(hf_path, gguf_path, synthetic, mlx_path, flags)
    typer.echo(f"wrote {out}")


def _exit_on_sigterm() -> None:
    import signal

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def _convert(hf_path, gguf_path, synthetic, mlx_path, flags: dict) -> Path:
    """The converter of the one source given, with the `convert` command's `flags` it takes."""
    if hf_path is not None:
        from ..convert.hf import convert_hf

        out = convert_hf(
            hf_path,
            mlx_path,
            flags["quantize"],
            q_bits=flags["q_bits"],
            q_group_size=flags["q_group_size"],
            q_mode=flags["q_mode"] or "affine",
            dtype=flags["dtype"],
            calibration_tokens=flags["calibration_tokens"],
        )
    elif gguf_path is not None:
        from ..convert.gguf import convert_gguf

        out = convert_gguf(
            gguf_path,
            mlx_path,
            split_experts=flags["split_experts"],
            calibration_tokens=flags["calibration_tokens"],
        )
    else:
        from ..convert.synthetic import convert_synthetic, synthetic_config

        config = synthetic_config(synthetic)
        for item in flags["set_"] or []:
            key, sep, value = item.partition("=")
            if not sep or key not in config:
                raise OptionError(
                    f"--set {item}: expected KEY=VALUE with KEY one of {sorted(config)}"
                )
            try:
                config[key] = type(config[key])(value)
            except ValueError:
                kind = type(config[key]).__name__
                raise OptionError(f"--set {item}: {value!r} is not a valid {kind}") from None
        out = convert_synthetic(
            synthetic,
            mlx_path,
            config=config,
            router=flags["router"],
            seed=flags["seed"],
            calibration_tokens=flags["calibration_tokens"],
            dtype=flags["dtype"] or "float16",
            recipe=flags["recipe"],
        )
    return out


@app.command()
@user_errors
def bench(
    model: Annotated[Path, typer.Option("--model", help="A strata-mlx store.")],
    prompt_tokens: int = typer.Option(2048, "-p", "--prompt-tokens"),
    generation_tokens: int = typer.Option(128, "-g", "--generation-tokens"),
    arena_gb: ArenaGB = None,
    prefill_step_size: PrefillStepSize = 1024,
    policies: str = typer.Option(
        "demand,static,lookahead",
        "--policies",
        help="Read-ahead policies, each with variants: lookahead:sync:d1 (see README).",
    ),
    repeats: int = typer.Option(1, "--repeats", help="A/B rounds; the order rotates each round."),
    io_workers: IOWorkers = 8,
    static_cap: StaticCap = 256,
    eviction: Eviction = "lru",
    scheduler: Scheduler = None,
    lookahead_depth: LookaheadDepth = None,
    json_out: Path | None = typer.Option(None, "--json", help="Write all figures as JSON."),
    baseline: str | None = typer.Option(
        None,
        "--baseline",
        help="mlx-lm: then mlx-lm's own model and ours on the same prompt, with ratios.",
    ),
    plot: Path | None = typer.Option(
        None, "--plot", help='Write a PNG of the run (pip install "strata-mlx[plot]").'
    ),
    pipeline: Pipeline = False,
    pipeline_split: PipelineSplit = None,
    pipeline_timeout: PipelineTimeout = 300.0,
    trace_file: TraceFile = None,
):
    """Prefill and decode, cold and warm, read-ahead policies side by side.

    Caches: before each cold run the store's own files are evicted from the OS page cache
    (posix_fadvise DONTNEED on each file, Linux); nothing else on the machine is touched.
    """
    from ..config import OptionError, check_int
    from ..stream.prediction import READ_AHEAD_POLICIES
    from .bench import bench as run_bench
    from .bench import markdown_table, policy_options, save

    check_int("prompt_tokens", prompt_tokens, 2, 1 << 24, cli=True)  # one chunk and a rest
    check_int("generation_tokens", generation_tokens, 1, 1 << 20, cli=True)
    check_int("repeats", repeats, 1, 1000, cli=True)
    check_output_file(json_out, "--json")
    check_output_file(plot, "--plot", suffix=".png")
    check_output_file(trace_file, "--trace")
    if trace_file is not None and pipeline:
        raise OptionError("--trace: a pipelined run's routing is not traced yet")
    runtime_config(dict(scheduler=scheduler, lookahead_depth=lookahead_depth))  # before :variants
    names = tuple(_with_variants(p, scheduler, lookahead_depth) for p in policies.split(",") if p)
    if not names:
        raise OptionError("--policies: name at least one (demand, static, lookahead)", "policies")
    for name in names:  # each policy's runtime, checked before anything is loaded
        given = dict(arena_gb=arena_gb, io_workers=io_workers, prefill_step_size=prefill_step_size,
                     static_cap=static_cap, eviction=eviction)  # fmt: skip
        try:
            runtime_config({**given, **policy_options(name)})
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
    make_pipeline = None
    if pipeline:  # under mlx.launch: every rank loads each run; rank 0 drives and prints
        from ..runtime.distributed import Pipeline, init

        group = init()
        make_pipeline = lambda: Pipeline(group, pipeline_split, pipeline_timeout)  # noqa: E731
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
        pipeline=make_pipeline,
        trace=trace_file,
    )
    if not result:  # a rank other than 0: it served rank 0's runs
        return
    typer.echo(markdown_table(result))
    if json_out is not None:
        save(result, json_out)


def _with_variants(policy: str, scheduler: str | None, lookahead_depth: int | None) -> str:
    """--scheduler and --lookahead-depth as the policy-name variants bench's runs take
    (`:sync`, `:d3`), for each policy that does not name its own."""
    variants = policy.split(":")[1:]
    if scheduler is not None and not {"sync", "loop"} & set(variants):
        policy += f":{scheduler}"
    if lookahead_depth is not None and not any(v[:1] == "d" and v[1:].isdigit() for v in variants):
        policy += f":d{lookahead_depth}"
    return policy


@app.command("cache-sim")
@user_errors
def cache_sim(
    trace_file: Path = typer.Argument(..., help="A trace file (bench/generate --trace)."),
    slots: str = typer.Option(
        ..., "--slots", help="Arena slots (expert records); a comma list sweeps sizes."
    ),
    policy: str = typer.Option(
        "lru,lfu,belady",
        "--policy",
        help="Comma-separated: eviction policies (names, module:Class plug-ins) and belady.",
    ),
    plot: Path | None = typer.Option(
        None, "--plot", help="Write a PNG of MB/token against the arena's slots."
    ),
    read_ahead: str = typer.Option(
        "none",
        "--read-ahead",
        help="none | lookahead | scored: also replay decode read-ahead from the trace's "
        "predictions, beside each policy.",
    ),
):
    """Replay a routing trace through eviction policies and Belady's optimum: decode miss %
    and MB/token for each (strata_mlx.apps.cache_sim)."""
    from .cache_sim import report

    check_output_file(plot, "--plot", suffix=".png")
    for line in report(trace_file, slots, policy, plot, read_ahead):
        typer.echo(line)


@app.command()
@user_errors
def plan(
    model: Path = typer.Argument(..., help="A store, a Hugging Face checkpoint or a GGUF file."),
    arena_gb: float | None = typer.Option(None, "--arena-gb", help="Default: automatic."),
    prefill_step_size: int | None = typer.Option(None, "--prefill-step-size"),
    prompt_tokens: int = typer.Option(2048, "-p", "--prompt-tokens"),
    generation_tokens: int = typer.Option(
        128,
        "-g",
        "--generation-tokens",
        help="Decode tokens after the cold prompt (the first ones find the arena as the "
        "prefill left it): as bench's -g.",
    ),
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
    from ..config import check_int
    from .plan import plan as run_plan
    from .plan import save

    check_int("prompt_tokens", prompt_tokens, 1, 1 << 24, cli=True)
    check_int("generation_tokens", generation_tokens, 1, 1 << 24, cli=True)
    check_output_file(json_out, "--json")
    f = run_plan(model, arena_gb, prefill_step_size, prompt_tokens, generation_tokens, io_workers,
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
    from ..config import MAX_IO_WORKERS, check_int, check_number
    from ..stream.probe import probe_ssd as probe

    check_int("record_bytes", record_bytes, 1, 1 << 30, cli=True)
    check_number("seconds", seconds, 0, 3600, lo_open=True, cli=True)
    counts = tuple(parse_tokens(workers, "--workers"))
    for n in counts:
        check_int("workers", n, 1, MAX_IO_WORKERS, cli=True)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    for row in probe(path, record_bytes=record_bytes, seconds=seconds, workers_list=counts):
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
    from ..runtime.kernels import example_layout, kernel_source_text

    if dialect not in ("metal", "cuda", "host"):
        _fail(f"--dialect {dialect!r}: one of metal, cuda, host")
    try:
        layout = example_layout(fmt, hidden, inter, down)
        typer.echo(kernel_source_text(layout, dialect, top_k, tile))
    except (KeyError, ValueError) as e:
        _fail(str(e).strip("'\""))


@app.command()
@user_errors
def serve(
    model: Model = None,
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8080, "--port"),
    model_name: str | None = typer.Option(
        None, "--model-name", help="The name clients ask for (default: the store's folder name)."
    ),
    arena_gb: ArenaGB = None,
    io_workers: IOWorkers = None,
    read_ahead: ReadAhead = None,
    lookahead_min_tokens: LookaheadMinTokens = None,
    lookahead_decode_min_miss: LookaheadDecodeMinMiss = None,
    lookahead_depth: LookaheadDepth = None,
    scheduler: Scheduler = None,
    static_cap: StaticCap = None,
    eviction: Eviction = None,
    verify: Verify = None,
    prefill_step_size: PrefillStepSize = None,
    decode: Decode = None,
    decode_lag: DecodeLag = None,
    preset: Preset = None,
    max_tokens: int = typer.Option(
        DEFAULT_MAX_TOKENS, "--max-tokens", "-m", help="max_tokens of a request that gives none."
    ),
    max_tokens_limit: int | None = typer.Option(
        None,
        "--max-tokens-limit",
        help="The largest max_tokens a request may ask (default: the model's context).",
    ),
    max_prompt_tokens: int | None = typer.Option(
        None,
        "--max-prompt-tokens",
        help="The longest prompt accepted, in tokens (default: the model's context).",
    ),
    max_queue: int = typer.Option(
        DEFAULT_MAX_QUEUE,
        "--max-queue",
        help="Requests that may wait behind the running one; more are answered 429.",
    ),
    shutdown_timeout: float = typer.Option(
        DEFAULT_SHUTDOWN_TIMEOUT,
        "--shutdown-timeout",
        help="Seconds requests in flight get to finish after SIGTERM before they are cancelled.",
    ),
    api_key: str | None = typer.Option(
        None,
        "--api-key",
        envvar="STRATA_MLX_API_KEY",
        help="Require 'Authorization: Bearer KEY' on every request (or set STRATA_MLX_API_KEY).",
    ),
    allowed_origins: str | None = typer.Option(
        None,
        "--allowed-origins",
        help="Comma-separated origins browsers may call from (CORS), or '*'.",
    ),
    log_level: str = typer.Option("info", "--log-level"),
    prompt_cache_size: int = typer.Option(
        10, "--prompt-cache-size", help="Conversations whose KV cache is kept for reuse (0: off)."
    ),
    prompt_cache_bytes: int = typer.Option(
        1 << 30, "--prompt-cache-bytes", help="Bytes those kept caches may hold together."
    ),
    prompt_cache_dir: Path | None = typer.Option(
        None,
        "--prompt-cache-dir",
        help="Also keep conversations' KV caches in this directory: what memory evicts, and "
        "all at shutdown; a restarted server resumes them from there.",
    ),
    prompt_cache_dir_bytes: int = typer.Option(
        16 << 30, "--prompt-cache-dir-bytes", help="Bytes the directory's caches may hold."
    ),
    max_kv_size: int | None = KV_FLAGS["max_kv_size"],
    kv_bits: int | None = KV_FLAGS["kv_bits"],
    kv_group_size: int = KV_FLAGS["kv_group_size"],
    quantized_kv_start: int = KV_FLAGS["quantized_kv_start"],
    pipeline: Pipeline = False,
    pipeline_split: PipelineSplit = None,
    pipeline_timeout: PipelineTimeout = 300.0,
):
    """Serve a store over HTTP: OpenAI's chat and text completions and Responses API, and
    Anthropic's Messages API."""
    runtime = dict(locals())
    from ..config import OptionError, check_int, check_number

    try:
        from .server import serve as run_server
    except ImportError as e:  # a machine without the server stack still runs everything else
        raise OptionError(f"serve needs {e.name}: pip install -e . installs it") from None
    check_int("port", port, 1, 65535, cli=True)
    check_int("max_tokens", max_tokens, 1, cli=True)
    for name in ("max_tokens_limit", "max_prompt_tokens"):
        if runtime[name] is not None:
            check_int(name, runtime[name], 1, cli=True)
    check_int("max_queue", max_queue, 0, cli=True)
    check_int("prompt_cache_size", prompt_cache_size, 0, cli=True)
    check_int("prompt_cache_bytes", prompt_cache_bytes, 0, cli=True)
    check_int("prompt_cache_dir_bytes", prompt_cache_dir_bytes, 1, cli=True)
    if pipeline and prompt_cache_dir is not None:  # the other ranks hold the state
        raise OptionError("--pipeline: --prompt-cache-dir is not pipelined yet")
    if prompt_cache_dir is not None and prompt_cache_dir.exists() and not prompt_cache_dir.is_dir():
        raise OptionError(f"--prompt-cache-dir {prompt_cache_dir}: not a directory")
    check_number("shutdown_timeout", shutdown_timeout, 0, cli=True)
    from ..generation.prompt_cache import KVOptions

    kv = KVOptions(max_kv_size, kv_bits, kv_group_size, quantized_kv_start)
    kv.check(cli=True)
    if pipeline and (kv.max_kv_size or kv.kv_bits):  # each rank has its own cache
        raise OptionError("--pipeline: --max-kv-size and --kv-bits are not pipelined yet")
    if api_key is not None and not api_key.strip():
        raise OptionError("--api-key: empty", "api_key")
    origins = [o.strip() for o in (allowed_origins or "").split(",") if o.strip()] or None
    if model is None:
        model_name = model_name or "smollm2-135m-instruct-split"
    model, runtime["arena_gb"] = builtin_model(model, arena_gb)
    cfg = runtime_config(runtime, preset)
    run_server(
        model,
        host=host,
        port=port,
        model_name=model_name,
        log_level=log_level,
        max_tokens=max_tokens,
        max_tokens_limit=max_tokens_limit,
        max_prompt_tokens=max_prompt_tokens,
        max_queue=max_queue,
        api_key=api_key,
        allowed_origins=origins,
        shutdown_timeout=shutdown_timeout,
        prompt_cache_size=prompt_cache_size,
        prompt_cache_bytes=prompt_cache_bytes,
        prompt_cache_dir=prompt_cache_dir,
        prompt_cache_dir_bytes=prompt_cache_dir_bytes,
        pipeline=pipeline,
        pipeline_split=pipeline_split,
        pipeline_timeout=pipeline_timeout,
        kv=kv,
        config=cfg,
    )


def _register_tools() -> None:
    from ..generation.tools import kld_command, route_parity_command

    app.command("kld", help="KLD and top-1 agreement between two logits files.")(
        user_errors(kld_command)
    )
    app.command("route-parity", help="Routing of two configurations, per layer and token.")(
        user_errors(route_parity_command)
    )


_register_tools()
