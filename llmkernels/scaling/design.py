"""The experiment's design: which runs each stage trains (no torch: ``--list`` prints it without data).

Stages, in order:
  1. ``lr``: rates ``lr_mults`` x the prior rule at ``lr_sizes`` sizes of two lower budgets (the
     smallest, and the smallest with the largest batch among the lower budgets); a (budget, size)
     whose best rate is the lowest or highest tried gets one more rate beyond it, up to
     ``lr_rounds`` times. The rule ``lr = c·(N/1e6)^-gamma·(batch tokens/2^15)^0.5`` is fitted from it.
  2. ``lower``: the ``lower_budgets`` smallest budgets, each at ``sizes_per_budget`` sizes about
     ``span^(2/(sizes-1))`` apart from ``N/span`` to ``N·span`` around the prior optimum
     (``tokens_per_param``), and a second seed at ``seed_budgets``.
  3. ``upper``: the other budgets, their windows centred on ``N_opt(C)`` fitted to the lower
     budgets; half the batch at three sizes of the top budget (the batch check).
Sizes that would see fewer than ``min_tokens_per_param`` tokens a parameter are skipped.

GPU time of the default, and how it was sized: ``estimate`` sums ``plan.StepCost`` (seconds a step
on one H100, fitted to the 71 kernels-backend runs of the committed 2026-11-25 sweep, rms error
2.7%) over every planned run, plus 45 s of data preparation and compilation per invocation. 123
runs (30 learning-rate, 72 IsoFLOP, 21 checks): 12.7 minutes in one piece with the upper windows
on the prior centre, 14.4 with them on an optimum of 80 tokens a parameter (smaller models, more
steps), 1.5 more in three 10-minute pieces; the learning-rate extensions add up to about 0.5 s
to 5 s a run. 1e14-1e16 with the same layout would take about 27 minutes, over the 20 allowed.
"""
from __future__ import annotations

from dataclasses import dataclass

from .plan import (H100, LADDER, HParams, LRRule, ModelConfig, Run, StepCost, budgets, make_run, parse_batch_rule,
                   parse_ladder, prior_optimal_params, window)

STAGES = ("lr", "sweep", "seed", "batch", "backend")


