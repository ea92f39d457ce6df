"""How wide must an IsoFLOP design be for a given interval on a, and is each approach unbiased on
a finished sweep's own design? Synthetic sweeps (``scaling.synthetic``) drawn from a finished
sweep's fitted surface ``L(N, D) = E + A/N^alpha + B/D^beta`` with its measured seed noise, fitted
(and bootstrapped) by the package's own code (``scaling.intervals``).

- ``--designs``: for each design, budgets log-spaced from LO to HI, ``--sizes`` sizes a budget
  spread ``--spread``x around the surface's optimum (as the windows of ``llmkernels scaling`` are),
  C = 6ND; the median 90% half-width of a for approaches 2 and 3 over ``--draws`` sweeps a design.
  A surface taken from real runs is smoother than they are (their residuals are not all noise), so
  compare designs with each other, not with a measured half-width. ``--ladder``: the runs the
  sweep itself would plan instead (the ladder's shapes; the upper windows centred on the surface's
  optimum; ``--span``: their width): where the ladder ends above a small budget's optimum, that
  budget tells less. ``--noise``: the seed sd when the report has no seed pairs (``--fit-from``).
- ``--bias DRAWS``: at the report's own runs (sizes, budgets, curve points), their curves placed as
  measured on them (``synthetic.measured_curves``); the mean and sd of each approach's a less the
  surface's, on the smooth surface and with each size's mean approach-3 residual of the report
  added to its runs (the sizes' own departures from the surface, the same at every budget).

    python benchmarks/scaling_design.py --designs 1e15,6e15,5 1e15,2e16,7 1e15,4e16,8
    python benchmarks/scaling_design.py --ladder --designs 2.236e14,2e16,10 2.236e14,2e16,14
    python benchmarks/scaling_design.py --report path/to/report.json --draws 5 --resamples 200
    python benchmarks/scaling_design.py --bias 100 --designs
    python benchmarks/scaling_design.py --report benchmarks/results/scaling-h200-2026-11-28-interim/e0/fit-from-1.26e15/surface.json \
        --noise 0.0125 --ladder --span 3 --designs 1e15,2e16,10 --draws 4 --resamples 200
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics

import numpy as np

from llmkernels.scaling import design as design_mod
from llmkernels.scaling import intervals, plan, surface, synthetic

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPORT = os.path.join(ROOT, "benchmarks", "results", "scaling-h200x4-2026-11-28", "seed1", "report.json")


def surface_of(report: dict, noise: float | None = None) -> tuple[dict, float]:
    """The report's approach-3 surface and one run's seed-to-seed standard deviation in log L
    (``noise`` when given: a report fitted without its seed pairs, ``--fit-from``, has none)."""
    analysis = report["analysis"]
    fit = analysis["approach3"]
    if not fit.get("ok"):
        raise SystemExit("the report's approach 3 did not fit: no surface to draw from")
    noise = noise if noise is not None else (analysis.get("seed_spread") or {}).get("per_run_sd_log")
    if noise is None:
        raise SystemExit("the report has no seed-to-seed spread (seed_spread.per_run_sd_log) to draw noise from: "
                         "give --noise")
    return {k: fit[k] for k in ("E", "A", "B", "alpha", "beta")}, float(noise)


def ladder_runs(truth: dict, design: tuple, sizes: int, span: float) -> list[dict]:
    """The IsoFLOP runs ``llmkernels scaling`` plans for ``design`` (the ladder's shapes, ``sizes`` a
    budget over ``span``), the upper budgets' windows centred on the surface's own optimum, as
    records to draw at."""
    lo, hi, budgets = design
    d = design_mod.Design(budget_lo=lo, budget_hi=hi, n_budgets=budgets, sizes_per_budget=sizes, span=span,
                          lower_budgets=min(budgets, design_mod.Design.lower_budgets))
    centres = {c: synthetic.optimal_params(truth, c) for c in d.budgets()[d.lower_budgets:]}
    models, hp, rule = plan.ladder_models(plan.BYTE_VOCAB), plan.HParams(), plan.LRRule()
    return [{"name": r.model.name, "params": r.model.total_params(), "non_embedding_params": r.model.non_embedding_params(),
             "budget": r.budget, "compute": r.compute, "tokens": r.tokens, "curve": []}
            for r in d.lower(models, rule, hp) + d.upper(models, rule, hp, centres) if r.stage == "sweep"]


def study(truth: dict, noise: float, design: tuple, args) -> dict:
    """Median half-widths of a (approaches 2 and 3) over ``args.draws`` sweeps of ``design``: sizes
    spread freely around the optimum, or (``args.ladder``) the sweep's own plan on the ladder."""
    lo, hi, budgets = design
    widths = {"a2_a": [], "a3_a": []}
    planned = ladder_runs(truth, design, args.sizes, args.span) if args.ladder else None
    for draw in range(args.draws):
        rng = np.random.default_rng(args.seed + draw)
        if planned is not None:
            runs = synthetic.at_runs(truth, noise, rng, planned)
        else:
            shape = synthetic.Shape(lo=lo, hi=hi, budgets=budgets, sizes=args.sizes, spread=args.spread,
                                    non_embedding=1.0)
            runs = synthetic.draw(truth, noise, rng, shape, synthetic.Curves(fractions=()))
        found = intervals.bootstrap(runs, intervals.fit_all(runs, noise_sd=noise), n=args.resamples, seed=draw,
                                    noise_sd=noise, processes=1)
        for key in widths:
            if found.get(key, {}).get("half_width") is not None:
                widths[key].append(found[key]["half_width"])
    return {"lo": lo, "hi": hi, "budgets": budgets, "runs": len(runs), "ladder": args.ladder,
            "compute": sum(r["compute"] for r in runs),
            **{f"{k}_half_width": statistics.median(v) if v else None for k, v in widths.items()}}


