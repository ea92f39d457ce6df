"""What each supported model type uses, as data: adding a family is one ``Family`` entry here
(and one test row). Nothing here imports torch or transformers."""
from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Family:
    module: str                      # transformers.models.<module>.modeling_<module>
    norms: dict                      # RMSNorm class name -> llmkernels casting
    causal_lm: Optional[str]         # the class whose forward computes the LM loss (*ForCausalLM, or a
                                     # *ForConditionalGeneration that calls ``base`` then ``lm_head``)
    layer_norm: bool = False         # uses torch.nn.LayerNorm (GPT-NeoX)
    mlps: dict = dataclasses.field(default_factory=dict)  # gated-MLP class name -> layout (mlp.LAYOUTS)
    experts: dict = dataclasses.field(default_factory=dict)  # MoE experts class name -> activation (hf/moe.py)
    rope: Optional[str] = "rotate_half"  # how the module applies RoPE (rope.WRAPPERS), None: it has none of its own
    logits: str = "plain"            # lm_head output -> loss logits: "plain", "softcap" (final_logit_softcapping)
                                     # or "scaled" (divided by config.logits_scaling)
    base: str = "model"              # attribute of ``causal_lm`` holding the base model
    reasons: dict = dataclasses.field(default_factory=dict)  # part -> why it is left to transformers


