"""The kernels' arguments on the host: checks that name the caller's argument, ``[rows, n]``
views, stand-ins for absent tensors, and the integer maths of grids and tiles."""
from __future__ import annotations

import torch


def check_tensor(name: str, t, *, like: torch.Tensor | None = None, like_name: str = "x",
                 floating: bool = True) -> None:
    """Raise TypeError/ValueError naming ``name`` when ``t`` is not a tensor, not floating point
    (when ``floating``), or not on the device of ``like`` (the op's main input, ``like_name``)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if floating and not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if like is not None and t.device != like.device:
        raise ValueError(f"{name} is on {t.device} but {like_name} is on {like.device}: move them to one device")


def as_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """View ``t [..., n]`` as ``[rows, n]`` with unit stride along the last dimension, copying
    only when no such view exists (a transposed last dim, or leading dims that don't merge)."""
    if t.dim() == 0 or t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 2:
        return t
    return t.reshape(-1, n)  # a view where one exists (no try/except: torch.compile cannot trace it)


def or_stand_in(t: torch.Tensor | None, stand_in: torch.Tensor) -> torch.Tensor:
    """``t``, or ``stand_in`` where ``t`` is absent: a kernel's pointer argument must be a tensor
    even where a switch (HAS_W, HAS_RES, ...) keeps the kernel from touching it."""
    return stand_in if t is None else t


def row_stride(t: torch.Tensor | None) -> int:
    """``t.stride(0)``, or 0 for an absent ``t`` (a stride the kernel then never uses)."""
    return 0 if t is None else t.stride(0)


def cdiv(a: int, b: int) -> int:
    """Ceiling division on the host (``triton.cdiv`` is a JIT function, slow to call from Python)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def is_dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill its span of memory without gaps or overlaps, from its strides
    alone (those of size-1 dims do not count: real and fake tensors may differ there)."""
    span = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if stride != span:
            return False
        span *= size
    return True
