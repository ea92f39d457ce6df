"""Post-training losses written on ``llmkernels.linear_log_probs``: GRPO, PPO and DPO.

RL and preference losses need, for every generated token, the policy's log-probability of that
token (and sometimes the entropy of its distribution). The unfused way builds the logits
``[tokens, vocab]`` (16384 x 151936 in bf16 is 5 GB, and its fp32 log-softmax 10 GB more);
``linear_log_probs(hidden, lm_head.weight, tokens)`` returns the same ``[tokens]`` values from the
final hidden states without them, differentiable in the hidden states and the head.

Each loss below takes the policy's final hidden states ``hidden [B, S, H]`` of the completion
positions, the LM head ``weight [V, H]`` and the completion tokens ``tokens [B, S]``
(``IGNORE`` = -100 marks padding and prompt positions, which count nowhere), plus what the
algorithm brings from outside the step (rollout log-probabilities, advantages, reference
log-probabilities, all detached).

Run ``python examples/post_training.py`` for a few steps of each on a toy policy. Without a GPU
it runs the kernels through Triton's interpreter on the CPU (``TRITON_INTERPRET=0``: the
plain-PyTorch reference instead); it says which path ran.
"""
from __future__ import annotations

import importlib.util
import os
import warnings

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # The interpreter runs masked-off lanes through NumPy too (log of 0, inf - inf): not our values.
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")

import llmkernels  # noqa: E402

IGNORE = -100


def token_log_probs(hidden, weight, tokens, *, temperature=1.0, entropy=False):
    """``log p(token)`` per position ``[B, S]`` (0 at ``IGNORE``), and the entropy with ``entropy``."""
    b, s, h = hidden.shape
    out = llmkernels.linear_log_probs(hidden.reshape(b * s, h), weight, tokens.reshape(-1), temperature=temperature,
                                      return_entropy=entropy, ignore_index=IGNORE)
    return tuple(t.view(b, s) for t in out) if entropy else out.view(b, s)


