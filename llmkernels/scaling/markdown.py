"""``report.md`` from ``report.analyse``'s analysis: every number in it is read from the analysis or
the runs, none is written into the text (no torch, no numpy)."""
from __future__ import annotations

import math

from . import gate, surface
from .data import bits_per_byte
from .literature import BESIROGLU, CHINCHILLA, CHINCHILLA_MODEL, LITERATURE, PORIAN, PORIAN_STEPS


def num(v, fmt=".3f") -> str:
    return "n/a" if v is None else format(v, fmt)


def count(n: float) -> str:
    """``180K``, ``10.7M``, ``1.4T``: three significant digits."""
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.3g}"


def _share(span: list | None) -> str:
    if not span:
        return "n/a"
    lo, hi = (f"{v:.2g}%" for v in (100 * v for v in span))
    return lo if lo == hi else f"{lo}-{hi}"


def _orders(lo: float, hi: float) -> str:
    return f"{math.log10(hi / lo):.1f}"


def bracket(iv: dict | None) -> str:
    if not iv or iv.get("lo") is None:
        return "n/a"
    return f"[{iv['lo']:.3f}, {iv['hi']:.3f}]"


def _gate_word(ok) -> str:
    return {True: "passed", False: "failed", None: "not evaluated"}[ok]


def _result_lines(an: dict) -> list[str]:
    h, ivals = an["headline"], an["intervals"] or {}
    level = round(100 * ivals.get("level", 0.9))
    a, b = h["a"], h["b"]
    if a.get("point") is None:
        return ["## Result", "", f"No exponent: approach {h['approach']} did not fit these runs.", ""]
    hw = " / ".join(num(v.get("half_width")) for v in (a, b))
    ex = h["extrapolation_error"]
    return ["## Result", "",
            f"**a = {a['point']:.3f} {bracket(a)}, b = {num(b['point'])} {bracket(b)}** (N_opt ∝ C^a, D_opt ∝ C^b; approach "
            f"{h['approach']}, {level}% bootstrap intervals over {ivals.get('resamples', 0)} resamples of the "
            f"{an['runs']} IsoFLOP runs). Quotable: **{'yes' if h['quotable'] else 'no'}**: "
            + (f"the sweep is not finished ({h['unfinished']} runs of its current stage left: this is its state, "
               "not a result); " if h.get("unfinished") else "")
            + "quality gate "
            f"{_gate_word(an['gate']['ok'])}; half-widths of a / b {hw} (at most {h['target_half_width']:g}: "
            f"{'met' if h['precise'] else 'not met'}); extrapolation to the held-out top budget "
            + ("not made" if ex is None else f"{ex:+.4f} nats/token (|error| at most {h['extrapolation_target']:g}: "
                                             f"{'met' if h['extrapolation_ok'] else 'not met'})") + ".", ""]


def _gate_lines(an: dict) -> list[str]:
    g = an["gate"]
    lines = [f"## Quality gate: {_gate_word(g['ok'])}", ""]
    lines += [f"- {c['name']}: {_gate_word(c['ok'])}: {c['reason']}." for c in g["checks"]]
    unfinished = an["headline"].get("unfinished")
    tail = (f"Every check passed on the runs so far, but {unfinished} runs of the sweep are left: **no interval "
            "below is a result yet**." if g["ok"] and unfinished else
            "Every check passed: the intervals below are results." if g["ok"] else
            "**No interval below is a result**; they are shown to find what went wrong.")
    return lines + ["", tail, ""]


def batch_text(batch_by_budget: dict) -> str:
    """Sequences a step by budget (``{budget: [batch, ...]}``, budgets rising), runs of budgets with
    the same batches as one range: ``64 at every budget`` or ``1e+15-2e+15: 32; 3e+15: 64``."""
    groups = []  # [first budget, last budget, batches]
    for budget, batches in batch_by_budget.items():
        if groups and groups[-1][2] == batches:
            groups[-1][1] = budget
        else:
            groups.append([budget, budget, batches])
    if len(groups) == 1:
        return f"{'/'.join(map(str, groups[0][2]))} at every budget"
    return "; ".join(f"{lo}{'' if lo == hi else '-' + hi}: {'/'.join(map(str, b))}" for lo, hi, b in groups)


