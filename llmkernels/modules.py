"""nn.Module drop-ins built on the fused kernels.

They subclass the torch modules they stand for, so ``isinstance`` checks, attributes and
state-dict keys are those of the module replaced and checkpoints load unchanged:

- ``RMSNorm`` is a ``torch.nn.RMSNorm`` (``weight``, ``normalized_shape``, ``eps``,
  ``elementwise_affine``) that also reads and writes ``variance_epsilon`` as Hugging Face's
  ``LlamaRMSNorm`` does. ``RMSNorm(n)`` computes ``LlamaRMSNorm(n)``; ``RMSNorm.from_llama_rmsnorm``
  converts a torch or Hugging Face module, keeping its arithmetic and sharing its weight.
- ``FusedAddRMSNorm``: an ``RMSNorm`` whose forward also adds the residual.
- ``LayerNorm`` is a ``torch.nn.LayerNorm``.
"""
from __future__ import annotations

import torch
from torch import nn

from .ops.norm import layer_norm, rms_norm


def _default_eps(dtype: torch.dtype) -> float:
    """torch's ``eps=None``: the machine epsilon of the dtype torch computes in (float32 for
    bfloat16 and float16 inputs, as ``torch.nn.functional.rms_norm`` does at run time)."""
    return torch.finfo(torch.promote_types(dtype, torch.float32)).eps


def _rows(x: torch.Tensor, normalized_shape: tuple, *params):
    """``x`` and ``params`` as the kernels take them: a norm over the last ``len(normalized_shape)``
    dims is a norm over one flattened last dim (the kernels read a 2-D weight as per-head rows)."""
    if tuple(x.shape[x.dim() - len(normalized_shape):]) != tuple(normalized_shape):
        raise ValueError(f"input must end in the normalized shape {tuple(normalized_shape)}, "
                         f"got shape {tuple(x.shape)}")
    if len(normalized_shape) == 1:
        return (x, *params)
    flat = (*x.shape[:x.dim() - len(normalized_shape)], -1)
    return (x.reshape(flat), *(p if p is None else p.reshape(-1) for p in params))


class RMSNorm(nn.RMSNorm):
    """RMSNorm computed by the fused kernel; a ``torch.nn.RMSNorm``.

    ``RMSNorm(hidden_size, eps=1e-6)`` is Hugging Face's ``LlamaRMSNorm(hidden_size, eps)``:
    ``weight * x_hat.to(input_dtype)``. ``casting`` picks another arithmetic (see
    ``llmkernels.rms_norm``): ``"gemma"`` (``x_hat * (1 + weight)`` in fp32, weight initialised
    to zeros) or ``"none"`` (fp32 throughout, one cast: ``torch.nn.RMSNorm``'s). ``eps=None``
    means what it means to torch: the epsilon of the computation dtype, at run time.
    """

    def __init__(self, hidden_size, eps: float | None = 1e-6, elementwise_affine: bool = True, *,
                 casting: str = "llama", weight_offset=None, device=None, dtype=None):
        self.casting = casting
        self.weight_offset = weight_offset
        super().__init__(hidden_size, eps=eps, elementwise_affine=elementwise_affine, device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            # Gemma's weight is an offset from 1: zeros scale by one, as ones do elsewhere.
            gemma = self.casting == "gemma" and self.weight_offset is None
            nn.init.zeros_(self.weight) if gemma else nn.init.ones_(self.weight)

    @property
    def variance_epsilon(self):
        """Hugging Face's name for ``eps``."""
        return self.eps

    @variance_epsilon.setter
    def variance_epsilon(self, value) -> None:
        self.eps = value

    @classmethod
    def from_llama_rmsnorm(cls, module: nn.Module, *, casting: str | None = None, weight_offset=None) -> "RMSNorm":
        """A kernel-backed copy of ``module`` that shares its weight (the same Parameter).

        ``module``: a ``torch.nn.RMSNorm`` (its arithmetic is kept: ``casting="none"``, and
        ``eps=None`` stays None) or a Hugging Face RMSNorm (``weight`` and ``variance_epsilon``
        or ``eps``): the casting of its family where ``llmkernels.patch`` knows the class
        (Gemma's ``"gemma"``, OLMo 2's ``"none"``), else ``"llama"``. ``casting`` overrides it.
        """
        weight = getattr(module, "weight", None)
        if isinstance(module, nn.RMSNorm):
            shape, eps = module.normalized_shape, module.eps
            casting = "none" if casting is None else casting
        elif isinstance(weight, torch.Tensor) and (hasattr(module, "variance_epsilon") or hasattr(module, "eps")):
            from .hf.families import NORM_CASTING

            shape = tuple(weight.shape)
            eps = module.variance_epsilon if hasattr(module, "variance_epsilon") else module.eps
            if casting is None:
                casting = NORM_CASTING.get(type(module).__name__, "llama")
        else:
            raise TypeError("module must be a torch.nn.RMSNorm or a Hugging Face RMSNorm (with weight and "
                            f"variance_epsilon), got {type(module).__name__}")
        new = cls(shape, eps, elementwise_affine=weight is not None, casting=casting, weight_offset=weight_offset,
                  device="meta")
        new.weight = weight
        return new

    def _eps(self, x: torch.Tensor) -> float:
        return _default_eps(x.dtype) if self.eps is None else self.eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x, weight = _rows(hidden_states, self.normalized_shape, self.weight)
        y = rms_norm(x, weight, eps=self._eps(x), casting=self.casting, weight_offset=self.weight_offset)
        return y.view(hidden_states.shape) if x is not hidden_states else y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, casting={self.casting!r}"


class FusedAddRMSNorm(RMSNorm):
    """``forward(x, residual) -> (y, h)`` with ``h = x + residual`` and ``y = RMSNorm(h)``: the
    pre-norm transformer block's add + norm in one kernel. ``residual=None`` normalizes x and
    returns it as h. ``out_dtype`` picks y's dtype (e.g. the dtype the next matmul takes)."""

    def __init__(self, hidden_size: int, eps: float | None = 1e-6, *, residual_in_fp32: bool = False, **kwargs):
        super().__init__(hidden_size, eps, **kwargs)
        self.residual_in_fp32 = residual_in_fp32
        if len(self.normalized_shape) != 1:
            raise ValueError(f"hidden_size must be one dimension (the last), got {self.normalized_shape}")

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None):
        return rms_norm(hidden_states, self.weight, eps=self._eps(hidden_states), residual=residual, prenorm=True,
                        residual_in_fp32=self.residual_in_fp32, casting=self.casting,
                        weight_offset=self.weight_offset, out_dtype=out_dtype)


class LayerNorm(nn.LayerNorm):
    """``torch.nn.LayerNorm`` computed by the fused kernel (same constructor, parameters and
    state dict; ``bias=False`` as in torch >= 2.1)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, weight, bias = _rows(x, self.normalized_shape, self.weight, self.bias)
        y = layer_norm(rows, weight, bias, eps=self.eps)
        return y.view(x.shape) if rows is not x else y
