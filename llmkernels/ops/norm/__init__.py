"""RMSNorm and LayerNorm: one forward and one backward kernel family for both.

Rows are the last dimension of ``x [..., N]``. Constexpr switches select RMS vs LayerNorm,
a fused residual add (``h = x + residual``), weight, bias, per-head weights ``[H, D]`` and
Llama's rounding of ``x_hat`` to the input dtype. Statistics and dW/dB accumulate in fp32;
``rstd`` (and ``mean``) are saved in fp32 for the backward.

Paths by row width:
  - one pass: the whole row (several rows for small N) sits in registers; x is read once.
  - split: rows wider than ``BWD_ONE_PASS_MAX`` (backward) or ``FWD_ONE_PASS_MAX`` (forward,
    the cases of ``FORWARD``'s split entries; some from 16385) are shared by several programs, each
    holding a slice in registers, that exchange partial row sums through global memory; x (and
    dy) are read once from memory (the forward reads its slice a second time, from L2).
  - blocked: other forwards of rows wider than ``FWD_ONE_PASS_MAX`` loop over column chunks,
    reading the row a second time right after the first, from L2; a backward that cannot be
    split computes the two row dot products in a first kernel, then dx and dW per chunk.
The backward uses a persistent grid: each program loops over its rows, accumulating dW/dB in
fp32 registers, and writes one ``[programs, N]`` partial that a small sum reduces. At decode
sizes (few rows) each program instead also sums dW/dB over every row for its share of the
columns: one launch, no partials.

The package, bottom up: ``tile`` (the arithmetic shared by the kernels), ``forward`` and
``backward`` (the kernels), ``configs`` (their launch configurations as records), ``tables``
(the measured tables that choose them), ``launchers`` and ``api`` (the public functions and their
registration for eager autograd and torch.compile).
"""
from .api import NORM, layer_norm, rms_norm
from .configs import BwdConfig, FwdConfig, NormConfig, SplitBwdConfig, SplitFwdConfig, check_config
from .launchers import BWD_PLANS, FWD_PLANS, BwdKey, FwdKey, NormOptions, norm_bwd, norm_fwd
from .tables import BACKWARD, FORWARD, NormKey, backward_config, forward_config

__all__ = ["layer_norm", "rms_norm", "NORM", "NormConfig", "FwdConfig", "SplitFwdConfig", "BwdConfig", "SplitBwdConfig",
           "check_config", "NormOptions", "FwdKey", "BwdKey", "NormKey", "FORWARD", "BACKWARD", "forward_config",
           "backward_config", "norm_fwd", "norm_bwd", "FWD_PLANS", "BWD_PLANS"]
