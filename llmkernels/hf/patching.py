"""The patch machinery: ``patch`` (a model, in place), ``patch_model_type`` (a model type's
classes and functions), ``unpatch_all`` and the ``PatchReport`` both return. What to replace
comes from ``families``; the replacements from ``norms``, ``mlp``, ``rope`` and ``loss``."""
from __future__ import annotations

import dataclasses
import importlib
import types
import warnings
from typing import Optional

from torch import nn

from .families import FAMILIES, MLP_LAYOUT, MOE_EXPERTS, NORM_CASTING, Family, supported_model_types
from .loss import causal_lm_forward, scaled_logits_reason
from .marks import is_patched
from .mlp import LAYOUTS, glu_activation, mlp_not_patchable
from .moe import experts_forward, experts_not_supported, register_experts_interface
from .norms import RMS_FORWARDS, layer_norm_forward, layer_norm_unsupported, patch_layer_norms_after_init
from .rope import WRAPPERS

# (owner, attribute) -> original value, for every class- or module-level change made here.
_ORIGINALS: dict = {}


@dataclasses.dataclass
class PatchReport:
    """What ``patch`` / ``patch_model_type`` did: ``patched`` lists replacements (with counts
    of modules for instance patching); ``not_patched`` maps what was left alone to why."""
    model_type: Optional[str]
    patched: list = dataclasses.field(default_factory=list)
    not_patched: dict = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"llmkernels patch report for model_type={self.model_type!r}:"]
        lines += [f"  patched: {p}" for p in self.patched] or ["  patched: nothing"]
        lines += [f"  not patched: {what} ({why})" for what, why in self.not_patched.items()]
        return "\n".join(lines)


def _replace(owner, name: str, value) -> None:
    """Set ``owner.name = value``, remembering the first original for ``unpatch_all``."""
    _ORIGINALS.setdefault((owner, name), getattr(owner, name))
    setattr(owner, name, value)


def unpatch_all() -> None:
    """Undo every class- and module-level change made by ``patch_model_type`` and by the RoPE
    part of ``patch``. (Modules patched in place by ``patch`` keep their kernel forwards.)"""
    for (owner, name), value in _ORIGINALS.items():
        setattr(owner, name, value)
    _ORIGINALS.clear()


def _modeling_module(family: Family):
    return importlib.import_module(f"transformers.models.{family.module}.modeling_{family.module}")


def _patch_rope(family: Family, report: PatchReport) -> Optional[str]:
    """Patch the family's RoPE function (module-level); return why not (None: patched)."""
    if family.rope is None:
        return family.reasons.get("rope", f"model type {family.module!r} applies no RoPE of its own")
    module = _modeling_module(family)
    name, wrap = WRAPPERS[family.rope]
    if not hasattr(module, name):
        return f"{module.__name__} has no {name}"
    if not is_patched(getattr(module, name)):
        _replace(module, name, wrap(getattr(module, name)))
    report.patched.append(f"{module.__name__}.{name} -> llmkernels.apply_rope (module-level: every model of this type)")
    return None


def _patch_rope_and_loss_reason(families: list, report: PatchReport, rope: bool, cross_entropy: bool,
                                not_causal_lm: Optional[str]) -> Optional[str]:
    """Patch the RoPE of ``families`` (the model's, then its language model's if that is another
    type; unless ``rope=False``); return why the loss must not be patched (``None``: patch it).
    ``not_causal_lm``: the caller's reason the model has no supported loss, if any."""
    if not rope:
        report.not_patched["rope"] = "rope=False"
    else:
        reasons = [_patch_rope(family, report) for family in families]
        if all(reasons):
            report.not_patched["rope"] = reasons[0]
    if not cross_entropy:
        return "cross_entropy=False"
    return not_causal_lm or families[0].reasons.get("loss")


def _bind(module: nn.Module, attr: str, replacement) -> None:
    """``module.attr = replacement`` bound to ``module``, unless it is already llmkernels'."""
    if not is_patched(getattr(module, attr)):
        setattr(module, attr, types.MethodType(replacement, module))


# --------------------------------------------------------------------------------------------
# patch(model): modules in place
# --------------------------------------------------------------------------------------------
def _patch_rms_norm_module(module: nn.Module, report: PatchReport) -> str:
    casting = NORM_CASTING[type(module).__name__]
    _bind(module, "forward", RMS_FORWARDS[casting])
    return f"{type(module).__name__} -> llmkernels.rms_norm(casting={casting!r})"


def _patch_layer_norm_module(module: nn.Module, report: PatchReport) -> Optional[str]:
    why = layer_norm_unsupported(module)
    if why is not None:
        report.not_patched["LayerNorm"] = why
        return None
    _bind(module, "forward", layer_norm_forward)
    return "torch.nn.LayerNorm -> llmkernels.layer_norm"


