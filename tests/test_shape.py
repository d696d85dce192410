"""The floor plan, kept: the layers of strata_mlx import one way only, custom_kernels imports
nothing from strata_mlx, and functions, classes and modules stay short. Each rule lists the
exceptions that remain, with the reason; a new violation fails here, and so does a listed
exception that is gone (so the list only shrinks)."""

from __future__ import annotations

import ast
import re
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


# ---- the layers ------------------------------------------------------------------------------
# strata_mlx/<layer>/ may import the layers before it in this order, never one after it.
LAYERS = ("format", "stream", "models", "runtime", "generation", "convert", "apps")
# Top-level modules every layer may import: option checks and OptionError, the presets, the
# native reader, the progress line. They may import format/ (StoreError), nothing above it.
SHARED = ("strata_mlx.config", "strata_mlx.configs", "strata_mlx._reader", "strata_mlx.progress")

# (importing module, imported module) pairs against the order that remain, and why.
LAYER_EXCEPTIONS: dict[tuple[str, str], str] = {}
# config.py is below every layer: the choice lists it checks against travel in the options'
# declarations, so it imports none of them.
SHARED_EXCEPTIONS: set[tuple[str, str]] = set()


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in LAYERS else None


def _target(name: str) -> str:
    """The strata_mlx module an import names (`from pkg import name` may name a function)."""
    parts = name.split(".")
    while parts:
        path = ROOT.joinpath(*parts)
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return ".".join(parts)
        parts.pop()
    return name


def _strata_imports() -> set[tuple[str, str]]:
    out = set()
    for p in _sources(PACKAGE):
        for _, name in _imports(p):
            if name.split(".")[0] == "strata_mlx":
                out.add((_module(p), _target(name)))
    return out


def test_layers_import_one_way():
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    found = set()
    for src, dst in _strata_imports():
        a, b = _layer(src), _layer(dst)
        if a is not None and b is not None and rank[b] > rank[a]:
            found.add((src, dst))
        elif a is not None and b is None and dst not in SHARED and dst != "strata_mlx":
            found.add((src, dst))  # a layer importing a top-level module other than SHARED
        elif src in SHARED and b is not None and b != "format":
            found.add((src, dst))
    expected = set(LAYER_EXCEPTIONS) | SHARED_EXCEPTIONS
    new = sorted(found - expected)
    gone = sorted(expected - found)
    assert not new, "imports against the layer order:\n" + "\n".join(f"{a} -> {b}" for a, b in new)
    assert not gone, "listed exceptions that are gone (drop them):\n" + "\n".join(map(str, gone))


def test_no_private_names_across_modules():
    """No module of strata_mlx imports another's `_name`: a name another module needs is
    public (the native extensions `_reader`, `_cpu_experts` and `_nextuse` are modules, not
    private names)."""
    found = []
    for p in _sources(PACKAGE):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [a.name for a in node.names if a.name.startswith("_")]
                names = [
                    n
                    for n in names
                    if n not in ("_reader", "_cpu_experts", "_nextuse", "__version__")
                ]
                if names:
                    found.append(f"{_module(p)}:{node.lineno}: {', '.join(names)}")
    assert not found, "\n".join(found)


