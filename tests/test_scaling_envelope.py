"""Approach 1 (llmkernels.scaling.envelope) and the synthetic sweeps the fits are tested on
(llmkernels.scaling.synthetic): known exponents, fresh noise each run, no training."""
import json
import math
import os

import numpy as np
import pytest

from llmkernels.scaling import envelope, intervals, synthetic

SEED1 = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "scaling-h200x4-2026-11-28", "seed1",
                     "report.json")
TRUTH = {"E": 0.45, "A": 110.0, "B": 32000.0, "alpha": 0.45, "beta": 0.68}
LADDER = synthetic.Shape(lo=1e15, hi=6e15, budgets=5, sizes=7, spread=4.84, ladder=1.2)


@pytest.fixture
def seed():
    """Fresh noise each run: a new seed, named in the failure messages."""
    return int(np.random.SeedSequence().entropy % 2**32)


def _committed_sweep():
    report = json.load(open(SEED1))
    truth = {k: report["analysis"]["approach3"][k] for k in synthetic.TRUTH_KEYS}
    return [r for r in report["runs"] if r["stage"] == "sweep" and r["val_loss"] is not None], truth


def test_approach1_on_the_h200_design_whatever_the_curves(seed):
    """Losses of known exponent at the committed H200 seed-1 sweep's own runs, their curves placed as
    measured on those runs: a curve point mid-schedule lies above a run that ends there, by less for
    larger models, and on another held-out subset than the final loss. An envelope of the training
    curves picks sizes by their schedules' state (here its a came out 0.27 low, its optima up to
    twice the truth's between budgets); approach 1 compares only finished schedules: a and b within
    0.03, every optimum within 5% of N_opt(C), and poisoned curves change nothing."""
    real, truth = _committed_sweep()
    curves = synthetic.measured_curves(real, truth)
    assert curves.power > 0 and curves.offset < 0 and curves.fractions[-1] == pytest.approx(1.0)
    rng = np.random.default_rng(seed)
    runs = synthetic.at_runs(truth, 0.0003, rng, real, curves)
    assert [(r["params"], r["budget"], r["compute"]) for r in runs] == [(r["params"], r["budget"], r["compute"])
                                                                       for r in real]
    fits = intervals.fit_all(runs)
    a1, beta = fits["approach1"], fits["approach3"]["beta"]
    a_true, b_true = synthetic.exponents(truth)
    assert a1["a"] == pytest.approx(a_true, abs=0.03) and a1["b"] == pytest.approx(b_true, abs=0.03), (seed, a1)
    assert a1["between"] > 200 and a1["several"] >= 5 and a1["beta"] == beta
    for p in envelope.envelope_optima(runs, beta):
        assert p["params"] / synthetic.optimal_params(truth, p["compute"]) == pytest.approx(1.0, abs=0.05), (seed, p)
    poisoned = [{**r, "curve": [{**c, "val_loss": float(rng.uniform(0.1, 5))} for c in r["curve"]]} for r in runs]
    assert envelope.approach1(poisoned, beta)["a"] == a1["a"]


def test_approach1_interpolates_between_schedule_lengths():
    """On a ladder a size recurs at several budgets. Between two of them its loss follows the data
    term, linear in D^-beta: exact for the surface (linear in log C it would overstate the convex
    loss); the envelope's optima lie within 3% of the truth and a, b within 0.01 without noise."""
    runs = synthetic.draw(TRUTH, 0.0, np.random.default_rng(0), LADDER, synthetic.Curves(fractions=()))
    sizes = envelope.horizons(runs)
    several = {n: h for n, h in sizes.items() if h["log_c"].size > 1}
    assert len(several) >= 5
    for n, h in several.items():
        mid = (h["log_c"][0] + h["log_c"][1]) / 2
        loss, log_d = envelope.at(h, mid, TRUTH["beta"])
        truth = float(synthetic.loss(TRUTH, n, math.exp(mid) / (6 * n)))
        assert loss == pytest.approx(truth, rel=1e-12) and log_d == pytest.approx(math.log(math.exp(mid) / (6 * n)))
        assert np.interp(mid, h["log_c"], h["loss"]) > truth + 1e-4  # the chord lies above a convex curve
        assert envelope.at(h, h["log_c"][0] - 0.01, TRUTH["beta"]) is None  # no extrapolation past a horizon
    a1 = envelope.approach1(runs, TRUTH["beta"])
    a_true, b_true = synthetic.exponents(TRUTH)
    assert a1["a"] == pytest.approx(a_true, abs=0.01) and a1["b"] == pytest.approx(b_true, abs=0.01), a1
    assert a1["between"] > 200 and a1["smoothed"] > 0.9 * a1["points"]
    for p in envelope.envelope_optima(runs, TRUTH["beta"]):
        assert p["params"] / synthetic.optimal_params(TRUTH, p["compute"]) == pytest.approx(1.0, abs=0.03), p


