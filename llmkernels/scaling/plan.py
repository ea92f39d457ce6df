"""The experiment's plan, without torch (``--list`` prints it without building data).

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
from dataclasses import asdict, dataclass

import numpy as np

HEAD_DIM = 64  # FlashAttention's fastest head size on Hopper; every width is a multiple of it
SEQ_LEN = 512
BYTE_VOCAB = 320  # 256 bytes + end-of-text, padded to a multiple of 64 for the tensor cores

# (layers, width): one family of shapes, 0.6M to 18M total parameters at the byte vocabulary, about
# 1.1-1.4x apart, depth 3 to 10 and width / layers between 16 and 48 (no two-layer or 64-wide models):
# in the 2026-11-27 4 x H100 sweep the shallow-wide L2-W128 sat +0.06 to +0.09 in log L above the
# fitted surface and width / layers of 64 +0.025 above it, while depth 3-6 at width / layers 16-48
# lay within 0.01 of it on average.
LADDER = [
    (3, 128), (4, 128), (5, 128), (6, 128), (7, 128), (4, 192), (5, 192), (6, 192), (7, 192), (8, 192),
    (9, 192), (6, 256), (7, 256), (8, 256), (9, 256), (7, 320), (8, 320), (9, 320), (10, 320), (11, 320),
    (9, 384), (10, 384),
]

# bf16 dense peak of the tensor cores (vendor datasheets; SXM parts unless named) for MFU: the first
# name that the device's name contains.
PEAK_BF16_FLOPS = {"H100 PCIe": 756e12, "H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}


def peak_flops(device_name: str) -> float | None:
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in device_name), None)


# the model's switches added after runs were recorded (``ModelConfig``'s booleans; the command
# lines' ``--qk-norm``, ``--fused-qk-rope``, ``--bf16-residual``)
MODEL_SWITCHES = ("qk_norm", "fused_qk_rope", "bf16_residual")


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
    qk_norm: bool = False
    # the QK-norm and the rotation in one kernel (``llmkernels.qk_norm_rope``): a pass and a
    # rounding fewer, so the numerics of another model
    fused_qk_rope: bool = False
    # the residual stream in the matrix products' dtype (bfloat16 on a GPU), not float32: the
    # norms move a third fewer bytes, and the sum is rounded at every block
    bf16_residual: bool = False

    def __post_init__(self):
        for name in ("vocab_size", "n_layers", "width", "seq_len", "head_dim"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.width % self.head_dim or self.head_dim % 2:
            raise ValueError(f"width ({self.width}) must be a multiple of head_dim ({self.head_dim}), "
                             f"which must be even")
        if self.fused_qk_rope and not self.qk_norm:
            raise ValueError("fused_qk_rope fuses the QK-norm into the rotation: it needs qk_norm=True")

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
        """Attention 4·d², SwiGLU 3·d·hidden, two norms a block (and the query and key norms), the final norm."""
        d, h = self.width, self.mlp_hidden
        return self.n_layers * (4 * d * d + 3 * d * h + 2 * d + (2 * self.head_dim if self.qk_norm else 0)) + d

    def embedding_params(self) -> int:
        return self.vocab_size * self.width

    def total_params(self) -> int:
        """Every parameter: the tied embedding / head once, and the rest."""
        return self.non_embedding_params() + self.embedding_params()

    def flops_per_token(self) -> int:
        """Training FLOPs per token (see the module docstring)."""
        return 6 * self.total_params() + 6 * self.n_layers * self.seq_len * self.width

    def to_dict(self) -> dict:
        # a switch added after runs were recorded is omitted while off, so those runs keep their keys
        return {k: v for k, v in asdict(self).items() if k not in MODEL_SWITCHES or v}


def ladder_models(vocab_size: int, seq_len: int = SEQ_LEN, head_dim: int = HEAD_DIM, ladder=None,
                  **switches) -> list[ModelConfig]:
    """The ladder's shapes (``LADDER`` by default) as models, smallest first; ``switches``: of
    ``MODEL_SWITCHES``."""
    shapes = LADDER if ladder is None else ladder
    models = [ModelConfig(vocab_size, n_layers, width, seq_len=seq_len, head_dim=head_dim, **switches)
              for n_layers, width in shapes]
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
    """The prior window centre: ``N`` with ``C = 6·N·D`` and ``D = tokens_per_param·N``."""
    return math.sqrt(compute / (6.0 * tokens_per_param))


def window(models: list[ModelConfig], compute: float, centre: float, count: int, span: float,
           min_tokens_per_param: float = 0.0) -> list[ModelConfig]:
    """``count`` sizes for one budget, as close as the ladder allows to targets spaced evenly in log
    from ``centre/span`` to ``centre·span``: the increasing choice of ladder sizes with the least
    squared log distance to the targets, the two ends rounded outward (at or below the lowest
    target, at or above the highest, where the ladder allows) so that the window covers at least
    ``[centre/span, centre·span]``. Sizes that would train on fewer than ``min_tokens_per_param``
    tokens a parameter at this budget are not candidates (the window then reaches less far above
    the centre and further below it)."""
    if count < 2:
        raise ValueError(f"sizes per budget must be >= 2, got {count}")
    models = sorted((m for m in models if compute / m.flops_per_token() >= min_tokens_per_param * m.total_params()),
                    key=ModelConfig.total_params)
    if len(models) <= count:
        return models
    logs = [math.log(m.total_params()) for m in models]
    targets = [math.log(centre) + math.log(span) * (2 * i / (count - 1) - 1) for i in range(count)]
    allowed = [set(range(len(models))) for _ in targets]
    below = {j for j, v in enumerate(logs) if v <= targets[0] + 1e-9 and j <= len(models) - count}
    above = {j for j, v in enumerate(logs) if v >= targets[-1] - 1e-9 and j >= count - 1}
    allowed[0], allowed[-1] = below or allowed[0], above or allowed[-1]
    # cost[j]: the best choice for the targets so far ending at size j (increasing sizes: dynamic programming)
    cost = {j: (logs[j] - targets[0]) ** 2 for j in allowed[0]}
    back = [dict()]
    for t, ok in zip(targets[1:], allowed[1:]):
        new, links, best, arg = {}, {}, math.inf, None
        for j in range(len(models)):
            if best > cost.get(j - 1, math.inf):
                best, arg = cost[j - 1], j - 1
            if j in ok and arg is not None:
                new[j], links[j] = best + (logs[j] - t) ** 2, arg
        cost = new
        back.append(links)
    j = min(cost, key=cost.get)
    picked = [j]
    for links in reversed(back[1:]):
        j = links[j]
        picked.append(j)
    return [models[j] for j in reversed(picked)]


# --------------------------------------------------------------------------------------------
# GPU time: the estimate behind the default design and the runner's time-limit decisions
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepCost:
    """Seconds of one captured training step on one H100: a floor of launches and latency that
    grows with the layers, plus the step's FLOPs at a rate that grows with the width (small
    products fill the tensor cores less): ``fixed + per_layer·layers + flops / (rate·(width/512)^width_exp)``.

    Fitted (least squares in log time) to the 71 kernels-backend runs of
    ``benchmarks/results/scaling-h100-2026-11-25/`` (batches 16-256, 0.18M-45M parameters): rms
    error 2.7%, largest 5.7%; then the step terms scaled by 1.11, the median ratio of measured to
    predicted steps at batch 64 of the 123 runs of ``scaling-h100x4-2026-11-27/`` (deterministic
    kernels, four processes on one host: 1.04-1.16). ``run_overhead`` is a run's set-up, capture and
    evaluations (0.3-1 s, rounded up); ``process_overhead`` an invocation's data preparation (about
    25 s) and first kernel compilations (up to 20 s)."""

    fixed: float = 3.8e-4
    per_layer: float = 9.4e-5
    rate: float = 270e12
    width_exp: float = 0.71
    run_overhead: float = 1.0
    process_overhead: float = 45.0

    def step_seconds(self, model: ModelConfig, batch: int) -> float:
        flops = model.flops_per_token() * batch * model.seq_len
        return self.fixed + self.per_layer * model.n_layers + flops / (self.rate * (model.width / 512) ** self.width_exp)

    def run_seconds(self, run: "Run", steps: int | None = None) -> float:
        """A run's seconds, or those of its last ``steps`` steps (a run resumed from a checkpoint)."""
        return self.run_overhead + (run.steps if steps is None else steps) * self.step_seconds(run.model, run.batch_size)


