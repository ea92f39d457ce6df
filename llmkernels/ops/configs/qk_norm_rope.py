"""Launch configurations of the QK-norm + RoPE kernels (``ops/qk_norm_rope.py``), as frozen
records, and their choice for a device.

``QkNormRopeTiles`` is the rule (elements a step, warps, tokens a step at most, and for the
backward's persistent grid its programs a multiprocessor) that makes a call's
``QkNormRopeConfig`` from its heads; ``qk_norm_rope_tiles(direction, d, hq, hk, device)`` gives
a device's rule: the tuned cache's for these heads (``llmkernels tune --ops qk_norm_rope``), else
the default of that direction.

The defaults hold about 1K elements a step over 4 warps. What limits these kernels is their
bytes in flight, and registers limit those. Compiled for sm_90 as launched (Triton 3.9 on a CPU,
``cuobjdump -res-usage``, the integers specialised as Triton does) at the scaling decoder's 6
heads of 64, a thread needs 12-20 registers for each element of a half-row it holds in the
forward and 21-32 in the backward (float32 arithmetic):

- the defaults (2 tokens a step): forward 64 registers, 8 programs a multiprocessor, about 4,100
  half-row elements in flight; backward 96, where 5 programs would fit but its grid asks for 4
  (about 2,000);
- one token over 2 warps: 56 and 96 registers (18 and 10 programs: 4,600 and 2,600);
- one token over 1 warp: 96 and 168 (21 and 12 programs: 5,400 and 3,100).

So the backward holds about half the forward's bytes in flight, and the tune's candidates give
it more programs a multiprocessor and smaller tiles over fewer warps.
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