def masked_mean(x, mask):
    """Mean of ``x`` over the positions where ``mask`` (token-level, as DAPO and TRL's default)."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def clipped_surrogate(logp, old_logp, advantages, eps_low, eps_high):
    """PPO's per-token objective to minimise: ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``
    with ``r = exp(logp - old_logp)``."""
    ratio = torch.exp(logp - old_logp)
    return -torch.minimum(ratio * advantages, ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages)


def group_advantages(rewards, group_size: int):
    """GRPO's advantages: each completion's reward standardised within its group of
    ``group_size`` completions of one prompt (``rewards [B]``, B a multiple of the group size)."""
    r = rewards.view(-1, group_size)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).reshape(-1)


def grpo_loss(hidden, weight, tokens, old_logp, advantages, *, ref_logp=None, kl_coef=0.04, eps_low=0.2,
              eps_high=0.2, temperature=1.0):
    """GRPO (DeepSeekMath; TRL's GRPOTrainer): the clipped surrogate with one advantage per
    completion (``advantages [B]``, see ``group_advantages``), plus ``kl_coef`` times the k3
    estimate of KL(policy || reference) when ``ref_logp [B, S]`` is given,
    ``exp(ref - logp) - (ref - logp) - 1``; averaged over completion tokens."""
    logp = token_log_probs(hidden, weight, tokens, temperature=temperature)
    mask = (tokens != IGNORE).to(logp.dtype)
    per_token = clipped_surrogate(logp, old_logp, advantages[:, None], eps_low, eps_high)
    if ref_logp is not None:
        delta = ref_logp - logp
        per_token = per_token + kl_coef * (torch.exp(delta) - delta - 1.0)
    return masked_mean(per_token, mask)


def ppo_loss(hidden, weight, tokens, old_logp, advantages, *, eps=0.2, entropy_coef=0.01, temperature=1.0):
    """PPO's clipped surrogate with per-token advantages ``[B, S]`` (from a value model, GAE),
    minus ``entropy_coef`` times the policy's entropy (an exploration bonus: ``linear_log_probs``
    returns it without the logits); averaged over completion tokens."""
    logp, entropy = token_log_probs(hidden, weight, tokens, temperature=temperature, entropy=True)
    mask = (tokens != IGNORE).to(logp.dtype)
    return masked_mean(clipped_surrogate(logp, old_logp, advantages, eps, eps) - entropy_coef * entropy, mask)


def sequence_log_probs(hidden, weight, tokens):
    """``log p(completion)``: the sum of the token log-probabilities of each sequence ``[B]``."""
    return token_log_probs(hidden, weight, tokens).sum(-1)


def dpo_loss(chosen_hidden, rejected_hidden, weight, chosen_tokens, rejected_tokens, ref_chosen_logp,
             ref_rejected_logp, *, beta=0.1):
    """DPO (Rafailov et al.): ``-log sigmoid(beta ((pi_c - ref_c) - (pi_r - ref_r)))`` with the
    sequence log-probabilities of the chosen and rejected completions under the policy (pi) and
    the frozen reference model (``ref_*_logp [B]``); averaged over pairs."""
    chosen = sequence_log_probs(chosen_hidden, weight, chosen_tokens)
    rejected = sequence_log_probs(rejected_hidden, weight, rejected_tokens)
    margin = (chosen - ref_chosen_logp) - (rejected - ref_rejected_logp)
    return -F.logsigmoid(beta * margin).mean()


# --------------------------------------------------------------------------------------------
# a toy run: a policy whose last layer is an embedding lookup and a head
# --------------------------------------------------------------------------------------------
class ToyPolicy(torch.nn.Module):
    """``hidden = tanh(embed(prev token))``, logits = ``hidden @ head.T``: just enough to
    exercise the losses' gradients end to end."""

    def __init__(self, vocab: int, width: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.head = torch.nn.Parameter(torch.randn(vocab, width) / width ** 0.5)

    def forward(self, inputs):
        return torch.tanh(self.embed(inputs))


def _rollout(policy, batch: int, length: int, vocab: int, generator):
    inputs = torch.randint(0, vocab, (batch, length), generator=generator)
    tokens = torch.randint(0, vocab, (batch, length), generator=generator)
    tokens[:, -2:] = IGNORE  # padding
    with torch.no_grad():
        old_logp = token_log_probs(policy(inputs), policy.head, tokens)
    return inputs, tokens, old_logp


def main(steps: int = 3, batch: int = 4, length: int = 8, vocab: int = 64, width: int = 16, verbose: bool = True):
    """A few optimiser steps of each loss on a toy policy; returns the losses per step."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if verbose:
        on = ("the plain-PyTorch fallback (Triton is not installed)" if importlib.util.find_spec("triton") is None
              else "Triton kernels on the GPU" if torch.cuda.is_available() else
              "Triton kernels in Triton's interpreter (CPU)" if os.environ.get("TRITON_INTERPRET") == "1" else
              "the plain-PyTorch fallback (TRITON_INTERPRET=0)")
        print(f"GRPO, PPO and DPO on a toy policy ({vocab} tokens, width {width}), {steps} AdamW steps each, "
              f"linear_log_probs on {on}:")
    history = {}
    for name in ("grpo", "ppo", "dpo"):
        policy, reference = ToyPolicy(vocab, width), ToyPolicy(vocab, width)
        opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
        inputs, tokens, old_logp = _rollout(policy, batch, length, vocab, g)
        with torch.no_grad():
            ref_logp = token_log_probs(reference(inputs), reference.head, tokens)
        losses = []
        for _ in range(steps):
            hidden = policy(inputs)
            if name == "grpo":
                rewards = torch.rand(batch, generator=g)
                loss = grpo_loss(hidden, policy.head, tokens, old_logp, group_advantages(rewards, 2),
                                 ref_logp=ref_logp)
            elif name == "ppo":
                loss = ppo_loss(hidden, policy.head, tokens, old_logp, torch.randn(batch, length, generator=g))
            else:  # pairs: the first half of the batch chosen, the second rejected
                half = batch // 2
                loss = dpo_loss(hidden[:half], hidden[half:], policy.head, tokens[:half], tokens[half:],
                                ref_logp[:half].sum(-1), ref_logp[half:].sum(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        history[name] = losses
        if verbose:
            print(f"{name} loss, steps 1-{steps}: " + ", ".join(f"{x:.4f}" for x in losses))
    return history


if __name__ == "__main__":
    main()
