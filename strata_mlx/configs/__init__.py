"""Shipped settings: runtime presets (runtime/NAME.json) and model shapes (models/NAME.json).

Package data, read through importlib.resources, so that an installed wheel has them as a
source checkout does (the checkout's top-level `configs/` is a link to this folder). Owns
finding and parsing these files; never decides what a setting means (loader.apply_preset,
convert.synthetic do).
"""

from __future__ import annotations

import json
from importlib import resources
from importlib.abc import Traversable

from ..format.store import StoreError

KINDS = {"runtime": "preset", "models": "synthetic shape"}


def _folder(kind: str) -> Traversable:
    if kind not in KINDS:
        raise ValueError(f"no config kind {kind!r} (one of {', '.join(KINDS)})")
    return resources.files(__package__) / kind


def names(kind: str) -> list[str]:
    """The NAMEs of configs/KIND/NAME.json, sorted."""
    return sorted(
        p.name[: -len(".json")] for p in _folder(kind).iterdir() if p.name.endswith(".json")
    )


def read(kind: str, name: str) -> dict:
    """configs/KIND/NAME.json as a dict, or a StoreError naming the file and the known names."""
    path = _folder(kind) / f"{name}.json"
    if name not in names(kind) or not path.is_file():  # (no path: "../runtime/x" is no NAME)
        raise StoreError(f"{path}: no such {KINDS[kind]} (known: {', '.join(names(kind))})")
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise StoreError(f"{path}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise StoreError(f"{path}: expected a JSON object")
    return data


def path(kind: str, name: str) -> str:
    """Where configs/KIND/NAME.json is (for messages)."""
    return str(_folder(kind) / f"{name}.json")
