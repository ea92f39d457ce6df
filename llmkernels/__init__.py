"""llmkernels: fused Triton kernels for training transformers.

The public API is below. Names are imported on first use, so that ``llmkernels --help`` and
``llmkernels --version`` answer without importing torch.
"""
import importlib as _importlib

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "rms_norm": ".ops.norm",
    "layer_norm": ".ops.norm",
    "apply_rope": ".ops.rope",
    "apply_rotary_pos_emb": ".ops.rope",
    "qk_norm_rope": ".ops.qk_norm_rope",
    "qkv_norm_rope": ".ops.qk_norm_rope",
    "glu": ".ops.glu",
    "glu_linear": ".ops.glu",
    "cross_entropy": ".ops.losses.cross_entropy",
    "CrossEntropyOutput": ".ops.losses.base",
    "linear_cross_entropy": ".ops.losses.linear_cross_entropy",
    "linear_log_probs": ".ops.losses.log_probs",
    "linear_distill_loss": ".ops.losses.distill",
    "linear_z_loss": ".ops.losses.z_loss",
    "moe_experts": ".ops.moe",
    "ExpertLora": ".ops.moe",
    "moe_route": ".ops.moe",
    "moe_load_balancing_loss": ".ops.moe",
    "moe_router_z_loss": ".ops.moe",
    "RouterOptions": ".ops.moe",
    "vocab_parallel_cross_entropy": ".parallel.vocab_parallel",
    "vocab_parallel_linear_cross_entropy": ".parallel.vocab_parallel_linear",
    "RMSNorm": ".modules",
    "FusedAddRMSNorm": ".modules",
    "LayerNorm": ".modules",
    "patch": ".hf",
    "patch_model_type": ".hf",
    "unpatch_all": ".hf",
    "supported_model_types": ".hf",
    "PatchReport": ".hf",
    "add_expert_lora": ".hf",
    "save_expert_lora": ".hf",
    "load_expert_lora": ".hf",
}

_SUBMODULES = ("ops", "parallel", "reference", "reference_moe", "modules", "hf", "hf_kernels", "bench", "scaling")

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        if name in _SUBMODULES:  # ``llmkernels.reference`` without importing it first, as before
            return _importlib.import_module(f".{name}", __name__)
        raise AttributeError(f"module 'llmkernels' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module, __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__():
    """The public API (``__all__``), not this module's machinery or the submodules imported so far."""
    return sorted(__all__)
