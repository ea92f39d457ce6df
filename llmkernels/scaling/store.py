"""The output folder's small JSON files: read (None when absent or torn), written atomically, the
learning-rate rule and window centres saved between stages, and the whole folder's small files
packed into one archive and restored from it (a sweep cut into calls on machines that keep nothing),
or from the report.json a sweep wrote (its runs, rule, window centres and data record: what a committed
report keeps when the archive is gone)."""
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


def unpack_report(report: Path, out: Path) -> int:
    """Write the runs, learning-rate rule, window centres and data record of ``report`` (a sweep's
    report.json) into ``out`` as the sweep itself saves them, so that a sweep whose archive is lost
    resumes or grows from its committed report: a run is read back where its key (rebuilt here)
    matches the plan's. Returns the number of runs written."""
    saved = read_json(report)
    if not saved or "runs" not in saved or "data" not in saved:
        raise ValueError(f"--restore: {report} is not a report.json of llmkernels scaling")
    out, fingerprint = Path(out), saved["data"]["fingerprint"]
    (out / "runs").mkdir(parents=True, exist_ok=True)
    (out / "data" / fingerprint).mkdir(parents=True, exist_ok=True)
    write_json(out / "data" / fingerprint / "meta.json", saved["data"])
    # (a diverged run's record names no dtype: the sweep's, which every run shares)
    dtype = next((run["dtype"] for run in saved["runs"] if run.get("dtype")), None)
    for run in saved["runs"]:
        key = {"run": run["id"], "model": run["model"], "train": run["train"], "backend": run["backend"],
               "dtype": run.get("dtype") or dtype, "data": fingerprint}
        write_json(out / "runs" / f"{run['id']}.json", {**run, "key": key, "history": []})
    rule = saved["analysis"].get("lr_rule")
    if rule and rule.get("runs"):
        write_json(out / "lr_rule.json", {k: v for k, v in rule.items() if k != "source"})
    if saved.get("centres"):
        write_json(out / "centres.json", saved["centres"])
    return len(saved["runs"])


def restore(source: str, out: Path) -> str:
    """``--restore``: ``source`` (an archive of ``pack`` or a sweep's report.json) into ``out``; the
    line that says what came back."""
    path = Path(source)
    if not path.is_file():
        return f"--restore: no archive at {source}: starting from what {out} holds"
    if path.suffix == ".json":
        return f"restored {unpack_report(path, out)} runs from {source} into {out}"
    return f"restored {unpack(path, out)} files from {source} into {out}"
