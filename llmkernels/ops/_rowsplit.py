"""Rows split across programs: the exchange of partial row results between the programs that
share a row (the split norm and cross-entropy kernels).

The programs sharing a row exchange partial results through slots in global memory. A slot is
an int64 that starts at zero: ``publish`` writes an fp32 value into its low word and a tag (1)
into its high word with one 64-bit atomic exchange, so the value is its own arrival flag;
``collect`` spins on volatile loads of the siblings' slots until every tag is set. No counter and
no release/acquire fence: a fence would wait for every store the program has in flight (the
previous row's output), which costs about a microsecond a row. Every program of the grid must be
resident at once: a grid of at most one program per multiprocessor guarantees it, or ``per_sm``
programs each held to ``resident_registers`` (their shared memory is small).
"""
from __future__ import annotations

import os

import torch

from ._args import cdiv
from ._device import persistent_programs
from ._launch import INTERPRET, INTERPRET_CONST
from ._triton import tl, triton

ROW_SPLIT = os.environ.get("LLMKERNELS_ROW_SPLIT", "1") != "0"


def split_grid(n: int, m: int, block_n: int, device: torch.device, per_sm: int = 1):
    """``(parts, groups)`` for ``m`` rows of ``n`` split over ``parts`` programs of ``block_n``
    columns, ``groups`` rows in flight, ``per_sm`` programs per multiprocessor (launched with at
    most ``resident_registers`` registers a thread). None where a split cannot run:
    LLMKERNELS_ROW_SPLIT=0, more parts than programs, or several parts under the interpreter
    (which runs programs one after another: one waiting for a sibling would never return)."""
    parts = cdiv(n, block_n)
    resident = persistent_programs(device, per_sm)
    if not ROW_SPLIT or parts > resident or (INTERPRET and parts > 1):
        return None
    return parts, max(1, min(m, resident // parts))


def resident_registers(num_warps: int, per_sm: int) -> int:
    """Registers a thread at most (Triton's ``maxnreg``) for ``per_sm`` programs of ``num_warps``
    to be resident on a multiprocessor at once (64K 32-bit registers; 255 at most a thread)."""
    return min(255, 65536 // (per_sm * num_warps * 32) // 8 * 8)


@triton.jit
def row_slice(X, row, stride_x, cols, M, N, other, EVICT_LAST: tl.constexpr = False):
    """Columns ``cols`` of row ``row`` of ``X`` in its dtype, ``other`` past column N; nothing
    is read for a row past the last (a program prefetching beyond its group's rows). EVICT_LAST:
    kept in L1 and L2 ahead of other lines (the slice is read again soon)."""
    mask = cols < tl.where(row < M, N, 0)
    if EVICT_LAST:
        return tl.load(X + row * stride_x + cols, mask=mask, other=other, eviction_policy="evict_last")
    return tl.load(X + row * stride_x + cols, mask=mask, other=other)


@triton.jit
def publish(SLOT, value):
    """``value`` (fp32) into the int64 ``SLOT`` with its tag, in one atomic exchange."""
    bits = value.to(tl.float32).to(tl.uint32, bitcast=True).to(tl.int64)
    tl.atomic_xchg(SLOT, bits | 0x100000000, sem="relaxed", scope="gpu")


@triton.jit
def publish_pair(SLOT, nonneg, value):
    """Two fp32 values in one slot: ``nonneg`` (>= 0, e.g. a sum of squares) in the high word
    with its sign bit set as the tag, ``value`` in the low word (``collect_pair`` reads them)."""
    high = (nonneg.to(tl.float32).to(tl.uint32, bitcast=True) | 0x80000000).to(tl.int64)
    low = value.to(tl.float32).to(tl.uint32, bitcast=True).to(tl.int64)
    tl.atomic_xchg(SLOT, (high << 32) | low, sem="relaxed", scope="gpu")


@triton.jit
def keep_packed(x):
    """``x`` unchanged, passed through an opaque move (inline assembly with a side effect) where
    it is used. A 2-byte tile that a program holds across a loop (a weight slice) and converts to
    fp32 in it is otherwise converted once, before the loop, by the compiler's hoisting, and held
    as fp32: twice its registers, which spill in the split LayerNorm forward. Other dtypes, and
    the interpreter, pass through."""
    if INTERPRET_CONST or x.dtype.primitive_bitwidth != 16:
        return x
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False, pack=2)


# PTX of one slot's wait, for ``collect`` in a loop that Triton pipelines (its pipeliner skips
# loops that hold loops, so there the spin cannot be a loop of the kernel): each thread loads
# its slot (a masked-off one, mask 0, reads as published zero) until the tag (high word) is set;
# a warp polls until every lane has its value, deciding by vote so that the branch is uniform
# (lanes branching each on its own slot measured slower, with or without a back-off).
_SPIN_ON_SLOT = tl.constexpr("""{
    .reg .pred %p_live, %p_unset, %p_any;
    setp.ne.s32 %p_live, $2, 0;
    mov.b64 $0, 0x100000000;
    SLOT_POLL:
    @%p_live ld.volatile.global.b64 $0, [$1];
    setp.lt.u64 %p_unset, $0, 0x100000000;
    vote.sync.any.pred %p_any, %p_unset, 0xffffffff;
    @%p_any bra.uni SLOT_POLL;
}""")


@triton.jit
def _collect_slots(SLOTS, mask, IN_PIPELINED_LOOP: tl.constexpr):
    """The int64 slots ``SLOTS`` (a block of pointers, any shape), once each one where ``mask`` is
    published; 0x100000000 (a tag, zero words) elsewhere. See ``collect``."""
    if IN_PIPELINED_LOOP and not INTERPRET_CONST:  # (no inline assembly under the interpreter)
        slots = tl.inline_asm_elementwise(_SPIN_ON_SLOT, "=l,l,r", [SLOTS, mask.to(tl.int32)], dtype=tl.int64,
                                          is_pure=False, pack=1)
    else:
        slots = tl.load(SLOTS, mask=mask, other=0x100000000, volatile=True)
        # (the high word unsigned: a ``publish_pair`` slot's has its sign bit set)
        while tl.min(tl.ravel(slots.to(tl.uint64, bitcast=True) >> 32), axis=0) == 0:
            slots = tl.load(SLOTS, mask=mask, other=0x100000000, volatile=True)
        # A block smaller than the program is held in several copies (threads), each loaded on
        # its own, and the loop's reduction need not look at every copy: a copy can still hold
        # an unpublished slot (seen on H100 as a zero taken for a sibling's part). Every slot is
        # published by now, so such copies load it again.
        stale = (slots >> 32) == 0
        slots = tl.where(stale, tl.load(SLOTS, mask=mask & stale, other=0x100000000, volatile=True), slots)
    return slots


@triton.jit
def _low_float(slots):
    return (slots & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)


@triton.jit
def collect(SLOTS, mask, IN_PIPELINED_LOOP: tl.constexpr = False):
    """fp32 values of the slots ``SLOTS`` (a block of pointers, any shape) where ``mask``, else 0.
    ``IN_PIPELINED_LOOP``: the spin in inline assembly (see ``_SPIN_ON_SLOT``); elsewhere a loop
    of volatile loads, which measured faster there."""
    return _low_float(_collect_slots(SLOTS, mask, IN_PIPELINED_LOOP))


@triton.jit
def collect_pair(SLOTS, mask, IN_PIPELINED_LOOP: tl.constexpr = False):
    """The two fp32 values of each slot written by ``publish_pair`` (high word's, low word's)
    where ``mask``, else 0 (``IN_PIPELINED_LOOP``: as ``collect``'s; the tag, the high word's
    sign bit, reads as set there too)."""
    slots = _collect_slots(SLOTS, mask, IN_PIPELINED_LOOP)
    return tl.where(mask, _low_float((slots >> 32) & 0x7FFFFFFF), 0.0), _low_float(slots)
