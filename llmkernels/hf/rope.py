"""RoPE: wrappers of a modeling module's RoPE function that call ``llmkernels.apply_rope``
where its inputs fit the kernel and the original function otherwise.

Partial rotary (GPT-NeoX, Phi-3) rotates the first ``cos.shape[-1]`` channels; gpt-oss's
half-width tables serve both halves; the multimodal RoPE of Qwen2-VL, Qwen2.5-VL and Qwen3-VL
is folded into per-token cos/sin before the function is called; Llama 4's complex
``apply_rotary_emb`` rotates pairs ``(2i, 2i + 1)``.
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch

from ..ops.rope import apply_rope
from .marks import mark


def _rotate_half_wrapper(original: Callable, half_table: bool = False) -> Callable:
    """Wrap ``apply_rotary_pos_emb(q, k, cos, sin, ..., unsqueeze_dim=1)``: the kernel where it
    fits (4-D q/k, per-token cos/sin ``[B, S, R]`` of q's dtype; ``R < D`` is partial rotary,
    channels past R pass through), else ``original``. ``half_table``: cos/sin are
    ``[B, S, D / 2]``, used for both halves of the head (gpt-oss)."""
    params = list(inspect.signature(original).parameters)
    unsqueeze_pos = params.index("unsqueeze_dim") - 4 if "unsqueeze_dim" in params else None

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        unsqueeze_dim = kwargs.get("unsqueeze_dim", 1)
        if unsqueeze_pos is not None and len(args) > unsqueeze_pos:
            unsqueeze_dim = args[unsqueeze_pos]
        layout = {1: "bhsd", 2: "bshd"}.get(unsqueeze_dim)
        width = cos.shape[-1] * (2 if half_table else 1)
        if (layout is None or q.dim() != 4 or k is None or k.dim() != 4 or cos.dim() != 3
                or not (q.dtype == k.dtype == cos.dtype == sin.dtype) or width > q.shape[-1]
                or (half_table and width != q.shape[-1])
                or (torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad))):
            return original(q, k, cos, sin, *args, **kwargs)
        if half_table:
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        return apply_rope(q, k, cos, sin, layout=layout)

    apply_rotary_pos_emb._llmkernels_original = original
    return mark(apply_rotary_pos_emb)


def _complex_wrapper(original: Callable) -> Callable:
    """Wrap Llama 4's ``apply_rotary_emb(xq, xk, freqs_cis)``: q/k ``[B, S, H, D]`` times the
    complex ``freqs_cis [B, S, D / 2]`` on feature pairs ``(2i, 2i + 1)`` in fp32, which is
    ``apply_rope(interleaved=True)`` with cos/sin its real/imaginary parts repeated per pair;
    else ``original``."""
    @functools.wraps(original)
    def apply_rotary_emb(xq, xk, freqs_cis):
        if (xq.dim() != 4 or xk.dim() != 4 or freqs_cis.dim() != 3 or not freqs_cis.is_complex()
                or 2 * freqs_cis.shape[-1] != xq.shape[-1] or freqs_cis.requires_grad):
            return original(xq, xk, freqs_cis)
        cos = freqs_cis.real.repeat_interleave(2, dim=-1)
        sin = freqs_cis.imag.repeat_interleave(2, dim=-1)
        return apply_rope(xq, xk, cos, sin, layout="bshd", interleaved=True)

    apply_rotary_emb._llmkernels_original = original
    return mark(apply_rotary_emb)


# Family.rope -> (the modeling module's function, its wrapper)
WRAPPERS = {
    "rotate_half": ("apply_rotary_pos_emb", _rotate_half_wrapper),
    "half_table": ("apply_rotary_pos_emb", functools.partial(_rotate_half_wrapper, half_table=True)),
    "complex": ("apply_rotary_emb", _complex_wrapper),
}