H100 = StepCost()


# A run started under a horizon is predicted from the slow end of its width's ratios: they spread
# 2-3x with how many runs share the GPU meanwhile, a run cut short at a session's end loses its work,
# and a slot left empty costs little (runs at once share one GPU's throughput: six give 1.04-1.21x one).
ADMIT_QUANTILE = 0.9


class Estimator:
    """Predicted seconds of a run's steps left: ``StepCost`` (an H100's) scaled by a quantile (the
    median unless told) of the ratios of measured to predicted seconds of the runs finished on
    ``device`` (a result's ``device``: in this invocation, or restored: they trained as this sweep
    trains, so many at once included): of the same shape (width and depth) where two or more have
    finished, else of the same width, else of every run. The ratio grows as the model shrinks, in
    depth too: on an H200 with six at once 2.0x at L10-W384 and 6.3x at L3-W128, where W128's
    runs together gave 4.2x. None: no guess (CPU before its first run)."""

    def __init__(self, cuda: bool, device: str):
        self.ratios: dict[tuple[int, int], list[float]] = {}
        self.cuda, self.device = cuda, device

    def add(self, run, result: dict):
        """``result``'s ``wall_seconds`` covered its steps from ``resumed_from_step`` on; a result
        of another device is no measure of this one."""
        left = run.steps - (result.get("resumed_from_step") or 0)
        if result.get("device") == self.device and result.get("wall_seconds") and left > 0:
            self.ratios.setdefault((run.model.width, run.model.n_layers), []).append(
                result["wall_seconds"] / H100.run_seconds(run, left))

    def ratio(self, model: ModelConfig | None = None, q: float = 0.5) -> float | None:
        """The ``q`` quantile of the ratios of runs of ``model``'s shape, else of its width (each
        where two or more finished), else of every run (also for no model)."""
        pools = []
        if model is not None:
            pools.append(self.ratios.get((model.width, model.n_layers), []))
            pools.append([r for (width, _), rs in self.ratios.items() if width == model.width for r in rs])
        pool = next((p for p in pools if len(p) >= 2), [r for rs in self.ratios.values() for r in rs])
        return float(np.quantile(pool, q)) if pool else None

    def count(self) -> int:
        return sum(len(rs) for rs in self.ratios.values())

    def seconds(self, run, done: int = 0, q: float = 0.5) -> float | None:
        ratio = self.ratio(run.model, q)
        if ratio is None and not self.cuda:
            return None
        return H100.run_seconds(run, run.steps - done) * (1.0 if ratio is None else ratio)


