"""Conversion that cannot destroy: never over its source or the directory it
runs from; an existing store replaced only with --overwrite, and kept until the new one is
complete; temporary directories of dead conversions removed by the next run; a read-only or
full filesystem a one-line error that leaves nothing behind."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tiny_gguf

import strata_mlx
from strata_mlx.convert.gguf import convert_gguf
from strata_mlx.format.store import StoreError, load_manifest
from strata_mlx.format.writer import OWNER, REPLACED, remove_dead_temps

CLI = [sys.executable, "-m", "strata_mlx"]


def run(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, *map(str, args)], capture_output=True, text=True, timeout=300, **kw
    )


def _error_line(r) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [line for line in r.stderr.strip().splitlines() if line.strip()]
    lines = [line.rsplit("expert/s]", 1)[-1] for line in lines if line.rsplit("expert/s]", 1)[-1]]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr  # after a progress bar
    return lines[0]


@pytest.fixture
def gguf(tmp_path) -> Path:
    return tiny_gguf.write(tmp_path / "m.gguf", "qwen3moe", *tiny_gguf.qwen3moe())


def _convert(src, out, **kw):
    return convert_gguf(src, out, progress=False, calibration_tokens=0, **kw)


def _fingerprint(path: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def _temps(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f".{out.name}.*"))


def test_existing_store_needs_overwrite_and_foreign_files_are_kept(gguf, tmp_path):
    out = _convert(gguf, tmp_path / "s")
    before = _fingerprint(out)
    with pytest.raises(StoreError, match="a store already exists; pass --overwrite"):
        _convert(gguf, out)
    assert _fingerprint(out) == before
    (out / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match="'notes.txt', which is not a store file"):
        _convert(gguf, out, overwrite=True)
    (out / "notes.txt").unlink()
    assert _convert(gguf, out, overwrite=True) == out
    load_manifest(out)
    assert not _temps(out) and not (out / OWNER).exists() and not (out / REPLACED).exists()
    # A directory that is not a store is never replaced, not even with overwrite.
    other = tmp_path / "photos"
    other.mkdir()
    (other / "a.jpg").write_bytes(b"x")
    with pytest.raises(StoreError, match="not a strata-mlx store"):
        _convert(gguf, other, overwrite=True)
    assert (other / "a.jpg").read_bytes() == b"x"


def test_refuses_the_source_and_the_working_directory(gguf, tmp_path, hf_checkpoint):
    # The source inside the output (replacing it would delete the source).
    holder = tmp_path / "holder"
    holder.mkdir()
    inside = shutil.copy(gguf, holder / "m.gguf")
    with pytest.raises(StoreError, match="holds the source"):
        _convert(inside, holder, overwrite=True)
    # A Hugging Face directory as its own output.
    src = tmp_path / "hf"
    shutil.copytree(hf_checkpoint("qwen3_moe"), src)
    line = _error_line(run("convert", "--hf-path", src, "--mlx-path", src, "--overwrite"))
    assert "is the source" in line
    # `convert --mlx-path .` run inside an existing store (used to delete both stores).
    store = _convert(gguf, tmp_path / "s")
    before = _fingerprint(store)
    line = _error_line(
        run("convert", "--gguf-path", gguf, "--mlx-path", ".", "--overwrite", cwd=store)
    )
    assert "the directory this command runs in" in line
    assert _fingerprint(store) == before and not _temps(store)


def test_cli_overwrite(gguf, tmp_path):
    out = tmp_path / "s"
    args = ("convert", "--gguf-path", gguf, "--mlx-path", out, "--calibration-tokens", 0)
    assert run(*args).returncode == 0
    line = _error_line(run(*args))
    assert "pass --overwrite" in line
    r = run(*args, "--overwrite")
    assert r.returncode == 0, r.stderr
    load_manifest(out)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _temp(out: Path, pid: int, start: str = "0", tag: str = "") -> Path:
    """A temporary directory of a conversion into `out` by process `pid`, as StoreWriter
    names them (the owner is in the name from the moment it exists)."""
    from strata_mlx.format.writer import _host_tag

    d = out.parent / f".{out.name}.{pid}-{start}-{_host_tag()}.{tag or 'abcd1234'}"
    d.mkdir(parents=True)
    return d


def _stamp(d: Path, pid: int) -> None:
    from strata_mlx.format.writer import _host_tag

    (d / OWNER).write_text(json.dumps({"pid": pid, "host": _host_tag(), "start": None}))


def test_temporary_directories_of_dead_conversions_are_removed(gguf, tmp_path):
    out = tmp_path / "s"
    dead = _temp(out, _dead_pid(), tag="dead")
    (dead / "experts.bin").write_bytes(b"\0" * 4096)  # killed before its stamp was written
    reused = _temp(out, os.getpid(), start="1", tag="reused")  # a live pid, another process
    alive = _temp(out, os.getpid(), tag="alive")
    unknown = tmp_path / ".s.unknown1"  # not named as ours: not ours to judge
    unknown.mkdir()
    other = _temp(tmp_path / "t", _dead_pid())  # another output's
    _convert(gguf, out)
    assert not dead.exists() and not reused.exists()
    assert alive.exists() and unknown.exists() and other.exists()


def test_a_replacement_killed_between_its_renames_is_undone(gguf, tmp_path):
    out = _convert(gguf, tmp_path / "s")
    before = _fingerprint(out)
    # Killed after moving the old store aside, before renaming the new one into place.
    tmp = _temp(out, _dead_pid())
    os.replace(out, tmp / REPLACED)
    assert not out.exists()
    remove_dead_temps(out)
    assert _fingerprint(out) == before and not tmp.exists()
    # Killed after both renames, before deleting the old store.
    shutil.copytree(out, tmp_path / "old")
    os.replace(tmp_path / "old", out / REPLACED)
    _stamp(out, _dead_pid())
    remove_dead_temps(out)
    assert _fingerprint(out) == before and not (out / REPLACED).exists()


def test_a_signal_after_the_renames_finishes_the_store_and_says_it_is_written(
    gguf, tmp_path, monkeypatch
):
    """Ctrl-C just after commit() moved the new store into place printed "stopped" alone and
    left the old store and the owner stamp inside the new one: the signal's thread finishes
    what commit() had left (the store is whole) and names it as written."""
    from strata_mlx.format import writer

    out = _convert(gguf, tmp_path / "s")
    before = _fingerprint(out)
    finish = writer._finish_replacement

    def interrupted(path):  # the signal lands after the renames, before the old store goes
        monkeypatch.setattr(writer, "_finish_replacement", finish)
        raise KeyboardInterrupt

    monkeypatch.setattr(writer, "_finish_replacement", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _convert(gguf, out, overwrite=True)
    assert (out / REPLACED).is_dir() and (out / writer.OWNER).is_file()
    assert writer.finish_committed() == [out]  # (the signal's thread, before its exit)
    assert _fingerprint(out) == before and not (out / REPLACED).exists()
    assert not (out / writer.OWNER).exists() and writer.finish_committed() == []


def test_a_failed_commit_puts_the_old_store_back(gguf, tmp_path, monkeypatch):
    out = _convert(gguf, tmp_path / "s")
    before = _fingerprint(out)
    import strata_mlx.format.writer as writer

    real = os.replace
    calls = []

    def second_fails(a, b):
        calls.append((a, b))
        if len(calls) == 2:
            raise OSError(errno.EIO, "Input/output error", str(b))
        return real(a, b)

    monkeypatch.setattr(writer.os, "replace", second_fails)
    with pytest.raises(StoreError, match="cannot write the store"):
        _convert(gguf, out, overwrite=True)
    monkeypatch.setattr(writer.os, "replace", real)
    assert _fingerprint(out) == before and not _temps(out)


def test_a_store_written_there_meanwhile_is_not_replaced(gguf, tmp_path, monkeypatch):
    """Two conversions to one new path at once both said "wrote", the first store lost: one
    that began with no store there does not move its own over a store that appeared while
    it ran (another conversion's, copied in here just before the move); it says so, and
    leaves that store and no temporary directory."""
    import strata_mlx.format.writer as writer

    other = _convert(gguf, tmp_path / "other")
    out, real = tmp_path / "s", writer._fsync_tree

    def another_wrote_first(d):
        shutil.copytree(other, out)
        return real(d)

    monkeypatch.setattr(writer, "_fsync_tree", another_wrote_first)
    with pytest.raises(StoreError, match="another conversion wrote a store there meanwhile"):
        _convert(gguf, out)
    assert _fingerprint(out) == _fingerprint(other) and not _temps(out)


def test_the_new_store_is_on_the_drive_before_the_old_one_is_moved_aside(
    gguf, tmp_path, monkeypatch
):
    """A crash after the renames must not find a store whose bytes were in the page cache
    only: every file of the new store is fsynced before the first rename, the rename after."""
    out = _convert(gguf, tmp_path / "s")
    import strata_mlx.format.writer as writer

    events, path_of = [], {}
    real_open, real_fsync, real_replace = os.open, os.fsync, os.replace

    def open_(path, flags, *args):
        fd = real_open(path, flags, *args)
        path_of[fd] = str(path)
        return fd

    def fsync(fd):
        events.append(("fsync", path_of.get(fd, "?")))
        return real_fsync(fd)

    def replace(a, b):
        events.append(("replace", str(b)))
        return real_replace(a, b)

    monkeypatch.setattr(writer.os, "open", open_)
    monkeypatch.setattr(writer.os, "fsync", fsync)
    monkeypatch.setattr(writer.os, "replace", replace)
    _convert(gguf, out, overwrite=True)
    first = next(
        i
        for i, (kind, target) in enumerate(events)
        if kind == "replace" and target.endswith(REPLACED)
    )
    synced = {Path(p).name for kind, p in events[:first] if kind == "fsync"}
    assert {"experts.bin", "dense.safetensors", "manifest.json"} <= synced, events
    last_rename = max(i for i, (kind, target) in enumerate(events) if target == str(out))
    assert ("fsync", str(out.parent)) in events[last_rename:], events


@pytest.mark.parametrize("where", ["experts", "dense", "manifest", "mkdtemp"])
def test_disk_errors_are_one_line_and_leave_nothing(gguf, tmp_path, monkeypatch, where):
    """ENOSPC / EROFS at each write, injected (tests below use real filesystems)."""
    import strata_mlx.format.writer as writer

    err = OSError(errno.ENOSPC, "No space left on device", "x")
    if where == "experts":
        monkeypatch.setattr(writer.StoreWriter, "add_expert", _raise(err))
    elif where == "dense":

        def short(path, weights, metadata=None):
            Path(path).write_bytes(b"\x10" + b"\0" * 7)  # what a full disk leaves

        import mlx.core as mx

        monkeypatch.setattr(mx, "save_safetensors", short)
    elif where == "manifest":
        monkeypatch.setattr(writer, "write_text_atomic", _raise(err))
    else:
        monkeypatch.setattr(writer.tempfile, "mkdtemp", _raise(OSError(errno.EROFS, "Read-only")))
    with pytest.raises(StoreError) as e:
        _convert(gguf, tmp_path / "s")
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and str(tmp_path / "s") in msg, msg
    assert ("disk full" in msg) if where == "dense" else ("cannot write the store" in msg)
    assert not (tmp_path / "s").exists() and not _temps(tmp_path / "s")


def test_an_exit_before_the_writer_owns_its_directory_leaves_nothing(tmp_path):
    """The temporary directory exists, then the process unwinds (as convert's SIGTERM does)
    before any code that would remove it runs: it goes at exit, an old store moved aside into
    it comes back; a forked child's exit leaves its parent's alone."""
    out = tmp_path / "s"
    code = f"""
import os
from pathlib import Path
from strata_mlx.format import writer
out = Path({str(out)!r})
out.mkdir()
(out / "old").write_text("the user's store")
t = writer._make_temp(out)
if os.fork() == 0:
    raise SystemExit(0)
os.wait()
assert t.is_dir()
os.replace(out, t / writer.REPLACED)  # commit() between its renames
raise SystemExit(128 + 15)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 128 + 15, p.stderr
    assert not _temps(out)
    assert (out / "old").read_text() == "the user's store"


def _raise(e):
    def f(*a, **kw):
        raise e

    return f


@contextlib.contextmanager
def _tmpfs(path: Path, options: str):
    path.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True
    )
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()})")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], capture_output=True)


