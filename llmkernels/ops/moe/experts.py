"""The routed experts as grouped GEMMs: launchers, their registration (eager autograd and the
torch.compile custom ops ``llmkernels::moe_experts_fwd`` / ``_bwd``), and ``moe_experts``.

Forward, for ``S = T * k`` slots sorted by expert (``routing.sort_slots``):
  1. ``gate_up_kernel``: ``gate, up = x[token] @ gate_up_proj[e]^T`` with the tokens gathered on
     load (no ``[S, H]`` copy of x), the gated activation in the epilogue: ``h [S, I]``; the
     rounded ``gate, up [S, 2I]`` are kept for the backward.
  2. ``grouped_mm_kernel``: ``y = h @ down_proj[e]^T``, stored at each slot's own row ``t * k + j``.
  3. ``combine_kernel``: ``out[t] = sum_j w[t, j] y[t * k + j]`` in fp32, in a fixed order.
Backward, from ``dy [T, H]``:
  1. ``down_bwd_kernel``: ``g = dy[token] @ down_proj[e]`` (gathered on load); from the kept
     ``gate, up``: ``d(gate, up)`` of ``w * g``, ``h`` recomputed, and ``<g, h>`` by column tile,
     the routing weight's gradient (``<dy, y>``, without keeping y).
  2. ``weight_grad_kernel``: ``d down_proj[e] = sum_rows (w dy[token])^T h``.
  3. ``grouped_mm_kernel`` then ``combine_kernel``: ``dx = sum_j d(gate, up) @ gate_up_proj[e]``.
  4. ``weight_grad_kernel``: ``d gate_up_proj[e] = sum_rows d(gate, up)^T x[token]``.
Each weight gradient is one program's sum over its expert's rows in token order: bitwise
deterministic. Memory: the call keeps ``x`` and the ``[S, 2I]`` gate/up values; the ``[S, I]``
and ``[S, H]`` buffers live within the forward or the backward only.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .._launch import as_rows, cdiv, launcher
from . import kernels
from .configs import GemmTiles, MoeConfig, moe_config
from .routing import sort_slots, tile_table

ACTIVATIONS = ("silu", "clamped_swiglu")


class ExpertsOptions(NamedTuple):
    """The options of an experts call, named once (the custom ops' schemas are made of them):
    the gated activation, gpt-oss's ``alpha`` and ``limit`` (clamped_swiglu), and whether the
    gate and up columns of ``2I`` are interleaved (gpt-oss) or concatenated."""

    activation: str
    interleaved: bool
    alpha: float
    limit: float


class ExpertsGrads(NamedTuple):
    """What a backward computes: the call's options and which gradients are needed."""

    options: ExpertsOptions
    x: bool
    weights: bool
    gate_up: bool
    down: bool
    gate_up_bias: bool
    down_bias: bool


def _empty(like: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A ``[rows, cols]`` buffer of ``like``'s dtype and device (``torch.empty``, which the tests
    poison with NaN)."""
    return torch.empty((rows, cols), device=like.device, dtype=like.dtype)


def _precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s precision: IEEE for fp32 inputs (TF32 would lose their digits)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _pairing(options: ExpertsOptions, inter: int) -> tuple:
    """``(PAIR, up_offset)`` of the gate/up columns (kernels.py)."""
    return (2, 1) if options.interleaved else (1, inter)


def _launch_rows(kernel, tiles: GemmTiles, routing, rows: int, n: int, args: tuple, **constexprs) -> None:
    """``kernel`` over the row tiles of ``routing`` (``tiles.block_m`` rows) and ``n`` columns."""
    tile_e, tile_s = tile_table(routing[1], rows, tiles.block_m)
    grid = (tile_e.numel() * cdiv(n, tiles.block_n),)
    handle = launcher(kernel, **constexprs, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                      num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    handle(grid, args[0], routing[0], tile_e, tile_s, routing[1], *args[1:])


def _combine(ys: torch.Tensor, index: torch.Tensor, weights: Optional[torch.Tensor], n_experts: int,
             config: MoeConfig, out_dtype: torch.dtype) -> torch.Tensor:
    """``out [T, N]``: the (weighted) sum of each token's k slot rows of ``ys [S, N]``."""
    t, k = index.shape
    n = ys.shape[1]
    out = torch.empty((t, n), device=ys.device, dtype=out_dtype)
    tiles = config.combine
    w = index if weights is None else weights
    handle = launcher(kernels.combine_kernel, TOP_K=k, WEIGHTED=weights is not None, BLOCK_T=tiles.block_t,
                      BLOCK_N=tiles.block_n, num_warps=tiles.num_warps)
    handle((cdiv(t, tiles.block_t) * cdiv(n, tiles.block_n),), ys, index, w, out, t, n, n_experts, index.stride(0),
           index.stride(1), w.stride(0), w.stride(1), out.stride(0))
    return out


def _weight_grad(a, b, routing, scale, out_like, bias_like, *, k, gather_a, gather_b, config: MoeConfig):
    """``(dW, d_bias)``: ``dW[e] = sum over expert e's rows of a_r^T b_r`` (``weight_grad_kernel``)
    in ``out_like``'s layout, and the column sums of ``a`` when ``bias_like`` is given."""
    n_experts, m, n = out_like.shape
    dw = torch.empty_like(out_like)
    db = None if bias_like is None else torch.empty_like(bias_like)
    tiles = config.weight_grad
    handle = launcher(kernels.weight_grad_kernel, TOP_K=k, GATHER_A=gather_a, GATHER_B=gather_b,
                      HAS_SCALE=scale is not None, HAS_DB=db is not None, BLOCK_M=tiles.block_m,
                      BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, PRECISION=_precision(a.dtype),
                      num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    handle((n_experts * cdiv(m, tiles.block_m) * cdiv(n, tiles.block_n),), a, b, routing[0], routing[1],
           a if scale is None else scale, dw, dw if db is None else db, m, n, a.stride(0), b.stride(0), dw.stride(0),
           dw.stride(1), dw.stride(2), 0 if db is None else db.stride(0))
    return dw, db


# --------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------
def _forward(x, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias,
             options: ExpertsOptions, store_gu: bool, config: Optional[MoeConfig]):
    t, hidden = x.shape
    k = top_k_index.shape[1]
    n_experts, inter = down_proj.shape[0], down_proj.shape[2]
    rows = t * k
    config = config or moe_config(rows, n_experts, hidden, inter, x.device)
    routing = sort_slots(top_k_index, n_experts)
    gu = _empty(x, rows, 2 * inter) if store_gu else None
    hs = _empty(x, rows, inter)
    pair, up_offset = _pairing(options, inter)
    precision = _precision(x.dtype)
    _launch_rows(kernels.gate_up_kernel, config.gate_up, routing, rows, inter,
                 (x, gate_up_proj, hs if gate_up_bias is None else gate_up_bias, hs if gu is None else gu, hs,
                  n_experts, hidden, inter, x.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(2),
                  gate_up_proj.stride(1), 0 if gate_up_bias is None else gate_up_bias.stride(0), up_offset,
                  options.alpha, options.limit),
                 PAIR=pair, TOP_K=k, ACTIVATION=options.activation, HAS_BIAS=gate_up_bias is not None,
                 STORE_GU=store_gu, PRECISION=precision)
    ys = _empty(x, rows, hidden)
    _launch_rows(kernels.grouped_mm_kernel, config.down, routing, rows, hidden,
                 (hs, down_proj, ys if down_bias is None else down_bias, ys, n_experts, inter, hidden, hs.stride(0),
                  down_proj.stride(0), down_proj.stride(2), down_proj.stride(1),
                  0 if down_bias is None else down_bias.stride(0), ys.stride(0)),
                 TOP_K=k, GATHER_A=False, SCATTER_C=True, HAS_BIAS=down_bias is not None, PRECISION=precision)
    del hs
    out = _combine(ys, top_k_index, top_k_weights, n_experts, config, x.dtype)
    return out, gu, routing.order, routing.offsets


def experts_fwd(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up_proj: torch.Tensor,
                down_proj: torch.Tensor, gate_up_bias: Optional[torch.Tensor], down_bias: Optional[torch.Tensor],
                options: ExpertsOptions, *, config: Optional[MoeConfig] = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out [T, H], gate/up [S, 2I], order [S], offsets [E + 1])`` of ``x [T, H]`` (unit
    stride along H) routed by ``top_k_index``, ``top_k_weights [T, k]`` through
    ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` (logical orientation, any strides)."""
    return _forward(x, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, options,
                    True, config)


def experts_infer(x, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias,
                  options: ExpertsOptions, *, config: Optional[MoeConfig] = None):
    """``experts_fwd`` of a call that needs no gradient: the gate/up values are not kept."""
    return _forward(x, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, options,
                    False, config)


def experts_bwd(dy: torch.Tensor, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up_proj: torch.Tensor, down_proj: torch.Tensor, down_bias: Optional[torch.Tensor],
                gu: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, grads: ExpertsGrads, *,
                config: Optional[MoeConfig] = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, d_weights, d_gate_up_proj, d_down_proj, d_gate_up_bias, d_down_bias)`` from
    ``dy [T, H]``, None where ``grads`` does not ask for one."""
    options = grads.options
    t, hidden = x.shape
    k = top_k_index.shape[1]
    n_experts, inter = down_proj.shape[0], down_proj.shape[2]
    rows = t * k
    config = config or moe_config(rows, n_experts, hidden, inter, x.device)
    routing = (order, offsets)
    dy = as_rows(dy, hidden)
    weights = top_k_weights.contiguous().view(-1)
    pair, up_offset = _pairing(options, inter)
    tiles = config.down_bwd
    dgu = torch.empty_like(gu)
    hs = _empty(x, rows, inter) if grads.down or grads.down_bias else None
    partial = (torch.zeros((rows, cdiv(inter, tiles.block_n)), device=x.device, dtype=torch.float32)
               if grads.weights else None)
    _launch_rows(kernels.down_bwd_kernel, tiles, routing, rows, inter,
                 (dy, down_proj, gu, weights, dgu, dgu if hs is None else hs, dgu if partial is None else partial,
                  n_experts, hidden, inter, dy.stride(0), down_proj.stride(0), down_proj.stride(1),
                  down_proj.stride(2), 0 if partial is None else partial.stride(0), up_offset, options.alpha,
                  options.limit),
                 PAIR=pair, TOP_K=k, ACTIVATION=options.activation, STORE_H=hs is not None,
                 STORE_P=partial is not None, PRECISION=_precision(x.dtype))
    d_weights = None
    if grads.weights:
        d_weights = partial.sum(1).view(t, k)
        if down_bias is not None:  # <dy, y> has the bias's part too: <dy[t], down_bias[e]>
            valid = (top_k_index >= 0) & (top_k_index < n_experts)
            by_expert = dy.float() @ down_bias.float().T
            d_weights = d_weights + torch.where(valid, by_expert.gather(1, top_k_index.long().clamp(0, n_experts - 1)),
                                                0.0)
        d_weights = d_weights.to(top_k_weights.dtype)
    d_down = d_down_bias = None
    if grads.down or grads.down_bias:
        d_down, d_down_bias = _weight_grad(dy, hs, routing, weights, down_proj,
                                           down_bias if grads.down_bias else None, k=k, gather_a=True,
                                           gather_b=False, config=config)
        d_down = d_down if grads.down else None
    del hs
    dx = None
    if grads.x:
        dxs = _empty(x, rows, hidden)
        _launch_rows(kernels.grouped_mm_kernel, config.down, routing, rows, hidden,
                     (dgu, gate_up_proj, dxs, dxs, n_experts, 2 * inter, hidden, dgu.stride(0),
                      gate_up_proj.stride(0), gate_up_proj.stride(1), gate_up_proj.stride(2), 0, dxs.stride(0)),
                     TOP_K=k, GATHER_A=False, SCATTER_C=True, HAS_BIAS=False, PRECISION=_precision(x.dtype))
        dx = _combine(dxs, top_k_index, None, n_experts, config, x.dtype)
        del dxs
    d_gate_up = d_gate_up_bias = None
    if grads.gate_up or grads.gate_up_bias:
        bias_like = _empty(x, n_experts, 2 * inter) if grads.gate_up_bias else None
        d_gate_up, d_gate_up_bias = _weight_grad(dgu, x, routing, None, gate_up_proj, bias_like, k=k, gather_a=False,
                                                 gather_b=True, config=config)
        d_gate_up = d_gate_up if grads.gate_up else None
    return dx, d_weights, d_gate_up, d_down, d_gate_up_bias, d_down_bias
