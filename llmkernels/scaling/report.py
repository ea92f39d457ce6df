"""The report of a sweep: every fit and check as JSON, a Markdown summary, and the figures.

``analyse`` runs the fits (``fit``) over the finished runs; ``write`` writes ``report.json``,
``report.md`` and (with matplotlib) ``isoflop.png``, ``optimal.png``, ``lnd_fit.png``,
``curves.png`` and ``lr_sweep.png`` into the output folder. No torch here.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np

from . import fit
from .data import bits_per_byte
from .plan import PUBLISHED


def _pairs(a: list[dict], b: list[dict]) -> list[tuple[dict, dict]]:
    by_name = {r["name"]: r for r in b}
    return [(r, by_name[r["name"]]) for r in sorted(a, key=lambda r: r["params"]) if r["name"] in by_name]


def _spread(pairs) -> dict | None:
    """Differences of paired losses: mean, standard deviation, and the standard deviation of one
    run's loss implied by them (``sd(diff) / sqrt 2``, or ``rms(diff) / sqrt 2`` from the seeds)."""
    if not pairs:
        return None
    d = [x["val_loss"] - y["val_loss"] for x, y in pairs]
    return {"n": len(d), "mean_diff": statistics.fmean(d), "max_abs_diff": max(abs(v) for v in d),
            "sd_diff": statistics.stdev(d) if len(d) > 1 else None,
            "rms_diff": math.sqrt(statistics.fmean(v * v for v in d)),
            "per_run_sd": math.sqrt(statistics.fmean(v * v for v in d) / 2),
            "sizes": [{"name": x["name"], "params": x["params"], "a": x["val_loss"], "b": y["val_loss"],
                       "diff": x["val_loss"] - y["val_loss"],
                       "speedup": y["train_seconds"] / x["train_seconds"] if x["train_seconds"] > 0 else None}
                      for x, y in pairs]}


def analyse(results: list[dict], lr_rule: dict | None, meta: dict, n_boot: int) -> dict:
    """Every fit and check over the finished runs (``results``: run records with ``stage``)."""
    sweep = [r for r in results if r["stage"] == "sweep"]
    a2 = fit.approach2(sweep)
    a3 = fit.approach3([r["params"] for r in sweep], [r["tokens"] for r in sweep], [r["val_loss"] for r in sweep]) \
        if len(sweep) >= 5 else {"ok": False, "warning": "fewer than 5 runs"}
    out = {
        "runs": len(sweep), "budgets": len(fit.by_budget(sweep)),
        "approach1": fit.approach1(sweep), "approach2": a2, "approach3": a3,
        "loss_law": fit.optimal_loss_law(a2["optima"]),
        "frontier": fit.frontier(sweep),
        "extrapolation": fit.extrapolation(sweep),
        "bootstrap": fit.bootstrap(sweep, n_boot, approach3_fit=a3) if n_boot > 0 and sweep else None,
        "lr_rule": lr_rule, "published": PUBLISHED,
    }
    check_budgets = {r["budget"] for r in results if r["stage"] in ("seed", "backend")}
    base = [r for r in sweep if r["budget"] in check_budgets]
    out["seed_spread"] = _spread(_pairs(base, [r for r in results if r["stage"] == "seed"]))
    out["backend_check"] = _spread(_pairs(base, [r for r in results if r["stage"] == "backend"]))
    bigram = (meta.get("baselines") or {}).get("bigram")
    out["smallest_vs_bigram"] = None if bigram is None or not sweep else \
        min(bigram - r["val_loss"] for r in sweep)
    out["train_seconds"] = sum(r["train_seconds"] for r in results)
    out["wall_seconds"] = sum(r["wall_seconds"] for r in results)
    out["max_epochs"] = max((r["epochs"] for r in results), default=None)
    return out


# --------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------
def _ci(boot: dict | None, key: str) -> str:
    if not boot or key not in boot:
        return "n/a"
    return f"[{boot[key]['lo']:.3f}, {boot[key]['hi']:.3f}]"


def _f(v, fmt=".3f") -> str:
    return "n/a" if v is None else format(v, fmt)


