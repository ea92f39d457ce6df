"""Norms of tensor-parallel (DTensor) models: the kernel runs on the local shard.

The input may be sharded along any dimension but the normalized (last) one; the weight / bias
replicated (their gradient is reduced as DTensor prescribes) or sharded (gathered with
``full_tensor()``). FSDP2 (``fully_shard``) unshards parameters before each forward, so plain
tensors reach the kernel and need nothing from here.
"""
from __future__ import annotations

from ..ops.losses.base import is_dtensor


def norm_call(fn, x, weight, bias, **kwargs):
    """``fn(x, weight, bias, **kwargs)``, on the local shards when any of them is a DTensor."""
    if is_dtensor(x) or is_dtensor(weight) or is_dtensor(bias):
        return _norm_on_local_shards(fn, x, weight, bias, **kwargs)
    return fn(x, weight, bias, **kwargs)


def _norm_on_local_shards(fn, x, weight, bias, **kwargs):
    """``fn(x, weight, bias)`` when x or a parameter is a DTensor: the kernel runs on x's local
    shard; the result has x's placements."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = placements = None
    if isinstance(x, DTensor):
        mesh, placements = x.device_mesh, x.placements
        for p in placements:
            if isinstance(p, Shard) and p.dim % x.dim() == x.dim() - 1:
                raise ValueError("the norm's input is sharded along its last (normalized) dimension; "
                                 "llmkernels norms need whole rows on each rank (shard another dim)")
            if not isinstance(p, (Shard, Replicate)):
                raise ValueError(f"the norm's input has placement {p}; expected Shard or Replicate")
        x = x.to_local()

    def local(p):
        if not isinstance(p, DTensor):
            return p
        if all(isinstance(q, Replicate) for q in p.placements):
            # Rows are split across ranks where x is sharded: each rank's dW is a partial sum.
            grads = [Partial() if isinstance(q, Shard) else Replicate() for q in (placements or p.placements)]
            return p.to_local(grad_placements=grads if placements is not None else None)
        return p.full_tensor()

    y = fn(x, local(weight), local(bias), **kwargs)
    return DTensor.from_local(y, mesh, placements, run_check=False) if mesh is not None else y
