"""The examples run as written (without a GPU: the kernels through Triton's interpreter, which
tests/conftest.py turns on), and the README's quick start is examples/quickstart.py."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = sorted(f for f in os.listdir(os.path.join(ROOT, "examples")) if f.endswith(".py"))


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs(name):
    env = {**os.environ, "PYTHONPATH": ROOT}  # this checkout's llmkernels, whatever is installed
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr  # e.g. NumPy's from the interpreter's masked-off lanes
    if name == "quickstart.py":
        assert re.search(r"on (cpu|cuda): loss [0-9.]+, every op matches PyTorch$", proc.stdout.strip()), proc.stdout


def test_readme_quick_start_is_the_example():
    code = open(os.path.join(ROOT, "examples", "quickstart.py")).read()
    body = code.split('"""', 2)[2].strip()  # without the module docstring
    readme = open(os.path.join(ROOT, "README.md")).read()
    blocks = [b.strip() for b in re.findall(r"```python\n(.*?)```", readme, re.S)]
    assert body in blocks, "README's quick start differs from examples/quickstart.py"
