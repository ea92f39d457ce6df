"""Approach 3: the loss surface ``L(N, D) = E + A/N^alpha + B/D^beta`` (numpy + scipy; no torch).

Fitted as Hoffmann et al. and Besiroglu et al. do: Huber loss (delta 1e-3) on ``log L`` of the
log-sum-exp form, L-BFGS-B from a grid of starting points, with the implied ``a = beta/(alpha+beta)``
and ``b = alpha/(alpha+beta)``. The parameters are bounded (an unbounded ``log E`` ran to -1483,
where the gradient in E is exactly zero and no restart near it can move E: issue 33).

``profile_e``: the profile likelihood of E (least squares on log L, the other four parameters
refitted at each E): an interval where the data bound E on both sides, else an upper bound.
"""
from __future__ import annotations

import math
import os
import sys
import warnings

import numpy as np

# L-BFGS on five parameters makes tiny BLAS calls, where OpenBLAS's threads only spin against each
# other (3.5 ms a call on a busy 2-core machine, 0.1 ms on one thread). Read when scipy loads it.
if "scipy" not in sys.modules:
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

HUBER_DELTA = 1e-3
# The starting grid: exponents, log A, log B as Hoffmann et al.'s; E as fractions of the lowest loss
# (E must lie below every loss), so that every start has an E > 0 that matters.
GRID = {"alpha": (0.0, 0.5, 1.0, 1.5, 2.0), "beta": (0.0, 0.5, 1.0, 1.5, 2.0),
        "e_frac": (0.02, 0.2, 0.4, 0.6, 0.8), "a": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0), "b": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0)}
GRID_KEEP = 12  # L-BFGS runs from the best grid points overall, and the best at each E of the grid
# (log A, log B, log E, alpha, beta): wide enough for any sweep here, finite so exp() never overflows.
BOUNDS = [(-10.0, 60.0), (-10.0, 60.0), (-12.0, 5.0), (0.0, 4.0), (0.0, 4.0)]
CHI2_95 = 3.841  # the 95% point of chi-square with one degree of freedom


def _logs(n, d, loss):
    return np.log(np.asarray(n, float)), np.log(np.asarray(d, float)), np.log(np.asarray(loss, float))


def _lse3(theta, ln, ld):
    a, b, e, alpha, beta = theta
    t = np.stack([a - alpha * ln, b - beta * ld, np.full_like(ln, e)])
    m = t.max(0)
    w = np.exp(t - m)
    s = w.sum(0)
    return m + np.log(s), w / s


def _huber(r):
    small = np.abs(r) <= HUBER_DELTA
    return np.where(small, 0.5 * r * r, HUBER_DELTA * (np.abs(r) - 0.5 * HUBER_DELTA)), np.where(
        small, r, HUBER_DELTA * np.sign(r))


def _objective(theta, ln, ld, ll):
    pred, w = _lse3(theta, ln, ld)
    loss, psi = _huber(pred - ll)
    grad = np.array([(psi * w[0]).sum(), (psi * w[1]).sum(), (psi * w[2]).sum(),
                     -(psi * w[0] * ln).sum(), -(psi * w[1] * ld).sum()])
    return loss.sum(), grad


def grid_starts(ln, ld, ll, keep: int = GRID_KEEP) -> np.ndarray:
    """The ``keep`` grid points of lowest Huber objective, then the best point at each E of the grid
    (evaluated all at once)."""
    e = np.log(np.array(GRID["e_frac"]) * math.exp(ll.min()))
    mesh = np.stack(np.meshgrid(GRID["a"], GRID["b"], e, GRID["alpha"], GRID["beta"], indexing="ij"), -1)
    theta = mesh.reshape(-1, 5)
    t = np.stack([theta[:, :1] - theta[:, 3:4] * ln, theta[:, 1:2] - theta[:, 4:5] * ld,
                  np.broadcast_to(theta[:, 2:3], (theta.shape[0], ln.size))])
    m = t.max(0)
    obj = _huber(m + np.log(np.exp(t - m).sum(0)) - ll)[0].sum(1)
    order = np.argsort(obj)
    per_e = [order[theta[order, 2] == v][0] for v in e]
    return theta[list(dict.fromkeys([*order[:keep], *per_e]))]


