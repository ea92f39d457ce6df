"""Sharded (DTensor) weights at the fused losses' entry points.

A fused loss reads its head weight directly, without running the head module, so it can meet a
``torch.distributed.tensor.DTensor`` where a plain tensor is expected: an FSDP2 (``fully_shard``)
parameter outside its module's forward (a head sharded as its own group, or ``lm_head.weight``
passed to ``linear_cross_entropy`` by hand), or a weight distributed by the user. ``gathered``
makes the whole weight for the call; its gradient goes back to the shards averaged over the
mesh, which is what FSDP2 and DDP do with the gradients of every other parameter.

Nothing here imports torch.distributed unless a DTensor arrives: processes that never shard pay
nothing.
"""
from __future__ import annotations


def is_dtensor(t) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (checked by name: importing
    torch.distributed costs every process that never shards)."""
    return type(t).__name__ == "DTensor" and hasattr(t, "device_mesh")


def gathered(weight, like=None):
    """``weight`` itself, or for a DTensor its full value as a plain tensor on every rank.

    Differentiable: the gradient of the full value is taken as a partial of every rank (each
    rank's loss is its own share of the batch) and averaged into the shards (a reduce-scatter
    along sharded mesh dimensions, an all-reduce along replicated ones), as FSDP2 and DDP
    average the gradients of the parameters they manage. Ranks whose losses are equal (tensor
    parallelism over the same tokens) get that one gradient. A DTensor of another floating dtype
    than ``like`` (the activations) is cast to it before the gather, as FSDP2's mixed precision
    (``param_dtype``) casts the parameters it gathers. None stays None.
    """
    if not is_dtensor(weight):
        return weight
    from torch.distributed.tensor import Partial

    if like is not None and weight.dtype != like.dtype and weight.is_floating_point() and like.is_floating_point():
        weight = weight.to(like.dtype)
    return weight.full_tensor(grad_placements=[Partial("avg")] * weight.device_mesh.ndim)
