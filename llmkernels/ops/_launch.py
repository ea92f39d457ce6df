"""Where kernels run, and the cached kernel launch.

Three names, from the bottom up:

  - :class:`Launcher`: one kernel with its launch options (``num_warps``, every constexpr) fixed,
    called as ``handle(grid, *args)``. Triton's ``kernel[grid](...)`` binds the arguments, formats
    a cache key as a string and looks the compiled kernel up on every call, which takes longer on
    the host than the kernel on the GPU at decode sizes; a Launcher keeps the compiled kernels
    Triton gave it, keyed on exactly what Triton specialises them on, and calls a compiled
    kernel's own launcher directly after the first call for a key.
  - :func:`launcher_of`: the Launcher of a kernel and options, made once (what a plan keeps).
  - :func:`launch`: ``kernel[grid](*args, **options)`` through that Launcher, for a launch
    that no plan keeps.

:class:`PlanCache` holds a family's launch plans by key (what decides a launch: sizes, dtypes,
flags), each made once: the configuration, the grid and the Launchers of one key.
"""
from __future__ import annotations

import inspect
import os

import torch

from ._triton import HAVE_TRITON, TensorDescriptor, knobs, tl

# Triton's interpreter runs the real kernel code on CPU tensors; it must be chosen before triton
# is imported, so it is read once here.
INTERPRET = HAVE_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
INTERPRET_CONST = tl.constexpr(INTERPRET)


if INTERPRET:
    from ._interpreter_shims import install

    install()


def use_kernels(t: torch.Tensor) -> bool:
    """True when the Triton kernels can run on ``t``: Triton is installed and ``t`` is a CUDA
    tensor, or a CPU tensor under the interpreter. Otherwise the ops fall back to
    ``llmkernels.reference``."""
    return HAVE_TRITON and (t.is_cuda or (INTERPRET and t.device.type == "cpu"))


def reference_dtype(t: torch.Tensor):
    """None where the kernels run on ``t``; else the dtype in which an op computes
    ``llmkernels.reference`` instead: float64 for float64 inputs (the kernels' statistics are
    fp32), float32 where no kernel can run."""
    if t.dtype == torch.float64:
        return torch.float64
    return None if use_kernels(t) else torch.float32


# --------------------------------------------------------------------------------------------
# the cached launch
# --------------------------------------------------------------------------------------------
# Triton compiles a kernel for the dtype and the 16-byte alignment of each tensor argument, and
# for each int argument whether it is 1, whether it is a multiple of 16, and whether it fits 32
# bits (else 64, else unsigned 64); floats and bools are not specialised. A fingerprint is that
# list for one call; ``_fingerprint`` writes it as one tuple expression (what a loop over the
# arguments computes in twice the time), generated once per sequence of argument kinds. Computing
# it costs more than the rest of a launch, so a Launcher first looks its arguments up as they
# are (``_values``: each number's class and value, each tensor's dtype and alignment), which
# determine the fingerprint; a fingerprint is computed only for values not seen before.
_FINGERPRINTS: dict = {}
_VALUES: dict = {}
# Host-side tensor descriptors: Triton keys them itself, and a call with one always goes through
# Triton, whose launch encodes the descriptor (its hardware form varies between versions).
_DESCRIPTORS = (TensorDescriptor,) if TensorDescriptor is not None else ()
VALUES_KEPT = 256  # a Launcher's look-ups by value (all dropped when full: a run's sizes are few)


def _kinds(args) -> tuple:
    return tuple("tensor" if isinstance(a, torch.Tensor) else "float" if type(a) is float
                 else "none" if a is None else "descriptor" if isinstance(a, _DESCRIPTORS) else "number"
                 for a in args)


def _generated(name: str, kinds: tuple, term) -> object:
    """``def name(device, a0, a1, ...): return (device, *terms)``, ``term(a, kind)`` the
    expression of each argument."""
    names = [f"a{i}" for i in range(len(kinds))]
    namespace: dict = {}
    exec(f"def {name}(device, {', '.join(names)}):\n    return (device, {', '.join(map(term, names, kinds))})\n",
         namespace)
    return namespace[name]


