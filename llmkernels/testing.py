"""What the tests and the benchmark's correctness check share (the tests never import the
benchmark runner): allocations poisoned so that an unwritten output cannot pass."""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def poisoned():
    """``torch.empty``/``empty_like`` return NaN-filled (integer: max-value) tensors meanwhile, so
    an output that a kernel leaves unwritten shows up instead of passing on stale memory."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def fill(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(torch.iinfo(t.dtype).max)
        return t

    torch.empty = lambda *a, **k: fill(real_empty(*a, **k))
    torch.empty_like = lambda *a, **k: fill(real_empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_empty_like
