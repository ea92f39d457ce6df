"""How the losses over an LM head (``ops/losses``: linear cross-entropy, log-probabilities,
distillation) cut their work, as frozen records.

The chunk sizes trade the cuBLAS matmuls' efficiency against the memory of one block of logits;
the kernels read rows of logits that cuBLAS wrote, at widths where every configuration measured
ran at the copy bandwidth. Neither follows the device model: a chunk is sized against the free
device memory when it is cut (``losses/base/chunks.py``).
"""
from __future__ import annotations

import dataclasses


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
    vocab_grad: RowKernel  # the gradient written over a vocabulary chunk's logits
    log_probs: RowKernel  # the log-probabilities' online pass over a row
    distill: RowKernel  # the distillation's passes over a row of each model
    results: str  # the measurements that chose them


DEFAULT_CONFIG = LinearLossConfig(
    rows_per_chunk=2048, chunk_bytes=256 * 2**20, low_memory_chunk_bytes=64 * 2**20, column_align=128,
    vocab_grad=RowKernel(block_v=4096, num_warps=8), log_probs=RowKernel(block_v=4096, num_warps=8),
    distill=RowKernel(block_v=4096, num_warps=8),
    results="e2e-h100-2026-11-22-session4-memory-variants.txt (rows a chunk); post-training-h100-2026-11-25/")