def _fingerprint(kinds: tuple):
    """The function ``(device, *args) -> key`` for arguments of ``kinds`` (``_kinds``: tensor,
    float, None, descriptor or number at each position). A number's key holds its class too, so
    an int, a bool and a float never share one; None (which Triton specialises as a constant)
    keys as ``a is None``; a descriptor as its class (Triton looks such calls up itself)."""
    fingerprint = _FINGERPRINTS.get(kinds)
    if fingerprint is None:
        number = "({a}.__class__, {a} == 1, {a} % 16 == 0, -0x80000000 <= {a} <= 0x7FFFFFFF, {a} <= 0x7FFFFFFFFFFFFFFF)"
        fingerprint = _FINGERPRINTS[kinds] = _generated("fingerprint", kinds, lambda a, kind: (
            f"{a}.dtype, {a}.data_ptr() % 16 == 0" if kind == "tensor" else f"{a} is None" if kind == "none" else
            f"{a}.__class__" if kind == "descriptor" else
            # (a float is not specialised: its class is its key, and a number of another class its own)
            f"{a}.__class__ is float or {number.format(a=a)}" if kind == "float" else number.format(a=a)))
    return fingerprint


def _values(kinds: tuple):
    """The function ``(device, *args) -> key`` of arguments of ``kinds`` as they are: each
    tensor's dtype and alignment, each number's class and value."""
    values = _VALUES.get(kinds)
    if values is None:
        values = _VALUES[kinds] = _generated("values", kinds, lambda a, kind: (
            f"{a}.dtype, {a}.data_ptr() % 16 == 0" if kind == "tensor" else f"{a} is None" if kind == "none"
            else f"{a}.__class__" if kind == "descriptor" else f"{a}.__class__, {a}"))
    return values


def _arg_key(a):
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if type(a) is int:
        return int, a == 1, a % 16 == 0, -0x80000000 <= a <= 0x7FFFFFFF, a <= 0x7FFFFFFFFFFFFFFF
    return type(a)


def _generic_key(device, args) -> tuple:
    """What ``_fingerprint`` computes, for arguments of any kinds (a slower loop)."""
    return (device, "generic", *[_arg_key(a) for a in args])


def _stream_handle(device: int) -> int:
    return torch.cuda.current_stream(device).cuda_stream


# torch's raw-stream query skips building a Stream object on every launch; it is not public API,
# so guarded (ARCHITECTURE.md lists it with its measured benefit and the test of a break).
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or _stream_handle
_current_device = torch.cuda.current_device
_PUBLIC = object()  # a key whose compiled kernel is launched through ``kernel[grid]`` (no direct handle)


# Whether compiled kernels are launched through their own launcher (Triton >= 3.4, where it takes
# the hooks of ``triton.knobs``; older versions go through ``kernel[grid]``). A launcher whose
# signature differs at run time turns it off (``Launcher._refused``).
direct = knobs is not None and hasattr(getattr(knobs, "runtime", None), "launch_enter_hook")


def _hooked() -> bool:
    """Whether a launch hook of ``triton.knobs`` is set (a profiler's): those launches go
    through Triton, which calls the hooks with the launch's metadata. (From Triton 3.5 a hook
    is a HookChain, always set, that calls nothing while empty.)"""
    runtime = knobs.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return (enter is not None and bool(getattr(enter, "calls", True))) or (
        leave is not None and bool(getattr(leave, "calls", True)))


