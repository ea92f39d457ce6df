"""Reporting: speedups over the best peer, console and Markdown tables, JSON, PNG plots."""
from __future__ import annotations

import json
import math
import os
from collections import defaultdict

OURS = "llmkernels"
RESULTS_JSON = "results.json"
RESULTS_MD = "results.md"
# A record's status where a provider's backward alone is not timed (its forward forms the
# gradient), and why, as the tables say it once.
NOT_TIMED_ALONE = "in fwd+bwd"
NOT_TIMED_ALONE_WHY = "its forward forms the gradient, so its backward is timed with it (see fwd+bwd)"


def _key(r: dict) -> tuple:
    return (r["kind"], r["op"], r["mode"], r["dtype"], tuple(sorted(r["shape"].items())))


def add_speedups(records: list) -> None:
    """Set ``speedup_vs_best_peer`` and ``best_peer`` on each llmkernels record (and each
    llmkernels_* variant's): the fastest other provider that passed its check, and its time
    over ours (same bytes: the GB/s ratio)."""
    groups = defaultdict(list)
    for r in records:
        groups[_key(r)].append(r)
    for group in groups.values():
        # Providers named llmkernels_* are our own variants (other options), not peers.
        peers = [r for r in group if not r["provider"].startswith(OURS) and r["status"] == "ok" and r["ms"]]
        best = min(peers, key=lambda r: r["ms"], default=None)
        for r in group:
            if r["provider"].startswith(OURS):
                ok = best is not None and r["status"] == "ok" and r["ms"]
                r["best_peer"] = best["provider"] if best else None
                r["speedup_vs_best_peer"] = best["ms"] / r["ms"] if ok else None


def summary(records: list, complete: bool = True) -> str:
    """One line: llmkernels' checks, the timed cells where it is fastest, and its geometric-mean
    speedup over the best peer (cells where a peer was timed too)."""
    ours = [r for r in records if r["provider"] == OURS and r["status"] not in (None, NOT_TIMED_ALONE)]
    passed = sum(r["status"] == "ok" for r in ours)
    peers = [r for r in records if not r["provider"].startswith(OURS) and r["status"] not in (None, NOT_TIMED_ALONE)]
    line = f"summary: llmkernels passed {passed} of {len(ours)} checks"
    if peers:
        line += f" (peers {sum(r['status'] == 'ok' for r in peers)} of {len(peers)})"
    speedups = [r["speedup_vs_best_peer"] for r in ours
                if r["kind"] != "check" and r.get("speedup_vs_best_peer") is not None]
    if speedups:
        fastest = sum(s > 1 for s in speedups)
        mean = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
        line += (f"; fastest in {fastest} of {len(speedups)} timed cells; "
                 f"geometric-mean speedup over the best peer {mean:.2f}x")
    elif any(r["kind"] == "check" for r in ours):
        line += "; nothing timed (no GPU)"
    else:
        line += "; no cell timed beside a peer"
    return line + ("" if complete else " (interrupted: partial run)")


def write_texts(out: str, texts: dict) -> None:
    """``texts`` by file name under the folder ``out``, each replaced whole through a temporary
    file: a run killed mid-write (a call's timeout) leaves the previous file, not half of one."""
    os.makedirs(out, exist_ok=True)
    for file, text in texts.items():
        path = os.path.join(out, file)
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)


def write_json(path: str, meta: dict, records: list, skipped: list) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "skipped": skipped, "records": records}, f, indent=1)
        f.write("\n")


# --------------------------------------------------------------------------------------------
# tables
# --------------------------------------------------------------------------------------------
def _err(r) -> str:
    e = r.get("rel_err")
    return f"{e:.0e}" if isinstance(e, (int, float)) else str(e)


def _cell(r: dict) -> str:
    if r is None:
        return ""
    status = r["status"]
    if status == "failed":
        return f"FAILED (err {_err(r)})"
    if status in ("error", "oom", NOT_TIMED_ALONE):
        return status
    if r["kind"] == "check":
        return f"ok (err {_err(r)})"
    if r["kind"] in ("decode", "decode_graph", "eager"):
        return f"{r['us']:.1f} (err {_err(r)})"
    return f"{r['gbps']:.0f} ({r['pct_copy']:.0f}%, err {_err(r)})"


def _speedup(r) -> str:
    if r is None or r.get("speedup_vs_best_peer") is None:
        return "-"
    return f"{r['speedup_vs_best_peer']:.2f}x vs {r['best_peer']}"