def _runs_table(results: list[dict], meta: dict) -> list[str]:
    tpb = meta["val_tokens_per_byte"]
    bigram = (meta.get("baselines") or {}).get("bigram")
    lines = ["| stage | budget | size | N total | N non-emb | tokens D | epochs | batch | steps | lr | loss (nats/tok) "
             "| bits/byte | bigram - loss | tok/s | MFU | s |", "|" + " --- |" * 16]
    for r in sorted(results, key=lambda r: (r["stage"] != "sweep", r["stage"], r["budget"], r["params"], r["seed"])):
        lines.append(
            f"| {r['stage']}{'' if r['backend'] == 'kernels' else ' (' + r['backend'] + ')'}"
            f"{' s' + str(r['seed']) if r['stage'] == 'seed' else ''} | {r['budget']:.3g} | {r['name']} "
            f"| {r['params']:,} | {r['non_embedding_params']:,} | {r['tokens'] / 1e6:.1f}M | {r['epochs']:.2f} "
            f"| {r['train']['batch_size']} | {r['steps']} | {r['train']['lr']:.2e} | {r['val_loss']:.4f} "
            f"| {bits_per_byte(r['val_loss'], tpb):.4f} | {_f(None if bigram is None else bigram - r['val_loss'])} "
            f"| {r['tokens_per_s']:,.0f} | {_f(r['mfu'], '.1%')} | {r['train_seconds']:.1f} |")
    return lines


def _bigram_sentence(margin) -> str:
    if margin is None:
        return ""
    if margin > 0:
        return f"Every IsoFLOP run beats the bigram, the closest by {margin:.3f} nats/token."
    return f"Some IsoFLOP runs do not beat the bigram (the worst by {-margin:.3f} nats/token): not in the power-law regime."


