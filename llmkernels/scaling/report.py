"""The report of a sweep: ``analyse`` runs every fit and check over the finished runs (any subset of
them), ``write`` writes ``report.json`` (every run), ``report.md`` (``markdown``) and the figures
(``figures``) into the output folder. Every number the report states is computed here from the
runs it describes. No torch here.

The quoted exponents (``HEADLINE``) are approach 3's: it fits every IsoFLOP run at once, where
approaches 1 and 2 use only the runs that reach the envelope or lie near each budget's minimum,
and its a and b are tied (a + b = 1), as in Besiroglu et al.'s re-fit. The quality gate requires
all three approaches to agree (``gate``), so the choice cannot hide a disagreement.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from . import envelope, fit, gate, intervals, surface
from .figures import plots
from .markdown import markdown

HEADLINE = "3"
EXTRAPOLATION_TARGET = 0.02  # nats/token: the held-out top budget's optimal loss, predicted
RUN_FIELDS = ("name", "stage", "budget", "seed", "params", "non_embedding_params", "tokens", "compute", "batch",
              "steps", "lr", "val_loss", "curve")


def _pairs(a: list[dict], b: list[dict]) -> list[tuple[dict, dict]]:
    by_key = {(r["budget"], r["name"]): r for r in b}
    return [(r, by_key[(r["budget"], r["name"])]) for r in sorted(a, key=lambda r: (r["budget"], r["params"]))
            if (r["budget"], r["name"]) in by_key]


def _spread(pairs) -> dict | None:
    """Differences of paired losses: mean, standard deviation, and one run's standard deviation
    implied by them (``rms(diff) / sqrt 2``), in nats and in log L (the approach-3 fit's scale)."""
    if not pairs:
        return None
    d = [x["val_loss"] - y["val_loss"] for x, y in pairs]
    dl = [math.log(x["val_loss"] / y["val_loss"]) for x, y in pairs]
    return {"n": len(d), "mean_diff": statistics.fmean(d), "max_abs_diff": max(abs(v) for v in d),
            "sd_diff": statistics.stdev(d) if len(d) > 1 else None,
            "rms_diff": math.sqrt(statistics.fmean(v * v for v in d)),
            "per_run_sd": math.sqrt(statistics.fmean(v * v for v in d) / 2),
            "per_run_sd_log": math.sqrt(statistics.fmean(v * v for v in dl) / 2),
            "sizes": [{"name": x["name"], "budget": x["budget"], "params": x["params"], "a": x["val_loss"],
                       "b": y["val_loss"], "diff": x["val_loss"] - y["val_loss"],
                       "speedup": y["train_seconds"] / x["train_seconds"] if x["train_seconds"] > 0 else None}
                      for x, y in pairs]}


def _span(values) -> list | None:
    values = [v for v in values if v is not None]
    return [min(values), max(values)] if values else None


def design_summary(results: list[dict], sweep: list[dict]) -> dict:
    """What the runs were: counts by stage, the IsoFLOP grid's budgets, sizes, tokens, batches and
    seeds, and the models' shares of embedding parameters and attention FLOPs."""
    stages = {}
    for r in results:
        stages[r["stage"]] = stages.get(r["stage"], 0) + 1
    groups = fit.by_budget(sweep)
    models = {r["name"]: r for r in sweep}
    seq = {r["model"]["seq_len"] for r in sweep if "model" in r}
    return {
        "runs": len(results), "by_stage": stages, "budgets": sorted(groups), "sizes": len(models),
        "sizes_per_budget": _span(len(rs) for rs in groups.values()), "params": _span(r["params"] for r in sweep),
        "tokens": _span(r["tokens"] for r in sweep),
        "tokens_per_param": _span(r["tokens"] / r["params"] for r in sweep),
        "batch_by_budget": {f"{c:.3g}": sorted({r["train"]["batch_size"] for r in rs}) for c, rs in groups.items()},
        "seeds": sorted({r["seed"] for r in sweep}), "check_seeds": sorted({r["seed"] for r in results if r["stage"] == "seed"}),
        "seq_len": sorted(seq), "vocab": sorted({r["model"]["vocab_size"] for r in sweep if "model" in r}),
        "embedding_share": _span(r.get("embedding_params", r["params"] - r["non_embedding_params"]) / r["params"]
                                 for r in models.values()),
        "attention_share": _span(_attention_share(r) for r in models.values()),
        "beta2": sorted({r["train"]["beta2"] for r in sweep if "beta2" in r.get("train", {})}),
        "min_lr_ratio": sorted({r["train"]["min_lr_ratio"] for r in sweep if "min_lr_ratio" in r.get("train", {})}),
        "warmup_share": _span(r["train"]["warmup_steps"] / r["steps"] for r in sweep if "warmup_steps" in r.get("train", {})),
    }


def _attention_share(r: dict) -> float | None:
    """The attention term's share of a run's FLOPs a token (``plan.ModelConfig.flops_per_token``)."""
    m = r.get("model")
    if not m or not r.get("flops_per_token"):
        return None
    return 6 * m["n_layers"] * m["seq_len"] * m["width"] / r["flops_per_token"]


def throughput(results: list[dict]) -> list[dict]:
    """Per model size and batch (kernels backend, runs with a measured MFU): the median tokens/s and
    MFU over its runs, and the peak they are measured against."""
    rows = {}
    for r in results:
        if r.get("mfu") is None or r.get("backend") != "kernels" or r.get("val_loss") is None:
            continue
        rows.setdefault((r["params"], r["name"], r["train"]["batch_size"]), []).append(r)
    out = []
    for (params, name, batch), rs in sorted(rows.items()):
        out.append({"name": name, "params": params, "batch": batch, "runs": len(rs), "steps": sum(r["steps"] for r in rs),
                    "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                    "mfu": statistics.median(r["mfu"] for r in rs), "mfu_max": max(r["mfu"] for r in rs),
                    "peak_flops": rs[0].get("peak_flops") or rs[0]["tflops"] * 1e12 / rs[0]["mfu"],
                    "flops_per_token": rs[0].get("flops_per_token")})
    return out


def headline(ivals: dict | None, points: dict, gate_: dict, extrapolation: dict, unfinished: int = 0) -> dict:
    """The quoted a and b (approach ``HEADLINE``), whether they are quotable (the sweep finished:
    no ``unfinished`` run left; the gate passed; each 90% half-width within
    ``gate.TARGET_HALF_WIDTH``) and the extrapolation's error against ``EXTRAPOLATION_TARGET``."""
    keys = {x: f"a{HEADLINE}_{x}" for x in ("a", "b")}
    iv = {x: (ivals or {}).get(k) or {"point": points.get(k), "half_width": None} for x, k in keys.items()}
    precise = all(v["half_width"] is not None and v["half_width"] <= gate.TARGET_HALF_WIDTH for v in iv.values())
    err = extrapolation.get("approach3_error")
    return {"approach": HEADLINE, "a": iv["a"], "b": iv["b"], "precise": precise,
            "quotable": bool(gate_["ok"]) and precise and not unfinished, "unfinished": unfinished,
            "target_half_width": gate.TARGET_HALF_WIDTH,
            "extrapolation_error": err, "extrapolation_target": EXTRAPOLATION_TARGET,
            "extrapolation_ok": None if err is None else abs(err) <= EXTRAPOLATION_TARGET}


def analyse(results: list[dict], lr_rule: dict | None, meta: dict, n_boot: int, fit_from: float | None = None,
            unfinished: int = 0) -> dict:
    """Every fit and check over the finished runs (``results``: run records with ``stage``; any
    subset, diverged runs left out of the fits and listed). ``fit_from``: fit only the budgets from
    this one up; the IsoFLOP runs below it stay in the runs' table and are counted as not fitted.
    ``unfinished``: the runs of the sweep's plan not trained yet (none quotable while any is left)."""
    valid = [r for r in results if r.get("val_loss") is not None]
    isoflop = [r for r in valid if r["stage"] == "sweep"]
    sweep = [r for r in isoflop if fit_from is None or r["budget"] >= fit_from * (1 - 1e-6)]
    stage = {k: [r for r in valid if r["stage"] == k] for k in ("seed", "batch", "backend")}
    seed_spread = _spread(_pairs(sweep, stage["seed"]))
    noise = (seed_spread or {}).get("per_run_sd")
    fits = intervals.fit_all(sweep, noise)
    a3 = fits["approach3"]
    points = intervals.estimates(fits)
    ivals = intervals.bootstrap(sweep, fits, n_boot, noise_sd=noise) if n_boot > 0 and sweep else None
    batch = _spread(_pairs(sweep, stage["batch"]))
    gate_ = gate.quality_gate([gate.residuals(sweep, a3, seed_spread), gate.agreement(points, ivals),
                               gate.batch(batch, seed_spread), gate.bootstrap(ivals), gate.noise(sweep, seed_spread)])
    cols = [[r[k] for r in sweep] for k in ("params", "tokens", "val_loss")]
    extrapolation = intervals.extrapolation(sweep)
    bigram = (meta.get("baselines") or {}).get("bigram")
    return {
        **fits, "runs": len(sweep), "budgets": len(fit.by_budget(sweep)), "fit_from": fit_from,
        "not_fitted": sorted({r["budget"] for r in isoflop} - {r["budget"] for r in sweep}),
        "diverged": [r["id"] for r in results if r not in valid], "estimates": points, "intervals": ivals,
        "gate": gate_, "headline": headline(ivals, points, gate_, extrapolation, unfinished),
        "e_profile": surface.profile_e(*cols, a3), "loss_law": fit.optimal_loss_law(fits["approach2"]["optima"]),
        "frontier": envelope.frontier(sweep), "extrapolation": extrapolation, "lr_rule": lr_rule,
        "seed_spread": seed_spread, "batch_check": batch, "backend_check": _spread(_pairs(sweep, stage["backend"])),
        "design": design_summary(results, sweep), "throughput": throughput(results),
        "smallest_vs_bigram": None if bigram is None or not sweep else min(bigram - r["val_loss"] for r in sweep),
        "train_seconds": sum(r["train_seconds"] for r in results), "wall_seconds": sum(r["wall_seconds"] for r in results),
        "max_epochs": max((r["epochs"] for r in results), default=None),
    }


def write(info: dict, results: list[dict], lr_rule: dict | None, meta: dict, out: Path, n_boot: int,
          fit_from: float | None = None, centres: dict | None = None, unfinished: int = 0) -> dict:
    """report.md, report.json and the figures in ``out``; ``centres`` (the upper windows as
    ``centres.json`` saved them) goes into report.json as it is, so that a sweep restored from its
    report plans the same runs; ``unfinished``: as ``analyse`` takes it."""
    an = analyse(results, lr_rule, meta, n_boot, fit_from, unfinished)
    an["figures"], an["figures_skipped"] = plots(an, results, out)
    runs = [{**{k: r.get(k) for k in RUN_FIELDS}, "batch": r["train"]["batch_size"], "lr": r["train"]["lr"],
             **{k: v for k, v in r.items() if k not in ("history", "key")}} for r in results]
    report = {"info": info, "data": meta, "analysis": an, "runs": runs, **({"centres": centres} if centres else {})}
    # (compact: the machine's record and a resumed sweep's state, committed beside report.md, the reader's)
    (out / "report.json").write_text(json.dumps(report, separators=(",", ":"), default=float) + "\n")
    (out / "report.md").write_text(markdown(info, an, results, meta))
    return an