def _design_lines(an: dict) -> list[str]:
    d = an["design"]
    if not d["budgets"]:
        return ["## Design", "", f"{d['runs']} runs, none of them an IsoFLOP run.", ""]
    cs, p, t, tpp = d["budgets"], d["params"], d["tokens"], d["tokens_per_param"]
    stages = ", ".join(f"{n} {s}" for s, n in sorted(d["by_stage"].items()))
    batches = batch_text(d["batch_by_budget"])
    sizes = d["sizes_per_budget"]
    return ["## Design", "",
            f"{d['runs']} runs ({stages}). IsoFLOP grid: {len(cs)} budgets from {cs[0]:.3g} to {cs[-1]:.3g} FLOPs "
            f"({cs[-1] / cs[0]:.0f}x), {sizes[0]}{'' if sizes[0] == sizes[1] else '-' + str(sizes[1])} sizes each, "
            f"{d['sizes']} sizes from {count(p[0])} to {count(p[1])} total parameters ({p[1] / p[0]:.0f}x), "
            f"{count(t[0])} to {count(t[1])} tokens ({tpp[0]:.1f} to {tpp[1]:.1f} tokens a parameter); "
            + (f"sequences of {'/'.join(map(str, d['seq_len']))} tokens, vocabulary {'/'.join(map(str, d['vocab']))} "
               "(padded); " if d["seq_len"] else "")
            + f"sequences a step by budget: {batches}; seed {', '.join(map(str, d['seeds']))}"
            + (f" (second seed: {', '.join(map(str, d['check_seeds']))})" if d["check_seeds"] else "") + "."
            + (f" Not fitted (`--fit-from {an['fit_from']:.4g}`): the IsoFLOP runs of "
               f"{', '.join(f'{c:.3g}' for c in an['not_fitted'])} (in the runs' table), and the checks paired with them."
               if an.get("not_fitted") else ""), ""]


def _data_lines(an: dict, meta: dict) -> list[str]:
    base, tpb = meta.get("baselines") or {}, meta["val_tokens_per_byte"]

    def bpb(v):
        return None if v is None else bits_per_byte(v, tpb)
    margin = an["smallest_vs_bigram"]
    bigram = ("" if margin is None else f" Every IsoFLOP run beats the bigram, the closest by {margin:.3f} nats/token."
              if margin > 0 else f" Some IsoFLOP runs do not beat the bigram (the worst by {-margin:.3f} nats/token): "
              "not in the power-law regime.")
    return ["## Data", "",
            f"{meta['train_documents']:,} train / {meta['val_documents']:,} held-out documents "
            f"({meta['duplicates_dropped']:,} duplicates dropped, {meta['skipped_not_text']:,} files not UTF-8 "
            f"text), {meta['train_bytes'] / 1e6:.1f} MB / {meta['val_bytes'] / 1e6:.1f} MB; "
            f"**{meta['train_tokens']:,} train / {meta['val_tokens']:,} held-out tokens** "
            f"({meta['config']['tokenizer']}, vocabulary {meta['vocab_size']}). Most epochs of any run: "
            f"{num(an['max_epochs'], '.2f')}.", "",
            f"Held-out baselines: unigram {num(base.get('unigram'))} nats/token ({num(bpb(base.get('unigram')))} bits/byte), "
            f"bigram {num(base.get('bigram'))} nats/token ({num(bpb(base.get('bigram')))} bits/byte).{bigram}", ""]