@dataclass(frozen=True)
class Design:
    """The whole experiment (see the module docstring); budgets are indexed from 0 = smallest."""

    budget_lo: float = 3e13
    budget_hi: float = 3e15
    n_budgets: int = 8
    lower_budgets: int = 5
    sizes_per_budget: int = 9
    span: float = 3.0
    tokens_per_param: float = 20.0
    min_tokens_per_param: float = 2.0
    lr_budgets: tuple | None = None
    lr_sizes: int = 3
    lr_mults: tuple = (0.25, 0.5, 1.0, 2.0, 4.0)
    lr_rounds: int = 2
    seed_budgets: tuple = (1, 3)
    batch_check_sizes: int = 3
    backend_check: int | None = None
    backend: str = "kernels"
    check_backend: str = "reference"
    seed: int = 0

    def __post_init__(self):
        n = self.n_budgets
        if not 1 <= self.lower_budgets <= n:
            raise ValueError(f"lower budgets must be 1..{n}, got {self.lower_budgets}")
        for name in ("seed_budgets", "lr_budgets"):
            if any(not 0 <= i < n for i in getattr(self, name) or ()):
                raise ValueError(f"{name} must index the {n} budgets, got {getattr(self, name)}")
        if any(i >= self.lower_budgets for i in self.lr_budgets or ()):
            raise ValueError(f"the learning-rate sweep runs before the windows are fitted: its budgets must be "
                             f"among the {self.lower_budgets} lower ones, got {self.lr_budgets}")

    def budgets(self) -> list[float]:
        return budgets(self.budget_lo, self.budget_hi, self.n_budgets)

    def sizes(self, models: list[ModelConfig], compute: float, centre: float | None = None) -> list[ModelConfig]:
        """The window at ``compute``, around ``centre`` (default: the prior optimum)."""
        centre = prior_optimal_params(compute, self.tokens_per_param) if centre is None else centre
        return window(models, compute, centre, self.sizes_per_budget, self.span, self.min_tokens_per_param)

    # ----------------------------------------------------------------------------------------
    def lr_budget_indices(self, hp: HParams) -> tuple:
        """The given ones, or the smallest budget and the smallest lower budget with the largest
        batch among the lower ones (so the rule is fitted at the batches it is used with)."""
        if self.lr_budgets is not None:
            return tuple(self.lr_budgets)
        batches = [hp.batch(c) for c in self.budgets()[: self.lower_budgets]]
        other = batches.index(max(batches))
        return (0, other) if other else (0, 1) if self.lower_budgets > 1 else (0,)

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
        rate is an edge of those tried: beyond it by the ratio of the default rates' ends' neighbours."""
        ratio = max(self.lr_mults) / sorted(self.lr_mults)[-2] if len(self.lr_mults) > 1 else 2.0
        by_group = {(r.budget, r.model.name): r for r in runs}
        more = []
        for g in groups:
            mults = g["lr_mults"]
            if g["edge"] and (g["budget"], g["name"]) in by_group:
                mult = min(mults) / ratio if g["edge"] == "low" else max(mults) * ratio
                more.append(self.lr_run(g["budget"], by_group[(g["budget"], g["name"])].model, mult, hp))
        return more

    # ----------------------------------------------------------------------------------------
    def _checks(self, models, rule: LRRule, hp: HParams, index: int, sizes: list[ModelConfig]) -> list[Run]:
        c = self.budgets()[index]
        runs = []
        if index in self.seed_budgets:
            runs += [make_run("seed", c, m, rule, hp, seed=self.seed + 1, backend=self.backend) for m in sizes]
        if index == self.backend_check:
            runs += [make_run("backend", c, m, rule, hp, seed=self.seed, backend=self.check_backend) for m in sizes]
        if index == self.n_budgets - 1 and self.batch_check_sizes > 0 and hp.batch(c) >= 2:
            k = self.batch_check_sizes
            picks = sorted({round((j + 1) * (len(sizes) - 1) / (k + 1)) for j in range(k)})
            runs += [make_run("batch", c, sizes[j], rule, hp, seed=self.seed, backend=self.backend,
                              batch=hp.batch(c) // 2) for j in picks]
        return runs

    def stage_runs(self, models, rule: LRRule, hp: HParams, indices, centres: dict | None = None) -> list[Run]:
        """The IsoFLOP runs of the budgets ``indices`` (windows around ``centres[budget]``, default the
        prior) and the checks that fall at them."""
        runs, cs = [], self.budgets()
        for i in indices:
            sizes = self.sizes(models, cs[i], (centres or {}).get(cs[i]))
            runs += [make_run("sweep", cs[i], m, rule, hp, seed=self.seed, backend=self.backend) for m in sizes]
            runs += self._checks(models, rule, hp, i, sizes)
        return runs

    def lower(self, models, rule: LRRule, hp: HParams) -> list[Run]:
        return self.stage_runs(models, rule, hp, range(self.lower_budgets))

    def upper(self, models, rule: LRRule, hp: HParams, centres: dict | None) -> list[Run]:
        return self.stage_runs(models, rule, hp, range(self.lower_budgets, self.n_budgets), centres)


def estimate(runs: list[Run], cost: StepCost = H100, pieces: int = 1) -> float:
    """Seconds on one GPU of ``runs`` back to back in ``pieces`` invocations (``plan.StepCost``)."""
    return sum(cost.run_seconds(r) for r in runs) + pieces * cost.process_overhead


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
                        batch_check_sizes=args.batch_check, backend_check=args.backend_check, backend=args.backend,
                        check_backend="reference" if args.backend == "kernels" else "kernels", seed=args.seed)
        hp = HParams(batch_rule=parse_batch_rule(args.batch_rule), warmup_frac=args.warmup_frac,
                     weight_decay=args.weight_decay)
        ladder = parse_ladder(args.ladder) if args.ladder else LADDER
    except ValueError as exc:
        raise SystemExit(f"llmkernels scaling: {exc}") from None
    return design, hp, ladder


def centres_from(fit_n: dict | None, upper: list[float]) -> dict | None:
    """``{budget: N_opt}`` from a fitted ``N_opt = coef·C^exponent`` (``fit.power_law``'s), None if none."""
    if not fit_n or not fit_n.get("ok") or not fit_n.get("exponent") or fit_n["exponent"] <= 0:
        return None
    return {c: fit_n["coef"] * c ** fit_n["exponent"] for c in upper}
