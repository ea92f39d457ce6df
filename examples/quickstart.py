"""Quick start: each family once, checked against plain PyTorch, forward and a gradient.

Runs on a GPU; without one, the same Triton kernels run on the CPU through Triton's interpreter.
It says which path ran. The README shows this file.
"""
import importlib.util
import os

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # no GPU: run the kernels through Triton's interpreter (slow, exact)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when llmkernels is imported

import llmkernels as lk  # noqa: E402

device = "cuda" if torch.cuda.is_available() else "cpu"
triton = importlib.util.find_spec("triton") is not None      # Linux only: elsewhere the fallback runs
kernels = triton and (device == "cuda" or os.environ["TRITON_INTERPRET"] == "1")
path = ("Triton kernels on the GPU" if device == "cuda" else "Triton kernels in Triton's interpreter (CPU)"
        ) if kernels else "the plain-PyTorch fallback (no kernel ran)"
B, S, H, D, V, I = 2, 16, 4, 16, 512, 128       # batch, sequence, heads, head dim, vocabulary, MLP width
N = H * D                                        # hidden size
torch.manual_seed(0)
close = lambda ours, theirs: torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)  # noqa: E731

# Norms over the last dim, any leading shape; the residual add fused; Llama / Gemma / plain casting.
x, w = torch.randn(B, S, N, device=device, requires_grad=True), torch.randn(N, device=device, requires_grad=True)
close(lk.rms_norm(x, w, eps=1e-6), F.rms_norm(x, (N,), w, eps=1e-6))
y, h = lk.rms_norm(x, w, residual=x, prenorm=True)                 # h = x + residual, y = rms_norm(h)
# RoPE on q and k [B, H, S, D] with cos / sin [S, D], as transformers makes them.
q, k = torch.randn(2, B, H, S, D, device=device).unbind(0)
angles = torch.arange(S, device=device)[:, None] * 1e4 ** -(torch.arange(0, D, 2, device=device) / D)
cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
close(lk.apply_rope(q, k, cos, sin)[0], q * cos + torch.cat([-q[..., D // 2:], q[..., :D // 2]], -1) * sin)
# Gated MLP with the down projection fused: the [tokens, I] product is not kept for the backward.
gate, up = (torch.randn(B, S, I, device=device, requires_grad=True) for _ in range(2))
down = (torch.randn(N, I, device=device) * I**-0.5).requires_grad_()
out = lk.glu_linear(gate, up, down)
close(out, F.linear(F.silu(gate) * up, down))
# The LM head fused with cross-entropy: the [tokens, V] logits never exist, forward or backward.
hidden, head = out.reshape(-1, N), (torch.randn(V, N, device=device) * N**-0.5).requires_grad_()
target = torch.randint(0, V, (B * S,), device=device)
loss, reference = lk.linear_cross_entropy(hidden, head, target), F.cross_entropy(hidden @ head.T, target)
close(loss, reference)
expected = torch.autograd.grad(reference, head)[0]
loss.backward()                                                     # into head, down, gate and up
close(head.grad, expected)
# Modules: drop-ins that are torch.nn.RMSNorm instances (from_llama_rmsnorm converts HF's too).
norm = lk.RMSNorm.from_llama_rmsnorm(torch.nn.RMSNorm(N).to(device))
close(norm(x), F.rms_norm(x, (N,), norm.weight))
print(f"llmkernels {lk.__version__}, {path}: loss {loss.item():.4f}; "
      + ("every op above matches PyTorch" if kernels else "PyTorch was compared with itself"))
