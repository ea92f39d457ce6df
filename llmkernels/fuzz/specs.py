"""What the fuzzer draws for every public op: arguments in random shapes, dtypes, layouts and
options, the function under test, its float64 reference, and the bad arguments it must refuse.

Each builder takes a :class:`~llmkernels.fuzz.draw.Draw` and returns a :class:`Case`. The
reference is ``llmkernels.reference``'s definition of the op, called on the same arguments with
floating tensors upcast by the runner.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch

import llmkernels as lk
from llmkernels import reference, reference_moe

from .draw import Draw, shift_values


@dataclasses.dataclass
class Case:
    """One call of one op.

    ``args``: keyword arguments of ``call`` (tensors, None and options); ``ref(args, dtype)``
    the reference on arguments upcast to ``dtype``; ``differentiable``: the tensor arguments
    that may take a gradient; ``row_input``: the argument whose rows map one to one onto the
    rows of the outputs at ``row_outputs`` (default all), where a NaN must stay, or None;
    ``nan_in_grad``: the row input's gradient depends on it (a NaN there reaches it);
    ``follows_autocast``: the op's matmuls run in autocast's dtype, as the modules it replaces;
    ``tol_scale``: a wider tolerance (set by the runner under autocast, for ops that follow it);
    ``mutates``: arguments written as documented;
    ``bad``: ``(argument name, replacement args)`` that must raise an error naming it;
    ``eager_only``: an op with no torch.compile form (documented), run plain where the compile
    context is drawn."""

    op: str
    args: dict
    call: Callable
    ref: Callable
    differentiable: tuple
    row_input: Optional[str] = None
    row_outputs: Optional[tuple] = None
    nan_in_grad: bool = True
    follows_autocast: bool = False
    tol_scale: float = 1.0
    mutates: tuple = ()
    bad: list = dataclasses.field(default_factory=list)
    eager_only: bool = False


def _bad(args: dict, name: str, value) -> tuple:
    return name, {**args, name: value}


def _common_bad(d: Draw, args: dict, tensors: tuple, options: dict) -> list:
    """Bad arguments every op must name: a non-tensor, an integer tensor where a float one goes,
    a tensor on another device, a mis-sized one, and each option's bad values (``options``:
    name -> bad value)."""
    present = [n for n in tensors if args.get(n) is not None]
    name = d.choice(present)
    t = args[name]
    other = torch.device("meta")
    bad = [_bad(args, name, t.tolist() if t.numel() < 64 else 1.0)]
    if t.is_floating_point():
        bad.append(_bad(args, name, t.to(torch.int32)))
    if name != present[0]:  # the first is the op's main input: the others are checked against it
        bad.append(_bad(args, name, t.to(other)))
        bad.append(_bad(args, name, torch.zeros((*t.shape[:-1], t.shape[-1] + 1), dtype=t.dtype, device=t.device)
                        if t.dim() else torch.zeros(2, dtype=t.dtype, device=t.device)))
    bad += [_bad(args, n, v) for n, v in options.items()]
    return bad


def _one_bad(d: Draw, table: dict) -> dict:
    """One of an op's bad option values, drawn."""
    name = d.choice(list(table))
    return {name: table[name]}


