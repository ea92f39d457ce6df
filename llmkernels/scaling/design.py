"""The experiment's design: which runs each stage trains (no torch: ``--list`` prints it without data).

Stages, in order:
  1. ``lr``: rates ``lr_mults`` x the prior rule at ``lr_sizes`` sizes of the smallest budget (and,
     when the lower budgets' batches differ, of the smallest with the largest of them); a (budget,
     size) whose best rate is the lowest or highest tried, or whose optimum by the rule shared by the
     sizes lies beyond the rates tried, gets one more rate on that side, up to ``lr_rounds`` times.
     The rule ``lr = c·(N/1e6)^-gamma·(batch tokens/2^15)^0.5`` is fitted from it.
  2. ``lower``: the ``lower_budgets`` smallest budgets, each at ``sizes_per_budget`` sizes about
     ``span^(2/(sizes-1))`` apart from ``N/span`` to ``N·span`` around the prior optimum
     (``tokens_per_param``), a second seed (``SEED_CHECK_OFFSET``) at ``seed_budgets`` and half the
     batch at ``batch_check_sizes`` sizes of each of ``batch_budgets`` (the batch check; by default the
     smallest budget of each batch the rule gives, where that batch has the fewest steps).
  3. ``upper``: the other budgets, their windows centred on ``N_opt(C)`` fitted to the lower
     budgets when that fit is good enough, else shrunk toward the prior exponent, and widened by
     the extrapolation's uncertainty (``centre_plan``).
Sizes that would see fewer than ``min_tokens_per_param`` tokens a parameter are skipped.

The default range starts above the loss's early plateau and its drop (from about 1.3 nats to below
1.0 once some tens of millions of tokens are seen), whose timing varies with size and seed: runs
that end around it lie off any smooth L(N, D), and the learning-rate sweep, the seed pair and the
batch check, all at the smallest budget, would carry that noise into every run of a sweep.
``tokens_per_param`` (80) is where the parabolas above the drop put the optimum. The evidence is in
``benchmarks/results/scaling-h100x4-2026-11-27/`` and ``-2026-11-28/``. Below about 1.26e15 no batch
rule helps: at 64 sequences the smallest budgets' runs stop inside the drop and the batch check fails
(``scaling-h200-2026-11-28-interim/d0/``); at 16 and 32 (``--batch-rule 3.2e14:16,9e14:32,64``) they
pass it, but the seed pairs stay 0.06 nats a run apart and the gate's noise check fails (``e0/``).

GPU time (``estimate``): ``plan.StepCost`` (seconds a step on one H100) summed over every planned
run; with several training processes each stage lasts as long as the busiest process (runs handed
out in the runner's order, ``run_order``, and a stage starts when the one before it has ended), plus the data preparation and first kernel
compilations of each invocation. ``llmkernels scaling --list`` prints it for the plan at hand.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from .plan import (H100, LADDER, MODEL_SWITCHES, HParams, LRRule, ModelConfig, Run, StepCost, budgets, ladder_models,
                   make_run, parse_batch_rule, parse_ladder, prior_optimal_params, window)

STAGES = ("lr", "sweep", "seed", "batch", "backend")
# The seed check's runs train with seed + this, so that a replicate sweep with a nearby --seed
# shares none of its runs with another sweep's checks.
SEED_CHECK_OFFSET = 1000


@dataclass(frozen=True)
class Design:
    """The whole experiment (see the module docstring); budgets are indexed from 0 = smallest."""

    budget_lo: float = 1e15
    budget_hi: float = 6e15
    n_budgets: int = 5
    lower_budgets: int = 3
    sizes_per_budget: int = 7
    span: float = 2.2
    tokens_per_param: float = 80.0
    min_tokens_per_param: float = 2.0
    lr_budgets: tuple | None = None
    lr_sizes: int = 3
    lr_mults: tuple = (0.35, 0.7, 1.4, 2.8)
    lr_rounds: int = 2
    seed_budgets: tuple = (0,)
    batch_check_sizes: int = 3
    batch_budgets: tuple | None = None
    backend_check: int | None = None
    backend: str = "kernels"
    check_backend: str = "reference"
    seed: int = 0

    def __post_init__(self):
        n = self.n_budgets
        if not 1 <= self.lower_budgets <= n:
            raise ValueError(f"lower budgets must be 1..{n}, got {self.lower_budgets}")
        if any(not -n <= i < n for i in self.batch_budgets or ()):
            raise ValueError(f"the batch check's budgets must index the {n} budgets, got {self.batch_budgets}")
        for name in ("seed_budgets", "lr_budgets"):
            if any(not 0 <= i < n for i in getattr(self, name) or ()):
                raise ValueError(f"{name} must index the {n} budgets, got {getattr(self, name)}")
        if any(i >= self.lower_budgets for i in self.lr_budgets or ()):
            raise ValueError(f"the learning-rate sweep runs before the windows are fitted: its budgets must be "
                             f"among the {self.lower_budgets} lower ones, got {self.lr_budgets}")

    def budgets(self) -> list[float]:
        return budgets(self.budget_lo, self.budget_hi, self.n_budgets)

    def sizes(self, models: list[ModelConfig], compute: float, centre: float | None = None,
              span: float | None = None) -> list[ModelConfig]:
        """The window at ``compute``, around ``centre`` (default: the prior optimum), ``span`` (default:
        the design's) each side."""
        centre = prior_optimal_params(compute, self.tokens_per_param) if centre is None else centre
        return window(models, compute, centre, self.sizes_per_budget, span or self.span, self.min_tokens_per_param)

    # ----------------------------------------------------------------------------------------
    def lr_budget_indices(self, hp: HParams) -> tuple:
        """The given ones, or the smallest budget and the smallest lower budget with the largest
        batch among the lower ones (so the rule is fitted at the batches it is used with); the
        smallest alone when every lower budget has one batch (the rule's batch term is then unused)."""
        if self.lr_budgets is not None:
            return tuple(self.lr_budgets)
        batches = [hp.batch(c) for c in self.budgets()[: self.lower_budgets]]
        other = batches.index(max(batches))
        return (0, other) if other else (0,) if len(set(batches)) == 1 else (0, 1)

    def batch_budget_indices(self, hp: HParams) -> tuple:
        """The given ones, or the smallest budget of each batch the rule gives: a batch's runs there
        take the fewest steps, so it is where halving the batch would change the loss most."""
        if self.batch_budgets is not None:
            return tuple(sorted({i % self.n_budgets for i in self.batch_budgets}))
        batches = [hp.batch(c) for c in self.budgets()]
        return tuple(i for i, b in enumerate(batches) if i == 0 or b != batches[i - 1])

    def lr_run(self, compute: float, model: ModelConfig, mult: float, hp: HParams) -> Run:
        return make_run("lr", compute, model, LRRule(), hp, seed=self.seed, backend=self.backend, lr_mult=mult)

    def lr_sweep(self, models: list[ModelConfig], hp: HParams) -> list[Run]:
        runs, cs = [], self.budgets()
        for i in self.lr_budget_indices(hp):
            sizes = self.sizes(models, cs[i])
            picks = sorted({round(k * (len(sizes) - 1) / max(1, self.lr_sizes - 1)) for k in range(self.lr_sizes)})
            runs += [self.lr_run(cs[i], sizes[k], m, hp) for k in picks for m in self.lr_mults]
        return runs

    def lr_extension(self, groups: list[dict], runs: list[Run], hp: HParams) -> list[Run]:
        """One more rate for each (budget, size) of ``groups`` (``fit.fit_lr_rule``'s rows) whose best
        rate is an edge of those tried, or whose optimum by the rule shared by the sizes lies beyond
        them (``beyond``): past the end on that side by the ratio of the default rates' ends'
        neighbours."""
        ratio = max(self.lr_mults) / sorted(self.lr_mults)[-2] if len(self.lr_mults) > 1 else 2.0
        by_group = {(r.budget, r.model.name): r for r in runs}
        more = []
        for g in groups:
            mults = g["lr_mults"]
            side = g["edge"] or g.get("beyond")
            if side and (g["budget"], g["name"]) in by_group:
                mult = min(mults) / ratio if side == "low" else max(mults) * ratio
                more.append(self.lr_run(g["budget"], by_group[(g["budget"], g["name"])].model, mult, hp))
        return more

    # ----------------------------------------------------------------------------------------
    def _checks(self, models, rule: LRRule, hp: HParams, index: int, sizes: list[ModelConfig]) -> list[Run]:
        c = self.budgets()[index]
        runs = []
        if index in self.seed_budgets:
            runs += [make_run("seed", c, m, rule, hp, seed=self.seed + SEED_CHECK_OFFSET, backend=self.backend)
                     for m in sizes]
        if index == self.backend_check:
            runs += [make_run("backend", c, m, rule, hp, seed=self.seed, backend=self.check_backend) for m in sizes]
        if index in self.batch_budget_indices(hp) and self.batch_check_sizes > 0 and hp.batch(c) >= 2:
            k = self.batch_check_sizes
            picks = sorted({round((j + 1) * (len(sizes) - 1) / (k + 1)) for j in range(k)})
            runs += [make_run("batch", c, sizes[j], rule, hp, seed=self.seed, backend=self.backend,
                              batch=hp.batch(c) // 2) for j in picks]
        return runs

    def stage_runs(self, models, rule: LRRule, hp: HParams, indices, centres: dict | None = None,
                   spans: dict | None = None) -> list[Run]:
        """The IsoFLOP runs of the budgets ``indices`` (windows around ``centres[budget]``, default the
        prior, ``spans[budget]`` each side, default the design's) and the checks that fall at them."""
        runs, cs = [], self.budgets()
        for i in indices:
            sizes = self.sizes(models, cs[i], (centres or {}).get(cs[i]), (spans or {}).get(cs[i]))
            runs += [make_run("sweep", cs[i], m, rule, hp, seed=self.seed, backend=self.backend) for m in sizes]
            runs += self._checks(models, rule, hp, i, sizes)
        return runs

    def lower(self, models, rule: LRRule, hp: HParams) -> list[Run]:
        return self.stage_runs(models, rule, hp, range(self.lower_budgets))

    def upper(self, models, rule: LRRule, hp: HParams, centres: dict | None, spans: dict | None = None) -> list[Run]:
        return self.stage_runs(models, rule, hp, range(self.lower_budgets, self.n_budgets), centres, spans)


def run_order(runs) -> list:
    """The order runs are handed out in: longest first, so that the processes end together, and
    under a time limit the longest runs start early in a call rather than being left, each alone,
    to a last call of their own."""
    return sorted(runs, key=lambda r: -H100.run_seconds(r))


def estimate(stages: list[list[Run]], cost: StepCost = H100, pieces: int = 1, workers: int = 1) -> float:
    """Seconds of the runs of ``stages`` in ``pieces`` invocations on ``workers`` GPUs
    (``plan.StepCost``): each stage's runs handed out in ``run_order`` to the least busy process, a
    stage lasting until its busiest process ends."""
    total = 0.0
    for stage in stages:
        loads = [0.0] * workers
        for run in run_order(stage):
            loads[loads.index(min(loads))] += cost.run_seconds(run)
        total += max(loads)
    return total + pieces * cost.process_overhead


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(","))


def _indices(text: str | None) -> tuple | None:
    return None if text in (None, "") else tuple(int(v) for v in text.split(","))


def design_from(args) -> tuple[Design, HParams, list]:
    """The design, the fixed hyperparameters and the ladder from the command line's arguments."""
    lo, hi, count = _floats(args.budgets) if args.budgets.count(",") == 2 else (None, None, None)
    if count is None or count != int(count) or count < 1:
        raise SystemExit(f"--budgets: expected LO,HI,COUNT, got {args.budgets!r}")
    try:
        design = Design(budget_lo=lo, budget_hi=hi, n_budgets=int(count), lower_budgets=min(int(count), args.lower_budgets),
                        sizes_per_budget=args.sizes_per_budget, span=args.span, tokens_per_param=args.tokens_per_param,
                        min_tokens_per_param=args.min_tokens_per_param, lr_budgets=_indices(args.lr_budgets),
                        lr_sizes=args.lr_sizes, lr_mults=_floats(args.lr_mults), lr_rounds=args.lr_rounds,
                        seed_budgets=tuple(i for i in _indices(args.seed_budgets) or () if i < count),
                        batch_check_sizes=args.batch_check, batch_budgets=_indices(args.batch_budgets), backend_check=args.backend_check, backend=args.backend,
                        check_backend="reference" if args.backend == "kernels" else "kernels", seed=args.seed)
        hp = HParams(batch_rule=parse_batch_rule(args.batch_rule), warmup_frac=args.warmup_frac,
                     weight_decay=args.weight_decay)
        ladder = parse_ladder(args.ladder) if args.ladder else LADDER
    except ValueError as exc:
        raise SystemExit(f"llmkernels scaling: {exc}") from None
    return design, hp, ladder


def add_model_switches(group) -> None:
    """The flags of ``MODEL_SWITCHES``, one definition for every command line that builds the model
    (``llmkernels scaling``, ``benchmarks/scaling_check.py``)."""
    group.add_argument("--qk-norm", action=argparse.BooleanOptionalAction, default=True,
                       help="RMSNorm of each head's queries and keys (stabilises high learning rates) (default: on)")
    group.add_argument("--fused-qk-rope", action="store_true",
                       help="the QK-norm and the rotation in one kernel (qkv_norm_rope): a pass fewer, one rounding "
                            "fewer, so runs of another model than those without it (default: off)")
    group.add_argument("--bf16-residual", action="store_true",
                       help="the residual stream in bfloat16 on a GPU, not float32: the norms move a third fewer "
                            "bytes and the sum is rounded at every block, so runs of another model (default: off)")


def model_switches(args) -> dict:
    """The command line's model switches (``MODEL_SWITCHES``), as ``ModelConfig`` takes them."""
    return {name: getattr(args, name) for name in MODEL_SWITCHES}


def models_from(args, vocab_size: int, ladder: list) -> list[ModelConfig]:
    """The ladder's models with the command line's sequence length, head size and model switches."""
    return ladder_models(vocab_size, args.seq_len, args.head_dim, ladder, **model_switches(args))


# The lower budgets' N_opt(C) fit places the upper windows as it is only when it is at least this
# good; otherwise its exponent is shrunk toward the prior's (the H200's second cut-short sweep
# placed them from 3 points with r2 0.01 and an exponent of 0.05 +- 0.37: 4-8x below the first's).
CENTRE_MIN_POINTS = 4
CENTRE_MIN_R2 = 0.7
CENTRE_MAX_SE = 0.15
PRIOR_EXPONENT, PRIOR_EXPONENT_SD = 0.5, 0.1  # Chinchilla's a, and the spread of published small-scale fits
MAX_SPAN_GROWTH = 1.5  # a 9-size window then stays at most about 1.46x apart


def empirical_optima(lower_runs: list[dict], optima: list[dict]) -> list[tuple[float, float]]:
    """``(C, N)`` per lower budget: the parabola's minimum where it lies inside the sizes tried,
    else the size of lowest loss (a minimum at the window's edge is still the best evidence there)."""
    inside = {o["budget"]: o["n_opt"] for o in optima if o["ok"] and o["inside"]}
    points = []
    for c in sorted({r["budget"] for r in lower_runs}):
        best = min((r for r in lower_runs if r["budget"] == c), key=lambda r: r["val_loss"])
        points.append((c, inside.get(c, best["params"])))
    return points


def centre_plan(lower_runs: list[dict], fit_n: dict | None, optima: list[dict], upper: list[float], span: float) -> dict:
    """Centres and half-widths (``span``) of the upper budgets' windows from the lower budgets.

    ``fit_n`` (approach 2's weighted ``N_opt = coef·C^exponent``) is used as it is when it passes the
    quality bar (``CENTRE_MIN_POINTS`` budgets, r2 >= ``CENTRE_MIN_R2``, exponent SE <=
    ``CENTRE_MAX_SE``, 0 < exponent < 1); otherwise the exponent is the precision-weighted blend of
    its own and the prior ``PRIOR_EXPONENT ± PRIOR_EXPONENT_SD`` (the prior alone without a usable
    fit), through the lower budgets' empirical optima (``empirical_optima``) in log-log. Each window
    widens by the extrapolation's standard error in log N, ``exp(se·|log C - mean log C_lower|)``,
    at most ``MAX_SPAN_GROWTH`` times. Empty ``centres`` (the prior's windows) without lower runs."""
    points = empirical_optima(lower_runs, optima) if lower_runs else []
    if not points:
        return {"source": "prior (no lower-budget results)", "centres": {}, "spans": {}}
    mean_lc = sum(math.log(c) for c, _ in points) / len(points)
    mean_ln = sum(math.log(n) for _, n in points) / len(points)
    fit_n = fit_n or {}
    a, se = fit_n.get("exponent"), fit_n.get("exponent_se")
    good = (bool(fit_n.get("ok")) and a is not None and se is not None and 0 < a < 1 and se <= CENTRE_MAX_SE
            and fit_n.get("n_points", 0) >= CENTRE_MIN_POINTS and (fit_n.get("r2") or 0.0) >= CENTRE_MIN_R2)
    if good:
        exponent, exp_se, log_coef = a, se, math.log(fit_n["coef"])
        source = f"approach 2 over the lower budgets (a = {a:.3f} ± {se:.3f}, r2 {fit_n['r2']:.2f}, {fit_n['n_points']} budgets)"
    else:
        w_prior = PRIOR_EXPONENT_SD ** -2
        w_fit = se ** -2 if fit_n.get("ok") and a is not None and se else 0.0
        exponent = (w_prior * PRIOR_EXPONENT + w_fit * (a if w_fit else 0.0)) / (w_prior + w_fit)
        exp_se = (w_prior + w_fit) ** -0.5
        log_coef = mean_ln - exponent * mean_lc
        why = ("no usable fit" if not w_fit else
               f"fit a = {a:.3f} ± {se:.3f}, r2 {fit_n.get('r2') or 0.0:.2f}, {fit_n.get('n_points', 0)} budgets")
        source = (f"prior a = {PRIOR_EXPONENT} ± {PRIOR_EXPONENT_SD} blended with the lower budgets ({why}): "
                  f"a = {exponent:.3f} ± {exp_se:.3f} through their empirical optima")
    centres = {c: math.exp(log_coef + exponent * math.log(c)) for c in upper}
    spans = {c: span * min(MAX_SPAN_GROWTH, math.exp(exp_se * abs(math.log(c) - mean_lc))) for c in upper}
    return {"source": source, "good_fit": good, "exponent": exponent, "exponent_se": exp_se,
            "optima": [list(p) for p in points], "centres": centres, "spans": spans}
