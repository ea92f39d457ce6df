"""The fits of a compute-optimal sweep (numpy + scipy; no torch).

- Approach 1 (Hoffmann et al. 2022): the lower envelope of every run's held-out loss over
  training compute; at each compute the size that reaches it, fitted as ``N_opt ∝ C^a``.
- Approach 2: at each budget a parabola of loss in ``log N`` through the sizes around the lowest
  loss; its minimum gives ``N_opt(C)`` and
  ``D_opt(C)``, fitted as power laws ``C^a`` and ``C^b``.
- Approach 3: ``L(N, D) = E + A/N^alpha + B/D^beta``, Huber loss (delta 1e-3) on ``log L``, L-BFGS
  from a grid of starting points (Hoffmann et al.; Besiroglu et al. 2024), with the implied
  ``a = beta/(alpha+beta)`` and ``b = alpha/(alpha+beta)``.
- Bootstrap intervals: runs resampled with replacement within each budget, every fit redone.
- Extrapolation: the fits without the largest budget predict its optimal loss.
- The learning-rate rule from the learning-rate sweep.

A fit with no more points than parameters reports ``warning`` and no ``r2`` (it would be 1 by
construction).
"""
from __future__ import annotations

import math
import os
import sys
import warnings
from collections import defaultdict

import numpy as np

# L-BFGS on five parameters makes tiny BLAS calls, where OpenBLAS's threads only spin against each
# other (3.5 ms a call on a busy 2-core machine, 0.1 ms on one thread). Read when scipy loads it.
if "scipy" not in sys.modules:
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

HUBER_DELTA = 1e-3
# A budget's parabola goes through the lowest loss and two sizes each side of it: across a 16x
# window the loss is not parabolic in log N (a 4x-too-large model stops far from converged and
# its loss shoots up, which would drag a parabola over every size away from the minimum).
PARABOLA_HALF_WIDTH = 2
# Approach 3's starting grid (Hoffmann et al.'s): exponents, log E, log A, log B. L-BFGS runs from
# the GRID_KEEP points of lowest objective (the rest start where those do, or worse).
GRID = {"alpha": (0.0, 0.5, 1.0, 1.5, 2.0), "beta": (0.0, 0.5, 1.0, 1.5, 2.0), "e": (-1.0, -0.5, 0.0, 0.5, 1.0),
        "a": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0), "b": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0)}
GRID_KEEP = 16


def _fit_quality(y, pred, n_params: int) -> dict:
    n = int(np.size(y))
    dof = n - n_params
    out = {"n_points": n, "n_params": n_params, "dof": dof, "r2": None, "warning": None}
    if dof < 1:
        out["warning"] = (f"exactly determined ({n} points, {n_params} parameters): no goodness of fit"
                          if dof == 0 else f"underdetermined ({n} points, {n_params} parameters)")
        return out
    y, pred = np.asarray(y, float), np.asarray(pred, float)
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    out["r2"] = 1.0 - float(np.sum((y - pred) ** 2)) / ss_tot if ss_tot > 0 else None
    return out


def power_law(x, y) -> dict:
    """``y = k·x^p`` by least squares in log-log: ``{"exponent", "coef", ...quality}``."""
    lx, ly = np.log(np.asarray(x, float)), np.log(np.asarray(y, float))
    if lx.size < 2 or np.ptp(lx) == 0:
        return {"ok": False, "exponent": None, "coef": None, **_fit_quality(ly, ly, 2)}
    p, k = np.polyfit(lx, ly, 1)
    return {"ok": True, "exponent": float(p), "coef": float(math.exp(k)), **_fit_quality(ly, p * lx + k, 2)}


