"""The one place the op families get Triton from, and what stands in for it where it is missing.

Triton ships for Linux only. Without it (macOS, Windows, or not installed) ``import llmkernels``
still works: the kernel definitions below become inert (``jit`` keeps the function and refuses
to launch it), ``HAVE_TRITON`` is False, ``_launch.use_kernels`` then answers False for every
tensor and every op computes ``llmkernels.reference`` in plain PyTorch. One ``UserWarning`` at
import says so.
"""
from __future__ import annotations

import functools
import types
import warnings

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

HAVE_TRITON = triton is not None

try:  # x read through a tensor descriptor made on the host (Triton 3.4+): what TMA copies from
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None

try:  # the launcher's hooks live in ``triton.knobs`` from Triton 3.4 (older versions: see _launch.Launcher)
    from triton import knobs
except ImportError:
    knobs = None


class _Inert:
    """A kernel defined without Triton: kept for its name and docstring, never launched."""

    def __init__(self, fn):
        functools.update_wrapper(self, fn)

    def __getitem__(self, grid):
        raise RuntimeError(f"{self.__name__} is a Triton kernel and Triton is not installed")


def _inert_jit(fn=None, **options):
    return _Inert(fn) if fn is not None else _Inert


if not HAVE_TRITON:
    warnings.warn("Triton is not installed: llmkernels ops run in plain PyTorch (llmkernels.reference), "
                  "without their fused kernels. Install triton (Linux) to use the kernels.", UserWarning,
                  stacklevel=2)
    # What the op modules use of Triton while defining their kernels (not when running them).
    triton = types.SimpleNamespace(jit=_inert_jit)
    tl = types.SimpleNamespace(constexpr=lambda value=None: value)
