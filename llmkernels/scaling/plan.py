"""The experiment's plan, in plain Python (no torch: ``--list`` prints it without building data).

Model shapes (a ladder of ``(layers, width)``), compute budgets, the sizes each budget trains, the
hyperparameter rule and the run records. Every count here is total: parameters include the (tied)
embedding, training compute includes the head and attention.

Counting, per token of training (forward + backward = 3x forward):
``C/token = 6 * N_total + 6 * layers * seq_len * width``. ``6 * N_total`` covers every matrix
product, the language-model head included (the tied embedding's lookup is free, its use as head
is not); the second term is the attention scores and their use on the values over the causal half
of the context (Kaplan et al. 2020 count it so). Norm weights are in ``N_total`` (a rounding).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

HEAD_DIM = 64  # FlashAttention's fastest head size on Hopper; every width is a multiple of it
SEQ_LEN = 512
BYTE_VOCAB = 320  # 256 bytes + end-of-text, padded to a multiple of 64 for the tensor cores

# (layers, width): 0.18M to 45M total parameters at the byte vocabulary, about 1.25-1.4x apart,
# width / layers between 21 and 72 (the shape matters little at fixed N: Kaplan et al. 2020).
LADDER = [
    (3, 64), (4, 64), (2, 128), (3, 128), (4, 128), (5, 128), (3, 192), (4, 192), (5, 192), (4, 256),
    (5, 256), (6, 256), (5, 320), (6, 320), (7, 320), (6, 384), (7, 384), (8, 384), (7, 448), (8, 448), (8, 512),
    (8, 576), (9, 640),
]

# Published fits for the report (Hoffmann et al. 2022, Table 2 / A; Besiroglu et al. 2024, Table 1).
PUBLISHED = {
    "chinchilla_approach1": {"a": 0.50, "a_ci": [0.488, 0.502], "b": 0.50, "b_ci": [0.501, 0.512]},
    "chinchilla_approach2": {"a": 0.49, "a_ci": [0.462, 0.534], "b": 0.51, "b_ci": [0.483, 0.529]},
    "chinchilla_approach3": {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28, "a": 0.46, "b": 0.54},
    "besiroglu2024_approach3": {"E": 1.82, "A": 482.01, "B": 2085.43, "alpha": 0.3478, "beta": 0.3658,
                                "E_se": 0.03, "alpha_se": 0.02, "beta_se": 0.02,
                                "a": round(0.3658 / (0.3478 + 0.3658), 3), "b": round(0.3478 / (0.3478 + 0.3658), 3)},
}


@dataclass(frozen=True)
class ModelConfig:
    """One decoder's shape: ``n_layers`` blocks of ``width`` channels in heads of ``head_dim``."""

    vocab_size: int
    n_layers: int
    width: int
    seq_len: int = SEQ_LEN
    head_dim: int = HEAD_DIM
    rope_theta: float = 10000.0
    eps: float = 1e-6

    def __post_init__(self):
        for name in ("vocab_size", "n_layers", "width", "seq_len", "head_dim"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.width % self.head_dim or self.head_dim % 2:
            raise ValueError(f"width ({self.width}) must be a multiple of head_dim ({self.head_dim}), "
                             f"which must be even")

    @property
    def name(self) -> str:
        return f"L{self.n_layers}-W{self.width}"

    @property
    def n_heads(self) -> int:
        return self.width // self.head_dim

    @property
    def mlp_hidden(self) -> int:
        """SwiGLU hidden size: 8/3 of the width (the parameters of a 4x GELU MLP), in multiples of 64
        (of 8 below width 64)."""
        step = 64 if self.width >= 64 else 8
        return step * max(1, round(8 * self.width / 3 / step))

    def non_embedding_params(self) -> int:
        """Attention 4·d², SwiGLU 3·d·hidden, two norms a block, the final norm."""
        d, h = self.width, self.mlp_hidden
        return self.n_layers * (4 * d * d + 3 * d * h + 2 * d) + d

    def embedding_params(self) -> int:
        return self.vocab_size * self.width

    def total_params(self) -> int:
        """Every parameter: the tied embedding / head once, and the rest."""
        return self.non_embedding_params() + self.embedding_params()

    def flops_per_token(self) -> int:
        """Training FLOPs per token (see the module docstring)."""
        return 6 * self.total_params() + 6 * self.n_layers * self.seq_len * self.width

    def to_dict(self) -> dict:
        return asdict(self)


def ladder_models(vocab_size: int, seq_len: int = SEQ_LEN, head_dim: int = HEAD_DIM, ladder=None) -> list[ModelConfig]:
    shapes = LADDER if ladder is None else ladder
    models = [ModelConfig(vocab_size, n_layers, width, seq_len=seq_len, head_dim=head_dim) for n_layers, width in shapes]
    return sorted(models, key=ModelConfig.total_params)


def parse_ladder(spec: str) -> list[tuple[int, int]]:
    """``LAYERSxWIDTH,LAYERSxWIDTH,...`` (e.g. ``1x16,2x32``)."""
    shapes = []
    for item in spec.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--ladder: {item!r} is not LAYERSxWIDTH")
        shapes.append((int(parts[0]), int(parts[1])))
    return shapes


def budgets(lo: float, hi: float, count: int) -> list[float]:
    """``count`` compute budgets spaced evenly in log from ``lo`` to ``hi`` FLOPs (3 significant digits)."""
    if count < 1 or lo <= 0 or hi < lo:
        raise ValueError(f"need 0 < lo <= hi and count >= 1, got lo={lo}, hi={hi}, count={count}")
    if count == 1:
        return [float(f"{lo:.3g}")]
    return [float(f"{lo * (hi / lo) ** (i / (count - 1)):.3g}") for i in range(count)]


def prior_optimal_params(compute: float, tokens_per_param: float) -> float:
    """The window's centre: ``N`` with ``C = 6·N·D`` and ``D = tokens_per_param·N`` (Chinchilla's 20)."""
    return math.sqrt(compute / (6.0 * tokens_per_param))


def window(models: list[ModelConfig], compute: float, tokens_per_param: float, count: int,
           span: float) -> list[ModelConfig]:
    """``count`` sizes for one budget: targets spaced evenly in log from ``N_opt/span`` to
    ``N_opt·span`` around the prior optimum, each the nearest unused ladder size; the two ends
    rounded outward (at or below the lowest target, at or above the highest where the ladder
    allows) so that the window covers at least ``[N_opt/span, N_opt·span]``."""
    if count < 2:
        raise ValueError(f"sizes per budget must be >= 2, got {count}")
    if len(models) < count:
        raise ValueError(f"the ladder has {len(models)} sizes, fewer than {count} per budget")
    centre = prior_optimal_params(compute, tokens_per_param)
    targets = [centre * span ** (2 * i / (count - 1) - 1) for i in range(count)]
    sizes = [m.total_params() for m in models]
    picked: list[int] = []
    for i, t in enumerate(targets):
        order = sorted(range(len(models)), key=lambda j: abs(math.log(sizes[j] / t)))
        if i == 0:
            below = [j for j in range(len(models)) if sizes[j] <= t]
            order = ([max(below, key=lambda j: sizes[j])] if below else []) + order
        elif i == count - 1:
            above = [j for j in range(len(models)) if sizes[j] >= t]
            order = ([min(above, key=lambda j: sizes[j])] if above else []) + order
        picked.append(next(j for j in order if j not in picked))
    return [models[j] for j in sorted(picked)]


# --------------------------------------------------------------------------------------------
# hyperparameters: the rule
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LRRule:
    """Peak learning rate ``lr = c · (N_total / 1e6)^(-gamma) · (batch_tokens / 2^15)^kappa``.

    ``kappa`` is fixed at 1/2 (Adam's square-root batch scaling, Malladi et al. 2022): the batch
    follows the token count (see ``HParams``), and the sweep's batches are too few to fit it.
    ``c`` and ``gamma`` come from the learning-rate sweep (``fit.fit_lr_rule``) or, before it
    has run, are this prior."""

    c: float = 3e-3
    gamma: float = 0.25
    kappa: float = 0.5
    source: str = "prior"

    def lr(self, n_params: int, batch_tokens: int) -> float:
        return self.c * (n_params / 1e6) ** (-self.gamma) * (batch_tokens / 2**15) ** self.kappa


@dataclass(frozen=True)
class HParams:
    """Settings of the rule that are not fitted.

    Batch: ``tokens / (seq_len · target_steps)`` sequences, rounded to a power of two within
    ``[min_batch, max_batch]``, so that every run takes a comparable number of optimizer steps
    (about 400-1200, more only where a small model's many tokens meet the largest batch).
    Warm-up ``warmup_frac`` of the steps (at least ``min_warmup``), then a cosine to
    ``min_lr_ratio`` of the peak (Chinchilla's 10x decay over the run's own horizon). AdamW
    (0.9, ``beta2``) with ``beta2 = 0.99`` for batches under 2^18 tokens (every batch here: 0.95
    trains small batches worse, Porian et al. 2024), decoupled weight decay, global clip 1."""

    target_steps: int = 600
    min_batch: int = 16
    max_batch: int = 256
    warmup_frac: float = 0.05
    min_warmup: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0

    def batch(self, tokens: float, seq_len: int) -> int:
        want = max(1.0, tokens / (seq_len * self.target_steps))
        return int(min(self.max_batch, max(self.min_batch, 1 << max(0, round(math.log2(want))))))

    @staticmethod
    def beta2(batch_tokens: int) -> float:
        return 0.99 if batch_tokens < 2**18 else 0.95


@dataclass(frozen=True)
class Run:
    """One training run: a size at a compute budget, with its hyperparameters."""

    stage: str  # "lr" (learning-rate sweep), "sweep" (the IsoFLOP grid), "seed", "backend" (checks)
    budget: float
    model: ModelConfig
    batch_size: int
    steps: int
    lr: float
    warmup_steps: int
    beta2: float
    seed: int = 0
    backend: str = "kernels"
    lr_mult: float = 1.0
    extra: dict = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return self.steps * self.batch_size * self.model.seq_len

    @property
    def compute(self) -> float:
        return float(self.tokens) * self.model.flops_per_token()

    @property
    def id(self) -> str:
        tag = f"{self.stage}-C{self.budget:.3g}-{self.model.name}".replace("+", "")
        if self.stage == "lr":
            tag += f"-x{self.lr_mult:g}"
        return f"{tag}-s{self.seed}-{self.backend}"


def make_run(stage: str, budget: float, model: ModelConfig, rule: LRRule, hp: HParams, *, seed: int = 0,
             backend: str = "kernels", lr_mult: float = 1.0) -> Run:
    tokens = budget / model.flops_per_token()
    batch = hp.batch(tokens, model.seq_len)
    steps = max(1, round(tokens / (batch * model.seq_len)))
    batch_tokens = batch * model.seq_len
    return Run(stage=stage, budget=budget, model=model, batch_size=batch, steps=steps,
               lr=rule.lr(model.total_params(), batch_tokens) * lr_mult,
               warmup_steps=min(steps - 1, max(hp.min_warmup, round(hp.warmup_frac * steps))) if steps > 1 else 0,
               beta2=hp.beta2(batch_tokens), seed=seed, backend=backend, lr_mult=lr_mult)


@dataclass(frozen=True)
class Design:
    """The whole experiment: which budgets, how many sizes, the learning-rate sweep and the checks."""

    budget_lo: float = 1e14
    budget_hi: float = 1e16
    n_budgets: int = 6
    sizes_per_budget: int = 7
    span: float = 4.0
    tokens_per_param: float = 20.0
    lr_budgets: int = 2  # the learning-rate sweep runs at this many of the smallest budgets
    lr_sizes: int = 3  # ... at this many sizes of each (the window's ends and middle)
    lr_mults: tuple = (0.25, 0.5, 1.0, 2.0, 4.0)
    check_budget: int = 1  # index of the budget rerun with a second seed and with the other backend
    backend: str = "kernels"
    check_backend: str = "reference"
    seed: int = 0
    checks: bool = True

    def budgets(self) -> list[float]:
        return budgets(self.budget_lo, self.budget_hi, self.n_budgets)

    def lr_sweep(self, models, rule: LRRule, hp: HParams) -> list[Run]:
        runs = []
        for c in self.budgets()[: self.lr_budgets]:
            sizes = window(models, c, self.tokens_per_param, self.sizes_per_budget, self.span)
            picks = sorted({round(i * (len(sizes) - 1) / max(1, self.lr_sizes - 1)) for i in range(self.lr_sizes)})
            for i in picks:
                for mult in self.lr_mults:
                    runs.append(make_run("lr", c, sizes[i], rule, hp, seed=self.seed, backend=self.backend,
                                         lr_mult=mult))
        return runs

    def main_runs(self, models, rule: LRRule, hp: HParams) -> list[Run]:
        """The IsoFLOP grid, then (when ``checks``) the check budget again with seed + 1 and with
        the other backend."""
        runs, cs = [], self.budgets()
        for c in cs:
            for m in window(models, c, self.tokens_per_param, self.sizes_per_budget, self.span):
                runs.append(make_run("sweep", c, m, rule, hp, seed=self.seed, backend=self.backend))
        if self.checks and cs:
            c = cs[min(self.check_budget, len(cs) - 1)]
            for m in window(models, c, self.tokens_per_param, self.sizes_per_budget, self.span):
                runs.append(make_run("seed", c, m, rule, hp, seed=self.seed + 1, backend=self.backend))
                runs.append(make_run("backend", c, m, rule, hp, seed=self.seed, backend=self.check_backend))
        return runs
