"""Approach 2, the power laws and parabolas the approaches share, and the learning-rate rule
(numpy + scipy; no torch). Approach 1 is in ``envelope``, approach 3 in ``surface``, the intervals
and checks in ``intervals``.

- Approach 2: at each budget a parabola of loss in ``log N`` through the sizes around the lowest
  loss, its minimum with a standard error (the delta method on the parabola's coefficients, from
  the larger of its residual scatter and the measured seed noise); ``N_opt(C)`` and ``D_opt(C)``
  fitted as power laws weighted by those errors.
- The learning-rate rule from the learning-rate sweep.

A fit with no more points than parameters reports ``warning`` and no ``r2`` (it would be 1 by
construction).
"""
from __future__ import annotations

import math
import warnings
from collections import defaultdict

import numpy as np

# A budget's parabola goes through the lowest loss and up to three sizes each side of it (7 of a
# 9-size window 1.3x apart, a 7x range in N): far from the minimum the loss is not parabolic in
# log N (a model well off the optimum stops far from converged), which would drag the minimum.
PARABOLA_HALF_WIDTH = 3
# A learning-rate run this far (nats) above its size's best rate stalled or diverged (the H200's
# L6-W256 at 2x its best: +0.7) rather than sat on the smooth side of the optimum (within ~0.1).
UNSTABLE_MARGIN = 0.25
GAMMA_MAX = 1.0  # the rule's exponent beyond [0, 1] would extrapolate wildly past the sizes swept


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


def power_law(x, y, se=None) -> dict:
    """``y = k·x^p`` by least squares in log-log, weighted by ``1/se²`` when the standard errors of
    ``log y`` are given: ``{"exponent", "coef", "exponent_se", ...quality}``. The slope's error is
    scaled up by the reduced chi-square when the points scatter more than their errors say."""
    lx, ly = np.log(np.asarray(x, float)), np.log(np.asarray(y, float))
    if lx.size < 2 or np.ptp(lx) == 0:
        return {"ok": False, "exponent": None, "coef": None, "exponent_se": None, **_fit_quality(ly, ly, 2)}
    w = np.ones_like(lx) if se is None else 1.0 / np.asarray(se, float) ** 2
    design = np.stack([lx, np.ones_like(lx)], 1)
    cov = np.linalg.pinv(design.T @ (design * w[:, None]))
    p, k = cov @ design.T @ (w * ly)
    chi2 = float(np.sum(w * (ly - p * lx - k) ** 2))
    dof = lx.size - 2
    if se is None:
        se_p = math.sqrt(cov[0, 0] * chi2 / dof) if dof > 0 else None
    else:
        se_p = math.sqrt(cov[0, 0] * (max(1.0, chi2 / dof) if dof > 0 else 1.0))
    return {"ok": True, "exponent": float(p), "coef": float(math.exp(k)), "exponent_se": se_p,
            "weighted": se is not None, **_fit_quality(ly, p * lx + k, 2)}


