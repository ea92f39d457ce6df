"""The router: scores, the top-k experts of each token and their weights, and the auxiliary
losses. ``[T, E]`` elementwise work beside the experts' GEMMs, so it is plain PyTorch (autograd
differentiates it), in float32 as transformers computes it, with one tie-break on every device:
among equal scores the lower expert index wins (``torch.topk`` leaves that order unspecified)."""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from ... import reference_moe
from .._args import check_tensor

SCORINGS = reference_moe.SCORINGS


class RouterOptions(NamedTuple):
    """How a family routes (``reference_moe.route`` defines each field); ``weights_dtype`` is
    the dtype of the returned weights (Qwen and gpt-oss cast them to the logits' dtype, Mixtral
    and DeepSeek-V3 keep float32; None: float32)."""

    top_k: int
    scoring: str = "softmax"
    renormalize: bool = True
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0
    weights_dtype: Optional[torch.dtype] = None


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def check_router_options(options: RouterOptions, num_experts: int) -> None:
    """ValueError / TypeError naming the field of ``options`` that ``num_experts`` experts
    cannot route with."""
    if not isinstance(options, RouterOptions):
        raise TypeError(f"router must be a RouterOptions, got {type(options).__name__}")
    if _positive_int("router.top_k", options.top_k) > num_experts:
        raise ValueError(f"router.top_k = {options.top_k} exceeds the {num_experts} experts")
    if options.scoring not in SCORINGS:
        raise ValueError(f"router.scoring must be one of {SCORINGS}, got {options.scoring!r}")
    n_group, topk_group = _positive_int("router.n_group", options.n_group), _positive_int(
        "router.topk_group", options.topk_group)
    if num_experts % n_group or topk_group > n_group:
        raise ValueError(f"router.n_group = {n_group} must divide the {num_experts} experts and "
                         f"router.topk_group = {topk_group} must not exceed it")
    if options.top_k > topk_group * (num_experts // n_group):
        raise ValueError(f"router.top_k = {options.top_k} exceeds the experts of router.topk_group = {topk_group} "
                         f"groups of {num_experts // n_group}")
    if options.scoring == "sigmoid" and num_experts // n_group < 2:
        raise ValueError("sigmoid scoring ranks a group by its two best experts: groups need at least 2")
    if options.weights_dtype is not None and not (isinstance(options.weights_dtype, torch.dtype)
                                                  and options.weights_dtype.is_floating_point):
        raise TypeError(f"router.weights_dtype must be None or a floating-point dtype, got {options.weights_dtype!r}")


def moe_route(logits: torch.Tensor, options: RouterOptions,
              correction_bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(top_k_weights [T, k], top_k_index [T, k] int64)`` of router ``logits [T, E]`` (any
    float dtype; the arithmetic in float32, float64 for float64 logits).

    ``options`` (a :class:`RouterOptions`) selects the family's scoring: ``softmax`` (Mixtral,
    Qwen 2/3 MoE, OLMoE; ``renormalize`` as ``norm_topk_prob``), ``topk_softmax`` (gpt-oss: the
    logits, with the router's bias, are the scores) or ``sigmoid`` (DeepSeek-V3, with
    ``correction_bias [E]``, its ``e_score_correction_bias``, grouped top-k and ``scaling``,
    its ``routed_scaling_factor``). The weights are differentiable in ``logits``; ties go to
    the lower expert index.
    """
    check_tensor("logits", logits)
    if logits.dim() != 2:
        raise ValueError(f"logits must be [tokens, experts], got shape {list(logits.shape)}")
    check_router_options(options, logits.shape[1])
    if correction_bias is not None:
        check_tensor("correction_bias", correction_bias, like=logits, like_name="logits")
        if correction_bias.shape != (logits.shape[1],):
            raise ValueError(f"correction_bias must have shape [{logits.shape[1]}], got {list(correction_bias.shape)}")
        if options.scoring != "sigmoid":
            raise ValueError("correction_bias is DeepSeek-V3's: it needs router.scoring='sigmoid'")
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    weights, index = reference_moe.route(logits, options.top_k, scoring=options.scoring,
                                         renormalize=options.renormalize, n_group=options.n_group,
                                         topk_group=options.topk_group, scaling=options.scaling,
                                         correction_bias=correction_bias, compute_dtype=compute)
    return weights.to(options.weights_dtype or compute), index


def _logits_list(router_logits) -> list:
    layers = [router_logits] if isinstance(router_logits, torch.Tensor) else list(router_logits)
    if not layers:
        raise ValueError("router_logits must be a tensor or a non-empty sequence of tensors")
    for i, logits in enumerate(layers):
        check_tensor(f"router_logits[{i}]", logits, like=layers[0], like_name="router_logits[0]")
        if logits.dim() != 2 or logits.shape[1] != layers[0].shape[1]:
            raise ValueError(f"router_logits[{i}] must be [tokens, experts] as router_logits[0] "
                             f"{list(layers[0].shape)}, got {list(logits.shape)}")
    return layers


def moe_load_balancing_loss(router_logits, top_k: int, attention_mask: Optional[torch.Tensor] = None
                            ) -> torch.Tensor:
    """Switch Transformer's load-balancing loss as Mixtral, Qwen 2/3 MoE, OLMoE and gpt-oss
    compute it (their ``load_balancing_loss_func``), over one layer's ``router_logits [T, E]``
    or a sequence of layers' (``attention_mask [batch, sequence]`` of ``T = batch * sequence``
    leaves padding out). A float32 scalar (float64 for float64 logits), differentiable in the
    logits; multiply it by ``router_aux_loss_coef``."""
    layers: Sequence[torch.Tensor] = _logits_list(router_logits)
    num_experts = layers[0].shape[1]
    if _positive_int("top_k", top_k) > num_experts:
        raise ValueError(f"top_k = {top_k} exceeds the {num_experts} experts")
    if attention_mask is not None:
        check_tensor("attention_mask", attention_mask, like=layers[0], like_name="router_logits", floating=False)
        if attention_mask.numel() != layers[0].shape[0]:
            raise ValueError(f"attention_mask has {attention_mask.numel()} tokens, router_logits "
                             f"{layers[0].shape[0]}")
    compute = torch.float64 if layers[0].dtype == torch.float64 else torch.float32
    return reference_moe.load_balancing_loss(layers, num_experts, top_k, attention_mask, compute_dtype=compute)


def moe_router_z_loss(router_logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss, ``mean(logsumexp(logits)^2)`` over the tokens of
    ``router_logits [..., E]``, in float32 (float64 for float64 logits); differentiable."""
    check_tensor("router_logits", router_logits)
    if router_logits.dim() == 0 or router_logits.numel() == 0:
        raise ValueError(f"router_logits must be [..., experts] with tokens, got shape {list(router_logits.shape)}")
    compute = torch.float64 if router_logits.dtype == torch.float64 else torch.float32
    return reference_moe.router_z_loss(router_logits, compute_dtype=compute)
