"""The report of a sweep: every fit and check as JSON, a Markdown summary, and the figures.

``analyse`` runs the fits (``fit``, ``surface``, ``intervals``) over the finished runs, whichever
they are; ``write`` writes ``report.json`` (every run), ``report.md`` and the figures (``figures``)
into the output folder. No torch here.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from . import fit, intervals, surface
from .data import bits_per_byte
from .figures import plots
from .plan import PUBLISHED

BATCH_TOLERANCE = 0.03  # nats: B and B/2 must agree within this at the top budget (issue 33)
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


def analyse(results: list[dict], lr_rule: dict | None, meta: dict, n_boot: int) -> dict:
    """Every fit and check over the finished runs (``results``: run records with ``stage``; any
    subset, diverged runs left out of the fits and listed)."""
    valid = [r for r in results if r.get("val_loss") is not None]
    sweep = [r for r in valid if r["stage"] == "sweep"]
    stage = {k: [r for r in valid if r["stage"] == k] for k in ("seed", "batch", "backend")}
    seed_spread = _spread(_pairs(sweep, stage["seed"]))
    noise = (seed_spread or {}).get("per_run_sd")
    a2 = fit.approach2(sweep, noise)
    cols = [[r[k] for r in sweep] for k in ("params", "tokens", "val_loss")]
    a3 = surface.approach3(*cols)
    out = {
        "runs": len(sweep), "budgets": len(fit.by_budget(sweep)), "diverged": [r["id"] for r in results if r not in valid],
        "approach1": fit.approach1(sweep), "approach2": a2, "approach3": a3,
        "e_profile": surface.profile_e(*cols, a3), "loss_law": fit.optimal_loss_law(a2["optima"]),
        "frontier": fit.frontier(sweep), "extrapolation": intervals.extrapolation(sweep),
        "bootstrap": intervals.bootstrap(sweep, n_boot, approach3_fit=a3, noise_sd=noise) if n_boot > 0 and sweep else None,
        "lr_rule": lr_rule, "published": PUBLISHED, "seed_spread": seed_spread,
        "gate": intervals.quality_gate(sweep, a3, seed_spread),
        "backend_check": _spread(_pairs(sweep, stage["backend"])),
    }
    batch = _spread(_pairs(sweep, stage["batch"]))
    out["batch_check"] = batch and {**batch, "tolerance": BATCH_TOLERANCE, "ok": batch["max_abs_diff"] <= BATCH_TOLERANCE}
    bigram = (meta.get("baselines") or {}).get("bigram")
    out["smallest_vs_bigram"] = None if bigram is None or not sweep else min(bigram - r["val_loss"] for r in sweep)
    out["train_seconds"] = sum(r["train_seconds"] for r in results)
    out["wall_seconds"] = sum(r["wall_seconds"] for r in results)
    out["max_epochs"] = max((r["epochs"] for r in results), default=None)
    return out


def comparison(an: dict) -> str:
    """The paragraph that sets this sweep's exponents beside the published ones and says why they differ."""
    pub = an["published"]
    a = [(name, an[key].get("a")) for name, key in (("1", "approach1"), ("2", "approach2"), ("3", "approach3"))]
    got = ", ".join(f"{v:.2f} (approach {k})" for k, v in a if v is not None) or "no exponent"
    b3 = pub["besiroglu2024_approach3"]
    return (f"This sweep gives a = {got}. Hoffmann et al. (Chinchilla) found a ≈ b ≈ 0.5 "
            f"(approach 1: {pub['chinchilla_approach1']['a']}, approach 2: {pub['chinchilla_approach2']['a']}, approach 3: "
            f"{pub['chinchilla_approach3']['a']}); Besiroglu et al.'s re-fit of their approach-3 data gives alpha = "
            f"{b3['alpha']}, beta = {b3['beta']}, so a = {b3['a']}; Porian et al. reproduce Kaplan et al.'s a ≈ "
            f"{pub['porian2024']['a_kaplan_setup']} at small scale and bring it to ≈ {pub['porian2024']['a_corrected']} by "
            "counting the head's FLOPs, shortening warm-up and tuning the learning rate, batch and AdamW beta2 per size. "
            "Reasons this sweep can differ: its tokens are UTF-8 bytes (a byte carries about a quarter of a 32K-vocabulary "
            "token's information, so D counts differently and data is cheap next to parameters); its models are 0.2-45M "
            "parameters and its budgets 1e13-1e16 FLOPs, three to seven orders below Chinchilla's, where the embedding "
            "and attention terms are a large part of N and C (both are counted in totals here, as Porian et al. and "
            "Pearce and Song recommend); the hyperparameters follow a rule fitted at two budgets, and an untuned rate "
            "or batch at some sizes tilts the IsoFLOP minima (Porian et al.'s main finding). An exponent is comparable "
            "only when the quality gate above passes.")


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
        loss = r["val_loss"]
        ok = loss is not None
        lines.append(
            f"| {r['stage']}{'' if r['backend'] == 'kernels' else ' (' + r['backend'] + ')'}"
            f"{' s' + str(r['seed']) if r['stage'] == 'seed' else ''} | {r['budget']:.3g} | {r['name']} "
            f"| {r['params']:,} | {r['non_embedding_params']:,} | {r['tokens'] / 1e6:.1f}M | {r['epochs']:.2f} "
            f"| {r['train']['batch_size']} | {r['steps']} | {r['train']['lr']:.2e} | {_f(loss, '.4f') if ok else 'diverged'} "
            f"| {_f(bits_per_byte(loss, tpb) if ok else None, '.4f')} | {_f(bigram - loss if ok and bigram else None)} "
            f"| {r['tokens_per_s']:,.0f} | {_f(r['mfu'], '.1%')} | {r['train_seconds']:.1f} |")
    return lines


