"""The output folder's small JSON files: read (None when absent or torn), written atomically, and
the learning-rate rule and window centres saved between stages."""
from __future__ import annotations

import json
import os
from pathlib import Path

from .plan import LRRule


def read_json(path: Path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def write_json(path: Path, obj):
    """Write through a temporary file, so that a reader (another rank, a killed run) never sees half."""
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