def _lr_lines(an: dict) -> list[str]:
    rule = an["lr_rule"] or {}
    by_batch = ", ".join(f"{k}: {v:+.2f}" for k, v in (rule.get("by_batch") or {}).items()) or "n/a"
    d = an["design"]
    beta2 = "/".join(f"{v:g}" for v in d.get("beta2") or []) or "n/a"
    warm, floor = d.get("warmup_share"), d.get("min_lr_ratio")
    return ["## Hyperparameters", "",
            f"Peak learning rate `lr = c·(N/1e6)^-gamma·(batch_tokens/2^15)^kappa` with c = {num(rule.get('c'), '.3g')}, "
            f"gamma = {num(rule.get('gamma'))}, kappa = {num(rule.get('kappa'))} ({rule.get('source', 'n/a')}); "
            f"{len(rule.get('groups') or [])} sweep groups, {rule.get('edges', 0)} with the best rate still at an edge "
            f"of the rates tried and {sum('beyond' in g for g in rule.get('groups') or [])} with the optimum of the "
            f"parabola shared by the sizes beyond them (the rule: {rule.get('method', 'n/a')}; `lr_sweep.png`); mean "
            f"residual of log lr* by batch tokens (kappa's check): {by_batch}. "
            f"Warm-up {num(warm and warm[0], '.1%')} to {num(warm and warm[1], '.1%')} of the steps, then a cosine to "
            f"{'/'.join(f'{v:.0%}' for v in floor or []) or 'n/a'} of the peak; AdamW beta2 {beta2} (`plan.HParams`).", ""]


def _fits_lines(an: dict) -> list[str]:
    ivals, a1, a2, a3 = an["intervals"] or {}, an["approach1"], an["approach2"], an["approach3"]
    level = f"{round(100 * ivals.get('level', 0.9))}% interval" + ("" if an["gate"]["ok"] else " (not a result)")

    def cells(key, v):
        iv = ivals.get(key)
        return f"{num(v)} | {bracket(iv)} | {num(iv and iv['bias'], '+.3f')}"
    lines = ["## Fits (total parameters, total compute)", "",
             f"Each interval: the bootstrap's spread about its median, placed at the point (`intervals`); bias: "
             f"the bootstrap median minus the point.", "",
             f"| approach | a | {level} | bias | b | {level} | bias |", "| --- | --- | --- | --- | --- | --- | --- |",
             f"| 1: envelope of finished schedules ({a1['points']} computes) | {cells('a1_a', a1['a'])} "
             f"| {cells('a1_b', a1['b'])} |",
             f"| 2: IsoFLOP parabolas, weighted ({a2['budgets_used']} budgets) | {cells('a2_a', an['estimates']['a2_a'])} "
             f"| {cells('a2_b', an['estimates']['a2_b'])} |",
             f"| 3: L(N, D), every run | {cells('a3_a', a3.get('a'))} | {cells('a3_b', a3.get('b'))} |", "",
             f"Approach 1 compares final losses only (a curve point mid-schedule has not annealed): "
             f"{a1['several']} of the {a1['sizes']} sizes ran at more than one budget, and between two budgets a "
             f"size's loss is interpolated along D^-beta (beta {num(a1['beta'])}, approach 3's; `envelope`).", "",
             f"Approach 2 with non-embedding N: a = {num(a2['a_non_embedding'])}. Per budget, the parabola's minimum "
             "(N, ± s.e. in log N): " + "; ".join(f"{o['budget']:.3g}: {num(o['n_opt'], ',.0f')} ± {num(o['x_se'])}"
                                                   for o in a2["optima"] if o["ok"]) + ".", ""]
    if a3.get("ok"):
        lines += ["| L(N, D) = E + A/N^alpha + B/D^beta | E | alpha | beta | A | B |", "| --- | --- | --- | --- | --- | --- |",
                  f"| this sweep | {a3['E']:.3f} {bracket(ivals.get('a3_E'))} | {a3['alpha']:.3f} {bracket(ivals.get('a3_alpha'))} "
                  f"| {a3['beta']:.3f} {bracket(ivals.get('a3_beta'))} | {a3['A']:.4g} | {a3['B']:.4g} |", "",
                  f"Approach 3 fit: {a3['n_points']} runs, residual rms {a3['residual_rms']:.4f} in log L, "
                  f"R² {num(a3['r2'], '.4f')}" + (f"; at a bound: {', '.join(a3['at_bound'])}" if a3["at_bound"] else "")
                  + ". " + surface.describe_e(an["e_profile"]) + ".", ""]
    warnings_ = [f"approach {k}: {v['warning']}" for k, v in (("1", a1), ("3", a3)) if v.get("warning")]
    warnings_ += [f"budget {o['budget']:.3g}: parabola " + ("has no minimum" if not o["ok"] else
                  "minimum outside its sizes" if not o["inside"] else o["warning"] or "")
                  for o in a2["optima"] if not (o["ok"] and o["inside"]) or o["warning"]]
    warnings_ += [f"diverged (left out): {', '.join(an['diverged'])}"] if an["diverged"] else []
    return lines + (["Warnings: " + "; ".join(warnings_) + ".", ""] if warnings_ else [])


