"""Mixture-of-Experts experts on ``llmkernels.moe_experts``: transformers' 3-D experts modules
(``*Experts(hidden_states, top_k_index, top_k_weights)``, whatever ``experts_implementation``
they were built with) run as grouped GEMMs reading their weights in place, with the expert
adapters of ``lora.py`` when attached. The family's router is left as it is; its auxiliary loss
is computed from the router logits by transformers, or, in the fused-loss forward of ``loss.py``,
by ``moe_load_balancing_loss`` (the same value, with no read back to the host).

Three ways in: ``patch(model)`` binds the replacement to each experts module;
``patch_model_type`` replaces the class's ``forward``; and ``experts_implementation=
"llmkernels"`` (transformers' experts interface, registered by ``register_experts_interface``)
selects it per model like ``grouped_mm``. A module the kernels cannot run (another activation,
DTensor weights, a post-expert norm, mixed dtypes) falls back to transformers' own forward.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..ops.losses.base import is_dtensor
from ..ops.moe import moe_experts
from .families import MOE_EXPERTS
from .lora import expert_lora
from .marks import mark
from .mlp import glu_activation

EXPERTS_INTERFACE_NAME = "llmkernels"
_GPT_OSS_DEFAULTS = {"alpha": 1.702, "limit": 7.0}  # transformers 5.17 hard-codes them


def experts_not_supported(module, activation: str, hidden_states: Optional[torch.Tensor] = None) -> Optional[str]:
    """Why ``module`` (a family's experts, whose record says ``activation``) must keep
    transformers' forward, or None. Without ``hidden_states``, what can be told from the module."""
    if activation == "silu" and glu_activation(getattr(module, "act_fn", None)) != "silu":
        return f"its activation {type(getattr(module, 'act_fn', None)).__name__} is not SiLU"
    if not getattr(module, "has_gate", True) or getattr(module, "has_post_expert_norm", False):
        return "ungated experts or a post-expert norm"
    weights = [module.gate_up_proj, module.down_proj]
    if any(is_dtensor(w) for w in weights):
        return "DTensor expert weights"
    if hidden_states is not None and (is_dtensor(hidden_states) or hidden_states.dtype != weights[0].dtype
                                      or hidden_states.dim() != 2):
        return "hidden states that are a DTensor, of another dtype than the weights, or not [tokens, hidden]"
    return None


def _run(module, activation: str, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
    params = {"alpha": getattr(module, "alpha", _GPT_OSS_DEFAULTS["alpha"]),
              "limit": getattr(module, "limit", _GPT_OSS_DEFAULTS["limit"])} if activation == "clamped_swiglu" else {}
    return moe_experts(hidden_states, top_k_index, top_k_weights, module.gate_up_proj, module.down_proj,
                       gate_up_bias=getattr(module, "gate_up_proj_bias", None),
                       down_bias=getattr(module, "down_proj_bias", None), activation=activation,
                       interleaved=not getattr(module, "is_concatenated", True),
                       transposed=getattr(module, "is_transposed", False), lora=expert_lora(module), **params)


def experts_forward(activation: str, fallback: Optional[Callable] = None) -> Callable:
    """The replacement ``forward(self, hidden_states, top_k_index, top_k_weights)`` of a family's
    experts: the kernels, else ``fallback`` (default: the class's own forward, for a forward
    bound to one module)."""
    def forward(self, hidden_states, top_k_index, top_k_weights):
        if experts_not_supported(self, activation, hidden_states) is None:
            return _run(self, activation, hidden_states, top_k_index, top_k_weights)
        return (fallback or type(self).forward)(self, hidden_states, top_k_index, top_k_weights)
    forward.__name__ = f"llmkernels_moe_experts_{activation}_forward"
    return mark(forward)


def _interface_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' experts interface entry ``"llmkernels"``: the kernels for the families whose
    experts it knows, else transformers' ``grouped_mm`` experts."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    activation = MOE_EXPERTS.get(type(self).__name__)
    if activation is not None and experts_not_supported(self, activation, hidden_states) is None:
        return _run(self, activation, hidden_states, top_k_index, top_k_weights)
    return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)


def register_experts_interface() -> bool:
    """Register ``experts_implementation="llmkernels"`` with transformers (where it has the
    experts interface); True when it is registered."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:
        return False
    ExpertsInterface.register(EXPERTS_INTERFACE_NAME, _interface_forward)
    return True
