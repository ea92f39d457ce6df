"""nn.Module drop-ins built on the fused kernels.

State-dict keys and attributes match the modules they replace, so checkpoints load unchanged:
``RMSNorm`` ~ Hugging Face ``LlamaRMSNorm`` (``weight``, ``variance_epsilon``), ``LayerNorm`` ~
``torch.nn.LayerNorm`` (``weight``, ``bias``, ``normalized_shape``, ``eps``).
"""
from __future__ import annotations

import torch
from torch import nn

from .ops.norm import layer_norm, rms_norm


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension; ``RMSNorm(hidden_size, eps)`` as ``LlamaRMSNorm``.

    ``casting`` and ``weight_offset`` select the Llama (default), Gemma or plain-fp32 variant
    (see ``llmkernels.rms_norm``); Gemma keeps its weight around 0 and uses ``1 + weight``.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, casting: str = "llama", weight_offset=None,
                 device=None, dtype=None):
        super().__init__()
        init = torch.zeros if (casting == "gemma" and weight_offset is None) else torch.ones
        self.weight = nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps
        self.casting = casting
        self.weight_offset = weight_offset

    @classmethod
    def from_llama_rmsnorm(cls, module: nn.Module, *, casting: str = "llama", weight_offset=None) -> "RMSNorm":
        """A kernel-backed RMSNorm that shares ``module.weight`` (the same Parameter)."""
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.weight = module.weight
        new.variance_epsilon = eps
        new.casting = casting
        new.weight_offset = weight_offset
        return new

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, eps=self.variance_epsilon, casting=self.casting,
                        weight_offset=self.weight_offset)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, casting={self.casting!r}"


class FusedAddRMSNorm(RMSNorm):
    """``forward(x, residual) -> (y, h)`` with ``h = x + residual`` and ``y = RMSNorm(h)``: the
    pre-norm transformer block's add + norm in one kernel. ``residual=None`` normalizes x and
    returns it as h. ``out_dtype`` picks y's dtype (e.g. the dtype the next matmul takes)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, residual_in_fp32: bool = False, **kwargs):
        super().__init__(hidden_size, eps, **kwargs)
        self.residual_in_fp32 = residual_in_fp32

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None):
        return rms_norm(hidden_states, self.weight, eps=self.variance_epsilon, residual=residual, prenorm=True,
                        residual_in_fp32=self.residual_in_fp32, casting=self.casting,
                        weight_offset=self.weight_offset, out_dtype=out_dtype)


class LayerNorm(nn.LayerNorm):
    """``torch.nn.LayerNorm`` over the last dimension, computed by the fused kernel (same
    constructor, parameters and state dict; ``bias=False`` as in torch >= 2.1)."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, bias=bias,
                         device=device, dtype=dtype)
        if len(self.normalized_shape) != 1:
            raise ValueError(f"normalized_shape must be one dimension (the last), got {self.normalized_shape}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, eps=self.eps)
