"""How the losses over an LM head (``ops/losses``: linear cross-entropy, log-probabilities,
distillation, z-loss) cut their work, as frozen records.

The chunk sizes trade the cuBLAS matmuls' efficiency against the memory of one block of logits;
the kernels read rows of logits that cuBLAS wrote, at widths where every configuration measured
ran at the copy bandwidth. Neither follows the device model: a chunk is sized against the free
device memory when it is cut (``losses/base/chunks.py``).
"""
from __future__ import annotations

import dataclasses
import types
from typing import Mapping


@dataclasses.dataclass(frozen=True)
class RowKernel:
    """A kernel over rows of logits: ``block_v`` columns a program reads a step, ``num_warps``."""

    block_v: int
    num_warps: int


@dataclasses.dataclass(frozen=True)
class LinearLossConfig:
    """The chunking and the kernels of the linear losses (``DEFAULT_CONFIG``)."""

    # linear_cross_entropy(memory="fast"): rows a chunk, so that each chunk's weight-gradient matmul
    # does ~500 flops per byte of the [V, H] fp32 accumulator it reads and writes (compute-bound on
    # H100-class GPUs)
    rows_per_chunk: int
    # the other chunks (log-probabilities, distillation with memory="fast", vocabulary chunks):
    # logits of a block, large enough for the chunk's matmuls to run near cuBLAS's peak, small
    # beside the weight gradient they produce
    chunk_bytes: int
    # memory="low": logits of a chunk (its rows, or its vocabulary columns) of each model
    low_memory_chunk_bytes: int
    # vocabulary chunks of a multiple of this many columns keep every row of a block 16-byte
    # aligned for cuBLAS
    column_align: int
    # the row kernels by the pass that runs them (``kernel(name)``); a pass not named takes "default"
    kernels: Mapping[str, RowKernel]
    results: str  # the measurements that chose them

    def kernel(self, name: str) -> RowKernel:
        """The kernel of the pass ``name`` ("vocab_grad", "log_probs", "distill", ...)."""
        return self.kernels.get(name) or self.kernels["default"]


DEFAULT_CONFIG = LinearLossConfig(
    rows_per_chunk=2048, chunk_bytes=256 * 2**20, low_memory_chunk_bytes=64 * 2**20, column_align=128,
    kernels=types.MappingProxyType({name: RowKernel(block_v=4096, num_warps=8)
                                    for name in ("vocab_grad", "log_probs", "distill", "default")}),
    results="e2e-h100-2026-11-22-session4-memory-variants.txt (rows a chunk); post-training-h100-2026-11-25/")
