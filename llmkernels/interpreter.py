"""Running the kernels where there is no GPU: a command that checks them re-runs itself under
Triton's interpreter, with the interpreter's NumPy warnings hidden. Shared by the commands
(``bench``, ``fuzz``, ``tune``) without their importing ``cli``, which imports them."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from typing import Optional


def kernels_or_rerun(module: str, argv) -> Optional[int]:
    """Make a command that checks the kernels run them: None where this process can (a GPU, or
    Triton's interpreter already on); else run ``python -m <module> <argv>`` again with
    ``TRITON_INTERPRET=1`` and return its exit status (Triton reads the variable when
    llmkernels' kernels are defined, at ``import llmkernels``, so it cannot be set from here)."""
    import torch

    from .ops._launch import HAVE_TRITON, INTERPRET

    if torch.cuda.is_available() or INTERPRET or not HAVE_TRITON:
        return None
    return subprocess.call([sys.executable, "-m", module, *argv], env=dict(os.environ, TRITON_INTERPRET="1"))


def quiet_interpreter() -> None:
    """Hide the NumPy RuntimeWarnings that Triton's interpreter raises on masked-off lanes (log
    of 0, inf - inf): values no kernel keeps, so the user has nothing to act on."""
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")
