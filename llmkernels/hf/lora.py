"""LoRA on the MoE experts of a transformers model, trained in ``moe_experts``'s own kernels, and
read and written in PEFT's format.

``add_expert_lora(model, r, lora_alpha)`` gives each experts module of a known family adapters
``A [E, r, K]``, ``B [E, N, r]`` on ``gate_up_proj`` and ``down_proj`` (parameters ``lora_<target>_A``
/ ``_B`` of the module, in the projection's logical orientation; A as PEFT initialises it, B
zero) and freezes everything else. The patched experts forward (``hf/moe.py``) then runs them.

PEFT's format (``LoraConfig(target_parameters=[...])``, ``lora.ParamWrapper``, PEFT >= 0.17):
a 3-D expert parameter's adapter is ``lora_A.weight [r * E, in]`` (``A`` viewed as ``[E, r, in]``)
and ``lora_B.weight [out, r * E]`` (viewed as ``[out, r, E]``), ``in`` / ``out`` the projection's
input and output sizes whatever the parameter's layout. Two parameters of one module nest: the
first registered (``gate_up_proj``) is the inner wrapper, its keys under ``base_layer.``.
"""
from __future__ import annotations

import json
import math
import os
from typing import Optional

import torch
from torch import nn

from ..ops.moe import ExpertLora
from .families import MOE_EXPERTS

TARGETS = ("gate_up_proj", "down_proj")
WEIGHTS_NAME, CONFIG_NAME = "adapter_model.safetensors", "adapter_config.json"


def _names(target: str) -> tuple:
    return f"lora_{target.removesuffix('_proj')}_A", f"lora_{target.removesuffix('_proj')}_B"


def _logical_shape(module, target: str) -> tuple:
    """``(E, out, in)`` of the expert projection ``target``."""
    shape = getattr(module, target).shape
    return (shape[0], shape[2], shape[1]) if getattr(module, "is_transposed", False) else tuple(shape)


def _adapted(module) -> list:
    """The targets of ``module`` that have adapters, in the module's parameter order."""
    return [t for t in TARGETS if getattr(module, _names(t)[0], None) is not None]


def expert_lora(module) -> Optional[ExpertLora]:
    """The adapters ``add_expert_lora`` attached to ``module``, as ``moe_experts`` takes them."""
    targets = _adapted(module)
    if not targets:
        return None
    pairs = {t: tuple(getattr(module, n) for n in _names(t)) for t in targets}
    return ExpertLora(pairs.get("gate_up_proj"), pairs.get("down_proj"), module.llmkernels_lora_scale)


def experts_modules(model: nn.Module) -> list:
    """``(qualified name, module)`` of every experts module of a family ``moe_experts`` runs."""
    return [(name, m) for name, m in model.named_modules()
            if type(m).__name__ in MOE_EXPERTS and type(m).__module__.startswith("transformers.")]


def _scale(r: int, lora_alpha: float, use_rslora: bool) -> float:
    return lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r


def add_expert_lora(model: nn.Module, r: int = 16, lora_alpha: float = 32, *, targets: tuple = TARGETS,
                    use_rslora: bool = False, dtype: torch.dtype = torch.float32, freeze: bool = True) -> int:
    """Attach rank-``r`` adapters to the ``targets`` of every MoE experts module of ``model``
    (PEFT's initialisation: A Kaiming-uniform, B zero; ``dtype`` float32 as PEFT keeps adapters
    of a bf16 model); with ``freeze`` only adapters train afterwards. Returns how many modules
    got adapters (ValueError where there are none)."""
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"r must be an int >= 1, got {r!r}")
    unknown = set(targets) - set(TARGETS)
    if unknown or not targets:
        raise ValueError(f"targets must be a non-empty subset of {TARGETS}, got {targets!r}")
    modules = experts_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no MoE experts module of the families llmkernels knows "
                         f"({', '.join(sorted(MOE_EXPERTS))})")
    if freeze:
        model.requires_grad_(False)
    for _, module in modules:
        for target in (t for t in TARGETS if t in targets):
            n_experts, out, inp = _logical_shape(module, target)
            device = getattr(module, target).device
            a = torch.empty(n_experts * r, inp, device=device, dtype=dtype)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # as PEFT's lora_A, an nn.Linear's weight
            name_a, name_b = _names(target)
            module.register_parameter(name_a, nn.Parameter(a.view(n_experts, r, inp)))
            module.register_parameter(name_b, nn.Parameter(torch.zeros(n_experts, out, r, device=device, dtype=dtype)))
        module.llmkernels_lora_scale = _scale(r, lora_alpha, use_rslora)
    return len(modules)


