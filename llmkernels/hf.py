"""Patch Hugging Face transformers models to run on the llmkernels kernels.

Two entry points:

- ``patch(model)``: patch a model that already exists, in place. Norm modules keep their class,
  parameters and state-dict keys; only their ``forward`` is swapped (the same Parameter feeds the
  kernel). Returns a ``PatchReport`` saying what was patched and what was not, and why.
- ``patch_model_type("llama")``: patch the classes and functions of a model type's modeling
  module, so that every model of that type built afterwards (``from_pretrained``,
  ``from_config``, ``LlamaForCausalLM(config)``) runs on the kernels.

What is replaced (each can be switched off):

- ``rms_norm``: the family's RMSNorm class (Llama-like ``weight * x_hat.to(dtype)``, Gemma's
  ``x_hat * (1 + weight)`` in fp32, OLMo 2/3's and gpt-oss's ``(weight * x_hat).to(dtype)``),
  including the per-head q/k norms of Qwen 3, Gemma 3 and OLMo 2/3 and Llama 4's weightless
  q/k L2 norm, by ``llmkernels.rms_norm`` with the matching ``casting``.
- ``layer_norm``: ``torch.nn.LayerNorm`` modules (GPT-NeoX) by ``llmkernels.layer_norm``.
- ``mlp``: the product ``act_fn(gate) * up`` of the family's gated MLP by ``llmkernels.glu``
  (``silu``: SwiGLU; Gemma's ``gelu_pytorch_tanh``: GeGLU; exact ``gelu``), which saves gate and
  up for the backward but not ``act_fn(gate)``; with its ``down_proj`` a plain ``nn.Linear`` by
  ``llmkernels.glu_linear``, which does not keep the product for ``down_proj``'s weight gradient
  either (recomputed in the backward): Llama-style ``gate_proj``/``up_proj``/``down_proj``
  MLPs (``forward``), Phi-3's fused ``gate_up_proj`` (``forward``, halves read in place), the
  3-D expert weights of Mixtral, Qwen 2/3 MoE (``_apply_gate``, the hook that transformers'
  ``grouped_mm``, ``batched_mm`` and ``deepgemm`` experts implementations call; its ``eager``
  one computes the product inline and is left alone; gpt-oss's own ``_apply_gate``, a clamped
  SwiGLU, is left alone) and Llama 4's (``forward``, one ``bmm`` over every expert). An MLP
  whose activation is none of those three (or whose gate/up are DTensors) computes
  transformers' ``act_fn(gate) * up``.
- ``rope``: the modeling module's ``apply_rotary_pos_emb`` by ``llmkernels.apply_rope``
  (partial rotary, as GPT-NeoX and Phi-3 use it, rotates the first ``cos.shape[-1]`` channels;
  gpt-oss's half-width tables serve both halves; the multimodal RoPE of Qwen2-VL, Qwen2.5-VL and
  Qwen3-VL is folded into per-token cos/sin before it; inputs the kernel does not take go to the
  original function), and Llama 4's complex ``apply_rotary_emb`` (pairs ``(2i, 2i + 1)``).
  A module-level function: it changes every model of that type in the process, also for
  ``patch(model)`` (which also patches the language model's type of a composite model).
- ``cross_entropy``: the ``forward`` of ``*ForCausalLM`` and of the multimodal
  ``*ForConditionalGeneration`` classes that run their base model and then ``lm_head``. When
  labels are given and logits are not wanted the loss comes from
  ``llmkernels.linear_cross_entropy`` on the final hidden states and the output embedding,
  without materializing the ``[tokens, vocab]`` logits (label shift, ``ignore_index``,
  ``shift_labels``, ``num_items_in_batch``, Gemma 2/3 final-logit softcapping, Granite's
  ``logits_scaling`` when it is a power of two, and the MoE router auxiliary loss as
  transformers computes them); the output is the class transformers returns, without logits.
  Logits are wanted when ``return_logits=True`` is passed, or by default when the model is not
  training: then the original forward runs and returns logits and its loss.

DTensor (tensor parallel) norms: when the norm's input or weight is a ``DTensor`` the kernel
runs on the local shard: the input may be sharded along any dimension but the normalized
(last) one, the weight/bias replicated (their gradient is reduced as DTensor prescribes) or
sharded (gathered with ``full_tensor()``). FSDP2 (``fully_shard``) unshards parameters before
each forward, so plain tensors reach the kernel and no special handling is needed.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import types
import warnings
from typing import Callable, Optional

import torch
from torch import nn

from .ops.glu import ACTIVATIONS as GLU_ACTIVATIONS
from .ops.glu import glu as _glu
from .ops.glu import glu_linear as _glu_linear
from .ops.linear_cross_entropy import linear_cross_entropy as _linear_cross_entropy
from .ops.norm import layer_norm as _layer_norm
from .ops.norm import rms_norm as _rms_norm
from .ops.rope import apply_rope as _apply_rope


# --------------------------------------------------------------------------------------------
# what each supported model type uses
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Family:
    module: str                      # transformers.models.<module>.modeling_<module>
    norms: dict                      # RMSNorm class name -> llmkernels casting
    causal_lm: Optional[str]         # the class whose forward computes the LM loss (*ForCausalLM, or a
                                     # *ForConditionalGeneration that calls ``base`` then ``lm_head``)
    layer_norm: bool = False         # uses torch.nn.LayerNorm (GPT-NeoX)
    mlps: dict = dataclasses.field(default_factory=dict)  # gated-MLP class name -> layout (_MLP_PATCHES)
    rope: Optional[str] = "rotate_half"  # how the module applies RoPE (_ROPE_PATCHES), None: it has none of its own
    logits: str = "plain"            # lm_head output -> loss logits: "plain", "softcap" (final_logit_softcapping)
                                     # or "scaled" (divided by config.logits_scaling)
    base: str = "model"              # attribute of ``causal_lm`` holding the base model
    reasons: dict = dataclasses.field(default_factory=dict)  # part -> why it is left to transformers


_FAMILIES = {
    "llama": _Family("llama", {"LlamaRMSNorm": "llama"}, "LlamaForCausalLM", mlps={"LlamaMLP": "separate"}),
    "mistral": _Family("mistral", {"MistralRMSNorm": "llama"}, "MistralForCausalLM",
                       mlps={"MistralMLP": "separate"}),
    "ministral3": _Family("ministral3", {"Ministral3RMSNorm": "llama"}, "Ministral3ForCausalLM",
                          mlps={"Ministral3MLP": "separate"}),
    # Mistral 3 (Pixtral vision + a Mistral / Ministral 3 language model of its own model type, whose
    # RoPE ``patch`` patches): the projector's norm and the loss here.
    "mistral3": _Family("mistral3", {"Mistral3RMSNorm": "llama"}, "Mistral3ForConditionalGeneration", rope=None,
                        reasons={"rope": "its language model is the model type config.text_config.model_type: "
                                         "patch_model_type that type too"}),
    "mixtral": _Family("mixtral", {"MixtralRMSNorm": "llama"}, "MixtralForCausalLM",
                       mlps={"MixtralExperts": "experts"}),
    "qwen2": _Family("qwen2", {"Qwen2RMSNorm": "llama"}, "Qwen2ForCausalLM", mlps={"Qwen2MLP": "separate"}),
    "qwen2_moe": _Family("qwen2_moe", {"Qwen2MoeRMSNorm": "llama"}, "Qwen2MoeForCausalLM",
                         mlps={"Qwen2MoeMLP": "separate", "Qwen2MoeExperts": "experts"}),
    # Qwen2-VL, Qwen2.5-VL, Qwen3-VL: their rotary embedding folds the multimodal (temporal, height, width)
    # sections into per-token cos/sin, which apply_rotary_pos_emb applies as plain RoPE.
    "qwen2_vl": _Family("qwen2_vl", {"Qwen2VLRMSNorm": "llama"}, "Qwen2VLForConditionalGeneration",
                        mlps={"Qwen2MLP": "separate"}),
    "qwen2_5_vl": _Family("qwen2_5_vl", {"Qwen2_5_VLRMSNorm": "llama"}, "Qwen2_5_VLForConditionalGeneration",
                          mlps={"Qwen2MLP": "separate", "Qwen2_5_VLMLP": "separate"}),
    "qwen3": _Family("qwen3", {"Qwen3RMSNorm": "llama"}, "Qwen3ForCausalLM", mlps={"Qwen3MLP": "separate"}),
    "qwen3_moe": _Family("qwen3_moe", {"Qwen3MoeRMSNorm": "llama"}, "Qwen3MoeForCausalLM",
                         mlps={"Qwen3MoeMLP": "separate", "Qwen3MoeExperts": "experts"}),
    "qwen3_vl": _Family("qwen3_vl", {"Qwen3VLTextRMSNorm": "llama"}, "Qwen3VLForConditionalGeneration",
                        mlps={"Qwen3VLTextMLP": "separate"}),
    # Llama 4: complex RoPE on (2i, 2i + 1) pairs, weightless q/k L2 norms, 3-D experts run by bmm.
    "llama4_text": _Family("llama4", {"Llama4TextRMSNorm": "llama", "Llama4TextL2Norm": "llama"},
                           "Llama4ForCausalLM", mlps={"Llama4TextMLP": "separate_activation_fn",
                                                      "Llama4TextExperts": "bmm_experts"}, rope="complex"),
    "llama4": _Family("llama4", {"Llama4TextRMSNorm": "llama", "Llama4TextL2Norm": "llama"}, None,
                      mlps={"Llama4TextMLP": "separate_activation_fn", "Llama4TextExperts": "bmm_experts"},
                      rope="complex",
                      reasons={"loss": "Llama4ForConditionalGeneration merges the image features and runs its "
                                       "language model's lm_head itself (Llama4ForCausalLM's loss is patched)"}),
    "phi3": _Family("phi3", {"Phi3RMSNorm": "llama"}, "Phi3ForCausalLM", mlps={"Phi3MLP": "fused"}),
    "smollm3": _Family("smollm3", {"SmolLM3RMSNorm": "llama"}, "SmolLM3ForCausalLM", mlps={"SmolLM3MLP": "separate"}),
    # Granite divides the logits by logits_scaling: the loss is patched where that is a power of two (then
    # hidden / scaling is exact and the logits equal transformers' bit for bit).
    "granite": _Family("granite", {"GraniteRMSNorm": "llama"}, "GraniteForCausalLM", mlps={"GraniteMLP": "separate"},
                       logits="scaled"),
    # OLMo 2 / 3 and gpt-oss multiply by the weight in fp32 and cast once: casting="none".
    "olmo2": _Family("olmo2", {"Olmo2RMSNorm": "none"}, "Olmo2ForCausalLM", mlps={"Olmo2MLP": "separate"}),
    "olmo3": _Family("olmo3", {"Olmo3RMSNorm": "none"}, "Olmo3ForCausalLM", mlps={"Olmo3MLP": "separate"}),
    # gpt-oss: cos/sin tables of half the head (both halves use them); its experts' _apply_gate is a
    # clamped SwiGLU (alpha, limit) that llmkernels.glu does not compute.
    "gpt_oss": _Family("gpt_oss", {"GptOssRMSNorm": "none"}, "GptOssForCausalLM", mlps={"GptOssExperts": "experts"},
                       rope="half_table"),
    "gemma": _Family("gemma", {"GemmaRMSNorm": "gemma"}, "GemmaForCausalLM", mlps={"GemmaMLP": "separate"}),
    "gemma2": _Family("gemma2", {"Gemma2RMSNorm": "gemma"}, "Gemma2ForCausalLM", mlps={"Gemma2MLP": "separate"},
                      logits="softcap"),
    "gemma3_text": _Family("gemma3", {"Gemma3RMSNorm": "gemma"}, "Gemma3ForCausalLM",
                           mlps={"Gemma3MLP": "separate"}, logits="softcap"),
    # The multimodal Gemma 3 (its lm_head output is not softcapped).
    "gemma3": _Family("gemma3", {"Gemma3RMSNorm": "gemma"}, "Gemma3ForConditionalGeneration",
                      mlps={"Gemma3MLP": "separate"}),
    # GPT-NeoX's MLP is not gated (dense_4h_to_h(act(dense_h_to_4h(x)))).
    "gpt_neox": _Family("gpt_neox", {}, "GPTNeoXForCausalLM", layer_norm=True, base="gpt_neox"),
}

# Norm class name -> casting, for recognising these classes inside any model.
_NORM_CASTING = {name: casting for fam in _FAMILIES.values() for name, casting in fam.norms.items()}
# Gated-MLP class name -> layout, likewise.
_MLP_LAYOUT = {name: layout for fam in _FAMILIES.values() for name, layout in fam.mlps.items()}

# (owner, attribute) -> original value, for every class- or module-level change made here.
_ORIGINALS: dict = {}


def supported_model_types() -> tuple:
    """The ``config.model_type`` values that ``patch`` and ``patch_model_type`` know."""
    return tuple(_FAMILIES)


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


# --------------------------------------------------------------------------------------------
# replacement forwards
# --------------------------------------------------------------------------------------------
def _mark(fn: Callable) -> Callable:
    fn._llmkernels = True
    return fn


def _is_patched(fn) -> bool:
    return getattr(getattr(fn, "__func__", fn), "_llmkernels", False)


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "device_mesh")


def _norm_on_local_shards(fn, x, weight, bias, **kwargs):
    """``fn(x, weight, bias)`` when x or a parameter is a DTensor: the kernel runs on x's local
    shard; the result has x's placements. See the module docstring for what is supported."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = placements = None
    if isinstance(x, DTensor):
        mesh, placements = x.device_mesh, x.placements
        for p in placements:
            if isinstance(p, Shard) and p.dim % x.dim() == x.dim() - 1:
                raise ValueError("the norm's input is sharded along its last (normalized) dimension; "
                                 "llmkernels norms need whole rows on each rank (shard another dim)")
            if not isinstance(p, (Shard, Replicate)):
                raise ValueError(f"the norm's input has placement {p}; expected Shard or Replicate")
        x = x.to_local()

    def local(p):
        if not isinstance(p, DTensor):
            return p
        if all(isinstance(q, Replicate) for q in p.placements):
            # Rows are split across ranks where x is sharded: each rank's dW is a partial sum.
            grads = [Partial() if isinstance(q, Shard) else Replicate() for q in (placements or p.placements)]
            return p.to_local(grad_placements=grads if placements is not None else None)
        return p.full_tensor()

    y = fn(x, local(weight), local(bias), **kwargs)
    return DTensor.from_local(y, mesh, placements, run_check=False) if mesh is not None else y


