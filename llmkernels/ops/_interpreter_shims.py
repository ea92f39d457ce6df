"""Triton's interpreter made to behave as the GPU does where the kernels' CPU tests rely on it
(installed by ``_launch`` when ``TRITON_INTERPRET=1``): tensor loop bounds on older Triton,
fp32 -> bf16 rounded to nearest even, and loads and stores held to the launch's tensors."""
from __future__ import annotations

import numpy as np
from triton.runtime import interpreter

from ._triton import tl


def install() -> None:
    """Every shim, once (each leaves the interpreter as it is when installed already)."""
    loop_bounds_compat()
    bf16_rounding()
    bounds_check()


def loop_bounds_compat() -> None:
    """Triton < 3.7's interpreter turns a tensor loop bound (``range(tl.program_id(0), ...)``)
    into an int with ``int(array)`` of a 1-element 1-D array, which NumPy >= 2.5 refuses
    (TypeError: only 0-dimensional arrays ...); Triton 3.7+ squeezes first. Do the same there."""
    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "_llmkernels", False):
        return

    def patch_lang_tensor(tensor, scope, *args, **kwargs):
        patch_tensor(tensor, scope, *args, **kwargs)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor._llmkernels = True
    interpreter._patch_lang_tensor = patch_lang_tensor


def bf16_rounding() -> None:
    """Triton's interpreter converts fp32 to bf16 by dropping the low 16 bits (toward zero), where
    the GPU rounds to nearest even: convert as the GPU does, so that a kernel's results under the
    interpreter are its results on the GPU, and neither the kernels nor their references need a
    path of their own for the CPU."""
    builder = interpreter.InterpreterBuilder
    convert = getattr(builder, "cast_impl", None)
    if convert is None or getattr(convert, "_llmkernels", False):
        return

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return convert(self, src, dst_type)
        bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
        even = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        quiet_nan = (bits >> 16) | 0x40
        out = np.where((bits & 0x7FFFFFFF) > 0x7F800000, quiet_nan, even).astype(np.uint16)
        return interpreter.TensorHandle(out.reshape(np.shape(src.data)), tl.bfloat16)

    cast_impl._llmkernels = True
    builder.cast_impl = cast_impl


def _tensors_in(arg):
    """The tensors of a kernel argument: itself, a tuple's, a TMA descriptor's base."""
    if isinstance(arg, tuple):
        for a in arg:
            yield from _tensors_in(a)
    elif hasattr(arg, "untyped_storage"):
        yield arg
    elif hasattr(arg, "base") and hasattr(arg.base, "untyped_storage"):
        yield arg.base


def bounds_check() -> None:
    """Triton's interpreter loads and stores at any address a kernel computes, where the GPU
    faults or reads another tensor's bytes: refuse an unmasked load or store that falls outside
    every tensor argument of its launch, so that the CPU tests and fuzzer catch it."""
    executor, builder = interpreter.GridExecutor, interpreter.InterpreterBuilder
    init_args, load, store = (getattr(owner, name, None) for owner, name in (
        (executor, "_init_args_hst"), (builder, "create_masked_load"), (builder, "create_masked_store")))
    if None in (init_args, load, store) or getattr(init_args, "_llmkernels", False):
        return
    spans = {"starts": np.zeros(0, np.uint64), "ends": np.zeros(0, np.uint64)}  # the running launch's storages

    def init_args_hst(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        storages = {}
        for arg in (*args_hst, *kwargs_hst.values()):
            for t in _tensors_in(arg):
                storage = t.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        starts = sorted(storages)
        spans["starts"] = np.array(starts, np.uint64)
        spans["ends"] = np.array([start + storages[start] for start in starts], np.uint64)
        return args_hst, kwargs_hst

    def check(what, ptrs, mask):
        addresses = np.broadcast_to(np.asarray(ptrs.data, np.uint64), np.shape(mask.data))[np.asarray(mask.data, bool)]
        if addresses.size == 0:
            return
        size = np.uint64(interpreter._get_np_dtype(ptrs.get_element_ty()).itemsize)
        starts, ends = spans["starts"], spans["ends"]
        inside = np.zeros(addresses.shape, bool)
        if starts.size:
            owner = np.searchsorted(starts, addresses, side="right") - 1
            inside = (owner >= 0) & (addresses + size <= ends[np.maximum(owner, 0)])
        if not inside.all():
            outside = addresses[~inside]
            raise IndexError(f"{what} of {outside.size} element(s) outside every tensor argument of the launch (the "
                             f"first at address {int(outside[0]):#x}): on a GPU an illegal memory access or "
                             "another tensor's bytes")

    def masked_load(self, ptrs, mask, *args, **kwargs):
        check("a load", ptrs, mask)
        return load(self, ptrs, mask, *args, **kwargs)

    def masked_store(self, ptrs, value, mask, *args, **kwargs):
        check("a store", ptrs, mask)
        return store(self, ptrs, value, mask, *args, **kwargs)

    init_args_hst._llmkernels = True
    executor._init_args_hst = init_args_hst
    builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
