"""The ``llmkernels`` command: help, version, env, and how ``llmkernels bench`` names its output,
refuses to merge runs, sums a run up in one line and keeps the interpreter's warnings out."""
import os
import subprocess
import sys

import pytest

import llmkernels
from llmkernels import cli
from llmkernels.bench import _parser, ops, report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, cwd=None, env=None):
    env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
    return subprocess.run([sys.executable, "-m", "llmkernels.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=300)


def test_help_and_version_do_not_import_torch():
    code = ("import sys; from llmkernels import cli; cli.main(['--help']); cli.main(['--version']); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "commands:" in proc.stdout and "bench" in proc.stdout and "env" in proc.stdout
    assert proc.stdout.rstrip().endswith(f"llmkernels {llmkernels.__version__}")


def test_bare_command_prints_help_and_exits_2(capsys):
    assert cli.main([]) == 2
    assert "usage: llmkernels" in capsys.readouterr().err
    assert cli.main(["nope"]) == 2
    assert "unknown command 'nope'" in capsys.readouterr().err
    assert cli.main(["env", "--nope"]) == 2


def test_env_reports_versions_interpreter_gpu_and_peers(capsys):
    assert cli.main(["env"]) == 0
    text = capsys.readouterr().out
    import torch
    import triton

    assert f"llmkernels    {llmkernels.__version__}" in text
    assert f"torch         {torch.__version__}" in text and f"triton        {triton.__version__}" in text
    assert "interpreter   " in text
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    assert f"interpreter   {'on' if interpret else 'off'}" in text
    assert ("GPU 0" in text and "memory bandwidth" in text) if torch.cuda.is_available() else "GPU           none" in text
    for dist in cli.PEERS + cli.INTEGRATIONS:
        assert dist in text


def test_every_bench_option_is_described():
    parser = _parser(ops())
    for action in parser._actions:
        assert action.help, f"{action.option_strings} has no help"
    text = parser.format_help()
    for words in ("bf16, fp16, fp32", "inference forward", "backward alone", "fwd+bwd",
                  "./llmkernels-bench/<device>-<date>-<time>", "% of the GPU's copy bandwidth"):
        assert words in " ".join(text.split()), words
    assert "%%" not in text  # the description is printed as written, not %-formatted


def test_summary_line():
    def rec(provider, kind, status="ok", speedup=None):
        return {"provider": provider, "kind": kind, "status": status, "speedup_vs_best_peer": speedup}
    records = [rec("llmkernels", "bandwidth", speedup=2.0), rec("llmkernels", "bandwidth", speedup=0.5),
               rec("llmkernels", "decode_graph", speedup=1.25), rec("llmkernels", "bandwidth", "failed"),
               rec("torch", "bandwidth"), rec("liger", "bandwidth", "failed"), rec("llmkernels_inplace", "bandwidth")]
    assert report.summary(records) == ("summary: llmkernels passed 3 of 4 checks (peers 1 of 2); fastest in 2 of 3 "
                                       "timed cells; geometric-mean speedup over the best peer 1.08x")
    checks = [rec("llmkernels", "check"), rec("torch", "check", "failed")]
    assert report.summary(checks, complete=False) == ("summary: llmkernels passed 1 of 1 checks (peers 0 of 1); "
                                                      "nothing timed (no GPU) (interrupted: partial run)")


def test_bench_writes_a_new_folder_and_no_interpreter_warnings(tmp_path):
    """A run lands in a new folder under ./llmkernels-bench and ends with the summary line; the
    cross-entropy kernels take log(0) on masked lanes, which NumPy warns about under the
    interpreter: not on the user's screen."""
    args = ["bench", "--op", "cross_entropy", "--providers", "llmkernels", "--mode", "fwd", "--no-decode"]
    if not __import__("torch").cuda.is_available():
        args += ["--dtype", "fp32"]
    proc = _run(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RuntimeWarning" not in proc.stderr + proc.stdout
    assert proc.stdout.rstrip().splitlines()[-1].startswith("summary: llmkernels passed ")
    (folder,) = os.listdir(tmp_path / "llmkernels-bench")
    assert set(os.listdir(tmp_path / "llmkernels-bench" / folder)) >= {"results.json", "results.md"}


def test_each_run_gets_its_own_folder(tmp_path, monkeypatch):
    """Named by device, date and time; a second run in the same second gets a suffix."""
    import llmkernels.bench as bench

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench.time, "strftime", lambda fmt: "2026-11-25-120000")
    first = bench._new_out_dir("NVIDIA H100 80GB HBM3")
    assert first == os.path.join("llmkernels-bench", "nvidia-h100-80gb-hbm3-2026-11-25-120000")
    os.makedirs(first)
    assert bench._new_out_dir("NVIDIA H100 80GB HBM3") == first + "-2"


@pytest.mark.parametrize("args", [["--help"], ["bench", "--help"]])
def test_help_exits_0(args):
    proc = _run(*args)
    assert proc.returncode == 0 and "usage: llmkernels" in proc.stdout, proc.stderr
