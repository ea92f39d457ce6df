"""Launch configurations of the RoPE kernel (``ops/rope.py``), as frozen records, and their
choice for a device.

``RopeTiles`` is the rule (elements of q a program moves a step, and its warps) that makes a
call's ``RopeConfig`` from its sizes; ``rope_tiles(d, hq, hk, device)`` gives the rule of a
device: the tuned cache's for these heads (``llmkernels tune``), else ``DEFAULT_TILES`` on every
device. Larger steps for a device that needs more bytes in flight did not help: on the H200 the
tune measured 86.4% of copy at 1024 elements a step against 80.3% at 2048 and 74.1% at 4096
(``llmkernels/ops/tuned/nvidia-h200.json``, ``rope/128/32/8``), and ``portable.py`` 91.1% against
84.2% in one process (``benchmarks/results/portable/nvidia-h200-2026-11-28.json``).
"""
from __future__ import annotations

import dataclasses

import torch

from .. import _device
from .._args import next_pow2


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """A launch of the RoPE kernel: ``block_t`` tokens a program, ``block_hq`` / ``block_hk``
    heads of q / k a step, ``num_warps``."""

    block_t: int
    block_hq: int
    block_hk: int
    num_warps: int


@dataclasses.dataclass(frozen=True)
class RopeTiles:
    """About ``tile_elements`` elements of q a step, several tokens a program when one token's
    heads are fewer, ``num_warps`` warps."""

    tile_elements: int
    num_warps: int

    def resolve(self, n_tokens: int, hq: int, hk: int, d: int) -> RopeConfig:
        row = next_pow2(d)
        block_hq = min(next_pow2(hq), max(1, self.tile_elements // row))
        block_hk = min(next_pow2(hk), block_hq)
        block_t = min(next_pow2(n_tokens), max(1, self.tile_elements // (block_hq * row)))
        return RopeConfig(block_t, block_hq, block_hk, self.num_warps)


# Smaller steps ran faster down to 1024 elements, and 4 warps fastest
# (benchmarks/results/rope-h100-2026-11-22*.json).
DEFAULT_TILES = RopeTiles(tile_elements=1024, num_warps=4)
RECORDS = (RopeTiles,)


def tuned_name(d: int, hq: int, hk: int) -> str:
    """The key of ``llmkernels tune``'s cache: head dim and heads of q and k."""
    return f"rope/{d}/{hq}/{hk}"


def rope_tiles(d: int, hq: int, hk: int, device: torch.device) -> RopeTiles:
    """The rule of these heads on ``device``: tuned there, else ``DEFAULT_TILES``."""
    tuned = _device.tuned_of(device).config(tuned_name(d, hq, hk), RECORDS)
    return tuned or DEFAULT_TILES


def rope_config(n_tokens: int, hq: int, hk: int, d: int, tiles: RopeTiles = DEFAULT_TILES) -> RopeConfig:
    """The launch of ``n_tokens`` tokens of these heads by the rule ``tiles``."""
    return tiles.resolve(n_tokens, hq, hk, d)
