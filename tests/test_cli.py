"""The ``llmkernels`` command: help in the user's words, version, env, the public names; how
``llmkernels bench`` names its output, refuses to merge runs, checks every gradient, says once
what did not run and sums a run up in one line; ``tune`` without a GPU; and no interpreter
warnings on the user's screen."""
import argparse
import dataclasses
import os
import re
import subprocess
import sys

import pytest
import torch

import llmkernels
from llmkernels import cli, fuzz, tune
from llmkernels.bench import _parser, ops, registry, report
from llmkernels.bench.registry import Provider, Unavailable
from llmkernels.bench.runner import Case, Runner, Settings
from llmkernels.fuzz import check
from llmkernels.ops import _device

# Names of the code, not of the product: never in what a command prints for help.
INTERNAL = re.compile(r"spaces\.|check\.|\w\.py\b|CONTEXTS|NORM_WIDTHS|VOCABS|``")

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


def test_dir_shows_the_public_api_only():
    names = dir(llmkernels)
    assert names == sorted(llmkernels.__all__) and "rms_norm" in names and "__version__" in names
    llmkernels.reference, llmkernels.rms_norm  # noqa: B018 (lazy look-ups add no name)
    assert dir(llmkernels) == names
    assert not {"annotations", "importlib", "_importlib", "reference", "ops"} & set(names)


def _help(capsys, *argv) -> str:
    try:
        code = cli.main([*argv, "--help"])
    except SystemExit as exit:  # argparse's --help
        code = exit.code
    assert code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", [[], ["env"], ["bench"], ["tune"], ["fuzz"]], ids=lambda c: " ".join(c) or "-")
def test_help_speaks_the_users_language(command, capsys):
    text = _help(capsys, *command)
    assert not INTERNAL.search(text), INTERNAL.search(text)


@pytest.mark.parametrize("parser", [tune._parser, fuzz._parser], ids=["tune", "fuzz"])
def test_every_option_has_help(parser):
    for action in parser()._actions:
        assert action.help and action.help != argparse.SUPPRESS, f"{action.option_strings} has no help"


def test_fuzz_contexts_are_described():
    assert tuple(fuzz.CONTEXT_HELP) == check.CONTEXTS
    assert fuzz._parser().parse_args(["--context", "autocast"]).context == "autocast"


def test_cache_dir_moves_with_its_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(_device.CACHE_DIR_VARIABLE, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _device.cache_dir() == str(tmp_path / "xdg" / "llmkernels")
    monkeypatch.setenv(_device.CACHE_DIR_VARIABLE, str(tmp_path / "moved"))
    assert _device.cache_dir() == str(tmp_path / "moved")
    assert os.path.dirname(_device.user_cache_path("NVIDIA H100 80GB HBM3")) == str(tmp_path / "moved")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message of a machine without a GPU")
def test_tune_without_a_gpu_says_where_it_would_write_and_how_to_check(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(_device.CACHE_DIR_VARIABLE, str(tmp_path / "moved"))
    assert cli.main(["tune"]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and str(tmp_path / "moved") in err and _device.CACHE_DIR_VARIABLE in err
    check_command = re.search(r"^ +llmkernels tune (.*)$", err, re.M).group(1).split()
    assert tune._parser().parse_args(check_command).tiny
    assert not (tmp_path / "moved").exists()  # said, not written
    assert cli.main(["env"]) == 0 and f"tuned cache   {tmp_path / 'moved'}" in capsys.readouterr().out


def test_gradients_formed_in_the_forward_are_checked_and_their_bwd_table_says_why(device):
    """The linear losses form their gradients in the forward: without a GPU their gradients are
    checked as every other provider's; a timing run cannot time their backward alone, and its
    bwd table says so in one note instead of leaving their column out."""
    op = ops()["linear_cross_entropy"]
    settings = Settings(ops=[op.name], dtypes=["fp32"], sizes=[300], rows=5, modes=("fwd", "bwd"),
                        providers=["llmkernels", "torch"], decode=False, eager=False)
    if device == "cpu":
        records = Runner(settings, torch.device(device), log=print).run()
        bwd = {r["provider"]: r for r in records if r["mode"] == "bwd"}
        assert set(bwd) == {"llmkernels", "torch"} and bwd["llmkernels"]["status"] == "ok"
        assert {"dhidden", "dweight"} <= set(bwd["llmkernels"]["errors"])
    runner = Runner(settings, torch.device(device), log=print)
    runner.timing, runner.copy_gbps = True, 1000.0
    case = Case(op, op.shape(300, 5), torch.float32, torch.device(device), grads=True)
    runner.settings = dataclasses.replace(settings, modes=("bwd",))
    runner._run_provider(case, "bandwidth", "llmkernels", "linear_cross_entropy")
    runner.records.append(dict(runner.records[0], provider="torch", status="ok", ms=1.0, us=1e3, gbps=1.0,
                               pct_copy=0.1))
    report.add_speedups(runner.records)
    (title, headers, rows, notes), = report.tables(runner.records)
    assert headers[:3] == ["V", "llmkernels", "torch"] and rows[0][1] == report.NOT_TIMED_ALONE
    assert notes == [f"llmkernels: {report.NOT_TIMED_ALONE_WHY}"]
    assert runner.notes() == [f"bwd of llmkernels (linear_cross_entropy) not timed alone: {report.NOT_TIMED_ALONE_WHY}"]
    assert report.summary(runner.records).startswith("summary: llmkernels passed 0 of 0 checks (peers 1 of 1)")


def test_what_did_not_run_is_said_once(monkeypatch, device):
    """A provider skipped for every op is one line at the end, not one line an op."""
    missing = Provider(lambda: (_ for _ in ()).throw(Unavailable("demo is not installed")))
    for name in ("rmsnorm", "layernorm"):
        base = ops()[name]
        monkeypatch.setitem(registry._OPS, name, dataclasses.replace(
            base, small_shapes=base.small_shapes[:1], providers={"llmkernels": base.providers["llmkernels"],
                                                                  "demo": missing}))
    lines = []
    runner = Runner(Settings(ops=["rmsnorm", "layernorm"], dtypes=["fp32"], sizes=[256], rows=4, modes=("fwd",),
                             decode=False, eager=False), torch.device(device), log=lines.append)
    runner.run()
    assert not [line for line in lines if "demo" in line]
    assert runner.notes() == ["skipped demo (rmsnorm, layernorm): demo is not installed"]


def test_fuzz_reruns_itself_under_the_interpreter_without_warnings(tmp_path):
    """Without a GPU, ``llmkernels fuzz`` checks the kernels (through the interpreter, in a fresh
    process when TRITON_INTERPRET was not set), and NumPy's warnings about the interpreter's
    masked-off lanes stay off the screen (these cross-entropy cases raise one)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "llmkernels.cli", "fuzz", "--cases", "2", "--ops", "cross_entropy"],
                          capture_output=True, text=True, cwd=tmp_path, env={**env, "PYTHONPATH": ROOT}, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Warning" not in proc.stdout + proc.stderr, proc.stderr
    device = "Triton interpreter" if not torch.cuda.is_available() else torch.cuda.get_device_name()
    assert re.search(rf"^2 cases on .*{re.escape(device)}.*: 0 failures$", proc.stdout, re.M), proc.stdout