def parabola_min(x, y) -> dict:
    """Minimum of ``y = c2·x² + c1·x + c0``: ``{"ok", "x_min", "y_min", "coefs", "inside"}``. ``ok`` is
    False without curvature (c2 <= 0) or with fewer than 3 distinct x; ``inside`` says whether the
    minimum lies within the sampled x."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if np.unique(x).size < 3:
        return {"ok": False, "x_min": None, "y_min": None, "coefs": None, "inside": False, **_fit_quality(y, y, 3)}
    c2, c1, c0 = np.polyfit(x, y, 2)
    quality = _fit_quality(y, np.polyval([c2, c1, c0], x), 3)
    if c2 <= 0:
        return {"ok": False, "x_min": None, "y_min": None, "coefs": [c2, c1, c0], "inside": False, **quality}
    xm = -c1 / (2 * c2)
    return {"ok": True, "x_min": float(xm), "y_min": float(np.polyval([c2, c1, c0], xm)), "coefs": [c2, c1, c0],
            "inside": bool(x.min() <= xm <= x.max()), **quality}


def by_budget(runs: list[dict]) -> dict[float, list[dict]]:
    groups = defaultdict(list)
    for r in runs:
        groups[r["budget"]].append(r)
    return {c: sorted(rs, key=lambda r: r["params"]) for c, rs in sorted(groups.items())}


# --------------------------------------------------------------------------------------------
# approach 2
# --------------------------------------------------------------------------------------------
def near_minimum(rs: list[dict], half: int = PARABOLA_HALF_WIDTH) -> list[dict]:
    """The run of lowest loss and up to ``half`` sizes on each side of it (runs sorted by size)."""
    i = min(range(len(rs)), key=lambda j: rs[j]["val_loss"])
    return rs[max(0, i - half): i + half + 1]


def budget_optima(runs: list[dict]) -> list[dict]:
    """Per budget: the parabola of loss in log N (total parameters) through the sizes around the
    lowest loss (``near_minimum``) and its minimum, with D_opt read off the budget's runs (log D
    linear in log N) and N_opt counted without the embedding as well."""
    out = []
    for c, all_rs in by_budget(runs).items():
        rs = near_minimum(all_rs)
        ln = np.log([r["params"] for r in rs])
        fit = parabola_min(ln, [r["val_loss"] for r in rs])
        row = {"budget": c, "runs": len(all_rs), "fitted": [r["name"] for r in rs], **fit, "n_opt": None,
               "d_opt": None, "n_opt_non_embedding": None}
        if fit["ok"]:
            order = np.argsort(ln)
            ld = np.log([rs[i]["tokens"] for i in order])
            lne = np.log([rs[i]["non_embedding_params"] for i in order])
            slope = np.polyfit(ln[order], ld, 1)
            row.update(n_opt=math.exp(fit["x_min"]), d_opt=math.exp(float(np.polyval(slope, fit["x_min"]))),
                       n_opt_non_embedding=math.exp(float(np.interp(fit["x_min"], ln[order], lne))))
        out.append(row)
    return out


def approach2(runs: list[dict]) -> dict:
    """Approach 2: ``N_opt ∝ C^a``, ``D_opt ∝ C^b`` over the budgets whose parabola has a minimum
    inside its sizes (the others are listed, not fitted)."""
    optima = budget_optima(runs)
    good = [o for o in optima if o["ok"] and o["inside"]]
    cs = [o["budget"] for o in good]
    fit_n = power_law(cs, [o["n_opt"] for o in good])
    fit_d = power_law(cs, [o["d_opt"] for o in good])
    fit_ne = power_law(cs, [o["n_opt_non_embedding"] for o in good])
    return {"optima": optima, "budgets_used": len(good), "a": fit_n["exponent"], "b": fit_d["exponent"],
            "a_non_embedding": fit_ne["exponent"], "fit_n": fit_n, "fit_d": fit_d}


# --------------------------------------------------------------------------------------------
# approach 3
# --------------------------------------------------------------------------------------------
def _lse3(theta, ln, ld):
    a, b, e, alpha, beta = theta
    t = np.stack([a - alpha * ln, b - beta * ld, np.full_like(ln, e)])
    m = t.max(0)
    w = np.exp(t - m)
    s = w.sum(0)
    return m + np.log(s), w / s


def _huber_objective(theta, ln, ld, ll):
    pred, w = _lse3(theta, ln, ld)
    r = pred - ll
    small = np.abs(r) <= HUBER_DELTA
    loss = np.where(small, 0.5 * r * r, HUBER_DELTA * (np.abs(r) - 0.5 * HUBER_DELTA)).sum()
    psi = np.where(small, r, HUBER_DELTA * np.sign(r))
    grad = np.array([(psi * w[0]).sum(), (psi * w[1]).sum(), (psi * w[2]).sum(),
                     -(psi * w[0] * ln).sum(), -(psi * w[1] * ld).sum()])
    return loss, grad


def _grid_starts(ln, ld, ll, keep: int) -> np.ndarray:
    """The ``keep`` points of ``GRID`` with the lowest Huber objective (evaluated all at once)."""
    mesh = np.stack(np.meshgrid(GRID["a"], GRID["b"], GRID["e"], GRID["alpha"], GRID["beta"], indexing="ij"), -1)
    theta = mesh.reshape(-1, 5)
    t = np.stack([theta[:, :1] - theta[:, 3:4] * ln, theta[:, 1:2] - theta[:, 4:5] * ld,
                  np.broadcast_to(theta[:, 2:3], (theta.shape[0], ln.size))])
    m = t.max(0)
    r = m + np.log(np.exp(t - m).sum(0)) - ll
    small = np.abs(r) <= HUBER_DELTA
    obj = np.where(small, 0.5 * r * r, HUBER_DELTA * (np.abs(r) - 0.5 * HUBER_DELTA)).sum(1)
    return theta[np.argsort(obj)[:keep]]


def _minimize(starts, ln, ld, ll):
    from scipy.optimize import minimize
    best = None
    for x0 in starts:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = minimize(_huber_objective, np.asarray(x0, float), args=(ln, ld, ll), jac=True, method="L-BFGS-B",
                           options={"maxiter": 1000, "gtol": 1e-9, "ftol": 1e-12})
        if np.all(np.isfinite(res.x)) and (best is None or res.fun < best.fun):
            best = res
    return best


def approach3(n, d, loss, starts=None) -> dict:
    """``L(N, D) = E + A/N^alpha + B/D^beta`` (see the module docstring); ``starts`` defaults to the
    best points of the grid. Returns the parameters, the implied ``a``, ``b`` and ``G``
    (``N_opt = G·(C/6)^a``)."""
    ln, ld, ll = np.log(np.asarray(n, float)), np.log(np.asarray(d, float)), np.log(np.asarray(loss, float))
    if starts is None:
        starts = _grid_starts(ln, ld, ll, GRID_KEEP)
    res = _minimize(starts, ln, ld, ll)
    out = {"ok": res is not None, "theta": None, **_fit_quality(ll, ll, 5)}
    if res is None:
        return out
    a, b, e, alpha, beta = (float(v) for v in res.x)
    pred, _ = _lse3(res.x, ln, ld)
    out.update(_fit_quality(ll, pred, 5))
    out.update(ok=True, theta=[a, b, e, alpha, beta], E=math.exp(e), A=math.exp(a), B=math.exp(b), alpha=alpha,
               beta=beta, objective=float(res.fun), residual_rms=float(np.sqrt(np.mean((pred - ll) ** 2))))
    if alpha > 0 and beta > 0:
        out.update(a=beta / (alpha + beta), b=alpha / (alpha + beta),
                   G=(alpha * out["A"] / (beta * out["B"])) ** (1.0 / (alpha + beta)))
    else:
        out.update(a=None, b=None, G=None)
    return out


def predict3(fit: dict, n, d):
    n, d = np.asarray(n, float), np.asarray(d, float)
    return fit["E"] + fit["A"] * n ** -fit["alpha"] + fit["B"] * d ** -fit["beta"]


# --------------------------------------------------------------------------------------------
# approach 1
# --------------------------------------------------------------------------------------------
def frontier(runs: list[dict], points: int = 60) -> list[dict]:
    """Lower envelope of the held-out curves (each with its final point) over training compute:
    at each of ``points`` log-spaced computes, the lowest interpolated loss any run reaches there
    (``size``: which). ``best`` is the running minimum over compute, the monotone frontier (a
    larger budget can always stop early)."""
    curves = []
    for r in runs:
        pts = sorted({(c["compute"], c["val_loss"], c["tokens"]) for c in r.get("curve", [])} |
                     {(r["compute"], r["val_loss"], r["tokens"])})
        if len(pts) >= 2:
            curves.append((r, np.log([p[0] for p in pts]), np.array([p[1] for p in pts]),
                           np.log([p[2] for p in pts])))
    if not curves:
        return []
    grid = np.linspace(min(c[1][0] for c in curves), max(c[1][-1] for c in curves), points)
    losses = np.full((len(curves), points), np.inf)
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


def approach1(runs: list[dict], points: int = 60) -> dict:
    """Approach 1 over the envelope's points between the smallest and largest budget: ``N_opt ∝ C^a``
    and ``D_opt ∝ C^b`` from the sizes (and their tokens) that reach the envelope. Needs at least
    three distinct sizes on it."""
    cs = [r["budget"] for r in runs]
    pts = [p for p in frontier(runs, points) if min(cs) <= p["compute"] <= max(cs)]
    sizes = {p["size"] for p in pts}
    out = {"points": len(pts), "sizes_on_envelope": len(sizes), "a": None, "b": None, "fit_n": None, "fit_d": None}
    if len(sizes) < 3:
        out["warning"] = f"only {len(sizes)} size(s) reach the envelope: approach 1 not identifiable"
        return out
    fit_n = power_law([p["compute"] for p in pts], [p["params"] for p in pts])
    fit_d = power_law([p["compute"] for p in pts], [p["tokens"] for p in pts])
    out.update(a=fit_n["exponent"], b=fit_d["exponent"], fit_n=fit_n, fit_d=fit_d)
    return out


# --------------------------------------------------------------------------------------------
# loss at the optimum, extrapolation, bootstrap
# --------------------------------------------------------------------------------------------
def optimal_loss_law(optima: list[dict]) -> dict:
    """``L_opt(C) = E + A·C^(-gamma)`` through the budgets' parabola minima (scipy curve_fit)."""
    good = [o for o in optima if o["ok"] and o["inside"]]
    c = np.array([o["budget"] for o in good], float)
    y = np.array([o["y_min"] for o in good], float)
    out = {"ok": False, "E": None, "A": None, "gamma": None, **_fit_quality(y, y, 3)}
    if c.size < 3:
        return out
    from scipy.optimize import curve_fit
    c0 = float(np.exp(np.mean(np.log(c))))

    def f(x, e, log_a, g):
        return e + np.exp(log_a) * (x / c0) ** (-g)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            p, _ = curve_fit(f, c, y, p0=[0.5 * y.min(), math.log(max(1e-3, y.mean() - 0.5 * y.min())), 0.1],
                             bounds=([0.0, -20.0, 0.0], [y.min(), 20.0, 3.0]), maxfev=20000)
    except (RuntimeError, ValueError):
        return out
    out.update(_fit_quality(y, f(c, *p), 3))
    out.update(ok=True, E=float(p[0]), A=float(math.exp(p[1]) * c0 ** p[2]), gamma=float(p[2]))
    return out


