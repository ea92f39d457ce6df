"""The launchers: the forward and backward of ``[M, N]`` rows.

A call's options travel as one record, :class:`NormOptions`, from ``rms_norm`` / ``layer_norm``
to the kernels. What a call launches (kernels, constexprs, grids, the exchange slots' shape)
depends on the sizes, dtypes, device and options of its arguments, not on their data: it is
resolved once per such key (``FwdKey`` / ``BwdKey``, the options record in it) into a plan
(``FWD_PLANS`` / ``BWD_PLANS``, ``_launch.PlanCache``), and each call looks its plan up, allocates its
outputs (and the scratch its kernels write: exchange slots, dW / dB partials) and launches the
plan's kernel handles (``_launch.Launcher``).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import torch

from .._args import cdiv, next_pow2, or_stand_in, row_stride
from .._device import device_of, fit_stages, has_tma, model_of, persistent_programs, tuned_of
from .._launch import Launcher, PlanCache, launcher_of
from .._rowsplit import resident_registers, split_grid
from .._triton import TensorDescriptor
from .backward import norm_bwd_dots_kernel, norm_bwd_kernel, norm_bwd_split_kernel, sum_partials_kernel
from .configs import (DOTS_BLOCK_N, DOTS_WARPS, DW_STEP_ELEMENTS, SUMS_BLOCK_N, SUMS_BLOCK_P, SUMS_WARPS,
                      BackwardConfig, ForwardConfig, SplitBwdConfig, SplitFwdConfig, check_config)
from .forward import norm_fwd_kernel, norm_fwd_split_kernel
from .tables import NormKey, backward_config, forward_config


class NormOptions(NamedTuple):
    """The options of one norm call, named once: the custom ops' schemas, the autograd context
    and the plan keys are made of these fields."""

    is_rms: bool  # RMSNorm (else LayerNorm)
    round_x_hat: bool  # x_hat rounded to x's dtype before the weight is applied (casting="llama")
    heads: int  # weight rows [heads, N] taken by row % heads (1: one row)
    eps: float
    weight_offset: float  # added to the weight (Gemma's 1 + weight)
    out_dtype: torch.dtype  # y's
    h_dtype: Optional[torch.dtype]  # the residual sum h's (None: no residual)
    x_dtype: torch.dtype  # x's, dx's
    res_dtype: Optional[torch.dtype]  # the residual's, dresidual's (None: no residual)
    bias_dtype: Optional[torch.dtype]  # the bias's, dbias's (None: no bias)


NormOutputs = tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]


class FwdKey(NamedTuple):
    """What decides a forward's launch: rows ``m`` of ``n``, the device, the tensors present,
    whether the statistics are stored, the options, and a configuration given instead of the
    table's."""

    m: int
    n: int
    device_index: int
    residual: bool
    weight: bool
    bias: bool
    store_stats: bool
    options: NormOptions
    config: Optional[ForwardConfig]


class BwdKey(NamedTuple):
    """What decides a backward's launch: as :class:`FwdKey`, with the dtypes of the norm's input
    ``xin``, of ``dy`` and of ``dh`` and the weight (None: absent), and ``dres``: a dresidual
    written apart from dx."""

    m: int
    n: int
    device_index: int
    xin_dtype: torch.dtype
    dy_dtype: torch.dtype
    dh_dtype: Optional[torch.dtype]
    w_dtype: Optional[torch.dtype]
    dres: bool
    options: NormOptions
    config: Optional[BackwardConfig]


class FwdPlan(NamedTuple):
    """What one forward launches: ``launch(grid, ...)``; ``slots``: the shape of the split
    kernel's exchange slots (None: the rows kernel); ``tma_block``: x read through a tensor
    descriptor of ``[1, tma_block]`` blocks, made on the host each call (0: none), where x's rows
    start on 16 bytes, else through ``plain``, the same split reading x directly."""

    launch: Launcher
    grid: tuple
    slots: Optional[tuple]
    tma_block: int = 0
    plain: Optional[Launcher] = None