def bias(report: dict, truth: dict, noise: float, draws: int, seed: int) -> dict:
    """Each approach's a less the surface's at the report's own runs (see the module docstring):
    ``{"smooth" | "size offsets": {approach: {"mean", "sd"}}}`` over ``draws`` sweeps."""
    sweep = [r for r in report["runs"] if r["stage"] == "sweep" and r.get("val_loss") is not None]
    curves = synthetic.measured_curves(sweep, truth)
    a3 = surface.approach3(*([r[k] for r in sweep] for k in ("params", "tokens", "val_loss")))
    residuals = {}
    for r, v in zip(sweep, a3["residuals"]):
        residuals.setdefault(r["name"], []).append(v)
    a_true = synthetic.exponents(truth)[0]
    out = {"curves": {"excess": curves.excess, "power": curves.power, "offset": curves.offset}}
    for case, offsets in (("smooth", None), ("size offsets", {k: statistics.fmean(v) for k, v in residuals.items()})):
        errors = {k: [] for k in ("1", "2", "3")}
        for draw in range(draws):
            runs = synthetic.at_runs(truth, noise, np.random.default_rng(seed + draw), sweep, curves, offsets)
            found = intervals.estimates(intervals.fit_all(runs, noise_sd=noise))
            for k, v in errors.items():
                if found[f"a{k}_a"] is not None:
                    v.append(found[f"a{k}_a"] - a_true)
        out[case] = {k: {"mean": statistics.fmean(v), "sd": statistics.pstdev(v), "draws": len(v)}
                     for k, v in errors.items() if v}
    return out


def design_arg(text: str) -> tuple:
    lo, hi, count = text.split(",")
    return float(lo), float(hi), int(count)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--report", default=REPORT, help="a finished sweep's report.json (default: the H200 seed-1 sweep)")
    p.add_argument("--designs", nargs="*", type=design_arg, default=[(1e15, 6e15, 5), (1e15, 2e16, 7)],
                   metavar="LO,HI,BUDGETS")
    p.add_argument("--bias", type=int, default=0, metavar="DRAWS",
                   help="each approach's bias at the report's own runs over DRAWS sweeps (0: not run)")
    p.add_argument("--sizes", type=int, default=7)
    p.add_argument("--spread", type=float, default=6.0, help="largest over smallest size of a budget (free sizes)")
    p.add_argument("--span", type=float, default=design_mod.Design.span,
                   help="with --ladder: the windows' --span of llmkernels scaling (default: %(default)s)")
    p.add_argument("--noise", type=float, default=None, metavar="SD",
                   help="one run's seed sd in log L (default: the report's seed pairs)")
    p.add_argument("--ladder", action="store_true",
                   help="draw at the sweep's own plan (the ladder's shapes, its windows, the upper ones centred on "
                        "the surface's optimum) instead of sizes spread freely: where the ladder ends above a small "
                        "budget's optimum, that budget tells less")
    p.add_argument("--draws", type=int, default=3)
    p.add_argument("--resamples", type=int, default=200)
    p.add_argument("--seed", type=int, default=100)
    p.add_argument("--out", help="JSON of the results")
    args = p.parse_args(argv)
    with open(args.report) as f:
        report = json.load(f)
    truth, noise = surface_of(report, args.noise)
    found = bias(report, truth, noise, args.bias, args.seed) if args.bias else None
    if found:
        c = found["curves"]
        print(f"curves as measured on the report's runs: excess {c['excess']:.4f}, power {c['power']:.2f}, "
              f"offset {c['offset']:+.4f}", flush=True)
    for case, errors in (found or {}).items():
        if case != "curves":
            print(f"a less the surface's at the report's runs, {case} ({args.bias} draws): " + "; ".join(
                f"approach {k} {v['mean']:+.3f} (sd {v['sd']:.3f})" for k, v in errors.items()), flush=True)
    rows = []
    for design in args.designs:
        rows.append(study(truth, noise, design, args))
        r = rows[-1]
        print(f"{r['lo']:g}-{r['hi']:g}, {r['budgets']} budgets ({r['runs']} runs, {r['compute']:.3g} FLOPs): median half-width of a: "
              f"approach 3 {r['a3_a_half_width']}, approach 2 {r['a2_a_half_width']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"report": args.report, "truth": truth, "noise_sd_log": noise, "draws": args.draws,
                       "resamples": args.resamples, "sizes": args.sizes, "spread": args.spread, "span": args.span,
                       "designs": rows,
                       "bias": found}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
