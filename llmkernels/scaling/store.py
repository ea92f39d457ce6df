"""The output folder's small JSON files: read (None when absent or torn), written atomically, the
learning-rate rule and window centres saved between stages, and the whole folder's small files
packed into one archive and restored from it (a sweep cut into calls on machines that keep nothing)."""
from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path

from .plan import LRRule


def read_json(path: Path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def write_json(path: Path, obj):
    """Write through a temporary file, so that a reader (another process, a killed run) never sees half."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1, default=float))
    os.replace(tmp, path)


def read_rule(out: Path) -> LRRule | None:
    """The rule fitted by an earlier (or this) invocation's learning-rate sweep, None before it."""
    saved = read_json(Path(out) / "lr_rule.json")
    if not saved or not saved.get("ok"):
        return None
    return LRRule(c=saved["c"], gamma=saved["gamma"] if saved["gamma"] is not None else LRRule().gamma,
                  kappa=saved["kappa"], source=f"fitted from {len(saved['groups'])} learning-rate sweep groups")


def read_centres(out: Path) -> dict | None:
    """``{budget: N}`` the upper budgets' windows were centred on, None before the lower budgets' fit."""
    saved = read_json(Path(out) / "centres.json")
    return None if not saved or not saved.get("centres") else {float(c): n for c, n in saved["centres"].items()}


def read_spans(out: Path) -> dict:
    """``{budget: span}`` of the upper budgets' windows (empty: the design's span)."""
    saved = read_json(Path(out) / "centres.json") or {}
    return {float(c): s for c, s in (saved.get("spans") or {}).items()}


def packed(out: Path) -> list[Path]:
    """The files of ``out`` that a resumed sweep needs or reports: everything but the token arrays
    (rebuilt identically from the sources in about half a minute), checkpoints (up to hundreds of MB;
    a cut run restarts) and claims (one invocation's)."""
    out = Path(out)
    keep = []
    for path in sorted(out.rglob("*")):
        rel = path.relative_to(out)
        if (path.is_file() and rel.parts[0] not in ("checkpoints", "claims") and ".tmp" not in path.name
                and (rel.parts[0] != "data" or path.name == "meta.json")):
            keep.append(path)
    return keep


def pack(out: Path, archive: Path) -> int:
    """Write ``packed(out)`` to the gzipped tar ``archive`` (atomically); returns the number of files."""
    files = packed(out)
    archive = Path(archive)
    archive.parent.mkdir(parents=True, exist_ok=True)
    tmp = archive.with_name(f"{archive.name}.tmp{os.getpid()}")
    with tarfile.open(tmp, "w:gz") as tar:
        for path in files:
            tar.add(path, arcname=str(path.relative_to(out)))
    os.replace(tmp, archive)
    return len(files)


def unpack(archive: Path, out: Path) -> int:
    """Extract ``pack``'s archive into ``out`` (plain files inside it only); returns the number of files."""
    with tarfile.open(archive, "r:gz") as tar:
        members = [m for m in tar.getmembers() if m.isfile()]
        tar.extractall(out, members=members, filter="data")
    return len(members)