def _bigram_sentence(margin) -> str:
    if margin is None:
        return ""
    if margin > 0:
        return f"Every IsoFLOP run beats the bigram, the closest by {margin:.3f} nats/token."
    return f"Some IsoFLOP runs do not beat the bigram (the worst by {-margin:.3f} nats/token): not in the power-law regime."


def _gate_lines(an: dict) -> list[str]:
    gate = an["gate"]
    if gate["ok"]:
        return ["## Quality gate: passed", "", gate["reason"] + ": the intervals below are results.", ""]
    head = "failed: the design did not work" if gate["ok"] is False else "not evaluated"
    return [f"## Quality gate: {head}", "", gate["reason"] + ". **No interval below is a result**; they are shown to "
            "find what went wrong.", ""]


def _fits_lines(an: dict) -> list[str]:
    boot, pub = an["bootstrap"], an["published"]
    a1, a2, a3 = an["approach1"], an["approach2"], an["approach3"]
    ci = "95% CI" + ("" if an["gate"]["ok"] else " (not a result)")
    se2 = f" ± {_f(a2['a_se'])} s.e." if a2.get("a_se") else ""
    lines = ["## Fits (total parameters, total compute)", "",
             f"| approach | a (N_opt ∝ C^a) | {ci} | b (D_opt ∝ C^b) | {ci} | published |", "| --- | --- | --- | --- | --- | --- |",
             f"| 1: envelope of training curves ({a1['points']} points) | {_f(a1['a'])} | {_ci(boot, 'a1_a')} | {_f(a1['b'])} "
             f"| {_ci(boot, 'a1_b')} | Chinchilla a = {pub['chinchilla_approach1']['a']} {pub['chinchilla_approach1']['a_ci']} |",
             f"| 2: IsoFLOP parabolas, weighted ({a2['budgets_used']} budgets) | {_f(a2['a'])}{se2} | {_ci(boot, 'a2_a')} "
             f"| {_f(a2['b'])} | {_ci(boot, 'a2_b')} | Chinchilla a = {pub['chinchilla_approach2']['a']} "
             f"{pub['chinchilla_approach2']['a_ci']} |",
             f"| 3: L(N, D) | {_f(a3.get('a'))} | {_ci(boot, 'a3_a')} | {_f(a3.get('b'))} | {_ci(boot, 'a3_b')} "
             f"| Besiroglu et al. a = {pub['besiroglu2024_approach3']['a']}; Porian et al. ≈ {pub['porian2024']['a_corrected']} |",
             "", f"Approach 2 with non-embedding N: a = {_f(a2['a_non_embedding'])}. Per budget, the parabola's minimum "
             "(log N ± s.e.): " + "; ".join(f"{o['budget']:.3g}: {_f(o['n_opt'], ',.0f')} ± {_f(o['x_se'])}"
                                              for o in a2["optima"] if o["ok"]) + ".", ""]
    if a3.get("ok"):
        b3, c3 = pub["besiroglu2024_approach3"], pub["chinchilla_approach3"]
        lines += ["| L(N, D) = E + A/N^alpha + B/D^beta | E | alpha | beta | A | B |", "| --- | --- | --- | --- | --- | --- |",
                  f"| this sweep | {a3['E']:.3f} {_ci(boot, 'a3_E')} | {a3['alpha']:.3f} {_ci(boot, 'a3_alpha')} "
                  f"| {a3['beta']:.3f} {_ci(boot, 'a3_beta')} | {a3['A']:.4g} | {a3['B']:.4g} |",
                  f"| Besiroglu et al. 2024 | {b3['E']} ± {b3['E_se']} | {b3['alpha']} ± {b3['alpha_se']} "
                  f"| {b3['beta']} ± {b3['beta_se']} | {b3['A']} | {b3['B']} |",
                  f"| Hoffmann et al. 2022 | {c3['E']} | {c3['alpha']} | {c3['beta']} | {c3['A']} | {c3['B']} |", "",
                  f"Approach 3 fit: {a3['n_points']} runs, residual rms {a3['residual_rms']:.4f} in log L, "
                  f"R² {_f(a3['r2'], '.4f')}" + (f"; at a bound: {', '.join(a3['at_bound'])}" if a3["at_bound"] else "")
                  + ". " + surface.describe_e(an["e_profile"]) + ". Published losses are in nats per token of a "
                  "32K-token vocabulary on MassiveText: their E, A and B do not compare with a byte-level corpus; the "
                  "exponents do.", ""]
    warnings_ = [f"approach {k}: {v['warning']}" for k, v in (("1", a1), ("3", a3)) if v.get("warning")]
    warnings_ += [f"budget {o['budget']:.3g}: parabola " + ("has no minimum" if not o["ok"] else
                  "minimum outside its sizes" if not o["inside"] else o["warning"] or "")
                  for o in a2["optima"] if not (o["ok"] and o["inside"]) or o["warning"]]
    warnings_ += [f"diverged (left out): {', '.join(an['diverged'])}"] if an["diverged"] else []
    return lines + (["Warnings: " + "; ".join(warnings_) + ".", ""] if warnings_ else []) + \
        ["## Beside the published exponents", "", comparison(an), ""]