# --------------------------------------------------------------------------------------------
# hyperparameters: the rule
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LRRule:
    """Peak learning rate ``lr = c · (N_total / 1e6)^(-gamma) · (batch_tokens / 2^15)^kappa``.

    ``kappa`` is fixed at 1/2 (Adam's square-root batch scaling, Malladi et al. 2022): the sweep
    tries each budget's batch but too few batches to fit it (the report lists the rule's residual
    at each batch). ``c`` and ``gamma`` come from the learning-rate sweep (``fit.fit_lr_rule``) or,
    before it has run, are this prior: near the best rates of the 2026-11-27 sweep's learning-rate
    runs that had passed the loss's early plateau (0.6M: 5.8e-3, 1.8M: 5.2e-3 at 2^15 tokens, flat
    within 0.005 nats from 1.3e-3 to 5.2e-3), its multiples then bracketing them."""

    c: float = 5e-3
    gamma: float = 0.35
    kappa: float = 0.5
    source: str = "prior"

    def lr(self, n_params: int, batch_tokens: int) -> float:
        return self.c * (n_params / 1e6) ** (-self.gamma) * (batch_tokens / 2**15) ** self.kappa


def parse_batch_rule(spec: str) -> tuple:
    """``BUDGET:SEQUENCES,...,SEQUENCES`` (e.g. ``1e14:16,5e14:32,64``): up to each budget that many
    sequences a step, the last entry above every budget named."""
    steps = []
    for i, item in enumerate(spec.split(",")):
        parts = item.strip().split(":")
        try:
            if len(parts) == 2 and i < spec.count(","):
                steps.append((float(parts[0]), int(parts[1])))
            elif len(parts) == 1 and i == spec.count(","):
                steps.append((math.inf, int(parts[0])))
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"--batch-rule: expected BUDGET:SEQUENCES,...,SEQUENCES, got {spec!r}") from None
    if any(b <= 0 for _, b in steps) or [c for c, _ in steps] != sorted({c for c, _ in steps}):
        raise ValueError(f"--batch-rule: budgets must rise and sequences be >= 1, got {spec!r}")
    return tuple(steps)