def _norm_call(fn, x, weight, bias, **kwargs):
    if _is_dtensor(x) or _is_dtensor(weight) or _is_dtensor(bias):
        return _norm_on_local_shards(fn, x, weight, bias, **kwargs)
    return fn(x, weight, bias, **kwargs)


def _rms_forward(casting: str) -> Callable:
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        eps = self.variance_epsilon if hasattr(self, "variance_epsilon") else self.eps
        # (Llama 4's q/k L2 norm has no weight)
        return _norm_call(_rms_norm, hidden_states, getattr(self, "weight", None), None, eps=eps, casting=casting)
    forward.__name__ = f"llmkernels_rms_norm_{casting}_forward"
    return _mark(forward)


_RMS_FORWARDS = {c: _rms_forward(c) for c in ("llama", "gemma", "none")}


@_mark
def _layer_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    return _norm_call(_layer_norm, x, self.weight, self.bias, eps=self.eps)


def _layer_norm_supported(m: nn.Module) -> Optional[str]:
    """None when ``m`` (a torch.nn.LayerNorm) can run on the kernel, else why not."""
    if len(m.normalized_shape) != 1:
        return f"normalized_shape {tuple(m.normalized_shape)} spans more than the last dimension"
    return None


# transformers activation modules that llmkernels.glu computes (torch.nn.SiLU and nn.GELU too).
_GLU_ACTIVATIONS = {"SiLUActivation": "silu", "GELUTanh": "gelu_tanh", "NewGELUActivation": "gelu_tanh",
                    "GELUActivation": "gelu"}
