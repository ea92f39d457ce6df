"""Running one fuzz case: the op in a random execution context against its float64 reference,
forward and every gradient, then the properties that hold for every op (bitwise determinism,
inputs left as they were, NaN kept in its row, bad arguments refused by name).

Tolerance of a compared tensor: ``||out - ref64|| <= max(tol * ||ref64||, 8 ||ref32 - ref64||)``
with ``tol`` from the lowest precision among the op's floating inputs and the output, and
``ref32`` the same reference computed in float32: the second term admits the rounding of an
ill-conditioned case (a one-element RMSNorm's input gradient is a difference of equals), which
float32 arithmetic cannot avoid either.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Optional

import torch

from .draw import Draw
from .specs import Case

TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2, torch.float64: 1e-12}
CONTEXTS = ("plain", "default_device", "device_block", "autocast", "no_grad", "inference_mode", "compile")
# How often each context is drawn: torch.compile recompiles per shape (seconds a case), so it is
# drawn in about one case of a hundred.
CONTEXT_WEIGHTS = (10, 2, 2, 2, 2, 2, 0.2)


class Mismatch(AssertionError):
    """A case that broke the contract: what, where."""


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t``'s bits: bitwise comparison that counts NaN equal to the same NaN."""
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else t


def same_bits(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _upcast(args: dict, dtype: torch.dtype, wants: set) -> dict:
    """``args`` with floating tensors as ``dtype`` copies, leaves requiring a gradient where named."""
    out = {}
    for name, value in args.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            value = value.detach().to(dtype).requires_grad_(name in wants)
        out[name] = value
    return out


def _as_tuple(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _differentiable(outputs: tuple) -> list:
    return [i for i, t in enumerate(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]


def _grads(outputs: tuple, which: list, leaves: list, upstream: list) -> list:
    if not which or not leaves:
        return []
    grads = torch.autograd.grad([outputs[i] for i in which], leaves, [upstream[i] for i in which], allow_unused=True)
    return [torch.zeros_like(leaf) if g is None else g for leaf, g in zip(leaves, grads)]


def _precision(case: Case, out: torch.Tensor, context: str) -> torch.dtype:
    """The lowest precision among the op's floating inputs and ``out`` (and autocast's, for an op
    whose matmuls follow it)."""
    dtypes = [t.dtype for t in case.args.values() if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if context == "autocast" and case.follows_autocast:
        dtypes.append(torch.bfloat16)
    return max([*dtypes, out.dtype], key=lambda dt: TOL.get(dt, 0.0))


def compare(name: str, out, ref64, ref32, dtype: torch.dtype, scale: float = 1.0, tol_scale: float = 1.0,
            terms: int = 1) -> None:
    """Raise :class:`Mismatch` unless ``out`` matches the reference (module notes): shapes equal,
    NaN where the reference has NaN and nowhere else. ``scale``: the magnitude of the upstream
    gradient and ``terms`` how many rows a gradient may sum, for the absolute floor of a
    reference that is exactly 0 (rounding noise grows with both)."""
    if out is None or ref64 is None:
        if (out is None) != (ref64 is None):
            raise Mismatch(f"{name}: {'missing' if out is None else 'unexpected'} output")
        return
    if tuple(out.shape) != tuple(ref64.shape):
        raise Mismatch(f"{name}: shape {list(out.shape)} != reference {list(ref64.shape)}")
    got, want, low = out.detach().double().cpu(), ref64.detach().double().cpu(), ref32.detach().double().cpu()
    nan = torch.isnan(want)
    if not torch.equal(torch.isnan(got), nan):
        raise Mismatch(f"{name}: NaN at {torch.isnan(got).sum().item()} places, the reference at {nan.sum().item()}")
    got, want, low = got[~nan], want[~nan], low[~nan]
    if out.dtype.is_floating_point:  # beyond the output dtype's range, its max or inf of the same sign are both right
        beyond = torch.isfinite(want) & (want.abs() >= torch.finfo(out.dtype).max * (1 - TOL[dtype] * tol_scale))
        if not torch.equal(torch.sign(got[beyond]), torch.sign(want[beyond])):
            raise Mismatch(f"{name}: values beyond {out.dtype}'s range of the wrong sign")
        got, want, low = got[~beyond], want[~beyond], low[~beyond]
    if not torch.equal(torch.isinf(got), torch.isinf(want)) or not torch.equal(got[torch.isinf(got)],
                                                                               want[torch.isinf(want)]):
        raise Mismatch(f"{name}: infinities differ from the reference")
    finite = torch.isfinite(want)
    err = (got[finite] - want[finite]).norm().item()
    tol = TOL[dtype] * tol_scale
    floor = 0.1 * tol * scale * math.sqrt(want.numel() * terms)  # O(1) inputs: a reference of exactly 0
    allowed = max(tol * want[finite].norm().item(), 8 * (low[finite] - want[finite]).norm().item(), floor)
    if not err <= allowed:  # (NaN fails too)
        raise Mismatch(f"{name}: error {err:.3e} > allowed {allowed:.3e} ({dtype}, reference norm "
                       f"{want[finite].norm().item():.3e})")


@contextlib.contextmanager
def execution_context(name: str, device: torch.device):
    """The caller's setting around the op: a default device elsewhere ('meta' on the CPU, which
    catches any tensor made without naming its device; 'cuda' on a GPU run with CPU defaults in
    mind), a ``torch.device`` block, autocast to bf16, no_grad, inference_mode."""
    other = "meta" if device.type == "cpu" else "cuda"
    if name == "default_device":
        torch.set_default_device(other)
        try:
            yield
        finally:
            torch.set_default_device(None)
    elif name == "device_block":
        with torch.device(other):
            yield
    elif name == "autocast":
        with torch.autocast(device.type, dtype=torch.bfloat16):
            yield
    elif name == "no_grad":
        with torch.no_grad():
            yield
    elif name == "inference_mode":
        with torch.inference_mode():
            yield
    else:
        yield


def _caller(case: Case, context: str) -> Callable:
    if context != "compile":
        return case.call
    torch.compiler.reset()  # a fresh cache per case: no recompile limit quietly falling back to eager
    return torch.compile(case.call, fullgraph=True, dynamic=False)


def run_op(case: Case, context: str, wants: set, upstream: Optional[list], device: torch.device):
    """``(outputs, gradients of the ``wants`` arguments)`` of ``case`` run in ``context``."""
    args = {n: (v.requires_grad_(n in wants) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
            for n, v in case.args.items()}
    leaves = [args[n] for n in case.differentiable if n in wants]
    call = _caller(case, context)
    with execution_context(context, device):
        outputs = _as_tuple(call(args))
        grads = [] if upstream is None else _grads(outputs, _differentiable(outputs), leaves, upstream)
    return outputs, grads


def run_case(build: Callable, seed: int, index: int, device: torch.device, *, context: Optional[str] = None,
             checks: tuple = ("nan", "bad")) -> dict:
    """Run case ``index`` of ``seed`` (built by ``build(draw)``); raise :class:`Mismatch` on any
    broken property. Returns what ran: ``{"op", "context", "checks": [...]}``."""
    def fresh():
        return build(Draw(seed, index, device))

    case = fresh()
    plan = Draw(seed, -1 - index, device)  # the runner's own choices, apart from the case's
    context = context or plan.rng.choices(CONTEXTS, CONTEXT_WEIGHTS)[0]
    if context == "compile" and case.eager_only:
        context = "plain"
    forward_only = context in ("no_grad", "inference_mode")
    if context == "autocast" and case.follows_autocast:  # products and sums both rounded to bf16
        case.tol_scale *= 2
    wants = {n for n in case.differentiable if isinstance(case.args.get(n), torch.Tensor) and plan.chance(0.75)}
    wants = set() if forward_only else wants
    before = {n: v.detach().clone() for n, v in case.args.items() if isinstance(v, torch.Tensor)}

    ref64 = _as_tuple(case.ref(_upcast(case.args, torch.float64, wants), torch.float64))
    upstream = [None if t is None else (plan.values(t.shape, torch.float64) * plan.scale() if plan.chance(0.8)
                                        else torch.ones_like(t.detach())) for t in ref64]
    reference = _reference(case, wants, upstream)
    outputs, grads = run_op(case, context, wants, None if forward_only else upstream, device)
    ran = ["forward"]
    _compare_outputs(case, outputs, reference[0], reference[1], context)
    if not forward_only and grads:
        names = [n for n in case.differentiable if n in wants]
        scale = max((u.abs().max().item() for u in upstream if u is not None and u.numel()), default=1.0)
        for name, got, r64, r32 in zip(names, grads, reference[2], reference[3]):
            compare(f"{case.op} d{name}", got, r64, r32, _precision(case, got, context), scale, case.tol_scale,
                    terms=_rows_summed(case))
        ran.append("grads")
    for name, old in before.items():
        if name not in case.mutates and not same_bits(case.args[name].detach(), old):
            raise Mismatch(f"{case.op}: argument {name} was modified")
    again = fresh()
    outputs2, grads2 = run_op(again, context, wants, None if forward_only else upstream, device)
    if not all(same_bits(a, b) for a, b in zip((*outputs, *grads), (*outputs2, *grads2))):
        raise Mismatch(f"{case.op}: two runs on the same input differ (not deterministic)")
    ran.append("determinism")
    if "nan" in checks and context == "plain" and case.row_input is not None and plan.chance(0.4):
        if _nan_stays_in_row(fresh(), plan, wants, upstream, outputs, grads, device):
            ran.append("nan")
    if "bad" in checks and case.bad and plan.chance(0.5):
        _refuses(case.op, *plan.choice(case.bad), fresh)
        ran.append("bad")
    return {"op": case.op, "context": context, "checks": ran}


def _rows_summed(case: Case) -> int:
    """Rows of the op's main input: what a weight gradient sums over."""
    x = next(v for v in case.args.values() if isinstance(v, torch.Tensor))
    return max(1, x.numel() // x.shape[-1]) if x.dim() and x.shape[-1] else 1


def _reference(case: Case, wants: set, upstream: list):
    """(outputs in float64, in float32, gradients in float64, in float32)."""
    results = []
    for dtype in (torch.float64, torch.float32):
        args = _upcast(case.args, dtype, wants)
        outputs = _as_tuple(case.ref(args, dtype))
        leaves = [args[n] for n in case.differentiable if n in wants]
        ups = [None if u is None else u.to(dtype) for u in upstream]
        results.append((outputs, _grads(outputs, _differentiable(outputs), leaves, ups)))
    return results[0][0], results[1][0], results[0][1], results[1][1]


def _compare_outputs(case: Case, outputs: tuple, ref64: tuple, ref32: tuple, context: str) -> None:
    if len(outputs) != len(ref64):
        raise Mismatch(f"{case.op}: {len(outputs)} outputs, the reference {len(ref64)}")
    for i, (out, r64, r32) in enumerate(zip(outputs, ref64, ref32)):
        if out is not None and r64 is not None and out.dtype != r64.dtype and r64.dtype not in (
                torch.float64, torch.float32):
            raise Mismatch(f"{case.op} output {i}: dtype {out.dtype}, the reference's {r64.dtype}")
        compare(f"{case.op} output {i}", out, r64, r32,
                _precision(case, out, context) if out is not None else torch.float32, tol_scale=case.tol_scale,
                terms=_rows_summed(case))


def _unravel(index: int, shape) -> tuple:
    out = []
    for size in reversed(shape):
        index, i = divmod(index, size)
        out.append(i)
    return tuple(reversed(out))


def _rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t.detach().reshape(rows, -1) if rows else t.detach().reshape(0, 0)


def _nan_stays_in_row(case: Case, plan: Draw, wants: set, upstream: list, clean: tuple, clean_grads: list,
                      device: torch.device) -> bool:
    """A NaN put in one row of ``case.row_input`` makes that row of every row-wise output (and of
    its gradient) NaN and leaves every other row bitwise as it was. False where it cannot be
    tried (no rows, an expanded input whose rows share memory)."""
    x = case.args[case.row_input]
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if rows == 0 or 0 in x.stride():
        return False
    counted = torch.ones(rows, dtype=torch.bool, device="cpu")
    if case.args.get("target") is not None:  # an ignored row's outputs are 0 whatever its inputs
        counted = (case.args["target"] != case.args.get("ignore_index", -100)).cpu()
    if not counted.any():
        return False
    r = plan.choice(counted.nonzero().flatten().tolist())
    with torch.no_grad():  # in place, in the case's own layout
        x[(*_unravel(r, x.shape[:-1]), plan.int(0, x.shape[-1] - 1))] = math.nan
    outputs, grads = run_op(case, "plain", wants, upstream, device)
    names = [n for n in case.differentiable if n in wants]
    pairs = [(f"output {i}", o, c) for i, (o, c) in enumerate(zip(outputs, clean))
             if case.row_outputs is None or i in case.row_outputs]
    pairs += [(f"d{n}", g, c) for n, g, c in zip(names, grads, clean_grads) if n == case.row_input and case.nan_in_grad]
    for what, got, was in pairs:
        if got is None or got.numel() == 0 or got.numel() % rows:
            continue
        got, was = _rows(got, rows), _rows(was, rows)
        keep = torch.arange(rows, device=got.device) != r
        if not torch.isnan(got[r]).any():
            raise Mismatch(f"{case.op} {what}: a NaN in row {r} of {case.row_input} left that row without NaN")
        if not same_bits(got[keep], was[keep]):
            raise Mismatch(f"{case.op} {what}: a NaN in row {r} of {case.row_input} changed other rows")
    return True


def _refuses(op: str, name: str, args: dict, fresh: Callable) -> None:
    """The op called with ``args`` (one argument made bad) raises TypeError or ValueError naming it."""
    case = fresh()
    case.args = args
    try:
        case.call(args)
    except (TypeError, ValueError) as e:
        if name not in str(e):
            raise Mismatch(f"{op}: bad {name} raised {type(e).__name__} without naming it: {e}") from None
        return
    except Exception as e:  # noqa: BLE001  (any other error is the finding)
        raise Mismatch(f"{op}: bad {name} raised {type(e).__name__}, not TypeError/ValueError: {e}") from None
    raise Mismatch(f"{op}: bad {name} was accepted")
