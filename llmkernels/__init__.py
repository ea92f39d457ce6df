"""llmkernels: fused Triton kernels for training and serving transformers."""
from .ops.norm import layer_norm, rms_norm
from .ops.rope import apply_rope, apply_rotary_pos_emb
from .ops.glu import glu, glu_linear
from .ops.cross_entropy import CrossEntropyOutput, cross_entropy
from .ops.linear_cross_entropy import linear_cross_entropy
from .ops.log_probs import linear_log_probs
from .ops.distill import linear_distill_loss
from .modules import FusedAddRMSNorm, LayerNorm, RMSNorm
from .hf import patch, patch_model_type

__version__ = "0.1.0"