class Launcher:
    """``kernel[grid](*args, **options)`` for one kernel and one set of ``options`` (launch options
    such as ``num_warps`` and every constexpr), with the compiled kernels cached here: call it
    as ``launcher(grid, *args)``, ``args`` the kernel's runtime arguments in order. Under the
    interpreter it is the plain Triton call. Resolve one once per configuration and keep it to
    skip even the lookup of :func:`launcher_of`."""

    __slots__ = ("kernel", "options", "_compiled", "_fingerprint", "_tail", "_kinds", "_values", "_by_values")

    def __init__(self, kernel, options: dict):
        self.kernel, self.options = kernel, options
        self._compiled: dict = {}  # fingerprint -> launch handle (``_handle``)
        self._by_values: dict = {}  # ``_values`` key -> launch handle
        self._kinds = self._fingerprint = self._values = None
        self._tail = None

    def __call__(self, grid: tuple, *args) -> None:
        if INTERPRET:
            self.kernel[grid](*args, **self.options)
            return
        device = _current_device()
        try:
            entry = self._by_values[self._values(device, *args)]
        except (KeyError, AttributeError, TypeError):  # values not seen (or the first call, or other kinds)
            entry = self._lookup(grid, device, args)
            if entry is None:  # Triton has compiled and launched it
                return
        if entry is _PUBLIC or not direct or _hooked():
            self.kernel[grid](*args, **self.options)
            return
        run, function, packed = entry
        try:
            run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                _current_stream(device), function, packed, None, None, None, *args, *self._tail)
        except TypeError:
            self._refused(grid, args)

    def _lookup(self, grid, device, args):
        """The launch handle of ``args`` by their fingerprint, kept under their values too; or
        None after Triton has compiled (or found) the kernel for a new fingerprint and launched
        it."""
        kinds = _kinds(args)
        if self._kinds is None:  # the first call fixes the kinds the fast look-ups expect
            self._kinds, self._fingerprint, self._values = kinds, _fingerprint(kinds), _values(kinds)
        if kinds == self._kinds:
            key, values = self._fingerprint(device, *args), self._values(device, *args)
        else:  # (arguments of other kinds, e.g. None for a tensor: looked up by a slower key, kept by it only)
            key, values = _generic_key(device, args), None
        entry = self._compiled.get(key)
        launched = entry is None
        if launched:
            compiled = self.kernel[grid](*args, **self.options)  # Triton compiles (or finds) it, and launches
            entry = self._compiled[key] = self._handle(compiled, args)
        if values is not None:
            if len(self._by_values) >= VALUES_KEPT:
                self._by_values.clear()
            self._by_values[values] = entry
        return None if launched else entry

    def _handle(self, compiled, args: tuple):
        """What a later call needs to launch ``compiled`` itself: its launcher, function handle
        and packed metadata (present once Triton has launched it), or _PUBLIC (also where an
        argument is a tensor descriptor). (The launcher's arguments after those: launch metadata
        and the enter and exit hooks, None here.)"""
        if (not direct or not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata"))
                or any(isinstance(a, _DESCRIPTORS) for a in args)):
            return _PUBLIC
        if self._tail is None:  # the constexprs, passed after the runtime arguments
            params = inspect.signature(self.kernel.fn).parameters
            self._tail = tuple(self.options[name] if name in self.options else params[name].default
                               for name in self.kernel.arg_names[len(args):])
        return compiled.run, compiled.function, compiled.packed_metadata

    def _refused(self, grid, args) -> None:
        """The launcher's signature differs in this Triton version (it parses its arguments
        before anything launches; no hook runs in it): launch through Triton from now on."""
        global direct
        direct = False
        self.kernel[grid](*args, **self.options)


_LAUNCHERS: dict = {}


def launcher_of(kernel, **options) -> Launcher:
    """The :class:`Launcher` of ``kernel`` with ``options`` (``num_warps=...`` and every
    constexpr by name), made on first use."""
    # (the kernel's id: a JIT function hashes in Python; the names, then the values: cheaper to hash
    # than pairs)
    key = (id(kernel), *options, *options.values())
    found = _LAUNCHERS.get(key)
    if found is None:
        found = _LAUNCHERS[key] = Launcher(kernel, options)
    return found


def launch(kernel, grid: tuple, *args, **options) -> None:
    """``kernel[grid](*args, **options)`` through the cached :class:`Launcher` of ``options``.
    ``args`` are the kernel's runtime arguments in order; ``options`` name ``num_warps`` (and
    any other launch option) and every remaining parameter."""
    (_LAUNCHERS.get((id(kernel), *options, *options.values())) or launcher_of(kernel, **options))(grid, *args)


class PlanCache(dict):
    """A family's launch plans by key: ``plans[key]`` is ``make(*key)`` (``make(key)`` for a key
    that is not a tuple), made on the first look-up of the key (a dict look-up after that). An op
    keys its plans on what decides its launch (sizes, dtype, flags) and keeps in a plan what it
    would otherwise derive on every call: the configuration, the grid, the :class:`Launcher`. At
    most ``limit`` are kept (all are dropped when full: the sizes of a run are few)."""

    __slots__ = ("make", "limit")

    def __init__(self, make, limit: int = 4096):
        super().__init__()
        self.make, self.limit = make, limit
        _ALL_PLANS.append(self)

    def __missing__(self, key):
        if len(self) >= self.limit:
            self.clear()
        plan = self[key] = self.make(*key) if type(key) is tuple else self.make(key)
        return plan


_ALL_PLANS: list = []  # every family's plan caches (module-level, made once at import)


def clear_plans() -> None:
    """Drop every family's launch plans: the next call of each key chooses its configuration
    again (after the configuration source changed: ``_device.heuristic_only``)."""
    for plans in _ALL_PLANS:
        plans.clear()
