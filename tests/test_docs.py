"""ARCHITECTURE.md and CONTRIBUTING.md hold what they name: every file and folder, every
``path.py:Name`` (defined in that file), every command (its script exists and answers ``--help``,
its test files exist), and the worked example's size."""
import ast
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ("ARCHITECTURE.md", "CONTRIBUTING.md")
TOP = ("llmkernels/", "tests/", "benchmarks/", ".ci/")


def _read(name: str) -> str:
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


def _spans(doc: str) -> list:
    """The text of every inline code span and every line of every fenced block."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", doc, re.S)
    inline = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", doc, flags=re.S))
    return inline + [line for block in blocks for line in block.splitlines()]


def _defined(path: str) -> set:
    """Every name a module defines: functions, classes, methods as ``Class.method``, assignments."""
    names = set()
    for node in ast.walk(ast.parse(_read(path))):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                names |= {f"{node.name}.{n.name}" for n in node.body if isinstance(n, ast.FunctionDef)}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets for t in ast.walk(t) if isinstance(t, ast.Name)}
    return names


@pytest.mark.parametrize("doc", DOCS)
def test_named_paths_exist(doc):
    spans = _spans(_read(doc))
    paths = {re.split(r"[:\s]", s)[0] for s in spans if s.startswith(TOP)}
    paths |= {m for s in spans for m in re.findall(r"(?:^|\s)((?:llmkernels|tests|benchmarks)/[\w/.<>-]+)", s)}
    missing = sorted(p for p in paths if "<" not in p and not os.path.exists(os.path.join(ROOT, p.rstrip("/"))))
    assert not missing, f"{doc} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS)
def test_named_definitions_exist(doc):
    refs = set(re.findall(r"((?:llmkernels|tests|benchmarks)/[\w/]+\.py):([\w.]+)", _read(doc)))
    assert refs, f"{doc} names no definition"
    missing = sorted(f"{path}:{name}" for path, name in refs if name not in _defined(path))
    assert not missing, f"{doc} names definitions that do not exist: {missing}"


def _commands(doc: str) -> list:
    """The commands a reader would type: ``python ...``, ``llmkernels ...``, ``bash ...`` spans."""
    out = []
    for span in _spans(doc):
        span = re.sub(r"^(?:[A-Z_]+=\S+\s+)+", "", span.split("  #")[0].strip())  # environment assignments
        if re.match(r"(python|llmkernels|bash) ", span) and "<" not in span:
            out.append(shlex.split(span))
    return out


@pytest.mark.parametrize("doc", DOCS)
def test_commands_exist(doc):
    """Test files of a pytest command exist; a script or ``llmkernels`` command answers --help;
    a shell script parses."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    for argv in map(list, dict.fromkeys(map(tuple, _commands(_read(doc))))):
        if argv[:3] == ["python", "-m", "pytest"]:
            files = [a for a in argv[3:] if a.startswith("tests")]
            assert files and all(os.path.exists(os.path.join(ROOT, f)) for f in files), argv
            continue
        if argv[0] == "bash":
            assert subprocess.run(["bash", "-n", os.path.join(ROOT, argv[1])]).returncode == 0, argv
            continue
        if argv[0] == "llmkernels":
            run = [sys.executable, "-m", "llmkernels.cli", *argv[1:2]] if len(argv) > 1 else None
        elif argv[1] == "-m":
            run = [sys.executable, "-m", argv[2]]
        else:
            run = [sys.executable, os.path.join(ROOT, argv[1])]
        if run is None:
            continue
        done = subprocess.run([*run, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (argv, done.stderr[-2000:])


def test_worked_example_is_as_small_as_said():
    """The z-loss of "Add a loss": its module, its reference and its test in the lines the
    document gives."""
    said = int(re.search(r"(\d+) lines in 3 files", _read("ARCHITECTURE.md")).group(1))
    reference = _read("llmkernels/reference.py")
    start = reference.index("def linear_z_loss(")
    function = reference[start:reference.index("\n\n\n", start)]
    lines = function.count("\n") + 1 + 2  # (and the two blank lines before the next definition)
    for path in ("llmkernels/ops/losses/z_loss.py", "tests/test_z_loss.py"):
        lines += _read(path).count("\n")
    assert lines <= said <= 80, lines
