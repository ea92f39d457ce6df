"""End to end, eager decoding: tokens/s of transformers' ``generate()`` with a small Llama patched
by ``llmkernels.patch`` against the same model unpatched.

A Llama of random weights (default about 0.9B parameters: TinyLlama's shape with 16 layers), bf16,
PyTorch eager (no torch.compile, no CUDA graphs; SDPA attention, the dynamic KV cache), greedy
decoding of a fixed random prompt for a fixed number of new tokens (no end-of-sequence stop).
The two models share their weights' values (the patched one is a copy); they run in the same
process, alternately, ``--rounds`` times each after a warm-up, with ``unpatch_all()`` before every
unpatched run (``patch`` replaces transformers' RoPE function module-wide). Reported: the median
tokens/s of each, their ratio, and whether the generated tokens are identical (greedy decoding
follows the argmax, and the kernels round differently from the unpatched ops: RoPE once in fp32
where Hugging Face rounds three times in bf16, so a near tie between two logits can go the other
way and the continuations part; the first differing position is reported).

    python benchmarks/generate_bench.py [--layers 16] [--new-tokens 128] [--out generate.json]
    python benchmarks/generate_bench.py --tiny     # CPU, Triton's interpreter, a tiny Llama (a test runs it)
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

if "--tiny" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

import llmkernels  # noqa: E402

FULL = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
            num_key_value_heads=4, vocab_size=32000)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256)


def build(shape: dict, device: str, dtype: torch.dtype):
    """A Llama of random weights (its norm weights too: ones would hide a wrong scale)."""
    import transformers
    config = transformers.LlamaConfig(**shape, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + 1.0)
    model.generation_config.eos_token_id = None  # every run decodes exactly --new-tokens tokens
    model.generation_config.pad_token_id = 0
    return model.to(device=device, dtype=dtype).eval()


def _sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def generate(model, prompt: torch.Tensor, new_tokens: int):
    """(generated ids, seconds) of one greedy ``generate()``."""
    _sync(prompt.device.type)
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False)
    _sync(prompt.device.type)
    return out[:, prompt.shape[1]:], time.perf_counter() - t


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 16; --tiny 2)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 32; --tiny 8)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens generated (default 128; --tiny 4)")
    parser.add_argument("--rounds", type=int, default=None, help="timed runs of each model (default 3; --tiny 1)")
    parser.add_argument("--tiny", action="store_true", help="CPU, Triton's interpreter, a tiny Llama")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available() and not args.tiny
    if not gpu and not args.tiny:
        parser.error("no GPU: pass --tiny (CPU, Triton's interpreter)")
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.bfloat16)
    shape = dict(TINY if args.tiny else FULL)
    shape["num_hidden_layers"] = args.layers or shape["num_hidden_layers"]
    prompt_len = args.prompt or (8 if args.tiny else 32)
    new_tokens = args.new_tokens or (4 if args.tiny else 128)
    rounds = args.rounds or (1 if args.tiny else 3)

    llmkernels.unpatch_all()
    reference = build(shape, device, dtype)
    patched = copy.deepcopy(reference)
    report = llmkernels.patch(patched)
    params = sum(p.numel() for p in reference.parameters())
    prompt = torch.randint(3, shape["vocab_size"], (args.batch, prompt_len), generator=torch.Generator().manual_seed(1))
    prompt = prompt.to(device)

    def run(which: str):
        if which == "unpatched":
            llmkernels.unpatch_all()
            return generate(reference, prompt, new_tokens)
        llmkernels.patch(patched)  # (its modules keep their kernels; this restores the RoPE function)
        return generate(patched, prompt, new_tokens)

    tokens, seconds = {}, {"unpatched": [], "patched": []}
    for which in seconds:  # warm-up: Triton's compilation, cuBLAS, the allocator
        tokens[which], _ = run(which)
    for _ in range(rounds):
        for which in seconds:
            ids, s = run(which)
            seconds[which].append(s)
            if not torch.equal(ids, tokens[which]):
                raise RuntimeError(f"greedy decoding of the {which} model is not deterministic")
    llmkernels.unpatch_all()

    same = tokens["unpatched"] == tokens["patched"]
    differ = (~same).nonzero()
    rate = {k: args.batch * new_tokens / statistics.median(v) for k, v in seconds.items()}
    result = dict(
        device=torch.cuda.get_device_name() if gpu else "cpu, Triton interpreter", dtype=str(dtype),
        torch=torch.__version__, transformers=__import__("transformers").__version__,
        date=time.strftime("%Y-%m-%d"), model=dict(shape, parameters=params), batch=args.batch, prompt=prompt_len,
        new_tokens=new_tokens, rounds=rounds, seconds=seconds, tokens_per_s=rate,
        speedup=rate["patched"] / rate["unpatched"], tokens_identical=bool(same.all()),
        first_difference=None if differ.numel() == 0 else int(differ[:, 1].min()),
        tokens_agreeing=float(same.float().mean()), patched=report.patched)
    print(f"{result['device']}: Llama {params / 1e6:.1f}M parameters, {shape['num_hidden_layers']} layers, "
          f"{dtype}, batch {args.batch}, prompt {prompt_len}, {new_tokens} new tokens, median of {rounds}")
    for k in seconds:
        print(f"  {k:10s} {rate[k]:9.1f} tokens/s")
    print(f"  patched / unpatched: {result['speedup']:.2f}x; generated tokens identical: {result['tokens_identical']}"
          + ("" if result["tokens_identical"] else f" (first difference at new token {result['first_difference']}, "
                                                  f"{100 * result['tokens_agreeing']:.0f}% agree)"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
