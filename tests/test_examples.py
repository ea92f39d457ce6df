"""The examples run as written and say which path ran: without a GPU the kernels through Triton's
interpreter (which they turn on themselves, as tests/conftest.py does), and with
``TRITON_INTERPRET=0`` the plain-PyTorch fallback, which the quick start must not call a match."""
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = sorted(f for f in os.listdir(os.path.join(ROOT, "examples")) if f.endswith(".py"))
GPU = torch.cuda.is_available()
KERNELS = "Triton kernels on the GPU" if GPU else "Triton kernels in Triton's interpreter (CPU)"


def _run(name, **env):
    env = {**os.environ, "PYTHONPATH": ROOT, **env}  # this checkout's llmkernels, whatever is installed
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr  # e.g. NumPy's from the interpreter's masked-off lanes
    return proc.stdout.strip()


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs_and_names_the_kernels(name):
    out = _run(name)
    assert KERNELS in out, out
    if name == "quickstart.py":
        assert re.search(r": loss [0-9.]+; every op above matches PyTorch$", out), out
    if name == "post_training.py":
        for loss in ("grpo", "ppo", "dpo"):
            assert re.search(rf"^{loss} loss, steps 1-3: (-?[0-9.]+, ){{2}}-?[0-9.]+$", out, re.M), out


@pytest.mark.skipif(GPU, reason="the fallback runs where no kernel can: a CPU without the interpreter")
def test_quick_start_on_the_fallback_says_so():
    out = _run("quickstart.py", TRITON_INTERPRET="0")
    assert "the plain-PyTorch fallback (no kernel ran)" in out and "PyTorch was compared with itself" in out, out
    assert "matches" not in out
