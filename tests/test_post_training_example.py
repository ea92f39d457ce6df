"""examples/post_training.py: GRPO, PPO and DPO written on linear_log_probs give the values and
the hidden-state and head gradients of the same losses written in plain PyTorch on the full
float64 logits (log_softmax, gather); and the example runs."""
import pathlib
import runpy

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import assert_close

EXAMPLE = runpy.run_path(str(pathlib.Path(__file__).parents[1] / "examples" / "post_training.py"),
                         run_name="post_training_example")
IGNORE = EXAMPLE["IGNORE"]
B, S, H, V = 4, 6, 16, 96


def full_log_probs(hidden, weight, tokens, temperature=1.0):
    """Plain PyTorch: the ``[B, S, V]`` float64 logits, their log-softmax, the token's entry and
    the entropy, 0 at ``IGNORE``."""
    log_p = torch.log_softmax(hidden.double() @ weight.double().t() / temperature, dim=-1)
    valid = tokens != IGNORE
    logp = log_p.gather(-1, tokens.clamp(min=0)[..., None])[..., 0]
    entropy = -(log_p.exp() * log_p).sum(-1)
    return torch.where(valid, logp, 0.0), torch.where(valid, entropy, 0.0), valid.double()


def inputs(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, H, generator=g).to(device)
    weight = (torch.randn(V, H, generator=g) * 2 / H ** 0.5).to(device)
    tokens = torch.randint(0, V, (B, S), generator=g)
    tokens[:, -1] = IGNORE
    tokens[0, :2] = IGNORE
    with torch.no_grad():
        logp, _, _ = full_log_probs(hidden, weight, tokens.to(device))
    # Rollout and reference log-probabilities near the policy's: ratios on both sides of the clip.
    old = (logp + torch.randn(B, S, generator=g).to(device, torch.float64) * 0.3).float()
    ref = (logp + torch.randn(B, S, generator=g).to(device, torch.float64) * 0.3).float()
    return hidden, weight, tokens.to(device), old, ref


def check_loss(loss_fn, ref_fn, hidden, weight):
    """The example's loss and its gradients against the plain-PyTorch float64 one."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = loss_fn(h, w)
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref = ref_fn(h64, w64)
    assert_close(loss, ref, torch.float32, "loss")
    grads = torch.autograd.grad(loss, (h, w))
    ref_grads = torch.autograd.grad(ref, (h64, w64))
    for name, got, want in zip(("dhidden", "dweight"), grads, ref_grads):
        assert_close(got, want, torch.float32, name)


def ref_surrogate(logp, old, adv, lo, hi):
    ratio = torch.exp(logp - old.double())
    return -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - lo, 1 + hi) * adv)


@pytest.mark.parametrize("with_ref", [False, True], ids=["no-kl", "kl"])
def test_grpo(with_ref, device):
    hidden, weight, tokens, old, ref_logp = inputs(device)
    adv = EXAMPLE["group_advantages"](torch.tensor([1.0, 0.0, 0.3, 0.9], device=device), 2)
    assert torch.allclose(adv.view(2, 2).sum(1), torch.zeros(2, device=device), atol=1e-6)
    kw = dict(ref_logp=ref_logp if with_ref else None, kl_coef=0.1, eps_low=0.2, eps_high=0.28, temperature=0.9)

    def reference(h, w):
        logp, _, mask = full_log_probs(h, w, tokens, 0.9)
        per = ref_surrogate(logp, old, adv.double()[:, None], 0.2, 0.28)
        if with_ref:
            delta = ref_logp.double() - logp
            per = per + 0.1 * (torch.exp(delta) - delta - 1)
        return (per * mask).sum() / mask.sum()

    check_loss(lambda h, w: EXAMPLE["grpo_loss"](h, w, tokens, old, adv, **kw), reference, hidden, weight)


def test_ppo_with_entropy_bonus(device):
    hidden, weight, tokens, old, _ = inputs(device, seed=1)
    adv = torch.randn(B, S, device=device)

    def reference(h, w):
        logp, entropy, mask = full_log_probs(h, w, tokens)
        per = ref_surrogate(logp, old, adv.double(), 0.2, 0.2) - 0.05 * entropy
        return (per * mask).sum() / mask.sum()

    check_loss(lambda h, w: EXAMPLE["ppo_loss"](h, w, tokens, old, adv, entropy_coef=0.05), reference, hidden, weight)


def test_dpo(device):
    hidden, weight, tokens, _, ref_logp = inputs(device, seed=2)
    half = B // 2
    ref_c, ref_r = ref_logp[:half].sum(-1), ref_logp[half:].sum(-1)

    def reference(h, w):
        logp, _, _ = full_log_probs(h, w, tokens)
        margin = (logp[:half].sum(-1) - ref_c.double()) - (logp[half:].sum(-1) - ref_r.double())
        return -F.logsigmoid(0.5 * margin).mean()

    check_loss(lambda h, w: EXAMPLE["dpo_loss"](h[:half], h[half:], w, tokens[:half], tokens[half:], ref_c, ref_r,
                                                beta=0.5), reference, hidden, weight)


def test_example_runs():
    history = EXAMPLE["main"](steps=2, batch=2, length=4, verbose=False)
    assert set(history) == {"grpo", "ppo", "dpo"}
    assert all(len(v) == 2 and all(torch.isfinite(torch.tensor(v))) for v in history.values())
