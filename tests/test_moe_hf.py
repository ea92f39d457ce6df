"""The MoE families of transformers on ``moe_experts``: a tiny random model of each (Mixtral,
Qwen 2/3 MoE, OLMoE, DeepSeek-V3, gpt-oss) patched by ``llmkernels.patch`` trains like the
unpatched one (logits, loss with the router's auxiliary loss, every gradient, AdamW steps); the
class-level patch and transformers' experts interface (``experts_implementation="llmkernels"``);
experts the kernels cannot run keep transformers' forward; expert LoRA trains the adapters alone
and round-trips through PEFT's format (checked against PEFT itself where it is installed)."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import llmkernels  # noqa: E402
from llmkernels import hf  # noqa: E402
from llmkernels.hf import moe as moe_module  # noqa: E402

from tests.conftest import DEVICE  # noqa: E402
from tests.helpers import rel_err  # noqa: E402
from tests.test_hf import COMMON, batch, train  # noqa: E402

MOE = dict(COMMON, intermediate_size=64, output_router_logits=True, router_aux_loss_coef=0.1)
# model_type -> (config class name, config arguments, experts class name)
FAMILIES = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2), "MixtralExperts"),
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         norm_topk_prob=True), "Qwen3MoeExperts"),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=32), "Qwen2MoeExperts"),
    "olmoe": ("OlmoeConfig", dict(num_experts=4, num_experts_per_tok=2), "OlmoeExperts"),
    "deepseek_v3": ("DeepseekV3Config", dict(n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                                             moe_intermediate_size=32, first_k_dense_replace=0, kv_lora_rank=16,
                                             q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                                             n_shared_experts=1, rope_interleave=False, num_key_value_heads=4),
                    "DeepseekV3Experts"),
    "gpt_oss": ("GptOssConfig", dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
                "GptOssExperts"),
}
STEPS = 3
# tests/test_hf.py trains these four patched (moe_experts included) in the default run already.
IN_TEST_HF = ("mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss")


@pytest.fixture(autouse=True)
def _restore_transformers():
    yield
    hf.unpatch_all()


def make_moe(model_type: str, dtype=torch.float32, **extra):
    cls_name, kwargs, _ = FAMILIES[model_type]
    if not hasattr(transformers, cls_name):
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    config = getattr(transformers, cls_name)(**{**MOE, **kwargs, **extra})
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # random norm weights, router biases and gpt-oss expert biases: none stays trivial
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.5 + 1.0)
            elif "bias" in name:
                p.normal_(0, 0.1)
    return model.to(device=DEVICE, dtype=dtype)


def experts_of(model):
    return [m for m in model.modules() if type(m).__name__.endswith("Experts")]


@pytest.mark.parametrize("model_type", [pytest.param(t, marks=pytest.mark.slow) if t in IN_TEST_HF else t
                                        for t in FAMILIES])
def test_patched_moe_model_trains_like_unpatched(model_type):
    torch.manual_seed(0)
    model = make_moe(model_type)
    patched = copy.deepcopy(model)
    ref_losses, (ref_loss, ref_logits, ref_grads) = train(model, STEPS)
    report = llmkernels.patch(patched)
    experts_cls = FAMILIES[model_type][2]
    assert any(p.startswith(f"{experts_cls}.forward -> llmkernels.moe_experts") for p in report.patched), str(report)
    assert all(hf.is_patched(m.forward) for m in experts_of(patched))
    losses, (loss, logits, grads) = train(patched, STEPS)

    assert rel_err(logits, ref_logits) < 1e-5
    assert rel_err(loss, ref_loss) < 1e-5  # the router's auxiliary loss included
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert rel_err(g, ref_grads[name]) < 1e-4, f"grad {name}: rel err {rel_err(g, ref_grads[name]):.2e}"
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) < 1e-4, (losses, ref_losses)


def test_patched_moe_aux_loss_leaves_padding_out_as_transformers():
    """With an attention mask that pads, the auxiliary loss (llmkernels' own, in the patched
    forward) leaves the padded tokens out of the experts' shares as transformers' does."""
    torch.manual_seed(0)
    model = make_moe("olmoe")
    patched = copy.deepcopy(model)
    ids, _ = batch(0, model.config.vocab_size)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[-1, -2:] = 0
    ref_losses, (ref_loss, _, ref_grads) = train(model, 2, attention_mask=mask)
    llmkernels.patch(patched)
    losses, (loss, _, grads) = train(patched, 2, attention_mask=mask)
    assert rel_err(loss, ref_loss) < 1e-5
    router = [name for name in grads if ".gate." in name or "router" in name]
    assert router, list(grads)
    for name in router:
        assert rel_err(grads[name], ref_grads[name]) < 1e-4, name
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) < 1e-4, (losses, ref_losses)


@pytest.mark.slow
@pytest.mark.skipif(DEVICE != "cuda", reason="the interpreter takes minutes for 40 bf16 steps")
@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_patched_moe_model_trains_like_unpatched_bf16(model_type):
    """bf16, 20 AdamW steps: the losses stay within bf16's tolerance of the unpatched model's."""
    torch.manual_seed(0)
    model = make_moe(model_type, dtype=torch.bfloat16)
    patched = copy.deepcopy(model)
    ref_losses, _ = train(model, 20)
    llmkernels.patch(patched)
    losses, _ = train(patched, 20)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) < 3e-2, (losses, ref_losses)
    assert losses[-1] < losses[0]


def test_patch_model_type_and_experts_interface(monkeypatch):
    """patch_model_type replaces the experts class's forward (models built before and after);
    experts_implementation="llmkernels" selects the kernels per model through transformers."""
    torch.manual_seed(0)
    model = make_moe("qwen3_moe").eval()
    ids, _ = batch(0)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    report = llmkernels.patch_model_type("qwen3_moe")
    assert any(p.startswith("Qwen3MoeExperts.forward -> llmkernels.moe_experts") for p in report.patched)
    assert hf.is_patched(experts_of(model)[0].forward)
    with torch.no_grad():
        assert rel_err(model(input_ids=ids).logits, ref) < 1e-5
    hf.unpatch_all()
    assert not hf.is_patched(experts_of(model)[0].forward)
    if not hasattr(model, "set_experts_implementation"):
        pytest.skip(f"transformers {transformers.__version__} has no experts implementations")
    assert hf.register_experts_interface()
    model.set_experts_implementation("llmkernels")
    calls = []
    run = moe_module._run
    monkeypatch.setattr(moe_module, "_run", lambda *args: calls.append(args[1]) or run(*args))
    with torch.no_grad():
        out = model(input_ids=ids).logits
    assert calls == ["silu"], "experts_implementation='llmkernels' did not run llmkernels' experts"
    assert rel_err(out, ref) < 1e-5


def test_experts_the_kernels_cannot_run_keep_transformers_forward():
    model = make_moe("mixtral", hidden_act="gelu")
    report = llmkernels.patch(model, rope=False, cross_entropy=False)
    assert "is not SiLU" in report.not_patched["MixtralExperts.forward"], str(report)
    assert not hf.is_patched(experts_of(model)[0].forward)
    report = llmkernels.patch(make_moe("mixtral"), moe=False, rope=False, cross_entropy=False)
    assert report.not_patched["MixtralExperts.forward"] == "moe=False"


# --------------------------------------------------------------------------------------------
# expert LoRA
# --------------------------------------------------------------------------------------------
def _lora_model(model_type="qwen3_moe"):
    torch.manual_seed(0)
    model = make_moe(model_type)
    llmkernels.patch(model)
    assert hf.add_expert_lora(model, r=4, lora_alpha=8) == 1
    with torch.no_grad():  # trained adapters: B is not zero
        for name, p in model.named_parameters():
            if name.endswith("_B"):
                p.normal_(0, 0.2)
    return model


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_expert_lora_trains_the_adapters_alone(model_type):
    model = _lora_model(model_type)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"model.layers.0.mlp.experts.lora_{t}_{ab}" for t in ("gate_up", "down") for ab in "AB"}
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    ids, labels = batch(0)
    before = model(input_ids=ids, labels=labels).loss.item()
    losses, _ = train(model, STEPS)
    assert losses[-1] < before
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)


def test_expert_lora_round_trips_through_peft_format(tmp_path):
    model = _lora_model()
    ids, _ = batch(0)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    hf.save_expert_lora(model, tmp_path)
    config = __import__("json").loads((tmp_path / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    assert config["target_parameters"] == ["experts.down_proj", "experts.gate_up_proj"]
    from safetensors.torch import load_file

    tensors = load_file(tmp_path / "adapter_model.safetensors")
    prefix = "base_model.model.model.layers.0.mlp.experts."
    # PEFT's nesting: gate_up_proj (registered first) is the inner wrapper, under base_layer.
    assert {k: tuple(v.shape) for k, v in tensors.items()} == {
        prefix + "base_layer.lora_A.weight": (4 * 4, 64), prefix + "base_layer.lora_B.weight": (64, 4 * 4),
        prefix + "lora_A.weight": (4 * 4, 32), prefix + "lora_B.weight": (64, 4 * 4)}
    experts = experts_of(model)[0]
    a, b = experts.lora_gate_up_A.detach().cpu(), experts.lora_gate_up_B.detach().cpu()  # the file's are on the CPU
    assert torch.equal(tensors[prefix + "base_layer.lora_A.weight"].view(4, 4, 64), a)
    assert torch.equal(tensors[prefix + "base_layer.lora_B.weight"][:, 4 * 1 + 2], b[2, :, 1])  # r 1, e 2

    fresh = make_moe("qwen3_moe")
    fresh.load_state_dict({n: p for n, p in model.state_dict().items() if "lora_" not in n})
    llmkernels.patch(fresh)
    assert hf.load_expert_lora(fresh, tmp_path) == 1
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, ref)


def test_expert_lora_matches_peft(tmp_path):
    """Our adapters saved, loaded by PEFT onto the unpatched model: the same logits; PEFT's own
    adapter (trained a step by PEFT) loaded by us: the same logits as PEFT's model."""
    peft = pytest.importorskip("peft")
    model = _lora_model()
    ids, labels = batch(0)
    with torch.no_grad():
        ours = model(input_ids=ids).logits
    hf.save_expert_lora(model, tmp_path / "ours")
    base = make_moe("qwen3_moe")
    base.load_state_dict({n: p for n, p in model.state_dict().items() if "lora_" not in n})
    peft_model = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "ours")
    with torch.no_grad():
        assert rel_err(peft_model(input_ids=ids).logits, ours) < 1e-5

    trained = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=[], target_parameters=["experts.gate_up_proj", "experts.down_proj"]))
    opt = torch.optim.SGD([p for p in trained.parameters() if p.requires_grad], lr=1.0)
    trained(input_ids=ids, labels=labels).loss.backward()
    opt.step()
    trained.save_pretrained(tmp_path / "peft")
    with torch.no_grad():
        want = trained(input_ids=ids).logits
    llmkernels.patch(base)
    hf.load_expert_lora(base, tmp_path / "peft")
    with torch.no_grad():
        assert rel_err(base(input_ids=ids).logits, want) < 1e-5


# --------------------------------------------------------------------------------------------
# FSDP2
# --------------------------------------------------------------------------------------------
def _fsdp2_rank(rank, world, device, loss: bool):
    """Each rank the same batch: FSDP2's averaged gradients are one process's."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    torch.manual_seed(0)
    model = make_moe("qwen3_moe").to(device)
    ref_losses, _ = train(copy.deepcopy(model), STEPS)
    llmkernels.patch(model, cross_entropy=loss)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    losses, _ = train(model, STEPS, record_first=False)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) < 1e-4, (losses, ref_losses)


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
@pytest.mark.parametrize("loss", [False, True], ids=["experts", "with_loss"])
def test_fsdp2_trains_the_patched_moe_model_like_one_process(loss):
    """fully_shard on every layer and the root: FSDP2 unshards the expert weights before each
    forward, so the kernels read plain tensors (2 CPU processes with gloo, or 2 GPUs)."""
    from tests.helpers import run_ranks

    run_ranks(_fsdp2_rank, loss)
