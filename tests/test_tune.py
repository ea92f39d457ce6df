"""``llmkernels tune --tiny`` on CPU through the interpreter: every task's candidates checked
against the float64 reference, the cache written after each task, a second run resuming with
nothing left, a budget stopping between tasks, and the written cache read back as the device's
configurations."""
import dataclasses
import json

import pytest
import torch

from llmkernels import cli
from llmkernels.tune import FAMILIES, spaces
from llmkernels.ops import _device
from llmkernels.ops.configs import cross_entropy as ce
from llmkernels.ops.configs import qk_norm_rope as qk
from llmkernels.ops.norm import NormKey, backward_config, forward_config
from llmkernels.ops.norm.configs import CONFIGS
from llmkernels.ops.norm.tables import tuned_name
from tests.conftest import INTERPRETED

H200_MODEL = dataclasses.replace(_device.REFERENCE, name="NVIDIA H200", copy_gbps=4130.0)

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="--tiny is the CPU check; the GPU runs the real search")


def _tune(tmp_path, *args):
    out = tmp_path / "cache.json"
    assert cli.main(["tune", "--tiny", "--out", str(out), *args]) == 0
    return out, json.loads(out.read_text())


def test_tiny_tune_writes_checked_configs_and_resumes(tmp_path, capsys):
    out, state = _tune(tmp_path, "--ops", "norm,ce", "--widths", "1000", "--norm-ops", "rmsnorm")
    assert state["device"] == _device.INTERPRETER.name and state["format"] == _device.FORMAT
    assert {"triton", "llmkernels", "torch", "copy_gbps", "command", "date"} <= set(state)
    key = NormKey(True, torch.bfloat16, False, 1000, 5)
    assert set(state["entries"]) == {tuned_name(key, "fwd"), tuned_name(key, "bwd"), ce.tuned_name(9000)}
    for name, search in state["searches"].items():
        assert search["candidates"][0] == search["heuristic"], name
        for tried in search["candidates"]:
            assert "failed" in tried or tried["rel_err"] <= 2e-2, (name, tried)
    assert sorted(state["entries"][ce.tuned_name(9000)]["parts"]) == ["forward", "split_inplace"]
    text = capsys.readouterr().out
    assert "[1/4]" in text and "done: 3 keys" in text
    # resumed: nothing searched again
    _tune(tmp_path, "--ops", "norm,ce", "--widths", "1000", "--norm-ops", "rmsnorm")
    assert "0 of 4 tasks to search" in capsys.readouterr().out
    # the written cache gives the device its configurations
    tuned = _device.read_cache(str(out))
    assert tuned.path == str(out)
    for direction, choose in (("fwd", forward_config), ("bwd", backward_config)):
        chosen = _device.from_record(state["searches"][tuned_name(key, direction)]["chosen"], CONFIGS)
        assert choose(key._replace(sms=4, m=4096), tuned) == chosen
    assert isinstance(tuned.config(ce.tuned_name(9000), ce.RECORDS), ce.CrossEntropyConfig)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_runs_a_candidate(family, tmp_path):
    """Each tuned family's search calls its launcher the way the GPU search does: one candidate
    (the heuristic) at the tiny size must pass its float64 check."""
    _, state = _tune(tmp_path, "--ops", family, "--widths", "256", "--norm-ops", "rmsnorm", "--limit", "1")
    assert state["searches"]
    for name, search in state["searches"].items():
        assert [tried.get("failed") for tried in search["candidates"]] == [None], name


def test_qk_norm_rope_choices_are_read_back(tmp_path):
    """The QK-norm + RoPE search writes one key a direction, whose record the op's rule reader
    takes back as its tiles."""
    out, state = _tune(tmp_path, "--ops", "qk_norm_rope")
    tuned = _device.read_cache(str(out))
    for direction in qk.DIRECTIONS:
        name = qk.tuned_name(direction, 64, 3, 2)
        assert state["searches"][name]["mode"] == direction
        chosen = _device.from_record(state["entries"][name]["config"], qk.RECORDS)
        assert tuned.config(name, qk.RECORDS) == chosen
        assert chosen.resolve(3, 2, 64).num_warps == chosen.num_warps


def test_budget_stops_between_tasks(tmp_path, capsys):
    """A budget spent after the first task leaves the rest for the next run."""
    _, state = _tune(tmp_path, "--ops", "rope,norm", "--widths", "256", "--norm-ops", "layernorm",
                     "--budget", "0.001")
    assert len(state["searches"]) == 1
    assert "tasks left; run the same command again" in capsys.readouterr().out


def test_unknown_family_and_no_gpu(capsys):
    assert cli.main(["tune", "--tiny", "--ops", "nope"]) == 2 and "unknown --ops" in capsys.readouterr().err
    assert cli.main(["tune"]) == 2 and "needs a CUDA GPU" in capsys.readouterr().err


def test_env_names_the_configuration_source(capsys):
    assert cli.main(["env"]) == 0
    assert "configs       heuristic" in capsys.readouterr().out


@pytest.mark.parametrize("width", [32768, 65536])
@pytest.mark.parametrize("tma", [True, False])
def test_wide_forward_tries_the_tma_read_early_where_it_runs(tma, width):
    """At wide rows the split forward's pipelined twin and its TMA read come right after the
    heuristic, so that a search cut short by ``--limit 4`` still tries them, also where the
    heuristic reads the row in one pass (32768 on the reference model); the TMA read only where it
    can run (``tma``)."""
    tasks = spaces.norm_tasks(_device.REFERENCE, (width,), ("rmsnorm",), limit=4, tma=tma)
    (forward,) = [task for task in tasks if task.mode == "fwd"]
    reads = [getattr(config, "tma", False) for config in forward.candidates]
    assert any(reads) == tma
    assert not tma or reads.index(True) <= 2
    # an H200, whose table already reads through TMA: the plain pipelined read is still a rival
    (deep,) = [task for task in spaces.norm_tasks(H200_MODEL, (width,), ("rmsnorm",), limit=4, tma=True)
               if task.mode == "fwd"]
    assert deep.heuristic.tma and [c.tma for c in deep.candidates[:2]] == [True, False]
    assert deep.candidates[1] == dataclasses.replace(deep.heuristic, tma=False)