def test_approach1_says_why_it_has_no_estimate(seed):
    """Without approach 3's beta, or with fewer than three sizes, approach 1 gives no a and says why; a
    resample that repeats a run (the bootstrap's) counts it once at its budget."""
    runs = synthetic.draw(TRUTH, 0.01, np.random.default_rng(seed), LADDER)
    none = envelope.approach1(runs, None)
    assert none["a"] is None and "beta" in none["warning"] and none["sizes"] > 0
    two = [r for r in runs if r["params"] in sorted({r["params"] for r in runs})[:2]]
    assert envelope.approach1(two, TRUTH["beta"])["a"] is None
    doubled = runs + runs[:3]
    assert envelope.approach1(doubled, TRUTH["beta"])["a"] == envelope.approach1(runs, TRUTH["beta"])["a"]


def test_synthetic_sweeps_and_their_arguments(seed):
    """The generator's designs: sizes around each budget's optimum, recurring on a ladder; N_opt is
    the IsoFLOP minimum of the surface; curves above the law by the schedule's remaining rate; bad
    arguments named."""
    rng = np.random.default_rng(seed)
    exact = synthetic.draw(TRUTH, 0.0, rng, synthetic.Shape(budgets=3, sizes=5, spread=4.0))
    assert len(exact) == 15 and len({r["params"] for r in exact}) == 15
    ladder = synthetic.draw(TRUTH, 0.0, rng, LADDER)
    assert len({r["params"] for r in ladder}) < len(ladder)  # sizes recur at several budgets
    c = 3e15
    n_opt = synthetic.optimal_params(TRUTH, c)
    ns = n_opt * np.exp(np.linspace(-0.5, 0.5, 101))
    assert ns[np.argmin(synthetic.loss(TRUTH, ns, c / (6 * ns)))] == pytest.approx(n_opt, rel=0.011)
    a, b = synthetic.exponents(TRUTH)
    assert a + b == pytest.approx(1.0) and a == pytest.approx(TRUTH["beta"] / (TRUTH["alpha"] + TRUTH["beta"]))
    r = synthetic.draw(TRUTH, 0.0, rng, synthetic.Shape(budgets=1, lo=c, hi=c, sizes=1),
                       synthetic.Curves(fractions=(0.5, 1.0), excess=0.04, offset=-0.01))[0]
    law = synthetic.loss(TRUTH, r["params"], r["tokens"] / 2)
    assert r["curve"][0]["val_loss"] == pytest.approx(law + 0.02 - 0.01) and r["curve"][0]["compute"] == pytest.approx(c / 2)
    assert r["curve"][1]["val_loss"] == pytest.approx(r["val_loss"] - 0.01)
    for bad, word in ((lambda: synthetic.Shape(lo=2.0, hi=1.0), "lo"), (lambda: synthetic.Shape(sizes=0), "sizes"),
                      (lambda: synthetic.Shape(ladder=1.0), "ladder"), (lambda: synthetic.Curves(fractions=(1.5,)), "fractions"),
                      (lambda: synthetic.draw(TRUTH, -0.1, rng), "noise"), (lambda: synthetic.draw({"E": 1}, 0.0, rng), "truth")):
        with pytest.raises(ValueError, match=word):
            bad()
