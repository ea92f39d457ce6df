"""Quick start: each op once, checked against plain PyTorch, and a backward.

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


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# Norms: any leading shape, fused residual add, Llama / Gemma / plain casting.
x = torch.randn(B, S, N, device=device, requires_grad=True)
w = torch.randn(N, device=device, requires_grad=True)
y = lk.rms_norm(x, w, eps=1e-6)                                   # LlamaRMSNorm's arithmetic
close(y, F.rms_norm(x, (N,), w, eps=1e-6))
y2, h = lk.rms_norm(x, w, residual=y, prenorm=True)               # h = x + residual, y2 = rms_norm(h)
close(h, x + y)
z = lk.layer_norm(x, w, torch.zeros_like(w))                      # F.layer_norm
close(z, F.layer_norm(x, (N,), w, torch.zeros_like(w)))

# RoPE on q [B, H, S, D] and k [B, H_KV, S, D] (GQA), cos/sin [1, S, D] as transformers makes them.
q = torch.randn(B, H, S, D, device=device, requires_grad=True)
k = torch.randn(B, H_KV, S, D, device=device, requires_grad=True)
freqs = torch.outer(torch.arange(S, device=device).float(), 1e4 ** -(torch.arange(0, D, 2, device=device) / D))
cos, sin = torch.cat([freqs, freqs], -1).cos()[None], torch.cat([freqs, freqs], -1).sin()[None]
q_rot, k_rot = lk.apply_rope(q, k, cos, sin)


def rotate_half(t):
    return torch.cat([-t[..., D // 2:], t[..., :D // 2]], -1)


close(q_rot, q * cos[:, None] + rotate_half(q) * sin[:, None])

# Gated MLP: silu(gate) * up (SwiGLU; activation="gelu_tanh" for GeGLU), and with the down
# projection fused so the [tokens, I] product is not kept for the backward.
gate = torch.randn(B, S, I, device=device, requires_grad=True)
up = torch.randn(B, S, I, device=device, requires_grad=True)
down = torch.randn(N, I, device=device, requires_grad=True) / I**0.5
close(lk.glu(gate, up), F.silu(gate) * up)
mlp_out = lk.glu_linear(gate, up, down)                           # F.linear(glu(gate, up), down)
close(mlp_out, F.linear(F.silu(gate) * up, down))

# Losses: cross-entropy, and the LM head fused with it (the [tokens, V] logits never exist).
hidden = mlp_out.reshape(-1, N)
lm_head = torch.randn(V, N, device=device, requires_grad=True)
target = torch.randint(0, V, (B * S,), device=device)
close(lk.cross_entropy(hidden @ lm_head.T, target, label_smoothing=0.1),
      F.cross_entropy(hidden @ lm_head.T, target, label_smoothing=0.1))
loss = lk.linear_cross_entropy(hidden, lm_head, target)
close(loss, F.cross_entropy(hidden @ lm_head.T, target))
loss.backward()                                                   # gradients of lm_head, down, gate and up

# Modules: drop-ins for torch.nn.RMSNorm / LlamaRMSNorm and torch.nn.LayerNorm.
norm = lk.RMSNorm(N, eps=1e-6).to(device)                         # isinstance(norm, torch.nn.RMSNorm)
theirs = torch.nn.RMSNorm(N, eps=None).to(device)
close(lk.RMSNorm.from_llama_rmsnorm(theirs)(x), theirs(x))        # shares the weight, keeps eps=None
print(f"llmkernels {lk.__version__} on {device}: loss {loss.item():.4f}, every op matches PyTorch")
