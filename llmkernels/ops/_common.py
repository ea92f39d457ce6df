"""Small helpers shared by the op families: where kernels run, argument checks, grid sizing."""
from __future__ import annotations

import functools
import os

import torch

# Triton's interpreter runs the real kernel code on CPU tensors; it must be chosen before triton
# is imported, so it is read once here.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def use_kernels(t: torch.Tensor) -> bool:
    """True when the Triton kernels can run on ``t``: a CUDA tensor, or a CPU tensor under the
    interpreter. Otherwise the ops fall back to ``llmkernels.reference``."""
    return t.is_cuda or (INTERPRET and t.device.type == "cpu")


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def persistent_programs(device: torch.device, per_sm: int) -> int:
    """How many programs a persistent grid should launch: ``per_sm`` per multiprocessor on a
    GPU; a handful under the interpreter, where every program runs in turn on the CPU."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index) * per_sm


def cdiv(a: int, b: int) -> int:
    """Ceiling division on the host (``triton.cdiv`` is a JIT function: ~7 µs a call from Python)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


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
    try:
        return t.view(-1, n)
    except RuntimeError:
        return t.reshape(-1, n)
