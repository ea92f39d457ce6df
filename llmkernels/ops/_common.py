"""Small helpers shared by the op families: where kernels run, argument checks, grid sizing."""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton import knobs

# Triton's interpreter runs the real kernel code on CPU tensors; it must be chosen before triton
# is imported, so it is read once here.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
INTERPRET_CONST = tl.constexpr(INTERPRET)


def _interpreter_loop_bounds_compat() -> None:
    """Triton < 3.7's interpreter turns a tensor loop bound (``range(tl.program_id(0), ...)``)
    into an int with ``int(array)`` of a 1-element 1-D array, which NumPy >= 2.5 refuses
    (TypeError: only 0-dimensional arrays ...); Triton 3.7+ squeezes first. Do the same there."""
    from triton.runtime import interpreter

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "_llmkernels", False):
        return

    def patch_lang_tensor(tensor, scope, *args, **kwargs):
        patch_tensor(tensor, scope, *args, **kwargs)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor._llmkernels = True
    interpreter._patch_lang_tensor = patch_lang_tensor


if INTERPRET:
    _interpreter_loop_bounds_compat()


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


@functools.lru_cache(maxsize=None)
def _shared_memory(device_index: int) -> int:
    return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


def fit_stages(stages: int, stage_bytes: int, device: torch.device) -> int:
    """``stages`` of Triton's software pipelining (< 2: none) for a loop that keeps ``stage_bytes``
    of loads in flight per stage, lowered until its ``stages - 1`` shared-memory buffers fit a
    program beside its reductions' scratch; 0 (no pipelining) when not even one fits."""
    if stages < 2 or device.type != "cuda":
        return stages
    index = device.index if device.index is not None else torch.cuda.current_device()
    fit = 1 + (_shared_memory(index) - 8192) // stage_bytes
    return min(stages, fit) if fit >= 2 else 0


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


# --------------------------------------------------------------------------------------------
# kernel launch with a cached dispatch
# --------------------------------------------------------------------------------------------
# Triton's ``kernel[grid](...)`` binds the arguments, formats a cache key as a string and looks
# up the compiled kernel on every call: ~25 µs of host time on an H100 host, more than the
# kernel itself at decode sizes. ``launch`` keys the compiled kernel on what Triton specializes
# it on (each tensor's dtype and 16-byte alignment; each int's equality to 1, divisibility by
# 16 and width; the constexprs and launch options) and calls its C launcher directly after the
# first call. The first call for a key goes through Triton, which compiles and launches.
_COMPILED: dict = {}


def launch(kernel, grid: tuple, *args, num_warps: int, **constexprs) -> None:
    """``kernel[grid](*args, num_warps=num_warps, **constexprs)``, with the compiled kernel
    cached by this module. ``args`` are the kernel's runtime arguments in order; ``constexprs``
    name every remaining parameter. Under the interpreter this is the plain Triton call."""
    if INTERPRET:
        kernel[grid](*args, num_warps=num_warps, **constexprs)
        return
    device = torch.cuda.current_device()
    key = (kernel, device, num_warps, *constexprs.items(),
           *[(a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else
             (a == 1, a % 16 == 0, -0x80000000 <= a <= 0x7FFFFFFF) if type(a) is int else type(a) for a in args])
    entry = _COMPILED.get(key)
    if entry is None:
        compiled = kernel[grid](*args, num_warps=num_warps, **constexprs)
        _COMPILED[key] = (compiled, tuple(constexprs[name] for name in kernel.arg_names[len(args):]))
        return
    compiled, tail = entry
    stream = torch._C._cuda_getCurrentRawStream(device)
    enter_hook = knobs.runtime.launch_enter_hook  # a HookChain (Triton >= 3.5): metadata only if hooked
    hooked = enter_hook is not None and getattr(enter_hook, "calls", True)
    metadata = compiled.launch_metadata(grid, stream, *args, *tail) if hooked else None
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                 compiled.function, compiled.packed_metadata, metadata, enter_hook,
                 knobs.runtime.launch_exit_hook, *args, *tail)


# --------------------------------------------------------------------------------------------
# rows split across programs
# --------------------------------------------------------------------------------------------
# The programs sharing a row exchange partial results through slots in global memory. A slot
# is an int64 that starts at zero: ``publish`` writes an fp32 value into its low word and a tag
# (1) into its high word with one 64-bit atomic exchange, so the value is its own arrival flag;
# ``collect`` spins on volatile loads of the siblings' slots until every tag is set. No counter
# and no release/acquire fence: a fence would wait for every store the program has in flight
# (the previous row's output), which measured ~1 us a row on H100. Every program of the grid
# must be resident at once: a grid of at most one program per multiprocessor guarantees it, or
# ``per_sm`` programs each held to ``resident_registers`` (their shared memory is small).
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
    as fp32: twice its registers (the split forward's LayerNorm slice at 8 warps, 2 programs an
    SM: 128 registers and 64 B spilled a thread, 124 and none with this; H100 bf16 92.3 -> 93.4%
    of copy). Other dtypes, and the interpreter, pass through."""
    if INTERPRET_CONST or x.dtype.primitive_bitwidth != 16:
        return x
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False, pack=2)


# PTX of one slot's wait, for ``collect`` in a loop that Triton pipelines (its pipeliner skips
# loops that hold loops, so there the spin cannot be a loop of the kernel): each thread loads
# its slot (a masked-off one, mask 0, reads as published zero) until the tag (high word) is set;
# a warp polls until every lane has its value, deciding by vote so that the branch is uniform.
# (Each lane branching on its own slot measured 80-83% of copy for the bf16 RMSNorm backward at
# 65536-131072 on H100, 91-93 with a back-off between its polls; the vote 92-93 without one.)
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
        # an unpublished slot (measured on H100: 14 of 120 cross-entropy calls took a zero for a
        # sibling's part). Every slot is published by now, so such copies load it again.
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
    of volatile loads, which measured faster there (the split RMSNorm forward without statistics:
    90% of copy against 76 on H100)."""
    return _low_float(_collect_slots(SLOTS, mask, IN_PIPELINED_LOOP))


@triton.jit
def collect_pair(SLOTS, mask):
    """The two fp32 values of each slot written by ``publish_pair`` (high word's, low word's)
    where ``mask``, else 0."""
    slots = _collect_slots(SLOTS, mask, False)
    return tl.where(mask, _low_float((slots >> 32) & 0x7FFFFFFF), 0.0), _low_float(slots)
