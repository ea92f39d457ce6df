"""Launch configurations of the QK-norm + RoPE kernels (``ops/qk_norm_rope.py``), as frozen
records, and their choice for a device.

``QkNormRopeTiles`` is the rule (elements a step, warps, tokens a step at most, and for the
backward's persistent grid its programs a multiprocessor) that makes a call's
``QkNormRopeConfig`` from its heads; ``qk_norm_rope_tiles(direction, d, hq, hk, device)`` gives
a device's rule: the tuned cache's for these heads (``llmkernels tune --ops qk_norm_rope``), else
the default of that direction.

The defaults hold about 1K elements a step over 4 warps. What limits these kernels is their
bytes in flight, and registers limit those: compiled for sm_90 as launched (Triton 3.9 on a
CPU, ``cuobjdump -res-usage``), each element of a half-row a thread holds costs 26-37 registers
in the backward and 14-24 in the forward, whatever the tile (the arithmetic is float32; q and k
in separate programs saved a fifth). At the scaling decoder's 6 heads of 64 the defaults hold 2
tokens a step: the backward needs 148 registers (3 programs a multiprocessor, about 1,500
half-row elements in flight an SM) and the forward 96 (5, 2,560), where one token over 2 warps
gives 114 and 64 registers (8 and 16 programs, 2,048 and 4,096). So the tune's candidates are
smaller tiles over fewer warps with more programs a multiprocessor; a prefetch of the next
block's rows was compiled too and cost more registers (40 more at one token over 4 warps) than
it added bytes.
"""
from __future__ import annotations

import dataclasses

import torch

from .. import _device
from .._args import next_pow2

DIRECTIONS = ("fwd", "bwd")


@dataclasses.dataclass(frozen=True)
class QkNormRopeConfig:
    """A launch: ``block_t`` tokens a program (a step of a backward program), ``block_h`` heads a
    step, ``num_warps``; the backward's persistent grid has ``programs_per_sm`` programs a
    multiprocessor (the forward's grid is one program a token block and ignores it)."""

    block_t: int
    block_h: int
    num_warps: int
    programs_per_sm: int = 4


@dataclasses.dataclass(frozen=True)
class QkNormRopeTiles:
    """About ``tile_elements`` elements (the padded rows of ``block_h`` heads of ``block_t``
    tokens) a step, at most ``max_block_t`` tokens, over ``num_warps`` warps;
    ``programs_per_sm`` as in ``QkNormRopeConfig``."""

    tile_elements: int
    num_warps: int
    max_block_t: int = 8
    programs_per_sm: int = 4

    def resolve(self, hq: int, hk: int, d: int) -> QkNormRopeConfig:
        row = next_pow2(d)
        block_h = min(next_pow2(max(hq, hk)), max(1, self.tile_elements // row))
        block_t = max(1, min(self.max_block_t, self.tile_elements // (block_h * row)))
        return QkNormRopeConfig(block_t, block_h, self.num_warps, self.programs_per_sm)


DEFAULT_TILES = {"fwd": QkNormRopeTiles(1024, 4), "bwd": QkNormRopeTiles(1024, 4)}
RECORDS = (QkNormRopeTiles,)


def tuned_name(direction: str, d: int, hq: int, hk: int) -> str:
    """The key of ``llmkernels tune``'s cache: the direction, head dim and heads of q and k."""
    return f"qk_norm_rope/{direction}/{d}/{hq}/{hk}"


def qk_norm_rope_tiles(direction: str, d: int, hq: int, hk: int, device: torch.device) -> QkNormRopeTiles:
    """The rule of ``direction`` (``"fwd"`` or ``"bwd"``) for these heads on ``device``: tuned
    there, else the default."""
    tuned = _device.tuned_of(device).config(tuned_name(direction, d, hq, hk), RECORDS)
    return tuned or DEFAULT_TILES[direction]


def qk_norm_rope_config(direction: str, hq: int, hk: int, d: int, device: torch.device) -> QkNormRopeConfig:
    """The launch of these heads in ``direction`` on ``device``."""
    return qk_norm_rope_tiles(direction, d, hq, hk, device).resolve(hq, hk, d)
