"""The launchers: the forward and backward of [M, N] rows, each choosing its kernels' launch
configuration and launching them."""
from __future__ import annotations

from typing import Optional

import torch

from .._launch import cdiv, fit_stages, launch, next_pow2, persistent_programs, pointer, row_stride
from .._rowsplit import resident_registers, split_grid
from .backward import _norm_bwd_dots_kernel, _norm_bwd_kernel, _norm_bwd_split_kernel, _sum_partials_kernel
from .configs import _bwd_config, _fwd_config, _fwd_split_config, _split_config
from .forward import _norm_fwd_kernel, _norm_fwd_split_kernel


def _norm_fwd(x, weight, bias, residual, heads: int, eps: float, weight_offset: float, is_rms: bool,
              quantize: bool, out_dtype: torch.dtype, h_dtype: Optional[torch.dtype], store_stats: bool):
    """x, residual: [M, N] with unit column stride. Returns (y [M, N], h [M, N] or None,
    mean [M] fp32 or None, rstd [M] fp32 or None)."""
    m, n = x.shape
    dev = x.device
    y = torch.empty((m, n), dtype=out_dtype, device=dev)
    h = torch.empty((m, n), dtype=h_dtype, device=dev) if residual is not None else None
    rstd = torch.empty(m, dtype=torch.float32, device=dev) if store_stats else None
    mean = torch.empty(m, dtype=torch.float32, device=dev) if store_stats and not is_rms else None
    if m == 0:
        return y, h, mean, rstd
    split_cfg = _fwd_split_config(is_rms, x.element_size(), residual is not None, n) if heads == 1 else None
    split = split_grid(n, m, split_cfg[0], dev, split_cfg[2]) if split_cfg is not None else None
    if split is not None:
        parts, groups = split
        block_n, num_warps, per_sm = split_cfg
        launch(_norm_fwd_split_kernel, (groups * parts,),
            x, pointer(residual, x), pointer(weight, x), pointer(bias, x),
            y, pointer(h, y), pointer(mean, y), pointer(rstd, y),
            torch.zeros((m, parts), dtype=torch.int64, device=dev),
            m, n,
            x.stride(0), row_stride(residual), y.stride(0), row_stride(h),
            eps, weight_offset,
            IS_RMS=is_rms, HAS_RES=residual is not None, HAS_W=weight is not None, HAS_B=bias is not None,
            QUANTIZE=quantize, STORE_STATS=store_stats,
            PARTS=parts, PARTS_POW2=next_pow2(parts), BLOCK_N=block_n, EVEN=n % block_n == 0,
            num_warps=num_warps, maxnreg=resident_registers(num_warps, per_sm),
        )
        return y, h, mean, rstd
    block_m, block_n, num_warps, one_pass, early_w, tail_n = _fwd_config(n, m, is_rms, persistent_programs(dev, 1),
                                                                        x.element_size(), residual is not None)
    launch(_norm_fwd_kernel, (cdiv(m, block_m),),
        x, pointer(residual, x), pointer(weight, x), pointer(bias, x),
        y, pointer(h, y), pointer(mean, y), pointer(rstd, y),
        m, n, heads,
        x.stride(0), row_stride(residual), y.stride(0), row_stride(h),
        eps, weight_offset,
        IS_RMS=is_rms, HAS_RES=residual is not None, HAS_W=weight is not None, HAS_B=bias is not None,
        PER_HEAD=heads > 1, QUANTIZE=quantize, STORE_STATS=store_stats,
        BLOCK_M=block_m, BLOCK_N=block_n, ONE_PASS=one_pass, EARLY_W=early_w, TAIL_N=tail_n, num_warps=num_warps,
    )
    return y, h, mean, rstd