def _minimize(fun, starts, args, bounds):
    from scipy.optimize import minimize
    best = None
    for x0 in starts:
        x0 = np.clip(np.asarray(x0, float), [b[0] for b in bounds], [b[1] for b in bounds])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = minimize(fun, x0, args=args, jac=True, method="L-BFGS-B", bounds=bounds,
                           options={"maxiter": 1000, "gtol": 1e-10, "ftol": 1e-13})
        if np.all(np.isfinite(res.x)) and np.isfinite(res.fun) and (best is None or res.fun < best.fun):
            best = res
    return best


def _quality(ll, pred, n_params: int) -> dict:
    n = int(ll.size)
    out = {"n_points": n, "n_params": n_params, "dof": n - n_params, "r2": None, "warning": None}
    if n <= n_params:
        out["warning"] = f"{n} points for {n_params} parameters: no goodness of fit"
        return out
    ss = float(np.sum((ll - ll.mean()) ** 2))
    out["r2"] = 1.0 - float(np.sum((ll - pred) ** 2)) / ss if ss > 0 else None
    return out


def approach3(n, d, loss, starts=None, keep: int = GRID_KEEP) -> dict:
    """``L(N, D) = E + A/N^alpha + B/D^beta`` (see the module docstring); ``starts`` (rows of
    ``log A, log B, log E, alpha, beta``) are tried besides the grid's ``keep`` best points and its
    best at each E. Returns the
    parameters, the residuals in log L, the implied ``a``, ``b`` and ``G`` (``N_opt = G·(C/6)^a``)."""
    ln, ld, ll = _logs(n, d, loss)
    if ll.size < 5:
        return {"ok": False, "warning": f"{ll.size} runs: approach 3 needs at least 5"}
    grid = grid_starts(ln, ld, ll, keep)
    res = _minimize(_objective, grid if starts is None else [*starts, *grid], (ln, ld, ll), BOUNDS)
    if res is None:
        return {"ok": False, "warning": "no start converged"}
    a, b, e, alpha, beta = (float(v) for v in res.x)
    pred, _ = _lse3(res.x, ln, ld)
    out = {"ok": True, "theta": [a, b, e, alpha, beta], "E": math.exp(e), "A": math.exp(a), "B": math.exp(b),
           "alpha": alpha, "beta": beta, "objective": float(res.fun), "residuals": (ll - pred).tolist(),
           "residual_rms": float(np.sqrt(np.mean((pred - ll) ** 2))), **_quality(ll, pred, 5),
           "at_bound": [k for k, v, (lo, hi) in zip(("log A", "log B", "log E", "alpha", "beta"), res.x, BOUNDS)
                        if min(v - lo, hi - v) < 1e-6]}
    return {**out, **optimum(out)}


def optimum(fit: dict) -> dict:
    """The compute-optimal allocation of a surface ``E, A, B, alpha, beta``: ``N_opt = G·(C/6)^a``
    and ``D_opt ∝ C^b`` (all None unless alpha and beta are positive)."""
    alpha, beta = fit["alpha"], fit["beta"]
    if not (alpha > 0 and beta > 0):
        return {"a": None, "b": None, "G": None}
    return {"a": beta / (alpha + beta), "b": alpha / (alpha + beta),
            "G": (alpha * fit["A"] / (beta * fit["B"])) ** (1.0 / (alpha + beta))}


def predict3(fit: dict, n, d):
    n, d = np.asarray(n, float), np.asarray(d, float)
    return fit["E"] + fit["A"] * n ** -fit["alpha"] + fit["B"] * d ** -fit["beta"]


