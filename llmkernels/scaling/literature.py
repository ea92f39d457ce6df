"""Published compute-optimal fits that the report sets beside a sweep's, each a record with its
source (no torch, no numpy).

``N_opt ∝ C^a`` and ``D_opt ∝ C^b``; an approach-3 fit carries its loss surface
``L(N, D) = E + A/N^alpha + B/D^beta``, whose implied exponents are ``a = beta/(alpha+beta)`` and
``b = alpha/(alpha+beta)``. Intervals are as each source reports them (its level in
``interval_level``). The scale fields say where each result was measured, so that the report can
say how far below it a sweep lies.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Surface:
    """``L(N, D) = E + A/N^alpha + B/D^beta`` (nats per token of the source's tokenizer); ``*_se``:
    the source's standard errors where it gives them."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    E_se: float | None = None
    A_se: float | None = None
    B_se: float | None = None
    alpha_se: float | None = None
    beta_se: float | None = None

    @property
    def a(self) -> float:
        return self.beta / (self.alpha + self.beta)

    @property
    def b(self) -> float:
        return self.alpha / (self.alpha + self.beta)


@dataclass(frozen=True)
class Published:
    """One published estimate of the compute-optimal exponents."""

    key: str
    label: str
    source: str
    url: str
    a: float
    b: float | None = None
    a_interval: tuple | None = None
    b_interval: tuple | None = None
    interval_level: str | None = None
    surface: Surface | None = None
    params: tuple = ()          # (smallest, largest) model, total parameters
    budgets: tuple = ()         # (smallest, largest) compute budget of the IsoFLOP profiles, FLOPs
    data: str = ""


@dataclass(frozen=True)
class Correction:
    """One step of Porian et al.'s walk from Kaplan et al.'s setup to Chinchilla's: the exponent a
    once this change (and every one before it) is made."""

    change: str
    a: float
    a_interval: tuple


HOFFMANN = "Hoffmann et al. 2022, Training Compute-Optimal Large Language Models, Table 2"
HOFFMANN_URL = "https://arxiv.org/abs/2203.15556"
HOFFMANN_SCALE = dict(params=(70e6, 16e9), budgets=(6e18, 3e21),
                      data="SentencePiece subword tokens of MassiveText (32K vocabulary, Rae et al. 2021)")
HOFFMANN_LEVEL = "10th-90th percentile, bootstrap"
CHINCHILLA_MODEL = (70e9, 1.4e12)  # Chinchilla itself: parameters, training tokens (Hoffmann et al., Table 3)

CHINCHILLA = (
    Published("chinchilla_1", "Chinchilla, approach 1 (training-curve envelope)", HOFFMANN, HOFFMANN_URL,
              a=0.50, b=0.50, a_interval=(0.488, 0.502), b_interval=(0.501, 0.512), interval_level=HOFFMANN_LEVEL,
              **HOFFMANN_SCALE),
    Published("chinchilla_2", "Chinchilla, approach 2 (IsoFLOP profiles)", HOFFMANN, HOFFMANN_URL,
              a=0.49, b=0.51, a_interval=(0.462, 0.534), b_interval=(0.483, 0.529), interval_level=HOFFMANN_LEVEL,
              **HOFFMANN_SCALE),
    Published("chinchilla_3", "Chinchilla, approach 3 (parametric L(N, D))", HOFFMANN, HOFFMANN_URL,
              a=0.46, b=0.54, a_interval=(0.454, 0.455), b_interval=(0.542, 0.543), interval_level=HOFFMANN_LEVEL,
              surface=Surface(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28), **HOFFMANN_SCALE),
)

BESIROGLU = Published(
    "besiroglu_3", "Besiroglu et al. re-fit of approach 3",
    "Besiroglu, Erdil, Barnett and You 2024, Chinchilla Scaling: A replication attempt (estimates and standard "
    "errors of the fit to the data read off Hoffmann et al.'s Figure 4)",
    "https://arxiv.org/abs/2404.10102",
    a=round(0.3658 / (0.3478 + 0.3658), 3), b=round(0.3478 / (0.3478 + 0.3658), 3),
    surface=Surface(E=1.82, A=482.01, B=2085.43, alpha=0.3478, beta=0.3658, E_se=0.03, A_se=124.58, B_se=1293.23,
                    alpha_se=0.02, beta_se=0.02),
    **HOFFMANN_SCALE)

PORIAN_SOURCE = ("Porian, Wortsman, Jitsev, Schmidt and Carmon 2024 (NeurIPS), Resolving Discrepancies in "
                 "Compute-Optimal Scaling of Language Models, Figure 1 (RefinedWeb; the values of the authors' "
                 "data/summary_df.pickle.xz, github.com/formll/resolving-scaling-law-discrepancies)")
PORIAN_URL = "https://arxiv.org/abs/2406.19146"
# Each change on top of those before it (95% bootstrap intervals).
PORIAN_STEPS = (
    Correction("Kaplan et al.'s setup reproduced (non-embedding FLOPs, long warm-up, untuned)", 0.835, (0.82, 0.85)),
    Correction("+ the head's (last layer's) FLOPs counted", 0.706, (0.69, 0.72)),
    Correction("+ warm-up no longer than the smallest model's run", 0.602, (0.59, 0.62)),
    Correction("+ cosine decay to each run's own length", 0.571, (0.56, 0.59)),
    Correction("+ learning rate, batch and AdamW beta2 tuned per size (constant rate)", 0.497, (0.49, 0.50)),
)
PORIAN = Published("porian", "Porian et al., all corrections", PORIAN_SOURCE, PORIAN_URL, a=PORIAN_STEPS[-1].a,
                   a_interval=PORIAN_STEPS[-1].a_interval, interval_level="95%, bootstrap",
                   params=(5e6, 901e6), budgets=(1.25e16, 2.56e19), data="RefinedWeb (and OpenWebText2), OpenLM models")

LITERATURE = (*CHINCHILLA, BESIROGLU, PORIAN)


def by_key(key: str) -> Published:
    return next(p for p in LITERATURE if p.key == key)
