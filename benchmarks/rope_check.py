"""RoPE on the GPU: check against HF at the benchmark size, then time fwd and bwd against the peers.

    PYTHONPATH=. python benchmarks/rope_check.py --out results.json

bf16 q [B, Hq, S, D] = [8, 32, 4096, 128] and k [8, 8, 4096, 128] (and the [B, S, H, D] layout),
cos/sin [1, S, D] bf16 as Hugging Face's rotary embedding returns them. GB/s counts q and k read
once and written once (fwd: q, k in, q_out, k_out out; bwd: dq_out, dk_out in, dq, dk out);
``gbps_with_cos`` also counts cos and sin read once. Times are ``triton.testing.do_bench``
medians (L2 flushed before each call); the device-to-device copy of a 256 MiB tensor (bytes read
+ written) is measured in the same process. The bwd of every provider is
``torch.autograd.grad`` over a retained graph. Also sweeps a few kernel configs
(BLOCK_T, BLOCK_HQ, BLOCK_HK, num_warps) to check the default heuristic.
"""
from __future__ import annotations

import argparse
import datetime
import json

import torch
import triton
from triton.testing import do_bench

import llmkernels
from llmkernels import reference
from llmkernels.bench.runner import copy_bandwidth
from llmkernels.ops import rope as rope_ops

B, HQ, HK, S, D = 8, 32, 8, 4096, 128
# (BLOCK_T, BLOCK_HQ, BLOCK_HK, num_warps). Earlier runs (2026-11-22, results/rope-h100-*-run*.json)
# also timed (1, 32, 8, 8), (2, 32, 8, 8), (4, 32, 8, 16), (2, 16, 8, 4), (1, 16, 8, 2), (1, 16, 4, 4):
# none faster than 4 warps with 8-16 heads a step.
CONFIGS = [(1, 32, 8, 4), (1, 16, 8, 4), (1, 8, 8, 4), (2, 8, 8, 4), (1, 8, 8, 2), (1, 4, 4, 4)]