def extrapolation(runs: list[dict], starts=None) -> dict:
    """Fit without the largest budget; predict that budget's optimal loss (the minimum of its
    parabola, ``budget_optima``) by approach 3 (the same through the predicted losses of its runs) and by the
    ``L_opt(C)`` law; report the errors (predicted - measured, nats/token)."""
    groups = by_budget(runs)
    if len(groups) < 4:
        return {"ok": False, "warning": f"needs >= 4 budgets, got {len(groups)}"}
    top = max(groups)
    rest = [r for c, rs in groups.items() if c != top for r in rs]
    top_runs = groups[top]
    measured = budget_optima(top_runs)[0]
    out = {"ok": measured["ok"], "budget": top, "measured": measured["y_min"]}
    f3 = approach3([r["params"] for r in rest], [r["tokens"] for r in rest], [r["val_loss"] for r in rest], starts)
    if f3["ok"]:
        pred = predict3(f3, [r["params"] for r in top_runs], [r["tokens"] for r in top_runs])
        p3 = budget_optima([{**r, "val_loss": float(v)} for r, v in zip(top_runs, pred)])[0]
        out["approach3"] = p3["y_min"]
        out["approach3_error"] = None if not (p3["ok"] and measured["ok"]) else p3["y_min"] - measured["y_min"]
        out["approach3_fit"] = {k: f3[k] for k in ("E", "A", "B", "alpha", "beta", "a", "b")}
    a2 = approach2(rest)
    law = optimal_loss_law(a2["optima"])
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
    for rs in by_budget(runs).values():
        out.extend(rs[i] for i in rng.integers(0, len(rs), len(rs)))
    return out


