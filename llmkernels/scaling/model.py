"""A GPT/Llama-style decoder for the scaling experiments, on either backend.

Pre-norm blocks: ``(y, h) = RMSNorm(x + h)`` (the residual add fused into the norm), causal
self-attention with rotary position embeddings through ``F.scaled_dot_product_attention``, a SwiGLU
MLP; a final RMSNorm and a language-model head tied to the token embedding, whose loss is the mean
next-token cross-entropy.

``backend="kernels"`` computes the norms, RoPE and the head's loss with llmkernels' Triton kernels
(``FusedAddRMSNorm``, ``apply_rope``, ``linear_cross_entropy``: no ``[tokens, vocab]`` logits);
``backend="reference"`` computes the same functions with plain PyTorch (``reference.rms_norm``, a
rotate-half RoPE, ``F.cross_entropy`` on full logits). The residual stream is float32; matrix products
run in ``compute_dtype`` (bfloat16 on GPU: the norms write it directly and the head casts to it).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import reference
from ..modules import FusedAddRMSNorm
from ..ops.linear_cross_entropy import linear_cross_entropy
from ..ops.rope import apply_rope

BACKENDS = ("kernels", "reference")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of one model: ``n_layers`` blocks of ``width`` channels in ``n_heads`` heads."""

    vocab_size: int
    n_layers: int
    width: int
    n_heads: int
    seq_len: int
    rope_theta: float = 10000.0
    eps: float = 1e-6

    def __post_init__(self):
        for field in ("vocab_size", "n_layers", "width", "n_heads", "seq_len"):
            if int(getattr(self, field)) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.width % self.n_heads or (self.width // self.n_heads) % 2:
            raise ValueError(f"width ({self.width}) must split into n_heads ({self.n_heads}) heads of an even size")

    @property
    def name(self) -> str:
        return f"L{self.n_layers}-W{self.width}-H{self.n_heads}"

    @property
    def head_dim(self) -> int:
        return self.width // self.n_heads

    @property
    def mlp_hidden(self) -> int:
        """SwiGLU hidden size: 8/3 of the width (same parameters as a 4x GELU MLP), rounded up to 32."""
        return 32 * math.ceil(8 * self.width / 3 / 32)

    def non_embedding_params(self) -> int:
        """Parameters outside the (tied) embedding: attention 4·d², MLP 3·d·hidden, two norms per
        block and the final norm. The ``N`` of the scaling law (Kaplan et al. count it so)."""
        d, h = self.width, self.mlp_hidden
        return self.n_layers * (4 * d * d + 3 * d * h + 2 * d) + d

    def embedding_params(self) -> int:
        return self.vocab_size * self.width

    def flops_per_token(self) -> int:
        """Training FLOPs per token, forward + backward, with the head and attention scores counted:
        6·(N + V·d) + 6·L·T·d (the causal half of the 12·L·T·d score and value products)."""
        return 6 * (self.non_embedding_params() + self.embedding_params()) + 6 * self.n_layers * self.seq_len * self.width

    def to_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------------------------
# the three ops that differ between backends
# --------------------------------------------------------------------------------------------
def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device=None):
    """``cos, sin [seq_len, head_dim]`` (float32) as Llama's rotary embedding makes them: the
    angles of the ``head_dim / 2`` frequencies, repeated for the two halves that rotate together."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def linear_cross_entropy_reference(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                   reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``logits = h @ weight.T``: the full ``[tokens, vocab]`` logits in h's dtype,
    the softmax in float32."""
    return F.cross_entropy(F.linear(h, weight).float(), targets, reduction=reduction)


