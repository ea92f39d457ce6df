"""Time the cross-entropy forward's online loop over chunk widths and warps on a GPU
(bf16 logits, no grad); GB/s counts the logits read once; copy measured first.

    python benchmarks/ce_forward_variants.py

A per-lane variant of the online statistics (no cross-warp reduction inside the loop, two
exps per element) was timed with this script and lost everywhere; see
benchmarks/results/cross_entropy-forward-variants-h100-2026-11-22.txt.
"""
import dataclasses
import itertools

import torch
from triton.testing import do_bench

import llmkernels
from llmkernels.bench.runner import copy_bandwidth
from llmkernels.ops.configs.cross_entropy import DEFAULT_CONFIG

copy = copy_bandwidth(torch.device("cuda"))
print(f"copy {copy:.0f} GB/s", flush=True)
for m, v in [(8192, 32000), (8192, 128256), (4096, 262144)]:
    logits = torch.randn(m, v, device="cuda", dtype=torch.bfloat16)
    target = torch.randint(0, v, (m,), device="cuda")
    ref = torch.nn.functional.cross_entropy(logits.float(), target)
    for chunk, warps in itertools.product([4096, 8192, 16384], [8, 16, 32]):
        forward = dataclasses.replace(DEFAULT_CONFIG.forward, block_v=chunk, num_warps=warps)
        config = dataclasses.replace(DEFAULT_CONFIG, forward=forward)
        with torch.no_grad():
            try:
                loss = llmkernels.cross_entropy(logits, target, config=config)
                err = abs(loss.float().item() - ref.item()) / ref.item()
                ms = do_bench(lambda: llmkernels.cross_entropy(logits, target, check_targets=False, config=config),
                              return_mode="median")
            except Exception as e:
                print(f"{m}x{v} chunk={chunk} warps={warps} failed {type(e).__name__}", flush=True)
                continue
        gbps = logits.numel() * 2 / ms / 1e6
        print(f"{m}x{v} chunk={chunk:5d} warps={warps:2d}  {gbps:6.0f} GB/s ({gbps / copy:.2f})  "
              f"rel err {err:.1e}", flush=True)
    del logits
    torch.cuda.empty_cache()
