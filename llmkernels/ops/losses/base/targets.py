"""The target check of the losses: a target outside ``[0, V)`` that is not ``ignore_index``
raises ValueError, without waiting on the host for more than the small kernel that looks.

``start_target_check`` launches the search ahead of a loss's main kernels; ``finish_target_check``
reads its answer after they are queued. On a GPU the answer is a pinned host word that the
kernel writes itself (no copy back), read after the check kernel's event.
"""
from __future__ import annotations

import threading

import torch

from ..._launch import PlanCache, launcher_of, use_kernels
from ..._triton import tl, triton


@triton.jit
def _check_targets_kernel(T, ERR, M, V, ignore_index, BLOCK: tl.constexpr):
    """One program: ERR = 1 + the first row whose target is outside [0, V) and not
    ignore_index, or 0."""
    first_bad = tl.full([BLOCK], M, tl.int32)
    for start in range(0, M, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        t = tl.load(T + rows, mask=rows < M, other=ignore_index).to(tl.int64)
        first_bad = tl.minimum(first_bad, tl.where((t != ignore_index) & ((t < 0) | (t >= V)), rows, M))
    bad_row = tl.min(first_bad, axis=0)
    tl.store(ERR, tl.where(bad_row < M, bad_row + 1, 0).to(tl.int64))


def one_program(kernel, m: int, **switches):
    """The Launcher of a one-program kernel over M rows."""
    block, num_warps = (128, 4) if m <= 128 else (2048, 8)
    return launcher_of(kernel, **switches, BLOCK=block, num_warps=num_warps)


class _TargetFlag(threading.local):
    """Per thread: the host word the target check writes (pinned on a GPU: the kernel writes it
    through its device mapping, with no copy back; the host reads it after the check kernel's
    event, so a call's check is done before the next call's starts), and an event per device."""

    def __init__(self):
        self.words: dict = {}  # pinned or not -> int64 [1]
        self.events: dict = {}

    def word(self, pinned: bool) -> torch.Tensor:
        word = self.words.get(pinned)
        if word is None:
            word = self.words[pinned] = torch.empty(1, dtype=torch.int64, device="cpu", pin_memory=pinned)
        return word

    def event(self, device_index: int):
        event = self.events.get(device_index)
        if event is None:
            event = self.events[device_index] = torch.cuda.Event()
        return event


_FLAG = _TargetFlag()
_CHECK = PlanCache(lambda m: one_program(_check_targets_kernel, m))
# Whether the check kernel writes the pinned host word itself (unified addressing makes pinned host
# memory a kernel's to write); turned off, and the word copied back from the device instead, where
# Triton refuses it.
MAPPED_FLAG = True


def start_target_check(target: torch.Tensor, v: int, ignore_index: int):
    """Launch the search for a target outside ``[0, V)`` (not ``ignore_index``) ahead of the
    main kernel; ``finish_target_check`` reads its answer. On a GPU the host then waits for this
    small kernel only, not for the cross-entropy kernels queued after it, so the GPU does not
    idle while the host checks. None while a CUDA graph is being captured (no check then), and
    where no kernel can run (a CPU without Triton's interpreter: checked here, in PyTorch)."""
    if not use_kernels(target):
        check_target_range(target, v, ignore_index)
        return None
    m = target.shape[0]
    check = _CHECK[m]
    if not target.is_cuda:  # (the interpreter)
        word = _FLAG.word(False)
        check((1,), target, word, m, v, ignore_index)
        return word, None
    if torch.cuda.is_current_stream_capturing():
        return None
    word = _check_to_host(check, target, v, ignore_index)
    done = _FLAG.event(target.get_device())
    done.record()
    return word, done


def _check_to_host(check, target: torch.Tensor, v: int, ignore_index: int) -> torch.Tensor:
    """Launch ``check`` on a GPU's ``target`` writing the thread's pinned host word, or where
    Triton refuses host memory (then from now on) a device word copied back to the host."""
    global MAPPED_FLAG
    m = target.shape[0]
    if MAPPED_FLAG:
        word = _FLAG.word(True)
        try:
            check((1,), target, word, m, v, ignore_index)
            return word
        except ValueError:  # "Pointer argument cannot be accessed from Triton"
            MAPPED_FLAG = False
    on_device = target.new_empty(1, dtype=torch.int64)
    check((1,), target, on_device, m, v, ignore_index)
    return on_device.to("cpu", non_blocking=True)


def finish_target_check(pending, target: torch.Tensor, v: int, ignore_index: int) -> None:
    """Raise ValueError naming the first out-of-range target found by ``start_target_check``."""
    if pending is None:
        return
    word, done = pending
    if done is not None:
        done.synchronize()
    row = word.item() - 1
    if row >= 0:
        raise _outside(target, row, v, ignore_index)


def check_target_range(target: torch.Tensor, v: int, ignore_index: int) -> None:
    """The same check in PyTorch, waiting for it."""
    bad = (target != ignore_index) & ((target < 0) | (target >= v))
    if bad.any():
        raise _outside(target, int(bad.nonzero()[0, 0]), v, ignore_index)


def _outside(target: torch.Tensor, row: int, v: int, ignore_index: int) -> ValueError:
    return ValueError(f"target[{row}] = {int(target[row].item())} is outside [0, {v}) (the vocabulary size) and is "
                      f"not ignore_index ({ignore_index})")