# --------------------------------------------------------------------------------------------
# profile likelihood of E
# --------------------------------------------------------------------------------------------
def _fixed_e_sq(theta4, ln, ld, ll, big_e):
    """Sum of squared residuals in log L with E fixed, and its gradient in (log A, log B, alpha, beta)."""
    a, b, alpha, beta = theta4
    ta, tb = np.exp(a - alpha * ln), np.exp(b - beta * ld)
    total = big_e + ta + tb
    r = np.log(total) - ll
    g = 2 * r / total
    return float((r * r).sum()), np.array([(g * ta).sum(), (g * tb).sum(), -(g * ta * ln).sum(), -(g * tb * ld).sum()])


def profile_e(n, d, loss, fit3: dict | None = None, points: int = 40) -> dict:
    """Profile likelihood of E over ``[0, 0.99·min loss]``: at each E the other four parameters refitted
    by least squares on log L; deviance ``n·log(RSS(E)/RSS_min)`` against chi-square(1) at 95%.
    ``status``: ``"interval"`` (bounded on both sides: ``lo``, ``hi``), ``"upper bound"`` (E = 0 is
    within it: only ``hi``), or ``"not bounded"`` (E up to the lowest loss fits as well)."""
    ln, ld, ll = _logs(n, d, loss)
    if ll.size < 6:
        return {"ok": False, "status": "not fitted", "warning": f"{ll.size} runs: too few for a profile"}
    grid_e = np.linspace(0.0, 0.99 * math.exp(ll.min()), points)
    seeds = [np.array(fit3["theta"])[[0, 1, 3, 4]]] if fit3 and fit3.get("ok") else []
    seeds += [t[[0, 1, 3, 4]] for t in grid_starts(ln, ld, ll, 4)]
    bounds = [BOUNDS[i] for i in (0, 1, 3, 4)]
    rss, best = np.full(points, np.inf), [None] * points
    # up the grid, then down it, each point also started from its neighbour's solution (a profile is
    # smooth; a start far from one point's optimum can stall where the neighbour's does not)
    for order in (range(points), range(points - 1, -1, -1)):
        prev = None
        for k in order:
            res = _minimize(_fixed_e_sq, seeds + [x for x in (prev, best[k]) if x is not None], (ln, ld, ll, grid_e[k]),
                            bounds)
            if res.fun < rss[k]:
                rss[k], best[k] = res.fun, res.x
            prev = best[k]
    rss = np.maximum(rss, 1e-300)
    dev = ll.size * np.log(rss / rss.min())
    inside = np.flatnonzero(dev <= CHI2_95)
    i, j = inside.min(), inside.max()

    def cross(k, m):  # where the deviance crosses the 95% level between grid points k (inside) and m
        return float(grid_e[k] + (grid_e[m] - grid_e[k]) * (CHI2_95 - dev[k]) / (dev[m] - dev[k]))
    out = {"ok": True, "E": grid_e.tolist(), "deviance": dev.tolist(), "E_best": float(grid_e[dev.argmin()]),
           "lo": 0.0 if i == 0 else cross(i, i - 1), "hi": float(grid_e[-1]) if j == points - 1 else cross(j, j + 1),
           "level": 0.95}
    lower_open, upper_open = dev[0] <= CHI2_95, dev[-1] <= CHI2_95
    out["status"] = "not bounded" if upper_open else "upper bound" if lower_open else "interval"
    return out


def describe_e(profile: dict) -> str:
    """One line for the report: the interval, or the bound, said as such."""
    if not profile or not profile.get("ok"):
        return "E: no profile (" + (profile or {}).get("warning", "not fitted") + ")"
    if profile["status"] == "interval":
        return f"E in [{profile['lo']:.3f}, {profile['hi']:.3f}] (95% profile likelihood: identified)"
    if profile["status"] == "upper bound":
        return (f"E <= {profile['hi']:.3f} (95% profile likelihood; E = 0 fits as well: not identified from below, "
                "an upper bound only)")
    return "E not bounded below the lowest loss (95% profile likelihood): not identified"
