"""Quick start: each op once, a few checked against plain PyTorch, and a backward.

Runs on a GPU; without one it runs on the CPU (plain PyTorch there, or the Triton kernels
through Triton's interpreter with TRITON_INTERPRET=1). The README shows this file.
"""
import torch
import torch.nn.functional as F

import llmkernels as lk

device = "cuda" if torch.cuda.is_available() else "cpu"
B, S, H, H_KV, D, V = 2, 16, 4, 2, 16, 512       # batch, sequence, heads, kv heads, head dim, vocabulary
N, I = H * D, 2 * H * D                          # hidden size, MLP intermediate size
torch.manual_seed(0)


def close(a, b):                                                 # fp32: GPU GEMMs tile their sums
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# Norms over the last dim: any leading shape, fused residual add, Llama / Gemma / plain casting.
x = torch.randn(B, S, N, device=device, requires_grad=True)
w = torch.randn(N, device=device, requires_grad=True)
y = lk.rms_norm(x, w, eps=1e-6)                                  # LlamaRMSNorm's arithmetic
close(y, F.rms_norm(x, (N,), w, eps=1e-6))
y2, h = lk.rms_norm(x, w, residual=y, prenorm=True)              # h = x + residual, y2 = rms_norm(h)
z = lk.layer_norm(x, w, torch.zeros_like(w))                     # F.layer_norm

# RoPE on q [B, H, S, D] and k [B, H_KV, S, D] (GQA), cos/sin [1, S, D] as transformers makes them.
q = torch.randn(B, H, S, D, device=device, requires_grad=True)
k = torch.randn(B, H_KV, S, D, device=device, requires_grad=True)
angles = torch.arange(S, device=device)[:, None] * 1e4 ** -(torch.arange(0, D, 2, device=device) / D)
cos, sin = torch.cat([angles, angles], -1).cos()[None], torch.cat([angles, angles], -1).sin()[None]
q, k = lk.apply_rope(q, k, cos, sin)                             # or layout="bshd" for [B, S, H, D]

# Gated MLP: silu(gate) * up (activation="gelu_tanh": GeGLU), and with the down projection fused
# so that the [tokens, I] product is not kept for the backward.
gate = torch.randn(B, S, I, device=device, requires_grad=True)
up = torch.randn(B, S, I, device=device, requires_grad=True)
down = (torch.randn(N, I, device=device) * I**-0.5).requires_grad_()
a = lk.glu(gate, up)
out = lk.glu_linear(gate, up, down)                              # F.linear(glu(gate, up), down)
close(out, F.linear(F.silu(gate) * up, down))

# Losses: cross-entropy, and the LM head fused with it (the [tokens, V] logits never exist).
hidden = out.reshape(-1, N)
lm_head = (torch.randn(V, N, device=device) * N**-0.5).requires_grad_()
target = torch.randint(0, V, (B * S,), device=device)
ce = lk.cross_entropy(hidden @ lm_head.T, target, label_smoothing=0.1, z_loss=1e-4)
loss = lk.linear_cross_entropy(hidden, lm_head, target)
close(loss, F.cross_entropy(hidden @ lm_head.T, target))
loss.backward()                                                  # gradients of lm_head, down, gate, up

# Modules: drop-ins that are torch.nn.RMSNorm / torch.nn.LayerNorm instances.
norm = lk.RMSNorm(N, eps=1e-6).to(device)                        # LlamaRMSNorm(N, eps=1e-6)
theirs = torch.nn.RMSNorm(N).to(device)                          # eps=None
close(lk.RMSNorm.from_llama_rmsnorm(theirs)(x), theirs(x))       # shares the weight, same arithmetic
print(f"llmkernels {lk.__version__} on {device}: loss {loss.item():.4f}, every op matches PyTorch")