# --------------------------------------------------------------------------------------------
# norms
# --------------------------------------------------------------------------------------------
def norm(d: Draw, is_rms: bool) -> Case:
    dtype = d.dtype()
    lead = d.lead()
    per_head = d.chance(0.15)
    if per_head:
        heads, dim = d.int(1, 4), d.width(64)
        shape, wshape = (*lead, heads, dim), (heads, dim)
    else:
        shape = (*lead, d.width(300))
        wshape = shape[-1:]
    x = d.tensor(shape, dtype)
    wdtype = d.choice((dtype, dtype, torch.float32))
    weight = None if d.chance(0.15) else d.tensor(wshape, wdtype, scale=0.5, layouts=("contiguous", "sliced"))
    bias = d.tensor(wshape, wdtype, layouts=("contiguous",)) if (weight is not None and d.chance(0.6 if not is_rms
                                                                                              else 0.15)) else None
    residual = d.tensor(shape, d.choice((dtype, dtype, torch.float32))) if d.chance(0.4) else None
    args = dict(x=x, weight=weight, bias=bias, residual=residual, eps=d.choice((1e-6, 1e-5, 0.1)),
                prenorm=d.chance(0.5) if residual is not None else d.chance(0.1),
                residual_in_fp32=d.chance(0.2), casting=d.choice(reference.NORM_CASTINGS),
                weight_offset=d.choice((None, None, 1.0, 0.25)),
                out_dtype=d.choice((None, None, None, torch.float32, torch.bfloat16)))
    fn, ref = (lk.rms_norm, reference.rms_norm) if is_rms else (lk.layer_norm, reference.layer_norm)
    h_dtype = None if residual is None else reference.resolve_norm_dtypes(
        x, weight, residual, casting=args["casting"], weight_offset=None, out_dtype=None,
        residual_in_fp32=args["residual_in_fp32"])[2]

    def reference_norm(a, c):
        """The reference on upcast arguments, with ``h = x + residual`` stored in the dtype the op
        stores it in (part of its definition; upcast inputs would keep it exact): rounded in value,
        straight through for the gradient. Each pass rounds its own sum, so that the spread of the
        two passes admits a sum that the kernel's fp32 addition puts on the other side of a
        half-way point, which an ill-conditioned row (LayerNorm of 2 nearly equal values) turns
        into a large difference."""
        if a["residual"] is None:
            return ref(**a, compute_dtype=c)
        h = a["x"] + a["residual"]
        h = h + (h.to(h_dtype).to(c) - h).detach()
        y = ref(**{**a, "x": h, "residual": None, "prenorm": False}, compute_dtype=c)
        return (y, h) if a["prenorm"] else y

    options = {"eps": -1.0, "casting": "llama3", "out_dtype": torch.int32}
    bad = _common_bad(d, args, ("x", "weight", "bias", "residual"), _one_bad(d, options))
    # Rows whose mean is far larger than their spread (LayerNorm's variance must not cancel), in x
    # or the residual; drawn last, so that the other draws of a case stay as they were.
    offset = d.choice((0.0,) * 6 + (1e3, 1e4))
    if offset:
        shift_values(residual if residual is not None and d.chance(0.5) else x, offset)
    return Case("rms_norm" if is_rms else "layer_norm", args, lambda a: fn(**a),
                reference_norm, ("x", "weight", "bias", "residual"), row_input="x", bad=bad)


# --------------------------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------------------------
def _heads_shape(layout: str, b: int, s: int, dim: int):
    """``shape_of(heads)``: the shape of q or k with that many heads in ``layout``."""
    return (lambda h: (b, h, s, dim)) if layout == "bhsd" else (lambda h: (b, s, h, dim))


