"""Launch configurations of the GLU kernels (``ops/glu.py``), as frozen records.

``GluTiles`` is the rule (elements a program moves per tensor, widest column tile, warps) that
makes a call's ``GluConfig`` from its sizes. It does not deepen with the device
(``_device.DeviceModel.depth``): at 16 elements of each of gate and up a thread, the resident
programs of a multiprocessor keep several times the loads in flight that even a depth-4 device
needs, and every tile of 2048-8192 elements ran at the copy bandwidth.
"""
from __future__ import annotations

import dataclasses

from .._args import next_pow2


@dataclasses.dataclass(frozen=True)
class GluConfig:
    """A launch of a GLU kernel: tiles of ``block_m`` rows of ``block_n`` columns, ``num_warps``."""

    block_m: int
    block_n: int
    num_warps: int


@dataclasses.dataclass(frozen=True)
class GluTiles:
    """Tiles of about ``tile_elements``, several rows when they are narrower than ``max_block_n``."""

    tile_elements: int
    max_block_n: int
    num_warps: int

    def resolve(self, m: int, n: int) -> GluConfig:
        block_n = min(next_pow2(n), self.max_block_n)
        return GluConfig(min(next_pow2(m), max(1, self.tile_elements // block_n)), block_n, self.num_warps)


# Every tile of 2048-8192 elements at 4 or 8 warps ran at the copy bandwidth
# (benchmarks/results/nvidia-h100-80gb-hbm3-2026-11-22-session2/glu/tune.log).
DEFAULT_TILES = GluTiles(tile_elements=4096, max_block_n=2048, num_warps=8)


def glu_config(m: int, n: int, tiles: GluTiles = DEFAULT_TILES) -> GluConfig:
    """The launch of ``[m, n]`` by the rule ``tiles``."""
    return tiles.resolve(m, n)
