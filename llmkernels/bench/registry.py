"""The op registry: everything the benchmark knows about an op, declared in one place.

An op family lives in one module ``llmkernels/bench/ops_<family>.py`` that builds :class:`BenchOp`
objects and passes each to :func:`register`. :func:`ops` imports every such module the first
time it is called, so adding an op family touches no other file.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch

Outputs = Union[torch.Tensor, tuple]
MODES = ("fwd", "bwd", "fwd+bwd")


class Unavailable(Exception):
    """Raised by a provider factory when the provider cannot run here (package not installed,
    torch too old, ...). The message is printed as the reason it was skipped."""


def need_module(module: str, package: str):
    """Import ``module`` or raise :class:`Unavailable` saying that ``package`` is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise Unavailable(f"{package} is not installed ({exc})") from None


def liger_function(module: str, name: str):
    """``liger_kernel.ops.<module>.<name>.apply``, or :class:`Unavailable` when liger-kernel or
    that function is missing."""
    ops = need_module(f"liger_kernel.ops.{module}", "liger-kernel")
    if not hasattr(ops, name):
        raise Unavailable(f"this liger-kernel has no {name}")
    return getattr(ops, name).apply


def compile_static(fn: Callable) -> Callable:
    """``torch.compile(fn)`` for a benchmark case: static shapes, no graph break, the dynamo
    cache reset first (so the recompile limit never silently sends a size back to eager), and
    donated buffers off (they forbid the repeated backward of one retained graph that the bwd
    mode times)."""
    torch.compiler.reset()
    import torch._functorch.config as functorch_config
    if hasattr(functorch_config, "donated_buffer"):
        functorch_config.donated_buffer = False
    return torch.compile(fn, dynamic=False, fullgraph=True)


@dataclass(frozen=True)
class Provider:
    """One implementation of an op.

    factory: called once per benchmark case; returns ``fwd(**inputs) -> Tensor | tuple of
        Tensors`` (the op's outputs in the op's order), or raises :class:`Unavailable`.
    backward: True when ``fwd`` is differentiable. The backward is then run the same way for
        every provider: ``torch.autograd.grad(outputs, [inputs[k] for k in op.grad_inputs],
        grad_outputs)``, so each provider computes every gradient the op declares.
    gpu_only: True when the provider cannot run on CPU tensors (no interpreter path): it is
        skipped, with that reason, on a machine without a GPU.
    mutates: True when a forward that needs gradients writes into its inputs (a gradient formed
        in the forward over the logits): each checked call gets its own copy of the inputs, the
        timed calls share one, and the bwd mode (a repeated backward of one forward) is not run.
    single_backward: True when the forward forms the gradients, so that a forward's backward
        runs once (no ``retain_graph``): the bwd mode is not run either.
    """

    factory: Callable[[], Callable[..., Outputs]]
    backward: bool = True
    gpu_only: bool = False
    mutates: bool = False
    single_backward: bool = False

    @property
    def repeats_backward(self) -> bool:
        """Whether the bwd mode (many backwards of one retained forward) can time it."""
        return self.backward and not (self.mutates or self.single_backward)


@dataclass(frozen=True)
class BenchOp:
    """An op as the benchmark sees it (``ops._register.Op`` is how an op registers itself).

    name: the ``--op`` name.
    axis: the shape dimension that sweeps (``--n`` values, the x axis of the plots).
    sizes: default values of ``axis``; quick_sizes: those of ``--quick``.
    shape: ``(size, rows) -> dict`` of named dims, e.g. ``{"M": 131072, "N": 1024}``; ``rows``
        is ``--m`` (None: the op's default: each tensor about 256 MiB in bf16, cross_entropy 2^30 logits).
    decode_shapes: small shapes timed as latency (µs); small_shapes: tiny shapes of the
        correctness-only run on a machine without a GPU.
    eager_shapes: a training micro-batch (M = 4096 rows at the width of the decode shapes),
        timed as µs per plain call (forward and forward + backward, as an eager user calls it).
    make_inputs: ``(shape, dtype, device) -> dict`` of input tensors, passed to providers as
        keyword arguments (random, never zeros).
    grad_inputs: names of the inputs that receive gradients in the bwd modes.
    outputs: names of the outputs, in the order providers return them (tables and errors).
    reference: the op's definition, called with the inputs upcast to float64; its outputs and
        gradients are what every provider is checked against.
    min_bytes: ``(shape, dtype, mode) -> int``: the fewest bytes the op must move through
        memory in that mode (each input read once, each output written once); GB/s uses it.
    providers: name -> :class:`Provider`, ``"llmkernels"`` first; the others are peers.
    is_loss: the output is a training loss: the backward starts from an upstream gradient of 1,
        as ``loss.backward()`` does (other ops get random upstream gradients).
    inputs_from_graph: in a model the inputs come out of earlier ops (the residual stream of a
        transformer block), never autograd leaves: when gradients are timed, providers get views
        of the leaves (the gradients still reach the leaves, through views). An op may then hand
        two inputs one gradient tensor, which it must not do for leaves (their ``.grad`` would
        alias).
    """

    name: str
    axis: str
    sizes: tuple
    quick_sizes: tuple
    shape: Callable[[int, Optional[int]], dict]
    decode_shapes: tuple
    small_shapes: tuple
    make_inputs: Callable[[dict, torch.dtype, torch.device], dict]
    grad_inputs: tuple
    outputs: tuple
    reference: Callable[..., Outputs]
    min_bytes: Callable[[dict, torch.dtype, str], int]
    providers: dict = field(default_factory=dict)
    eager_shapes: tuple = ()
    is_loss: bool = False
    inputs_from_graph: bool = False


_OPS: dict[str, BenchOp] = {}
_loaded = False


def register(op: BenchOp) -> BenchOp:
    if op.name in _OPS:
        raise ValueError(f"op {op.name!r} is registered twice")
    _OPS[op.name] = op
    return op


def ops() -> dict[str, BenchOp]:
    """All registered ops by name, in registration order (imports every ``ops_*`` module once)."""
    global _loaded
    if not _loaded:
        _loaded = True
        package = importlib.import_module(__package__)
        for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
            if info.name.startswith("ops_"):
                importlib.import_module(f"{__package__}.{info.name}")
    return dict(_OPS)
