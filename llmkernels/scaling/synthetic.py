"""Synthetic IsoFLOP sweeps of known exponents (numpy, with ``surface``'s law and optimum; no
torch): the fits' tests and the design study (``benchmarks/scaling_design.py``) draw their runs
here.

A run's held-out loss is ``L(N, D) = E + A/N^alpha + B/D^beta`` (C = 6ND) times log-normal noise of
sd ``noise``, one draw a run (its curve shares it, as a trained model's quality would). ``draw``
places a budget's sizes evenly in log N around its optimum, ``Shape.spread`` x from the smallest to
the largest: exactly, or rounded to a ladder of sizes ``Shape.ladder`` x apart that every budget
shares (as ``plan.LADDER`` is: a size then recurs at several budgets, each time a schedule of its
own length). ``at_runs`` draws the losses at the sizes, budgets and curve points of existing runs
instead (a real sweep's design with a known truth).

A run's held-out curve (``Curves``) at a fraction ``f`` of its tokens lies above the law by
``excess·(N_opt(C)/N)^power·(1 + cos(pi·f))/2``: the cosine schedule's learning rate at ``f``
relative to its peak, the part a run stopped there has not annealed away, larger for a run with
more tokens a parameter than the optimum's; ``offset`` shifts every curve point (a curve evaluated on
another held-out subset than the final loss).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import surface

TRUTH_KEYS = ("E", "A", "B", "alpha", "beta")


@dataclass(frozen=True)
class Shape:
    """Where ``draw`` puts a sweep's runs: ``budgets`` log-spaced from ``lo`` to ``hi``, ``sizes`` a
    budget (see the module docstring); ``non_embedding``: the share of N without the embedding."""

    lo: float = 1e14
    hi: float = 1e16
    budgets: int = 8
    sizes: int = 9
    spread: float = 9.0
    ladder: float | None = None
    non_embedding: float = 0.9

    def __post_init__(self):
        if not 0 < self.lo <= self.hi or (self.budgets > 1 and self.lo == self.hi):
            raise ValueError(f"budgets need 0 < lo < hi, got lo={self.lo:g}, hi={self.hi:g}")
        if self.budgets < 1 or self.sizes < 1:
            raise ValueError(f"budgets and sizes must be >= 1, got {self.budgets} and {self.sizes}")
        if self.spread < 1 or (self.ladder is not None and self.ladder <= 1):
            raise ValueError(f"spread must be >= 1 and ladder > 1, got {self.spread} and {self.ladder}")


@dataclass(frozen=True)
class Curves:
    """A run's held-out curve: its ``fractions`` of the run and how far above the law they lie."""

    fractions: tuple = (0.1, 0.3, 0.6)
    excess: float = 0.02
    power: float = 0.0
    offset: float = 0.0

    def __post_init__(self):
        if any(not 0 < f <= 1 for f in self.fractions):
            raise ValueError(f"curve fractions must lie in (0, 1], got {self.fractions}")


def measured_curves(runs: list[dict], truth: dict) -> Curves:
    """``Curves`` as real runs' curves lie (``truth``: their fitted surface, for ``N_opt``):
    ``offset``, the mean of a run's last curve point less its final loss at the same compute (two
    held-out subsets); ``excess`` and ``power`` from each size's runs at two adjacent budgets, the
    later run's curve at the earlier run's compute less the earlier run's last curve point (one
    subset, one model's two schedules), fitted linear in ``log(N_opt/N)`` (the law's slope there)."""
    sweep = [r for r in runs if r.get("val_loss") is not None and r.get("curve")]
    offset = float(np.mean([r["curve"][-1]["val_loss"] - r["val_loss"] for r in sweep]))
    by = {}
    for r in sweep:
        by.setdefault(r["params"], {})[r["budget"]] = r
    budgets = sorted({r["budget"] for r in sweep})
    x, y, w = [], [], []
    for n, rs in by.items():
        for lo, hi in zip(budgets, budgets[1:]):
            if lo in rs and hi in rs:
                later = rs[hi]["curve"]
                f = rs[lo]["compute"] / rs[hi]["compute"]
                x.append(math.log(optimal_params(truth, hi) / n))
                y.append(float(np.interp(math.log(rs[lo]["compute"]), np.log([p["compute"] for p in later]),
                                         [p["val_loss"] for p in later])) - rs[lo]["curve"][-1]["val_loss"])
                w.append((1 + math.cos(math.pi * f)) / 2)
    if len(x) < 3:
        raise ValueError(f"runs: {len(x)} sizes at two adjacent budgets, at least 3 needed to measure the curves")
    slope, level = np.polyfit(x, y, 1)
    return Curves(fractions=tuple(p["compute"] / sweep[0]["compute"] for p in sweep[0]["curve"]),
                  excess=float(level / np.mean(w)), power=float(slope / level), offset=offset)