def _patch_mlp_module(module: nn.Module, report: PatchReport) -> Optional[str]:
    name = type(module).__name__
    layout = MLP_LAYOUT[name]
    why = mlp_not_patchable(module, layout, instance=True)
    if why is not None:
        report.not_patched[name] = why
        return None
    attr, replacement, act_attr = LAYOUTS[layout]
    _bind(module, attr, replacement)
    op = "glu_linear" if type(getattr(module, "down_proj", None)) is nn.Linear else "glu"
    return f"{name}.{attr} -> llmkernels.{op}(activation={glu_activation(getattr(module, act_attr))!r})"


def _patch_experts_module(module: nn.Module, report: PatchReport) -> Optional[str]:
    name = type(module).__name__
    activation = MOE_EXPERTS[name]
    why = experts_not_supported(module, activation)
    if why is not None:
        report.not_patched[f"{name}.forward"] = why
        return None
    _bind(module, "forward", experts_forward(activation))
    return f"{name}.forward -> llmkernels.moe_experts(activation={activation!r})"


def _text_model_type(config) -> Optional[str]:
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES and hasattr(config, "get_text_config"):
        text_type = getattr(config.get_text_config(), "model_type", None)
        if text_type in FAMILIES:
            return text_type
    return model_type


def patch(model: nn.Module, *, rms_norm: bool = True, layer_norm: bool = True, rope: bool = True,
          cross_entropy: bool = True, mlp: bool = True, moe: bool = True) -> PatchReport:
    """Patch a Hugging Face transformers model in place to use the llmkernels kernels.

    Args:
        model: a transformers ``PreTrainedModel`` (any head). Norm and gated-MLP modules are
            recognised by class (the RMSNorm and MLP classes of the supported families,
            ``torch.nn.LayerNorm``) in any model, also one of an unsupported type; RoPE and the
            loss need a known type.
        rms_norm, layer_norm, rope, cross_entropy, mlp: switch each replacement off with False.
        moe: the Mixture-of-Experts experts (``llmkernels.moe_experts``; their routers are
            transformers' own); False leaves them.

    Returns:
        A ``PatchReport``; ``print(report)`` lists what was and was not patched. For a model
        type this module does not know, the report is also issued as a warning.
    """
    config = getattr(model, "config", None)
    model_type = _text_model_type(config)
    family = FAMILIES.get(model_type)
    report = PatchReport(model_type)
    counts: dict = {}
    unknown_norms: set = set()
    # kind -> (switch, report key when switched off, patcher)
    kinds = {"rms_norm": (rms_norm, None, _patch_rms_norm_module),
             "layer_norm": (layer_norm, "LayerNorm", _patch_layer_norm_module),
             "mlp": (mlp, None, _patch_mlp_module)}
    for module in model.modules():
        cls = type(module)
        name = cls.__name__
        from_transformers = cls.__module__.startswith("transformers.")
        if name in MOE_EXPERTS and from_transformers:  # (besides the mlp part's _apply_gate, its fallback's)
            key = _patch_experts_module(module, report) if moe else None
            if not moe:
                report.not_patched[f"{name}.forward"] = "moe=False"
            if key is not None:
                counts[key] = counts.get(key, 0) + 1
        if name in NORM_CASTING and from_transformers:
            kind = "rms_norm"
        elif cls is nn.LayerNorm:
            kind = "layer_norm"
        elif name in MLP_LAYOUT and from_transformers:
            kind = "mlp"
        else:
            if name.endswith(("RMSNorm", "LayerNorm", "GroupNorm")) and not is_patched(module.forward):
                unknown_norms.add(name)
            continue
        enabled, off_key, patcher = kinds[kind]
        if not enabled:
            report.not_patched[off_key or name] = f"{kind}=False"
            continue
        key = patcher(module, report)
        if key is not None:
            counts[key] = counts.get(key, 0) + 1
    report.patched += [f"{key} ({n} modules)" for key, n in counts.items()]
    for name in sorted(unknown_norms):
        report.not_patched[name] = "norm class whose exact numerics llmkernels does not know"
    if family is None:
        why = f"model type {model_type!r} is not one of {', '.join(supported_model_types())}"
        report.not_patched["rope"] = report.not_patched["loss"] = why
        warnings.warn(str(report), stacklevel=2)
        return report
    not_causal_lm = None
    if family.causal_lm is not None and type(model).__name__ != family.causal_lm:
        not_causal_lm = f"{type(model).__name__} is not {family.causal_lm}"
    elif family.logits == "scaled":
        not_causal_lm = scaled_logits_reason(config)
    text_family = FAMILIES.get(getattr(config.get_text_config(), "model_type", None))
    families = [family] + ([text_family] if text_family is not None and text_family.module != family.module else [])
    if mlp and not any(f.mlps or f.experts for f in families):
        report.not_patched["mlp"] = f"model type {model_type!r} has no gated MLP"
    why = _patch_rope_and_loss_reason(families, report, rope, cross_entropy, not_causal_lm)
    if why:
        report.not_patched["loss"] = why
    else:
        _bind(model, "forward", causal_lm_forward(type(model).forward, family))
        report.patched.append(f"{type(model).__name__}.forward loss -> llmkernels.linear_cross_entropy")
    return report


