"""One description of an op, registered for eager calls and for torch.compile.

An op family describes each differentiable op once, as an :class:`Op`: its forward launcher,
what the backward needs (``setup``), the backward itself, the fake (meta) functions of its
outputs and the schemas of its custom ops. From that one description the Op builds

  - the eager path: a ``torch.autograd.Function`` whose forward runs the launcher and
    ``setup`` and whose backward runs ``backward`` with the backward launcher;
  - the torch.compile path: the custom ops ``llmkernels::<name>_fwd`` and ``<name>_bwd`` with
    their fake kernels, and ``register_autograd`` with ``setup`` and ``backward`` calling the
    backward op (an op that is its own derivative has one custom op, ``llmkernels::<name>``);
  - the dispatch, ``op(*args)``: the custom op under torch.compile; the Function when an input
    of ``grad_inputs`` needs a gradient; otherwise the launcher alone, with no autograd node.

Conventions the descriptions follow:
  - Launchers return a tensor or a tuple of outputs, None for an output that is absent (a
    residual sum without a residual). A custom op may neither return None nor outputs that
    alias each other, so it returns a distinct empty placeholder there: ``setup`` and
    ``backward`` tell what is absent from the inputs, never from the outputs.
  - Positional arguments are the custom op's. Keyword arguments of a call are eager-only
    options of the launchers (a launch configuration for tests and tuning; what the eager
    backward may do that a custom op may not): ``forward``, ``infer`` and ``setup`` receive them,
    and ``backward`` may pass them on to its launcher; under torch.compile they are dropped.
"""
from __future__ import annotations

import types
from typing import Callable, Optional, Sequence

import torch

_NAMESPACE = "llmkernels"

# Autograd's C++ apply, which ``Function.apply`` calls last. The Python steps before it act on
# functorch's transforms (and on Functions with a ``setup_context``, which these are not), so
# outside a transform the Op calls it directly. Not public API: guarded, ``Function.apply`` the
# fallback.
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", None)


def _c_apply(function) -> Optional[Callable]:
    """The C++ apply bound to ``function`` (a Function class), or None where this torch has none."""
    if _functorch_active is None:
        return None
    apply = getattr(super(torch.autograd.Function, function), "apply", None)
    return apply if isinstance(apply, types.BuiltinMethodType) else None


def _placeholder(like: torch.Tensor) -> torch.Tensor:
    """An empty tensor standing for an absent output of a custom op."""
    return like.new_empty(0, dtype=torch.float32)


def _with_placeholders(outputs, like: torch.Tensor):
    """``outputs`` of a launcher as a custom op returns them: a placeholder for each None."""
    if not isinstance(outputs, tuple):
        return outputs
    return tuple(_placeholder(like) if t is None else t for t in outputs)


def _custom_op(name: str, schema: str, launcher: Callable, fake: Callable, mutates: Sequence[str]):
    """``llmkernels::<name>`` running ``launcher`` (absent outputs as placeholders), with ``fake``
    as its fake kernel; both take the op's arguments positionally."""
    def run(*args):
        return _with_placeholders(launcher(*args), args[0])

    def run_fake(*args):
        return _with_placeholders(fake(*args), args[0])

    op = torch.library.custom_op(f"{_NAMESPACE}::{name}", run, mutates_args=tuple(mutates), schema=schema)
    op.register_fake(run_fake)
    return op


def _dropping_options(op):
    """``op`` called as a launcher is: keyword arguments (eager-only options) are dropped."""
    return lambda *args, **options: op(*args)


def _argument_names(schema: str) -> list[str]:
    """The argument names of a schema ``"(Tensor(a0!) q, Tensor? k, ...) -> ..."``."""
    return [arg.split()[-1].split("=")[0] for arg in schema[1:schema.rindex(") ->")].split(",")]


