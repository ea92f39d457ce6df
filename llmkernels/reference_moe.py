"""Plain-PyTorch definition of the Mixture-of-Experts layer: the spec of ``llmkernels.ops.moe``.

The router (scores, top-k, the routing weights), its auxiliary losses, and the routed experts
computed expert by expert as Hugging Face's eager loop does. Tests run it in float64 against the
kernels; the public functions fall back to it (in float32) where no kernel can run.

Conventions (those of transformers 5.x):
  - ``x [T, H]``; ``top_k_index [T, k]`` (expert ids; an id outside ``[0, E)`` is a dropped slot,
    as expert parallelism marks tokens of other ranks) and ``top_k_weights [T, k]``.
  - Expert weights in the logical orientation ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``
    (``F.linear(x, w[e])``); ``transposed=True`` takes gpt-oss's ``[E, H, 2I]`` and ``[E, I, H]``.
  - The gate and up halves of ``2I``: concatenated (gate ``[0, I)``, up ``[I, 2I)``) or
    ``interleaved`` (gate at even columns, up at odd, gpt-oss).
  - Activations: ``silu`` / ``gelu_tanh`` / ``gelu`` (``act(gate)`` rounded to the input dtype,
    times up, as the eager MLPs compute it) and gpt-oss's ``clamped_swiglu``
    (``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``).
  - LoRA on an expert projection ``w [E, N, K]`` (logical): ``A [E, r, K]``, ``B [E, N, r]``, the
    projection ``x w[e]^T + (scale * x A[e]^T) B[e]^T``, the adapters read in the model's dtype
    and the rank-r rows ``scale * x A[e]^T`` rounded to it.

Nothing here imports llmkernels.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "gelu_tanh", "gelu", "clamped_swiglu")
SCORINGS = ("softmax", "topk_softmax", "sigmoid")


# --------------------------------------------------------------------------------------------
# router
# --------------------------------------------------------------------------------------------
def topk_lowest_index(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest scores of each row, largest first; among equal scores the lower expert
    index first (a stable descending sort), so ties are broken the same way on every device."""
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def route(logits: torch.Tensor, top_k: int, *, scoring: str = "softmax", renormalize: bool = True,
          n_group: int = 1, topk_group: int = 1, scaling: float = 1.0,
          correction_bias: Optional[torch.Tensor] = None, compute_dtype=torch.float32
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(top_k_weights, top_k_index)`` of router ``logits [T, E]``, in ``compute_dtype``.

    scoring:
      - ``softmax``: softmax over the experts, the top-k probabilities, renormalized to sum 1 when
        ``renormalize`` (Mixtral, Qwen 3 MoE, Qwen 2 MoE and OLMoE with ``norm_topk_prob``);
      - ``topk_softmax``: the top-k logits, then a softmax over them (gpt-oss);
      - ``sigmoid``: DeepSeek-V3: sigmoid scores; experts chosen by score + ``correction_bias``
        within the ``topk_group`` best of ``n_group`` groups (a group's score: the sum of its two
        best); weights are the chosen sigmoid scores, renormalized (+1e-20) when ``renormalize``,
        times ``scaling``.
    """
    z = logits.to(compute_dtype)
    if scoring == "softmax":
        weights, index = topk_lowest_index(torch.softmax(z, dim=-1), top_k)
        if renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, index
    if scoring == "topk_softmax":
        values, index = topk_lowest_index(z, top_k)
        return torch.softmax(values, dim=-1), index
    if scoring != "sigmoid":
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    scores = torch.sigmoid(z)
    choice = scores if correction_bias is None else scores + correction_bias.to(compute_dtype)
    t, e = choice.shape
    group_scores = topk_lowest_index(choice.view(t, n_group, e // n_group), 2)[0].sum(-1)
    groups = topk_lowest_index(group_scores, topk_group)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    keep = keep[:, :, None].expand(t, n_group, e // n_group).reshape(t, e)
    index = topk_lowest_index(choice.masked_fill(~keep, float("-inf")), top_k)[1]
    weights = scores.gather(1, index)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, index


def load_balancing_loss(router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int,
                        attention_mask: Optional[torch.Tensor] = None, compute_dtype=torch.float32) -> torch.Tensor:
    """Switch Transformer's auxiliary loss as transformers' MoE families compute it over the
    layers' ``router_logits [T, E]`` (T = batch * sequence): ``E * sum_e f_e P_e``, ``f_e`` the
    share of top-k assignments to expert e (over the layers' tokens, not divided by k) and
    ``P_e`` its mean softmax probability; ``attention_mask [batch, sequence]`` (1: a token)
    leaves padding out of both."""
    counts = torch.zeros(num_experts, dtype=compute_dtype, device=router_logits[0].device)
    prob_sum = torch.zeros_like(counts)
    rows = torch.zeros((), dtype=compute_dtype, device=counts.device)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(compute_dtype)
    for logits in router_logits:
        probs = torch.softmax(logits.to(compute_dtype), dim=-1)
        chosen = torch.zeros_like(probs).scatter_(1, topk_lowest_index(probs, top_k)[1], 1.0)  # [T, E] of 0/1
        if mask is None:
            counts, prob_sum, rows = counts + chosen.sum(0), prob_sum + probs.sum(0), rows + probs.shape[0]
        else:
            counts = counts + (chosen * mask[:, None]).sum(0)
            prob_sum, rows = prob_sum + (probs * mask[:, None]).sum(0), rows + mask.sum()
    return num_experts * torch.sum((counts / rows) * (prob_sum / rows))


def router_z_loss(router_logits: torch.Tensor, compute_dtype=torch.float32) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean over tokens of ``logsumexp(logits)^2`` (``[..., E]``)."""
    return torch.logsumexp(router_logits.to(compute_dtype), dim=-1).pow(2).mean()


# --------------------------------------------------------------------------------------------
# experts
# --------------------------------------------------------------------------------------------
class Lora(NamedTuple):
    """Rank-r adapters of the experts' projections (logical orientation, see the module notes):
    ``gate_up = (A [E, r, H], B [E, 2I, r])``, ``down = (A [E, r, I], B [E, H, r])``, either
    None, and ``scale`` (PEFT's ``lora_alpha / r``)."""

    gate_up: Optional[tuple]
    down: Optional[tuple]
    scale: float


def rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` rounded to ``dtype`` (to nearest), in t's dtype."""
    return t.to(dtype).to(t.dtype)


def gated(gate: torch.Tensor, up: torch.Tensor, activation: str, alpha: float = 1.702, limit: float = 7.0,
          out_dtype=None) -> torch.Tensor:
    """The expert's gated activation of ``gate, up`` (values in the model's dtype, arithmetic in
    theirs), rounded to ``out_dtype`` where the eager MLP rounds: ``act(gate)`` and the product
    (the value returned in the arithmetic's dtype)."""
    out_dtype = out_dtype or gate.dtype
    if activation == "clamped_swiglu":
        g = gate.clamp(max=limit)
        return rounded((up.clamp(-limit, limit) + 1) * (g * torch.sigmoid(alpha * g)), out_dtype)
    act = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"), "gelu": F.gelu}[activation]
    return rounded(rounded(act(gate), out_dtype) * up, out_dtype)


def _logical(w: torch.Tensor, transposed: bool) -> torch.Tensor:
    return w.transpose(-1, -2) if transposed else w


def _project(x, w, lora, e, scale, dtype):
    """``x w[e]^T`` (+ the adapter's part), x and w in the compute dtype, ``dtype`` the model's."""
    out = x @ w[e].T
    if lora is not None:
        a, b = (rounded(t[e].to(x.dtype), dtype) for t in lora)
        out = out + rounded(scale * (x @ a.T), dtype) @ b.T
    return out


def experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up_proj: torch.Tensor,
            down_proj: torch.Tensor, gate_up_bias: Optional[torch.Tensor] = None,
            down_bias: Optional[torch.Tensor] = None, *, activation: str = "silu", interleaved: bool = False,
            transposed: bool = False, alpha: float = 1.702, limit: float = 7.0, lora: Optional[Lora] = None,
            compute_dtype=torch.float32, model_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The routed experts' output ``[T, H]`` in x's dtype: for each expert e and each slot (t, j)
    routed to it, ``y = down_e(act(gate_up_e(x[t])))``, rounded to the model's dtype, and
    ``out[t] = sum_j top_k_weights[t, j] * y`` (the sum in ``compute_dtype``, rounded once).
    ``model_dtype``: the dtype the values are rounded to on the way (default x's; the model's
    where x is an upcast copy)."""
    dtype, c = model_dtype or x.dtype, compute_dtype
    wgu, wd = _logical(gate_up_proj, transposed).to(c), _logical(down_proj, transposed).to(c)
    inter = wd.shape[-1]
    xc = x.to(c)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=c, device=x.device)
    for e in range(wgu.shape[0]):
        token, slot = torch.nonzero(top_k_index == e, as_tuple=True)
        if token.numel() == 0:
            continue
        scale = None if lora is None else lora.scale
        gu = _project(xc[token], wgu, None if lora is None else lora.gate_up, e, scale, dtype)
        if gate_up_bias is not None:
            gu = gu + gate_up_bias[e].to(c)
        gu = rounded(gu, dtype)  # the projection's output in the model's dtype
        gate, up = (gu[:, 0::2], gu[:, 1::2]) if interleaved else (gu[:, :inter], gu[:, inter:])
        h = gated(gate, up, activation, alpha, limit, out_dtype=dtype)
        y = _project(h, wd, None if lora is None else lora.down, e, scale, dtype)
        if down_bias is not None:
            y = y + down_bias[e].to(c)
        out.index_put_((token,), rounded(y, dtype) * top_k_weights[token, slot, None].to(c),
                       accumulate=True)
    return rounded(out, dtype).to(x.dtype)

