"""How far to trust the fits: one estimator for every quoted number, its bootstrap interval and the
extrapolation check (numpy + scipy; no torch).

- Estimator: ``fit_all`` runs approaches 1-3 over a set of runs (approach 1 with approach 3's
  beta) and ``estimates`` reads the quoted numbers off them (approaches 1-3's ``a`` and ``b``;
  approach 3's ``E``, ``alpha``, ``beta``), with the rules that decide whether a number exists
  (approach 2 needs ``MIN_BUDGETS`` budgets with a minimum inside their sizes). The point estimate is ``estimates(fit_all(runs))``; each
  bootstrap sample is the same function of a resample (runs drawn with replacement within each
  budget), fitted in parallel processes.
- Interval (``LEVEL``, 90%): the bootstrap samples' spread about their median, placed at the point,
  ``[point - (median - q_lo), point + (q_hi - median)]``. It keeps the samples' width and skew and
  holds the point by construction (``q_lo <= median <= q_hi``). ``bias`` (median minus point) and
  the resamples on which the number did not exist are reported; the quality gate (``gate``)
  rejects an estimator whose bias exceeds its half-width or that fails on many resamples, the
  cases where a plain percentile interval would miss its own point.
- Approach 3 on a resample starts from the full fit's optimum and from the resample's best grid
  points at every E of the grid (E > 0), so that a full fit with E at its bound cannot pin every
  resample there.
- Extrapolation: the fits without the largest budget predict its optimal loss.
"""
from __future__ import annotations

import math
import multiprocessing as mp
import os
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from . import envelope, fit
from .surface import GRID_KEEP, approach3, predict3

LEVEL = 0.90
MIN_BUDGETS = 3  # approach 2's exponents need this many budgets with a minimum inside their sizes
BOOT_GRID_KEEP = 2  # a resample's best grid points overall (its best at each E come on top)
RESAMPLES_PER_PROCESS = 25  # below this a spawned process (a few seconds to start) does not pay
EXPONENTS = ("a1_a", "a1_b", "a2_a", "a2_b", "a3_a", "a3_b")
# where a quantity can lie: an interval is clipped to it (the point always lies inside)
RANGES = {"a3_a": (0.0, 1.0), "a3_b": (0.0, 1.0), "a3_E": (0.0, math.inf), "a3_alpha": (0.0, math.inf),
          "a3_beta": (0.0, math.inf)}


def _a3(runs: list[dict], starts=None, keep: int = GRID_KEEP) -> dict:
    return approach3([r["params"] for r in runs], [r["tokens"] for r in runs], [r["val_loss"] for r in runs], starts,
                     keep)


def fit_all(runs: list[dict], noise_sd: float | None = None, starts=None, keep: int = GRID_KEEP) -> dict:
    """Approaches 1, 2 and 3 over ``runs`` (approach 2's minima with ``noise_sd`` as their scatter
    floor; approach 1 interpolating between schedule lengths with approach 3's beta)."""
    a3 = _a3(runs, starts, keep) if len(runs) >= 5 else {"ok": False, "warning": f"{len(runs)} runs"}
    return {"approach1": envelope.approach1(runs, a3.get("beta") if a3.get("ok") else None),
            "approach2": fit.approach2(runs, noise_sd), "approach3": a3}


def estimates(fits: dict) -> dict:
    """The quoted numbers of ``fit_all``'s fits, None where the estimator gives none."""
    a1, a2, a3 = fits["approach1"], fits["approach2"], fits["approach3"]
    enough = a2["budgets_used"] >= MIN_BUDGETS
    out = {"a1_a": a1.get("a"), "a1_b": a1.get("b"), "a2_a": a2["a"] if enough else None,
           "a2_b": a2["b"] if enough else None}
    ok3 = bool(a3.get("ok")) and a3.get("a") is not None
    out.update({f"a3_{k}": a3[k] if ok3 else None for k in ("a", "b", "E", "alpha", "beta")})
    return out


def resample(runs: list[dict], rng) -> list[int]:
    """Indices of ``runs`` drawn with replacement within each budget (each budget keeps its number of runs)."""
    index = {id(r): i for i, r in enumerate(runs)}
    out = []
    for rs in fit.by_budget(runs).values():
        out.extend(index[id(rs[i])] for i in rng.integers(0, len(rs), len(rs)))
    return out


def _estimate_resamples(runs: list[dict], draws: list[list[int]], noise_sd, starts) -> list[dict]:
    return [estimates(fit_all([runs[i] for i in d], noise_sd, starts, BOOT_GRID_KEEP)) for d in draws]