@pytest.mark.parametrize("size", ["8k", "48k"])  # dense written short / experts.bin ENOSPC
def test_full_disk_for_real(gguf, tmp_path, size):
    with _tmpfs(tmp_path / "small", f"size={size}") as fs:
        line = _error_line(
            run("convert", "--gguf-path", gguf, "--mlx-path", fs / "s", "--calibration-tokens", 0)
        )
        assert str(fs / "s") in line and ("No space left" in line or "disk full" in line), line
        assert list(fs.iterdir()) == []


def test_read_only_filesystem_for_real(gguf, tmp_path):
    with _tmpfs(tmp_path / "ro", "ro,size=1m") as fs:
        line = _error_line(run("convert", "--gguf-path", gguf, "--mlx-path", fs / "s"))
        assert "cannot write the store" in line and "not writable" in line, line


def test_sigterm_removes_the_temporary_directory(hf_checkpoint, tmp_path):
    out = tmp_path / "s"
    p = subprocess.Popen(
        [*CLI, "convert", "--hf-path", str(hf_checkpoint("qwen3_moe")), "--mlx-path", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    while not _temps(out) and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    p.send_signal(signal.SIGTERM)
    p.wait(60)
    if p.returncode == 0:
        pytest.skip("the conversion finished before SIGTERM")
    assert p.returncode == 128 + signal.SIGTERM, p.stderr.read()
    assert "Traceback" not in p.stderr.read().decode()
    assert not _temps(out) and not out.exists()


def test_loadable_after_overwrite(gguf, tmp_path):
    out = _convert(gguf, tmp_path / "s")
    out = _convert(gguf, out, overwrite=True)
    model, tok = strata_mlx.load(out)
    try:
        assert len(list(strata_mlx.stream_generate(model, tok, "hi", max_tokens=2))) == 2
    finally:
        model.expert_cache.close()


# ---- checkpoints that would compute wrong: refused, nothing written -------------------------


def _refused(src: Path, out: Path, match: str, **kw) -> str:
    from strata_mlx.convert.hf import convert_hf

    with pytest.raises(StoreError, match=match) as e:
        convert_hf(src, out, progress=False, calibration_tokens=0, **kw)
    assert "\n" not in str(e.value)
    assert not out.exists() and not _temps(out)
    return str(e.value)


def _fp8_checkpoint(hf_checkpoint, dst: Path, block: int = 16) -> dict:
    """The tiny DeepSeek-V3 checkpoint with its linear weights in FP8 (e4m3) and a float32
    `weight_scale_inv` per block, as DeepSeek ships it: the tensors, as saved."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(hf_checkpoint("deepseek_v3"), dst)
    (f,) = dst.glob("*.safetensors")
    out = {}
    for k, v in load_file(f).items():
        if not (v.dim() == 2 and k.endswith("proj.weight")):
            out[k] = v
            continue
        m, n = v.shape
        blocks = torch.nn.functional.pad(v, (0, -n % block, 0, -m % block))
        blocks = blocks.reshape(-(-m // block), block, -(-n // block), block)
        scale = (blocks.abs().amax(dim=(1, 3)) / 448).clamp(min=1e-12)
        full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:m, :n]
        out[k], out[k + "_scale_inv"] = (v / full).to(torch.float8_e4m3fn), scale.float()
    save_file(out, f, metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [block, block]}
    (dst / "config.json").write_text(json.dumps(config))
    return out


def _save(src: Path, tensors: dict) -> None:
    from safetensors.torch import save_file

    (f,) = src.glob("*.safetensors")
    save_file(tensors, f, metadata={"format": "pt"})


def test_fp8_weight_without_its_scale_is_refused(hf_checkpoint, tmp_path):
    """A checkpoint missing one `weight_scale_inv` converted with exit 0 (the e4m3 bytes read
    as numbers: top-1 agreement 50 %); all of them missing, the same."""
    src = tmp_path / "fp8"
    fp8 = _fp8_checkpoint(hf_checkpoint, src)
    gone = "model.layers.1.mlp.experts.3.up_proj.weight"
    _save(src, {k: v for k, v in fp8.items() if k != gone + "_scale_inv"})
    msg = _refused(src, tmp_path / "s", f"{gone}: dtype uint8 without its weight_scale_inv")
    assert str(src) in msg
    attn = "model.layers.0.self_attn.o_proj.weight"
    _save(src, {k: v for k, v in fp8.items() if k != attn + "_scale_inv"})
    _refused(src, tmp_path / "s", f"{attn}: dtype uint8 without its weight_scale_inv")
    _save(src, {k: v for k, v in fp8.items() if not k.endswith("_scale_inv")})
    _refused(src, tmp_path / "s", "dtype uint8 without its weight_scale_inv")


def test_fp8_scales_of_an_integer_dtype_are_refused(hf_checkpoint, tmp_path):
    import torch

    src = tmp_path / "fp8"
    fp8 = _fp8_checkpoint(hf_checkpoint, src)
    bad = "model.layers.2.mlp.experts.0.down_proj.weight_scale_inv"
    _save(src, {**fp8, bad: fp8[bad].to(torch.int32)})
    _refused(src, tmp_path / "s", f"{bad}: dtype int32, expected a float scale")


@pytest.mark.parametrize(
    "where, dtype",
    [
        ("model.layers.0.self_attn.q_a_proj.weight", "float32"),  # dense, float32
        ("model.layers.1.mlp.experts.5.gate_proj.weight", "float32"),  # an expert
        ("model.layers.1.mlp.experts.5.gate_proj.weight", "affine"),  # quantizing drops a NaN
        ("model.layers.1.mlp.experts.5.gate_proj.weight", "mxfp4"),
    ],
)
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_unless_allowed(
    hf_checkpoint, tmp_path, where, dtype, value
):
    """A checkpoint with NaN weights converted and generated "0 0 0"."""
    from safetensors.torch import load_file

    from strata_mlx.convert.hf import convert_hf

    src = shutil.copytree(hf_checkpoint("deepseek_v3"), tmp_path / "src")
    (f,) = src.glob("*.safetensors")
    w = load_file(f)
    w[where][3, 5] = value
    _save(src, w)
    kw = {"quantize": True, "q_mode": dtype, "q_group_size": 32} if dtype != "float32" else {}
    name = where.rsplit(".", 1)[0] if "experts" in where else where
    _refused(src, tmp_path / "s", f"{name}: 1 non-finite values .*--allow-non-finite", **kw)
    out = convert_hf(
        src, tmp_path / "s", progress=False, calibration_tokens=0, allow_non_finite=True, **kw
    )
    load_manifest(out)


def test_weights_that_overflow_the_store_dtype_are_refused(hf_checkpoint, tmp_path):
    """1e38 is a float32 but inf in float16: refused after the cast the store asks for."""
    from safetensors.torch import load_file

    src = shutil.copytree(hf_checkpoint("qwen3_moe"), tmp_path / "src")
    (f,) = src.glob("*.safetensors")
    w = load_file(f)
    w["model.layers.0.mlp.experts.2.down_proj.weight"][0, 0] = 1e38
    _save(src, w)
    _refused(src, tmp_path / "s", "experts.2.down_proj: 1 non-finite .* cast to float16",
             dtype="float16")  # fmt: skip


def test_cli_refuses_nan_weights_in_one_line(hf_checkpoint, tmp_path):
    from safetensors.torch import load_file

    src = shutil.copytree(hf_checkpoint("qwen3_moe"), tmp_path / "src")
    (f,) = src.glob("*.safetensors")
    w = load_file(f)
    w["model.layers.1.mlp.experts.4.up_proj.weight"][2, 2] = float("nan")
    _save(src, w)
    out = tmp_path / "s"
    quiet = {**os.environ, "PYTHONWARNINGS": "ignore"}  # the checkpoint has no tokenizer
    r = run("convert", "--hf-path", src, "--mlx-path", out, "--calibration-tokens", 0, env=quiet)
    line = _error_line(r)
    assert "experts.4.up_proj: 1 non-finite values" in line and str(src) in line
    assert not out.exists() and not _temps(out)
    r = run("convert", "--hf-path", src, "--mlx-path", out, "--calibration-tokens", 0,
            "--allow-non-finite", env=quiet)  # fmt: skip
    assert r.returncode == 0, r.stderr
    load_manifest(out)


def test_an_expert_shaped_unlike_the_others_or_a_stray_tensor_is_one_line(hf_checkpoint, tmp_path):
    """One expert's down_proj of another shape was a ValueError's traceback; a tensor the
    model does not have was named nowhere (MLX lists names after its message's first line)."""
    import torch
    from safetensors.torch import load_file

    quiet = {**os.environ, "PYTHONWARNINGS": "ignore"}  # the checkpoint has no tokenizer
    for name, change in [
        ("shape", lambda w: w.__setitem__(DOWN, w[DOWN][:, :-1].clone())),
        ("stray", lambda w: w.__setitem__("model.layers.0.mlp.stray.weight", torch.zeros(2))),
    ]:
        src = shutil.copytree(hf_checkpoint("qwen3_moe"), tmp_path / f"src-{name}")
        (f,) = src.glob("*.safetensors")
        w = load_file(f)
        change(w)
        _save(src, w)
        out = tmp_path / f"s-{name}"
        r = run("convert", "--hf-path", src, "--mlx-path", out, "--calibration-tokens", 0,
                env=quiet)  # fmt: skip
        line = _error_line(r)
        assert str(src) in line and "Traceback" not in r.stderr, r.stderr
        if name == "shape":
            assert "layer 1 expert 4: expert tensor down_proj.weight: shape" in line
        else:
            assert "model.layers.0.mlp.stray.weight" in line
        assert not out.exists() and not _temps(out)


DOWN = "model.layers.1.mlp.experts.4.down_proj.weight"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_inside_native_code_stops_the_conversion_at_once(tmp_path, sig):
    """Ctrl-C waited for MLX's evaluation to return (one calibration layer of a large model on
    a CPU: minutes), as Python runs handlers only between its own steps. Here the main thread
    sits in one long numpy call with a conversion's temporary store open."""
    out = tmp_path / "s"
    code = (
        "import numpy as np\n"
        "from strata_mlx.apps.cli.convert import exit_on_signals\n"
        "from strata_mlx.format.writer import _make_temp\n"
        "exit_on_signals()\n"
        f"_make_temp(__import__('pathlib').Path({str(out)!r}))\n"
        "print('ready', flush=True)\n"
        "a = np.random.default_rng(0).normal(size=(3000, 3000))\n"
        "for _ in range(20):\n"
        "    np.linalg.svd(a)\n"  # seconds each inside LAPACK
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert p.stdout.readline() == "ready\n"
    assert _temps(out)
    time.sleep(0.5)  # inside the first svd
    t = time.monotonic()
    p.send_signal(sig)
    p.wait(30)
    assert time.monotonic() - t < 2.0
    assert p.returncode == 128 + sig
    err = p.stderr.read()
    assert err.strip() == f"{signal.Signals(sig).name}: stopped; {out} not written", err
    assert not _temps(out) and not out.exists()
