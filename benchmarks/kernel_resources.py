"""Registers and spills of the split norm kernels, compiled for a GPU target on any machine.

Triton compiles for a target without a device (its wheel ships ptxas and cuobjdump), so the
register footprint of a launch configuration can be read on a CPU-only machine: a config whose
threads spill to the stack (local memory) pays for it in bandwidth. Prints, per (dtype, op,
columns per program, warps, stages (backward: 0 the exchange in step, 3 a row ahead with the loads
pipelined; forward: 0 a row ahead in registers, 3 the loads pipelined), and for the forward
programs per SM, the registers capped as launched),
the registers per thread, the stack bytes per thread and the shared memory.

    python benchmarks/kernel_resources.py [--kernel bwd|fwd] [--arch 90] [--parts 8]
"""
from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from llmkernels.ops.norm import backward as norm_backward, forward as norm_forward
from llmkernels.ops._rowsplit import resident_registers

CONFIGS = [  # (columns per program, num_warps)
    (4096, 8), (4096, 16), (8192, 8), (8192, 16), (8192, 32),
]
FWD_CONFIGS = [  # (columns per program, num_warps, programs per SM)
    (4096, 4, 4), (8192, 4, 2), (8192, 8, 1), (8192, 8, 2), (16384, 8, 1), (16384, 16, 1),
]


def split_kernel_resources(dtype: str, is_rms: bool, block_n: int, num_warps: int, stages: int, parts: int,
                           arch: int, forward: bool = False, per_sm: int = 1) -> dict:
    """Compile ``norm_bwd_split_kernel`` (``forward``: ``norm_fwd_split_kernel`` with ``per_sm``
    programs an SM, its registers capped as the launcher does) for
    ``sm_<arch>``; its registers and stack per thread and its shared memory per program."""
    ptr = "*" + dtype
    options = dict(num_warps=num_warps)
    if forward:
        kernel = norm_forward.norm_fwd_split_kernel
        types = dict(X=ptr, X_DESC=ptr, RES=ptr, W=ptr, B=ptr, Y=ptr, H=ptr, MEAN="*fp32", RSTD="*fp32",
                     SLOTS="*i64", M="i32", N="i32", stride_x="i32", stride_res="i32", stride_y="i32",
                     stride_h="i32", eps="fp32", weight_offset="fp32")
        constexprs = dict(IS_RMS=is_rms, HAS_RES=False, HAS_W=True, HAS_B=not is_rms, ROUND_X_HAT=is_rms,
                          STORE_STATS=True, PARTS=parts, PARTS_POW2=triton.next_power_of_2(parts), BLOCK_N=block_n,
                          EVEN=True, STAGES=stages)
        options["maxnreg"] = resident_registers(num_warps, per_sm)
    else:
        kernel = norm_backward.norm_bwd_split_kernel
        types = dict(X=ptr, W=ptr, DY=ptr, DH=ptr, DX=ptr, DRES=ptr, DW_PART="*fp32", DB_PART="*fp32",
                     MEAN="*fp32", RSTD="*fp32", SLOTS="*i64", M="i32", N="i32", stride_x="i32", stride_dy="i32",
                     stride_dh="i32", stride_dx="i32", stride_dres="i32", weight_offset="fp32")
        constexprs = dict(IS_RMS=is_rms, HAS_W=True, HAS_B=not is_rms, HAS_DH=False, HAS_DRES=False,
                          ROUND_X_HAT=is_rms, PARTS=parts, PARTS_POW2=triton.next_power_of_2(parts), BLOCK_N=block_n,
                          STAGES=stages, W_PACKED=False)
    names = kernel.arg_names
    src = ASTSource(fn=kernel, signature={n: types.get(n, "constexpr") for n in names},
                    constexprs={(names.index(k),): v for k, v in constexprs.items()},
                    # as launched: every pointer 16-byte aligned, every int a multiple of 16 (without
                    # this the loads are not vectorized and the counts are those of another kernel)
                    attrs={(names.index(k),): [["tt.divisibility", 16]] for k, v in types.items() if v[0] != "f"})
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
    found = re.search(r"REG:(\d+).*?STACK:(\d+)", usage, re.S)
    return {"regs": int(found.group(1)), "stack_bytes": int(found.group(2)), "shared_bytes": compiled.metadata.shared}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for H100")
    ap.add_argument("--parts", type=int, default=8, help="programs per row (PARTS)")
    ap.add_argument("--kernel", choices=["bwd", "fwd"], default="bwd", help="the split backward or forward")
    args = ap.parse_args()
    print(f"triton {triton.__version__}, sm_{args.arch}, PARTS={args.parts}, split {args.kernel}")
    if args.kernel == "fwd":
        print(f"{'dtype':5s} {'op':3s} {'cols':>5s} {'warps':>5s} {'per SM':>6s} {'stages':>6s} {'regs':>4s} "
              f"{'stack B':>7s} {'shared B':>8s}")
        for dtype, is_rms, (block_n, warps, per_sm), stages in itertools.product(("bf16", "fp32"), (True, False),
                                                                                 FWD_CONFIGS, (0, 3)):
            res = split_kernel_resources(dtype, is_rms, block_n, warps, stages, args.parts, args.arch, True, per_sm)
            print(f"{dtype:5s} {'rms' if is_rms else 'ln':3s} {block_n:5d} {warps:5d} {per_sm:6d} {stages:6d} "
                  f"{res['regs']:4d} {res['stack_bytes']:7d} {res['shared_bytes']:8d}", flush=True)
        return
    print(f"{'dtype':5s} {'op':3s} {'cols':>5s} {'warps':>5s} {'stages':>6s} {'regs':>4s} {'stack B':>7s} "
          f"{'shared B':>8s}")
    for dtype, is_rms, (block_n, warps), stages in itertools.product(("bf16", "fp32"), (True, False), CONFIGS,
                                                                     (0, 3)):
        res = split_kernel_resources(dtype, is_rms, block_n, warps, stages, args.parts, args.arch)
        print(f"{dtype:5s} {'rms' if is_rms else 'ln':3s} {block_n:5d} {warps:5d} {stages:6d} "
              f"{res['regs']:4d} {res['stack_bytes']:7d} {res['shared_bytes']:8d}", flush=True)


if __name__ == "__main__":
    main()
