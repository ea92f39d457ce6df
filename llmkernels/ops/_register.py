"""One description of an op, registered for eager calls and for torch.compile: :class:`Op`.

An op family describes each differentiable op once: its forward launcher and that launcher's
fake (meta) function, and the backward with what it needs saved. From that the Op builds the
eager ``torch.autograd.Function``, the custom ops ``llmkernels::<name>`` (or ``<name>_fwd`` and
``<name>_bwd``) with their fakes and ``register_autograd``, and the dispatch between them on
every call. ``torch.library.custom_op`` alone would do the registration, but its eager call
costs about 30 us more on the host than this dispatch (ARCHITECTURE.md, "Registering an op").

Each convention is stated where the code that relies on it stands: the schema and the options
record at :meth:`Signature.of`, absent outputs at :func:`_with_placeholders`, eager-only options
at :meth:`Op.__call__`, and the description's parts at :class:`Op`.
"""
from __future__ import annotations

import inspect
import types
import typing
from typing import Callable, NamedTuple, Optional

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
    """``outputs`` of a launcher as a custom op returns them: a placeholder for each None.

    A launcher returns None for an output that is absent (a residual sum without a residual);
    a custom op may neither return None nor outputs that alias each other, so it returns a
    distinct empty placeholder there. Hence ``setup`` and ``backward`` tell what is absent from
    the inputs or the options, never from the outputs."""
    if not isinstance(outputs, tuple):
        return outputs
    return tuple(_placeholder(like) if t is None else t for t in outputs)


# --------------------------------------------------------------------------------------------
# the schema, read from a launcher's annotations and its options record
# --------------------------------------------------------------------------------------------
_SCHEMA_TYPES = {torch.Tensor: "Tensor", bool: "bool", int: "SymInt", float: "float", str: "str",
                 torch.dtype: "ScalarType"}