def _truth(truth: dict) -> dict:
    missing = [k for k in TRUTH_KEYS if k not in truth]
    if missing:
        raise ValueError(f"truth lacks {', '.join(missing)} (needs {', '.join(TRUTH_KEYS)})")
    return {k: float(truth[k]) for k in TRUTH_KEYS}


def exponents(truth: dict) -> tuple[float, float]:
    """The surface's ``(a, b)``: ``N_opt ∝ C^a``, ``D_opt ∝ C^b``."""
    best = surface.optimum(_truth(truth))
    return best["a"], best["b"]


def loss(truth: dict, n, d):
    return surface.predict3(_truth(truth), n, d)


def optimal_params(truth: dict, compute: float) -> float:
    """``N_opt(C)`` of the surface at C = 6ND."""
    best = surface.optimum(_truth(truth))
    return best["G"] * (compute / 6) ** best["a"]


def _sizes(truth: dict, compute: float, shape: Shape) -> list[float]:
    steps = np.linspace(-0.5, 0.5, shape.sizes) if shape.sizes > 1 else np.zeros(1)
    sizes = optimal_params(truth, compute) * shape.spread ** steps
    if shape.ladder is not None:
        r = math.log(shape.ladder)
        sizes = np.unique(np.exp(np.round(np.log(sizes) / r) * r))
    return [float(n) for n in sizes]


def _run(truth: dict, n: float, budget: float, compute: float, fractions, curves: Curves, factor: float) -> dict:
    """A run of ``n`` parameters and ``compute`` FLOPs at ``budget`` (its held-out curve at
    ``fractions`` of it)."""
    d = compute / (6 * n)
    excess = curves.excess * (optimal_params(truth, budget) / n) ** curves.power
    curve = [{"compute": compute * f, "tokens": d * f, "val_loss": float(
        (loss(truth, n, d * f) + excess * (1 + math.cos(math.pi * f)) / 2) * factor + curves.offset)}
        for f in fractions]
    return {"id": f"sweep-{budget:.3g}-{n:.4g}", "stage": "sweep", "budget": float(budget), "params": n,
            "tokens": d, "compute": float(compute), "val_loss": float(loss(truth, n, d) * factor),
            "name": f"N{n:.4g}", "curve": curve, "steps": 1000, "batch": 16}


def draw(truth: dict, noise: float, rng, shape: Shape = Shape(), curves: Curves = Curves()) -> list[dict]:
    """One sweep's runs (``shape``), with the fields the fits and the report read."""
    if noise < 0:
        raise ValueError(f"noise must be >= 0, got {noise}")
    runs = []
    for c in np.logspace(math.log10(shape.lo), math.log10(shape.hi), shape.budgets):
        for n in _sizes(truth, c, shape):
            run = _run(truth, n, float(c), float(c), curves.fractions, curves, math.exp(rng.normal(0, noise)))
            runs.append({**run, "non_embedding_params": shape.non_embedding * n})
    return runs


def at_runs(truth: dict, noise: float, rng, runs: list[dict], curves: Curves = Curves(),
            offsets: dict | None = None) -> list[dict]:
    """``runs`` (a real sweep's records) with losses drawn from ``truth``: each at its own size,
    budget and compute, its curve at its own curve points' fractions of the run (``curves.fractions``
    unused), its tokens those of C = 6ND, its loss times ``exp(offsets[name])`` where given (a size's
    own departure from the surface, the same at every budget); every other field kept."""
    if noise < 0:
        raise ValueError(f"noise must be >= 0, got {noise}")
    out = []
    for r in runs:
        points = r.get("curve") or []
        factor = math.exp(rng.normal(0, noise) + (offsets or {}).get(r["name"], 0.0))
        drawn = _run(truth, r["params"], r["budget"], r["compute"], [p["compute"] / r["compute"] for p in points],
                     curves, factor)
        out.append({**r, **{k: drawn[k] for k in ("val_loss", "tokens", "curve")}})
    return out
