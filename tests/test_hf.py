"""Hugging Face patching: for every supported family that the installed transformers has, a
tiny random model patched by ``llmkernels.patch`` gives the logits, loss, every parameter
gradient and five AdamW steps of the unpatched model; plus the switches, the report and the
class-level ``patch_model_type``. No hub downloads: models are built from ``*Config(...)``."""
import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import llmkernels  # noqa: E402
from llmkernels import hf  # noqa: E402

from tests.conftest import DEVICE  # noqa: E402
from tests.helpers import rel_err  # noqa: E402

VOCAB, SEQ, BATCH = 128, 16, 2
# One layer and a 128-token vocabulary keep each family to seconds under the interpreter; DEEP
# (the ``slow`` run) repeats the training test with two layers, a larger vocabulary, more steps.
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
STEPS = 3
DEEP = dict(vocab_size=512, num_hidden_layers=2)
DEEP_STEPS = 5

# Multimodal models get a text config and a minimal vision config (their tests feed text; the
# Qwen VL ones 3-D multimodal positions, see FORWARD_INPUTS).
MROPE = dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3]))
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)
QWEN_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                   spatial_merge_size=2)
LLAMA4 = dict(head_dim=16, num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=128,
              attention_chunk_size=8)
# model_type -> (config class name, extra config arguments). Each exercises what is special in
# its family: MoE router loss, per-head q/k norms, Gemma's (1 + w) and softcapping, partial rotary.
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {}),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True)),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", dict(head_dim=16)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                         output_router_logits=True)),
    "gemma": ("GemmaConfig", dict(head_dim=16)),
    "gemma2": ("Gemma2Config", dict(head_dim=16, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                                    sliding_window=8, query_pre_attn_scalar=16)),
    "gemma3_text": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                                             final_logit_softcapping=30.0)),
    "phi3": ("Phi3Config", dict(partial_rotary_factor=0.5)),
    "olmo2": ("Olmo2Config", {}),
    "gpt_neox": ("GPTNeoXConfig", dict(num_key_value_heads=None, rotary_pct=0.25)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                         shared_expert_intermediate_size=64, output_router_logits=True)),
    "olmo3": ("Olmo3Config", dict(sliding_window=8)),
    "smollm3": ("SmolLM3Config", {}),
    "ministral3": ("Ministral3Config", dict(head_dim=16)),
    "granite": ("GraniteConfig", dict(logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5,
                                      attention_multiplier=0.1)),
    "gpt_oss": ("GptOssConfig", dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                     output_router_logits=True)),
    "llama4_text": ("Llama4TextConfig", LLAMA4),
    "llama4": ("Llama4Config", dict(text_config=LLAMA4, vision_config=dict(
        VISION, vision_output_dim=32, projector_input_dim=32, projector_output_dim=64))),
    "gemma3": ("Gemma3Config", dict(text_config=dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16),
                                    vision_config=VISION, mm_tokens_per_image=4)),
    "qwen2_vl": ("Qwen2VLConfig", dict(text_config=MROPE, vision_config=dict(
        depth=1, embed_dim=32, num_heads=2, hidden_size=64, mlp_ratio=2, patch_size=14, spatial_merge_size=2))),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", dict(text_config=MROPE, vision_config=dict(QWEN_VISION,
                                                                                  fullatt_block_indexes=[0]))),
    "qwen3_vl": ("Qwen3VLConfig", dict(text_config=dict(head_dim=16, rope_parameters=dict(
        MROPE["rope_parameters"], mrope_interleaved=True)), vision_config=dict(QWEN_VISION, deepstack_visual_indexes=[]))),
    "mistral3": ("Mistral3Config", dict(text_config=dict(model_type="ministral3", head_dim=16),
                                        vision_config=dict(VISION, head_dim=16))),
}
# Composite models that AutoModelForCausalLM does not build.
MODEL_CLASSES = {"llama4": "Llama4ForConditionalGeneration", "gemma3": "Gemma3ForConditionalGeneration",
                 "qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                 "qwen3_vl": "Qwen3VLForConditionalGeneration", "mistral3": "Mistral3ForConditionalGeneration"}
# model_type -> (gated-MLP class whose product llmkernels.glu computes, activation). Mixtral and
# Qwen 3 MoE: 3-D expert weights, through _apply_gate (grouped_mm experts, transformers' default).
# GPT-NeoX's MLP is not gated.
MLPS = {
    "llama": ("LlamaMLP", "silu"), "mistral": ("MistralMLP", "silu"), "mixtral": ("MixtralExperts", "silu"),
    "qwen2": ("Qwen2MLP", "silu"), "qwen3": ("Qwen3MLP", "silu"), "qwen3_moe": ("Qwen3MoeExperts", "silu"),
    "gemma": ("GemmaMLP", "gelu_tanh"), "gemma2": ("Gemma2MLP", "gelu_tanh"),
    "gemma3_text": ("Gemma3MLP", "gelu_tanh"), "phi3": ("Phi3MLP", "silu"), "olmo2": ("Olmo2MLP", "silu"),
    "qwen2_moe": ("Qwen2MoeExperts", "silu"), "olmo3": ("Olmo3MLP", "silu"), "smollm3": ("SmolLM3MLP", "silu"),
    "ministral3": ("Ministral3MLP", "silu"), "granite": ("GraniteMLP", "silu"),
    "llama4_text": ("Llama4TextExperts", "silu"), "llama4": ("Llama4TextExperts", "silu"),
    "gemma3": ("Gemma3MLP", "gelu_tanh"), "qwen2_vl": ("Qwen2MLP", "silu"), "qwen2_5_vl": ("Qwen2MLP", "silu"),
    "qwen3_vl": ("Qwen3VLTextMLP", "silu"), "mistral3": ("Ministral3MLP", "silu"),
}
# model_type -> {part: reason} of what patch() must leave to transformers.
NOT_PATCHED = {
    "gpt_oss": {"GptOssExperts": "_apply_gate is not transformers' default"},
    "llama4": {"loss": "merges the image features"},
}
# model_type -> what the report must say was patched beyond the norms, MLP, RoPE and loss checked for all.
ALSO_PATCHED = {
    "llama4_text": ["Llama4TextL2Norm -> llmkernels.rms_norm", "apply_rotary_emb -> llmkernels.apply_rope",
                    "Llama4TextMLP.forward -> llmkernels.glu_linear"],
    "qwen2_moe": ["Qwen2MoeMLP.forward -> llmkernels.glu_linear"],
    "mistral3": ["Mistral3RMSNorm -> llmkernels.rms_norm", "modeling_ministral3.apply_rotary_pos_emb"],
}


def mrope_positions():
    """Temporal, height and width positions ``[3, BATCH, SEQ]`` that differ per section (text
    alone would give three equal rows, which is plain RoPE)."""
    s = torch.arange(SEQ)
    return torch.stack([s, (3 * s) % 11, (5 * s) % 13])[:, None].expand(3, BATCH, SEQ).to(DEVICE)


# model_type -> extra forward inputs
FORWARD_INPUTS = {"qwen2_vl": mrope_positions, "qwen2_5_vl": mrope_positions, "qwen3_vl": mrope_positions}


def make_model(model_type: str, dtype=torch.float32, deep: bool = False):
    cls_name, extra = FAMILIES[model_type]
    if not hasattr(transformers, cls_name):
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    text = {**COMMON, **(DEEP if deep else {})}
    if "text_config" in extra:
        kwargs = dict(extra, text_config={**text, **extra["text_config"]})
    else:
        kwargs = {k: v for k, v in {**text, **extra}.items() if v is not None}
    config = getattr(transformers, cls_name)(**kwargs)
    # Eager attention: Gemma 2's attention-logit softcapping needs it, and it is fast at this size.
    if model_type in MODEL_CLASSES:
        model = getattr(transformers, MODEL_CLASSES[model_type])._from_config(config, attn_implementation="eager")
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    # Random norm weights: Gemma's zeros and Llama's ones would hide a wrong (1 + w) or w.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.5 + (0.0 if "gemma" in model_type else 1.0))
    return model.to(device=DEVICE, dtype=dtype)


def batch(step: int, vocab: int = VOCAB):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(3, vocab, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # masked prompt tokens
    return ids.to(DEVICE), labels.to(DEVICE)


def train(model, steps: int, record_first: bool = True, **inputs):
    """Loss of each of ``steps`` AdamW steps on one batch, and logits and gradients of the first
    (``record_first``: a model without logits in its output runs a second forward for them, which
    under FSDP2 leaves the root's gathered parameters stale for the next step)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    losses, first = [], None
    ids, labels = batch(0, model.config.get_text_config().vocab_size)
    for step in range(steps):
        out = model(input_ids=ids, labels=labels, **inputs)
        out.loss.backward()
        if step == 0 and record_first:
            with torch.no_grad():
                logits = (model(input_ids=ids, return_logits=True, **inputs).logits if out.logits is None
                          else out.logits)
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            first = (out.loss.detach(), logits.detach(), grads)
        losses.append(out.loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, first


@pytest.fixture(autouse=True)
def _restore_transformers():
    yield
    hf.unpatch_all()


@pytest.mark.parametrize("model_type,deep", [*((t, False) for t in FAMILIES),
                                             *(pytest.param(t, True, marks=pytest.mark.slow) for t in FAMILIES)],
                         ids=[*FAMILIES, *(f"{t}-deep" for t in FAMILIES)])
def test_patched_model_trains_like_unpatched(model_type, deep):
    torch.manual_seed(0)
    model = make_model(model_type, deep=deep)
    patched = copy.deepcopy(model)
    steps = DEEP_STEPS if deep else STEPS
    inputs = {name: make() for name, make in [("position_ids", FORWARD_INPUTS.get(model_type))] if make}
    try:
        ref_losses, (ref_loss, ref_logits, ref_grads) = train(model, steps, **inputs)  # before patching: RoPE
    except AttributeError as e:                                                       # is module-level
        if model_type == "llama4" and "image_outputs" in str(e):
            pytest.skip(f"transformers {transformers.__version__}: Llama4ForConditionalGeneration.forward fails "
                        f"unpatched ({e})")
        raise
    report = llmkernels.patch(patched)
    expected = NOT_PATCHED.get(model_type, {})
    for part in ("rope", "loss"):
        assert part in expected or part not in report.not_patched, str(report)
    for part, why in expected.items():
        assert why in report.not_patched.get(part, ""), str(report)
    if model_type in MLPS:
        mlp_cls, activation = MLPS[model_type]
        op = "glu" if mlp_cls.endswith("Experts") else "glu_linear"  # the down projection too
        assert any(p.startswith(f"{mlp_cls}.") and f"llmkernels.{op}(activation={activation!r})" in p
                   for p in report.patched), str(report)
    elif not expected:
        assert "no gated MLP" in report.not_patched["mlp"]
    for what in ALSO_PATCHED.get(model_type, []):
        assert any(what in p for p in report.patched), str(report)
    losses, (loss, logits, grads) = train(patched, steps, **inputs)

    assert rel_err(logits, ref_logits) < 1e-5, f"logits rel err {rel_err(logits, ref_logits):.2e}"
    assert rel_err(loss, ref_loss) < 1e-5, f"loss {loss.item()} vs {ref_loss.item()}"
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert rel_err(g, ref_grads[name]) < 1e-4, f"grad {name}: rel err {rel_err(g, ref_grads[name]):.2e}"
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) < 1e-4, (losses, ref_losses)
    assert ref_losses[-1] < ref_losses[0]  # the steps do train


def test_norm_patch_keeps_parameters_and_state_dict():
    model = make_model("qwen3")
    params = {n: p for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    report = llmkernels.patch(model, rope=False, cross_entropy=False)
    assert "Qwen3RMSNorm -> llmkernels.rms_norm(casting='llama') (5 modules)" in report.patched  # incl. q/k norms
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())
    assert hf.is_patched(model.model.layers[0].self_attn.q_norm.forward)
    assert llmkernels.patch(model, rope=False, cross_entropy=False).patched == report.patched  # idempotent


def test_switches_leave_the_model_alone():
    model = make_model("llama")
    report = llmkernels.patch(model, rms_norm=False, layer_norm=False, rope=False, cross_entropy=False, mlp=False)
    assert report.patched == []
    assert set(report.not_patched) == {"LlamaRMSNorm", "LlamaMLP", "rope", "loss"}
    assert "forward" not in vars(model) and "forward" not in vars(model.model.norm)
    assert "forward" not in vars(model.model.layers[0].mlp)
    module = __import__(type(model).__module__, fromlist=["x"])
    assert not hf.is_patched(module.apply_rotary_pos_emb)


def test_unknown_model_reports_what_was_not_patched():
    class FancyRMSNorm(nn.Module):
        def forward(self, x):
            return x

    model = nn.Sequential(transformers.models.llama.modeling_llama.LlamaRMSNorm(8), FancyRMSNorm(), nn.LayerNorm(8))
    with pytest.warns(UserWarning, match="not patched: FancyRMSNorm") as record:
        report = llmkernels.patch(model)
    text = str(record[0].message)
    assert "LlamaRMSNorm -> llmkernels.rms_norm(casting='llama') (1 modules)" in text
    assert "torch.nn.LayerNorm -> llmkernels.layer_norm (1 modules)" in text
    assert "model type None is not one of" in report.not_patched["loss"]
    x = torch.randn(3, 8, device=DEVICE)
    model.to(DEVICE)
    ref = nn.functional.layer_norm(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), (8,),
                                   model[2].weight, model[2].bias)
    assert rel_err(model(x), ref) < 1e-5


def test_patch_model_type_before_from_pretrained(tmp_path):
    torch.manual_seed(0)
    model = make_model("llama").eval()
    ids, _ = batch(0)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    model.save_pretrained(tmp_path)

    report = llmkernels.patch_model_type("llama")
    assert "LlamaRMSNorm.forward -> llmkernels.rms_norm(casting='llama')" in report.patched
    assert any(p.startswith("LlamaMLP.forward -> llmkernels.glu") for p in report.patched)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").to(DEVICE).eval()
    assert hf.is_patched(loaded.model.norm.forward)
    assert hf.is_patched(loaded.model.layers[0].mlp.forward)
    with torch.no_grad():
        out = loaded(input_ids=ids).logits
    assert rel_err(out, ref) < 1e-5
    hf.unpatch_all()
    assert not hf.is_patched(type(loaded.model.norm).forward)
    assert not hf.is_patched(type(loaded.model.layers[0].mlp).forward)


def test_patch_model_type_also_patches_models_built_before_it():
    """patch_model_type replaces the classes' own methods: a model that exists already runs on
    the kernels from then on too (its loss without logits while training)."""
    model = make_model("llama").train()
    ids, labels = batch(0)
    ref = model(input_ids=ids, labels=labels)
    assert ref.logits is not None and not hf.is_patched(model.model.norm.forward)
    llmkernels.patch_model_type("llama")
    assert all(hf.is_patched(f) for f in (model.forward, model.model.norm.forward, model.model.layers[0].mlp.forward))
    out = model(input_ids=ids, labels=labels)
    assert out.logits is None and rel_err(out.loss, ref.loss) < 1e-5


def test_mlp_whose_activation_glu_lacks_keeps_transformers_product():
    """hidden_act="relu": patch() leaves the MLP and says why; after patch_model_type the
    class-level forward computes transformers' act_fn(gate) * up for it."""
    config = transformers.LlamaConfig(**COMMON, hidden_act="relu")
    model = transformers.AutoModelForCausalLM.from_config(config).to(DEVICE)
    report = llmkernels.patch(model, rms_norm=False, rope=False, cross_entropy=False)
    assert "ReLU" in report.not_patched["LlamaMLP"], str(report)
    mlp = model.model.layers[0].mlp
    assert "forward" not in vars(mlp)
    llmkernels.patch_model_type("llama", rms_norm=False, rope=False, cross_entropy=False)
    assert hf.is_patched(mlp.forward)
    x = torch.randn(2, 3, COMMON["hidden_size"], device=DEVICE)
    assert torch.equal(mlp(x), mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)))