def _schema_type(hint) -> str:
    """The schema type of an annotation: ``Optional[X]`` is ``X?``, ``tuple[X, ...]`` is ``X[]``."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return _schema_type(inner) + "?"
    if typing.get_origin(hint) is tuple:
        return _SCHEMA_TYPES[args[0]] + "[]"
    return _SCHEMA_TYPES[hint]


def _is_record(hint) -> bool:
    return isinstance(hint, type) and issubclass(hint, tuple) and hasattr(hint, "_fields")


def _record_fields(record: type, prefix: str = "") -> list:
    """``(schema type, name, index path)`` of a record's fields in order, a nested record's
    flattened in its place (its fields' names prefixed with its own, their paths with its index)."""
    hints = typing.get_type_hints(record)
    fields = []
    for i, name in enumerate(record._fields):
        if _is_record(hints[name]):
            nested = _record_fields(hints[name], f"{prefix}{name}_")
            fields += [(kind, inner, (i, *path)) for kind, inner, path in nested]
        else:
            fields.append((_schema_type(hints[name]), prefix + name, (i,)))
    return fields


def _builder(record: type) -> Callable:
    """``build(values)``: the record of an iterator over its flat fields' values (a list, as a
    custom op receives a ``X[]``, rebuilt as the tuple the record holds)."""
    hints = typing.get_type_hints(record)
    parts = [_builder(hints[name]) if _is_record(hints[name])
             else (lambda values: tuple(next(values))) if typing.get_origin(hints[name]) is tuple
             else next for name in record._fields]
    return lambda values: record(*[part(values) for part in parts])


def flattener(record: type) -> Callable:
    """``flatten(options)``: a ``record``'s values in the order of ``_record_fields``, the custom
    op's arguments after the tensors. Its paths are resolved here, once, so that what runs under
    torch.compile is tuple indexing alone (Dynamo cannot trace ``hasattr`` on a record's class)."""
    paths = tuple(path for _, _, path in _record_fields(record))

    def flatten(options: tuple) -> tuple:
        values = []
        for path in paths:
            value = options
            for i in path:
                value = value[i]
            values.append(value)
        return tuple(values)
    return flatten


def flat_fields(options: tuple) -> tuple:
    """A record's flat values (``flattener``'s), e.g. for ``torch.library.opcheck`` in tests."""
    return flattener(type(options))(options)


class Signature(NamedTuple):
    """A launcher's custom-op signature: ``tensors`` (the names of its tensor arguments),
    ``schema``, ``build`` (its options record from the flat fields that follow them) and
    ``flatten`` (those fields of a record).

    A launcher takes its tensors, then one ``options`` record (a ``typing.NamedTuple`` of the
    op's options: the one place they are named), then keyword-only eager options. The schema is
    read from its annotations: the tensors (``Optional[Tensor]``: may be None), the record's
    fields flattened after them (a custom op takes only flat scalars; a nested record's fields
    prefixed with its name), and the outputs (``-> Tensor`` or ``-> tuple[Tensor, ...]``). The
    custom op rebuilds the record from the fields, so launchers, fakes, ``setup`` and
    ``backward`` only ever see the record."""

    tensors: tuple
    schema: str
    build: Callable
    flatten: Callable

    @classmethod
    def of(cls, launcher: Callable, mutates: tuple = ()) -> "Signature":
        hints = typing.get_type_hints(launcher)
        *tensors, record = [name for name, p in inspect.signature(launcher).parameters.items()
                            if p.kind is p.POSITIONAL_OR_KEYWORD]
        args = [_schema_type(hints[name]).replace("Tensor", f"Tensor(a{mutates.index(name)}!)" if name in mutates
                                                  else "Tensor") + " " + name for name in tensors]
        args += [f"{kind} {name}" for kind, name, _ in _record_fields(hints[record])]
        returns = hints.get("return", type(None))
        if returns is type(None):
            outputs = "()"
        elif typing.get_origin(returns) is tuple:
            outputs = "(" + ", ".join("Tensor" for _ in typing.get_args(returns)) + ")"
        else:
            outputs = "Tensor"
        return cls(tuple(tensors), f"({', '.join(args)}) -> {outputs}", _builder(hints[record]),
                   flattener(hints[record]))

    def split(self, flat: tuple) -> tuple:
        """``(tensors, options)`` of a custom op's flat arguments."""
        n = len(self.tensors)
        return flat[:n], self.build(iter(flat[n:]))


def _custom_op(name: str, launcher: Callable, fake: Callable, mutates: tuple):
    """``llmkernels::<name>`` running ``launcher`` (absent outputs as placeholders), with ``fake``
    as its fake kernel, and its :class:`Signature`."""
    signature = Signature.of(launcher, mutates)

    def run(*flat):
        tensors, options = signature.split(flat)
        return _with_placeholders(launcher(*tensors, options), flat[0])

    def run_fake(*flat):
        tensors, options = signature.split(flat)
        return _with_placeholders(fake(*tensors, options), flat[0])

    op = torch.library.custom_op(f"{_NAMESPACE}::{name}", run, mutates_args=mutates, schema=signature.schema)
    op.register_fake(run_fake)
    return op, signature


def _flattening(op, signature: Signature):
    """``op`` called as a launcher is, ``op(*tensors, options, **eager)``: the record's fields
    flattened after the tensors, the eager-only options dropped."""
    return lambda *args, **eager: op(*args[:-1], *signature.flatten(args[-1]))


def _input_grads(positions: tuple, n_inputs: int, grads) -> tuple:
    """One gradient per input: ``grads`` at ``positions``, None elsewhere."""
    out = [None] * n_inputs
    for i, g in zip(positions, grads):
        out[i] = g
    return tuple(out)


class Op:
    """A differentiable op described once, callable as ``op(*tensors, options, **eager)``.

    The description (keywords; ``forward``, ``fake`` and ``grad_inputs`` are what most ops give):

    Args:
        name: the custom ops' name (``llmkernels::<name>``, ``<name>_fwd`` / ``<name>_bwd`` with
            a backward launcher) and the autograd node's (``<Name>Backward``).
        forward: the forward launcher, ``forward(*tensors, options, **eager) -> outputs``
            (:class:`Signature`: its annotations give the custom op's schema).
        fake: the forward's fake, ``fake(*tensors, options)``: outputs as the launcher returns
            them, on the inputs' device, without running a kernel.
        grad_inputs: positions of the tensors whose ``requires_grad`` makes a call record an
            autograd node; ``backward`` returns their gradients in order (None for one that has
            none). Empty, with no ``backward``: an op without autograd.
        backward: ``backward(ctx, bwd, *grad_outputs)``: ``bwd`` is the backward launcher
            (eager) or its custom op (compiled), called as a launcher is, or for an op without
            one this op itself (its own derivative). Under torch.compile ``grad_outputs`` holds
            a gradient for every output of the launcher, eagerly one for each returned output:
            take the first ones and ``*_``.
        setup: ``setup(ctx, tensors, options, outputs, **eager)`` saves what the backward needs,
            on both paths. Default: saves the tensors, then the outputs the caller does not get
            (past ``returns``), and ``ctx.options``.
        backward_launcher, backward_fake: a backward that is a launcher of its own (custom op
            ``<name>_bwd``), and its fake.
        infer: the launcher of a call that needs no gradient (default ``forward``).
        returns: how many of the outputs the caller gets (the rest exist for ``setup``; 1: the
            output itself, not a 1-tuple); default all.
        non_differentiable: positions of outputs marked non-differentiable (eager).
        once: set when the eager backward consumes what the forward saved (scales a gradient
            in place): the error message of a second backward through the same call.
        once_differentiable: the eager backward is not differentiable (no double backward).
        mutates: names of the tensors the op writes in place (registered without autograd:
            under torch.compile a call that needs a gradient takes an out-of-place op); the
            eager Function marks them dirty and returns them.
        base: makes this an eager-only variant (no custom op): the op (or function with the
            same arguments) that a call needing no gradient, or under torch.compile, goes to.
    """

    def __init__(self, name: str, *, forward: Callable, grad_inputs: tuple = (), backward: Optional[Callable] = None,
                 setup: Optional[Callable] = None, fake: Optional[Callable] = None,
                 backward_launcher: Optional[Callable] = None, backward_fake: Optional[Callable] = None,
                 infer: Optional[Callable] = None, returns: Optional[int] = None, non_differentiable: tuple = (),
                 once: Optional[str] = None, once_differentiable: bool = False, mutates: tuple = (),
                 base: Optional[Callable] = None):
        self.forward, self.infer = forward, infer or forward
        self.backward, self.grad_inputs = backward, grad_inputs
        self.setup = setup or _saving(returns)
        self.backward_launcher = backward_launcher
        self.returns, self.non_differentiable, self.once = returns, non_differentiable, once
        # what a call hands back of the launcher's outputs: all, the first alone, or the first ``returns``
        self._take = None if returns is None else 0 if returns == 1 else slice(returns)
        self.base = base
        self.op = self.backward_op = self.signature = self.function = self._c_apply = None
        self._mutated = ()
        if base is None:
            suffix = "" if backward_launcher is None else "_fwd"
            self.op, self.signature = _custom_op(name + suffix, forward, fake, mutates)
            # positions of the mutated tensors, from the signature's names
            self._mutated = tuple(self.signature.tensors.index(m) for m in mutates)
        if backward is None:
            return
        self.function = self._autograd_function(name, once_differentiable)
        self._c_apply = _c_apply(self.function)
        if base is not None or mutates:
            return
        if backward_launcher is not None:
            self.backward_op = _flattening(*_custom_op(name + "_bwd", backward_launcher, backward_fake, ()))
        self.op.register_autograd(self._compiled_backward, setup_context=self._compiled_setup)

    # ---------------------------------------------------------------------------------------
    # dispatch
    # ---------------------------------------------------------------------------------------
    def needs_grad(self, tensors) -> bool:
        """Whether a call on ``tensors`` records an autograd node."""
        if not torch.is_grad_enabled():
            return False
        for i in self.grad_inputs:
            t = tensors[i]
            if t is not None and t.requires_grad:
                return True
        return False

    def __call__(self, *args, **eager):
        """The custom op under torch.compile; the autograd Function when an input of
        ``grad_inputs`` needs a gradient; otherwise the launcher alone, with no autograd node.
        Keyword arguments are eager-only options of the launchers (a launch configuration for
        tests and tuning; what an eager backward may do that a custom op may not): ``forward``,
        ``infer`` and ``setup`` receive them, ``backward`` may pass them on to its launcher, and
        under torch.compile they are dropped."""
        take = self._take
        if torch.compiler.is_compiling():
            if self.op is None:
                return self.base(*args, **eager)
            outputs = self.op(*args[:-1], *self.signature.flatten(args[-1]))
            return outputs if take is None else outputs[take]
        if torch.is_grad_enabled():
            for i in self.grad_inputs:  # (``needs_grad`` inline: every eager call takes this path)
                t = args[i]
                if t is not None and t.requires_grad:
                    return self._apply(*args, eager)
        if self.op is None:
            return self.base(*args, **eager)
        outputs = self.infer(*args, **eager)
        return outputs if take is None else outputs[take]

    def _apply(self, *args_and_eager):
        """``self.function.apply``: straight into autograd's C++ apply where nothing of the
        Python ``Function.apply`` applies (no functorch transform is active; the Function defines
        no ``setup_context``), else through it."""
        if self._c_apply is not None and not _functorch_active():
            return self._c_apply(*args_and_eager)
        return self.function.apply(*args_and_eager)

    # ---------------------------------------------------------------------------------------
    # the two backward paths
    # ---------------------------------------------------------------------------------------
    def _compiled_setup(self, ctx, inputs, output):
        self.setup(ctx, *self.signature.split(inputs), output)

    def _compiled_backward(self, ctx, *grad_outputs):
        bwd = self.backward_op if self.backward_op is not None else _flattening(self.op, self.signature)
        return _input_grads(self.grad_inputs, len(ctx.needs_input_grad), self.backward(ctx, bwd, *grad_outputs))

    def _autograd_function(self, name: str, once_differentiable: bool):
        """The eager ``torch.autograd.Function``: what a hand-written one does, each step chosen
        here rather than on every call."""
        launch, setup, backward, once = self.forward, self.setup, self.backward, self.once
        mutated, non_differentiable, take, grad_inputs = (self._mutated, self.non_differentiable, self._take,
                                                          self.grad_inputs)
        bwd = self.backward_launcher if self.backward_launcher is not None else self
        # The gradients of the first inputs, then None for the others, the options and the eager options.
        leading = grad_inputs == tuple(range(len(grad_inputs)))

        def forward(ctx, *args_and_eager):
            # The options come last, so that ``ctx.needs_input_grad[i]`` is the i-th tensor's on
            # both paths.
            tensors, options, eager = args_and_eager[:-2], args_and_eager[-2], args_and_eager[-1]
            outputs = launch(*tensors, options, **eager)
            setup(ctx, tensors, options, outputs, **eager)
            if once is not None:
                ctx.consumed = False
            if mutated:
                dirty = [tensors[i] for i in mutated if tensors[i] is not None]
                ctx.mark_dirty(*dirty)
                return dirty[0] if len(dirty) == 1 else tuple(dirty)
            if non_differentiable:
                ctx.mark_non_differentiable(*[outputs[i] for i in non_differentiable if outputs[i] is not None])
            return outputs if take is None else outputs[take]

        def gradients(ctx, *grad_outputs):
            if once is not None:
                if ctx.consumed:
                    raise RuntimeError(once)
                ctx.consumed = True
            grads = backward(ctx, bwd, *grad_outputs)
            if leading:
                return (*grads, *(None,) * (len(ctx.needs_input_grad) - len(grads)))
            return _input_grads(grad_inputs, len(ctx.needs_input_grad), grads)

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


def _saving(returns: Optional[int]) -> Callable:
    """The default ``setup``: saves the tensors and the outputs past ``returns`` (those the
    caller does not get), and ``ctx.options``."""
    def setup(ctx, tensors, options, outputs, **eager):
        ctx.save_for_backward(*tensors, *(() if returns is None else outputs[returns:]))
        ctx.options = options
    return setup