@dataclass(frozen=True)
class HParams:
    """Settings of the rule that are not fitted.

    Batch: one per budget (``batch_rule``: up to each budget that many sequences), the same for
    every size, so that at a budget the sizes differ only in N and D (a batch per run, rounded from
    its token count, made neighbouring sizes' step counts and losses zig-zag). By default one batch
    for every budget (64 sequences, 2^15 tokens): the 2026-11-27 sweep's steps from 16 to 32 to 64
    sequences between budgets moved whole budgets off the fitted surface (+0.063 in log L at the
    first budget of 32). Warm-up
    ``warmup_frac`` of the steps, then a cosine to ``min_lr_ratio`` of the peak over the run's own
    length (Chinchilla's 10x decay). AdamW (0.9, ``beta2``) with ``beta2 = 0.99`` for batches under
    2^18 tokens (every batch here: 0.95 trains small batches worse, Porian et al. 2024), decoupled
    weight decay, global clip 1."""

    batch_rule: tuple = ((math.inf, 64),)
    warmup_frac: float = 0.03
    min_warmup: int = 1
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0

    def batch(self, budget: float) -> int:
        return next(b for limit, b in self.batch_rule if budget <= limit * (1 + 1e-9))

    @staticmethod
    def beta2(batch_tokens: int) -> float:
        return 0.99 if batch_tokens < 2**18 else 0.95


@dataclass(frozen=True)
class Run:
    """One training run: a size at a compute budget, with its hyperparameters.

    Stages: ``lr`` (learning-rate sweep), ``sweep`` (the IsoFLOP grid), ``seed`` (a second seed),
    ``batch`` (half the budget's batch), ``backend`` (the other backend)."""

    stage: str
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
            tag += f"-x{self.lr_mult:.4g}"
        if self.stage == "batch":
            tag += f"-b{self.batch_size}"
        return f"{tag}-s{self.seed}-{self.backend}"


def make_run(stage: str, budget: float, model: ModelConfig, rule: LRRule, hp: HParams, *, seed: int = 0,
             backend: str = "kernels", lr_mult: float = 1.0, batch: int | None = None) -> Run:
    """The run of ``model`` at ``budget``: the budget's batch (or ``batch``), the steps that spend the
    budget, the rule's rate at that batch times ``lr_mult``."""
    batch = hp.batch(budget) if batch is None else batch
    tokens = budget / model.flops_per_token()
    steps = max(1, round(tokens / (batch * model.seq_len)))
    batch_tokens = batch * model.seq_len
    return Run(stage=stage, budget=budget, model=model, batch_size=batch, steps=steps,
               lr=rule.lr(model.total_params(), batch_tokens) * lr_mult,
               warmup_steps=min(steps - 1, max(hp.min_warmup, round(hp.warmup_frac * steps))) if steps > 1 else 0,
               beta2=hp.beta2(batch_tokens), seed=seed, backend=backend, lr_mult=lr_mult)