FAMILIES = {
    "llama": Family("llama", {"LlamaRMSNorm": "llama"}, "LlamaForCausalLM", mlps={"LlamaMLP": "separate"}),
    "mistral": Family("mistral", {"MistralRMSNorm": "llama"}, "MistralForCausalLM",
                      mlps={"MistralMLP": "separate"}),
    "ministral3": Family("ministral3", {"Ministral3RMSNorm": "llama"}, "Ministral3ForCausalLM",
                         mlps={"Ministral3MLP": "separate"}),
    # Mistral 3 (Pixtral vision + a Mistral / Ministral 3 language model of its own model type, whose
    # RoPE ``patch`` patches): the projector's norm and the loss here.
    "mistral3": Family("mistral3", {"Mistral3RMSNorm": "llama"}, "Mistral3ForConditionalGeneration", rope=None,
                       reasons={"rope": "its language model is the model type config.text_config.model_type: "
                                        "patch_model_type that type too"}),
    "mixtral": Family("mixtral", {"MixtralRMSNorm": "llama"}, "MixtralForCausalLM",
                      mlps={"MixtralExperts": "experts"}, experts={"MixtralExperts": "silu"}),
    "qwen2": Family("qwen2", {"Qwen2RMSNorm": "llama"}, "Qwen2ForCausalLM", mlps={"Qwen2MLP": "separate"}),
    "qwen2_moe": Family("qwen2_moe", {"Qwen2MoeRMSNorm": "llama"}, "Qwen2MoeForCausalLM",
                        mlps={"Qwen2MoeMLP": "separate", "Qwen2MoeExperts": "experts"},
                        experts={"Qwen2MoeExperts": "silu"}),
    # Qwen2-VL, Qwen2.5-VL, Qwen3-VL: their rotary embedding folds the multimodal (temporal, height, width)
    # sections into per-token cos/sin, which apply_rotary_pos_emb applies as plain RoPE.
    "qwen2_vl": Family("qwen2_vl", {"Qwen2VLRMSNorm": "llama"}, "Qwen2VLForConditionalGeneration",
                       mlps={"Qwen2MLP": "separate"}),
    "qwen2_5_vl": Family("qwen2_5_vl", {"Qwen2_5_VLRMSNorm": "llama"}, "Qwen2_5_VLForConditionalGeneration",
                         mlps={"Qwen2MLP": "separate", "Qwen2_5_VLMLP": "separate"}),
    "qwen3": Family("qwen3", {"Qwen3RMSNorm": "llama"}, "Qwen3ForCausalLM", mlps={"Qwen3MLP": "separate"}),
    "qwen3_moe": Family("qwen3_moe", {"Qwen3MoeRMSNorm": "llama"}, "Qwen3MoeForCausalLM",
                        mlps={"Qwen3MoeMLP": "separate", "Qwen3MoeExperts": "experts"},
                        experts={"Qwen3MoeExperts": "silu"}),
    # OLMoE: q/k norms over the whole projection; DeepSeek-V3: MLA, whose RoPE (rope_interleave) is
    # its own apply_rotary_pos_emb_interleave, left to transformers.
    "olmoe": Family("olmoe", {"OlmoeRMSNorm": "llama"}, "OlmoeForCausalLM", experts={"OlmoeExperts": "silu"}),
    "deepseek_v3": Family("deepseek_v3", {"DeepseekV3RMSNorm": "llama"}, "DeepseekV3ForCausalLM",
                          mlps={"DeepseekV3MLP": "separate"}, experts={"DeepseekV3Experts": "silu"}, rope=None,
                          reasons={"rope": "its attention (MLA) applies RoPE with apply_rotary_pos_emb_interleave "
                                           "or to a slice of each head: left to transformers"}),
    "qwen3_vl": Family("qwen3_vl", {"Qwen3VLTextRMSNorm": "llama"}, "Qwen3VLForConditionalGeneration",
                       mlps={"Qwen3VLTextMLP": "separate"}),
    # Llama 4: complex RoPE on (2i, 2i + 1) pairs, weightless q/k L2 norms, 3-D experts run by bmm.
    "llama4_text": Family("llama4", {"Llama4TextRMSNorm": "llama", "Llama4TextL2Norm": "llama"},
                          "Llama4ForCausalLM", mlps={"Llama4TextMLP": "separate_activation_fn",
                                                     "Llama4TextExperts": "bmm_experts"}, rope="complex"),
    "llama4": Family("llama4", {"Llama4TextRMSNorm": "llama", "Llama4TextL2Norm": "llama"}, None,
                     mlps={"Llama4TextMLP": "separate_activation_fn", "Llama4TextExperts": "bmm_experts"},
                     rope="complex",
                     reasons={"loss": "Llama4ForConditionalGeneration merges the image features and runs its "
                                      "language model's lm_head itself (Llama4ForCausalLM's loss is patched)"}),
    "phi3": Family("phi3", {"Phi3RMSNorm": "llama"}, "Phi3ForCausalLM", mlps={"Phi3MLP": "fused"}),
    "smollm3": Family("smollm3", {"SmolLM3RMSNorm": "llama"}, "SmolLM3ForCausalLM", mlps={"SmolLM3MLP": "separate"}),
    # Granite divides the logits by logits_scaling: the loss is patched where that is a power of two (then
    # hidden / scaling is exact and the logits equal transformers' bit for bit).
    "granite": Family("granite", {"GraniteRMSNorm": "llama"}, "GraniteForCausalLM", mlps={"GraniteMLP": "separate"},
                      logits="scaled"),
    # OLMo 2 / 3 and gpt-oss multiply by the weight in fp32 and cast once: casting="none".
    "olmo2": Family("olmo2", {"Olmo2RMSNorm": "none"}, "Olmo2ForCausalLM", mlps={"Olmo2MLP": "separate"}),
    "olmo3": Family("olmo3", {"Olmo3RMSNorm": "none"}, "Olmo3ForCausalLM", mlps={"Olmo3MLP": "separate"}),
    # gpt-oss: cos/sin tables of half the head (both halves use them); its experts' _apply_gate is a
    # clamped SwiGLU (alpha, limit) that llmkernels.glu does not compute (moe_experts does).
    "gpt_oss": Family("gpt_oss", {"GptOssRMSNorm": "none"}, "GptOssForCausalLM", mlps={"GptOssExperts": "experts"},
                      experts={"GptOssExperts": "clamped_swiglu"}, rope="half_table"),
    "gemma": Family("gemma", {"GemmaRMSNorm": "gemma"}, "GemmaForCausalLM", mlps={"GemmaMLP": "separate"}),
    "gemma2": Family("gemma2", {"Gemma2RMSNorm": "gemma"}, "Gemma2ForCausalLM", mlps={"Gemma2MLP": "separate"},
                     logits="softcap"),
    "gemma3_text": Family("gemma3", {"Gemma3RMSNorm": "gemma"}, "Gemma3ForCausalLM",
                          mlps={"Gemma3MLP": "separate"}, logits="softcap"),
    # The multimodal Gemma 3 (its lm_head output is not softcapped).
    "gemma3": Family("gemma3", {"Gemma3RMSNorm": "gemma"}, "Gemma3ForConditionalGeneration",
                     mlps={"Gemma3MLP": "separate"}),
    # GPT-NeoX's MLP is not gated (dense_4h_to_h(act(dense_h_to_4h(x)))).
    "gpt_neox": Family("gpt_neox", {}, "GPTNeoXForCausalLM", layer_norm=True, base="gpt_neox"),
}

# Norm class name -> casting, for recognising these classes inside any model.
NORM_CASTING = {name: casting for fam in FAMILIES.values() for name, casting in fam.norms.items()}
# Gated-MLP class name -> layout, likewise.
MLP_LAYOUT = {name: layout for fam in FAMILIES.values() for name, layout in fam.mlps.items()}
# MoE experts class name -> the activation moe_experts computes for it, likewise.
MOE_EXPERTS = {name: activation for fam in FAMILIES.values() for name, activation in fam.experts.items()}


def supported_model_types() -> tuple:
    """The ``config.model_type`` values that ``patch`` and ``patch_model_type`` know."""
    return tuple(FAMILIES)