def _peft_keys(name: str, module) -> dict:
    """target -> (key of lora_A, key of lora_B) in PEFT's state dict."""
    targets = _adapted(module)
    keys = {}
    for i, target in enumerate(targets):
        prefix = f"base_model.model.{name}." + "base_layer." * (len(targets) - 1 - i)
        keys[target] = (prefix + "lora_A.weight", prefix + "lora_B.weight")
    return keys


def save_expert_lora(model: nn.Module, directory: str, *, r: Optional[int] = None, lora_alpha: Optional[float] = None,
                     base_model_name_or_path: Optional[str] = None) -> None:
    """Write the experts' adapters as a PEFT adapter (``adapter_model.safetensors`` and
    ``adapter_config.json``) that ``peft.PeftModel.from_pretrained`` loads onto the unpatched
    model. ``lora_alpha`` defaults to ``scale * r``."""
    from safetensors.torch import save_file

    tensors, targets, rank, scale = {}, set(), None, None
    for name, module in experts_modules(model):
        for target, (key_a, key_b) in _peft_keys(name, module).items():
            a, b = (getattr(module, n).detach() for n in _names(target))
            n_experts, rank, inp = a.shape
            tensors[key_a] = a.reshape(n_experts * rank, inp).contiguous()
            tensors[key_b] = b.permute(1, 2, 0).reshape(b.shape[1], rank * n_experts).contiguous()
            targets.add(f"{name.rpartition('.')[2]}.{target}")
            scale = module.llmkernels_lora_scale
    if not tensors:
        raise ValueError("the model has no expert adapters: add_expert_lora first")
    r = r or rank
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, WEIGHTS_NAME))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r,
              "lora_alpha": lora_alpha if lora_alpha is not None else scale * r, "lora_dropout": 0.0, "bias": "none",
              "target_modules": [], "target_parameters": sorted(targets), "use_rslora": False, "use_dora": False,
              "fan_in_fan_out": False, "inference_mode": False, "base_model_name_or_path": base_model_name_or_path}
    with open(os.path.join(directory, CONFIG_NAME), "w") as f:
        json.dump(config, f, indent=2)


def load_expert_lora(model: nn.Module, directory: str, *, dtype: torch.dtype = torch.float32,
                     freeze: bool = True) -> int:
    """Attach the experts' adapters of the PEFT adapter in ``directory`` (saved by PEFT or by
    ``save_expert_lora``) to ``model``; returns how many modules got adapters."""
    from safetensors.torch import load_file

    with open(os.path.join(directory, CONFIG_NAME)) as f:
        config = json.load(f)
    targets = config.get("target_parameters") or []
    chosen = tuple(t for t in TARGETS if any(p.endswith(t) for p in targets))
    if config.get("peft_type") != "LORA" or not chosen:
        raise ValueError(f"{directory} holds no LoRA adapter of expert parameters ({', '.join(TARGETS)})")
    r = int(config["r"])
    count = add_expert_lora(model, r, config["lora_alpha"], targets=chosen, use_rslora=config.get("use_rslora", False),
                            dtype=dtype, freeze=freeze)
    tensors = load_file(os.path.join(directory, WEIGHTS_NAME))
    with torch.no_grad():
        for name, module in experts_modules(model):
            for target, (key_a, key_b) in _peft_keys(name, module).items():
                a, b = (getattr(module, n) for n in _names(target))
                n_experts, out = b.shape[0], b.shape[1]
                a.copy_(tensors[key_a].view(n_experts, r, -1))
                b.copy_(tensors[key_b].view(out, r, n_experts).permute(2, 0, 1))
    return count
