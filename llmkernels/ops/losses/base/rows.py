"""The row launchers of the losses over a vocabulary (kernels: ``row_kernels.py``): per-row
cross-entropy over a block of logits (``ce_rows``), the in-place scaling of a gradient formed in
the forward (``scale_rows_``), the reduction of the rows' losses (``finish_loss``), and the
outputs a loss returns (``CrossEntropyOutput``).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..._args import cdiv, next_pow2, or_stand_in, row_stride
from ..._device import device_of, persistent_programs
from ..._launch import PlanCache, launcher_of
from ..._rowsplit import resident_registers
from ...configs.cross_entropy import CrossEntropyConfig, ce_config, inplace_split, row_tiles, split_forward_parts
from .row_kernels import (ce_combine_kernel, ce_fused_split_kernel, ce_kernel, ce_partial_kernel, finish_kernel,
                          scale_rows_kernel)
from .targets import one_program


class CrossEntropyOutput(NamedTuple):
    """What ``cross_entropy`` / ``linear_cross_entropy`` return when ``return_z_loss`` or
    ``return_lse`` is set. ``loss`` includes the z-loss term; ``z_loss`` is that term alone,
    reduced like ``loss`` (for logging, no gradient); ``lse`` is the fp32 logsumexp of each
    row ``[M]`` (no gradient). Fields not asked for are ``None``."""

    loss: torch.Tensor
    z_loss: Optional[torch.Tensor]
    lse: Optional[torch.Tensor]


def package_output(loss, z, lse, return_z_loss: bool, return_lse: bool):
    """``loss``, or the :class:`CrossEntropyOutput` the ``return_*`` flags ask for."""
    if not (return_z_loss or return_lse):
        return loss
    return CrossEntropyOutput(loss, z.detach() if return_z_loss else None, lse.detach() if return_lse else None)


class RowLoss(NamedTuple):
    """How each row's cross-entropy is scored (``cross_entropy``'s ignore_index, label_smoothing,
    z_loss and softcap): the options ``ce_rows`` takes, a part of each cross-entropy's record."""

    ignore_index: int
    smoothing: float
    z_coef: float
    softcap: Optional[float]


class RowsKey(NamedTuple):
    """What decides the launches of a ``ce_rows`` call: ``[m, v]`` logits on a device, the passes
    (``forward``, ``grad``), what scales the gradient (an upstream gradient, ``mean``'s count),
    the options that switch terms on, and a configuration given instead of ``ce_config``'s."""

    m: int
    v: int
    device_index: int
    forward: bool
    grad: bool
    has_g: bool
    mean: bool
    has_smoothing: bool
    has_z: bool
    store_z: bool
    has_softcap: bool
    config: Optional[CrossEntropyConfig]


def ce_rows(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, row: RowLoss, *,
            loss: Optional[torch.Tensor] = None, z_loss: Optional[torch.Tensor] = None,
            dlogits: Optional[torch.Tensor] = None, grad_output: Optional[torch.Tensor] = None,
            count: Optional[torch.Tensor] = None, config: Optional[CrossEntropyConfig] = None) -> None:
    """Per-row cross-entropy over a block of logits: the row launcher of this module.

    ``logits [R, V]`` (unit stride along V; rows may be strided, e.g. a chunk of a bigger
    block), ``target [R]``, ``lse [R]`` fp32. Nothing is reduced over rows and nothing is
    allocated but scratch; each output is written in place:

    - ``loss`` given (``[R]`` fp32): the forward. Writes each row's loss (0 for ignored rows,
      NaN for targets outside ``[0, V)``, which are not read), its z-loss part into ``z_loss``
      (``[R]`` fp32, optional) and its logsumexp into ``lse``.
    - ``dlogits`` given (``[R, V]``, strided rows allowed; may be ``logits`` itself): writes
      ``d loss_row / d logits`` times the row's scale: ``grad_output`` (0-d, or ``[R]`` with any
      stride: an upstream gradient per row; default 1) times ``1 / count`` when ``count`` (0-d
      int, the rows of a ``mean``) is given. With ``loss`` too the gradient is formed in the
      forward, which reads the logits once (``grad_output`` is for a gradient after the
      forward); without, ``lse`` must hold the rows' logsumexps from an earlier forward.

    ``row``: how each row is scored; ``config`` the launch configuration (default ``ce_config``'s: tuned on this device,
    else derived from ``DEFAULT_CONFIG``).
    """
    m, v = logits.shape
    if m == 0:
        return
    forward, grad = loss is not None, dlogits is not None
    if forward and grad_output is not None:
        raise ValueError("ce_rows: grad_output scales a gradient formed after the forward (loss=None)")
    smoothing, z_coef, softcap = row.smoothing, row.z_coef, row.softcap
    has_softcap = softcap is not None
    run = _ROWS[RowsKey(m, v, logits.get_device(), forward, grad, grad_output is not None, count is not None,
                        smoothing > 0, z_coef > 0, z_loss is not None, has_softcap, config)]
    run(logits, target, lse, loss, z_loss, dlogits, grad_output, count, row.ignore_index, smoothing, z_coef,
        softcap if has_softcap else 1.0)


