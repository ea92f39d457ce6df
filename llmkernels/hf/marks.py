"""How a replacement made by llmkernels is recognised: ``patch`` and ``patch_model_type`` skip
what is already theirs, which makes both idempotent."""
from __future__ import annotations

from typing import Callable


def mark(fn: Callable) -> Callable:
    """Tag ``fn`` as an llmkernels replacement."""
    fn._llmkernels = True
    return fn


def is_patched(fn) -> bool:
    """True when ``fn`` (a function, or a method bound to a module or class) is an llmkernels
    replacement."""
    return getattr(getattr(fn, "__func__", fn), "_llmkernels", False)