def test_eager_experts_are_reported_not_patched():
    """transformers' eager experts loop computes act_fn(gate) * up inline, without _apply_gate."""
    model = make_model("mixtral")
    if not hasattr(model, "set_experts_implementation"):
        pytest.skip(f"transformers {transformers.__version__} has no experts implementations")
    model.set_experts_implementation("eager")
    report = llmkernels.patch(model, rope=False, cross_entropy=False)
    assert "experts_implementation='eager'" in report.not_patched["MixtralExperts"], str(report)
    assert "_apply_gate" not in vars(model.model.layers[0].mlp.experts)


def test_patch_model_type_gpt_neox_layer_norms():
    llmkernels.patch_model_type("gpt_neox", rope=False, cross_entropy=False)
    model = make_model("gpt_neox")
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    assert len(norms) == 3 and all(hf.is_patched(m.forward) for m in norms)
    with pytest.raises(ValueError, match="model_type must be one of"):
        llmkernels.patch_model_type("bert")


def test_return_dict_false_and_logits_when_asked():
    model = make_model("llama").train()
    llmkernels.patch(model)
    ids, labels = batch(0)
    out = model(input_ids=ids, labels=labels)
    assert out.logits is None  # training with labels: the loss without logits
    both = model(input_ids=ids, labels=labels, return_logits=True)
    assert both.logits.shape == (BATCH, SEQ, VOCAB) and rel_err(both.loss, out.loss) < 1e-5
    as_tuple = model(input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(as_tuple, tuple) and rel_err(as_tuple[0], out.loss) < 1e-6
    # num_items_in_batch (gradient accumulation): sum over tokens / the given count
    n = (labels[:, 1:] != -100).sum()
    summed = model(input_ids=ids, labels=labels, num_items_in_batch=2 * n).loss
    assert rel_err(summed, out.loss / 2) < 1e-5


def test_granite_loss_needs_power_of_two_scaling():
    """Granite divides the logits by logits_scaling: dividing the hidden states instead is exact
    only for a power of two, so with 3.0 patch() leaves the loss to transformers, and a class
    patched by patch_model_type falls back to transformers' forward."""
    config = transformers.GraniteConfig(**COMMON, logits_scaling=3.0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(DEVICE).train()
    report = llmkernels.patch(copy.deepcopy(model), rms_norm=False, rope=False, mlp=False)
    assert "logits_scaling=3.0 is not a power of two" in report.not_patched["loss"], str(report)
    ids, labels = batch(0)
    ref = model(input_ids=ids, labels=labels)
    report = llmkernels.patch_model_type("granite", rms_norm=False, rope=False, mlp=False)
    assert any("(models whose logits_scaling is a power of two)" in p for p in report.patched), str(report)
    out = model(input_ids=ids, labels=labels)
    assert out.logits is not None and torch.equal(out.loss, ref.loss)


def test_patch_model_type_of_a_composite_model():
    """Mistral 3's language model is a model type of its own: patch_model_type("mistral3") says
    so for RoPE and patches the projector's norm and the multimodal model's loss."""
    report = llmkernels.patch_model_type("mistral3")
    assert "patch_model_type that type too" in report.not_patched["rope"], str(report)
    assert "Mistral3RMSNorm.forward -> llmkernels.rms_norm(casting='llama')" in report.patched
    assert "Mistral3ForConditionalGeneration.forward loss -> llmkernels.linear_cross_entropy" in report.patched