def _norm_bwd(dy, dh, xin, weight, bias_dtype: Optional[torch.dtype], mean, rstd, heads: int, weight_offset: float,
              is_rms: bool, quantize: bool, x_dtype: torch.dtype, res_dtype: Optional[torch.dtype],
              share_dres: bool = False):
    """Gradients of the forward above. ``xin [M, N]`` is the norm's input (``h`` with a
    residual); ``dy`` and ``dh`` (gradient of the returned ``h``, or None) are ``[M, N]``.
    ``share_dres``: return dx itself as dresidual when the dtypes match (saves a write; only
    safe when neither input is a leaf whose ``.grad`` would then alias the other's).
    Returns (dx, dresidual or None, dweight or None, dbias [heads * N] of ``bias_dtype`` (None
    without a bias))."""
    has_bias = bias_dtype is not None
    m, n = xin.shape
    dev = xin.device
    dx = torch.empty((m, n), dtype=x_dtype, device=dev)
    dres = None
    if res_dtype is not None:
        share = share_dres and res_dtype == x_dtype
        dres = dx if share else torch.empty((m, n), dtype=res_dtype, device=dev)
    # The decode rule is measured for one weight row (heads == 1) only.
    block_m, block_n, num_warps, one_pass, per_sm, max_programs, prefetch, tail_n = _bwd_config(
        n, m, is_rms, persistent_programs(dev, 1) if heads == 1 else 0, xin.element_size())
    rows_per_head = m // heads
    # bytes of one row's loads in the loops (x, dy, dh): what a pipeline stage holds in shared memory
    row_bytes = xin.element_size() + dy.element_size() + (0 if dh is None else dh.element_size())
    split = None
    if not one_pass and heads == 1:
        split_cols, split_warps, split_stages, split_w_packed = _split_config(is_rms, xin.dtype)
        split = split_grid(n, m, split_cols, dev)
    n_chunks = 1 if one_pass else cdiv(n, block_n)
    if split is not None:
        parts, n_progs = split
    else:
        n_progs = max(1, min(cdiv(rows_per_head, block_m), cdiv(persistent_programs(dev, per_sm), heads * n_chunks)))
        if max_programs:
            n_progs = min(n_progs, max_programs)
    # Decode sizes (a program cap), one head and column chunk: each program of several also
    # computes dW/dB of its share of the columns over all rows; one program sums its rows'.
    # Either way the kernel writes dW/dB in their dtypes, no partials to sum in a second launch.
    dw_cols = next_pow2(cdiv(n, n_progs)) if max_programs and n_progs > 1 and heads == 1 and one_pass else 0
    direct = n_progs == 1 or dw_cols > 0
    dw_part = (torch.empty((1 if direct else n_progs, heads * n), dtype=weight.dtype if direct else torch.float32,
                           device=dev) if weight is not None else None)
    db_part = (torch.empty((1 if direct else n_progs, heads * n), dtype=bias_dtype if direct else torch.float32,
                           device=dev) if has_bias else None)
    if m > 0 and split is not None:
        launch(_norm_bwd_split_kernel, (n_progs * parts,),
               xin, pointer(weight, xin), dy, pointer(dh, dy), dx,
               pointer(dres, dx),
               pointer(dw_part, dx), pointer(db_part, dx),
               pointer(mean, rstd), rstd,
               torch.zeros((m + n_progs, parts, 2), dtype=torch.int64, device=dev),
               m, n,
               xin.stride(0), dy.stride(0), row_stride(dh), dx.stride(0),
               row_stride(dres),
               weight_offset,
               IS_RMS=is_rms, HAS_W=weight is not None, HAS_B=has_bias, HAS_DH=dh is not None,
               HAS_DRES=dres is not None and dres is not dx, QUANTIZE=quantize,
               PARTS=parts, PARTS_POW2=next_pow2(parts), BLOCK_N=split_cols,
               STAGES=fit_stages(split_stages, split_cols * row_bytes, dev), W_PACKED=split_w_packed,
               num_warps=split_warps)
    elif m > 0:
        dots = None
        if not one_pass:
            dots = torch.empty((m, 2), dtype=torch.float32, device=dev)
            launch(_norm_bwd_dots_kernel, (m,),
                xin, pointer(weight, xin), dy, pointer(mean, rstd), rstd, dots,
                n, heads, xin.stride(0), dy.stride(0), weight_offset,
                IS_RMS=is_rms, HAS_W=weight is not None, PER_HEAD=heads > 1, BLOCK_N=8192, num_warps=16,
            )
        launch(_norm_bwd_kernel, (n_progs, heads, n_chunks),
            xin, pointer(weight, xin), dy, pointer(dh, dy), dx,
            pointer(dres, dx),
            pointer(dw_part, dx), pointer(db_part, dx),
            pointer(mean, rstd), rstd, pointer(dots, rstd),
            rows_per_head, n, heads,
            xin.stride(0), dy.stride(0), row_stride(dh), dx.stride(0),
            row_stride(dres),
            weight_offset,
            IS_RMS=is_rms, HAS_W=weight is not None, HAS_B=has_bias, HAS_DH=dh is not None,
            HAS_DRES=dres is not None and dres is not dx, QUANTIZE=quantize,
            PRECOMPUTED_DOTS=not one_pass, BLOCK_M=block_m, BLOCK_N=block_n,
            PREFETCH=fit_stages(prefetch, (block_n + tail_n) * (block_m * row_bytes + (0 if weight is None else
                                                                                        weight.element_size())), dev),
            DW_COLS=dw_cols, DW_ROWS=min(next_pow2(m), max(1, 4096 // dw_cols)) if dw_cols else 1, TAIL_N=tail_n,
            num_warps=num_warps,
        )
    elif dw_part is not None or db_part is not None:
        dw_part = None if dw_part is None else dw_part.zero_()
        db_part = None if db_part is None else db_part.zero_()
    if direct:
        dw, db = (None if dw_part is None else dw_part[0]), (None if db_part is None else db_part[0])
    else:
        dw = None if weight is None else torch.empty(heads * n, dtype=weight.dtype, device=dev)
        db = torch.empty(heads * n, dtype=bias_dtype, device=dev) if has_bias else None
        block_n = min(64, next_pow2(heads * n))
        launch(_sum_partials_kernel, (cdiv(heads * n, block_n),), pointer(dw_part, db_part),
               pointer(db_part, dw_part), pointer(dw, db), pointer(db, dw),
               n_progs, heads * n, HAS_W=dw is not None, HAS_B=db is not None, BLOCK_P=32, BLOCK_N=block_n,
               num_warps=4)
    return dx, dres, None if dw is None else dw.view(weight.shape), db
