"""Approach 1 (Hoffmann et al. 2022), the lower envelope of loss over training compute, and the
frontier of the training curves for the figures (numpy; no torch).

Approach 1 compares losses only where a cosine schedule has ended. A point of a training curve
before the end is not the loss of a run that ends there: its schedule has not annealed, and how far
above such a run it lies depends on the size (on real runs, less for larger models:
``synthetic.measured_curves``), so an envelope of curves picks sizes by their schedules' state.
Chinchilla trained each size at four schedule lengths; an IsoFLOP sweep trains a size at the
budgets whose windows hold it, its schedule lengths (``horizons``). Between two of a size's
horizons its loss is interpolated along the data term of ``L(N, D)``, linear in ``D^-beta`` (D ∝ C
at a fixed size), with approach 3's beta of the same runs: linear in log C would overstate a
convex curve between the horizons. At each of the ``ENVELOPE_POINTS`` computes from the smallest
to the largest budget (and at every budget), the sizes with a horizon there or on both sides give
the envelope (at least ``MIN_SIZES``); its optimum is the parabola in log N through the lowest and
up to ``ENVELOPE_HALF_WIDTH`` sizes each side, where it has a minimum inside them, else the lowest
size; ``N_opt ∝ C^a`` and ``D_opt ∝ C^b`` are fitted through the optima.
"""
from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from .fit import parabola_min, power_law

ENVELOPE_POINTS = 250  # computes between the smallest and the largest budget (the budgets come on top)
ENVELOPE_HALF_WIDTH = 3  # the parabola: the lowest size and three each side (as approach 2's)
MIN_SIZES = 3  # a compute where fewer sizes have a loss has no parabola: its optimum is not located


def horizons(runs: list[dict]) -> dict[float, dict]:
    """Per size (total parameters): its finished runs' log budgets, losses (the mean where a size
    ran more than once at a budget, as a bootstrap resample repeats runs) and log tokens, by budget."""
    by = defaultdict(lambda: defaultdict(list))
    names = {}
    for r in runs:
        if r.get("val_loss") is not None:
            by[r["params"]][r["budget"]].append((r["val_loss"], r["tokens"]))
            names[r["params"]] = r["name"]
    out = {}
    for n, budgets in by.items():
        cs = sorted(budgets)
        out[n] = {"name": names[n], "log_c": np.log(cs),
                  "loss": np.array([np.mean([v[0] for v in budgets[c]]) for c in cs]),
                  "log_d": np.log([np.mean([v[1] for v in budgets[c]]) for c in cs])}
    return out


def at(h: dict, lc: float, beta: float) -> tuple[float, float] | None:
    """A size's ``(loss, log tokens)`` at log compute ``lc``: its own where it ran there, between
    two of its horizons interpolated (loss along ``C^-beta``, log tokens in log C), else None."""
    x, tol = h["log_c"], 1e-9
    j = int(np.searchsorted(x, lc - tol))
    if j < x.size and abs(x[j] - lc) <= tol:
        return float(h["loss"][j]), float(h["log_d"][j])
    if j == 0 or j == x.size:
        return None
    u0, u1, u = (math.exp(-beta * v) for v in (x[j - 1], x[j], lc))
    t = (u - u0) / (u1 - u0)
    loss = h["loss"][j - 1] + (h["loss"][j] - h["loss"][j - 1]) * t
    log_d = h["log_d"][j - 1] + (h["log_d"][j] - h["log_d"][j - 1]) * (lc - x[j - 1]) / (x[j] - x[j - 1])
    return float(loss), float(log_d)


def envelope_optima(runs: list[dict], beta: float, points: int = ENVELOPE_POINTS) -> list[dict]:
    """The optimum at each compute of the envelope (see the module docstring): ``compute``,
    ``params``, ``tokens``, the lowest ``size``, ``sizes`` that had a loss there and whether the
    parabola placed the optimum (``smoothed``)."""
    sizes = horizons(runs)
    if not sizes:
        return []
    budgets = np.unique(np.concatenate([h["log_c"] for h in sizes.values()]))
    grid = np.unique(np.concatenate([budgets, np.linspace(budgets[0], budgets[-1], points)]))
    out = []
    for lc in grid:
        here = [(math.log(n), h["name"], v) for n, h in sorted(sizes.items()) if (v := at(h, lc, beta)) is not None]
        if len(here) < MIN_SIZES:
            continue
        k = min(range(len(here)), key=lambda m: here[m][2][0])
        near = here[max(0, k - ENVELOPE_HALF_WIDTH): k + ENVELOPE_HALF_WIDTH + 1]
        ln = [v[0] for v in near]
        par = parabola_min(np.array(ln), [v[2][0] for v in near]) if len(near) >= 3 else {"ok": False}
        smoothed = bool(par["ok"] and par["inside"])
        x = par["x_min"] if smoothed else here[k][0]
        out.append({"compute": float(math.exp(lc)), "params": float(math.exp(x)),
                    "tokens": float(math.exp(np.interp(x, ln, [v[2][1] for v in near]))), "size": here[k][1],
                    "sizes": len(here), "at_budget": bool(np.min(np.abs(budgets - lc)) <= 1e-9), "smoothed": smoothed})
    return out


