"""The fused-loss forward of ``*ForCausalLM`` (and of the multimodal ``*ForConditionalGeneration``
classes that run their base model and then ``lm_head``).

When labels are given and logits are not wanted, the loss comes from
``llmkernels.linear_cross_entropy`` on the final hidden states and the output embedding, without
materializing the ``[tokens, vocab]`` logits (label shift, ``ignore_index``, ``shift_labels``,
``num_items_in_batch``, Gemma 2/3 final-logit softcapping, Granite's ``logits_scaling`` when it
is a power of two, and the MoE router auxiliary loss as transformers computes them); the output
is the class transformers returns, without logits. Logits are wanted when ``return_logits=True``
is passed, or by default when the model is not training: then the original forward runs.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from typing import Callable, Optional

import torch
from torch import nn

from ..ops.losses.linear_cross_entropy import linear_cross_entropy
from ..ops.moe.router import moe_load_balancing_loss
from .families import Family
from .marks import mark


def scaled_logits_reason(config) -> Optional[str]:
    """Why Granite's ``logits / logits_scaling`` loss must stay transformers' (None: it need not):
    dividing the hidden states instead is exact only by a power of two."""
    scaling = getattr(config, "logits_scaling", 1.0)
    if scaling > 0 and math.frexp(scaling)[0] == 0.5:
        return None
    return (f"logits_scaling={scaling} is not a power of two: hidden / scaling would round differently from "
            "transformers' logits / scaling")


def _causal_lm_loss(self, family: Family, hidden: torch.Tensor, labels: torch.Tensor, kwargs: dict) -> torch.Tensor:
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
    loss = linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]), head.weight, shift_labels.reshape(-1).to(hidden.device),
        bias=head.bias, ignore_index=ignore_index, softcap=softcap,
        reduction="mean" if num_items is None else "sum")
    if num_items is not None:
        loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
    return loss


def _output_class(original: Callable):
    """The ``ModelOutput`` class that ``original`` (a ``forward``) is annotated to return, or None."""
    from transformers.utils import ModelOutput

    annotation = inspect.signature(original).return_annotation
    for cls in getattr(annotation, "__args__", (annotation,)):
        if isinstance(cls, type) and issubclass(cls, ModelOutput):
            return cls
    return None


def _fused_loss_forward(self, family: Family, output: tuple, labels, kwargs):
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
        # The families' load_balancing_loss_func, without the host synchronisations of its
        # bincount in transformers' older 5.x releases, which drain the GPU's queue every layer.
        aux_loss = moe_load_balancing_loss(outputs.router_logits, self.num_experts_per_tok,
                                           kwargs.get("attention_mask"))
        loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
    values = {name: getattr(outputs, name, None) for name in fields if name not in ("loss", "logits", "aux_loss")}
    if "aux_loss" in fields:
        values["aux_loss"] = aux_loss
    return output_cls(loss=loss, logits=None, **values)


def _is_zero(logits_to_keep) -> bool:
    return isinstance(logits_to_keep, int) and logits_to_keep == 0


def causal_lm_forward(original: Callable, family: Family) -> Callable:
    """Wrap the loss class's ``forward``: the fused loss path when labels are given and logits
    are not wanted (``return_logits``, default: only while training), else ``original``."""
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
                or (family.logits == "scaled" and scaled_logits_reason(self.config))):
            return original(self, *args, **kwargs) if labels is None else original(self, *args, labels=labels,
                                                                                   **kwargs)
        kwargs.update(zip(positional, args))
        return_dict = kwargs.pop("return_dict", None)
        output = outputs[0] if len(outputs) == 3 else outputs[0 if hasattr(self, "router_aux_loss_coef") else 1]
        out = _fused_loss_forward(self, family, output, labels, kwargs)
        return out if (self.config.return_dict if return_dict is None else return_dict) else out.to_tuple()

    forward._llmkernels_original = original
    return mark(forward)