# Experts implementations (config._experts_implementation) that call the experts' _apply_gate.
_APPLY_GATE_IMPLEMENTATIONS = ("grouped_mm", "batched_mm", "deepgemm")


def _glu_activation(act) -> Optional[str]:
    """The ``llmkernels.glu`` activation equal to the module ``act``, or None."""
    if isinstance(act, nn.SiLU):
        return "silu"
    if isinstance(act, nn.GELU):
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    if type(act).__module__.startswith("transformers."):
        return _GLU_ACTIVATIONS.get(type(act).__name__)
    return None


def _gated(act_fn, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``act_fn(gate) * up``: ``llmkernels.glu`` when it computes ``act_fn`` on plain tensors,
    else transformers' own expression."""
    activation = _glu_activation(act_fn)
    if activation is None or _is_dtensor(gate) or _is_dtensor(up):
        return act_fn(gate) * up
    return _glu(gate, up, activation)


def _plain_linear(module, x: torch.Tensor) -> bool:
    """True when calling ``module(x)`` is exactly ``F.linear(x, module.weight, module.bias)``:
    an ``nn.Linear`` itself (not a LoRA or quantized subclass) without hooks, whose
    parameters are plain tensors of x's dtype, outside autocast."""
    from torch.nn.modules import module as module_globals

    return (type(module) is nn.Linear and not module._forward_hooks and not module._forward_pre_hooks
            and not module._backward_hooks and not module._backward_pre_hooks
            and not module_globals._global_forward_hooks and not module_globals._global_forward_pre_hooks
            and not module_globals._global_backward_hooks and not module_globals._global_backward_pre_hooks
            and not _is_dtensor(module.weight) and module.weight.dtype == x.dtype
            and not torch.is_autocast_enabled(x.device.type))


def _gated_down(act_fn, gate: torch.Tensor, up: torch.Tensor, down_proj) -> torch.Tensor:
    """``down_proj(act_fn(gate) * up)``: ``llmkernels.glu_linear`` (the product is recomputed in
    the backward, not kept) when ``down_proj`` is a plain ``nn.Linear``, else ``_gated``."""
    activation = _glu_activation(act_fn)
    if activation is None or _is_dtensor(gate) or _is_dtensor(up) or not _plain_linear(down_proj, gate):
        return down_proj(_gated(act_fn, gate, up))
    return _glu_linear(gate, up, down_proj.weight, down_proj.bias, activation)


def _separate_mlp_forward(act_attr: str) -> Callable:
    """Llama's MLP (and its copies): ``down_proj(act(gate_proj(x)) * up_proj(x))``, ``act`` the
    module's attribute ``act_attr``."""
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _gated_down(getattr(self, act_attr), self.gate_proj(x), self.up_proj(x), self.down_proj)
    forward.__name__ = f"llmkernels_separate_mlp_{act_attr}_forward"
    return _mark(forward)


@_mark
def _fused_mlp_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """Phi-3's MLP: ``gate, up = gate_up_proj(x).chunk(2, -1)``, ``down_proj(up * act(gate))``."""
    gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)
    return _gated_down(self.activation_fn, gate, up, self.down_proj)


