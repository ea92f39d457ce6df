"""The report's figures (matplotlib; no torch). Each is drawn only when the runs allow it; otherwise
``plots`` says why in one line, so that any subset of runs gives a report."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from . import fit
from .surface import predict3


def _isoflop(ax, an, groups, colour):
    optima = an["approach2"]["optima"]
    if not optima:
        return "no IsoFLOP run finished"
    for o in optima:
        rs = groups[o["budget"]]
        n = np.array([r["params"] for r in rs], float)
        ax.plot(n, [r["val_loss"] for r in rs], "o", color=colour[o["budget"]], label=f"C = {o['budget']:.2g}")
        if o["coefs"] is not None and n.min() < n.max():
            xs = np.linspace(np.log(n.min()), np.log(n.max()), 100)
            ax.plot(np.exp(xs), np.polyval(o["coefs"], xs), "-", color=colour[o["budget"]], lw=1)
        if o["ok"] and o["inside"]:
            ax.plot(o["n_opt"], o["y_min"], "*", color=colour[o["budget"]], ms=12, mec="k")
    ax.set(xscale="log", xlabel="total parameters N", ylabel="held-out loss (nats/token)",
           title="IsoFLOP profiles: parabolas in log N, minima starred")
    ax.legend(fontsize=7)
    return None


def _optimal(axes, an, groups):
    good = [o for o in an["approach2"]["optima"] if o["ok"] and o["inside"]]
    a1, a3 = an["approach1"], an["approach3"]
    if not good and not (a1.get("fit_n") or {}).get("ok") and not a3.get("G"):
        return "no budget has a parabola minimum inside its sizes and no approach fitted N_opt(C)"
    cs = np.logspace(math.log10(min(groups)), math.log10(max(groups)), 50)
    for ax, key, fkey, label in ((axes[0], "n_opt", "fit_n", "N_opt"), (axes[1], "d_opt", "fit_d", "D_opt")):
        if good:
            err = [o["x_se"] or 0.0 for o in good] if key == "n_opt" else [abs(o["d_slope"]) * (o["x_se"] or 0.0) for o in good]
            y = np.array([o[key] for o in good])
            ax.errorbar([o["budget"] for o in good], y, yerr=[y * (1 - np.exp(-np.array(err))), y * (np.exp(err) - 1)],
                        fmt="ko", ms=4, label="approach 2 minima (±1 s.e.)")
        for f, style, name in ((an["approach2"].get(fkey), "k-", "approach 2"), (a1.get(fkey), "C0--", "approach 1")):
            if f and f["ok"]:
                ax.plot(cs, f["coef"] * cs ** f["exponent"], style, lw=1, label=f"{name}: C^{f['exponent']:.3f}")
        if a3.get("G"):
            n3 = a3["G"] * (cs / 6) ** a3["a"]
            ax.plot(cs, n3 if key == "n_opt" else cs / (6 * n3), "C3:", lw=1.5,
                    label=f"approach 3: C^{a3['a' if key == 'n_opt' else 'b']:.3f}")
        ax.set(xscale="log", yscale="log", xlabel="training compute C (FLOPs)", ylabel=label)
        ax.legend(fontsize=7)
    return None


def _lnd(ax, an, groups, colour):
    a3 = an["approach3"]
    if not a3.get("ok"):
        return "approach 3 did not fit (" + a3.get("warning", "no fit") + ")"
    for c, rs in groups.items():
        ax.plot([r["val_loss"] for r in rs], predict3(a3, [r["params"] for r in rs], [r["tokens"] for r in rs]),
                "o", color=colour[c], label=f"C = {c:.2g}")
    losses = [r["val_loss"] for rs in groups.values() for r in rs]
    ax.plot([min(losses), max(losses)], [min(losses), max(losses)], "k-", lw=0.8)
    ax.set(xlabel="measured loss", ylabel="fitted L(N, D)",
           title=f"E={a3['E']:.3f} alpha={a3['alpha']:.3f} beta={a3['beta']:.3f}")
    ax.legend(fontsize=7)
    return None


def _curves(ax, an, sweep, cmap):
    drawn = [r for r in sweep if r.get("curve")]
    if not drawn:
        return "no run has a held-out curve"
    lognorm = [math.log(r["params"]) for r in drawn]
    for r in drawn:
        pts = sorted((c["compute"], c["val_loss"]) for c in r["curve"])
        t = (math.log(r["params"]) - min(lognorm)) / max(1e-9, max(lognorm) - min(lognorm))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-", color=cmap(t), lw=0.7, alpha=0.7)
        ax.plot(r["compute"], r["val_loss"], ".", color=cmap(t))
    fr = an["frontier"]
    if fr:
        ax.plot([p["compute"] for p in fr], [p["best"] for p in fr], "k-", lw=1.8, label="frontier (monotone)")
        ax.legend(fontsize=8)
    ax.set(xscale="log", yscale="log", xlabel="training compute (FLOPs)", ylabel="held-out loss (nats/token)",
           title="Training curves (colour: log N), final points dotted")
    return None


def _lr(ax, an):
    groups = (an["lr_rule"] or {}).get("groups") or []
    if not groups:
        return "no learning-rate sweep in these runs (--lr, or none finished)"
    for i, g in enumerate(groups):
        pts = [(lr, v) for lr, v in zip(g["lrs"], g["losses"]) if v is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=f"C{i % 10}", lw=1,
                label=f"C={g['budget']:.2g} N={g['params'] / 1e6:.2f}M" + (f" ({g['edge']} edge)" if g.get("edge") else ""))
        ax.axvline(g["lr_opt"], color=f"C{i % 10}", ls=":", lw=1)
    ax.set(xscale="log", xlabel="peak learning rate", ylabel="held-out loss (nats/token)",
           title="Learning-rate sweep (dotted: fitted optimum)")
    ax.legend(fontsize=7)
    return None


def plots(an: dict, results: list[dict], out: Path) -> tuple[list[str], dict]:
    """Write the PNGs; returns their names and ``{name: why not}`` for those not drawn."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], {"*.png": "matplotlib is not installed"}
    sweep = [r for r in results if r["stage"] == "sweep" and r.get("val_loss") is not None]
    groups = fit.by_budget(sweep)
    cmap = plt.get_cmap("viridis")
    colour = {c: cmap(i / max(1, len(groups) - 1)) for i, c in enumerate(groups)}
    figures = {"isoflop.png": ((7, 5), 1, lambda ax: _isoflop(ax, an, groups, colour)),
               "optimal.png": ((11, 4.5), 2, lambda axes: _optimal(axes, an, groups)),
               "lnd_fit.png": ((5.5, 5), 1, lambda ax: _lnd(ax, an, groups, colour)),
               "curves.png": ((8, 5), 1, lambda ax: _curves(ax, an, sweep, plt.get_cmap("plasma"))),
               "lr_sweep.png": ((7, 5), 1, lambda ax: _lr(ax, an))}
    written, skipped = [], {}
    for name, (size, cols, draw) in figures.items():
        fig, axes = plt.subplots(1, cols, figsize=size)
        try:
            why = draw(axes)
            if why is None:
                for ax in np.atleast_1d(axes):
                    ax.grid(True, which="both", alpha=0.3)
                fig.savefig(out / name, dpi=110, bbox_inches="tight")
                written.append(name)
        except (ValueError, ArithmeticError) as exc:  # a degenerate subset matplotlib cannot scale
            why = f"{type(exc).__name__}: {exc}"
        finally:
            plt.close(fig)
        if why is not None:
            skipped[name] = why
            (out / name).unlink(missing_ok=True)  # a stale figure of an earlier report would mislead
    return written, skipped