def _published_row(p) -> str:
    def iv(v):
        return "" if v is None else f" ({v[0]}, {v[1]})"
    return f"| {p.label} | {p.a:.3g}{iv(p.a_interval)} | {num(p.b, '.3g')}{iv(p.b_interval)} | {p.interval_level or 'n/a'} |"


def _outside(p) -> bool:
    """Whether a published point lies outside its own printed interval (rounded: two of Hoffmann et al.'s do)."""
    return any(v is not None and iv is not None and not iv[0] <= v <= iv[1]
               for v, iv in ((p.a, p.a_interval), (p.b, p.b_interval)))


def literature_lines(an: dict, meta: dict) -> list[str]:
    """The published exponents (``literature.LITERATURE``) beside this sweep's, and what differs at
    this scale, each difference stated with this sweep's own numbers."""
    h, d = an["headline"], an["design"]
    lines = ["## Against the literature", "", "| | a | b | interval |", "| --- | --- | --- | --- |"]
    for key, name in (("1", "approach 1"), ("2", "approach 2"), ("3", "approach 3")):
        ivals = an["intervals"] or {}
        lines.append(f"| this sweep, {name} | {num(an['estimates'][f'a{key}_a'])} {bracket(ivals.get(f'a{key}_a'))} "
                     f"| {num(an['estimates'][f'a{key}_b'])} {bracket(ivals.get(f'a{key}_b'))} | {round(100 * ivals.get('level', 0.9))}%, "
                     "bootstrap |")
    lines += [_published_row(p) for p in LITERATURE]
    for p in LITERATURE:
        if _outside(p):
            lines += ["", f"{p.label}: as printed in its source, the point estimate (rounded) outside the interval "
                      "beside it."]
    lines += ["", "Porian et al.'s walk from Kaplan et al.'s setup to Chinchilla's (RefinedWeb, a with its 95% interval): "
              + "; ".join(f"{s.change}: {s.a:.3f} ({s.a_interval[0]}, {s.a_interval[1]})" for s in PORIAN_STEPS) + ".", ""]
    lines += ["Sources: " + "; ".join(dict.fromkeys(f"{p.source} <{p.url}>" for p in LITERATURE)) + ".", ""]
    if not d["budgets"]:
        return lines
    ch, p, cs = CHINCHILLA[1], d["params"], d["budgets"]
    a = h["a"].get("point")
    if a is None:
        where = ""
    elif an["gate"]["ok"]:
        where = (f"This sweep's a = {a:.3f} is {a - ch.a:+.3f} from Chinchilla's approach 2 and {a - BESIROGLU.a:+.3f} "
                 "from Besiroglu et al.'s re-fit. ")
    else:
        where = f"This sweep's a = {a:.3f} is not comparable: its quality gate {_gate_word(an['gate']['ok'])}. "
    tpb, vocab, tokenizer = meta["val_tokens_per_byte"], meta["vocab_size"], meta["config"]["tokenizer"]
    source = f"the documents of {meta['config']['path']}" if meta["config"].get("path") else \
        "the Python installation's sources and docs"
    opt = [o for o in an["approach2"]["optima"] if o["ok"] and o["inside"] and o["d_opt"]]
    ratio = [o["d_opt"] / o["n_opt"] for o in opt]
    rule = an["lr_rule"] or {}
    lr_budgets = sorted({g["budget"] for g in rule.get("groups") or []})
    how = (f"a learning-rate rule fitted at {len(lr_budgets)} budget(s) ({', '.join(f'{c:.3g}' for c in lr_budgets)}; "
           "`lr_sweep.png`)" if lr_budgets else f"a learning-rate rule not fitted here ({rule.get('source', 'n/a')})")
    lines += ["What differs at this scale. " + where +
              f"(1) Scale: the IsoFLOP models are {count(p[0])} to {count(p[1])} total parameters and the budgets "
              f"{cs[0]:.3g} to {cs[-1]:.3g} FLOPs, {_orders(p[1], ch.params[0])} to {_orders(p[0], ch.params[1])} "
              f"orders of magnitude below Chinchilla's {count(ch.params[0])}-{count(ch.params[1])} models and "
              f"{_orders(cs[-1], ch.budgets[0])} to {_orders(cs[0], ch.budgets[1])} below its {ch.budgets[0]:.3g}-"
              f"{ch.budgets[1]:.3g} FLOPs (Porian et al.: {count(PORIAN.params[0])}-{count(PORIAN.params[1])}, "
              f"{PORIAN.budgets[0]:.3g}-{PORIAN.budgets[1]:.3g}). At these sizes the tied embedding is "
              f"{_share(d['embedding_share'])} of N and the attention term {_share(d['attention_share'])} of the FLOPs "
              "a token; both are counted (total N, total C): leaving the head's FLOPs out is the first of the "
              f"corrections that take Porian et al.'s a from {PORIAN_STEPS[0].a} to {PORIAN_STEPS[-1].a}. "
              f"(2) Data: {tokenizer} tokens (vocabulary {vocab}, {tpb:.2f} tokens a byte of held-out text) of {source}, "
              f"where Chinchilla's are {ch.data}"
              + (": a byte carries less text than a subword token, so" if tokenizer == "byte" else "; so")
              + " D_opt/N_opt does not compare with Chinchilla's "
              f"{CHINCHILLA_MODEL[1] / CHINCHILLA_MODEL[0]:.0f} tokens a parameter"
              + (f" (here {min(ratio):.1f} to {max(ratio):.1f} at the fitted minima)" if ratio else "") + "; the "
              "exponents do. "
              f"(3) Hyperparameters: one batch per budget (sequences a step: {batch_text(d['batch_by_budget'])}), "
              f"warm-up {num(d['warmup_share'] and d['warmup_share'][1], '.0%')} of each run at most, AdamW "
              f"beta2 {'/'.join(f'{v:g}' for v in d['beta2']) or 'n/a'}, and {how} rather than a rate tuned for every "
              "size: Porian et al.'s last correction, tuning the rate, batch and beta2 per size, moves a by "
              f"{PORIAN_STEPS[-2].a - PORIAN_STEPS[-1].a:.3f} at their scale; the batch check above measures how much "
              "this sweep's batch choice moves the loss.", ""]
    return lines


