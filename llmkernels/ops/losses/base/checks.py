"""The argument checks of the losses, each written once: TypeError / ValueError naming the
caller's argument."""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..._args import check_tensor
from .sharded import gathered

REDUCTIONS = ("mean", "sum", "none")
# ``memory=`` of the linear losses: "fast" sums the weight gradient over row chunks in a [V, H]
# buffer; "low" recomputes the logits over vocabulary chunks instead (one more matmul)
MEMORY_MODES = ("fast", "low")
# One default for every linear loss: the faster path, the one an LM's training step takes; "low"
# is the choice of a run bound by memory (benchmarks/RESULTS.md 2.6: 1.44x the time of "fast").
DEFAULT_MEMORY = "fast"


def check_ignore_index(ignore_index) -> None:
    if type(ignore_index) is not int and (isinstance(ignore_index, bool) or not isinstance(ignore_index, int)):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")


def check_reduction(reduction) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def check_chunk_size(name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")


def check_chunk_sizes(**sizes) -> None:
    """Each of ``sizes`` (argument name -> value) None or an int >= 1."""
    for name, value in sizes.items():
        check_chunk_size(name, value)


def check_temperature(temperature) -> float:
    if (isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature)
            or temperature <= 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    return float(temperature)


def check_loss_options(ignore_index, reduction, label_smoothing, z_loss, softcap) -> None:
    """The options shared by ``cross_entropy`` and ``linear_cross_entropy``."""
    check_ignore_index(ignore_index)
    check_reduction(reduction)
    if not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be a number in [0, 1], got {label_smoothing!r}")
    if not isinstance(z_loss, (int, float)) or not math.isfinite(z_loss) or z_loss < 0:
        raise ValueError(f"z_loss must be a finite number >= 0, got {z_loss!r}")
    if softcap is not None and (not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap <= 0):
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")


def check_fp32_or_none(name: str, dtype) -> None:
    """A dtype option that is torch.float32 or None (the inputs' dtype): ``accum_dtype``, ``logits_dtype``."""
    if dtype is not None and dtype is not torch.float32:
        raise ValueError(f"{name} must be torch.float32 or None, got {dtype!r}")


def check_chunking(chunk_size, accum_dtype, memory) -> None:
    """The chunking options shared by ``linear_cross_entropy`` and ``linear_distill_loss``."""
    check_chunk_size("chunk_size", chunk_size)
    check_fp32_or_none("accum_dtype", accum_dtype)
    if memory not in MEMORY_MODES:
        raise ValueError(f"memory must be one of {MEMORY_MODES}, got {memory!r}")


def check_target(target, m: int, like: torch.Tensor, rows_of: str) -> None:
    """Validate class indices ``target [m]`` for ``m`` rows of ``rows_of`` (an argument's name)."""
    check_tensor("target", target, like=like, like_name=rows_of, floating=False)
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target must be int64 or int32 class indices, got dtype {target.dtype}")
    if target.dim() != 1 or target.shape[0] != m:
        raise ValueError(f"target must have shape [{m}] (one class index per row of {rows_of}), "
                         f"got {list(target.shape)}")


def checked_head(hidden, weight, bias=None) -> tuple:
    """A loss's ``(hidden, weight, bias)``, checked as :func:`check_head` does; a DTensor weight
    or bias gathered for the call."""
    weight, bias = gathered(weight, hidden), gathered(bias, hidden)
    check_head("hidden", hidden, "weight", weight, "bias", bias)
    return hidden, weight, bias


def check_head(hidden_name: str, hidden, weight_name: str, weight, bias_name: str = "bias", bias=None, *,
               like: Optional[torch.Tensor] = None, like_name: str = "x") -> None:
    """Raise TypeError/ValueError naming the argument unless ``hidden [M, H]`` and ``weight
    [V, H]`` (V >= 1) are floating-point tensors of one dtype on one device (``like``'s, when
    given) and ``bias`` is None or ``[V]`` of weight's dtype."""
    check_tensor(hidden_name, hidden, like=like, like_name=like_name)
    if hidden.dim() != 2:
        raise ValueError(f"{hidden_name} must have shape [M, H], got {list(hidden.shape)}")
    check_tensor(weight_name, weight, like=hidden, like_name=hidden_name)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1] or weight.shape[0] == 0:
        raise ValueError(f"{weight_name} must have shape [V, H] = [V, {hidden.shape[1]}] (H of {hidden_name}) "
                         f"with V >= 1, got {list(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"{weight_name} dtype {weight.dtype} must equal {hidden_name} dtype {hidden.dtype}")
    if bias is not None:
        check_tensor(bias_name, bias, like=hidden, like_name=hidden_name)
        if bias.shape != weight.shape[:1] or bias.dtype != weight.dtype:
            raise ValueError(f"{bias_name} must have shape [{weight.shape[0]}] and dtype {weight.dtype}, "
                             f"got {list(bias.shape)} {bias.dtype}")
