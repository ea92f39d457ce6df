"""Test setup: kernels run on CUDA when there is a GPU, else through Triton's interpreter on CPU
tensors (TRITON_INTERPRET must be set before triton is imported, so it is set here)."""
import os

# Inductor's on-disk caches key a compiled graph on the graph, not on our custom ops' fake
# implementations: a graph compiled before a fake changed would be replayed with the old layout.
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# LLMKERNELS_TEST_DEFAULT_DEVICE=cuda runs the suite as training scripts often do, with
# torch.set_default_device("cuda"): every tensor an op makes must name its device.
if os.environ.get("LLMKERNELS_TEST_DEFAULT_DEVICE"):
    torch.set_default_device(os.environ["LLMKERNELS_TEST_DEFAULT_DEVICE"])
# The kernels run under Triton's interpreter on the CPU (llmkernels.ops._launch rounds its fp32 ->
# bf16 conversions to nearest even, as the GPU does); some shapes take too long there.
INTERPRETED = DEVICE == "cpu"


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
