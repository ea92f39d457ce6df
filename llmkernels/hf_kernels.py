"""llmkernels' layers for the ``kernels`` package, the mechanism behind ``kernels.kernelize`` and
transformers' ``use_kernels=True``.

transformers marks its layers with a name (``@use_kernel_forward_from_hub("RMSNorm")`` on
``LlamaRMSNorm`` and ~140 other RMSNorm classes of the same arithmetic); ``kernelize`` swaps the
``forward`` of each marked layer for the forward of the layer a *kernel mapping* gives for that
name, device and mode. ``kernel_mapping()`` maps ``"RMSNorm"`` to llmkernels' own layer, loaded
from this package (no hub download). transformers marks its layers only when it accepts the
installed ``kernels`` (transformers 5.24 asks for 0.18.2 or newer, which PyPI does not have; 5.17
takes 0.16), so ``kernelize`` here first marks the RMSNorm classes it finds unmarked, then runs
``kernels.kernelize`` under the mapping; it works with kernels 0.16 and 0.17 whatever
transformers accepts::

    from kernels import Mode
    from llmkernels.hf_kernels import kernelize

    model = kernelize(model, mode=Mode.TRAINING)

Where transformers accepts the installed ``kernels``, ``kernels.register_kernel_mapping(kernel_mapping())``
before ``from_pretrained(..., use_kernels=True)`` does the same. The CUDA entry covers compute
capability 8.0 and up, a narrower range than transformers' defaults (every capability), so
``kernels`` picks it over them whatever the order of registration.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .hf.families import NORM_CASTING
from .ops.norm import rms_norm


class RMSNorm(nn.Module):
    """The forward ``kernelize`` binds to transformers' Llama-style RMSNorm layers
    (``weight * x_hat.to(input_dtype)``): stateless, it reads the layer's ``weight`` and
    ``variance_epsilon`` (or ``eps``)."""

    can_torch_compile = True  # a torch.library custom op: no graph break
    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        eps = self.variance_epsilon if hasattr(self, "variance_epsilon") else self.eps
        return rms_norm(hidden_states, self.weight, eps=eps, casting="llama")


LAYERS = {"RMSNorm": RMSNorm}


@dataclasses.dataclass(frozen=True)
class Repository:
    """A ``kernels`` repository (it only needs ``load()``) that hands out a layer of this
    package instead of downloading one."""

    layer_name: str

    def load(self) -> type:
        return LAYERS[self.layer_name]

    def __str__(self) -> str:
        return f"llmkernels.hf_kernels, layer `{self.layer_name}`"


def kernel_mapping(devices=("cuda", "cpu")) -> dict:
    """``{layer name: {device: repository}}`` for ``kernels.use_kernel_mapping`` /
    ``register_kernel_mapping``, for every layer in ``LAYERS``. On ``"cpu"`` the ops run
    through Triton's interpreter with ``TRITON_INTERPRET=1``, else take the plain-PyTorch path."""
    from kernels import CUDAProperties, Device

    def device(name):
        if name == "cuda":  # Ampere and newer (bf16); narrower than a mapping without properties
            return Device(type="cuda", properties=CUDAProperties(min_capability=80, max_capability=2**31 - 1))
        return name

    return {name: {device(d): Repository(name) for d in devices} for name in LAYERS}


def mark_layers(model: nn.Module) -> list:
    """Mark for ``kernels.kernelize`` the transformers RMSNorm classes of Llama's arithmetic in
    ``model`` that transformers left unmarked (``kernels.replace_kernel_forward_from_hub``, as
    its own decorator would have). Returns the classes marked."""
    from kernels import replace_kernel_forward_from_hub

    marked = []
    for cls in dict.fromkeys(type(m) for m in model.modules()):
        name = cls.__name__
        ours = NORM_CASTING.get(name) == "llama" and name.endswith("RMSNorm")  # not Llama 4's weightless L2Norm
        if ours and cls.__module__.startswith("transformers.") and not hasattr(cls, "kernel_layer_name"):
            replace_kernel_forward_from_hub(cls, "RMSNorm")
            marked.append(cls)
    return marked


def kernelize(model: nn.Module, *, mode, device=None) -> nn.Module:
    """``kernels.kernelize(model, mode=mode, device=device)`` with llmkernels' layers: the
    unmarked RMSNorm classes marked first (``mark_layers``), ``kernel_mapping()`` in force
    above any mapping registered before. Returns the model."""
    import kernels

    mark_layers(model)
    with kernels.use_kernel_mapping(kernel_mapping()):
        return kernels.kernelize(model, mode=mode, device=device)
