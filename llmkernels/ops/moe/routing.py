"""Routing metadata: the slots ``(t, j)`` of ``top_k_index [T, k]`` ordered by expert, and the
row tiles the grouped GEMMs run over. Plain PyTorch on the device, no host synchronisation: the
tile table has a fixed upper-bound length, its unused tail marked with expert ``E``.

A slot's id is ``t * k + j`` (its place in ``top_k_index.reshape(-1)``, the token ``id // k``).
Sorted by expert with a stable sort, the slots of expert e are rows ``offsets[e]`` to
``offsets[e + 1]`` of the sorted order, in token order; ids outside ``[0, E)`` (dropped slots,
as expert parallelism marks tokens of other ranks) sort after every expert and no tile covers
them: ``offsets[0]`` is 0, so that a grouped GEMM given the experts' end rows alone
(``offsets[1:]``, as ``torch._grouped_mm`` takes them) starts expert 0 at row 0.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class Routing(NamedTuple):
    """``order [S] int32``: the slot id of each sorted row; ``offsets [E + 1] int32``: expert
    e's rows are ``offsets[e]:offsets[e + 1]``."""

    order: torch.Tensor
    offsets: torch.Tensor


def sort_slots(top_k_index: torch.Tensor, num_experts: int) -> Routing:
    """The slots of ``top_k_index [T, k]`` (int32 or int64) ordered by expert (stable: token
    order within an expert, so the weight gradients' sums run in one fixed order)."""
    flat = top_k_index.reshape(-1)
    experts, order = torch.sort(torch.where((flat >= 0) & (flat < num_experts), flat, num_experts), stable=True)
    bounds = torch.arange(num_experts + 1, device=experts.device, dtype=experts.dtype)
    return Routing(order.to(torch.int32), torch.searchsorted(experts, bounds).to(torch.int32))


def max_tiles(rows: int, num_experts: int, block_m: int) -> int:
    """An upper bound of ``sum_e cdiv(rows_e, block_m)`` over ``rows`` sorted rows: each expert
    that has rows adds at most one partial tile (at least 1: a grid is never empty)."""
    return max(1, rows // block_m + min(num_experts, rows))


def tile_table(offsets: torch.Tensor, rows: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tile_expert, tile_start)``, int32 of length ``max_tiles``: the expert and first sorted
    row of each tile of ``block_m`` rows (a tile never spans two experts); tiles past the last
    have expert ``E``."""
    num_experts = offsets.numel() - 1
    offsets = offsets.to(torch.int64)
    counts = offsets[1:] - offsets[:-1]
    tiles = (counts + block_m - 1) // block_m
    ends = torch.cumsum(tiles, 0)
    t = torch.arange(max_tiles(rows, num_experts, block_m), device=offsets.device)
    expert = torch.searchsorted(ends, t, right=True)
    clamped = expert.clamp(max=num_experts - 1)
    start = offsets[clamped] + (t - (ends - tiles)[clamped]) * block_m
    return expert.to(torch.int32), start.to(torch.int32)