def bootstrap(runs: list[dict], n: int = 1000, seed: int = 0, approach3_fit: dict | None = None) -> dict:
    """Percentile 95% intervals over ``n`` resamples (``resample``) of approach 1's and 2's ``a``, ``b``
    and approach 3's ``E, alpha, beta, a, b`` (approach 3 restarted from the full fit and one
    nearby point, not the whole grid)."""
    rng = np.random.default_rng(seed)
    samples = defaultdict(list)
    starts = None
    if approach3_fit and approach3_fit.get("ok"):
        t = np.asarray(approach3_fit["theta"])
        starts = [t, t + np.array([0.5, 0.5, -0.2, 0.05, 0.05])]
    for _ in range(n):
        rs = resample(runs, rng)
        a2 = approach2(rs)
        if a2["budgets_used"] >= 3:
            samples["a2_a"].append(a2["a"])
            samples["a2_b"].append(a2["b"])
        a1 = approach1(rs)
        if a1["a"] is not None:
            samples["a1_a"].append(a1["a"])
            samples["a1_b"].append(a1["b"])
        if starts is not None:
            f = approach3([r["params"] for r in rs], [r["tokens"] for r in rs], [r["val_loss"] for r in rs], starts)
            if f["ok"] and f.get("a") is not None:
                for k in ("E", "alpha", "beta", "a", "b"):
                    samples[f"a3_{k}"].append(f[k])
    return {k: {"lo": float(np.percentile(v, 2.5)), "hi": float(np.percentile(v, 97.5)), "median": float(np.median(v)),
                "samples": len(v)} for k, v in samples.items()} | {"resamples": n}