@_mark
def _experts_apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
    """transformers' default ``_apply_gate`` of 3-D expert weights: ``gate, up =
    gate_up_out.chunk(2, -1)`` (``[S, 2 I]``), ``act_fn(gate) * up``."""
    gate, up = gate_up_out.chunk(2, dim=-1)
    return _gated(self.act_fn, gate, up)


@_mark
def _bmm_experts_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """Llama 4's experts: tokens ``[E * T, H]`` (each expert's T, pre-scaled by the router),
    ``gate, up = bmm(x, gate_up_proj).chunk(2, -1)``, ``bmm(up * act_fn(gate), down_proj)``."""
    x = hidden_states.view(self.gate_up_proj.shape[0], -1, self.hidden_size)
    gate, up = torch.bmm(x, self.gate_up_proj).chunk(2, dim=-1)
    return torch.bmm(_gated(self.act_fn, gate, up), self.down_proj).view(-1, self.hidden_size)


# layout -> (attribute replaced, replacement, attribute holding the activation module)
_MLP_PATCHES = {
    "separate": ("forward", _separate_mlp_forward("act_fn"), "act_fn"),
    "separate_activation_fn": ("forward", _separate_mlp_forward("activation_fn"), "activation_fn"),
    "bmm_experts": ("forward", _bmm_experts_forward, "act_fn"),
    "fused": ("forward", _fused_mlp_forward, "activation_fn"),
    "experts": ("_apply_gate", _experts_apply_gate, "act_fn"),
}