class ReferenceAddRMSNorm(nn.Module):
    """Plain-PyTorch twin of ``llmkernels.FusedAddRMSNorm``: ``forward(x, residual) -> (y, x + residual)``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x, residual=None, out_dtype=None):
        return reference.rms_norm(x, self.weight, eps=self.variance_epsilon, residual=residual, prenorm=True,
                                  out_dtype=out_dtype)


def backend_ops(backend: str) -> dict:
    """Which implementation each of the model's fused ops uses under ``backend`` (recorded with
    every result)."""
    return {op: backend for op in ("rms_norm", "rope", "linear_cross_entropy")}


def _rope_fn(backend: str):
    """``rope(q, k, cos, sin)`` for q/k ``[B, T, H, D]`` and ``cos, sin [T, D]``."""
    apply = apply_rope if backend == "kernels" else reference.apply_rope

    def rope(q, k, cos, sin):
        return apply(q, k, cos, sin, layout="bshd")
    return rope


def _loss_fn(backend: str):
    if backend == "kernels":
        def loss(h, w, t, reduction="mean"):  # targets come from the tokenizer: no range check (no sync)
            return linear_cross_entropy(h, w, t, reduction=reduction, check_targets=False)
        return loss
    return linear_cross_entropy_reference


# --------------------------------------------------------------------------------------------
# the model
# --------------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, norm_cls):
        super().__init__()
        d = cfg.width
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.attn_norm = norm_cls(d, cfg.eps)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.mlp_norm = norm_cls(d, cfg.eps)
        self.gate_up = nn.Linear(d, 2 * cfg.mlp_hidden, bias=False)
        self.down = nn.Linear(cfg.mlp_hidden, d, bias=False)

    def forward(self, x, residual, cos, sin, rope, act_dtype):
        b, t, d = x.shape
        y, residual = self.attn_norm(x, residual, out_dtype=act_dtype)
        q, k, v = self.qkv(y).view(b, t, 3, self.n_heads, self.head_dim).unbind(2)
        q, k = rope(q, k, cos, sin)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = self.proj(a.transpose(1, 2).reshape(b, t, d))
        y, residual = self.mlp_norm(x, residual, out_dtype=act_dtype)
        gate, up = self.gate_up(y).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up), residual


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(idx [B, T] int64, targets [B, T]) -> loss``.

    Args:
        cfg: the shape.
        backend: ``"kernels"`` or ``"reference"`` (see the module docstring).
        compute_dtype: dtype of the matrix products' inputs (``torch.bfloat16`` under autocast on
            GPU, ``torch.float32`` on CPU); the norms write it and the head casts to it.
    """

    def __init__(self, cfg: ModelConfig, backend: str = "kernels", compute_dtype: torch.dtype = torch.float32):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.cfg, self.backend, self.compute_dtype = cfg, backend, compute_dtype
        norm_cls = FusedAddRMSNorm if backend == "kernels" else ReferenceAddRMSNorm
        self.wte = nn.Embedding(cfg.vocab_size, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg, norm_cls) for _ in range(cfg.n_layers))
        self.norm = norm_cls(cfg.width, cfg.eps)
        cos, sin = rope_cos_sin(cfg.seq_len, cfg.head_dim, cfg.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self._rope, self._loss = _rope_fn(backend), _loss_fn(backend)
        self.reset_parameters()

    def reset_parameters(self):
        """GPT-2 initialisation: N(0, 0.02), the residual branches' output projections scaled by
        1/sqrt(2·layers); norm weights 1."""
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "down.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * self.cfg.n_layers))
            elif p.dim() >= 2:
                nn.init.normal_(p, std=0.02)
            else:
                nn.init.ones_(p)

    def non_embedding_params(self) -> int:
        return sum(p.numel() for name, p in self.named_parameters() if not name.startswith("wte."))

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """Final-norm output ``[B, T, width]`` in ``compute_dtype``."""
        if idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"idx must be [batch, seq] integer token ids, got {tuple(idx.shape)} {idx.dtype}")
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than seq_len={self.cfg.seq_len}")
        cos, sin = self.cos[:t], self.sin[:t]
        x, residual = self.wte(idx), None
        for block in self.blocks:
            x, residual = block(x, residual, cos, sin, self._rope, self.compute_dtype)
        y, _ = self.norm(x, residual, out_dtype=self.compute_dtype)
        return y

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Next-token loss: the mean (``reduction="mean"``), or ``[B * T]`` per-token losses
        (``"none"``), in float32 on both backends."""
        h = self.hidden(idx)
        w = self.wte.weight.to(self.compute_dtype)
        return self._loss(h.reshape(-1, h.shape[-1]), w, targets.reshape(-1), reduction=reduction)