def markdown(info: dict, an: dict, results: list[dict], meta: dict) -> str:
    boot = an["bootstrap"]
    a1, a2, a3 = an["approach1"], an["approach2"], an["approach3"]
    pub = an["published"]
    base = meta.get("baselines") or {}
    tpb = meta["val_tokens_per_byte"]
    lines = [f"# Compute-optimal scaling on {info['device']} ({info['date']})", "",
             f"Command: `{info['command']}`  ", f"Written with torch {info['torch']}, triton {info['triton']}, "
             f"Python {info['python']}, ranks {info['world_size']}.", "",
             "## Data", "",
             f"{meta['train_documents']:,} train / {meta['val_documents']:,} held-out documents "
             f"({meta['duplicates_dropped']:,} duplicates dropped, {meta['skipped_not_text']:,} files not UTF-8 "
             f"text), {meta['train_bytes'] / 1e6:.1f} MB / {meta['val_bytes'] / 1e6:.1f} MB; "
             f"**{meta['train_tokens']:,} train / {meta['val_tokens']:,} held-out tokens** "
             f"({meta['config']['tokenizer']}, vocabulary {meta['vocab_size']}). Most epochs of any run: "
             f"{_f(an['max_epochs'], '.2f')}.", "",
             f"Held-out baselines: unigram {_f(base.get('unigram'))} nats/token "
             f"({_f(None if base.get('unigram') is None else bits_per_byte(base['unigram'], tpb))} bits/byte), "
             f"bigram {_f(base.get('bigram'))} nats/token "
             f"({_f(None if base.get('bigram') is None else bits_per_byte(base['bigram'], tpb))} bits/byte). "
             + _bigram_sentence(an['smallest_vs_bigram']), ""]
    rule = an["lr_rule"] or {}
    lines += ["## Hyperparameters", "",
              f"Peak learning rate `lr = c·(N/1e6)^-gamma·(batch_tokens/2^15)^kappa` with c = {_f(rule.get('c'), '.3g')}, "
              f"gamma = {_f(rule.get('gamma'))}, kappa = {_f(rule.get('kappa'))} ({rule.get('source', 'n/a')}); "
              f"{len(rule.get('groups') or [])} sweep groups, {rule.get('edges', 0)} with the best rate at an edge "
              "of the rates tried (see `lr_sweep.png`). Batch, warm-up, schedule, betas: see the run table and "
              "`plan.HParams`.", ""]
    lines += ["## Fits (total parameters, total compute)", "",
              "| approach | a (N_opt ∝ C^a) | 95% CI | b (D_opt ∝ C^b) | 95% CI | published |", "| --- | --- | --- | --- | --- | --- |",
              f"| 1: envelope of training curves | {_f(a1['a'])} | {_ci(boot, 'a1_a')} | {_f(a1['b'])} | {_ci(boot, 'a1_b')} "
              f"| Chinchilla a = {pub['chinchilla_approach1']['a']} {pub['chinchilla_approach1']['a_ci']} |",
              f"| 2: IsoFLOP parabolas ({a2['budgets_used']} budgets) | {_f(a2['a'])} | {_ci(boot, 'a2_a')} | {_f(a2['b'])} "
              f"| {_ci(boot, 'a2_b')} | Chinchilla a = {pub['chinchilla_approach2']['a']} "
              f"{pub['chinchilla_approach2']['a_ci']}, b = {pub['chinchilla_approach2']['b']} "
              f"{pub['chinchilla_approach2']['b_ci']} |",
              f"| 3: L(N, D) | {_f(a3.get('a'))} | {_ci(boot, 'a3_a')} | {_f(a3.get('b'))} | {_ci(boot, 'a3_b')} "
              f"| Besiroglu et al. a = {pub['besiroglu2024_approach3']['a']}, b = {pub['besiroglu2024_approach3']['b']} |",
              "", f"Approach 2 with non-embedding N: a = {_f(a2['a_non_embedding'])}.", ""]
    if a3.get("ok"):
        b3 = pub["besiroglu2024_approach3"]
        c3 = pub["chinchilla_approach3"]
        lines += ["| L(N, D) = E + A/N^alpha + B/D^beta | E | alpha | beta | A | B |", "| --- | --- | --- | --- | --- | --- |",
                  f"| this sweep | {a3['E']:.3f} {_ci(boot, 'a3_E')} | {a3['alpha']:.3f} {_ci(boot, 'a3_alpha')} "
                  f"| {a3['beta']:.3f} {_ci(boot, 'a3_beta')} | {a3['A']:.4g} | {a3['B']:.4g} |",
                  f"| Besiroglu et al. 2024 | {b3['E']} ± {b3['E_se']} | {b3['alpha']} ± {b3['alpha_se']} "
                  f"| {b3['beta']} ± {b3['beta_se']} | {b3['A']} | {b3['B']} |",
                  f"| Hoffmann et al. 2022 | {c3['E']} | {c3['alpha']} | {c3['beta']} | {c3['A']} | {c3['B']} |", "",
                  f"Approach 3 fit: {a3['n_points']} runs, residual rms {a3['residual_rms']:.4f} in log L, "
                  f"R² {_f(a3['r2'], '.4f')}. Published losses are in nats per token of a 32K-token "
                  "SentencePiece vocabulary on MassiveText: their E, A and B do not compare with a byte-level corpus; "
                  "the exponents do.", ""]
    warnings_ = [f"approach {k}: {v['warning']}" for k, v in (("1", a1), ("3", a3)) if v.get("warning")]
    warnings_ += [f"budget {o['budget']:.3g}: parabola " + ("has no minimum" if not o["ok"] else
                  "minimum outside its sizes" if not o["inside"] else o["warning"] or "")
                  for o in a2["optima"] if not (o["ok"] and o["inside"]) or o["warning"]]
    if warnings_:
        lines += ["Warnings: " + "; ".join(warnings_) + ".", ""]
    ex = an["extrapolation"]
    if ex.get("ok"):
        lines += ["## Extrapolation", "",
                  f"Fitted without the largest budget ({ex['budget']:.3g} FLOPs), its optimal loss (the minimum of its "
                  f"parabola: {ex['measured']:.4f}) is predicted at {_f(ex.get('approach3'), '.4f')} by approach 3 "
                  f"(error {_f(ex.get('approach3_error'), '+.4f')} nats/token) and at {_f(ex.get('loss_law'), '.4f')} by "
                  f"`L_opt(C) = E + A·C^-gamma` over the other budgets' minima (error {_f(ex.get('loss_law_error'), '+.4f')}). "
                  f"N_opt there: predicted {_f(ex.get('n_opt_predicted'), ',.0f')}, measured {_f(ex.get('n_opt_measured'), ',.0f')}.",
                  ""]
    lines += ["## Noise and the reference backend", ""]
    others = sorted({r["backend"] for r in results if r["stage"] == "backend"})
    other = others[0] if others else "reference"
    base = "reference" if other == "kernels" else "kernels"
    for title, sp in (("Seed to seed", an["seed_spread"]), (f"{base} minus {other}", an["backend_check"])):
        if sp:
            lines.append(f"{title} ({sp['n']} sizes at one budget): mean difference {sp['mean_diff']:+.4f}, "
                         f"largest {sp['max_abs_diff']:.4f}, rms {sp['rms_diff']:.4f} nats/token.")
    if an["seed_spread"]:
        lines.append(f"One run's seed-to-seed standard deviation: {an['seed_spread']['per_run_sd']:.4f} nats/token; "
                     "differences between runs smaller than about twice that are noise.")
    sp = [s["speedup"] for s in (an["backend_check"] or {}).get("sizes", []) if s["speedup"]]
    if sp:
        lines.append(f"Training time, {other} over {base} (each step one CUDA graph on GPU): {min(sp):.2f}x to "
                     f"{max(sp):.2f}x (geometric mean {math.exp(statistics.fmean(math.log(s) for s in sp)):.2f}x).")
    lines += ["", f"Training time {an['train_seconds']:.0f} s over {len(results)} runs "
              f"(wall-clock of the runs {an['wall_seconds']:.0f} s).", "",
              "## Figures", "", "`isoflop.png` (losses per budget and their parabolas), `optimal.png` (N_opt(C), "
              "D_opt(C) and the fits), `lnd_fit.png` (approach 3 against the measured losses), `curves.png` "
              "(held-out loss over training compute, and the monotone frontier), `lr_sweep.png`.", "",
              "## Runs", ""]
    lines += _runs_table(results, meta)
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# figures
# --------------------------------------------------------------------------------------------
def plots(an: dict, results: list[dict], out: Path) -> list[str]:
    """Write the PNGs; returns their names ([] without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    sweep = [r for r in results if r["stage"] == "sweep"]
    groups = fit.by_budget(sweep)
    cmap = plt.get_cmap("viridis")
    colour = {c: cmap(i / max(1, len(groups) - 1)) for i, c in enumerate(groups)}
    written = []

    def save(fig, name):
        fig.savefig(out / name, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(name)

    fig, ax = plt.subplots(figsize=(7, 5))
    for o in an["approach2"]["optima"]:
        rs = groups[o["budget"]]
        n = np.array([r["params"] for r in rs], float)
        ax.plot(n, [r["val_loss"] for r in rs], "o", color=colour[o["budget"]], label=f"C = {o['budget']:.2g}")
        if o["coefs"] is not None:
            xs = np.linspace(np.log(n.min()), np.log(n.max()), 100)
            ax.plot(np.exp(xs), np.polyval(o["coefs"], xs), "-", color=colour[o["budget"]], lw=1)
        if o["ok"] and o["inside"]:
            ax.plot(o["n_opt"], o["y_min"], "*", color=colour[o["budget"]], ms=12, mec="k")
    ax.set(xscale="log", xlabel="total parameters N", ylabel="held-out loss (nats/token)",
           title="IsoFLOP profiles: parabolas in log N, minima starred")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    save(fig, "isoflop.png")

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    good = [o for o in an["approach2"]["optima"] if o["ok"] and o["inside"]]
    cs = np.logspace(math.log10(min(groups)), math.log10(max(groups)), 50) if groups else np.array([])
    a3 = an["approach3"]
    for ax, key, fkey, label in ((axes[0], "n_opt", "fit_n", "N_opt"), (axes[1], "d_opt", "fit_d", "D_opt")):
        ax.plot([o["budget"] for o in good], [o[key] for o in good], "ko", label="approach 2 minima")
        f2 = an["approach2"][fkey]
        if f2["ok"]:
            ax.plot(cs, f2["coef"] * cs ** f2["exponent"], "k-", lw=1, label=f"approach 2: C^{f2['exponent']:.3f}")
        f1 = an["approach1"].get(fkey)
        if f1 and f1["ok"]:
            ax.plot(cs, f1["coef"] * cs ** f1["exponent"], "C0--", lw=1, label=f"approach 1: C^{f1['exponent']:.3f}")
        if a3.get("G"):
            n3 = a3["G"] * (cs / 6) ** a3["a"]
            ax.plot(cs, n3 if key == "n_opt" else cs / (6 * n3), "C3:", lw=1.5,
                    label=f"approach 3: C^{a3['a' if key == 'n_opt' else 'b']:.3f}")
        ax.set(xscale="log", yscale="log", xlabel="training compute C (FLOPs)", ylabel=label)
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
    save(fig, "optimal.png")

    if a3.get("ok"):
        fig, ax = plt.subplots(figsize=(5.5, 5))
        for c, rs in groups.items():
            ax.plot([r["val_loss"] for r in rs], fit.predict3(a3, [r["params"] for r in rs], [r["tokens"] for r in rs]),
                    "o", color=colour[c], label=f"C = {c:.2g}")
        lo = min(r["val_loss"] for r in sweep)
        hi = max(r["val_loss"] for r in sweep)
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        ax.set(xlabel="measured loss", ylabel="fitted L(N, D)",
               title=f"E={a3['E']:.3f} alpha={a3['alpha']:.3f} beta={a3['beta']:.3f}")
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
        save(fig, "lnd_fit.png")

    fig, ax = plt.subplots(figsize=(8, 5))
    lognorm = [math.log(r["params"]) for r in sweep] or [0.0]
    for r in sweep:
        pts = sorted((c["compute"], c["val_loss"]) for c in r["curve"])
        t = (math.log(r["params"]) - min(lognorm)) / max(1e-9, max(lognorm) - min(lognorm))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-", color=plt.get_cmap("plasma")(t), lw=0.7, alpha=0.7)
        ax.plot(r["compute"], r["val_loss"], ".", color=plt.get_cmap("plasma")(t))
    fr = an["frontier"]
    if fr:
        ax.plot([p["compute"] for p in fr], [p["best"] for p in fr], "k-", lw=1.8, label="frontier (monotone)")
    ax.set(xscale="log", yscale="log", xlabel="training compute (FLOPs)", ylabel="held-out loss (nats/token)",
           title="Training curves (colour: log N), final points dotted")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    save(fig, "curves.png")

    rule = an["lr_rule"] or {}
    if rule.get("groups"):
        fig, ax = plt.subplots(figsize=(7, 5))
        for i, g in enumerate(rule["groups"]):
            ax.plot(g["lrs"], g["losses"], "o-", color=f"C{i % 10}", lw=1,
                    label=f"C={g['budget']:.2g} N={g['params'] / 1e6:.2f}M")
            ax.axvline(g["lr_opt"], color=f"C{i % 10}", ls=":", lw=1)
        ax.set(xscale="log", xlabel="peak learning rate", ylabel="held-out loss (nats/token)",
               title="Learning-rate sweep (dotted: fitted optimum)")
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
        save(fig, "lr_sweep.png")
    return written


def write(info: dict, results: list[dict], lr_rule: dict | None, meta: dict, out: Path, n_boot: int) -> dict:
    an = analyse(results, lr_rule, meta, n_boot)
    an["figures"] = plots(an, results, out)
    report = {"info": info, "data": meta, "analysis": an,
              "runs": [{k: v for k, v in r.items() if k not in ("history", "key")} for r in results]}
    (out / "report.json").write_text(json.dumps(report, indent=1, default=float))
    (out / "report.md").write_text(markdown(info, an, results, meta))
    return an
