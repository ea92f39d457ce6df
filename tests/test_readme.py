"""The README says what the code does: its API table shows each function's arguments as they are
passed (positional ones in order, keyword-only ones after ``*``), and its commands are the ones
CI runs."""
import inspect
import os
import re

import llmkernels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()


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


def test_ci_runs_the_readme_test_commands():
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    commands = re.findall(r"^(python -m pytest tests.*?)\s*(?:#.*)?$", README, re.M)
    assert commands == ["python -m pytest tests", "python -m pytest tests -m slow"], commands
    assert all(f"\n{c}\n" in ci for c in commands)
    assert "pip wheel --no-deps ." in README
