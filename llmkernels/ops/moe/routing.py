"""Routing metadata: the slots ``(t, j)`` of ``top_k_index [T, k]`` ordered by expert, and the
row tiles the grouped GEMMs run over. A stable sort (torch) then one launch of
``kernels.routing_kernel`` for the offsets and the tile table, on the device, with no host
synchronisation: the tile table has a fixed upper-bound length, its unused tail marked with
expert ``E``.

A slot's id is ``t * k + j`` (its place in ``top_k_index.reshape(-1)``, the token ``id // k``).
Sorted by expert with a stable sort, the slots of expert e are rows ``offsets[e]`` to
``offsets[e + 1]`` of the sorted order, in token order; ids outside ``[0, E)`` (dropped slots,
as expert parallelism marks tokens of other ranks) sort after every expert and no tile covers
them: ``offsets[0]`` is 0, so that a grouped GEMM given the experts' end rows alone
(``offsets[1:]``, as ``torch._grouped_mm`` takes them) starts expert 0 at row 0.

The tile table of ``block_m`` rows is one int32 tensor ``[2 * n]`` (``n = max_tiles``): the
expert of each tile, then each tile's first sorted row (a tile never spans two experts).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .._args import next_pow2
from .._launch import launcher_of
from .kernels import routing_kernel

TABLE_CELLS = 8192  # tiles x experts compared a step of the routing kernel's tile loop


class Routing(NamedTuple):
    """``order [S] int32``: the slot id of each sorted row; ``offsets [E + 1] int32``: expert
    e's rows are ``offsets[e]:offsets[e + 1]``; ``tiles [2 * max_tiles] int32``: the tile table
    of the ``block_m`` it was made for."""

    order: torch.Tensor
    offsets: torch.Tensor
    tiles: torch.Tensor


def max_tiles(rows: int, num_experts: int, block_m: int) -> int:
    """An upper bound of ``sum_e cdiv(rows_e, block_m)`` over ``rows`` sorted rows: each expert
    that has rows adds at most one partial tile (at least 1: a grid is never empty)."""
    return max(1, rows // block_m + min(num_experts, rows))


def _tables(keys, offsets: torch.Tensor, rows: int, block_m: int, find_offsets: bool) -> torch.Tensor:
    """The tile table of ``block_m`` rows, from ``offsets`` or (``find_offsets``) writing them first
    from the sorted ``keys``: one launch of ``routing_kernel``."""
    num_experts = offsets.numel() - 1
    tiles = torch.empty(2 * max_tiles(rows, num_experts, block_m), device=offsets.device, dtype=torch.int32)
    block_e = next_pow2(num_experts + 1)
    handle = launcher_of(routing_kernel, BLOCK_M=block_m, FIND_OFFSETS=find_offsets, BLOCK_E=block_e,
                         BLOCK_T=max(16, TABLE_CELLS // block_e), num_warps=4)
    handle((1,), keys, offsets, tiles, rows, num_experts, tiles.numel() // 2, rows.bit_length())
    return tiles


def sort_slots(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> Routing:
    """The slots of ``top_k_index [T, k]`` (int32 or int64) ordered by expert (stable: token
    order within an expert, so the weight gradients' sums run in one fixed order), and the tile
    table of ``block_m`` rows."""
    # (ids outside [0, E) become E: clamped into [-1, E], then -1 taken modulo E + 1)
    keys, order = torch.sort(top_k_index.reshape(-1).clamp(-1, num_experts).remainder(num_experts + 1), stable=True)
    offsets = torch.empty(num_experts + 1, device=keys.device, dtype=torch.int32)
    return Routing(order.to(torch.int32), offsets, _tables(keys, offsets, keys.numel(), block_m, True))


def tile_table(offsets: torch.Tensor, rows: int, block_m: int) -> torch.Tensor:
    """The tile table of ``block_m`` rows from the ``offsets`` of ``sort_slots``."""
    return _tables(offsets, offsets, rows, block_m, False)
