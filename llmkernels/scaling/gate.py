"""The quality gate: whether a sweep's exponents are a result (numpy; no torch).

It passes only when each of its checks passes; a check without its evidence (no seed pairs, no
batch check, no bootstrap) is "not evaluated", and so is the gate then, never "passed".

1. Residuals: approach 3's residual rms in log L is at most ``RESIDUAL_FACTOR`` x one run's
   seed-to-seed standard deviation (log L). Larger residuals are structure the design put there,
   not noise, and no interval drawn from them is a result.
2. Agreement: the three approaches estimate the same a (and b) from the same runs. Every pair must
   (i) have overlapping intervals, ``|x_i - x_j| <= h_i + h_j`` with ``h`` the 90% half-widths (the
   rule the replicate comparison uses), and (ii) differ by at most ``AGREEMENT_TOLERANCE``, twice
   the half-width a quotable exponent may have, so that wide intervals cannot make approaches that
   disagree "agree".
3. Batch: at one budget (the design's default: the smallest, where the runs take the fewest steps
   and the batch matters most), half the batch (twice the steps) at a few sizes. Every difference
   ``B - B/2`` must lie within ``BATCH_SDS`` standard deviations of a seed pair's difference
   (``sqrt 2`` x one run's seed sd, in nats) or within ``BATCH_TOLERANCE``, whichever is larger:
   beyond that the batch changes the loss by more than noise explains, so the one-batch-a-budget
   rule shapes the IsoFLOP profiles.
4. Bootstrap: for every exponent, the resamples on which it could not be estimated are at most
   ``MAX_FAILED_SHARE`` of them, and the bootstrap's bias (median minus point) is at most its
   half-width: otherwise the estimator is unstable and its interval describes the resampling, not
   the estimate.
5. Noise: one run's seed-to-seed standard deviation (nats) is at most ``NOISE_SHARE`` of the median
   IsoFLOP depth (a budget's largest loss minus its smallest over its sizes). A parabola's minimum
   moves by about the noise over the depth, so noisier runs leave the optima to chance; runs still
   in a sudden drop of the loss (at byte level, the copy mechanisms forming) when their schedule ends
   are that noisy, and the smallest budget (where the seed pairs run) is the first to show it.
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from . import fit

RESIDUAL_FACTOR = 2.0
TARGET_HALF_WIDTH = 0.05  # the 90% half-width a quotable exponent may have
AGREEMENT_TOLERANCE = 2 * TARGET_HALF_WIDTH
BATCH_SDS = 3.0
BATCH_TOLERANCE = 0.03  # nats
MAX_FAILED_SHARE = 0.1
NOISE_SHARE = 0.4  # between a sweep that passed and one whose smallest budgets ended mid-drop (SCALING.md)
APPROACHES = ("1", "2", "3")


def _check(name: str, ok, reason: str, **extra) -> dict:
    return {"name": name, "ok": ok, "reason": reason, **extra}


def residuals(runs: list[dict], a3: dict, seed_spread: dict | None) -> dict:
    """Check 1; ``largest``: the five runs (of ``runs``, in the fit's order) with the largest residuals."""
    sd = (seed_spread or {}).get("per_run_sd_log")
    if not a3.get("ok"):
        return _check("residuals", None, "approach 3 did not fit: " + a3.get("warning", "no fit"), largest=[])
    order = np.argsort(-np.abs(a3["residuals"]))[:5]
    largest = [{"name": runs[i]["name"], "budget": runs[i]["budget"], "batch": runs[i].get("batch"),
                "steps": runs[i]["steps"], "residual": a3["residuals"][i]} for i in order]
    if not sd:
        return _check("residuals", None, "no seed pairs: the seed-to-seed spread is not measured, so the residuals "
                      "cannot be told from noise", largest=largest, residual_rms=a3["residual_rms"])
    ratio = a3["residual_rms"] / sd
    ok = bool(ratio <= RESIDUAL_FACTOR)
    worst = ", ".join(f"{r['name']} at {r['budget']:.3g} ({r['residual']:+.3f})" for r in largest[:3])
    reason = (f"approach 3's residual rms {a3['residual_rms']:.4f} in log L is {ratio:.1f}x one run's seed-to-seed "
              f"standard deviation ({sd:.4f}); at most {RESIDUAL_FACTOR:g}x passes"
              + ("" if ok else f": the misfit is structure, not noise (largest: {worst})"))
    return _check("residuals", ok, reason, largest=largest, residual_rms=a3["residual_rms"], seed_sd=sd, ratio=ratio)


def agreement(points: dict, intervals: dict | None) -> dict:
    """Check 2. ``points``: ``{"a1_a": ..., "a2_b": ...}`` (``intervals.estimates``); ``intervals``:
    the bootstrap's ``{key: interval}`` (None: not run)."""
    pairs, missing, bad, unknown = [], [], [], False
    for x in ("a", "b"):
        keys = [f"a{k}_{x}" for k in APPROACHES]
        missing += [k for k in keys if points.get(k) is None]
        for ki, kj in itertools.combinations([k for k in keys if points.get(k) is not None], 2):
            diff = abs(points[ki] - points[kj])
            hw = [((intervals or {}).get(k) or {}).get("half_width") for k in (ki, kj)]
            allowed = None if None in hw else hw[0] + hw[1]
            unknown |= allowed is None
            ok = diff <= AGREEMENT_TOLERANCE and (allowed is None or diff <= allowed)
            pairs.append({"pair": [ki, kj], "diff": diff, "sum_half_widths": allowed, "ok": ok})
            if not ok:
                bad.append(f"{x} of approaches {ki[1]} and {kj[1]}: {points[ki]:.3f} vs {points[kj]:.3f} differ by "
                           f"{diff:.3f}" + ("" if allowed is None else f" (sum of half-widths {allowed:.3f})"))
    rule = (f"every pair of approaches within the sum of their {round(100 * _level(intervals))}% half-widths and "
            f"within {AGREEMENT_TOLERANCE:g}")
    if bad:
        return _check("agreement", False, f"{rule}: not met, " + "; ".join(bad), pairs=pairs)
    if missing or unknown:
        why = (f"no estimate from {', '.join(sorted(set(missing)))}" if missing else "") + \
              ("; " if missing and unknown else "") + ("no bootstrap intervals" if unknown else "")
        return _check("agreement", None, f"{rule}: not evaluated ({why})", pairs=pairs)
    return _check("agreement", True, f"{rule}: met (largest difference {max(p['diff'] for p in pairs):.3f})",
                  pairs=pairs)


def _level(intervals: dict | None) -> float:
    return (intervals or {}).get("level", 0.9)


def budgets_of(spread: dict) -> str:
    """Where a paired check ran: "budget 5e+14" (or "budgets 5e+14, 3e+15")."""
    cs = sorted({s["budget"] for s in spread["sizes"]})
    return ("budget " if len(cs) == 1 else "budgets ") + ", ".join(f"{c:.3g}" for c in cs)


def batch(batch_spread: dict | None, seed_spread: dict | None) -> dict:
    """Check 3 from the paired differences ``B - B/2`` (``report._spread``) and the seed spread."""
    if not batch_spread:
        return _check("batch", None, "no batch-check runs")
    sd = (seed_spread or {}).get("per_run_sd")
    if not sd:
        return _check("batch", None, "no seed pairs to tell the batch's effect from noise")
    allowed = max(BATCH_TOLERANCE, BATCH_SDS * math.sqrt(2) * sd)
    worst = max(batch_spread["sizes"], key=lambda s: abs(s["diff"]))
    ok = bool(abs(worst["diff"]) <= allowed)
    reason = (f"B - B/2 at {batch_spread['n']} sizes of {budgets_of(batch_spread)}: largest |difference| {abs(worst['diff']):.4f} "
              f"nats ({worst['name']}); allowed max({BATCH_TOLERANCE:g}, {BATCH_SDS:g} x sqrt 2 x seed sd "
              f"{sd:.4f}) = {allowed:.4f}" + ("" if ok else ": the batch rule shapes the profiles"))
    return _check("batch", ok, reason, allowed=allowed)


def bootstrap(intervals: dict | None) -> dict:
    """Check 4 over the exponents that have a point estimate."""
    if not intervals:
        return _check("bootstrap", None, "no bootstrap (--bootstrap 0)")
    keys = [k for k in ("a1_a", "a1_b", "a2_a", "a2_b", "a3_a", "a3_b") if k in intervals]
    bad = []
    for k in keys:
        iv = intervals[k]
        share = iv["failed"] / max(1, intervals["resamples"])
        if share > MAX_FAILED_SHARE or iv["half_width"] is None:
            bad.append(f"{k}: not estimable on {share:.0%} of resamples")
        elif abs(iv["bias"]) > iv["half_width"]:
            bad.append(f"{k}: bootstrap median {iv['median']:.3f} is {abs(iv['bias']):.3f} from the point {iv['point']:.3f}, "
                       f"more than the half-width {iv['half_width']:.3f}")
    rule = f"every exponent estimable on >= {1 - MAX_FAILED_SHARE:.0%} of resamples, |bias| <= half-width"
    if bad:
        return _check("bootstrap", False, f"{rule}: not met, " + "; ".join(bad))
    if not keys:
        return _check("bootstrap", None, f"{rule}: no exponent to check")
    return _check("bootstrap", True, f"{rule}: met ({intervals['resamples']} resamples)")


def noise(runs: list[dict], seed_spread: dict | None) -> dict:
    """Check 5 over the IsoFLOP ``runs`` (each with ``budget`` and ``val_loss``) and the seed spread."""
    sd = (seed_spread or {}).get("per_run_sd")
    if not sd:
        return _check("noise", None, "no seed pairs: the seed-to-seed spread is not measured")
    losses = [[r["val_loss"] for r in rs] for rs in fit.by_budget(runs).values()]
    depths = [max(v) - min(v) for v in losses if len(v) >= 3]
    if not depths:
        return _check("noise", None, "no budget with 3 sizes or more: no IsoFLOP depth to compare with")
    depth = float(np.median(depths))
    ok = bool(sd <= NOISE_SHARE * depth)
    reason = (f"one run's seed sd {sd:.4f} nats ({budgets_of(seed_spread)}) is {sd / depth:.2f} of the median IsoFLOP "
              f"depth {depth:.4f} over {len(depths)} budgets; at most {NOISE_SHARE:g} passes"
              + ("" if ok else ": the optima are left to chance; a loss still dropping suddenly at the end of the "
                               "smallest budgets' schedules does this: raise the smallest budget"))
    return _check("noise", ok, reason, seed_sd=sd, depth=depth)


def quality_gate(checks: list[dict]) -> dict:
    """``ok``: False when a check fails, else None when one is not evaluated, else True."""
    failed = [c for c in checks if c["ok"] is False]
    pending = [c for c in checks if c["ok"] is None]
    ok = False if failed else None if pending else True
    return {"ok": ok, "checks": checks, "failed": [c["name"] for c in failed],
            "not_evaluated": [c["name"] for c in pending]}
