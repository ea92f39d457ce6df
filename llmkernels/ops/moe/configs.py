"""Launch configurations of the MoE kernels (``kernels.py``), as frozen records, and their choice
for a call from the device model.

A grouped GEMM is compute bound: what matters is that tiles fit the rows an expert has (few
tokens an expert: small M tiles, else most of a tile multiplies padding) and that there are
enough tiles to fill the multiprocessors. ``moe_config`` chooses ``block_m`` from the mean rows
an expert (``rows / experts``) and, for full 128-row tiles, wider column tiles in groups; it then
halves ``block_n`` while the forward's tiles would not give every multiprocessor two programs. Shared-memory stages are fitted to the device
(``_device.fit_stages``). The interpreter (CPU tests) takes larger tiles than its tiny shapes
need: it runs programs one after another, each op a NumPy call of any size, so fewer programs
are faster (16-wide tiles took 7x the time of these); tests pass small tiles where they mean to
span several.
"""
from __future__ import annotations

import dataclasses

import torch

from .. import _device
from .._args import cdiv
from .._launch import PlanCache
from .._device import fit_stages
from .routing import max_tiles
from .wgrad import BACKENDS, available


@dataclasses.dataclass(frozen=True)
class GemmTiles:
    """A launch of a GEMM kernel: ``block_m x block_n`` output tiles, ``block_k`` deep steps;
    ``group_m`` row tiles take each column tile in turn (``kernels._swizzled``: programs running
    together then share a weight tile from L2; 1: row tile by row tile)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 1


@dataclasses.dataclass(frozen=True)
class CombineTiles:
    """A launch of the combine kernel: ``block_t`` tokens by ``block_n`` columns a program."""

    block_t: int
    block_n: int
    num_warps: int


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """The launches of one MoE call: the forward gate/up GEMM (two accumulators), the grouped
    GEMMs of the forward down projection and the backward's dx (``down``), the backward of the
    down projection and activation, the weight gradients, and the combine. ``weight_grad_backend``
    forms the expert weights' own gradients ("triton": ``weight_grad_kernel`` with these tiles;
    "grouped_mm": torch's grouped GEMM, ``wgrad.py``, where it can take them, else the kernel);
    adapters' gradients always take the kernel."""

    gate_up: GemmTiles
    down: GemmTiles
    down_bwd: GemmTiles
    weight_grad: GemmTiles
    combine: CombineTiles
    weight_grad_backend: str = "triton"

    def __post_init__(self):
        if self.weight_grad_backend not in BACKENDS:
            raise ValueError(f"weight_grad_backend must be one of {BACKENDS}, got {self.weight_grad_backend!r}")


# Tiles of the interpreter (see the module notes).
INTERPRETER = MoeConfig(gate_up=GemmTiles(32, 64, 64, 4, 1), down=GemmTiles(32, 64, 64, 4, 1),
                        down_bwd=GemmTiles(32, 64, 64, 4, 1), weight_grad=GemmTiles(64, 64, 32, 4, 1),
                        combine=CombineTiles(8, 64, 4))
MIN_BLOCK_N = 32


def row_block(rows_per_expert: float) -> int:
    """``block_m`` for a mean of ``rows_per_expert`` rows an expert: the smallest of 16 ... 128
    that holds them, so that an expert's last tile is mostly rows."""
    for block in (16, 32, 64):
        if rows_per_expert <= block:
            return block
    return 128


def _staged(tiles: GemmTiles, device: torch.device, operands: int = 2) -> GemmTiles:
    """``tiles`` with the stages whose shared-memory buffers (``operands`` bf16 tiles a step: A
    and each B) fit the device."""
    stage_bytes = 2 * tiles.block_k * (tiles.block_m + (operands - 1) * tiles.block_n)
    return dataclasses.replace(tiles, num_stages=max(1, fit_stages(tiles.num_stages, stage_bytes, device)))


def choose(rows: int, experts: int, hidden: int, inter: int, device: torch.device) -> MoeConfig:
    """The launches of ``rows`` slots (tokens x top-k) over ``experts`` experts of hidden size
    ``hidden`` and intermediate size ``inter``, on ``device``."""
    if device.type != "cuda":
        return INTERPRETER
    block_m = row_block(rows / max(1, experts))
    full = block_m == 128
    # Full row tiles (Qwen3-30B-A3B's and Mixtral's shapes) measured fastest with twice the
    # columns a program and row tiles in groups of 8 sharing weight tiles from L2 (moe_tiles.py).
    warps, stages, group_m = (8, 3, 8) if full else (4, 4, 1)
    programs = 2 * _device.model_of(device).sms
    tiles = max_tiles(rows, experts, block_m)
    gate_up_n = 128 if full else 64
    while gate_up_n > MIN_BLOCK_N and tiles * cdiv(inter, gate_up_n) < programs:
        gate_up_n //= 2
    down_n = 256 if full else 128
    while down_n > MIN_BLOCK_N and tiles * cdiv(hidden, down_n) < programs:
        down_n //= 2
    return MoeConfig(
        gate_up=_staged(GemmTiles(block_m, gate_up_n, 64, warps, stages, group_m), device, operands=3),
        down=_staged(GemmTiles(block_m, down_n, 64, warps, stages, group_m), device),
        down_bwd=_staged(GemmTiles(block_m, gate_up_n, 64, warps, 4, group_m), device),
        weight_grad=_staged(GemmTiles(128, 128, 64 if full else 32, 8, 3), device),
        combine=CombineTiles(4, 512, 4),
        # Torch's grouped GEMM formed each weight gradient in about half the kernel's time at
        # Mixtral's shape (moe_tiles.py's bare GEMMs, H200); with fewer rows an expert the kernel stays.
        weight_grad_backend="grouped_mm" if full and available(device) else "triton")


# (chosen once a shape: a forward and its backward each ask, every layer of every step)
_CHOSEN = PlanCache(choose)


def moe_config(rows: int, experts: int, hidden: int, inter: int, device: torch.device) -> MoeConfig:
    """``choose``'s launches of these sizes on ``device``, made once."""
    return _CHOSEN[rows, experts, hidden, inter, device]
