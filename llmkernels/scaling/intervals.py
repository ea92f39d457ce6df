"""How far to trust the fits: bootstrap intervals, the extrapolation check and the quality gate
(numpy + scipy; no torch).

- Bootstrap: runs resampled with replacement within each budget, approaches 1-3 redone on each;
  approach 3 restarts from the full fit and from the resample's best grid points at every E of
  the grid (E > 0), so that a full fit with E at its bound cannot pin every resample there.
- Extrapolation: the fits without the largest budget predict its optimal loss.
- Quality gate: approach 3's residual rms in log L must be at most twice one run's seed-to-seed
  standard deviation (in log L); otherwise the residuals are structure the design put there, not
  noise, and no interval is a result.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from . import fit
from .surface import GRID_KEEP, approach3, predict3

GATE_FACTOR = 2.0
BOOT_GRID_KEEP = 2  # a resample's best grid points overall (its best at each E come on top)


def _a3(runs: list[dict], starts=None, keep: int = GRID_KEEP) -> dict:
    return approach3([r["params"] for r in runs], [r["tokens"] for r in runs], [r["val_loss"] for r in runs], starts,
                     keep)


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


def resample(runs: list[dict], rng) -> list[dict]:
    """Runs drawn with replacement within each budget (each budget keeps its number of runs)."""
    out = []
    for rs in fit.by_budget(runs).values():
        out.extend(rs[i] for i in rng.integers(0, len(rs), len(rs)))
    return out


def bootstrap(runs: list[dict], n: int = 1000, seed: int = 0, approach3_fit: dict | None = None,
              noise_sd: float | None = None) -> dict:
    """Percentile 95% intervals over ``n`` resamples (``resample``) of approach 1's and 2's ``a``, ``b``
    and approach 3's ``E, alpha, beta, a, b`` (see the module docstring for approach 3's starts)."""
    rng = np.random.default_rng(seed)
    samples = defaultdict(list)
    full = [np.asarray(approach3_fit["theta"])] if approach3_fit and approach3_fit.get("ok") else []
    for _ in range(n):
        rs = resample(runs, rng)
        a2 = fit.approach2(rs, noise_sd)
        if a2["budgets_used"] >= 3:
            samples["a2_a"].append(a2["a"])
            samples["a2_b"].append(a2["b"])
        a1 = fit.approach1(rs)
        if a1["a"] is not None:
            samples["a1_a"].append(a1["a"])
            samples["a1_b"].append(a1["b"])
        f = _a3(rs, full, BOOT_GRID_KEEP) if len(rs) >= 5 else {"ok": False}
        if f["ok"] and f.get("a") is not None:
            for k in ("E", "alpha", "beta", "a", "b"):
                samples[f"a3_{k}"].append(f[k])
    return {k: {"lo": float(np.percentile(v, 2.5)), "hi": float(np.percentile(v, 97.5)), "median": float(np.median(v)),
                "samples": len(v)} for k, v in samples.items()} | {"resamples": n}


def quality_gate(runs: list[dict], a3: dict, seed_spread: dict | None) -> dict:
    """Whether approach 3's residual rms (log L) is at most ``GATE_FACTOR`` x one run's seed-to-seed
    standard deviation (log L). ``ok`` None when either is missing; ``reason`` says why in words,
    ``largest``: the five runs (of ``runs``, in the fit's order) with the largest residuals."""
    sd = (seed_spread or {}).get("per_run_sd_log")
    out = {"ok": None, "factor": GATE_FACTOR, "residual_rms": a3.get("residual_rms"), "seed_sd": sd, "largest": []}
    if not a3.get("ok"):
        out["reason"] = "approach 3 did not fit: " + a3.get("warning", "no fit")
        return out
    order = np.argsort(-np.abs(a3["residuals"]))[:5]
    out["largest"] = [{"name": runs[i]["name"], "budget": runs[i]["budget"], "batch": runs[i].get("batch"),
                       "steps": runs[i]["steps"], "residual": a3["residuals"][i]} for i in order]
    if not sd:
        out["reason"] = ("no seed pairs: the seed-to-seed spread is not measured, so the residuals cannot be "
                         "told from noise")
        return out
    out["ratio"] = a3["residual_rms"] / sd
    out["ok"] = bool(out["ratio"] <= GATE_FACTOR)
    worst = ", ".join(f"{r['name']} at {r['budget']:.3g} ({r['residual']:+.3f})" for r in out["largest"][:3])
    out["reason"] = (f"residual rms {a3['residual_rms']:.4f} in log L is {out['ratio']:.1f}x one run's seed-to-seed "
                     f"standard deviation ({sd:.4f}); the gate allows {GATE_FACTOR:g}x"
                     + ("" if out["ok"] else f": the fit's misfit is structure, not noise (largest: {worst})"))
    return out