def _input_grads(positions: tuple, n_inputs: int, grads) -> tuple:
    """One gradient per input: ``grads`` at ``positions``, None elsewhere."""
    out = [None] * n_inputs
    for i, g in zip(positions, grads):
        out[i] = g
    return tuple(out)


class Op:
    """A differentiable op described once, callable as ``op(*args, **options)`` (see the module
    notes). The description:

    Args:
        name: the custom ops' name (``llmkernels::<name>_fwd`` ...), and the autograd node's.
        forward: the forward launcher, ``forward(*args, **options) -> outputs``.
        setup: ``setup(ctx, inputs, outputs, **options)``: saves what the backward needs
            (``ctx.save_for_backward`` and attributes), on both paths.
        backward: ``backward(ctx, bwd, *grad_outputs) -> gradients`` of the inputs at
            ``grad_inputs``, in order; ``bwd`` is ``backward_launcher`` (eager) or its custom op
            (compiled), or for an op without one this op itself (its own derivative).
        grad_inputs: positions of the inputs whose ``requires_grad`` makes a call record an
            autograd node (the backward returns their gradients, None where there is none).
        schema, fake: the forward custom op's schema and fake function (``fake(*args)``, outputs
            as the launcher returns them). Without a schema the Op is an eager-only variant of
            ``base``.
        backward_launcher, backward_schema, backward_fake: the same for the backward.
        infer: the launcher of a call that needs no gradient (default ``forward``).
        returns: how many of the outputs the caller gets (the rest exist for ``setup``);
            default all.
        non_differentiable: positions of outputs marked non-differentiable (eager).
        once: set when the eager backward consumes what the forward saved (scales a gradient
            in place): the error message of a second backward through the same call.
        once_differentiable: the eager backward is not differentiable (no double backward).
        mutates: names of the arguments the op writes in place (registered without autograd:
            under torch.compile a call that needs a gradient takes an out-of-place op); the
            eager Function marks them dirty and returns them.
        base: for an eager-only variant (no schema), the op (or function with the same
            arguments) that a call needing no gradient, or under torch.compile, goes to.
    """

    def __init__(self, name: str, *, forward: Callable, setup: Callable, backward: Callable,
                 grad_inputs: tuple, schema: Optional[str] = None, fake: Optional[Callable] = None,
                 backward_launcher: Optional[Callable] = None, backward_schema: Optional[str] = None,
                 backward_fake: Optional[Callable] = None, infer: Optional[Callable] = None,
                 returns: Optional[int] = None, non_differentiable: tuple = (), once: Optional[str] = None,
                 once_differentiable: bool = False, mutates: tuple = (), base: Optional[Callable] = None):
        self.forward, self.infer = forward, infer or forward
        self.setup, self.backward, self.grad_inputs = setup, backward, grad_inputs
        self.backward_launcher = backward_launcher
        self.returns, self.non_differentiable, self.once = returns, non_differentiable, once
        self.base = base
        # positions of the mutated arguments, from the schema's names
        self._mutated = tuple(_argument_names(schema).index(m) for m in mutates)
        self.function = self._autograd_function(name, once_differentiable)
        self._c_apply = _c_apply(self.function)
        self.op = self.backward_op = None
        if schema is None:
            return
        suffix = "" if backward_launcher is None else "_fwd"
        self.op = _custom_op(name + suffix, schema, forward, fake, mutates)
        if mutates:
            return
        if backward_launcher is not None:
            self.backward_op = _dropping_options(
                _custom_op(name + "_bwd", backward_schema, backward_launcher, backward_fake, ()))
        self.op.register_autograd(self._compiled_backward, setup_context=self._compiled_setup)

    # ---------------------------------------------------------------------------------------
    # dispatch
    # ---------------------------------------------------------------------------------------
    def needs_grad(self, args) -> bool:
        """Whether a call on ``args`` records an autograd node."""
        if not torch.is_grad_enabled():
            return False
        for i in self.grad_inputs:
            t = args[i]
            if t is not None and t.requires_grad:
                return True
        return False

    def __call__(self, *args, **options):
        if torch.compiler.is_compiling():
            if self.op is None:
                return self.base(*args, **options)
            outputs = self.op(*args)
            return outputs if self.returns is None else outputs[:self.returns]
        if torch.is_grad_enabled():
            for i in self.grad_inputs:  # (``needs_grad`` inline: every eager call takes this path)
                t = args[i]
                if t is not None and t.requires_grad:
                    return self._apply(*args, options)
        if self.op is None:
            return self.base(*args, **options)
        outputs = self.infer(*args, **options)
        return outputs if self.returns is None else outputs[:self.returns]

    def _apply(self, *args_and_options):
        """``self.function.apply``: straight into autograd's C++ apply where nothing of the
        Python ``Function.apply`` applies (no functorch transform is active; the Function defines
        no ``setup_context``), else through it."""
        if self._c_apply is not None and not _functorch_active():
            return self._c_apply(*args_and_options)
        return self.function.apply(*args_and_options)

    # ---------------------------------------------------------------------------------------
    # the two backward paths
    # ---------------------------------------------------------------------------------------
    def _compiled_setup(self, ctx, inputs, output):
        self.setup(ctx, inputs, output)

    def _compiled_backward(self, ctx, *grad_outputs):
        bwd = self.backward_op if self.backward_op is not None else self.op
        return _input_grads(self.grad_inputs, len(ctx.needs_input_grad), self.backward(ctx, bwd, *grad_outputs))

    def _autograd_function(self, name: str, once_differentiable: bool):
        """The eager ``torch.autograd.Function``: what a hand-written one does, each step chosen
        here rather than on every call."""
        launch, setup, backward, once = self.forward, self.setup, self.backward, self.once
        mutated, non_differentiable, returns, grad_inputs = (self._mutated, self.non_differentiable, self.returns,
                                                             self.grad_inputs)
        bwd = self.backward_launcher if self.backward_launcher is not None else self
        # The gradients of the first inputs, then None for the others and the options.
        leading = grad_inputs == tuple(range(len(grad_inputs)))

        def forward(ctx, *args_and_options):
            # The options come last, so that ``ctx.needs_input_grad[i]`` is the i-th input's on
            # both paths.
            args, options = args_and_options[:-1], args_and_options[-1]
            outputs = launch(*args, **options)
            setup(ctx, args, outputs, **options)
            if once is not None:
                ctx.consumed = False
            if mutated:
                dirty = [args[i] for i in mutated if args[i] is not None]
                ctx.mark_dirty(*dirty)
                return dirty[0] if len(dirty) == 1 else tuple(dirty)
            if non_differentiable:
                ctx.mark_non_differentiable(*[outputs[i] for i in non_differentiable if outputs[i] is not None])
            return outputs if returns is None else outputs[:returns]

        def gradients(ctx, *grad_outputs):
            if once is not None:
                if ctx.consumed:
                    raise RuntimeError(once)
                ctx.consumed = True
            grads = backward(ctx, bwd, *grad_outputs)
            if leading:
                return (*grads, *(None,) * (len(ctx.needs_input_grad) - len(grads)))
            return _input_grads(grad_inputs, len(ctx.needs_input_grad) - 1, grads) + (None,)

        backward_ = gradients
        if once_differentiable:
            # torch's wrapper runs the backward under no_grad and, when a graph of the backward is
            # being recorded (create_graph=True), makes its outputs raise on a second
            # differentiation; a plain backward (grad mode off) needs neither.
            recorded = torch.autograd.function.once_differentiable(gradients)

            def backward_(ctx, *grad_outputs):
                if torch.is_grad_enabled():
                    return recorded(ctx, *grad_outputs)
                return gradients(ctx, *grad_outputs)

        # A class of the op's name, for autograd's node names (``<Name>Backward``).
        title = "".join(part.title() for part in name.split("_"))
        return type(title, (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(backward_)})