def parabola_min(x, y, noise_sd: float | None = None) -> dict:
    """Minimum of ``y = c2·x² + c1·x + c0``: ``{"ok", "x_min", "x_se", "y_min", "coefs", "inside"}``.
    ``ok`` is False without curvature (c2 <= 0) or with fewer than 3 distinct x; ``inside`` says
    whether the minimum lies within the sampled x. ``x_se``: the delta method's standard error of
    ``x_min`` with the points' scatter the larger of the residuals' and ``noise_sd`` (None when
    neither is known)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if np.unique(x).size < 3:
        return {"ok": False, "x_min": None, "x_se": None, "y_min": None, "coefs": None, "inside": False,
                **_fit_quality(y, y, 3)}
    c2, c1, c0 = np.polyfit(x, y, 2)
    pred = np.polyval([c2, c1, c0], x)
    quality = _fit_quality(y, pred, 3)
    if c2 <= 0:
        return {"ok": False, "x_min": None, "x_se": None, "y_min": None, "coefs": [c2, c1, c0], "inside": False,
                **quality}
    xm = -c1 / (2 * c2)
    var = [float(np.sum((y - pred) ** 2)) / quality["dof"]] if quality["dof"] > 0 else []
    var += [noise_sd**2] if noise_sd else []
    x_se = None
    if var and max(var) > 0:
        vand = np.stack([x * x, x, np.ones_like(x)], 1)
        cov = np.linalg.inv(vand.T @ vand)[:2, :2] * max(var)
        g = np.array([c1 / (2 * c2 * c2), -1.0 / (2 * c2)])
        x_se = float(math.sqrt(max(0.0, g @ cov @ g))) or None
    return {"ok": True, "x_min": float(xm), "x_se": x_se, "y_min": float(np.polyval([c2, c1, c0], xm)),
            "coefs": [c2, c1, c0], "inside": bool(x.min() <= xm <= x.max()), **quality}


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


def budget_optima(runs: list[dict], noise_sd: float | None = None) -> list[dict]:
    """Per budget: the parabola of loss in log N (total parameters) through the sizes around the
    lowest loss (``near_minimum``), its minimum and that minimum's standard error in log N, with
    D_opt read off the budget's runs (log D linear in log N) and N_opt counted without the
    embedding as well, where the minimum lies inside those sizes (beyond them a nearly straight
    profile puts it anywhere, past any float)."""
    out = []
    for c, all_rs in by_budget(runs).items():
        rs = near_minimum(all_rs)
        ln = np.log([r["params"] for r in rs])
        fit = parabola_min(ln, [r["val_loss"] for r in rs], noise_sd)
        row = {"budget": c, "runs": len(all_rs), "fitted": [r["name"] for r in rs], **fit, "n_opt": None,
               "d_opt": None, "n_opt_non_embedding": None, "d_slope": None}
        if fit["ok"] and fit["inside"]:
            order = np.argsort(ln)
            ld = np.log([rs[i]["tokens"] for i in order])
            lne = np.log([rs[i]["non_embedding_params"] for i in order])
            slope = np.polyfit(ln[order], ld, 1)
            row.update(n_opt=math.exp(fit["x_min"]), d_opt=math.exp(float(np.polyval(slope, fit["x_min"]))),
                       n_opt_non_embedding=math.exp(float(np.interp(fit["x_min"], ln[order], lne))),
                       d_slope=float(slope[0]))
        out.append(row)
    return out


def approach2(runs: list[dict], noise_sd: float | None = None) -> dict:
    """Approach 2: ``N_opt ∝ C^a``, ``D_opt ∝ C^b`` over the budgets whose parabola has a minimum
    inside its sizes (the others are listed, not fitted), weighted by each minimum's standard
    error when every one has one."""
    runs = [r for r in runs if r.get("val_loss") is not None]
    optima = budget_optima(runs, noise_sd)
    good = [o for o in optima if o["ok"] and o["inside"]]
    cs = [o["budget"] for o in good]
    se = [o["x_se"] for o in good]
    se = se if se and all(v for v in se) else None
    fit_n = power_law(cs, [o["n_opt"] for o in good], se)
    fit_d = power_law(cs, [o["d_opt"] for o in good], None if se is None else [abs(o["d_slope"]) * v for o, v in zip(good, se)])
    fit_ne = power_law(cs, [o["n_opt_non_embedding"] for o in good], se)
    return {"optima": optima, "budgets_used": len(good), "a": fit_n["exponent"], "b": fit_d["exponent"],
            "a_se": fit_n["exponent_se"], "b_se": fit_d["exponent_se"], "a_non_embedding": fit_ne["exponent"],
            "fit_n": fit_n, "fit_d": fit_d}


# --------------------------------------------------------------------------------------------
# the loss at the optimum
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


# --------------------------------------------------------------------------------------------
# the learning-rate rule
# --------------------------------------------------------------------------------------------
def fit_lr_rule(lr_runs: list[dict], kappa: float) -> dict:
    """From the learning-rate sweep: per (budget, size) the loss-minimising rate (a parabola in
    log lr through the best rate tried and its two neighbours; a diverged run counts as the worst),
    or the best rate tried when that is the lowest or highest (``edge``: "low" / "high") or when a
    neighbour is ``unstable`` (more than ``UNSTABLE_MARGIN`` above the best: a diverged or stalled
    run, whose loss says nothing about the optimum's position), then
    the rule ``log(lr*) - kappa·log(batch_tokens / 2^15) = log c - gamma·log(N / 1e6)`` from every
    size's stable rates at once (``_joint_rule``). Returns ``{"c", "gamma", "groups": [...],
    "by_batch", "method", ...}`` (``by_batch``: the mean residual of the sizes' log lr* at each
    batch, kappa's check); ``gamma`` is None (and ``c`` the sizes' geometric mean) with a single
    size."""
    groups = defaultdict(list)
    for r in lr_runs:
        groups[(r["budget"], r["name"])].append(r)
    rows = []
    for (c, name), rs in sorted(groups.items()):
        rs = sorted(rs, key=lambda r: r["train"]["lr"])
        llr = np.log([r["train"]["lr"] for r in rs])
        losses = np.array([math.inf if r["val_loss"] is None else r["val_loss"] for r in rs])
        i = int(np.argmin(losses))
        edge = "low" if i == 0 else "high" if i == len(rs) - 1 else None
        unstable = losses > losses[i] + UNSTABLE_MARGIN
        near = [j for j in (i - 1, i, i + 1) if 0 <= j < len(rs) and not unstable[j]]
        fit = parabola_min(llr[near], losses[near]) if edge is None and len(near) == 3 else {"ok": False}
        best = float(math.exp(fit["x_min"] if fit["ok"] else llr[i]))
        batch_tokens = rs[0]["train"]["batch_size"] * rs[0]["model"]["seq_len"]
        rows.append({"budget": c, "name": name, "params": rs[0]["params"], "batch_tokens": batch_tokens,
                     "lrs": [r["train"]["lr"] for r in rs], "lr_mults": [r["lr_mult"] for r in rs],
                     "losses": [None if not math.isfinite(v) else float(v) for v in losses], "lr_opt": best,
                     "unstable": [r["lr_mult"] for r, u in zip(rs, unstable) if u],
                     "edge": edge, "at_edge": edge is not None, "normalised": best / (batch_tokens / 2**15) ** kappa})
    if not rows:
        return {"ok": False, "groups": []}
    y = np.log([r["normalised"] for r in rows])
    x = np.log([r["params"] / 1e6 for r in rows])
    method = "one parabola per size"
    if np.unique(x).size >= 2:
        slope, icpt = np.polyfit(x, y, 1)
        gamma = float(np.clip(-slope, 0.0, GAMMA_MAX))
        joint = _joint_rule(rows, kappa, math.exp(np.mean(y + gamma * x)), gamma)
        beyond = joint["beyond"] if joint is not None else {}
        for row in rows:
            if (row["budget"], row["name"]) in beyond:
                row["beyond"] = beyond[(row["budget"], row["name"])]
        if joint is not None and not beyond:
            c, gamma, method = joint["c"], joint["gamma"], "one parabola shared by the sizes"
        else:
            c = math.exp(np.mean(y + gamma * x))
        c, gamma = float(f"{c:.4g}"), float(f"{gamma:.4g}")
        resid = y - (np.log(c) - gamma * x)
        quality = _fit_quality(y, np.log(c) - gamma * x, 2)
    else:
        gamma, c = None, float(f"{math.exp(y.mean()):.4g}")
        resid = y - y.mean()
        quality = _fit_quality(y, np.full_like(y, y.mean()), 1)
    by_batch = {str(b): float(np.mean([v for v, r in zip(resid, rows) if r["batch_tokens"] == b]))
                for b in sorted({r["batch_tokens"] for r in rows})}
    return {"ok": True, "c": c, "gamma": gamma, "kappa": kappa, "groups": rows, "edges": sum(r["at_edge"] for r in rows),
            "by_batch": by_batch, "method": method, **quality}


def _joint_rule(rows: list[dict], kappa: float, c0: float, gamma0: float) -> dict | None:
    """``{"c", "gamma", "beyond"}`` of one parabola in log lr shared by every size: its own floor
    each, one curvature, the minimum at ``log c - gamma·log(N / 1e6)`` (batch-normalised as the
    rule). Every stable rate of every size informs the rule, where a size's own parabola rests on
    three runs whose noise can move it by a factor of two. ``beyond``: ``{(budget, name): "low" |
    "high"}`` for each size whose optimum it puts outside the rates tried there (no curvature to
    trust there: the caller keeps the sizes' own optima, and the sweep tries a rate on that side).
    None without more stable rates than parameters, or when the fit fails."""
    from scipy.optimize import least_squares

    rows = [r for r in rows if any(v is not None for v in r["losses"])]
    g, x, n, y = [], [], [], []
    for i, r in enumerate(rows):
        best = min(v for v in r["losses"] if v is not None)
        for lr, v in zip(r["lrs"], r["losses"]):
            if v is not None and v <= best + UNSTABLE_MARGIN:
                g.append(i)
                x.append(math.log(lr / (r["batch_tokens"] / 2**15) ** kappa))
                n.append(math.log(r["params"] / 1e6))
                y.append(v)
    g, x, n, y = map(np.asarray, (g, x, n, y))
    k = len(rows)
    if y.size <= k + 3:
        return None

    def resid(p):
        return p[:k][g] + math.exp(p[k]) * (x - (p[k + 1] - p[k + 2] * n)) ** 2 - y

    lo = np.r_[np.full(k + 2, -np.inf), 0.0]
    hi = np.r_[np.full(k + 2, np.inf), GAMMA_MAX]
    start = np.r_[[y[g == i].min() for i in range(k)], math.log(0.05), math.log(c0), gamma0]
    fit = least_squares(resid, np.clip(start, lo, hi), bounds=(lo, hi))
    if not fit.success:
        return None
    centre = fit.x[k + 1] - fit.x[k + 2] * n
    beyond = {(r["budget"], r["name"]): "low" if centre[g == i][0] < x[g == i].min() else "high"
              for i, r in enumerate(rows) if not x[g == i].min() <= centre[g == i][0] <= x[g == i].max()}
    return {"c": math.exp(fit.x[k + 1]), "gamma": float(fit.x[k + 2]), "beyond": beyond}