def approach1(runs: list[dict], beta: float | None, points: int = ENVELOPE_POINTS) -> dict:
    """Approach 1 over the envelope's optima (``envelope_optima``; ``beta``: approach 3's data
    exponent of the same runs): ``N_opt ∝ C^a``, ``D_opt ∝ C^b``. Needs beta and at least three
    distinct sizes lowest somewhere. ``sizes`` / ``several``: the sizes, and those trained at more
    than one budget (the schedule lengths between which the envelope interpolates)."""
    found = horizons(runs)
    out = {"points": 0, "between": 0, "sizes_on_envelope": 0, "smoothed": 0, "sizes": len(found),
           "several": sum(h["log_c"].size > 1 for h in found.values()), "beta": beta,
           "a": None, "b": None, "fit_n": None, "fit_d": None}
    if beta is None or not beta > 0:
        return {**out, "warning": "no data exponent beta from approach 3 to interpolate between schedule lengths"}
    pts = envelope_optima(runs, beta, points)
    lowest = {p["size"] for p in pts}
    out.update(points=len(pts), between=sum(not p["at_budget"] for p in pts), sizes_on_envelope=len(lowest),
               smoothed=sum(p["smoothed"] for p in pts))
    if len(lowest) < 3:
        return {**out, "warning": f"only {len(lowest)} size(s) reach the envelope: approach 1 not identifiable"}
    fit_n = power_law([p["compute"] for p in pts], [p["params"] for p in pts])
    fit_d = power_law([p["compute"] for p in pts], [p["tokens"] for p in pts])
    return {**out, "a": fit_n["exponent"], "b": fit_d["exponent"], "fit_n": fit_n, "fit_d": fit_d}


# --------------------------------------------------------------------------------------------
# the frontier of the training curves (figures only)
# --------------------------------------------------------------------------------------------
def _curves(runs: list[dict]) -> list[tuple]:
    """Each run's held-out curve with its final point: ``(run, log compute, loss, log tokens)``."""
    curves = []
    for r in (r for r in runs if r.get("val_loss") is not None):
        pts = sorted({(c["compute"], c["val_loss"], c["tokens"]) for c in r.get("curve", [])} |
                     {(r["compute"], r["val_loss"], r["tokens"])})
        if len(pts) >= 2:
            curves.append((r, np.log([p[0] for p in pts]), np.array([p[1] for p in pts]),
                           np.log([p[2] for p in pts])))
    return curves


def frontier(runs: list[dict], points: int = 60, between: tuple | None = None) -> list[dict]:
    """Lower envelope of the held-out curves (each with its final point) over training compute:
    at each of ``points`` log-spaced computes (over every curve, or ``between`` two computes), the
    lowest interpolated loss any run reaches there (``size``: which). ``best`` is the running
    minimum over compute, the monotone frontier (a larger budget can always stop early). Mid-schedule
    points included: a picture of training, not approach 1."""
    curves = _curves(runs)
    if not curves:
        return []
    lo, hi = (min(c[1][0] for c in curves), max(c[1][-1] for c in curves)) if between is None else np.log(between)
    grid = np.linspace(lo, hi, points)
    losses = np.full((len(curves), len(grid)), np.inf)
    for i, (_, cs, ls, _) in enumerate(curves):
        inside = (grid >= cs[0]) & (grid <= cs[-1])
        losses[i, inside] = np.interp(grid[inside], cs, ls)
    winner = losses.argmin(0)
    out, best = [], math.inf
    for j, lc in enumerate(grid):
        loss = float(losses[winner[j], j])
        if not math.isfinite(loss):
            continue
        r, cs, _, lt = curves[winner[j]]
        best = min(best, loss)
        out.append({"compute": float(math.exp(lc)), "val_loss": loss, "best": best, "size": r["name"],
                    "params": r["params"], "tokens": float(math.exp(np.interp(lc, cs, lt)))})
    return out