def test_no_private_methods_called_across_objects():
    """No module calls `x._name(...)` on an object other than self: what another object
    needs is public (os._exit is the standard library's way out of a stuck process)."""
    found = []
    for p in _sources(PACKAGE):
        for node in ast.walk(ast.parse(p.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            name, owner = node.func.attr, node.func.value
            if not name.startswith("_") or name.startswith("__"):
                continue
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls", "os"):
                continue
            found.append(f"{_module(p)}:{node.lineno}: {ast.unparse(node.func)}")
    assert not found, "\n".join(found)


# ---- no runtime read back off a model ------------------------------------------------------

EXPERT_CACHE_GETATTR = re.compile(r"getattr\(\s*\w+(?:\.\w+)*\s*,\s*[\"']expert_cache[\"']")


def test_no_getattr_expert_cache():
    """load() returns a StrataModel whose expert cache is always there: nothing asks."""
    found = {}
    for p in _sources(PACKAGE):
        n = len(EXPERT_CACHE_GETATTR.findall(p.read_text()))
        if n:
            found[str(p.relative_to(ROOT))] = n
    assert not found, f"getattr(model, 'expert_cache') per file: {found}"


# ---- no attribute set on a model, its modules or its runtime from outside ----------------------
# `x.attr = ...` (or +=, or a tuple target) in strata_mlx where x is not self: flagged when
# x is a model or one of its modules by the names the code gives them, or when attr is one of
# the runtime's hooks. Objects a function builds and fills itself (stats, rows, steps) go by
# other names and are not this rule's business.
MODULE_NAMES = {"model", "module", "inner", "block", "blocks", "layer", "layers", "mlp", "m"}
MODULE_NAMES |= {"switch_mlp", "attn", "embed_tokens", "norm", "lm_head"}
HOOKS = {"expert_cache", "decoder", "runtime", "store_path", "pipeline", "moe_blocks", "top_k"}
HOOKS |= {"dump", "trace", "route_bonus", "gather"}
# (file, target) left, and why.
SETATTR_EXCEPTIONS = {
    # A pipeline stage swaps the layers, embedding and norm another rank computes for
    # weightless stand-ins before the weights load; the families build every layer.
    ("strata_mlx/runtime/distributed.py", "inner.embed_tokens"): "stage stand-ins",
    ("strata_mlx/runtime/distributed.py", "inner.norm"): "stage stand-ins",
    # A synthetic store's generator writes its random dense weights into a built model.
    ("strata_mlx/convert/synthetic.py", "model.model.embed_tokens.weight"): "synthetic weights",
    ("strata_mlx/convert/synthetic.py", "attn.o_proj.weight"): "synthetic weights",
    ("strata_mlx/convert/synthetic.py", "blocks[layer].gate.weight"): "synthetic weights",
    # The tokenizers library's Tokenizer, built in that function: its decoder is its setting.
    ("strata_mlx/convert/gguf/tokenizer.py", "tok.decoder"): "a tokenizers.Tokenizer",
}


def _root(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _attribute_targets(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and isinstance(t.ctx, ast.Store):
                    yield t


def test_no_attribute_set_on_a_model_from_outside():
    found = set()
    for p in _sources(PACKAGE):
        for t in _attribute_targets(ast.parse(p.read_text())):
            root = _root(t.value)
            if root in ("self", "cls"):
                continue
            if root in MODULE_NAMES or t.attr in HOOKS:
                found.add((str(p.relative_to(ROOT)), ast.unparse(t)))
    new = sorted(found - set(SETATTR_EXCEPTIONS))
    gone = sorted(set(SETATTR_EXCEPTIONS) - found)
    assert not new, "attributes set from outside the object:\n" + "\n".join(map(str, new))
    assert not gone, "listed exceptions that are gone (drop them):\n" + "\n".join(map(str, gone))


# ---- sizes -----------------------------------------------------------------------------------

MAX_FUNCTION, MAX_CLASS, MAX_MODULE = 80, 300, 700
# Longer than that today, and why they stay for now. A function counts the lines of its body
# after the docstring (a typer command's flag declarations are its signature).
SIZE_EXCEPTIONS = {}


def _body_lines(node: ast.AST) -> int:
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return node.end_lineno - body[0].lineno + 1 if body else 0


def _oversized() -> dict[str, int]:
    out = {}
    for p in [*_sources(PACKAGE), *_sources(KERNELS)]:
        text = p.read_text()
        where = str(p.relative_to(ROOT))
        if len(text.splitlines()) > MAX_MODULE:
            out[where] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if _body_lines(node) > MAX_FUNCTION:
                    out[f"{where}::{node.name}"] = _body_lines(node)
            elif isinstance(node, ast.ClassDef):
                if node.end_lineno - node.lineno + 1 > MAX_CLASS:
                    out[f"{where}::{node.name}"] = node.end_lineno - node.lineno + 1
    return out


def test_functions_classes_and_modules_stay_short():
    found = _oversized()
    new = sorted(set(found) - set(SIZE_EXCEPTIONS))
    gone = sorted(set(SIZE_EXCEPTIONS) - set(found))
    assert not new, "over the size limits:\n" + "\n".join(f"{n} ({found[n]} lines)" for n in new)
    assert not gone, "listed exceptions that are within the limits now (drop them): " + str(gone)
