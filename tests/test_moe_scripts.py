"""The MoE GPU scripts run end to end on CPU at tiny size (``--tiny``, Triton's interpreter), so
that their first GPU call works: every provider that can run here checked against the float32
reference, the JSON and markdown written."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script: str, out: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), "--tiny", "--out", out, *args],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    name = script.removesuffix(".py")
    assert os.path.getsize(os.path.join(out, f"{name}.md")) > 0
    with open(os.path.join(out, f"{name}.json")) as f:
        return json.load(f)


@pytest.mark.slow
def test_moe_bench_tiny(tmp_path):
    result = _run("moe_bench.py", str(tmp_path))
    for case in result["cases"].values():
        for provider in ("llmkernels", "hf_eager", "hf_grouped_mm", "torch_grouped_mm"):
            record = case["providers"][provider]
            assert record["status"] == "ok", record
            assert max(record["errors"].values()) < 3e-2  # bf16 (the interpreter rounds toward zero)


def test_moe_bench_spent_budget_skips_whole_cases(tmp_path):
    """Past the budget a case costs nothing: no reference, no GEMM calibration, every provider skipped."""
    result = _run("moe_bench.py", str(tmp_path), "--budget", "0")
    assert result["cases"]
    for case in result["cases"].values():
        assert "gemm_ceiling_tflops" not in case
        assert {r["status"] for r in case["providers"].values()} == {"skipped: the run's time budget is spent"}


@pytest.mark.slow
def test_moe_lora_bench_tiny(tmp_path):
    result = _run("moe_lora_bench.py", str(tmp_path))
    ours = result["runs"]["llmkernels"]
    assert ours["status"] == "ok" and len(ours["losses"]) == result["meta"]["steps"]
    peft = result["runs"]["transformers+peft"]
    if peft["status"] == "ok":  # the same weights and adapters: the same losses, to bf16's tolerance
        assert max(abs(a - b) / b for a, b in zip(ours["losses"], peft["losses"])) < 2e-2