def _mlp_not_patchable(owner, layout: str, instance: bool) -> Optional[str]:
    """Why the gated-MLP class or module ``owner`` must keep its own code, or None. A class
    (``instance=False``) is patched whatever its models' activations: each falls back at run
    time; a module is checked for its activation and, for experts, its implementation."""
    attr, _, act_attr = _MLP_PATCHES[layout]
    current = getattr(owner, attr, None)
    if layout == "experts" and not (_is_patched(current) or
                                    getattr(current, "__name__", None) == "_default_apply_gate"):
        return "its _apply_gate is not transformers' default act_fn(gate) * up"
    if not instance:
        return None
    act = getattr(owner, act_attr, None)
    if _glu_activation(act) is None:
        return f"its activation {type(act).__name__} is none of llmkernels.glu's {GLU_ACTIVATIONS}"
    implementation = getattr(getattr(owner, "config", None), "_experts_implementation", None)
    if layout == "experts" and implementation not in _APPLY_GATE_IMPLEMENTATIONS:
        return (f"experts_implementation={implementation!r} does not call _apply_gate "
                f"({', '.join(_APPLY_GATE_IMPLEMENTATIONS)} do)")
    return None


def _rope_forward(original: Callable, half_table: bool = False) -> Callable:
    """Wrap a modeling module's ``apply_rotary_pos_emb(q, k, cos, sin, ..., unsqueeze_dim=1)``:
    ``llmkernels.apply_rope`` where it fits (4-D q/k, per-token cos/sin ``[B, S, R]`` of q's
    dtype; ``R < D`` is partial rotary, channels past R pass through), else ``original``.
    ``half_table``: cos/sin are ``[B, S, D / 2]``, used for both halves of the head (gpt-oss)."""
    import inspect

    params = list(inspect.signature(original).parameters)
    unsqueeze_pos = params.index("unsqueeze_dim") - 4 if "unsqueeze_dim" in params else None

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        unsqueeze_dim = kwargs.get("unsqueeze_dim", 1)
        if unsqueeze_pos is not None and len(args) > unsqueeze_pos:
            unsqueeze_dim = args[unsqueeze_pos]
        layout = {1: "bhsd", 2: "bshd"}.get(unsqueeze_dim)
        width = cos.shape[-1] * (2 if half_table else 1)
        if (layout is None or q.dim() != 4 or k is None or k.dim() != 4 or cos.dim() != 3
                or not (q.dtype == k.dtype == cos.dtype == sin.dtype) or width > q.shape[-1]
                or (half_table and width != q.shape[-1])
                or (torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad))):
            return original(q, k, cos, sin, *args, **kwargs)
        if half_table:
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        return _apply_rope(q, k, cos, sin, layout=layout)

    apply_rotary_pos_emb._llmkernels_original = original
    return _mark(apply_rotary_pos_emb)


