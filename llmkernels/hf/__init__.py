"""Patch Hugging Face transformers models to run on the llmkernels kernels.

Two entry points:

- ``patch(model)``: patch a model that already exists, in place. Norm modules keep their class,
  parameters and state-dict keys; only their ``forward`` is swapped (the same Parameter feeds the
  kernel). Returns a ``PatchReport`` saying what was patched and what was not, and why.
- ``patch_model_type("llama")``: patch the classes and functions of a model type's modeling
  module, so that every model of that type, built before the call or after it, runs on the
  kernels. ``unpatch_all()`` undoes it.

What is replaced (each can be switched off): the family's RMSNorm (``norms``), including the
per-head q/k norms of Qwen 3, Gemma 3 and OLMo 2/3 and Llama 4's weightless q/k L2 norm, with
the family's casting; ``torch.nn.LayerNorm`` (GPT-NeoX); the gated MLP's product and down
projection (``mlp``); the MoE experts of Mixtral, Qwen 2/3 MoE, OLMoE, DeepSeek-V3 and gpt-oss
(``moe``: ``llmkernels.moe_experts``, adapters included); the modeling module's RoPE function
(``rope``: module-level, so it changes every model of that type in the process, also for
``patch(model)``); and the loss of ``*ForCausalLM`` (``loss``). Tensor-parallel (DTensor) norms run on the local shard
(``sharding``); a sharded head weight that the fused loss reads outside the head's forward (FSDP2
with the head a group of its own) is gathered for the call (``llmkernels.ops.losses.base.sharded``).

The modules: ``families`` (what each model type uses, as data), ``patching`` (the two entry
points), ``norms``, ``mlp``, ``moe`` (MoE experts), ``rope``, ``loss``, ``sharding`` (the
replacements), ``lora`` (adapters on the experts, in PEFT's format), ``marks`` (how a
replacement is recognised).
"""
from .families import supported_model_types
from .lora import add_expert_lora, load_expert_lora, save_expert_lora
from .marks import is_patched
from .moe import register_experts_interface
from .patching import PatchReport, patch, patch_model_type, unpatch_all

__all__ = ["PatchReport", "add_expert_lora", "is_patched", "load_expert_lora", "patch", "patch_model_type",
           "register_experts_interface", "save_expert_lora", "supported_model_types", "unpatch_all"]
