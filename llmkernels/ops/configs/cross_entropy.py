"""Launch configurations of the cross-entropy kernels (``ops/losses/``), as frozen
records, and their choice for a device.

``DEFAULT_CONFIG`` holds what the H100 measurements chose (each pass names its results);
``ce_config(v, device)`` gives a call's: the tuned cache's for this vocabulary (``llmkernels
tune``), else the default ``deepened`` to the device's depth (``_device.DeviceModel.depth``):
a device that needs more loads in flight a multiprocessor splits each row over more, narrower
programs. Every launcher takes ``config=`` instead.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import torch

from .. import _device
from .._args import cdiv, next_pow2
from .._rowsplit import split_grid

MIN_SPLIT_BLOCK_V = 16384  # the narrowest slice an in-place split program takes when a device asks for more
MAX_SPLIT_PER_SM = 2  # in-place split programs a multiprocessor at most (each holds its slice in registers)


@dataclasses.dataclass(frozen=True)
class RowPass:
    """How ``_ce_kernel`` runs one kind of pass over rows wider than one block: a loop over
    ``block_v``-column chunks of ``block_m`` rows a program."""

    block_v: int
    num_warps: int
    per_sm: int  # programs a multiprocessor of the persistent grid; 0: a program per row tile
    # cache policy of a row's read for its logsumexp and of its read for the gradient (a pass
    # that reads a row once makes one of them)
    evict: tuple
    results: str  # the measurements that chose it
    block_m: int = 1


@dataclasses.dataclass(frozen=True)
class SplitForward:
    """The forward alone over few rows: each row split over programs that store partial
    logsumexps (the forward pass's chunk and warps), then a combine kernel; with more rows the
    last wave of whole-row programs would leave multiprocessors idle."""

    max_items: int  # rows x parts at most
    results: str
    combine_rows: int = 128  # rows a program of the combine kernel
    combine_warps: int = 4


@dataclasses.dataclass(frozen=True)
class SplitInplace:
    """The in-place pass over rows split across resident programs that exchange the row's
    statistics (``_ce_fused_split_kernel``): the logits are read once."""

    block_v: int  # columns each program holds in registers
    num_warps: int
    results: str
    per_sm: int = 1  # programs a multiprocessor (more than one: registers capped so that all are resident)

    def deepened(self, depth: int) -> "SplitInplace":
        """``depth`` times the programs a multiprocessor (``_device.more_programs``), within
        MAX_SPLIT_PER_SM and MIN_SPLIT_BLOCK_V."""
        return _device.more_programs(self, depth, "block_v", MIN_SPLIT_BLOCK_V, MAX_SPLIT_PER_SM)


@dataclasses.dataclass(frozen=True)
class CrossEntropyConfig:
    """The launch configuration of every cross-entropy pass (``DEFAULT_CONFIG``; tests and
    tuning pass others as ``config=``)."""

    one_block_max: int  # rows up to this many classes are held whole in registers by one program
    forward: RowPass  # the forward alone
    backward: RowPass  # the separate backward (re-reads the logits with the forward's lse)
    inplace: RowPass  # forward and gradient in one program, each row read twice
    split_forward: SplitForward
    split_inplace: Optional[SplitInplace]  # None: the in-place pass never splits rows
    tile_elements: int = 4096  # elements a program holds in the one-block kernel
    warp_elements: int = 512  # ... a warp of it holds (4 to 32 warps)

    def deepened(self, depth: int) -> "CrossEntropyConfig":
        """The configuration of a device needing ``depth`` times the H100's loads in flight a
        multiprocessor: the in-place split deepened (the row passes already fill every
        multiprocessor's threads)."""
        if depth == 1 or self.split_inplace is None:
            return self
        return dataclasses.replace(self, split_inplace=self.split_inplace.deepened(depth))


_SWEEP = "benchmarks/results/cross_entropy-h100-2026-11-22.json"
_SESSION4 = "benchmarks/results/cross-entropy-session4-h100-2026-11-22/"
DEFAULT_CONFIG = CrossEntropyConfig(
    one_block_max=8192,
    forward=RowPass(block_v=16384, num_warps=8, per_sm=0, evict=("evict_first", "evict_first"),
                    results="benchmarks/results/cross_entropy-forward-variants-h100-2026-11-22.txt, " + _SWEEP),
    backward=RowPass(block_v=16384, num_warps=32, per_sm=2, evict=("evict_last", "evict_first"),
                     results=_SESSION4 + "ce-bwd-inplace-sweep-8192-rows.json"),
    inplace=RowPass(block_v=16384, num_warps=32, per_sm=4, evict=("evict_last", "evict_first"),
                    results=_SESSION4 + "ce-bwd-inplace-sweep-8192-rows.json, " + _SWEEP),
    split_forward=SplitForward(max_items=4096, results=_SESSION4 + "ce-split-forward-and-api.json"),
    split_inplace=SplitInplace(block_v=32768, num_warps=16,
                               results="benchmarks/results/cross-entropy-inplace-h100-2026-11-23/"),
)


class RowTiles(NamedTuple):
    """What one program of ``_ce_kernel`` covers: ``block_m`` rows, ``block_v`` columns a step."""

    block_m: int
    block_v: int
    num_warps: int
    one_block: bool  # the whole row in one block (else a loop over chunks)


def row_tiles(v: int, m: int, row_pass: RowPass, config: CrossEntropyConfig = DEFAULT_CONFIG) -> RowTiles:
    """The tiles of ``m`` rows of ``v`` classes for ``row_pass``: rows up to ``one_block_max``
    whole in one block, several rows a program up to ``tile_elements``; wider rows chunked."""
    if v > config.one_block_max:
        return RowTiles(row_pass.block_m, row_pass.block_v, row_pass.num_warps, False)
    block_v = max(16, next_pow2(v))
    block_m = min(max(1, config.tile_elements // block_v), next_pow2(max(m, 1)))
    return RowTiles(block_m, block_v, min(32, max(4, block_m * block_v // config.warp_elements)), True)


def split_forward_parts(v: int, m: int, config: CrossEntropyConfig = DEFAULT_CONFIG) -> tuple[int, int]:
    """``(parts, span)``: programs per row of the forward alone and the columns each covers (a
    multiple of the forward's chunk): one program (span V), or as many spans as keep rows x
    parts <= ``split_forward.max_items``."""
    chunk = config.forward.block_v
    if v <= config.one_block_max:
        return 1, v
    parts = max(1, min(cdiv(v, chunk), config.split_forward.max_items // max(m, 1)))
    if parts == 1:
        return 1, v
    span = cdiv(cdiv(v, parts), chunk) * chunk
    return cdiv(v, span), span


def inplace_split(v: int, m: int, device: torch.device, config: CrossEntropyConfig = DEFAULT_CONFIG):
    """``(parts, groups)`` of the in-place pass over rows split across programs, or None: rows
    held by one block, no split configured, or a split that cannot run here (``split_grid``)."""
    if v <= config.one_block_max or config.split_inplace is None:
        return None
    return split_grid(v, m, config.split_inplace.block_v, device, config.split_inplace.per_sm)


RECORDS = (CrossEntropyConfig, RowPass, SplitForward, SplitInplace)


def tuned_name(v: int) -> str:
    """The key of ``llmkernels tune``'s cache: the vocabulary."""
    return f"cross_entropy/{v}"


def derived_config(v: int, depth: int) -> CrossEntropyConfig:
    """The configuration of rows of ``v`` classes on a device of ``depth`` without a tuned entry:
    ``DEFAULT_CONFIG`` deepened, except where the H100's in-place split holds the row in one slice.
    Splitting such a row on a deeper device cost the H200 10 points of copy at V = 32000 (83.5%
    whole against 73.1%, the tune's search in ``ops/tuned/nvidia-h200.json``; ``portable.py`` 89.9%
    against 78.5%: ``benchmarks/results/portable/nvidia-h200-2026-11-28.json``), where wider rows
    gained 2 points (128256) or held (262144)."""
    return DEFAULT_CONFIG if v <= DEFAULT_CONFIG.split_inplace.block_v else DEFAULT_CONFIG.deepened(depth)


def ce_config(v: int, device: torch.device) -> CrossEntropyConfig:
    """The configuration of rows of ``v`` classes on ``device``: tuned there, else derived."""
    tuned = _device.tuned_of(device).config(tuned_name(v), RECORDS)
    return tuned or derived_config(v, _device.model_of(device).depth)
