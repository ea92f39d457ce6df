"""The README says what the code does: its API table shows each function's arguments as they are
passed (positional ones in order, keyword-only ones after ``*``); its install and test commands
are the ones CI runs; its Python blocks run as written (on CPU through Triton's interpreter, which
tests/conftest.py turns on); its ``llmkernels`` commands parse, and the cheap ones run; every
figure of its table names a date."""
import inspect
import os
import re
import subprocess
import sys

import pytest

import llmkernels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()
CI = open(os.path.join(ROOT, ".ci", "run")).read()
PYTHON_BLOCKS = [b.strip() for b in re.findall(r"```python\n(.*?)```", README, re.S)]
QUICKSTART = open(os.path.join(ROOT, "examples", "quickstart.py")).read().split('"""', 2)[2].strip()
# The commands of the README's bash blocks, without their comments.
COMMANDS = [line.split("  #")[0].strip() for block in re.findall(r"```bash\n(.*?)```", README, re.S)
            for line in block.replace("\\\n", " ").splitlines() if line.strip()]
CLI_LINES = [c.split()[1:] for c in COMMANDS if c.startswith("llmkernels")]
CHEAP = (["--help"], ["env"], ["--version"])  # answered in seconds; the rest run for minutes


def _run(args, **kwargs):
    env = {**os.environ, "PYTHONPATH": ROOT}  # this checkout's llmkernels, whatever is installed
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=600, **kwargs)


def api_calls():
    """``(function name, [argument names and "*" as written])`` of every call in the API table."""
    table = README.split("## API", 1)[1].split("\n\n", 2)[1]
    calls = []
    for name, args in re.findall(r"`(\w+)\(([^`]*)\)`", table):
        names = [re.match(r"[\w*.]+", a.strip()).group() for a in re.split(r",(?![^\"]*\"\\?\|)", args) if a.strip()]
        calls.append((name, names))
    return calls


def test_api_table_shows_keyword_only_arguments_after_a_star():
    calls = api_calls()
    assert len(calls) >= 12, calls
    for name, written in calls:
        fn = getattr(llmkernels, name, None) or getattr(llmkernels.RMSNorm, name)  # or a classmethod
        params = inspect.signature(fn).parameters.values()
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        keyword = {p.name for p in params if p.kind == p.KEYWORD_ONLY}
        star = written.index("*") if "*" in written else len(written)
        before = [a for a in written[:star] if a != "..."]
        after = [a for a in written[star + 1:] if a != "..."]
        assert before == positional[:len(before)], f"{name}: {before} are not its first positional arguments"
        assert set(after) <= keyword, f"{name}: {set(after) - keyword} are not keyword-only"


def test_ci_runs_the_readme_install_and_test_commands_in_order():
    """CI runs the README's commands verbatim, in the README's order; where the README's CPU torch
    command cannot reach PyTorch's index, CI installs the same pinned version with plain pip."""
    install = [c for c in COMMANDS if c.startswith(("pip install", "python -m pytest"))]
    torch_line, *rest = install
    assert re.fullmatch(r"pip install torch==[\d.]+ --index-url https://download\.pytorch\.org/whl/cpu", torch_line)
    assert rest == ['pip install -e ".[test]"', "python -m pytest tests", "python -m pytest tests -m slow"], rest
    assert all(f"\n{c}\n" in CI for c in rest)
    positions = [CI.index(c) for c in install]
    assert positions == sorted(positions), "CI runs the README's commands in another order"
    pin = torch_line.split()[2]
    fallback = CI[CI.index("else", positions[0]):positions[1]]
    assert f"python -m pip install {pin}\n" in fallback, "CI's fallback installs another torch than the README's"
    assert fallback.count("echo") >= 1 and "echo" in CI[positions[0]:CI.index("else", positions[0])]


def test_readme_quick_start_is_the_example():
    """examples/quickstart.py is the README's quick start (tests/test_examples.py runs it)."""
    assert QUICKSTART in PYTHON_BLOCKS, "README's quick start differs from examples/quickstart.py"


@pytest.mark.parametrize("block", [b for b in PYTHON_BLOCKS if b != QUICKSTART],
                         ids=lambda b: re.sub(r"\W+", "-", re.search(r"^\w.*\(", b, re.M).group()))
def test_readme_python_block_runs(block):
    proc = _run([sys.executable, "-c", block], cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr


def test_readme_commands_parse():
    """Each ``llmkernels`` command the README shows is one its command line accepts."""
    from llmkernels import fuzz, tune
    from llmkernels.bench import _parser as bench_parser, ops

    parsers = {"bench": lambda: bench_parser(ops()), "tune": tune._parser, "fuzz": fuzz._parser}
    shown = {args[0] for args in CLI_LINES}
    assert {"env", "bench", "tune", "fuzz", "scaling"} <= shown, shown
    for args in CLI_LINES:
        if args[0] in parsers and "--help" not in args:
            parsers[args[0]]().parse_args(args[1:])


@pytest.mark.parametrize("args", [a for a in CLI_LINES if a in CHEAP or a[-1:] == ["--help"]], ids=" ".join)
def test_readme_cheap_commands_run(args):
    proc = _run([sys.executable, "-m", "llmkernels.cli", *args], cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() and "Traceback" not in proc.stderr and "Warning" not in proc.stderr


def test_every_figure_names_its_date_and_results_are_linked():
    table = README.split("## What you get", 1)[1].split("\n\n")[2]
    rows = [r for r in table.splitlines()[2:] if r.startswith("|")]
    assert len(rows) >= 6
    for row in rows:
        assert re.search(r"\| 20\d\d-\d\d-\d\d \|", row), f"no date: {row}"
    assert "NVIDIA H100 80GB HBM3" in README.split("## What you get", 1)[1].split("|", 1)[0]
    assert "(benchmarks/RESULTS.md)" in README and os.path.exists(os.path.join(ROOT, "benchmarks", "RESULTS.md"))
    results = open(os.path.join(ROOT, "benchmarks", "RESULTS.md")).read()
    for anchor in re.findall(r"benchmarks/RESULTS\.md#([\w-]+)", README):
        titles = [re.sub(r"[^\w\- ]", "", t).strip().lower().replace(" ", "-")
                  for t in re.findall(r"^#+ (.*)$", results, re.M)]
        assert anchor in titles, f"README links RESULTS.md#{anchor}, which has no such section"
