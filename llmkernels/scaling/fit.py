"""Fitting and plotting the sweep: ``L(N) = E + A·N^(-alpha)``, the loss-vs-compute frontier and
``L(C) = E + B·C^(-beta)`` over the final points, a log-log figure with residuals."""
from __future__ import annotations

import math
import warnings

import numpy as np


def _power(x, e, log_b, alpha):
    return e + np.exp(log_b) * np.power(x, -alpha)


def fit_power_law(x, y) -> dict:
    """Least-squares fit of ``y = E + A·x^(-alpha)`` with ``scipy.optimize.curve_fit``.

    ``x`` is scaled by its geometric mean for conditioning; several starting slopes are tried and
    the best kept. Bounds: ``0 <= E <= min(y)``, ``0 <= alpha <= 5``. If SciPy is missing or every
    start fails, falls back to a straight line in log-log (``E = 0``) and says so in ``method``
    and ``error``. Needs at least 3 points (then R² is 1 by construction: ``dof`` says so).

    Returns a dict: ``ok, method, E, A, alpha, r2, n_points, dof, stderr, predicted, residuals, error``.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    out = {"ok": False, "method": None, "E": None, "A": None, "alpha": None, "r2": None, "n_points": int(x.size),
           "dof": int(x.size) - 3, "stderr": None, "predicted": None, "residuals": None, "error": None}
    if x.size < 3 or not (np.all(np.isfinite(x)) and np.all(np.isfinite(y)) and np.all(x > 0)):
        out["error"] = f"need >= 3 finite points with x > 0, got {x.size}"
        return out
    x_ref = float(np.exp(np.mean(np.log(x))))
    xs = x / x_ref
    best, errors = None, []
    try:
        from scipy.optimize import curve_fit
    except ImportError:
        curve_fit = None
        errors.append("scipy is not installed")
    if curve_fit is not None:
        y_min = float(y.min())
        for alpha0 in (0.1, 0.3, 0.6, 1.0):
            for e_frac in (0.0, 0.5, 0.9):
                e0 = e_frac * y_min
                p0 = [e0, math.log(max(1e-6, float(np.mean(y)) - e0)), alpha0]
                try:
                    with warnings.catch_warnings():  # "covariance could not be estimated": stderr is None then
                        warnings.simplefilter("ignore")
                        popt, pcov = curve_fit(_power, xs, y, p0=p0, maxfev=20000,
                                               bounds=([0.0, -30.0, 0.0], [y_min, 30.0, 5.0]))
                except (RuntimeError, ValueError) as exc:
                    errors.append(str(exc))
                    continue
                sse = float(np.sum((_power(xs, *popt) - y) ** 2))
                if np.all(np.isfinite(popt)) and (best is None or sse < best[0]):
                    best = (sse, popt, pcov)
    if best is not None:
        _, (e, log_b, alpha), pcov = best
        pred = _power(xs, e, log_b, alpha)
        perr = np.sqrt(np.clip(np.diag(pcov), 0, None)) if np.all(np.isfinite(pcov)) else None
        out.update(method="curve_fit", stderr=None if perr is None else {"E": float(perr[0]), "alpha": float(perr[2])})
    else:  # fallback: log y = log A - alpha log x
        slope, intercept = np.polyfit(np.log(xs), np.log(y), 1)
        e, log_b, alpha = 0.0, float(intercept), float(-slope)
        pred = _power(xs, e, log_b, alpha)
        out.update(method="log-log line (E=0): curve_fit unavailable or failed")
    ss_res = float(np.sum((y - pred) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    out.update(ok=True, E=float(e), A=float(math.exp(log_b) * x_ref**alpha), alpha=float(alpha),
               r2=1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan"),
               predicted=pred.tolist(), residuals=(y - pred).tolist(), error="; ".join(errors[:3]) or None)
    return out


def predict(fit: dict, x):
    """``E + A·x^(-alpha)`` for a fit returned by ``fit_power_law``."""
    return fit["E"] + fit["A"] * np.power(np.asarray(x, dtype=np.float64), -fit["alpha"])


def compute_frontier(results: list[dict], points: int = 40) -> list[dict] | None:
    """Lower envelope of the held-out loss-vs-compute curves (``C = 6·N·tokens``) of all sizes, on
    ``points`` log-spaced compute values: the best loss any size reached at that compute, and which.

    Intermediate points come from runs whose learning rate had not yet decayed, so the envelope
    is an upper bound on the loss an annealed run of that compute would reach. ``None`` when fewer
    than two sizes have a curve."""
    curves = [(r["name"], np.array([c["compute"] for c in r["curve"]]), np.array([c["val_loss"] for c in r["curve"]]))
              for r in results if len(r.get("curve", [])) >= 2]
    if len(curves) < 2:
        return None
    lo = min(c.min() for _, c, _ in curves)
    hi = max(c.max() for _, c, _ in curves)
    frontier = []
    for c in np.logspace(math.log10(lo), math.log10(hi), points):
        best = None
        for name, cs, ls in curves:
            if cs[0] <= c <= cs[-1]:
                loss = float(np.interp(math.log(c), np.log(cs), ls))
                if best is None or loss < best[0]:
                    best = (loss, name)
        if best is not None:
            frontier.append({"compute": float(c), "val_loss": best[0], "size": best[1]})
    return frontier


def plot(results: list[dict], fit_n: dict, fit_c: dict, frontier, path: str, title: str) -> bool:
    """Log-log figure: L(N) with its fit, the fit's residuals, and loss vs compute (each size's curve,
    the frontier and the L(C) fit). Returns False (and writes nothing) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    n = np.array([r["params"] for r in results], dtype=np.float64)
    loss = np.array([r["val_loss"] for r in results])
    comp = np.array([r["compute"] for r in results])
    fig = plt.figure(figsize=(12, 6.5))
    grid = fig.add_gridspec(2, 2, height_ratios=[3, 1], hspace=0.08, wspace=0.22)
    ax, axr, axc = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[:, 1])
    ax.loglog(n, loss, "o", color="C0", label="held-out loss")
    for r in results:
        ax.annotate(r["name"], (r["params"], r["val_loss"]), fontsize=6, rotation=35, xytext=(3, 3),
                    textcoords="offset points")
    xs = np.logspace(math.log10(n.min() / 1.5), math.log10(n.max() * 1.5), 200)
    if fit_n.get("ok"):
        ax.loglog(xs, predict(fit_n, xs), "-", color="C1",
                  label=f"L = {fit_n['E']:.3f} + {fit_n['A']:.3g}·N^(-{fit_n['alpha']:.3f})  (R² = {fit_n['r2']:.4f})")
        if fit_n["E"] > 0.2 * loss.min():
            ax.axhline(fit_n["E"], color="C1", ls=":", lw=1, label=f"E = {fit_n['E']:.3f}")
        axr.semilogx(n, fit_n["residuals"], "o", color="C0")
    axr.axhline(0, color="C1", lw=1)
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.tick_params(labelbottom=False)
    axr.set_xscale("log")
    axr.set_xlim(ax.get_xlim())
    axr.set_xlabel("non-embedding parameters N")
    axr.set_ylabel("residual")
    for i, r in enumerate(results):
        cs = [c["compute"] for c in r.get("curve", [])]
        ls = [c["val_loss"] for c in r.get("curve", [])]
        axc.loglog(cs, ls, "-", lw=1, alpha=0.7, color=f"C{i % 10}", label=r["name"])
    axc.loglog(comp, loss, "ko", ms=4, label="final (annealed)")
    if frontier:
        axc.loglog([f["compute"] for f in frontier], [f["val_loss"] for f in frontier], "k--", lw=1.5,
                   label="frontier (envelope)")
    if fit_c.get("ok"):
        cx = np.logspace(math.log10(comp.min() / 1.5), math.log10(comp.max() * 1.5), 200)
        axc.loglog(cx, predict(fit_c, cx), "-", color="C1", lw=1,
                   label=f"L = {fit_c['E']:.3f} + {fit_c['A']:.3g}·C^(-{fit_c['alpha']:.3f})")
    axc.set_xlabel("training compute C = 6·N·D (FLOPs)")
    axc.set_ylabel("held-out loss")
    axc.legend(fontsize=7, ncol=2)
    for a in (ax, axc):
        a.grid(True, which="both", alpha=0.3)
    axr.grid(True, which="both", alpha=0.3)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return True
