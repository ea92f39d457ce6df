"""How wide must an IsoFLOP design be for a given interval on a? Synthetic sweeps drawn from a
finished sweep's fitted surface ``L(N, D) = E + A/N^alpha + B/D^beta`` with its measured seed noise,
each fitted and bootstrapped by the package's own code (``scaling.intervals``), for each design:
budgets log-spaced from LO to HI, ``--sizes`` sizes a budget spread ``--spread``x around the
surface's optimum (as the windows of ``llmkernels scaling`` are), C = 6ND. Prints, and writes as
JSON, the median 90% half-width of a for approaches 2 and 3 over ``--draws`` sweeps a design.

A surface taken from real runs is smoother than they are (their residuals are not all noise), so
compare designs with each other, not with a measured half-width.

    python benchmarks/scaling_design.py --designs 1e15,6e15,5 1e15,2e16,7 1e15,4e16,8
    python benchmarks/scaling_design.py --report path/to/report.json --draws 5 --resamples 200
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics

import numpy as np

from llmkernels.scaling import intervals

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPORT = os.path.join(ROOT, "benchmarks", "results", "scaling-h200x4-2026-11-28", "seed1", "report.json")


def surface_of(report: dict) -> tuple[dict, float]:
    """The report's approach-3 surface and one run's seed-to-seed standard deviation in log L."""
    analysis = report["analysis"]
    fit = analysis["approach3"]
    if not fit.get("ok"):
        raise SystemExit("the report's approach 3 did not fit: no surface to draw from")
    noise = (analysis.get("seed_spread") or {}).get("per_run_sd_log")
    if noise is None:
        raise SystemExit("the report has no seed-to-seed spread (seed_spread.per_run_sd_log) to draw noise from")
    return {k: fit[k] for k in ("E", "A", "B", "alpha", "beta")}, float(noise)


def draw_sweep(truth: dict, noise: float, lo: float, hi: float, budgets: int, sizes: int, spread: float,
               rng) -> list[dict]:
    """One synthetic sweep's runs (the fields the fits read), log-normal noise of sd ``noise``."""
    e, a, b, al, be = (truth[k] for k in ("E", "A", "B", "alpha", "beta"))
    g = (al * a / (be * b)) ** (1 / (al + be))
    runs = []
    for c in np.logspace(math.log10(lo), math.log10(hi), budgets):
        n_opt = g * (c / 6) ** (be / (al + be))
        for k in np.linspace(-0.5, 0.5, sizes):
            n = n_opt * spread ** k
            d = c / (6 * n)
            loss = (e + a * n ** -al + b * d ** -be) * math.exp(rng.normal(0, noise))
            runs.append({"id": f"sweep-{c:.3g}-{n:.4g}", "stage": "sweep", "budget": float(c), "params": n,
                         "non_embedding_params": n, "tokens": d, "compute": float(c), "val_loss": loss,
                         "name": f"N{n:.4g}", "curve": [], "steps": 1, "batch": 1})
    return runs


def study(truth: dict, noise: float, design: tuple, args) -> dict:
    """Median half-widths of a (approaches 2 and 3) over ``args.draws`` sweeps of ``design``."""
    lo, hi, budgets = design
    widths = {"a2_a": [], "a3_a": []}
    for draw in range(args.draws):
        runs = draw_sweep(truth, noise, lo, hi, budgets, args.sizes, args.spread, np.random.default_rng(args.seed + draw))
        found = intervals.bootstrap(runs, intervals.fit_all(runs, noise_sd=noise), n=args.resamples, seed=draw,
                                    noise_sd=noise, processes=1)
        for key in widths:
            if found.get(key, {}).get("half_width") is not None:
                widths[key].append(found[key]["half_width"])
    return {"lo": lo, "hi": hi, "budgets": budgets, "runs": budgets * args.sizes,
            **{f"{k}_half_width": statistics.median(v) if v else None for k, v in widths.items()}}


def design_arg(text: str) -> tuple:
    lo, hi, count = text.split(",")
    return float(lo), float(hi), int(count)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--report", default=REPORT, help="a finished sweep's report.json (default: the H200 seed-1 sweep)")
    p.add_argument("--designs", nargs="+", type=design_arg, default=[(1e15, 6e15, 5), (1e15, 2e16, 7)],
                   metavar="LO,HI,BUDGETS")
    p.add_argument("--sizes", type=int, default=7)
    p.add_argument("--spread", type=float, default=6.0, help="largest over smallest size of a budget")
    p.add_argument("--draws", type=int, default=3)
    p.add_argument("--resamples", type=int, default=200)
    p.add_argument("--seed", type=int, default=100)
    p.add_argument("--out", help="JSON of the results")
    args = p.parse_args(argv)
    with open(args.report) as f:
        truth, noise = surface_of(json.load(f))
    rows = []
    for design in args.designs:
        rows.append(study(truth, noise, design, args))
        r = rows[-1]
        print(f"{r['lo']:g}-{r['hi']:g}, {r['budgets']} budgets ({r['runs']} runs): median half-width of a: "
              f"approach 3 {r['a3_a_half_width']}, approach 2 {r['a2_a_half_width']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"report": args.report, "truth": truth, "noise_sd_log": noise, "draws": args.draws,
                       "resamples": args.resamples, "sizes": args.sizes, "spread": args.spread, "designs": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