def _checks_lines(an: dict, results: list[dict]) -> list[str]:
    lines = ["## Checks", ""]
    titles = (("Seed to seed", an["seed_spread"]), ("Batch B minus B/2 at the top budget", an["batch_check"]),
              ("Kernels minus reference", an["backend_check"]))
    for title, sp in titles:
        if sp:
            lines.append(f"{title} ({sp['n']} sizes): mean difference {sp['mean_diff']:+.4f}, largest "
                         f"{sp['max_abs_diff']:.4f}, rms {sp['rms_diff']:.4f} nats/token.")
    if an["seed_spread"]:
        lines.append(f"One run's seed-to-seed standard deviation: {an['seed_spread']['per_run_sd']:.4f} nats/token "
                     f"({an['seed_spread']['per_run_sd_log']:.4f} in log L).")
    bc = an["batch_check"]
    if bc:
        lines.append(f"Batch check: {'passed' if bc['ok'] else 'FAILED'} (every |difference| within {bc['tolerance']} "
                     "nats" + ("" if bc["ok"] else ": the batch rule must change") + ").")
    sp = [s["speedup"] for s in (an["backend_check"] or {}).get("sizes", []) if s["speedup"]]
    if sp:
        lines.append(f"Training time, reference over kernels: {min(sp):.2f}x to {max(sp):.2f}x.")
    return lines + ["", f"Training time {an['train_seconds']:.0f} s over {len(results)} runs (wall-clock of the runs "
                    f"{an['wall_seconds']:.0f} s).", ""]


