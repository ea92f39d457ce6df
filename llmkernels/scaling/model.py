"""A Llama-style decoder for the scaling experiments, on either backend.

Pre-norm blocks: ``(y, h) = RMSNorm(x + h)`` (the residual add fused into the norm), causal
self-attention (optionally with an RMSNorm of each head's queries and keys before the rotation,
``ModelConfig.qk_norm``: it bounds the attention logits, whose growth is a known cause of early
instability at high learning rates, Wortsman et al. 2023) with rotary position embeddings through ``F.scaled_dot_product_attention`` (heads of
64: FlashAttention), a SwiGLU MLP; a final RMSNorm and a language-model head tied to the token
embedding, whose loss is the mean next-token cross-entropy.

``backend="kernels"`` computes the norms, RoPE, the SwiGLU product and the head's loss with
llmkernels' Triton kernels (``FusedAddRMSNorm``, ``apply_rope``, ``glu``, ``linear_cross_entropy``
without a target check, which would synchronise, and with a fixed chunk size, so that a CUDA graph
can hold the step); ``backend="reference"`` computes the same functions with plain PyTorch
(``llmkernels.reference``'s norm and RoPE, Hugging Face's ``silu(gate) * up``,
``F.cross_entropy`` on the full logits). With ``ModelConfig.fused_qk_rope`` the QK-norm and the
rotation are one op (``qkv_norm_rope``; its reference is float32 rounded once). On a CPU without Triton's
interpreter the kernels fall back to the reference: ``ops_run`` says what actually runs. The residual
stream is float32 (in ``compute_dtype`` with ``ModelConfig.bf16_residual``); matrix products run in
``compute_dtype`` (bfloat16 on GPU).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import reference
from ..modules import FusedAddRMSNorm
from ..ops._launch import use_kernels
from ..ops.glu import glu
from ..ops.qk_norm_rope import qkv_norm_rope
from ..ops.losses.linear_cross_entropy import linear_cross_entropy
from ..ops.rope import apply_rope
from .plan import ModelConfig

BACKENDS = ("kernels", "reference")
OPS = ("rms_norm", "rope", "glu", "linear_cross_entropy")


def ops_run(backend: str, device: torch.device) -> dict:
    """Which implementation each fused op really runs: the Triton kernels only on a GPU or under
    Triton's interpreter; elsewhere they fall back to the reference."""
    if backend == "reference":
        return {op: "reference" for op in OPS}
    real = use_kernels(torch.empty(0, device=device))
    return {op: "kernels" if real else "reference (kernels fall back: no GPU, no TRITON_INTERPRET=1)" for op in OPS}


def loss_chunk_rows(rows: int, vocab: int) -> int:
    """Rows per chunk of the fused head + loss: every row at once while a chunk's logits stay
    under 2^27 elements (256 MB in bf16), else that many; fixed per shape so that a CUDA graph
    can hold it (without it the op sizes chunks from the free memory)."""
    return max(1, min(rows, (1 << 27) // vocab))


def rope_cos_sin(seq_len: int, head_dim: int, theta: float):
    """``cos, sin [seq_len, head_dim]`` (float32), Llama's rotary tables (``rotate_half`` pairs)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


class ReferenceAddRMSNorm(nn.Module):
    """Plain-PyTorch twin of ``llmkernels.FusedAddRMSNorm``: ``forward(x, residual) -> (y, x + residual)``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x, residual=None, out_dtype=None):
        return reference.rms_norm(x, self.weight, eps=self.variance_epsilon, residual=residual, prenorm=True,
                                  out_dtype=out_dtype)


def _kernel_loss(h, w, t, reduction="mean"):
    return linear_cross_entropy(h, w, t, reduction=reduction, check_targets=False,
                                chunk_size=loss_chunk_rows(h.shape[0], w.shape[0]))


def _reference_loss(h, w, t, reduction="mean"):
    """The full ``[tokens, vocab]`` logits in h's dtype, the softmax in float32."""
    return F.cross_entropy(F.linear(h, w).float(), t, reduction=reduction)


def _reference_rope(q, k, cos, sin, layout):
    return reference.apply_rope(q, k, cos, sin, layout=layout)


def _reference_qkv_norm_rope(qkv, q_weight, k_weight, cos, sin, *, eps):
    q, k, v = qkv.unbind(3)
    return (*reference.qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps=eps, layout="bshd"), v)


