"""Seeded random draws for one fuzz case: shapes, dtypes, options and tensors in random layouts.

A case is reproduced from ``(seed, index)`` alone: choices come from a ``random.Random`` seeded
with both, values from a CPU ``torch.Generator`` seeded from it (the same bits on every device).
"""
from __future__ import annotations

import math
import random

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# How a tensor is stored: the layouts the ops must read as they come.
LAYOUTS = ("contiguous", "transposed", "sliced", "strided", "expanded")


class Draw:
    """The random choices of one case on ``device``."""

    def __init__(self, seed: int, index: int, device: torch.device):
        self.rng = random.Random(f"{seed}:{index}")
        self.gen = torch.Generator(device="cpu").manual_seed(self.rng.getrandbits(62))
        self.device = device

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def choice(self, options):
        return self.rng.choice(list(options))

    def int(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def dtype(self) -> torch.dtype:
        return self.choice(DTYPES)

    def width(self, hi: int) -> int:
        """A last-dimension size in ``[1, hi]``: 1, odd and ragged sizes, powers of two and their
        neighbours (block edges), each about as often."""
        kind = self.rng.random()
        if kind < 0.1:
            return 1
        if kind < 0.55:
            return self.int(2, hi)
        p = 2 ** self.int(1, max(1, int(math.log2(hi))))
        return max(1, min(hi, p + self.choice((-1, 0, 0, 1))))

    def rows(self, hi: int = 40) -> int:
        """A row count: 0 (an empty batch) and 1 (decode) among random ones."""
        kind = self.rng.random()
        return 0 if kind < 0.05 else 1 if kind < 0.2 else self.int(2, hi)

    def lead(self, max_rows: int = 40) -> tuple:
        """Leading dims of a ``[..., N]`` input: none, one or two, their product at most ``max_rows``."""
        n = self.choice((0, 1, 1, 2))
        if n == 0:
            return ()
        if n == 1:
            return (self.rows(max_rows),)
        a = self.int(1, 5)
        return a, self.rows(max(1, max_rows // a))

    def scale(self) -> float:
        """A random magnitude over six decades (loss scaling, gradient accumulation)."""
        return 10.0 ** self.rng.uniform(-3, 3)

    def values(self, shape, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
        t = torch.randn(tuple(shape), generator=self.gen, device="cpu") * scale
        return t.to(dtype).to(self.device)

    def tensor(self, shape, dtype: torch.dtype, *, scale: float = 1.0, layouts=LAYOUTS) -> torch.Tensor:
        """Random normal values in a layout drawn from ``layouts``, as a detached leaf."""
        return stored(self.values(shape, dtype, scale), self.choice(layouts)).detach()

    def target(self, m: int, v: int, ignore_index: int) -> torch.Tensor:
        """Class indices ``[m]`` in ``[0, v)`` with a random fraction (up to all) ``ignore_index``."""
        t = torch.randint(0, v, (m,), generator=self.gen, device="cpu")
        ignored = torch.rand(m, generator=self.gen, device="cpu") < self.choice((0.0, 0.0, 0.2, 0.6, 1.0))
        t = torch.where(ignored, ignore_index, t).to(self.choice((torch.int64, torch.int32)))
        return t.to(self.device)


def stored(values: torch.Tensor, layout: str) -> torch.Tensor:
    """``values`` stored in ``layout``: row-major, the last two dims swapped in memory, a slice of
    wider rows, every other row of a taller tensor, or its first row expanded (stride 0)."""
    if values.dim() == 0 or values.numel() == 0:
        return values
    if layout == "transposed" and values.dim() >= 2:
        return values.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "sliced":
        wide = torch.full((*values.shape[:-1], values.shape[-1] + 3), math.nan, dtype=values.dtype,
                          device=values.device)
        wide[..., :values.shape[-1]] = values
        return wide[..., :values.shape[-1]]
    if layout == "strided" and values.dim() >= 2:
        tall = torch.full((2 * values.shape[0], *values.shape[1:]), math.nan, dtype=values.dtype, device=values.device)
        tall[::2] = values
        return tall[::2]
    if layout == "expanded" and values.dim() >= 2:
        return values[:1].expand(values.shape)
    return values


def shift_values(t: torch.Tensor, offset: float) -> None:
    """Add ``offset`` to the values of ``t`` (made by ``stored``) in place, in whatever layout: to its
    whole storage (a slice's padding and a strided tensor's gaps are NaN and stay so)."""
    with torch.no_grad():
        torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage()).add_(offset)