def _extrapolation_lines(an: dict) -> list[str]:
    ex = an["extrapolation"]
    if not ex.get("ok"):
        return []
    return ["## Extrapolation", "",
            f"Fitted without the largest budget ({ex['budget']:.3g} FLOPs), its optimal loss (the minimum of its parabola: "
            f"{ex['measured']:.4f}) is predicted at {num(ex.get('approach3'), '.4f')} by approach 3 (error "
            f"{num(ex.get('approach3_error'), '+.4f')} nats/token) and at {num(ex.get('loss_law'), '.4f')} by "
            f"`L_opt(C) = E + A·C^-gamma` over the other budgets' minima (error {num(ex.get('loss_law_error'), '+.4f')}). "
            f"N_opt there: predicted {num(ex.get('n_opt_predicted'), ',.0f')}, measured {num(ex.get('n_opt_measured'), ',.0f')}.",
            ""]


def _checks_lines(an: dict, results: list[dict]) -> list[str]:
    lines = ["## Checks", ""]
    for title, sp in (("Seed to seed", an["seed_spread"]), ("Batch B minus B/2", an["batch_check"]),
                      ("Kernels minus reference", an["backend_check"])):
        if sp:
            lines.append(f"{title} ({sp['n']} sizes, {gate.budgets_of(sp)}): mean difference {sp['mean_diff']:+.4f}, largest "
                         f"{sp['max_abs_diff']:.4f}, rms {sp['rms_diff']:.4f} nats/token.")
    if an["seed_spread"]:
        lines.append(f"One run's seed-to-seed standard deviation: {an['seed_spread']['per_run_sd']:.4f} nats/token "
                     f"({an['seed_spread']['per_run_sd_log']:.4f} in log L).")
    sp = [s["speedup"] for s in (an["backend_check"] or {}).get("sizes", []) if s["speedup"]]
    if sp:
        lines.append(f"Training time, reference over kernels: {min(sp):.2f}x to {max(sp):.2f}x.")
    return lines + ["", f"Training time {an['train_seconds']:.0f} s over {len(results)} runs (wall-clock of the runs "
                    f"{an['wall_seconds']:.0f} s).", ""]


