"""The routed experts as grouped GEMMs: the launchers of ``moe_experts``'s forward and backward.

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
deterministic. ``MoeConfig.weight_grad_backend`` may send steps 2 and 4 (the expert weights',
not the adapters') to torch's grouped GEMM instead (``wgrad.py``, which adds one ``[S, H]``
buffer of rows in expert order). Memory: the call keeps ``x`` and the ``[S, 2I]`` gate/up
values; the ``[S, I]`` and ``[S, H]`` buffers live within the forward or the backward only.

LoRA (rank r, ``A [E, r, K]``, ``B [E, N, r]`` on a projection ``W [E, N, K]``, scale s) runs in
the same kernels: a grouped GEMM forms the rows' ``s x A^T [S, r]`` (kept: r columns), and the
projection's kernel adds ``(s x A^T) @ B^T`` as a second K loop into its accumulators. The
backward forms ``s dy B [S, r]`` the same way, adds ``(s dy B) @ A`` into the input gradient's
kernel, and sums ``dB``, ``dA`` per expert like the weights.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional

import torch

from .._args import as_rows, cdiv, next_pow2
from .._launch import launcher_of
from . import kernels, wgrad
from .configs import GemmTiles, MoeConfig, moe_config
from .routing import sort_slots, tile_table

ACTIVATIONS = ("silu", "clamped_swiglu")


class ExpertsOptions(NamedTuple):
    """The options of an experts call, named once (the custom ops' schemas are made of them):
    the gated activation, gpt-oss's ``alpha`` and ``limit`` (clamped_swiglu), whether the gate
    and up columns of ``2I`` are interleaved (gpt-oss) or concatenated, and the LoRA scale
    (``lora_alpha / r``; unused without adapters)."""

    activation: str
    interleaved: bool
    alpha: float
    limit: float
    lora_scale: float


class ExpertsGrads(NamedTuple):
    """What a backward computes: the call's options and which gradients are needed (in the
    order of the call's differentiable tensors; named apart from the tensors, as the custom
    op's schema lists both)."""

    options: ExpertsOptions
    need_x: bool
    need_weights: bool
    need_gate_up: bool
    need_down: bool
    need_gate_up_bias: bool
    need_down_bias: bool
    need_gate_up_lora_a: bool
    need_gate_up_lora_b: bool
    need_down_lora_a: bool
    need_down_lora_b: bool


def _empty(like: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A ``[rows, cols]`` buffer of ``like``'s dtype and device (``torch.empty``, which the tests
    poison with NaN)."""
    return torch.empty((rows, cols), device=like.device, dtype=like.dtype)


def _precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s precision: IEEE for fp32 inputs (TF32 would lose their digits)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _operand(w: torch.Tensor, k_dim: int) -> tuple:
    """``(w, stride_e, stride_k, stride_n)``: ``w [E, d1, d2]`` read as a kernel's ``B[e][kk, n]``,
    ``kk`` along dim ``k_dim`` (2: ``x @ w[e]^T``; 1: ``x @ w[e]``)."""
    strides = w.stride()  # (once: each Tensor.stride(i) is a call into torch)
    return w, strides[0], strides[k_dim], strides[3 - k_dim]


def _rank_block(r: int) -> int:
    return max(16, next_pow2(r))


@functools.lru_cache(maxsize=256)
def _narrow(tiles: GemmTiles, r: int) -> GemmTiles:
    """``tiles`` with column tiles of a LoRA rank ``r``'s width."""
    return dataclasses.replace(tiles, block_n=_rank_block(r))


def _lora_args(rows_lora: Optional[torch.Tensor], b: Optional[tuple], stand_in: torch.Tensor) -> tuple:
    """The kernels' LoRA arguments: ``(LA, LB)`` pointers and ``(R, stride_la, stride_lbe,
    stride_lbk, stride_lbn)``; stand-ins without an adapter."""
    if rows_lora is None:
        return (stand_in, stand_in), (0, 0, 0, 0, 0)
    return (rows_lora, b[0]), (rows_lora.shape[1], rows_lora.stride(0), *b[1:])


class Launch(NamedTuple):
    """What the row-tiled launches of one call share; ``tables``: the tile tables made so far,
    by ``block_m`` (the routing's own, then any other ``block_m`` a configuration asks for, each
    made once a call)."""

    routing: tuple  # (order, offsets)
    rows: int
    top_k: int
    n_experts: int
    config: MoeConfig
    precision: str
    tables: dict


def _row_grid(kernel, tiles: GemmTiles, launch: Launch, n: int, args: tuple, **constexprs) -> None:
    """``kernel`` over the row tiles of ``launch`` (``tiles.block_m`` rows) and ``n`` columns."""
    order, offsets = launch.routing
    table = launch.tables.get(tiles.block_m)
    if table is None:
        table = launch.tables[tiles.block_m] = tile_table(offsets, launch.rows, tiles.block_m)
    handle = launcher_of(kernel, **constexprs, TOP_K=launch.top_k, BLOCK_M=tiles.block_m, GROUP_M=tiles.group_m,
                      BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, PRECISION=launch.precision,
                      num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    handle((table.numel() // 2 * cdiv(n, tiles.block_n),), args[0], order, table, offsets, *args[1:])


def _grouped_mm(launch: Launch, a, w: tuple, n: int, k: int, *, gather=False, scatter=False, bias=None,
                lora_rows=None, lora_b=None, scale=1.0, narrow=False) -> torch.Tensor:
    """``C [S, n] = scale * a[row or token] @ B[e]`` (+ ``lora_rows @ lora_b[e]``, + bias),
    rows in sorted order or, ``scatter``, at their slots; ``w`` an ``_operand``. ``narrow``: n
    is a LoRA rank (column tiles of its size)."""
    tiles = _narrow(launch.config.down, n) if narrow else launch.config.down
    c = torch.empty((launch.rows, n), device=a.device, dtype=a.dtype)
    (la, lb), lora = _lora_args(lora_rows, lora_b, a)
    _row_grid(kernels.grouped_mm_kernel, tiles, launch, n,
              (a, w[0], c if bias is None else bias, la, lb, c, launch.n_experts, k, n, lora[0], a.stride(0), *w[1:],
               0 if bias is None else bias.stride(0), *lora[1:], n, float(scale)),
              GATHER_A=gather, SCATTER_C=scatter, HAS_BIAS=bias is not None, HAS_LORA=lora_rows is not None,
              BLOCK_R=_rank_block(lora[0]))
    return c


def _combine(ys: torch.Tensor, index: torch.Tensor, weights: Optional[torch.Tensor], launch: Launch,
             out_dtype: torch.dtype) -> torch.Tensor:
    """``out [T, N]``: the (weighted) sum of each token's k slot rows of ``ys [S, N]``."""
    t, n = index.shape[0], ys.shape[1]
    out = torch.empty((t, n), device=ys.device, dtype=out_dtype)
    tiles = launch.config.combine
    w = index if weights is None else weights
    handle = launcher_of(kernels.combine_kernel, TOP_K=launch.top_k, WEIGHTED=weights is not None,
                      BLOCK_T=tiles.block_t, BLOCK_N=tiles.block_n, num_warps=tiles.num_warps)
    handle((cdiv(t, tiles.block_t) * cdiv(n, tiles.block_n),), ys, index, w, out, t, n, launch.n_experts,
           *index.stride(), *w.stride(), n)
    return out


def _weight_grad(launch: Launch, a, b, out_like, *, gather_a=False, gather_b=False, scale=None, bias_like=None):
    """``(dW, d_bias)``: ``dW[e] = sum over expert e's rows of a_r^T b_r`` (``a_r`` times
    ``scale[slot]`` if given) in ``out_like``'s layout, and with ``bias_like`` the sums of a_r."""
    n_experts, m, n = out_like.shape
    dw = torch.empty_like(out_like)
    db = None if bias_like is None else torch.empty_like(bias_like)
    tiles = launch.config.weight_grad
    handle = launcher_of(kernels.weight_grad_kernel, TOP_K=launch.top_k, GATHER_A=gather_a, GATHER_B=gather_b,
                      HAS_SCALE=scale is not None, HAS_DB=db is not None, BLOCK_M=tiles.block_m,
                      GROUP_M=tiles.group_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, PRECISION=launch.precision,
                      num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    order, offsets = launch.routing
    handle((n_experts * cdiv(m, tiles.block_m) * cdiv(n, tiles.block_n),), a, b, order, offsets,
           a if scale is None else scale, dw, dw if db is None else db, m, n, a.stride(0), b.stride(0), *dw.stride(),
           0 if db is None else db.stride(0))
    return dw, db


def _plain_weight_grad(launch: Launch, a, b, out_like, **options):
    """``_weight_grad`` of an expert weight (not an adapter): through torch's grouped GEMM where
    the configuration asks for it and ``wgrad.usable`` holds, else the kernel."""
    if launch.config.weight_grad_backend == "grouped_mm" and a.dtype == b.dtype and wgrad.usable(
            out_like, a.dtype, options.get("bias_like")):
        return wgrad.grouped_weight_grad(a, b, *launch.routing, launch.top_k, out_like, **options)
    return _weight_grad(launch, a, b, out_like, **options)


def _launch(x, top_k_index, down_proj, config, routing=None) -> Launch:
    """The call's launches over ``routing`` (order, offsets, tile table of ``gate_up.block_m``),
    sorted here when None (the forward)."""
    t, k = top_k_index.shape
    n_experts = down_proj.shape[0]
    config = config or moe_config(t * k, n_experts, x.shape[1], down_proj.shape[2], x.device)
    block_m = config.gate_up.block_m
    order, offsets, table = routing or sort_slots(top_k_index, n_experts, block_m)
    return Launch((order, offsets), t * k, k, n_experts, config, _precision(x.dtype), {block_m: table})


def _pairing(options: ExpertsOptions, inter: int) -> tuple:
    """``(PAIR, up_offset)`` of the gate/up columns (kernels.py)."""
    return (2, 1) if options.interleaved else (1, inter)


# --------------------------------------------------------------------------------------------
# forward
# --------------------------------------------------------------------------------------------
def _forward(x, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, gate_up_lora_a,
             gate_up_lora_b, down_lora_a, down_lora_b, options: ExpertsOptions, store_gu: bool,
             config: Optional[MoeConfig]):
    hidden, inter = x.shape[1], down_proj.shape[2]
    launch = _launch(x, top_k_index, down_proj, config)
    scale = options.lora_scale
    xa = None if gate_up_lora_a is None else _grouped_mm(launch, x, _operand(gate_up_lora_a, 2),
                                                         gate_up_lora_a.shape[1], hidden, gather=True, scale=scale,
                                                         narrow=True)
    gu = _empty(x, launch.rows, 2 * inter) if store_gu else None
    hs = _empty(x, launch.rows, inter)
    pair, up_offset = _pairing(options, inter)
    (la, lb), lora = _lora_args(xa, None if xa is None else _operand(gate_up_lora_b, 2), x)
    _row_grid(kernels.gate_up_kernel, launch.config.gate_up, launch, inter,
              (x, gate_up_proj, hs if gate_up_bias is None else gate_up_bias, la, lb, hs if gu is None else gu, hs,
               launch.n_experts, hidden, inter, lora[0], x.stride(0), *_operand(gate_up_proj, 2)[1:],
               0 if gate_up_bias is None else gate_up_bias.stride(0), *lora[1:], up_offset, options.alpha,
               options.limit),
              PAIR=pair, ACTIVATION=options.activation, HAS_BIAS=gate_up_bias is not None, HAS_LORA=xa is not None,
              STORE_GU=store_gu, BLOCK_R=_rank_block(lora[0]))
    ha = None if down_lora_a is None else _grouped_mm(launch, hs, _operand(down_lora_a, 2), down_lora_a.shape[1],
                                                      inter, scale=scale, narrow=True)
    ys = _grouped_mm(launch, hs, _operand(down_proj, 2), hidden, inter, scatter=True, bias=down_bias, lora_rows=ha,
                     lora_b=None if ha is None else _operand(down_lora_b, 2))
    del hs
    out = _combine(ys, top_k_index, top_k_weights, launch, x.dtype)
    return out, gu, *launch.routing, launch.tables[launch.config.gate_up.block_m], xa, ha


def experts_fwd(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up_proj: torch.Tensor,
                down_proj: torch.Tensor, gate_up_bias: Optional[torch.Tensor], down_bias: Optional[torch.Tensor],
                gate_up_lora_a: Optional[torch.Tensor], gate_up_lora_b: Optional[torch.Tensor],
                down_lora_a: Optional[torch.Tensor], down_lora_b: Optional[torch.Tensor], options: ExpertsOptions, *,
                config: Optional[MoeConfig] = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                           torch.Tensor]:
    """``(out [T, H], gate/up [S, 2I], order [S], offsets [E + 1], tile table, s x A_gu^T [S, r],
    s h A_down^T [S, r])`` of ``x [T, H]`` (unit stride along H) routed by ``top_k_index``,
    ``top_k_weights [T, k]`` through ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``
    (logical orientation, any strides) and their adapters (None: none)."""
    return _forward(x, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, gate_up_lora_a,
                    gate_up_lora_b, down_lora_a, down_lora_b, options, True, config)


def experts_infer(x, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, gate_up_lora_a,
                  gate_up_lora_b, down_lora_a, down_lora_b, options: ExpertsOptions, *,
                  config: Optional[MoeConfig] = None):
    """``experts_fwd`` of a call that needs no gradient: the gate/up values are not kept."""
    return _forward(x, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, gate_up_lora_a,
                    gate_up_lora_b, down_lora_a, down_lora_b, options, False, config)


# --------------------------------------------------------------------------------------------
# backward
# --------------------------------------------------------------------------------------------
def _routing_weight_grad(partial, dy, top_k_index, top_k_weights, down_bias, n_experts):
    """``<dy[t], y[t, j]>``: the column tiles' sums of ``<g, h>``, plus ``<dy[t], down_bias[e]>``."""
    d_weights = partial.sum(2)
    if down_bias is not None:
        valid = (top_k_index >= 0) & (top_k_index < n_experts)
        with torch.autocast(dy.device.type, enabled=False):  # (a backward may run inside autocast)
            by_expert = (dy.float() @ down_bias.float().T).gather(1, top_k_index.long().clamp(0, n_experts - 1))
        d_weights = d_weights + torch.where(valid, by_expert, 0.0)
    return d_weights.to(top_k_weights.dtype)


def experts_bwd(dy: torch.Tensor, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up_proj: torch.Tensor, down_proj: torch.Tensor, down_bias: Optional[torch.Tensor],
                gate_up_lora_a: Optional[torch.Tensor], gate_up_lora_b: Optional[torch.Tensor],
                down_lora_a: Optional[torch.Tensor], down_lora_b: Optional[torch.Tensor], gu: torch.Tensor,
                order: torch.Tensor, offsets: torch.Tensor, tiles: torch.Tensor, xa: Optional[torch.Tensor],
                ha: Optional[torch.Tensor],
                grads: ExpertsGrads, *, config: Optional[MoeConfig] = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of ``experts_fwd``'s differentiable tensors (x, top_k_weights, gate_up_proj,
    down_proj, the biases, the adapters' A and B of gate_up then down) from ``dy [T, H]``; None
    where ``grads`` does not ask for one."""
    options, scale = grads.options, grads.options.lora_scale
    hidden, inter = x.shape[1], down_proj.shape[2]
    launch = _launch(x, top_k_index, down_proj, config, (order, offsets, tiles))
    dy = as_rows(dy, hidden)
    weights = top_k_weights.contiguous()  # (read by slot id: [T, k] in place)
    # s dy B_down [S, r]: the down adapter's part of the gradient of h
    dyb = None if ha is None else _grouped_mm(launch, dy, _operand(down_lora_b, 1), down_lora_b.shape[2], hidden,
                                              gather=True, scale=scale, narrow=True)
    tiles = launch.config.down_bwd
    dgu = torch.empty_like(gu)
    hs = _empty(x, launch.rows, inter) if grads.need_down or grads.need_down_bias or grads.need_down_lora_a else None
    # (a slot's column-tile sums at [t, j, :], slot t * k + j: summed into top_k_weights' shape)
    partial = (torch.zeros((*top_k_index.shape, cdiv(inter, tiles.block_n)), device=x.device, dtype=torch.float32)
               if grads.need_weights else None)
    pair, up_offset = _pairing(options, inter)
    (la, lb), lora = _lora_args(dyb, None if dyb is None else _operand(down_lora_a, 1), dgu)
    _row_grid(kernels.down_bwd_kernel, tiles, launch, inter,
              (dy, down_proj, la, lb, gu, weights, dgu, dgu if hs is None else hs,
               dgu if partial is None else partial, launch.n_experts, hidden, inter, lora[0], dy.stride(0),
               *_operand(down_proj, 1)[1:], *lora[1:], 0 if partial is None else partial.stride(1), up_offset,
               options.alpha, options.limit),
              PAIR=pair, ACTIVATION=options.activation, HAS_LORA=dyb is not None, STORE_H=hs is not None,
              STORE_P=partial is not None, BLOCK_R=_rank_block(lora[0]))
    d_weights = None if partial is None else _routing_weight_grad(partial, dy, top_k_index, top_k_weights, down_bias,
                                                                  launch.n_experts)
    d_down = d_down_bias = d_down_b = d_down_a = None
    if grads.need_down or grads.need_down_bias:
        d_down, d_down_bias = _plain_weight_grad(launch, dy, hs, down_proj, gather_a=True, scale=weights,
                                                 bias_like=down_bias if grads.need_down_bias else None)
    if grads.need_down_lora_b:
        d_down_b = _weight_grad(launch, dy, ha, down_lora_b, gather_a=True, scale=weights)[0]
    if grads.need_down_lora_a:
        d_down_a = _weight_grad(launch, dyb, hs, down_lora_a, scale=weights)[0]
    del hs, dyb
    # s d(gate, up) B_gu [S, r]: the gate/up adapter's part of the gradient of x
    dgb = None if xa is None or not (grads.need_x or grads.need_gate_up_lora_a) else _grouped_mm(
        launch, dgu, _operand(gate_up_lora_b, 1), gate_up_lora_b.shape[2], 2 * inter, scale=scale, narrow=True)
    dx = None
    if grads.need_x:
        dxs = _grouped_mm(launch, dgu, _operand(gate_up_proj, 1), hidden, 2 * inter, scatter=True, lora_rows=dgb,
                          lora_b=None if dgb is None else _operand(gate_up_lora_a, 1))
        dx = _combine(dxs, top_k_index, None, launch, x.dtype)
        del dxs
    d_gate_up = d_gate_up_bias = None
    if grads.need_gate_up or grads.need_gate_up_bias:
        d_gate_up, d_gate_up_bias = _plain_weight_grad(launch, dgu, x, gate_up_proj, gather_b=True,
                                                       bias_like=_empty(x, launch.n_experts, 2 * inter)
                                                       if grads.need_gate_up_bias else None)
    d_gate_up_b = None if not grads.need_gate_up_lora_b else _weight_grad(launch, dgu, xa, gate_up_lora_b)[0]
    d_gate_up_a = None if not grads.need_gate_up_lora_a else _weight_grad(launch, dgb, x, gate_up_lora_a,
                                                                     gather_b=True)[0]
    return (dx, d_weights, d_gate_up if grads.need_gate_up else None, d_down if grads.need_down else None, d_gate_up_bias,
            d_down_bias, d_gate_up_a, d_gate_up_b, d_down_a, d_down_b)