def markdown(info: dict, an: dict, results: list[dict], meta: dict) -> str:
    base = meta.get("baselines") or {}
    tpb = meta["val_tokens_per_byte"]
    lines = [f"# Compute-optimal scaling on {info['device']} ({info['date']})", "",
             f"Command: `{info['command']}`  ", f"Written with torch {info['torch']}, triton {info['triton']}, "
             f"Python {info['python']}, ranks {info['world_size']}.", ""]
    lines += _gate_lines(an)
    lines += ["## Data", "",
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
              f"{len(rule.get('groups') or [])} sweep groups, {rule.get('edges', 0)} with the best rate still at an edge "
              "of the rates tried (see `lr_sweep.png`); mean residual of log lr* by batch tokens (kappa's check): "
              + (", ".join(f"{k}: {v:+.2f}" for k, v in (rule.get("by_batch") or {}).items()) or "n/a")
              + ". One batch per budget (the run table), warm-up, cosine to 10%, AdamW beta2: `plan.HParams`.", ""]
    lines += _fits_lines(an)
    ex = an["extrapolation"]
    if ex.get("ok"):
        lines += ["## Extrapolation", "",
                  f"Fitted without the largest budget ({ex['budget']:.3g} FLOPs), its optimal loss (the minimum of its "
                  f"parabola: {ex['measured']:.4f}) is predicted at {_f(ex.get('approach3'), '.4f')} by approach 3 "
                  f"(error {_f(ex.get('approach3_error'), '+.4f')} nats/token) and at {_f(ex.get('loss_law'), '.4f')} by "
                  f"`L_opt(C) = E + A·C^-gamma` over the other budgets' minima (error {_f(ex.get('loss_law_error'), '+.4f')}). "
                  f"N_opt there: predicted {_f(ex.get('n_opt_predicted'), ',.0f')}, measured {_f(ex.get('n_opt_measured'), ',.0f')}.",
                  ""]
    lines += _checks_lines(an, results)
    lines += ["## Figures", ""] + [f"- `{name}`" for name in an["figures"]]
    lines += [f"- `{name}`: not drawn: {why}" for name, why in an["figures_skipped"].items()]
    lines += ["", "## Runs", ""] + _runs_table(results, meta)
    return "\n".join(lines) + "\n"


def write(info: dict, results: list[dict], lr_rule: dict | None, meta: dict, out: Path, n_boot: int) -> dict:
    an = analyse(results, lr_rule, meta, n_boot)
    an["figures"], an["figures_skipped"] = plots(an, results, out)
    runs = [{**{k: r.get(k) for k in RUN_FIELDS}, "batch": r["train"]["batch_size"], "lr": r["train"]["lr"],
             **{k: v for k, v in r.items() if k not in ("history", "key")}} for r in results]
    report = {"info": info, "data": meta, "analysis": an, "runs": runs}
    (out / "report.json").write_text(json.dumps(report, indent=1, default=float))
    (out / "report.md").write_text(markdown(info, an, results, meta))
    return an
