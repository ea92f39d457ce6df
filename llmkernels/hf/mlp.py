"""Gated MLPs: the product ``act_fn(gate) * up`` by ``llmkernels.glu`` and, with a plain
``nn.Linear`` down projection, ``down_proj(...)`` by ``llmkernels.glu_linear`` (the product is
recomputed in the backward, not kept). One layout per way transformers writes the MLP:

- ``separate`` / ``separate_activation_fn``: Llama-style ``gate_proj`` / ``up_proj`` /
  ``down_proj`` (``forward``; the activation in ``act_fn`` or ``activation_fn``);
- ``fused``: Phi-3's ``gate_up_proj`` (``forward``, halves read in place);
- ``experts``: the 3-D expert weights of Mixtral, Qwen 2/3 MoE (``_apply_gate``, the hook that
  transformers' ``grouped_mm``, ``batched_mm`` and ``deepgemm`` experts call; its ``eager``
  experts compute the product inline and are left alone);
- ``bmm_experts``: Llama 4's experts (``forward``, one ``bmm`` over every expert).

An MLP whose activation is none of glu's (or whose gate / up are DTensors) computes
transformers' ``act_fn(gate) * up``.
"""
from __future__ import annotations

import typing
from typing import Callable, Optional

import torch
from torch import nn

from ..ops.glu import ACTIVATIONS, glu, glu_linear
from .marks import is_patched, mark
from .sharding import is_dtensor

# transformers activation modules that llmkernels.glu computes (torch.nn.SiLU and nn.GELU too).
_TRANSFORMERS_ACTIVATIONS = {"SiLUActivation": "silu", "GELUTanh": "gelu_tanh", "NewGELUActivation": "gelu_tanh",
                             "GELUActivation": "gelu"}
# Experts implementations (config._experts_implementation) that call the experts' _apply_gate.
_APPLY_GATE_IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "deepgemm")


def glu_activation(act) -> Optional[str]:
    """The ``llmkernels.glu`` activation equal to the module ``act``, or None."""
    if isinstance(act, nn.SiLU):
        return "silu"
    if isinstance(act, nn.GELU):
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    if type(act).__module__.startswith("transformers."):
        return _TRANSFORMERS_ACTIVATIONS.get(type(act).__name__)
    return None


def _gated(act_fn, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``act_fn(gate) * up``: ``llmkernels.glu`` when it computes ``act_fn`` on plain tensors,
    else transformers' own expression."""
    activation = glu_activation(act_fn)
    if activation is None or is_dtensor(gate) or is_dtensor(up):
        return act_fn(gate) * up
    return glu(gate, up, activation)


# torch's registries of the hooks of every module (``register_module_forward_hook`` ...): not
# public API, read because no public call tells whether one is set (ARCHITECTURE.md lists them).
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


def _global_hooks() -> bool:
    """Whether a hook of every module is set; True on a torch without these registries."""
    from torch.nn.modules import module as module_globals

    return any(getattr(module_globals, name, True) for name in _GLOBAL_HOOKS)


def _plain_linear(module, x: torch.Tensor) -> bool:
    """True when calling ``module(x)`` is exactly ``F.linear(x, module.weight, module.bias)``:
    an ``nn.Linear`` itself (not a LoRA or quantized subclass) without hooks, whose
    parameters are plain tensors of x's dtype, outside autocast."""
    return (type(module) is nn.Linear and not module._forward_hooks and not module._forward_pre_hooks
            and not module._backward_hooks and not module._backward_pre_hooks and not _global_hooks()
            and not is_dtensor(module.weight) and module.weight.dtype == x.dtype
            and not torch.is_autocast_enabled(x.device.type))


def _gated_down(act_fn, gate: torch.Tensor, up: torch.Tensor, down_proj) -> torch.Tensor:
    """``down_proj(act_fn(gate) * up)``: ``llmkernels.glu_linear`` when ``down_proj`` is a plain
    ``nn.Linear``, else ``_gated``."""
    activation = glu_activation(act_fn)
    if activation is None or is_dtensor(gate) or is_dtensor(up) or not _plain_linear(down_proj, gate):
        return down_proj(_gated(act_fn, gate, up))
    return glu_linear(gate, up, down_proj.weight, down_proj.bias, activation)


def _separate_mlp_forward(act_attr: str) -> Callable:
    """Llama's MLP (and its copies): ``down_proj(act(gate_proj(x)) * up_proj(x))``, ``act`` the
    module's attribute ``act_attr``."""
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _gated_down(getattr(self, act_attr), self.gate_proj(x), self.up_proj(x), self.down_proj)
    forward.__name__ = f"llmkernels_separate_mlp_{act_attr}_forward"
    return mark(forward)


@mark
def _fused_mlp_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """Phi-3's MLP: ``gate, up = gate_up_proj(x).chunk(2, -1)``, ``down_proj(up * act(gate))``."""
    gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)
    return _gated_down(self.activation_fn, gate, up, self.down_proj)


@mark
def _experts_apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
    """transformers' default ``_apply_gate`` of 3-D expert weights: ``gate, up =
    gate_up_out.chunk(2, -1)`` (``[S, 2 I]``), ``act_fn(gate) * up``."""
    gate, up = gate_up_out.chunk(2, dim=-1)
    return _gated(self.act_fn, gate, up)


@mark
def _bmm_experts_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """Llama 4's experts: tokens ``[E * T, H]`` (each expert's T, pre-scaled by the router),
    ``gate, up = bmm(x, gate_up_proj).chunk(2, -1)``, ``bmm(up * act_fn(gate), down_proj)``."""
    x = hidden_states.view(self.gate_up_proj.shape[0], -1, self.hidden_size)
    gate, up = torch.bmm(x, self.gate_up_proj).chunk(2, dim=-1)
    return torch.bmm(_gated(self.act_fn, gate, up), self.down_proj).view(-1, self.hidden_size)


class Layout(typing.NamedTuple):
    attr: str             # the attribute replaced
    replacement: Callable
    activation_attr: str  # the attribute holding the activation module


LAYOUTS = {
    "separate": Layout("forward", _separate_mlp_forward("act_fn"), "act_fn"),
    "separate_activation_fn": Layout("forward", _separate_mlp_forward("activation_fn"), "activation_fn"),
    "bmm_experts": Layout("forward", _bmm_experts_forward, "act_fn"),
    "fused": Layout("forward", _fused_mlp_forward, "activation_fn"),
    "experts": Layout("_apply_gate", _experts_apply_gate, "act_fn"),
}


def mlp_not_patchable(owner, layout: str, instance: bool) -> Optional[str]:
    """Why the gated-MLP class or module ``owner`` must keep its own code, or None. A class
    (``instance=False``) is patched whatever its models' activations: each falls back at run
    time; a module is checked for its activation and, for experts, its implementation."""
    attr, _, act_attr = LAYOUTS[layout]
    current = getattr(owner, attr, None)
    if layout == "experts" and not (is_patched(current) or
                                    getattr(current, "__name__", None) == "_default_apply_gate"):
        return "its _apply_gate is not transformers' default act_fn(gate) * up"
    if not instance:
        return None
    act = getattr(owner, act_attr, None)
    if glu_activation(act) is None:
        return f"its activation {type(act).__name__} is none of llmkernels.glu's {ACTIVATIONS}"
    implementation = getattr(getattr(owner, "config", None), "_experts_implementation", None)
    if layout == "experts" and implementation not in _APPLY_GATE_IMPLEMENTATIONS:
        return (f"experts_implementation={implementation!r} does not call _apply_gate "
                f"({', '.join(_APPLY_GATE_IMPLEMENTATIONS)} do)")
    return None