class BwdPlan(NamedTuple):
    """What one backward launches: ``launch(grid, ...)`` (the split kernel where ``slots``, the
    shape of its exchange slots, is set); ``dots``: the blocked loop's row dot products first;
    ``partials``: rows of the dW / dB partials (1: the kernel writes dW / dB themselves), summed
    by ``sums(sums_grid, ...)``."""

    launch: Launcher
    grid: tuple
    slots: Optional[tuple]
    dots: Optional[Launcher]
    partials: int
    sums: Optional[Launcher]
    sums_grid: tuple


def _fwd_launcher(config: ForwardConfig, n: int, parts: int = 1, *, is_rms: bool, residual: bool, weight: bool,
                  bias: bool, round_x_hat: bool, store_stats: bool, heads: int = 1) -> Launcher:
    """The kernel handle of a forward in ``config`` over rows of ``n`` (a split configuration:
    each row over ``parts`` programs), with the switches of the call (what is present)."""
    switches = dict(IS_RMS=is_rms, HAS_RES=residual, HAS_W=weight, HAS_B=bias, ROUND_X_HAT=round_x_hat,
                    STORE_STATS=store_stats)
    if isinstance(config, SplitFwdConfig):
        return launcher_of(norm_fwd_split_kernel, **switches, PARTS=parts, PARTS_POW2=next_pow2(parts),
                        BLOCK_N=config.block_n, EVEN=n % config.block_n == 0, STAGES=config.stages, TMA=config.tma,
                        LAG=config.lag, num_warps=config.num_warps, maxnreg=resident_registers(config.num_warps, config.per_sm))
    return launcher_of(norm_fwd_kernel, **switches, PER_HEAD=heads > 1, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                    ONE_PASS=config.one_pass, EARLY_W=config.early_w, TAIL_N=config.tail_n,
                    num_warps=config.num_warps)


def _bwd_launcher(config: BackwardConfig, parts: int = 1, *, stages: int, is_rms: bool, weight: bool, bias: bool,
                  dh: bool, dres: bool, round_x_hat: bool, heads: int = 1, dw_cols: int = 0, dw_rows: int = 1) -> Launcher:
    """The kernel handle of a backward in ``config`` (a split configuration: each row over
    ``parts`` programs), its pipelining ``stages`` (PREFETCH of the rows kernel) as fitted to the
    device, with the switches of the call; ``dw_cols`` / ``dw_rows``: each program's share of
    the dW / dB columns and rows a step, where it sums them (decode sizes)."""
    switches = dict(IS_RMS=is_rms, HAS_W=weight, HAS_B=bias, HAS_DH=dh, HAS_DRES=dres, ROUND_X_HAT=round_x_hat)
    if isinstance(config, SplitBwdConfig):
        return launcher_of(norm_bwd_split_kernel, **switches, PARTS=parts, PARTS_POW2=next_pow2(parts),
                        BLOCK_N=config.block_n, STAGES=stages, W_PACKED=config.w_packed, num_warps=config.num_warps)
    return launcher_of(norm_bwd_kernel, **switches, PRECOMPUTED_DOTS=not config.one_pass, BLOCK_M=config.block_m,
                    BLOCK_N=config.block_n, PREFETCH=stages, DW_COLS=dw_cols, DW_ROWS=dw_rows, TAIL_N=config.tail_n,
                    num_warps=config.num_warps)


def _forward_plan(key: FwdKey) -> FwdPlan:
    """The plan of a ``norm_fwd`` call (``key.config``: instead of ``FORWARD``'s)."""
    m, n, options, config = key.m, key.n, key.options, key.config
    device = device_of(key.device_index)
    table_key = NormKey(options.is_rms, options.x_dtype, key.residual, n, m, persistent_programs(device, 1),
                        options.heads == 1, model_of(device).depth)
    tuned = tuned_of(device)
    if config is None:
        config = forward_config(table_key, tuned)
    else:
        check_config(config, n, backward=False)
    switches = dict(is_rms=options.is_rms, residual=key.residual, weight=key.weight, bias=key.bias,
                    round_x_hat=options.round_x_hat, store_stats=key.store_stats, heads=options.heads)
    if isinstance(config, SplitFwdConfig):
        split = split_grid(n, m, config.block_n, device, config.per_sm) if table_key.split else None
        if split is not None:
            parts, groups = split
            # (a pipelined kernel publishes the rows past the last into spare slots)
            slots = (m + config.lag * groups if config.stages else m, parts)
            if config.tma and key.config is None and not (_tma_runs(config, options.x_dtype)
                                                          and has_tma(key.device_index)):
                config = dataclasses.replace(config, tma=False)  # a table's or cache's TMA read that cannot run here
            if not config.tma:
                return FwdPlan(_fwd_launcher(config, n, parts, **switches), (groups * parts,), slots)
            _check_tma(config, options.x_dtype)
            plain = _fwd_launcher(dataclasses.replace(config, tma=False), n, parts, **switches)
            return FwdPlan(_fwd_launcher(config, n, parts, **switches), (groups * parts,), slots, config.block_n,
                           plain)
        config = forward_config(table_key._replace(split=False), tuned)
    return FwdPlan(_fwd_launcher(config, n, **switches), (cdiv(m, config.block_m),), None)