def _complex_rope_forward(original: Callable) -> Callable:
    """Wrap Llama 4's ``apply_rotary_emb(xq, xk, freqs_cis)``: q/k ``[B, S, H, D]`` times the
    complex ``freqs_cis [B, S, D / 2]`` on feature pairs ``(2i, 2i + 1)`` in fp32, which is
    ``llmkernels.apply_rope(interleaved=True)`` with cos/sin its real/imaginary parts repeated
    per pair; else ``original``."""
    @functools.wraps(original)
    def apply_rotary_emb(xq, xk, freqs_cis):
        if (xq.dim() != 4 or xk.dim() != 4 or freqs_cis.dim() != 3 or not freqs_cis.is_complex()
                or 2 * freqs_cis.shape[-1] != xq.shape[-1] or freqs_cis.requires_grad):
            return original(xq, xk, freqs_cis)
        cos = freqs_cis.real.repeat_interleave(2, dim=-1)
        sin = freqs_cis.imag.repeat_interleave(2, dim=-1)
        return _apply_rope(xq, xk, cos, sin, layout="bshd", interleaved=True)

    apply_rotary_emb._llmkernels_original = original
    return _mark(apply_rotary_emb)


# how a modeling module applies RoPE -> (its function, wrapper)
_ROPE_PATCHES = {
    "rotate_half": ("apply_rotary_pos_emb", _rope_forward),
    "half_table": ("apply_rotary_pos_emb", functools.partial(_rope_forward, half_table=True)),
    "complex": ("apply_rotary_emb", _complex_rope_forward),
}


def _scaled_logits_reason(config) -> Optional[str]:
    """Why Granite's ``logits / logits_scaling`` loss must stay transformers' (None: it need not):
    dividing the hidden states instead is exact only by a power of two."""
    scaling = getattr(config, "logits_scaling", 1.0)
    if scaling > 0 and math.frexp(scaling)[0] == 0.5:
        return None
    return (f"logits_scaling={scaling} is not a power of two: hidden / scaling would round differently from "
            "transformers' logits / scaling")


