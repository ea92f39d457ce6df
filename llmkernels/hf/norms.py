"""The norm forwards ``patch`` binds to transformers' RMSNorm modules and to
``torch.nn.LayerNorm``: the same Parameters feed the kernel, so class, parameters and
state-dict keys stay transformers'."""
from __future__ import annotations

import functools
import types
from typing import Callable, Optional

import torch
from torch import nn

from ..ops.norm import layer_norm, rms_norm
from .marks import mark
from .sharding import norm_call


def _rms_forward(casting: str) -> Callable:
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        eps = self.variance_epsilon if hasattr(self, "variance_epsilon") else self.eps
        # (Llama 4's q/k L2 norm has no weight)
        return norm_call(rms_norm, hidden_states, getattr(self, "weight", None), None, eps=eps, casting=casting)
    forward.__name__ = f"llmkernels_rms_norm_{casting}_forward"
    return mark(forward)


# casting -> the RMSNorm forward of that arithmetic
RMS_FORWARDS = {c: _rms_forward(c) for c in ("llama", "gemma", "none")}


@mark
def layer_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    return norm_call(layer_norm, x, self.weight, self.bias, eps=self.eps)


def layer_norm_unsupported(m: nn.Module) -> Optional[str]:
    """None when ``m`` (a torch.nn.LayerNorm) can run on the kernel, else why not."""
    if len(m.normalized_shape) != 1:
        return f"normalized_shape {tuple(m.normalized_shape)} spans more than the last dimension"
    return None


def patch_layer_norms_after_init(original: Callable) -> Callable:
    """Wrap a model class's ``post_init``: torch.nn.LayerNorm is not the family's own class, so
    its modules are patched in each new model instead."""
    @functools.wraps(original)
    def post_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        for module in self.modules():
            if type(module) is nn.LayerNorm and layer_norm_unsupported(module) is None:
                module.forward = types.MethodType(layer_norm_forward, module)
    return mark(post_init)
