"""Registers and spills of the split norm backward, compiled for a GPU target on any machine.

Triton compiles for a target without a device (its wheel ships ptxas and cuobjdump), so the
register footprint of a launch configuration can be read on a CPU-only machine: a config whose
threads spill to the stack (local memory) pays for it in bandwidth. Prints, per (dtype, op,
columns per program, warps, stages: 0 the exchange in step, 3 a row ahead with the loads
pipelined), the registers per thread, the stack bytes per thread and the shared memory.

    python benchmarks/kernel_resources.py [--arch 90] [--parts 8]
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

from llmkernels.ops import norm as N_

CONFIGS = [  # (columns per program, num_warps)
    (4096, 8), (4096, 16), (8192, 8), (8192, 16), (8192, 32),
]


def split_kernel_resources(dtype: str, is_rms: bool, block_n: int, num_warps: int, stages: int, parts: int,
                           arch: int) -> dict:
    """Compile ``_norm_bwd_split_kernel`` for ``sm_<arch>``; its registers and stack per thread and
    its shared memory per program."""
    ptr = "*" + dtype
    types = dict(X=ptr, W=ptr, DY=ptr, DH=ptr, DX=ptr, DRES=ptr, DW_PART="*fp32", DB_PART="*fp32",
                 MEAN="*fp32", RSTD="*fp32", SLOTS="*i64", M="i32", N="i32", stride_x="i32", stride_dy="i32",
                 stride_dh="i32", stride_dx="i32", stride_dres="i32", weight_offset="fp32")
    constexprs = dict(IS_RMS=is_rms, HAS_W=True, HAS_B=not is_rms, HAS_DH=False, HAS_DRES=False, QUANTIZE=is_rms,
                      PARTS=parts, PARTS_POW2=triton.next_power_of_2(parts), BLOCK_N=block_n, STAGES=stages)
    names = N_._norm_bwd_split_kernel.arg_names
    src = ASTSource(fn=N_._norm_bwd_split_kernel, signature={n: types.get(n, "constexpr") for n in names},
                    constexprs={(names.index(k),): v for k, v in constexprs.items()},
                    # as launched: every pointer 16-byte aligned, every int a multiple of 16 (without
                    # this the loads are not vectorized and the counts are those of another kernel)
                    attrs={(names.index(k),): [["tt.divisibility", 16]] for k in types if k != "weight_offset"})
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps))
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
    args = ap.parse_args()
    print(f"triton {triton.__version__}, sm_{args.arch}, PARTS={args.parts}")
    print(f"{'dtype':5s} {'op':3s} {'cols':>5s} {'warps':>5s} {'stages':>6s} {'regs':>4s} {'stack B':>7s} "
          f"{'shared B':>8s}")
    for dtype, is_rms, (block_n, warps), stages in itertools.product(("bf16", "fp32"), (True, False), CONFIGS,
                                                                     (0, 3)):
        res = split_kernel_resources(dtype, is_rms, block_n, warps, stages, args.parts, args.arch)
        print(f"{dtype:5s} {'rms' if is_rms else 'ln':3s} {block_n:5d} {warps:5d} {stages:6d} "
              f"{res['regs']:4d} {res['stack_bytes']:7d} {res['shared_bytes']:8d}", flush=True)


if __name__ == "__main__":
    main()