def _causal_lm_loss(self, family: _Family, hidden: torch.Tensor, labels: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` (shift, ignore_index, num_items_in_batch) of the loss
    logits of ``lm_head(hidden)``, computed by ``linear_cross_entropy`` without the logits."""
    ignore_index = kwargs.get("ignore_index", -100)
    shift_labels = kwargs.get("shift_labels")
    if shift_labels is None:
        # Position t predicts token t + 1; the last position has no target.
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    head = self.get_output_embeddings()
    num_items = kwargs.get("num_items_in_batch")
    softcap = self.config.final_logit_softcapping if family.logits == "softcap" else None
    if family.logits == "scaled":
        hidden = hidden / self.config.logits_scaling  # a power of two: exact
    loss = _linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]), head.weight, shift_labels.reshape(-1).to(hidden.device),
        bias=head.bias, ignore_index=ignore_index, softcap=softcap,
        reduction="mean" if num_items is None else "sum")
    if num_items is not None:
        loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
    return loss


def _output_class(original: Callable):
    """The ``ModelOutput`` class that ``original`` (a ``forward``) is annotated to return, or None."""
    import inspect

    from transformers.utils import ModelOutput

    annotation = inspect.signature(original).return_annotation
    for cls in getattr(annotation, "__args__", (annotation,)):
        if isinstance(cls, type) and issubclass(cls, ModelOutput):
            return cls
    return None


def _fused_loss_forward(self, family: _Family, output: tuple, labels, kwargs):
    """The loss class's forward with the loss from the base model's last hidden state: the
    output is ``output = (class, its field names)`` with ``logits=None`` and the base model's
    outputs of the same names (cache, hidden states, router logits, image features, ...)."""
    output_cls, fields = output
    kwargs.pop("logits_to_keep", None)
    is_moe = hasattr(self, "router_aux_loss_coef")
    if is_moe:
        router = kwargs.pop("output_router_logits", None)
        kwargs["output_router_logits"] = self.config.output_router_logits if router is None else router
    outputs = getattr(self, family.base)(**kwargs)
    loss = _causal_lm_loss(self, family, outputs.last_hidden_state, labels, kwargs)
    aux_loss = None
    if is_moe and kwargs["output_router_logits"]:
        balance = importlib.import_module(type(self).__module__).load_balancing_loss_func
        aux_loss = balance(outputs.router_logits, self.num_experts, self.num_experts_per_tok,
                           kwargs.get("attention_mask"))
        loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
    values = {name: getattr(outputs, name, None) for name in fields if name not in ("loss", "logits", "aux_loss")}
    if "aux_loss" in fields:
        values["aux_loss"] = aux_loss
    return output_cls(loss=loss, logits=None, **values)


def _causal_lm_forward(original: Callable, family: _Family) -> Callable:
    """Wrap the loss class's ``forward``: the fused loss path when labels are given and logits
    are not wanted (``return_logits``, default: only while training), else ``original``."""
    import inspect

    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    params = list(inspect.signature(original).parameters.values())[1:]
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    # (class, field names) of the output, resolved here: dataclass introspection does not compile.
    outputs = [(cls, tuple(f.name for f in dataclasses.fields(cls)))
               for cls in (_output_class(original), MoeCausalLMOutputWithPast, CausalLMOutputWithPast) if cls]

    @functools.wraps(original)
    def forward(self, *args, labels=None, return_logits: Optional[bool] = None, **kwargs):
        if return_logits is None:
            return_logits = not self.training
        if (labels is None or return_logits or len(args) > len(positional)
                or not _is_zero(kwargs.get("logits_to_keep", 0))
                or (family.logits == "scaled" and _scaled_logits_reason(self.config))):
            return original(self, *args, **kwargs) if labels is None else original(self, *args, labels=labels,
                                                                                   **kwargs)
        kwargs.update(zip(positional, args))
        return_dict = kwargs.pop("return_dict", None)
        output = outputs[0] if len(outputs) == 3 else outputs[0 if hasattr(self, "router_aux_loss_coef") else 1]
        out = _fused_loss_forward(self, family, output, labels, kwargs)
        return out if (self.config.return_dict if return_dict is None else return_dict) else out.to_tuple()

    forward._llmkernels_original = original
    return _mark(forward)


def _is_zero(logits_to_keep) -> bool:
    return isinstance(logits_to_keep, int) and logits_to_keep == 0


# --------------------------------------------------------------------------------------------
# patching
# --------------------------------------------------------------------------------------------
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


def _modeling_module(family: _Family):
    return importlib.import_module(f"transformers.models.{family.module}.modeling_{family.module}")


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


def _patch_rope(family: _Family, report: PatchReport) -> Optional[str]:
    """Patch the family's RoPE function; return why not (None: patched)."""
    if family.rope is None:
        return family.reasons.get("rope", f"model type {family.module!r} applies no RoPE of its own")
    module = _modeling_module(family)
    name, wrap = _ROPE_PATCHES[family.rope]
    if not hasattr(module, name):
        return f"{module.__name__} has no {name}"
    if not _is_patched(getattr(module, name)):
        _replace(module, name, wrap(getattr(module, name)))
    report.patched.append(f"{module.__name__}.{name} -> llmkernels.apply_rope (module-level: every model of this type)")
    return None


def _text_model_type(config) -> Optional[str]:
    model_type = getattr(config, "model_type", None)
    if model_type not in _FAMILIES and hasattr(config, "get_text_config"):
        text_type = getattr(config.get_text_config(), "model_type", None)
        if text_type in _FAMILIES:
            return text_type
    return model_type


def patch(model: nn.Module, *, rms_norm: bool = True, layer_norm: bool = True, rope: bool = True,
          cross_entropy: bool = True, mlp: bool = True) -> PatchReport:
    """Patch a Hugging Face transformers model in place to use the llmkernels kernels.

    Args:
        model: a transformers ``PreTrainedModel`` (any head). Norm and gated-MLP modules are
            recognised by class (the RMSNorm and MLP classes of the supported families,
            ``torch.nn.LayerNorm``) in any model, also one of an unsupported type; RoPE and the
            loss need a known type.
        rms_norm, layer_norm, rope, cross_entropy, mlp: switch each replacement off with False.

    Returns:
        A ``PatchReport``; ``print(report)`` lists what was and was not patched. For a model
        type this module does not know, the report is also issued as a warning.
    """
    config = getattr(model, "config", None)
    model_type = _text_model_type(config)
    family = _FAMILIES.get(model_type)
    report = PatchReport(model_type)
    counts: dict = {}
    unknown_norms: set = set()
    for module in model.modules():
        cls = type(module)
        name = cls.__name__
        if name in _NORM_CASTING and cls.__module__.startswith("transformers."):
            if not rms_norm:
                report.not_patched[name] = "rms_norm=False"
                continue
            casting = _NORM_CASTING[name]
            if not _is_patched(module.forward):
                module.forward = types.MethodType(_RMS_FORWARDS[casting], module)
            key = f"{name} -> llmkernels.rms_norm(casting={casting!r})"
        elif cls is nn.LayerNorm:
            if not layer_norm:
                report.not_patched["LayerNorm"] = "layer_norm=False"
                continue
            why = _layer_norm_supported(module)
            if why is not None:
                report.not_patched["LayerNorm"] = why
                continue
            if not _is_patched(module.forward):
                module.forward = types.MethodType(_layer_norm_forward, module)
            key = "torch.nn.LayerNorm -> llmkernels.layer_norm"
        elif name in _MLP_LAYOUT and cls.__module__.startswith("transformers."):
            if not mlp:
                report.not_patched[name] = "mlp=False"
                continue
            layout = _MLP_LAYOUT[name]
            why = _mlp_not_patchable(module, layout, instance=True)
            if why is not None:
                report.not_patched[name] = why
                continue
            attr, replacement, act_attr = _MLP_PATCHES[layout]
            if not _is_patched(getattr(module, attr)):
                setattr(module, attr, types.MethodType(replacement, module))
            op = "glu_linear" if type(getattr(module, "down_proj", None)) is nn.Linear else "glu"
            key = f"{name}.{attr} -> llmkernels.{op}(activation={_glu_activation(getattr(module, act_attr))!r})"
        else:
            if name.endswith(("RMSNorm", "LayerNorm", "GroupNorm")) and not _is_patched(module.forward):
                unknown_norms.add(name)
            continue
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
        not_causal_lm = _scaled_logits_reason(config)
    text_family = _FAMILIES.get(getattr(config.get_text_config(), "model_type", None))
    families = [family] + ([text_family] if text_family is not None and text_family.module != family.module else [])
    if mlp and not any(f.mlps for f in families):
        report.not_patched["mlp"] = f"model type {model_type!r} has no gated MLP"
    why = _patch_rope_and_loss_reason(families, report, rope, cross_entropy, not_causal_lm)
    if why:
        report.not_patched["loss"] = why
    else:
        if not _is_patched(model.forward):
            model.forward = types.MethodType(_causal_lm_forward(type(model).forward, family), model)
        report.patched.append(f"{type(model).__name__}.forward loss -> llmkernels.linear_cross_entropy")
    return report


def _patch_layer_norms_after_init(original: Callable) -> Callable:
    @functools.wraps(original)
    def post_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        for module in self.modules():
            if type(module) is nn.LayerNorm and _layer_norm_supported(module) is None:
                module.forward = types.MethodType(_layer_norm_forward, module)
    return _mark(post_init)


def patch_model_type(model_type: str = "llama", *, rms_norm: bool = True, layer_norm: bool = True,
                     rope: bool = True, cross_entropy: bool = True, mlp: bool = True) -> PatchReport:
    """Patch a model type's transformers classes so that models built afterwards use the kernels.

    Call before ``from_pretrained`` / ``from_config`` / the constructor. Replaces the family's
    RMSNorm ``forward``, its gated MLP's ``forward`` (experts: ``_apply_gate``; each model
    whose activation ``llmkernels.glu`` does not compute keeps transformers' product), its
    ``apply_rotary_pos_emb`` and its ``*ForCausalLM.forward`` (loss);
    for ``torch.nn.LayerNorm`` (GPT-NeoX), which is not the family's own class, the family's
    ``post_init`` patches each new model's LayerNorm modules. ``unpatch_all()`` undoes this.

    Args:
        model_type: a ``config.model_type``, one of ``supported_model_types()``.
    """
    if model_type not in _FAMILIES:
        raise ValueError(f"model_type must be one of {', '.join(supported_model_types())}; got {model_type!r}. "
                         "For another model, build it and call llmkernels.patch(model)")
    family = _FAMILIES[model_type]
    module = _modeling_module(family)
    report = PatchReport(model_type)
    for name, casting in family.norms.items():
        if not rms_norm:
            report.not_patched[name] = "rms_norm=False"
            continue
        cls = getattr(module, name)
        if not _is_patched(cls.forward):
            _replace(cls, "forward", _RMS_FORWARDS[casting])
        report.patched.append(f"{name}.forward -> llmkernels.rms_norm(casting={casting!r})")
    if family.layer_norm:
        if not layer_norm:
            report.not_patched["LayerNorm"] = "layer_norm=False"
        else:
            base = next(c for c in getattr(module, family.causal_lm).__mro__
                        if c.__module__ == module.__name__ and c.__name__.endswith("PreTrainedModel"))
            if not _is_patched(base.post_init):
                _replace(base, "post_init", _patch_layer_norms_after_init(base.post_init))
            report.patched.append(f"torch.nn.LayerNorm in {base.__name__} models -> llmkernels.layer_norm")
    for name, layout in family.mlps.items():
        cls = getattr(module, name, None)
        why = "mlp=False" if not mlp else (f"{module.__name__} has no {name}" if cls is None
                                            else _mlp_not_patchable(cls, layout, instance=False))
        if why is not None:
            report.not_patched[name] = why
            continue
        attr, replacement, _ = _MLP_PATCHES[layout]
        if not _is_patched(getattr(cls, attr)):
            _replace(cls, attr, replacement)
        report.patched.append(f"{name}.{attr} -> llmkernels.glu (models whose activation it computes)")
    if mlp and not family.mlps:
        report.not_patched["mlp"] = f"model type {model_type!r} has no gated MLP"
    why = _patch_rope_and_loss_reason([family], report, rope, cross_entropy, None)
    if why:
        report.not_patched["loss"] = why
    else:
        cls = getattr(module, family.causal_lm)
        if not _is_patched(cls.forward):
            _replace(cls, "forward", _causal_lm_forward(cls.forward, family))
        scaled = " (models whose logits_scaling is a power of two)" if family.logits == "scaled" else ""
        report.patched.append(f"{family.causal_lm}.forward loss -> llmkernels.linear_cross_entropy{scaled}")
    return report
