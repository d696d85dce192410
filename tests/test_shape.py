"""The floor plan, kept: the layers of strata_mlx import one way only, custom_kernels imports
nothing from strata_mlx, and functions, classes and modules stay short. Each rule lists the
exceptions that remain, with the reason; a new violation fails here, and so does a listed
exception that is gone (so the list only shrinks)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "strata_mlx"
KERNELS = ROOT / "custom_kernels"


def _sources(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in `path`, at any depth (lazy ones too)."""
    module = _module(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            # `from pkg import module` imports pkg.module
            out += [(node.lineno, f"{name}.{a.name}") for a in node.names]
    return out


def test_custom_kernels_import_nothing_from_strata_mlx():
    found = [
        f"{p.relative_to(ROOT)}:{line}: {name}"
        for p in _sources(KERNELS)
        for line, name in _imports(p)
        if name == "strata_mlx" or name.startswith("strata_mlx.")
    ]
    assert not found, "custom_kernels imports strata_mlx:\n" + "\n".join(found)


def test_importing_the_kernels_loads_no_strata_mlx_module():
    code = (
        "import sys, custom_kernels, custom_kernels.formats, custom_kernels.ggml, "
        "custom_kernels.algorithm, custom_kernels.dispatch; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'strata_mlx'))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