# --------------------------------------------------------------------------------------------
# the learning-rate rule
# --------------------------------------------------------------------------------------------
def fit_lr_rule(lr_runs: list[dict], kappa: float) -> dict:
    """From the learning-rate sweep: per (budget, size) the loss-minimising rate (a parabola in
    log lr, or the best rate tried when the minimum is not inside the rates: flagged), then
    ``log(lr*) - kappa·log(batch_tokens / 2^15) = log c - gamma·log(N / 1e6)`` by least squares.
    Returns ``{"c", "gamma", "groups": [...], ...}``; ``gamma`` is None (and ``c`` their geometric
    mean) with a single size."""
    groups = defaultdict(list)
    for r in lr_runs:
        groups[(r["budget"], r["name"])].append(r)
    rows = []
    for (c, name), rs in sorted(groups.items()):
        rs = sorted(rs, key=lambda r: r["train"]["lr"])
        llr = np.log([r["train"]["lr"] for r in rs])
        losses = np.array([r["val_loss"] for r in rs])
        fit = parabola_min(llr, losses)
        edge = not (fit["ok"] and fit["inside"])
        best = float(math.exp(llr[int(np.argmin(losses))] if edge else fit["x_min"]))
        batch_tokens = rs[0]["train"]["batch_size"] * rs[0]["model"]["seq_len"]
        rows.append({"budget": c, "name": name, "params": rs[0]["params"], "batch_tokens": batch_tokens,
                     "lrs": [r["train"]["lr"] for r in rs], "losses": losses.tolist(), "lr_opt": best,
                     "at_edge": edge, "normalised": best / (batch_tokens / 2**15) ** kappa})
    if not rows:
        return {"ok": False, "groups": []}
    y = np.log([r["normalised"] for r in rows])
    x = np.log([r["params"] / 1e6 for r in rows])
    if np.unique(x).size >= 2:
        slope, icpt = np.polyfit(x, y, 1)
        gamma = float(f"{np.clip(-slope, 0.0, 1.0):.4g}")  # beyond [0, 1] the rule would extrapolate wildly
        c = float(f"{math.exp(np.mean(y + gamma * x)):.4g}")
        quality = _fit_quality(y, np.log(c) - gamma * x, 2)
    else:
        gamma, c = None, float(f"{math.exp(y.mean()):.4g}")
        quality = _fit_quality(y, np.full_like(y, y.mean()), 1)
    return {"ok": True, "c": c, "gamma": gamma, "kappa": kappa, "groups": rows, "edges": sum(r["at_edge"] for r in rows),
            **quality}
