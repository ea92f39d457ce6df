"""``llmkernels scaling --compare A B``: two sweeps' exponents side by side (a replicate with another
seed, or another backend or machine), from their reports (no torch, no numpy).

For each approach and each of a and b: both points with their intervals, the difference, the sum of
the two half-widths, whether each point lies inside the other's interval, and whether they agree:
``|a_A - a_B| <= h_A + h_B`` (``h``: the 90% half-widths), the rule the quality gate applies to the
three approaches of one sweep. A or B: an output folder, its ``report.json``, or an ``--archive``.
"""
from __future__ import annotations

import json
import tarfile
from pathlib import Path

from .markdown import bracket, num

KEYS = [(f"a{k}_{x}", k, x) for k in ("1", "2", "3") for x in ("a", "b")]


def load_report(path) -> dict:
    """``report.json`` of an output folder, the file itself, or the one inside an ``--archive``."""
    path = Path(path)
    try:
        if path.is_dir():
            return json.loads((path / "report.json").read_text())
        if tarfile.is_tarfile(path):
            with tarfile.open(path) as tar:
                return json.load(tar.extractfile("report.json"))
        return json.loads(path.read_text())
    except (OSError, KeyError, ValueError) as exc:
        raise ValueError(f"--compare: no readable report.json in {path} ({type(exc).__name__}: {exc})") from None


def _inside(x, iv) -> bool | None:
    if x is None or not iv or iv.get("lo") is None:
        return None
    return iv["lo"] <= x <= iv["hi"]


def compare(rep_a: dict, rep_b: dict) -> dict:
    """Row per exponent (``KEYS``); ``headline``: the rows of each report's quoted approach."""
    rows = []
    for key, approach, x in KEYS:
        side = []
        for rep in (rep_a, rep_b):
            an = rep["analysis"]
            side.append({"point": an["estimates"].get(key), "interval": (an.get("intervals") or {}).get(key)})
        (pa, ia), (pb, ib) = ((s["point"], s["interval"]) for s in side)
        hws = [(iv or {}).get("half_width") for iv in (ia, ib)]
        diff = None if pa is None or pb is None else abs(pa - pb)
        allowed = None if None in hws else hws[0] + hws[1]
        rows.append({"key": key, "approach": approach, "exponent": x, "A": side[0], "B": side[1], "diff": diff,
                     "sum_half_widths": allowed, "agree": None if diff is None or allowed is None else diff <= allowed,
                     "B_in_A": _inside(pb, ia), "A_in_B": _inside(pa, ib)})
    heads = {rep["analysis"]["headline"]["approach"] for rep in (rep_a, rep_b)}
    return {"rows": rows, "headline": [r for r in rows if r["approach"] in heads],
            "gates": [rep["analysis"]["gate"]["ok"] for rep in (rep_a, rep_b)],
            "seeds": [rep["analysis"]["design"]["seeds"] for rep in (rep_a, rep_b)]}


def _word(v) -> str:
    return {True: "yes", False: "**no**", None: "n/a"}[v]


def markdown(cmp: dict, names: tuple[str, str]) -> str:
    a, b = names
    lines = [f"# Two sweeps compared: A = `{a}`, B = `{b}`", "",
             f"Seeds: A {cmp['seeds'][0]}, B {cmp['seeds'][1]}; quality gates: A {cmp['gates'][0]}, B {cmp['gates'][1]}. "
             "Agree: the difference is at most the sum of the two 90% half-widths.", "",
             "| exponent | A | A's interval | B | B's interval | difference | sum of half-widths | agree | B in A's | A in B's |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in cmp["rows"]:
        lines.append(f"| approach {r['approach']}: {r['exponent']} | {num(r['A']['point'])} | {bracket(r['A']['interval'])} "
                     f"| {num(r['B']['point'])} | {bracket(r['B']['interval'])} | {num(r['diff'])} | {num(r['sum_half_widths'])} "
                     f"| {_word(r['agree'])} | {_word(r['B_in_A'])} | {_word(r['A_in_B'])} |")
    head = cmp["headline"]
    verdict = ("agree" if all(r["agree"] for r in head) else
               "do not agree" if any(r["agree"] is False for r in head) else "cannot be compared (no intervals)")
    quoted = ", ".join(f"{r['exponent']} (approach {r['approach']}): {num(r['diff'])} vs {num(r['sum_half_widths'])}"
                       for r in head)
    return "\n".join(lines + ["", f"The quoted exponents {verdict}: {quoted}."]) + "\n"


def main(paths: list[str], out: str | None, log=print) -> int:
    """Print the comparison; with ``out``, also write ``comparison.md`` and ``comparison.json`` there."""
    try:
        reports = [load_report(p) for p in paths]
    except ValueError as exc:
        log(f"llmkernels scaling: {exc}")
        return 1
    try:
        cmp = compare(*reports)
    except KeyError as exc:
        log(f"llmkernels scaling: --compare: a report without {exc} (written before the comparison existed: "
            "refit it with --fit-only)")
        return 1
    text = markdown(cmp, tuple(paths))
    log(text)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "comparison.md").write_text(text)
        (Path(out) / "comparison.json").write_text(json.dumps(cmp, indent=1, default=float))
    return 0