def rope(d: Draw, hf: bool) -> Case:
    dtype = d.dtype()
    b, hq, s, dim = d.int(1, 3), d.int(1, 4), d.int(1, 9), 2 * d.int(1, 32)
    hk = d.choice((None, 1, hq, d.int(1, hq)))
    layout = "bhsd" if hf and d.chance(0.5) else d.choice(("bhsd", "bshd"))
    shape_of = _heads_shape(layout, b, s, dim)
    q = d.tensor(shape_of(hq), dtype, layouts=("contiguous", "sliced", "strided"))
    k = None if hk is None else d.tensor(shape_of(hk), dtype, layouts=("contiguous", "sliced", "strided"))
    rotary = dim if hf or d.chance(0.6) else 2 * d.int(1, dim // 2)
    cdtype = d.choice((dtype, torch.float32))
    table = not hf and d.chance(0.25)
    cshape = (s + d.int(0, 5), rotary) if table else d.choice(((1, s, rotary), (b, s, rotary), (s, rotary)))
    if hf:
        cshape = d.choice(((1, s, dim), (b, s, dim)))
    angles = d.values(cshape, torch.float32, 3.0)
    args = dict(q=q, k=k, cos=angles.cos().to(cdtype), sin=angles.sin().to(cdtype))
    if hf:
        args["unsqueeze_dim"] = 1 if layout == "bhsd" else 2
        return Case("apply_rotary_pos_emb", args, lambda a: lk.apply_rotary_pos_emb(**a),
                    lambda a, c: reference.hf_apply_rotary_pos_emb(**a), ("q", "k"), row_input="q", row_outputs=(0,), nan_in_grad=False,
                    bad=_common_bad(d, args, ("q", "k", "cos", "sin"), {"unsqueeze_dim": 5}))
    position_ids = None
    if table:
        position_ids = torch.randint(0, cshape[0], d.choice(((s,), (b, s))), generator=d.gen, device="cpu").to(d.device)
    args.update(position_ids=position_ids, layout=layout, interleaved=d.chance(0.3),
                rotary_dim=None if rotary == dim and d.chance(0.5) else rotary)

    def ref(a, c):
        pos = a["position_ids"]
        if pos is not None:
            pos = (pos if pos.dim() == 2 else pos[None]).expand(b, s)
        return reference.apply_rope(**{**a, "position_ids": pos}, compute_dtype=c)

    options = {"layout": "bsdh", "rotary_dim": rotary + 1}
    return Case("apply_rope", args, lambda a: lk.apply_rope(**a), ref, ("q", "k"), row_input="q", row_outputs=(0,), nan_in_grad=False,
                bad=_common_bad(d, args, ("q", "k", "cos", "sin"), _one_bad(d, options)))


def qk_norm_rope(d: Draw) -> Case:
    dtype = d.dtype()
    b, hq, s, dim = d.int(1, 3), d.int(1, 4), d.int(1, 9), 2 * d.int(1, 64)
    hk = d.choice((1, hq, d.int(1, hq)))
    layout = d.choice(("bhsd", "bshd"))
    shape_of = _heads_shape(layout, b, s, dim)
    q = d.tensor(shape_of(hq), dtype, layouts=("contiguous", "sliced", "strided"))
    k = d.tensor(shape_of(hk), dtype, layouts=("contiguous", "sliced", "strided"))
    wdtype = d.choice((dtype, torch.float32))
    angles = d.values(d.choice(((1, s, dim), (b, s, dim), (s, dim))), torch.float32, 3.0)
    cdtype = d.choice((dtype, torch.float32))
    args = dict(q=q, k=k, q_weight=d.tensor((dim,), wdtype, scale=0.5, layouts=("contiguous", "sliced")),
                k_weight=d.tensor((dim,), wdtype, scale=0.5, layouts=("contiguous", "sliced")),
                cos=angles.cos().to(cdtype), sin=angles.sin().to(cdtype), eps=d.choice((1e-6, 1e-5, 0.1)), layout=layout)
    tensors = ("q", "k", "q_weight", "k_weight", "cos", "sin")
    return Case("qk_norm_rope", args, lambda a: lk.qk_norm_rope(**a),
                lambda a, c: reference.qk_norm_rope(**a, compute_dtype=c), ("q", "k", "q_weight", "k_weight"),
                row_input="q", row_outputs=(0,),
                bad=_common_bad(d, args, tensors, _one_bad(d, {"layout": "sbhd", "eps": -1.0})))


# --------------------------------------------------------------------------------------------
# gated MLP
# --------------------------------------------------------------------------------------------
def glu(d: Draw, linear: bool) -> Case:
    dtype = d.dtype()
    shape = (*d.lead(), d.width(300))
    # The halves of a fused projection are slices of one tensor: "sliced" covers them.
    gate, up = d.tensor(shape, dtype), d.tensor(shape, dtype)
    args = dict(gate=gate, up=up, activation=d.choice(tuple(reference.GLU_ACTIVATIONS)))
    options = {"activation": "relu"}
    if not linear:
        return Case("glu", args, lambda a: lk.glu(**a), lambda a, c: (reference.glu(**a, compute_dtype=c),),
                    ("gate", "up"), row_input="gate", bad=_common_bad(d, args, ("gate", "up"), options))
    n = d.width(64)
    args.update(weight=d.tensor((n, shape[-1]), dtype, scale=shape[-1] ** -0.5, layouts=("contiguous", "transposed")),
                bias=d.tensor((n,), dtype) if d.chance(0.4) else None)

    def ref(a, c):
        y = reference.glu(a["gate"], a["up"], a["activation"], compute_dtype=c)
        return (torch.nn.functional.linear(y, a["weight"], a["bias"]),)

    return Case("glu_linear", args, lambda a: lk.glu_linear(**a), ref, ("gate", "up", "weight", "bias"),
                row_input="gate", follows_autocast=True, bad=_common_bad(d, args, ("gate", "up", "weight", "bias"), options))


# --------------------------------------------------------------------------------------------
# losses
# --------------------------------------------------------------------------------------------
LOSS_BAD = {"reduction": "avg", "label_smoothing": 1.5, "z_loss": -1.0, "softcap": 0.0, "ignore_index": 1.5}


def _loss_options(d: Draw, v: int) -> dict:
    return dict(ignore_index=d.choice((-100, -100, 0, v - 1)), reduction=d.choice(("mean", "sum", "none")),
                label_smoothing=d.choice((0.0, 0.0, 0.1, 1.0)), z_loss=d.choice((0.0, 0.0, 1e-3)),
                softcap=d.choice((None, None, 5.0)))


def rounded(compute: torch.dtype, dtype: torch.dtype) -> Optional[torch.dtype]:
    """The logits' dtype for the reference's float32 pass: the inputs' own, as the kernels round
    the cuBLAS product to it (the float64 pass keeps them exact, and the spread between the two
    passes admits that rounding where a gradient's cancellation over the vocabulary amplifies it)."""
    return dtype if compute == torch.float32 and dtype != torch.float32 else None


def _head(d: Draw, dtype: torch.dtype, m: int, v: int, h: Optional[int] = None) -> tuple:
    h = h or d.width(96)
    hidden = d.tensor((m, h), dtype, layouts=("contiguous", "transposed", "sliced", "strided"))
    weight = d.tensor((v, h), dtype, scale=h ** -0.5 * d.choice((1.0, 4.0)), layouts=("contiguous", "transposed"))
    return hidden, weight


def cross_entropy(d: Draw) -> Case:
    dtype, m, v = d.dtype(), d.rows(), d.choice((1, d.width(600), d.int(4090, 5000)))
    options = _loss_options(d, v)
    inplace = d.chance(0.3)
    args = dict(logits=d.tensor((m, v), dtype, scale=d.choice((1.0, 8.0)),
                                layouts=("contiguous", "sliced", "strided") if inplace else ("contiguous", "transposed",
                                                                                              "sliced", "strided")),
                target=d.target(m, v, options["ignore_index"]), **options, return_z_loss=d.chance(0.3),
                return_lse=d.chance(0.3), inplace_backward=inplace)

    def ref(a, c):
        keep = {k: a[k] for k in ("ignore_index", "reduction", "label_smoothing", "z_loss", "softcap")}
        loss, z, lse = reference.cross_entropy(a["logits"], a["target"], **keep, compute_dtype=c)
        return _ce_outputs(loss, z, lse, a)

    return Case("cross_entropy", args, lambda a: _ce_outputs(*_as_ce(lk.cross_entropy(**a)), a), ref, ("logits",),
                row_input="logits" if options["reduction"] == "none" else None, row_outputs=_ce_rows(args),
                mutates=("logits",) if inplace else (),
                bad=_common_bad(d, args, ("logits", "target"), _one_bad(d, LOSS_BAD)))


def vocab_parallel_cross_entropy(d: Draw) -> Case:
    """In one process (no process group): the whole vocabulary is this rank's shard."""
    dtype, m, v = d.dtype(), d.rows(), d.choice((1, d.width(600), d.int(4090, 5000)))
    options = {k: val for k, val in _loss_options(d, v).items() if k != "softcap"}
    inplace = d.chance(0.3)
    args = dict(logits=d.tensor((m, v), dtype, scale=d.choice((1.0, 8.0)),
                                layouts=("contiguous", "sliced", "strided") if inplace else ("contiguous", "transposed",
                                                                                              "sliced", "strided")),
                target=d.target(m, v, options["ignore_index"]), **options, inplace_backward=inplace)

    def ref(a, c):
        return reference.cross_entropy(a["logits"], a["target"], **options, compute_dtype=c)[:1]

    bad = {k: val for k, val in LOSS_BAD.items() if k != "softcap"}
    return Case("vocab_parallel_cross_entropy", args, lambda a: (lk.vocab_parallel_cross_entropy(**a),), ref,
                ("logits",), row_input="logits" if options["reduction"] == "none" else None,
                mutates=("logits",) if inplace else (),
                bad=_common_bad(d, args, ("logits", "target"), _one_bad(d, bad)), eager_only=True)


def _as_ce(out) -> tuple:
    return tuple(out) if isinstance(out, tuple) else (out, None, None)


def _ce_rows(a: dict) -> tuple:
    """The outputs that are per row with ``reduction="none"``: all but a z-loss part that the
    options make zeros."""
    z_rows = () if a["z_loss"] == 0 else (1,)
    return (0, *(z_rows if a["return_z_loss"] else ()), *((1 + a["return_z_loss"],) if a["return_lse"] else ()))


def _ce_outputs(loss, z, lse, a) -> tuple:
    """The outputs the call returned: the loss, then the z-loss and lse asked for (no gradient)."""
    return (loss, *((z.detach(),) if a.get("return_z_loss") else ()),
            *((lse.detach(),) if a.get("return_lse") else ()))


def linear_cross_entropy(d: Draw) -> Case:
    dtype, m, v = d.dtype(), d.rows(), d.choice((1, d.width(600), d.int(4090, 5000)))
    hidden, weight = _head(d, dtype, m, v)
    options = _loss_options(d, v)
    args = dict(hidden=hidden, weight=weight, target=d.target(m, v, options["ignore_index"]),
                bias=d.tensor((v,), dtype) if d.chance(0.3) else None, **options, return_z_loss=d.chance(0.3),
                return_lse=d.chance(0.3), chunk_size=d.choice((None, None, 1, d.int(2, 17))),
                accum_dtype=d.choice((torch.float32, None)), memory=d.choice(("fast", "low")))

    def ref(a, c):
        keep = {k: a[k] for k in ("ignore_index", "reduction", "label_smoothing", "z_loss", "softcap")}
        return _ce_outputs(*reference.linear_cross_entropy(a["hidden"], a["weight"], a["target"], a["bias"], **keep,
                                                           compute_dtype=c, logits_dtype=rounded(c, dtype)), a)

    bad = {**LOSS_BAD, "memory": "medium", "chunk_size": 0, "accum_dtype": torch.float16}
    return Case("linear_cross_entropy", args, lambda a: _ce_outputs(*_as_ce(lk.linear_cross_entropy(**a)), a), ref,
                ("hidden", "weight", "bias"), row_input="hidden" if options["reduction"] == "none" else None,
                row_outputs=_ce_rows(args),
                bad=_common_bad(d, args, ("hidden", "weight", "target", "bias"), _one_bad(d, bad)))


def linear_log_probs(d: Draw) -> Case:
    dtype, m, v = d.dtype(), d.rows(), d.choice((1, d.width(600), d.int(4090, 5000)))
    hidden, weight = _head(d, dtype, m, v)
    ignore_index = d.choice((-100, 0))
    args = dict(hidden=hidden, weight=weight, target=d.target(m, v, ignore_index),
                bias=d.tensor((v,), dtype) if d.chance(0.3) else None, temperature=d.choice((1.0, 0.7, 2.0)),
                return_entropy=d.chance(0.5), ignore_index=ignore_index, logits_dtype=d.choice((None, torch.float32)),
                vocab_chunk_size=d.choice((None, None, d.int(1, 700))))

    def ref(a, c):  # fp32 logits: the float32 pass unrounded, as the kernels keep them
        logp, entropy = reference.linear_log_probs(a["hidden"], a["weight"], a["target"], a["bias"],
                                                   temperature=a["temperature"], ignore_index=ignore_index,
                                                   compute_dtype=c,
                                                   logits_dtype=None if a["logits_dtype"] else rounded(c, dtype))
        return (logp, entropy) if a["return_entropy"] else (logp,)

    bad = {"temperature": 0.0, "vocab_chunk_size": -1, "ignore_index": "x", "logits_dtype": torch.bfloat16}
    return Case("linear_log_probs", args, lambda a: lk.linear_log_probs(**a), ref, ("hidden", "weight", "bias"),
                row_input="hidden",
                bad=_common_bad(d, args, ("hidden", "weight", "target", "bias"), _one_bad(d, bad)))


def linear_z_loss(d: Draw) -> Case:
    dtype, m, v = d.dtype(), d.rows(), d.choice((1, d.width(600), d.int(4090, 5000)))
    hidden, weight = _head(d, dtype, m, v)
    args = dict(hidden=hidden, weight=weight, bias=d.tensor((v,), dtype) if d.chance(0.3) else None,
                reduction=d.choice(("mean", "sum", "none")), chunk_size=d.choice((None, None, d.int(1, 9))),
                vocab_chunk_size=d.choice((None, None, d.int(1, 700))))

    def ref(a, c):
        return (reference.linear_z_loss(a["hidden"], a["weight"], a["bias"], reduction=a["reduction"], compute_dtype=c,
                                        logits_dtype=rounded(c, dtype)),)

    bad = {"reduction": "avg", "chunk_size": 0, "vocab_chunk_size": -1}
    return Case("linear_z_loss", args, lambda a: (lk.linear_z_loss(**a),), ref, ("hidden", "weight", "bias"),
                row_input="hidden" if args["reduction"] == "none" else None,
                bad=_common_bad(d, args, ("hidden", "weight", "bias"), _one_bad(d, bad)))


def linear_distill_loss(d: Draw) -> Case:
    dtype, m, v = d.dtype(), d.rows(), d.choice((1, d.width(600), d.int(4090, 5000)))
    student = _head(d, dtype, m, v)
    teacher = _head(d, d.choice((dtype, torch.float32)), m, v)
    kind = d.choice(reference.DISTILL_KINDS)
    ignore_index = -100
    reduction = d.choice(("mean", "sum", "none"))
    args = dict(student_hidden=student[0], student_weight=student[1], teacher_hidden=teacher[0],
                teacher_weight=teacher[1], target=d.target(m, v, ignore_index) if d.chance(0.6) else None, kind=kind,
                beta=d.choice((0.5, 0.1, 0.9)), temperature=d.choice((1.0, 0.7, 2.0)), reduction=reduction,
                chunk_size=d.choice((None, None, d.int(1, 9))), memory=d.choice(("low", "fast")),
                accum_dtype=d.choice((torch.float32, None)))

    def ref(a, c):
        keep = {k: a[k] for k in ("kind", "beta", "temperature", "reduction")}
        return (reference.linear_distill_loss(a["student_hidden"], a["student_weight"], a["teacher_hidden"],
                                              a["teacher_weight"], a["target"], **keep, compute_dtype=c,
                                              logits_dtypes=(rounded(c, dtype), rounded(c, teacher[0].dtype))),)

    bad = {"kind": "kl", "beta": 1.0 if kind == "jsd" else None, "temperature": -1.0, "reduction": "avg",
           "memory": "medium", "chunk_size": 0}
    bad = {k: b for k, b in bad.items() if b is not None}
    return Case("linear_distill_loss", args, lambda a: (lk.linear_distill_loss(**a),), ref,
                ("student_hidden", "student_weight"), row_input="student_hidden" if reduction == "none" else None,
                bad=_common_bad(d, args, ("student_hidden", "student_weight", "teacher_hidden", "teacher_weight",
                                          "target"), _one_bad(d, bad)))


# --------------------------------------------------------------------------------------------
# Mixture of experts
# --------------------------------------------------------------------------------------------
def _routing(d: Draw, t: int, n_experts: int, k: int) -> torch.Tensor:
    """``[t, k]`` distinct experts a token: at times every token on one expert (the others
    empty), at times slots of another rank (expert ``E``, dropped; never all of a token's)."""
    scores = torch.rand(t, n_experts, generator=d.gen)
    if d.chance(0.2):
        scores[:, d.int(0, n_experts - 1)] += 2.0
    index = scores.argsort(-1, descending=True)[:, :k]
    if k > 1 and d.chance(0.2):
        index[::3, 0] = n_experts
    return index.to(d.choice((torch.int64, torch.int32))).to(d.device)


def moe_experts(d: Draw) -> Case:
    dtype, t = d.dtype(), d.rows(24)
    n_experts = d.int(1, 6)
    k, hidden, inter = d.int(1, n_experts), d.width(80), d.width(48)
    gpt_oss = d.chance(0.3)  # transposed, interleaved weights with biases and the clamped SwiGLU

    def weight(n, kk, scale):
        return d.tensor((n_experts, kk, n) if gpt_oss else (n_experts, n, kk), dtype, scale=scale,
                        layouts=("contiguous", "transposed", "strided"))

    args = dict(x=d.tensor((t, hidden), dtype), top_k_index=_routing(d, t, n_experts, k),
                top_k_weights=d.tensor((t, k), d.choice((dtype, torch.float32)), scale=0.5),
                gate_up_proj=weight(2 * inter, hidden, hidden ** -0.5), down_proj=weight(hidden, inter, inter ** -0.5),
                gate_up_bias=d.tensor((n_experts, 2 * inter), dtype, scale=0.3) if gpt_oss else None,
                down_bias=d.tensor((n_experts, hidden), dtype, scale=0.3) if gpt_oss else None,
                activation="clamped_swiglu" if gpt_oss else "silu", interleaved=gpt_oss, transposed=gpt_oss,
                # (a bf16 ulp decides a clamp near the limit: the limits are crossed in fp32 only)
                limit=d.choice((7.0, 1.0)) if dtype == torch.float32 else 7.0, lora=None)
    if d.chance(0.3):  # (a record: its outputs are checked here, its gradients by tests/test_moe_lora.py)
        r = d.int(1, 8)
        pairs = [(d.tensor((n_experts, r, kk), d.choice((dtype, torch.float32)), scale=0.3),
                  d.tensor((n_experts, n, r), d.choice((dtype, torch.float32)), scale=0.3)) if d.chance(0.7) else None
                 for n, kk in ((2 * inter, hidden), (hidden, inter))]
        args["lora"] = None if pairs == [None, None] else lk.ExpertLora(*pairs, d.choice((0.5, 2.0)))

    def ref(a, c):
        lora = None if a["lora"] is None else reference_moe.Lora(*a["lora"])
        return (reference_moe.experts(**{**a, "lora": lora}, compute_dtype=c, model_dtype=dtype),)

    tensors = ("x", "top_k_weights", "gate_up_proj", "down_proj", "gate_up_bias", "down_bias")
    # (torch.clamp passes no gradient to a NaN: gpt-oss's clamps keep a NaN of x out of dx)
    return Case("moe_experts", args, lambda a: (lk.moe_experts(**a),), ref, tensors, row_input="x",
                nan_in_grad=not gpt_oss, bad=_common_bad(d, args, tensors, _one_bad(d, {"activation": "relu", "limit": math.inf})))


BUILDERS = {
    "rms_norm": lambda d: norm(d, True),
    "layer_norm": lambda d: norm(d, False),
    "apply_rope": lambda d: rope(d, False),
    "apply_rotary_pos_emb": lambda d: rope(d, True),
    "qk_norm_rope": qk_norm_rope,
    "glu": lambda d: glu(d, False),
    "glu_linear": lambda d: glu(d, True),
    "cross_entropy": cross_entropy,
    "vocab_parallel_cross_entropy": vocab_parallel_cross_entropy,
    "linear_cross_entropy": linear_cross_entropy,
    "linear_log_probs": linear_log_probs,
    "linear_distill_loss": linear_distill_loss,
    "linear_z_loss": linear_z_loss,
    "moe_experts": moe_experts,
}
