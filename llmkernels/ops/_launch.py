"""Where kernels run, what the device offers, argument checks, and the cached kernel launch.

The launch: Triton's ``kernel[grid](...)`` binds the arguments, formats a cache key as a string
and looks the compiled kernel up on every call, which takes longer on the host than the kernel
on the GPU at decode sizes. A :class:`Launcher` holds one kernel with its launch options
and constexprs fixed, keeps the compiled kernels it was given by Triton, keyed on exactly what
Triton specialises them on, and calls the compiled kernel's launcher directly after the first
call for a key. ``launch(kernel, grid, *args, **options)`` finds the Launcher of those options.
"""
from __future__ import annotations

import functools
import inspect
import os

import torch

from ._triton import HAVE_TRITON, knobs, tl, triton

# Triton's interpreter runs the real kernel code on CPU tensors; it must be chosen before triton
# is imported, so it is read once here.
INTERPRET = HAVE_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
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
    """True when the Triton kernels can run on ``t``: Triton is installed and ``t`` is a CUDA
    tensor, or a CPU tensor under the interpreter. Otherwise the ops fall back to
    ``llmkernels.reference``."""
    return HAVE_TRITON and (t.is_cuda or (INTERPRET and t.device.type == "cpu"))


# --------------------------------------------------------------------------------------------
# device queries
# --------------------------------------------------------------------------------------------
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
    """Shared memory a program may use (opt-in maximum), in bytes."""
    try:  # Triton's driver utilities are not public API: torch's property is the fallback
        return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]
    except (AttributeError, KeyError, TypeError):
        return torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin


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
    """Ceiling division on the host (``triton.cdiv`` is a JIT function, slow to call from Python)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# --------------------------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------------------------
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
    return t.reshape(-1, n)  # a view where one exists (no try/except: torch.compile cannot trace it)


def pointer(t: torch.Tensor | None, stand_in: torch.Tensor) -> torch.Tensor:
    """``t``, or ``stand_in`` where ``t`` is absent: a kernel's pointer argument must be a tensor
    even where a switch (HAS_W, HAS_RES, ...) keeps the kernel from touching it."""
    return stand_in if t is None else t


def device_of(index: int) -> torch.device:
    """The device of ``Tensor.get_device()``'s ``index`` (-1: the CPU, under the interpreter), for
    plans keyed on the index."""
    return torch.device("cpu") if index < 0 else torch.device("cuda", index)


def row_stride(t: torch.Tensor | None) -> int:
    """``t.stride(0)``, or 0 for an absent ``t`` (a stride the kernel then never uses)."""
    return 0 if t is None else t.stride(0)


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
VALUES_KEPT = 256  # a Launcher's look-ups by value (all dropped when full: a run's sizes are few)


def _kinds(args) -> tuple:
    return tuple("tensor" if isinstance(a, torch.Tensor) else "float" if type(a) is float
                 else "none" if a is None else "number" for a in args)


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
    float, None or number at each position). A number's key holds its class too, so an int, a
    bool and a float never share one; None (which Triton specialises as a constant) keys as
    ``a is None``."""
    fingerprint = _FINGERPRINTS.get(kinds)
    if fingerprint is None:
        number = "({a}.__class__, {a} == 1, {a} % 16 == 0, -0x80000000 <= {a} <= 0x7FFFFFFF, {a} <= 0x7FFFFFFFFFFFFFFF)"
        fingerprint = _FINGERPRINTS[kinds] = _generated("fingerprint", kinds, lambda a, kind: (
            f"{a}.dtype, {a}.data_ptr() % 16 == 0" if kind == "tensor" else f"{a} is None" if kind == "none" else
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
            else f"{a}.__class__, {a}"))
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


def _device_index() -> int:
    return torch.cuda.current_device()


# torch's raw-stream and device queries skip building a Stream object and the Python checks of
# ``torch.cuda.current_device`` (CUDA is initialised by then: the arguments are CUDA tensors);
# they are not public API, so guarded.
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or _stream_handle
_current_device = getattr(torch._C, "_cuda_getDevice", None) or _device_index
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
    skip even the lookup of :func:`launcher`."""

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
            entry = self._compiled[key] = self._handle(compiled, len(args))
        if values is not None:
            if len(self._by_values) >= VALUES_KEPT:
                self._by_values.clear()
            self._by_values[values] = entry
        return None if launched else entry

    def _handle(self, compiled, n_args: int):
        """What a later call needs to launch ``compiled`` itself: its launcher, function handle
        and packed metadata (present once Triton has launched it), or _PUBLIC. (The launcher's
        arguments after those: launch metadata and the enter and exit hooks, None here.)"""
        if not direct or not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
            return _PUBLIC
        if self._tail is None:  # the constexprs, passed after the runtime arguments
            params = inspect.signature(self.kernel.fn).parameters
            self._tail = tuple(self.options[name] if name in self.options else params[name].default
                               for name in self.kernel.arg_names[n_args:])
        return compiled.run, compiled.function, compiled.packed_metadata

    def _refused(self, grid, args) -> None:
        """The launcher's signature differs in this Triton version (it parses its arguments
        before anything launches; no hook runs in it): launch through Triton from now on."""
        global direct
        direct = False
        self.kernel[grid](*args, **self.options)


_LAUNCHERS: dict = {}


def launcher(kernel, **options) -> Launcher:
    """The :class:`Launcher` of ``kernel`` with ``options`` (``num_warps=...`` and every
    constexpr by name), made on first use."""
    # (the kernel's id: a JIT function hashes in Python; the names, then the values: cheaper to hash
    # than pairs)
    key = (id(kernel), *options, *options.values())
    found = _LAUNCHERS.get(key)
    if found is None:
        found = _LAUNCHERS[key] = Launcher(kernel, options)
    return found


class Plans(dict):
    """Launch plans by key: ``plans[key]`` is ``make(*key)`` (``make(key)`` for a key that is not a
    tuple), made on the first look-up of the key
    (a dict look-up after that). An op keys its plans on what decides its launch (sizes, dtype,
    flags) and keeps in a plan what it would otherwise derive on every call: the configuration,
    the grid, the :class:`Launcher`. At most ``limit`` are kept (all are dropped when full: the
    sizes of a run are few)."""

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


_ALL_PLANS: list = []  # every family's plans (module-level, made once at import)


def clear_plans() -> None:
    """Drop every family's launch plans: the next call of each key chooses its configuration
    again (after the configuration source changed: ``_device.heuristic_only``)."""
    for plans in _ALL_PLANS:
        plans.clear()


def launch(kernel, grid: tuple, *args, **options) -> None:
    """``kernel[grid](*args, **options)`` through the cached :class:`Launcher` of ``options``.
    ``args`` are the kernel's runtime arguments in order; ``options`` name ``num_warps`` (and
    any other launch option) and every remaining parameter."""
    (_LAUNCHERS.get((id(kernel), *options, *options.values())) or launcher(kernel, **options))(grid, *args)