FWD_PLANS = PlanCache(_forward_plan)

# TMA copies a pipelined slice into a ring of shared-memory buffers, each of which must start on
# 128 bytes (where Triton's pipeliner does not check, the copy faults with "misaligned address").
TMA_SLICE_BYTES = 128


def _tma_runs(config: SplitFwdConfig, dtype: torch.dtype) -> bool:
    """Whether this Triton can read x of ``dtype`` through TMA in ``config``'s slices."""
    return TensorDescriptor is not None and config.block_n * dtype.itemsize % TMA_SLICE_BYTES == 0


def _check_tma(config: SplitFwdConfig, dtype: torch.dtype) -> None:
    """Raise ValueError naming ``config`` where its TMA read cannot run on x of ``dtype``."""
    if TensorDescriptor is None:
        raise ValueError(f"config {config}: TMA needs triton.tools.tensor_descriptor (Triton 3.4+)")
    if not _tma_runs(config, dtype):
        raise ValueError(f"config {config}: a TMA slice of {config.block_n} {dtype} is not a multiple of "
                         f"{TMA_SLICE_BYTES} bytes")


def _tma_aligned(x: torch.Tensor) -> bool:
    """Whether x's base and rows start on 16 bytes, as a tensor descriptor needs."""
    return x.data_ptr() % 16 == 0 and x.stride(0) * x.element_size() % 16 == 0


def norm_fwd(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
             residual: Optional[torch.Tensor], options: NormOptions, *, store_stats: bool,
             config: Optional[ForwardConfig] = None) -> NormOutputs:
    """The forward of ``x [M, N]`` (and ``residual``; unit column stride): returns (y [M, N],
    h [M, N] or None, mean [M] fp32 or None, rstd [M] fp32 or None). ``config``: the launch
    configuration instead of the table's."""
    m, n = x.shape
    dev = x.device
    y = torch.empty((m, n), dtype=options.out_dtype, device=dev)
    h = torch.empty((m, n), dtype=options.h_dtype, device=dev) if residual is not None else None
    rstd = torch.empty(m, dtype=torch.float32, device=dev) if store_stats else None
    mean = torch.empty(m, dtype=torch.float32, device=dev) if store_stats and not options.is_rms else None
    if m == 0:
        return y, h, mean, rstd
    handle, grid, slots, tma_block, plain = FWD_PLANS[FwdKey(m, n, x.get_device(), residual is not None,
                                                             weight is not None, bias is not None, store_stats,
                                                             options, config)]
    eps, weight_offset = options.eps, options.weight_offset
    if slots is None:
        handle(grid, x, or_stand_in(residual, x), or_stand_in(weight, x), or_stand_in(bias, x), y, or_stand_in(h, y),
               or_stand_in(mean, y), or_stand_in(rstd, y), m, n, options.heads, x.stride(0), row_stride(residual),
               y.stride(0), row_stride(h), eps, weight_offset)
    else:
        x_read = x
        if tma_block and _tma_aligned(x):
            x_read = TensorDescriptor(x, list(x.shape), [x.stride(0), 1], [1, tma_block])
        elif tma_block:
            handle = plain
        handle(grid, x, x_read, or_stand_in(residual, x), or_stand_in(weight, x),
               or_stand_in(bias, x), y, or_stand_in(h, y), or_stand_in(mean, y), or_stand_in(rstd, y),
               torch.zeros(slots, dtype=torch.int64, device=dev), m, n, x.stride(0), row_stride(residual),
               y.stride(0), row_stride(h), eps, weight_offset)
    return y, h, mean, rstd