def _rows_plan(key: RowsKey):
    """The launches of one ``ce_rows`` call's sizes and switches, resolved once:
    ``run(logits, target, lse, loss, z_loss, dlogits, grad_output, count, ignore_index, smoothing,
    z_coef, cap)``."""
    m, v, forward, grad, has_smoothing, has_z, store_z, has_softcap = (
        key.m, key.v, key.forward, key.grad, key.has_smoothing, key.has_z, key.store_z, key.has_softcap)
    device = device_of(key.device_index)
    config = key.config or ce_config(v, device)
    switches = dict(HAS_SMOOTHING=has_smoothing, HAS_SOFTCAP=has_softcap)
    parts, span = split_forward_parts(v, m, config) if forward and not grad else (1, v)
    if parts > 1:
        combine = config.split_forward
        partial_kernel = launcher_of(ce_partial_kernel, **switches, BLOCK_V=config.forward.block_v,
                                  num_warps=config.forward.num_warps)
        combine_kernel = launcher_of(ce_combine_kernel, PARTS_POW2=next_pow2(parts), HAS_SMOOTHING=has_smoothing,
                                  HAS_Z=has_z, STORE_Z=store_z, HAS_SOFTCAP=has_softcap,
                                  BLOCK_R=combine.combine_rows, num_warps=combine.combine_warps)
        partial_grid, combine_grid = (m * parts,), (cdiv(m, combine.combine_rows),)

        def split_forward(logits, target, lse, loss, z_loss, dlogits, g, count, ignore_index, smoothing, z_coef, cap):
            partials = logits.new_empty((3, m, parts), dtype=torch.float32)
            partial_kernel(partial_grid, logits, partials, m, v, logits.stride(0), cap, parts, span)
            combine_kernel(combine_grid, logits, target, partials, loss, or_stand_in(z_loss, loss), lse, m, v,
                           logits.stride(0), ignore_index, smoothing, z_coef, cap, parts)
        return split_forward
    split = inplace_split(v, m, device, config) if forward and grad else None
    if split is not None:
        parts, groups = split
        inplace = config.split_inplace
        # (several programs a multiprocessor: registers capped so that every program is resident)
        resident = {} if inplace.per_sm == 1 else {"maxnreg": resident_registers(inplace.num_warps, inplace.per_sm)}
        handle = launcher_of(ce_fused_split_kernel, MEAN=key.mean, HAS_SMOOTHING=has_smoothing, HAS_Z=has_z,
                          STORE_Z=store_z, HAS_SOFTCAP=has_softcap, PARTS=parts, PARTS_POW2=next_pow2(parts),
                          BLOCK_V=inplace.block_v, num_warps=inplace.num_warps, **resident)
        grid = (groups * parts,)

        def split_inplace(logits, target, lse, loss, z_loss, dlogits, g, count, ignore_index, smoothing, z_coef, cap):
            handle(grid, logits, target, loss, or_stand_in(z_loss, loss), lse, dlogits, or_stand_in(count, lse),
                   logits.new_zeros((m, parts, 4), dtype=torch.int64),
                   m, v, logits.stride(0), dlogits.stride(0), ignore_index, smoothing, z_coef, cap)
        return split_inplace
    row_pass = (config.inplace if forward else config.backward) if grad else config.forward
    block_m, block_v, num_warps, one_block = row_tiles(v, m, row_pass, config)
    tiles = cdiv(m, block_m)
    grid = (tiles if row_pass.per_sm == 0 else min(tiles, persistent_programs(device, row_pass.per_sm)),)
    handle = launcher_of(ce_kernel, FORWARD=forward, GRAD=grad, HAS_G=key.has_g, MEAN=key.mean,
                      HAS_SMOOTHING=has_smoothing, HAS_Z=has_z, STORE_Z=store_z, HAS_SOFTCAP=has_softcap,
                      PASS1_EVICT=row_pass.evict[0],
                      PASS2_EVICT=row_pass.evict[1], BLOCK_M=block_m, BLOCK_V=block_v, ONE_BLOCK=one_block,
                      num_warps=num_warps)

    def rows(logits, target, lse, loss, z_loss, dlogits, g, count, ignore_index, smoothing, z_coef, cap):
        handle(grid, logits, target, or_stand_in(loss, lse), or_stand_in(z_loss, lse), lse,
               or_stand_in(dlogits, logits), or_stand_in(g, lse), or_stand_in(count, lse), m, v, logits.stride(0),
               row_stride(dlogits), 0 if g is None or g.dim() == 0 else g.stride(0), ignore_index, smoothing, z_coef,
               cap)
    return rows