def bench(fn):
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def providers(layout):
    unsqueeze = 1 if layout == "bhsd" else 2
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf

    def hf_fn(q, k, cos, sin):
        return hf(q, k, cos, sin, unsqueeze_dim=unsqueeze)

    out = {
        "llmkernels": lambda q, k, cos, sin: llmkernels.apply_rope(q, k, cos, sin, layout=layout),
        "hf_eager": hf_fn,
        "torch_compile": torch.compile(hf_fn, dynamic=False, fullgraph=True),
    }
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
        if layout == "bhsd":
            out["liger"] = liger_rotary_pos_emb
        else:  # Liger takes [B, H, S, D]: give it the transposed views (free).
            def liger_bshd(q, k, cos, sin):
                qo, ko = liger_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
                return qo.transpose(1, 2), ko.transpose(1, 2)
            out["liger"] = liger_bshd
    except ImportError as exc:
        print("liger unavailable:", exc)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layouts", nargs="+", default=["bhsd", "bshd", "bhsd_view"])
    ap.add_argument("--providers", nargs="+", help="default: all")
    ap.add_argument("--no-sweep", action="store_true", help="skip the kernel config sweep")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.cuda.get_device_name()
    copy = copy_bandwidth(torch.device("cuda"))
    print(f"device {dev}, copy {copy:.0f} GB/s, torch {torch.__version__}, triton {triton.__version__}")
    records = []
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D)
    ang = torch.arange(S, device="cuda", dtype=torch.float32)[:, None] * inv_freq
    ang = torch.cat((ang, ang), -1)[None]
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    meta = {"date": datetime.date.today().isoformat(), "device": dev, "torch": torch.__version__,
            "triton": triton.__version__, "copy_gbps": copy}
    # (name, apply_rope layout, q/k maker): "bhsd_view" is what a HF model passes: [B, H, S, D]
    # views (transposes) of [B, S, H, D] projections.
    cases = [("bhsd", "bhsd", lambda h: torch.randn(B, h, S, D, device="cuda", dtype=torch.bfloat16)),
             ("bshd", "bshd", lambda h: torch.randn(B, S, h, D, device="cuda", dtype=torch.bfloat16)),
             ("bhsd_view", "bhsd",
              lambda h: torch.randn(B, S, h, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2))]
    for name_layout, layout, make in [c for c in cases if c[0] in args.layouts]:
        q, k = make(HQ), make(HK)
        qk_bytes = 2 * (q.numel() + k.numel()) * q.element_size()
        cos_bytes = 2 * cos.numel() * cos.element_size()
        shape = {"B": B, "Hq": HQ, "Hk": HK, "S": S, "D": D, "layout": name_layout}
        provs = {n: f for n, f in providers(layout).items() if not args.providers or n in args.providers}
        # Check at this size: against the float64 reference (Liger rotates its input in place,
        # so each provider gets copies).
        q_ref, k_ref = reference.apply_rope(q.double(), k.double(), cos.double(), sin.double(), layout=layout,
                                            compute_dtype=torch.float64)
        errs = {}
        for name, fn in provs.items():
            qo, ko = fn(q.clone(), k.clone(), cos, sin)
            errs[name] = max(((qo.double() - q_ref).norm() / q_ref.norm()).item(),
                             ((ko.double() - k_ref).norm() / k_ref.norm()).item())
        del q_ref, k_ref, qo, ko
        print(name_layout, "rel err vs float64:", {n: f"{e:.2e}" for n, e in errs.items()})
        assert errs["llmkernels"] < 1e-2, errs

        def record(mode, provider, ms, **extra):
            r = {"op": "rope", "mode": mode, "provider": provider, "dtype": "bf16", "shape": shape, "ms": ms,
                 "gbps": qk_bytes / ms / 1e6, "gbps_with_cos": (qk_bytes + cos_bytes) / ms / 1e6,
                 "copy_gbps": copy, "frac_of_copy": qk_bytes / ms / 1e6 / copy, "device": dev, **extra}
            records.append(r)
            print(f"{name_layout} {mode:4s} {provider:28s} {ms * 1e3:8.1f} us {r['gbps']:6.0f} GB/s "
                  f"({r['frac_of_copy']:.2f} x copy)", flush=True)

        if name_layout != "bhsd_view" and not args.no_sweep:
            # Kernel configs on the forward launcher, called as apply_rope calls it.
            qv, kv = (q.transpose(1, 2), k.transpose(1, 2)) if layout == "bhsd" else (q, k)
            qo, ko = torch.empty_like(qv), torch.empty_like(kv)
            cx = cos.expand(B, S, D)
            print("default config:", rope_ops.rope_config(B * S, HQ, HK, D))
            for cfg in CONFIGS:
                ms = bench(lambda: rope_ops.rope_launch(
                    qv, kv, cx, cx, None, rope_ops.RopeOptions(False, D, False, qv.dtype, kv.dtype, "bshd"), qo, ko,
                    config=rope_ops.RopeConfig(*cfg)))
                record("fwd", f"llmkernels{list(cfg)}", ms, config=list(cfg))
            del qo, ko
        for name, fn in provs.items():
            record("fwd", name, bench(lambda: fn(q, k, cos, sin)), rel_err=errs[name])
            qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
            outs = fn(qg, kg, cos, sin)
            grads = [torch.randn_like(o) for o in outs]
            record("bwd", name, bench(lambda: torch.autograd.grad(outs, (qg, kg), grads, retain_graph=True)))
            del qg, kg, outs, grads
        del q, k
        torch.cuda.empty_cache()
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1)
    print("\nsummary (GB/s, x copy), q/k bf16 B=8 Hq=32 Hk=8 S=4096 D=128")
    for r in records:
        if not r["provider"].startswith("llmkernels["):
            print(f"  {r['shape']['layout']} {r['mode']:3s} {r['provider']:14s} {r['gbps']:6.0f}  "
                  f"{r['frac_of_copy']:.2f}")


if __name__ == "__main__":
    main()