def _processes(n: int) -> int:
    """Processes for ``n`` resamples: one per CPU, each with at least ``RESAMPLES_PER_PROCESS``."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cpus, n // RESAMPLES_PER_PROCESS))


def interval(point: float, samples, resamples: int, bounds=(-math.inf, math.inf), level: float = LEVEL) -> dict:
    """``point`` with the ``level`` interval of its bootstrap ``samples`` (see the module docstring)."""
    out = {"point": point, "lo": None, "hi": None, "half_width": None, "median": None, "bias": None,
           "samples": len(samples), "failed": resamples - len(samples), "level": level}
    if len(samples) < 2:
        return out
    q_lo, median, q_hi = (float(v) for v in np.quantile(samples, [(1 - level) / 2, 0.5, (1 + level) / 2]))
    lo = max(bounds[0], point - (median - q_lo))
    hi = min(bounds[1], point + (q_hi - median))
    return {**out, "lo": lo, "hi": hi, "half_width": (hi - lo) / 2, "median": median, "bias": median - point}


def bootstrap(runs: list[dict], point_fits: dict, n: int = 1000, seed: int = 0, noise_sd: float | None = None,
              processes: int | None = None) -> dict:
    """Every number of ``estimates(point_fits)`` with its interval over ``n`` resamples of ``runs``
    (``point_fits``: ``fit_all(runs, noise_sd)``): ``{key: interval(...)}``, ``resamples`` and
    ``level``. The resamples are drawn here and fitted in ``processes`` processes (default: one per
    CPU, each with at least ``RESAMPLES_PER_PROCESS``): the result does not depend on how many."""
    rng = np.random.default_rng(seed)
    draws = [resample(runs, rng) for _ in range(n)]
    a3 = point_fits["approach3"]
    starts = [np.asarray(a3["theta"])] if a3.get("ok") else []
    processes = _processes(n) if processes is None else max(1, min(processes, n))
    if processes == 1:
        fitted = _estimate_resamples(runs, draws, noise_sd, starts)
    else:
        chunks = [draws[i::processes] for i in range(processes)]
        with ProcessPoolExecutor(processes, mp_context=mp.get_context("spawn")) as pool:
            parts = list(pool.map(_estimate_resamples, *zip(*[(runs, c, noise_sd, starts) for c in chunks])))
        fitted = [parts[i % processes][i // processes] for i in range(n)]  # back in the order drawn
    samples = defaultdict(list)
    for est in fitted:
        for k, v in est.items():
            if v is not None:
                samples[k].append(v)
    point = estimates(point_fits)
    out = {k: interval(v, samples[k], n, RANGES.get(k, (-math.inf, math.inf))) for k, v in point.items() if v is not None}
    return {**out, "resamples": n, "level": LEVEL}


def extrapolation(runs: list[dict], starts=None) -> dict:
    """Fit without the largest budget; predict that budget's optimal loss (the minimum of its
    parabola, ``fit.budget_optima``) by approach 3 (the same through the predicted losses of its
    runs) and by the ``L_opt(C)`` law; report the errors (predicted - measured, nats/token)."""
    groups = fit.by_budget(runs)
    if len(groups) < 4:
        return {"ok": False, "warning": f"needs >= 4 budgets, got {len(groups)}"}
    top = max(groups)
    rest = [r for c, rs in groups.items() if c != top for r in rs]
    top_runs = groups[top]
    measured = fit.budget_optima(top_runs)[0]
    out = {"ok": measured["ok"], "budget": top, "measured": measured["y_min"]}
    f3 = _a3(rest, starts)
    if f3["ok"]:
        pred = predict3(f3, [r["params"] for r in top_runs], [r["tokens"] for r in top_runs])
        p3 = fit.budget_optima([{**r, "val_loss": float(v)} for r, v in zip(top_runs, pred)])[0]
        out["approach3"] = p3["y_min"]
        out["approach3_error"] = None if not (p3["ok"] and measured["ok"]) else p3["y_min"] - measured["y_min"]
        out["approach3_fit"] = {k: f3[k] for k in ("E", "A", "B", "alpha", "beta", "a", "b")}
    a2 = fit.approach2(rest)
    law = fit.optimal_loss_law(a2["optima"])
    if law["ok"] and measured["ok"]:
        out["loss_law"] = law["E"] + law["A"] * top ** -law["gamma"]
        out["loss_law_error"] = out["loss_law"] - measured["y_min"]
    if a2["fit_n"]["ok"]:
        out["n_opt_predicted"] = a2["fit_n"]["coef"] * top ** a2["fit_n"]["exponent"]
        out["n_opt_measured"] = measured["n_opt"]
    return out