_ROWS = PlanCache(_rows_plan)


def _scale_plan(r: int, n: int, device_index: int):
    block_n = min(4096, max(16, next_pow2(n)))
    block_r = max(1, 4096 // block_n)
    device = device_of(device_index)
    programs = min(cdiv(r, block_r), persistent_programs(device, 8))
    return launcher_of(scale_rows_kernel, BLOCK_R=block_r, BLOCK_N=block_n, num_warps=8), (programs,)


_SCALE = PlanCache(_scale_plan)


def scale_rows_(dx: torch.Tensor, g: torch.Tensor) -> None:
    """``dx [R, N] *= g`` in place, ``g`` 0-d or ``[R]``; rows whose factor is 1 are skipped."""
    r, n = dx.shape
    if r == 0 or n == 0:
        return
    if n > 1 and dx.stride(1) != 1:  # the kernel steps along a row by one element
        raise RuntimeError(f"scale_rows_ needs rows of unit column stride, got strides {dx.stride()}")
    handle, grid = _SCALE[r, n, dx.get_device()]
    handle(grid, dx, g, r, n, dx.stride(0), 0 if g.dim() == 0 else g.stride(0))


def row_buffers(m: int, want_z: bool, z_coef: float, device: torch.device):
    """What a forward writes per row: (lse [M] fp32, loss [M] fp32, z-loss [M] fp32 or None)."""
    lse = torch.empty(m, dtype=torch.float32, device=device)
    return lse, torch.empty_like(lse), (torch.empty_like(lse) if want_z and z_coef > 0 else None)


def count_rows(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Rows not ignored (0-d int64): for passes that scale a gradient by ``1 / count`` as they go."""
    return (target != ignore_index).sum()


def _finish_plan(m: int, reduce: bool, mean: bool, has_z: bool, count_given: bool):
    return one_program(finish_kernel, m, REDUCE=reduce, MEAN=mean, HAS_Z=has_z, COUNT_GIVEN=count_given)


_FINISH = PlanCache(_finish_plan)


def finish_loss(loss_rows, z_rows, target, *, ignore_index: int, reduction: str, want_z: bool,
                dtype: torch.dtype, count: Optional[torch.Tensor] = None):
    """Reduce the per-row losses to ``dtype`` (and the z-loss part when ``want_z``) in one
    small kernel, which also counts the rows for ``mean`` unless ``count`` is given.
    Returns (loss, z-loss part or None, count (0-d int64, ``mean`` only) or None)."""
    m = loss_rows.shape[0]
    reduce = reduction != "none"
    loss = loss_rows.new_empty(() if reduce else (m,), dtype=dtype)
    z = None if z_rows is None else torch.empty_like(loss)
    out_count = None
    if reduction == "mean":
        out_count = count if count is not None else target.new_empty((), dtype=torch.int64)
    _FINISH[m, reduce, out_count is not None, z is not None, count is not None](
        (1,), loss_rows, or_stand_in(z_rows, loss_rows), target, or_stand_in(out_count, loss_rows), loss,
        or_stand_in(z, loss), m, ignore_index)
    if want_z and z is None:
        z = torch.zeros_like(loss)
    return loss, z, out_count