def _throughput_lines(an: dict) -> list[str]:
    rows = an["throughput"]
    if not rows:
        return ["## Throughput", "", "No run has a measured MFU (no GPU of known peak).", ""]
    peak = sorted({round(r["peak_flops"] / 1e12, 1) for r in rows})
    lines = ["## Throughput of the training step", "",
             "MFU = tokens/s x FLOPs a token / peak, FLOPs a token = 6·N_total + 6·layers·seq_len·width (every matrix "
             "product with the head, and the attention scores over the causal half: `plan.ModelConfig`), tokens/s "
             "from each run's measured training time (its held-out evaluations excluded), peak = "
             + "/".join(f"{v:g}" for v in peak) + " TFLOP/s (bf16 dense). Medians over the runs of each size "
             "and batch:", "", "| size | N total | batch | runs | steps | tokens/s | MFU | best MFU |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['name']} | {count(r['params'])} | {r['batch']} | {r['runs']} | {r['steps']:,} | "
              f"{r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {r['mfu_max']:.1%} |" for r in rows]
    big = [r for r in rows if r["params"] >= 10e6]
    lines += ["", (f"From 10M parameters: MFU {min(r['mfu'] for r in big):.1%} to {max(r['mfu'] for r in big):.1%}."
                   if big else "No size of 10M parameters or more.") + "", ""]
    return lines


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
            f"| {r['train']['batch_size']} | {r['steps']} | {r['train']['lr']:.2e} | {num(loss, '.4f') if ok else 'diverged'} "
            f"| {num(bits_per_byte(loss, tpb) if ok else None, '.4f')} | {num(bigram - loss if ok and bigram else None)} "
            f"| {r['tokens_per_s']:,.0f} | {num(r['mfu'], '.1%')} | {r['train_seconds']:.1f} |")
    return lines


def markdown(info: dict, an: dict, results: list[dict], meta: dict) -> str:
    lines = [f"# Compute-optimal scaling on {info['device']} ({info['date']})", "",
             f"Command: `{info['command']}`  ",
             f"Written with torch {info['torch']}, triton {info['triton']}, Python {info['python']}; "
             f"{info.get('workers', 1)} training process(es)"
             + (f", {info['runs_per_device']} runs at once in each" if info.get("runs_per_device", 1) > 1 else "")
             + (f", {info['wall_seconds'] / 60:.1f} min wall-clock in this invocation" if info.get("wall_seconds") else "")
             + ".", ""]
    lines += _result_lines(an) + _gate_lines(an) + _design_lines(an) + _data_lines(an, meta) + _lr_lines(an)
    lines += _fits_lines(an) + literature_lines(an, meta) + _extrapolation_lines(an) + _checks_lines(an, results)
    lines += _throughput_lines(an)
    lines += ["## Figures", ""] + [f"- `{name}`" for name in an["figures"]]
    lines += [f"- `{name}`: not drawn: {why}" for name, why in an["figures_skipped"].items()]
    lines += ["", "## Runs", ""] + _runs_table(results, meta)
    return "\n".join(lines) + "\n"