# --------------------------------------------------------------------------------------------
# patch_model_type(model_type): classes and functions
# --------------------------------------------------------------------------------------------
def _patch_norm_classes(family: Family, module, report: PatchReport) -> None:
    for name, casting in family.norms.items():
        cls = getattr(module, name)
        if not is_patched(cls.forward):
            _replace(cls, "forward", RMS_FORWARDS[casting])
        report.patched.append(f"{name}.forward -> llmkernels.rms_norm(casting={casting!r})")


def _patch_layer_norm_classes(family: Family, module, report: PatchReport) -> None:
    base = next(c for c in getattr(module, family.causal_lm).__mro__
                if c.__module__ == module.__name__ and c.__name__.endswith("PreTrainedModel"))
    if not is_patched(base.post_init):
        _replace(base, "post_init", patch_layer_norms_after_init(base.post_init))
    report.patched.append(f"torch.nn.LayerNorm in {base.__name__} models built after this call -> "
                          "llmkernels.layer_norm")


def _patch_mlp_classes(family: Family, module, report: PatchReport) -> None:
    for name, layout in family.mlps.items():
        cls = getattr(module, name, None)
        why = f"{module.__name__} has no {name}" if cls is None else mlp_not_patchable(cls, layout, instance=False)
        if why is not None:
            report.not_patched[name] = why
            continue
        attr, replacement, _ = LAYOUTS[layout]
        if not is_patched(getattr(cls, attr)):
            _replace(cls, attr, replacement)
        report.patched.append(f"{name}.{attr} -> llmkernels.glu (models whose activation it computes)")


def _patch_experts_classes(family: Family, module, report: PatchReport) -> None:
    register_experts_interface()
    for name, activation in family.experts.items():
        cls = getattr(module, name, None)
        if cls is None:
            report.not_patched[f"{name}.forward"] = f"{module.__name__} has no {name}"
            continue
        if not is_patched(cls.forward):
            _replace(cls, "forward", experts_forward(activation, fallback=cls.forward))
        report.patched.append(f"{name}.forward -> llmkernels.moe_experts(activation={activation!r}) "
                              "(modules the kernels run; others keep transformers' forward)")


def patch_model_type(model_type: str = "llama", *, rms_norm: bool = True, layer_norm: bool = True,
                     rope: bool = True, cross_entropy: bool = True, mlp: bool = True, moe: bool = True) -> PatchReport:
    """Patch a model type's transformers classes so that its models run on the kernels.

    Replaces the family's RMSNorm ``forward``, its gated MLP's ``forward`` (experts:
    ``_apply_gate``; each model whose activation ``llmkernels.glu`` does not compute keeps
    transformers' product), its ``apply_rotary_pos_emb`` and its ``*ForCausalLM.forward``
    (loss). These are the classes' own methods, so every model of that type in the process
    runs on the kernels, built before the call or after it (``from_pretrained``,
    ``from_config``, the constructor). ``torch.nn.LayerNorm`` (GPT-NeoX) is not the family's
    own class: the family's ``post_init`` patches the LayerNorm modules of each model built
    after the call (``patch(model)`` patches an existing one). ``unpatch_all()`` undoes this.

    Args:
        model_type: a ``config.model_type``, one of ``supported_model_types()``.
        rms_norm, layer_norm, rope, cross_entropy, mlp, moe: switch each replacement off with False
            (``moe``: the MoE experts' ``forward``, ``llmkernels.moe_experts``; it also registers
            ``experts_implementation="llmkernels"`` with transformers).
    """
    if model_type not in FAMILIES:
        raise ValueError(f"model_type must be one of {', '.join(supported_model_types())}; got {model_type!r}. "
                         "For another model, build it and call llmkernels.patch(model)")
    family = FAMILIES[model_type]
    module = _modeling_module(family)
    report = PatchReport(model_type)
    # part -> (switch, report key when switched off, patcher); a part the family lacks is skipped
    parts = [(rms_norm, "rms_norm", list(family.norms), _patch_norm_classes),
             (layer_norm, "layer_norm", ["LayerNorm"] if family.layer_norm else [], _patch_layer_norm_classes),
             (mlp, "mlp", list(family.mlps), _patch_mlp_classes),
             (moe, "moe", [f"{name}.forward" for name in family.experts], _patch_experts_classes)]
    for enabled, switch, names, patcher in parts:
        if not names:
            continue
        if enabled:
            patcher(family, module, report)
        else:
            report.not_patched.update({name: f"{switch}=False" for name in names})
    if mlp and not (family.mlps or family.experts):
        report.not_patched["mlp"] = f"model type {model_type!r} has no gated MLP"
    why = _patch_rope_and_loss_reason([family], report, rope, cross_entropy, None)
    if why:
        report.not_patched["loss"] = why
    else:
        cls = getattr(module, family.causal_lm)
        if not is_patched(cls.forward):
            _replace(cls, "forward", causal_lm_forward(cls.forward, family))
        scaled = " (models whose logits_scaling is a power of two)" if family.logits == "scaled" else ""
        report.patched.append(f"{family.causal_lm}.forward loss -> llmkernels.linear_cross_entropy{scaled}")
    return report