def _backward_plan(key: BwdKey) -> BwdPlan:
    """The plan of a ``norm_bwd`` call (``key.config``: instead of ``BACKWARD``'s)."""
    m, n, options, config, dh_dtype, w_dtype = key.m, key.n, key.options, key.config, key.dh_dtype, key.w_dtype
    is_rms, heads, dtype = options.is_rms, options.heads, key.xin_dtype
    device = device_of(key.device_index)
    # (residual: the gradient of h flows in; the decode rows are measured for one weight row only)
    table_key = NormKey(is_rms, dtype, dh_dtype is not None, n, m,
                        persistent_programs(device, 1) if heads == 1 else 0, heads == 1, model_of(device).depth)
    tuned = tuned_of(device)
    if config is None:
        config = backward_config(table_key, tuned)
    else:
        check_config(config, n, backward=True)
    # bytes of one row's loads in the loops (x, dy, dh): what a pipeline stage holds in shared memory
    row_bytes = dtype.itemsize + key.dy_dtype.itemsize + (0 if dh_dtype is None else dh_dtype.itemsize)
    switches = dict(is_rms=is_rms, weight=w_dtype is not None, bias=options.bias_dtype is not None,
                    dh=dh_dtype is not None, dres=key.dres, round_x_hat=options.round_x_hat)
    if isinstance(config, SplitBwdConfig):
        split = split_grid(n, m, config.block_n, device) if table_key.split else None
        if split is not None:
            parts, programs = split
            handle = _bwd_launcher(config, parts, stages=fit_stages(config.stages, config.block_n * row_bytes, device),
                                   **switches)
            return _with_sums(handle, (programs * parts,), (m + programs, parts, 2), None, programs, heads * n,
                              switches)
        config = backward_config(table_key._replace(split=False), tuned)
    chunks = 1 if config.one_pass else cdiv(n, config.block_n)
    programs = max(1, min(cdiv(m // heads, config.block_m),
                          cdiv(persistent_programs(device, config.per_sm), heads * chunks)))
    if config.max_programs:
        programs = min(programs, config.max_programs)
    # Capped programs (decode sizes), one head and column chunk: each program of several also sums
    # dW / dB of its share of the columns over every row, so no partials.
    by_columns = config.max_programs and programs > 1 and heads == 1 and config.one_pass
    dw_cols = next_pow2(cdiv(n, programs)) if by_columns else 0
    weight_bytes = 0 if w_dtype is None else w_dtype.itemsize
    stages = fit_stages(config.prefetch, (config.block_n + config.tail_n) * (config.block_m * row_bytes + weight_bytes),
                        device)
    handle = _bwd_launcher(config, stages=stages, heads=heads, dw_cols=dw_cols,
                           dw_rows=min(next_pow2(m), max(1, DW_STEP_ELEMENTS // dw_cols)) if dw_cols else 1, **switches)
    dots = None if config.one_pass else launcher_of(norm_bwd_dots_kernel, IS_RMS=is_rms, HAS_W=w_dtype is not None,
                                                 PER_HEAD=heads > 1, BLOCK_N=DOTS_BLOCK_N, num_warps=DOTS_WARPS)
    return _with_sums(handle, (programs, heads, chunks), None, dots, 1 if dw_cols else programs, heads * n,
                      switches)


def _with_sums(handle, grid, slots, dots, partials: int, columns: int, switches: dict) -> BwdPlan:
    """The plan, with the launch that sums ``partials`` rows of partials of ``columns`` dW / dB
    (none without a weight and a bias: there is nothing to sum)."""
    if partials == 1 or not (switches["weight"] or switches["bias"]):
        return BwdPlan(handle, grid, slots, dots, 1, None, ())
    block_n = min(SUMS_BLOCK_N, next_pow2(columns))
    sums = launcher_of(sum_partials_kernel, HAS_W=switches["weight"], HAS_B=switches["bias"], BLOCK_P=SUMS_BLOCK_P,
                    BLOCK_N=block_n, num_warps=SUMS_WARPS)
    return BwdPlan(handle, grid, slots, dots, partials, sums, (cdiv(columns, block_n),))


BWD_PLANS = PlanCache(_backward_plan)


def norm_bwd(dy: torch.Tensor, dh: Optional[torch.Tensor], xin: torch.Tensor, weight: Optional[torch.Tensor],
             mean: Optional[torch.Tensor], rstd: torch.Tensor, options: NormOptions, *, share_dres: bool = False,
             config: Optional[BackwardConfig] = None) -> NormOutputs:
    """Gradients of ``norm_fwd``. ``xin [M, N]`` is the norm's input (``h`` with a residual);
    ``dy`` and ``dh`` (gradient of the returned ``h``, or None) are ``[M, N]``. ``share_dres``:
    return dx itself as dresidual when the dtypes match (saves a write; only safe when neither
    input is a leaf whose ``.grad`` would then alias the other's). ``config``: the launch
    configuration instead of the table's. Returns (dx, dresidual or None, dweight or None,
    dbias [heads * N] (None without a bias))."""
    m, n = xin.shape
    dev = xin.device
    heads, x_dtype, res_dtype, bias_dtype = options.heads, options.x_dtype, options.res_dtype, options.bias_dtype
    dx = torch.empty((m, n), dtype=x_dtype, device=dev)
    dres = None
    if res_dtype is not None:
        dres = dx if share_dres and res_dtype == x_dtype else torch.empty((m, n), dtype=res_dtype, device=dev)
    if m == 0:
        dw = None if weight is None else torch.zeros((1, heads * n), dtype=weight.dtype, device=dev)[0]
        db = None if bias_dtype is None else torch.zeros((1, heads * n), dtype=bias_dtype, device=dev)[0]
        return dx, dres, None if dw is None else dw.view(weight.shape), db
    plan = BWD_PLANS[BwdKey(m, n, xin.get_device(), xin.dtype, dy.dtype, None if dh is None else dh.dtype,
                            None if weight is None else weight.dtype, dres is not None and dres is not dx, options,
                            config)]
    partials = plan.partials
    part_dtype = torch.float32 if partials > 1 else None
    dw_part = None if weight is None else torch.empty((partials, heads * n), dtype=part_dtype or weight.dtype,
                                                      device=dev)
    db_part = None if bias_dtype is None else torch.empty((partials, heads * n), dtype=part_dtype or bias_dtype,
                                                          device=dev)
    if plan.slots is not None:
        plan.launch(plan.grid, xin, or_stand_in(weight, xin), dy, or_stand_in(dh, dy), dx, or_stand_in(dres, dx),
                    or_stand_in(dw_part, dx), or_stand_in(db_part, dx), or_stand_in(mean, rstd), rstd,
                    torch.zeros(plan.slots, dtype=torch.int64, device=dev), m, n, xin.stride(0), dy.stride(0),
                    row_stride(dh), dx.stride(0), row_stride(dres), options.weight_offset)
    else:
        dots = None
        if plan.dots is not None:
            dots = torch.empty((m, 2), dtype=torch.float32, device=dev)
            plan.dots((m,), xin, or_stand_in(weight, xin), dy, or_stand_in(mean, rstd), rstd, dots, n, heads,
                      xin.stride(0), dy.stride(0), options.weight_offset)
        plan.launch(plan.grid, xin, or_stand_in(weight, xin), dy, or_stand_in(dh, dy), dx, or_stand_in(dres, dx),
                    or_stand_in(dw_part, dx), or_stand_in(db_part, dx), or_stand_in(mean, rstd), rstd,
                    or_stand_in(dots, rstd), m // heads, n, heads, xin.stride(0), dy.stride(0), row_stride(dh),
                    dx.stride(0), row_stride(dres), options.weight_offset)
    if plan.sums is None:
        dw, db = (None if dw_part is None else dw_part[0]), (None if db_part is None else db_part[0])
    else:
        dw = None if weight is None else torch.empty(heads * n, dtype=weight.dtype, device=dev)
        db = None if bias_dtype is None else torch.empty(heads * n, dtype=bias_dtype, device=dev)
        plan.sums(plan.sums_grid, or_stand_in(dw_part, db_part), or_stand_in(db_part, dw_part), or_stand_in(dw, db),
                  or_stand_in(db, dw), partials, heads * n)
    # (dW is [heads * N]: a weight of that shape takes it as it is, a per-head one as a view)
    return dx, dres, dw if dw is None or weight.dim() == 1 else dw.view(weight.shape), db
