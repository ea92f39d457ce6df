"""The differential fuzzer (``llmkernels.fuzz``): a seeded subset over every op on this device, the
cases it once failed on (kept as regressions), and proof that it catches each kind of defect it
looks for (a planted wrong value, wrong gradient, modified input, nondeterminism, a NaN leaking
to other rows, a bad argument accepted)."""
import dataclasses

import pytest
import torch

from llmkernels.fuzz import BUILDERS, Mismatch, fuzz
from llmkernels.fuzz.check import run_case
from llmkernels.fuzz.draw import Draw
from tests.conftest import DEVICE

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

SEED = 20261127
# Cases that failed once, by (op, seed, index, context): each stays as a test.
REGRESSIONS = [
    ("layer_norm", 1, 21, "compile"),  # as_rows' view-or-reshape try/except broke fullgraph
    ("cross_entropy", 2, 6, "plain"),  # all rows ignored, mean: a z_loss=0 call's z-loss part is 0, not NaN
    ("glu_linear", 2, 15, "autocast"),  # glu_linear's matmuls follow autocast, as down_proj(glu(...)) does
    ("glu_linear", SEED, 1695, "autocast"),  # (H200) bf16 sums of bf16 products: autocast's tolerance
    ("layer_norm", SEED, 101, "plain"),  # (H200) h = x + residual half-way between two bf16 values, N = 2
    ("linear_log_probs", SEED, 4228, "plain"),  # (H200) fp16 logits rounded, entropy's gradient cancels
    ("linear_distill_loss", SEED, 4799, None),  # (H200) V = 1: a zero reference, noise summed over the rows
    # (4 x H200, torch 2.11) Dynamo could not trace hasattr on a nested options record's class
    ("cross_entropy", 2026112702, 2712, "compile"),
    ("linear_cross_entropy", 2026112702, 3209, "compile"),
    ("vocab_parallel_cross_entropy", 2026112702, 4847, "compile"),  # (4 x H200) eager only: runs plain
    ("layer_norm", SEED, 265, "plain"),  # residual 1e3 above its spread: the variance shifted by x[0], not h[0]
    ("rms_norm", SEED, 880, "plain"),  # (GPU only) no weight, 75 rows: the backward launched dW sums with None
    ("layer_norm", SEED, 5743, "plain"),  # (GPU only) likewise, LayerNorm without weight and bias
    # (H100) a "bad" unsqueeze_dim of 3 that HF's formula takes: cos [1, 4, 4] at 3 broadcasts to q [3, 4, 4, 4]
    ("apply_rotary_pos_emb", 20261128, 1235, None),
    ("apply_rotary_pos_emb", 20261128, 68, "compile"),  # (H100) the fake judged density from empty_like's strides
    ("linear_z_loss", 20261128, 5614, None),  # (H100) fp16 dhidden beyond 65504: inf is right, not a mismatch
    ("moe_experts", 7, 9, "plain"),  # a column-major down bias read as row-major
    ("moe_experts", 7, 15, "plain"),  # gpt-oss's clamps dropped a NaN (Triton's minimum / maximum)
    ("moe_experts", 7, 59, "autocast"),  # the down bias's part of dweights in bf16 under autocast
    ("moe_experts", 9, 47, "compile"),  # inductor: the backward op's schema named a bool x beside the tensor x
]


def test_seeded_subset_every_op():
    summary = fuzz(3 * len(BUILDERS), seed=SEED, device=DEVICE)
    assert summary["cases"] == 3 * len(BUILDERS)
    assert summary["failures"] == 0, summary["failed"]
    assert all(stats["cases"] == 3 for stats in summary["per_op"].values())


@pytest.mark.parametrize("op,seed,index,context", REGRESSIONS)
def test_regression(op, seed, index, context):
    run_case(BUILDERS[op], seed, index, torch.device(DEVICE), context=context)


def planted(op, change):
    """``op``'s builder with ``change(case)`` applied to every case it draws."""
    def build(draw):
        case = BUILDERS[op](draw)
        change(case)
        return case
    return build


def first_case(build, context="plain", need=lambda case: True):
    """Run the first case (of a few seeds) that ``need`` accepts; the Mismatch it raises, if any."""
    for index in range(40):
        case = build(Draw(SEED, index, torch.device(DEVICE)))
        if need(case):
            with pytest.raises(Mismatch) as caught:
                run_case(build, SEED, index, torch.device(DEVICE), context=context)
            return str(caught.value)
    raise AssertionError("no case drawn fits")


def test_catches_a_wrong_value():
    def change(case):
        call = case.call
        case.call = lambda a: call(a) * 1.01
    assert "output" in first_case(planted("glu", change), need=lambda c: c.args["gate"].numel() > 0)


class _DoubleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        return y.clone()

    @staticmethod
    def backward(ctx, g):
        return 2 * g


def test_catches_a_wrong_gradient():
    def change(case):
        call = case.call
        case.call = lambda a: _DoubleGrad.apply(call(a))
    message = first_case(planted("rms_norm", change),
                         need=lambda c: c.args["x"].numel() > 0 and c.args["x"].shape[-1] > 1)
    assert "dx" in message or "dweight" in message or "dresidual" in message or "dbias" in message


def test_catches_a_modified_input():
    def change(case):
        call = case.call

        def writes(a):
            out = call(a)
            with torch.no_grad():
                a["up"].mul_(2)
            return out
        case.call = writes
    assert "modified" in first_case(planted("glu", change), context="no_grad",  # (autograd would see the write)
                                    need=lambda c: c.args["up"].numel() > 0 and 0 not in c.args["up"].stride())


def test_catches_nondeterminism():
    runs = iter(range(10 ** 6))

    def change(case):
        call = case.call
        case.call = lambda a: call(a) * (1 + next(runs) * 1e-6)  # the second run differs in its last bits
    assert "deterministic" in first_case(planted("glu", change),
                                         need=lambda c: c.args["gate"].numel() > 0 and c.args["gate"].dtype
                                         == torch.float32)


def first_mismatch(build, context, checks, tries):
    """The message of the first Mismatch over cases 0 .. tries - 1 (a check that runs on a share
    of the cases); fails if none raised one."""
    for index in range(tries):
        try:
            run_case(build, SEED, index, torch.device(DEVICE), context=context, checks=checks)
        except Mismatch as e:
            return str(e)
    raise AssertionError(f"no case of {tries} raised a Mismatch under checks {checks}")


def test_catches_a_nan_leaking_to_other_rows():
    def change(case):
        call = case.call
        case.call = lambda a: call(a) + torch.where(torch.isnan(a["gate"]).any(), float("nan"), 0.0)
    # the NaN check runs on a share of the plain cases
    assert "other rows" in first_mismatch(planted("glu", change), "plain", ("nan",), tries=200)


def test_catches_an_accepted_bad_argument():
    def change(case):
        case.bad = [("activation", {**case.args, "activation": "silu"})]  # a valid value: accepted
    assert "accepted" in first_mismatch(planted("glu", change), "no_grad", ("bad",), tries=40)


def test_case_field_names_are_the_ops_arguments():
    """A case's args are passed by name: every builder draws only arguments its op takes."""
    import inspect

    import llmkernels as lk
    for op, build in BUILDERS.items():
        case = build(Draw(SEED, 0, torch.device(DEVICE)))
        params = inspect.signature(getattr(lk, op)).parameters
        assert set(case.args) <= set(params), (op, set(case.args) - set(params))
        assert dataclasses.is_dataclass(case)