def tables(records: list) -> list:
    """``(title, headers, rows, notes)`` per (op, dtype, kind, mode), in the records' order."""
    groups = defaultdict(list)
    for r in records:
        groups[(r["op"], r["dtype"], r["kind"], r["mode"])].append(r)
    out = []
    for (op, dtype, kind, mode), group in groups.items():
        providers = list(dict.fromkeys(r["provider"] for r in group))
        shapes = sorted({tuple(r["shape"].items()) for r in group}, key=lambda s: [v for _, v in s])
        by = {(tuple(r["shape"].items()), r["provider"]): r for r in group}
        sweep = "M" if kind.startswith("decode") or kind == "eager" else group[0]["axis"]
        unit = {"bandwidth": "GB/s (% of copy, rel err)", "decode": "µs per plain call (rel err)",
                "decode_graph": "µs per call replayed from a CUDA graph (rel err)",
                "eager": "µs per plain call at a training micro-batch (rel err)",
                "check": "float64 check (rel err)"}[kind]
        copies = sorted({round(r["copy_gbps"]) for r in group if r.get("copy_gbps")})
        title = f"{op} {mode} {dtype}" + {"decode": " decode", "decode_graph": " decode", "eager": " eager"}.get(
            kind, "") + f" — {unit}"
        if copies:
            title += f"; copy {'/'.join(map(str, copies))} GB/s"
        headers = ["shape" if kind == "check" else sweep] + providers
        has_speedup = kind != "check" and OURS in providers and len(providers) > 1
        if has_speedup:
            headers.append(f"{OURS} vs best peer")
        rows = []
        for shape in shapes:
            d = dict(shape)
            first = " ".join(f"{k}={v}" for k, v in shape) if kind == "check" else str(d[sweep])
            row = [first] + [_cell(by.get((shape, p))) for p in providers]
            if has_speedup:
                row.append(_speedup(by.get((shape, OURS))))
            rows.append(row)
        notes = [f"{r['provider']} at {' '.join(f'{k}={v}' for k, v in r['shape'].items())}: {r['note']}"
                 for r in group if r.get("note")]
        alone = list(dict.fromkeys(r["provider"] for r in group if r["status"] == NOT_TIMED_ALONE))
        if alone:
            notes.append(f"{', '.join(alone)}: {NOT_TIMED_ALONE_WHY}")
        out.append((title, headers, rows, notes))
    return out


def console(records: list) -> str:
    lines = []
    for title, headers, rows, notes in tables(records):
        widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
        lines += ["", title, "  ".join(h.ljust(w) for h, w in zip(headers, widths)),
                  "  ".join("-" * w for w in widths)]
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
        lines += [f"  note: {n}" for n in notes]
    return "\n".join(lines)


def markdown(meta: dict, records: list, skipped: list, method: str) -> str:
    versions = ", ".join(f"{k} {meta[k]}" for k in ("torch", "triton", "cuda", "llmkernels", "liger_kernel",
                                                   "quack_kernels") if meta.get(k))
    lines = [f"# llmkernels benchmark — {meta['device']}, {meta['date']}", "", versions, "",
             f"Command: `{meta['command']}`", "", method, ""]
    if skipped:
        lines += ["Skipped providers:", ""] + [f"- {s['provider']} ({s['op']}): {s['reason']}" for s in skipped] + [""]
    for title, headers, rows, notes in tables(records):
        lines += [f"## {title}", "", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        lines += [""] + [f"- {n}" for n in notes] + ([""] if notes else [])
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# plots
# --------------------------------------------------------------------------------------------
def _pyplot():
    """matplotlib's pyplot on the file-only backend (raises ImportError without matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(plt, fig, ax, path: str) -> str:
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(records: list, out_dir: str) -> list:
    """One PNG per (op, mode, dtype): GB/s against the swept size, one line per provider, the
    copy ceiling as a horizontal line. Returns the paths written; raises ImportError without
    matplotlib."""
    plt = _pyplot()
    groups = defaultdict(list)
    for r in records:
        if r["kind"] == "bandwidth":
            groups[(r["op"], r["mode"], r["dtype"])].append(r)
    paths = []
    for (op, mode, dtype), group in groups.items():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for provider in dict.fromkeys(r["provider"] for r in group):
            pts = sorted((r["size"], r["gbps"]) for r in group if r["provider"] == provider and r["status"] == "ok")
            if pts:
                ax.plot(*zip(*pts), marker="o", label=provider, linewidth=2.5 if provider == OURS else 1.5)
        copies = [r["copy_gbps"] for r in group if r.get("copy_gbps")]
        if copies:
            copy = sorted(copies)[len(copies) // 2]
            ax.axhline(copy, color="black", linestyle="--", linewidth=1, label=f"copy {copy:.0f} GB/s")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(group[0]["axis"])
        ax.set_ylabel("GB/s (minimum bytes)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{op} {mode} {dtype} — {group[0]['device']}")
        paths.append(_save(plt, fig, ax, os.path.join(out_dir, f"{op}-{mode.replace('+', '')}-{dtype}.png")))
    return paths


def plot_checks(records: list, out_dir: str) -> list:
    """The float64 check of a run without timings: one PNG per dtype, each provider's worst
    relative error (over shapes and modes) per op on a log scale, the dtype's tolerance as a
    horizontal line. Returns the paths written; raises ImportError without matplotlib."""
    plt = _pyplot()
    groups = defaultdict(list)
    for r in records:
        if isinstance(r.get("rel_err"), (int, float)):
            groups[r["dtype"]].append(r)
    paths = []
    for dtype, group in groups.items():
        op_names = list(dict.fromkeys(r["op"] for r in group))
        fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(op_names)), 4.5))
        for provider in dict.fromkeys(r["provider"] for r in group):
            worst = {}
            for r in group:
                if r["provider"] == provider:
                    worst[r["op"]] = max(worst.get(r["op"], 0.0), r["rel_err"])
            ax.scatter([op_names.index(o) for o in worst], [max(e, 1e-12) for e in worst.values()], label=provider,
                       marker="o" if provider == OURS else "x", s=60 if provider == OURS else 30, zorder=3)
        tol = group[0]["tol"]
        ax.axhline(tol, color="black", linestyle="--", linewidth=1, label=f"tolerance {tol:.0e}")
        ax.set_xticks(range(len(op_names)), op_names, rotation=30, ha="right")
        ax.set_yscale("log")
        ax.set_ylabel("worst ||out - ref|| / ||ref|| (float64 reference)")
        ax.set_title(f"float64 check, {dtype} — {group[0]['device']}")
        paths.append(_save(plt, fig, ax, os.path.join(out_dir, f"check-{dtype}.png")))
    return paths

