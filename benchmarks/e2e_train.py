"""End-to-end training step of a ~1.3B-parameter Llama-style model: tokens/s and peak memory.

Providers (each runs in its own process, so that patches and allocator state don't leak):
  hf        transformers eager (sdpa attention), loss from materialized logits
  llmkernels  the same model after ``llmkernels.patch(model)``: RMSNorm, RoPE, the SwiGLU
            MLP activation with its down projection (``glu_linear``: the product is recomputed
            in the backward, not kept), fused linear cross-entropy (whatever the report says
            was patched is recorded in the JSON)
  liger     ``liger_kernel.transformers.apply_liger_kernel_to_llama()`` (its defaults: RMSNorm,
            RoPE, SwiGLU, fused linear cross-entropy) before the model is built
  compile   ``torch.compile(model)`` of the HF model (inductor); compile time reported apart

Every provider builds the same model from the same seed, in bf16 (weights and activations),
trains with AdamW (fused) on the same random token batches, runs ``--warmup`` steps, then
times ``--steps`` steps (CUDA-synchronized wall clock). Peak memory is
``torch.cuda.max_memory_allocated`` over the timed steps (weights, grads, optimizer state and
activations). Losses of every step are recorded, so providers can be checked against hf.

    python benchmarks/e2e_train.py --out benchmarks/results/e2e-h100-DATE.json
    python benchmarks/e2e_train.py --provider llmkernels --layers 2   # one provider, small
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PROVIDERS = ("hf", "llmkernels", "liger", "compile")


def build_model(args):
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa",
                                                           dtype=torch.bfloat16)
    return model


def run_provider(args) -> dict:
    import torch

    result = {"provider": args.provider}
    if args.provider == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        import liger_kernel
        apply_liger_kernel_to_llama()
        result["liger_version"] = getattr(liger_kernel, "__version__", None) or _dist_version("liger_kernel")
    model = build_model(args)
    model.train()
    result["params"] = sum(p.numel() for p in model.parameters())
    if args.provider == "llmkernels":
        import llmkernels
        report = llmkernels.patch(model)
        print(report, flush=True)
        result["patched"], result["not_patched"] = report.patched, report.not_patched
    step_model = torch.compile(model) if args.provider == "compile" else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda", generator=g)
               for _ in range(args.warmup + args.steps)]
    losses = []

    def step(ids):
        loss = step_model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    t0 = time.perf_counter()
    for i in range(args.warmup):
        losses.append(step(batches[i]))
        if i == 0:
            torch.cuda.synchronize()
            result["first_step_s"] = time.perf_counter() - t0  # includes compilation for "compile"
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for i in range(args.warmup, args.warmup + args.steps):
        losses.append(step(batches[i]))
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    result.update(
        step_ms=1e3 * elapsed / args.steps,
        tokens_per_s=args.batch * args.seq * args.steps / elapsed,
        peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30,
        losses=[x.item() for x in losses],
    )
    return result


def _dist_version(name: str):
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def environment() -> dict:
    import torch
    import transformers
    import triton
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d")}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--provider", choices=PROVIDERS, help="run one provider in this process (default: all, "
                   "each in a subprocess)")
    p.add_argument("--providers", default=",".join(PROVIDERS))
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--timeout", type=int, default=400, help="seconds per provider subprocess")
    p.add_argument("--out", help="write the JSON here")
    args = p.parse_args()

    if args.provider:
        print("RESULT " + json.dumps(run_provider(args)), flush=True)
        return

    shape = {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "seq",
                                           "batch", "warmup", "steps")}
    results = {"model": "LlamaForCausalLM, bf16 weights and activations, AdamW(fused), sdpa attention",
               "shape": shape, "environment": environment(), "providers": []}
    passthrough = [f"--{k.replace('_', '-')}={v}" for k, v in shape.items()]
    for provider in args.providers.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--provider", provider, *passthrough]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            entry = json.loads(lines[-1][7:]) if lines else {
                "provider": provider, "error": (proc.stderr or proc.stdout)[-2000:]}
        except subprocess.TimeoutExpired:
            entry = {"provider": provider, "error": f"timed out after {args.timeout} s"}
        results["providers"].append(entry)
        print(json.dumps({k: v for k, v in entry.items() if k != "losses"})[:600], flush=True)
        if args.out:  # written after every provider, so a later failure keeps the earlier results
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)

    base = next((r for r in results["providers"] if r["provider"] == "hf" and "error" not in r), None)
    print(f"\n{'provider':<12}{'tokens/s':>10}{'step ms':>9}{'peak GiB':>10}{'vs hf':>8}{'max |dloss|':>13}")
    for r in results["providers"]:
        if "error" in r:
            print(f"{r['provider']:<12} error: {r['error'].strip().splitlines()[-1][:100]}")
            continue
        speed = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        dloss = f"{max(abs(a - b) for a, b in zip(r['losses'], base['losses'])):.4f}" if base else "-"
        print(f"{r['provider']:<12}{r['tokens_per_s']:>10.0f}{r['step_ms']:>9.1f}{r['peak_mem_gib']:>10.2f}"
              f"{speed:>8}{dloss:>13}")


if __name__ == "__main__":
    main()