def _reference_glu(gate, up):
    """Hugging Face's LlamaMLP product, in the activations' dtype."""
    return F.silu(gate) * up


BACKEND_OPS = {
    "kernels": {"norm": FusedAddRMSNorm, "rope": apply_rope, "qkv_norm_rope": qkv_norm_rope, "glu": glu,
                "loss": _kernel_loss},
    "reference": {"norm": ReferenceAddRMSNorm, "rope": _reference_rope, "qkv_norm_rope": _reference_qkv_norm_rope,
                  "glu": _reference_glu, "loss": _reference_loss},
}


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: dict):
        super().__init__()
        d = cfg.width
        self.n_heads, self.head_dim, self.ops = cfg.n_heads, cfg.head_dim, ops
        self.fused_qk_rope, self.eps = cfg.fused_qk_rope, cfg.eps
        self.attn_norm = ops["norm"](d, cfg.eps)
        self.qk_norms = nn.ModuleList(ops["norm"](cfg.head_dim, cfg.eps) for _ in range(2)) if cfg.qk_norm else None
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.mlp_norm = ops["norm"](d, cfg.eps)
        self.gate_up = nn.Linear(d, 2 * cfg.mlp_hidden, bias=False)
        self.down = nn.Linear(cfg.mlp_hidden, d, bias=False)

    def forward(self, x, residual, cos, sin, act_dtype):
        b, t, d = x.shape
        y, residual = self.attn_norm(x, residual, out_dtype=act_dtype)
        # [q, k, v] of each head side by side: the rows of q (and of k) lie 3·head_dim apart, evenly,
        # so that the QK-norm reads them in place instead of from a copy
        qkv = self.qkv(y).view(b, t, self.n_heads, 3, self.head_dim)
        if self.fused_qk_rope:  # (its backward writes the three gradients into one buffer: no stack of them)
            q, k, v = self.ops["qkv_norm_rope"](qkv, self.qk_norms[0].weight, self.qk_norms[1].weight, cos, sin,
                                                eps=self.eps)
        else:
            q, k, v = qkv.unbind(3)
            if self.qk_norms is not None:
                q, k = (norm(h, out_dtype=act_dtype)[0] for norm, h in zip(self.qk_norms, (q, k)))
            q, k = self.ops["rope"](q, k, cos, sin, layout="bshd")
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = self.proj(a.transpose(1, 2).reshape(b, t, d))
        y, residual = self.mlp_norm(x, residual, out_dtype=act_dtype)
        gate, up = self.gate_up(y).chunk(2, dim=-1)
        return self.down(self.ops["glu"](gate, up)), residual


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
        ops = BACKEND_OPS[backend]
        self._loss = ops["loss"]
        self.wte = nn.Embedding(cfg.vocab_size, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg, ops) for _ in range(cfg.n_layers))
        self.norm = ops["norm"](cfg.width, cfg.eps)
        cos, sin = rope_cos_sin(cfg.seq_len, cfg.head_dim, cfg.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
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

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """Final-norm output ``[B, T, width]`` in ``compute_dtype``."""
        if idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"idx must be [batch, seq] integer token ids, got {tuple(idx.shape)} {idx.dtype}")
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than seq_len={self.cfg.seq_len}")
        cos, sin = self.cos[:t], self.sin[:t]
        x, residual = self.wte(idx), None
        if self.cfg.bf16_residual:  # the embedding's rows start the stream in the products' dtype
            x = x.to(self.compute_dtype)
        for block in self.blocks:
            x, residual = block(x, residual, cos, sin, self.compute_dtype)
        y, _ = self.norm(x, residual, out_dtype=self.compute_dtype)
        return y

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Next-token loss: the mean (``reduction="mean"``), or ``[B * T]`` per-token losses
        (``"none"``), in float32 on both backends."""
        h = self.hidden(idx)
        w = self.wte.weight.to(self.compute_dtype)
        return self._loss(h.reshape(-1, h.shape[-1]), w, targets.reshape(-1), reduction=reduction)
