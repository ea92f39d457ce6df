"""The device model and the tuned cache: an H100-like device takes today's tables exactly, a device
with more bandwidth a multiprocessor gets deeper (still launchable) configurations, and a tuned
cache is read once, keyed by device and versions, hidden by LLMKERNELS_TUNED=0, and used for the
sizes it was measured at."""
import dataclasses
import hashlib
import itertools
import json
import os

import pytest
import torch

import llmkernels as lk
from llmkernels import reference
from llmkernels.ops import _device
from llmkernels.ops.norm import (BACKWARD, FORWARD, FWD_PLANS, BwdConfig, FwdConfig, NormKey, SplitBwdConfig,
                                 SplitFwdConfig, backward_config, forward_config)
from llmkernels.ops.norm import tables
from llmkernels.ops.norm.tables import tuned_name
from tests.helpers import assert_close
from tests.test_norm import WIDEST_TESTED, _launchable

H100 = _device.REFERENCE
H200 = dataclasses.replace(H100, name="NVIDIA H200", copy_gbps=4130.0)
# The digest of every norm configuration the tables chose before the device model (commit
# 1b6d940) over the widths the coverage test resolves (every rule edge and every 257th width up
# to 262144), each kind, dtype, residual add, row count, SM count and split.
TODAYS_TABLES = "897b58e8dcd1e48473127fa0345ae1d16414a4e9ab3bab64519237cdd25f9bd9"


def _widths() -> list:
    edges = {v for table in (FORWARD, BACKWARD) for e in table.entries for w in e.widths for v in (w - 1, w, w + 1)}
    edges |= {v for p in range(4, 19) for v in (2**p - 1, 2**p, 2**p + 1)}
    return sorted(n for n in edges | set(range(1, WIDEST_TESTED + 1, 257)) if 1 <= n <= WIDEST_TESTED)


def _keys(depth: int):
    for is_rms, dtype, residual, n, m, sms, split in itertools.product(
            (True, False), (torch.float32, torch.bfloat16, torch.float16), (False, True), _widths(), (1, 200, 4096),
            (0, 132), (True, False)):
        yield NormKey(is_rms, dtype, residual, n, m, sms, split, depth)


@pytest.mark.parametrize("copy_gbps", [2950.0, 3000.0, 3020.0, _device.COPY_EFFICIENCY * 3352.0])
def test_h100_like_device_takes_todays_tables(copy_gbps):
    """An H100 at any copy it measures (or its clocks' estimate) has depth 1, and the selection at
    its depth is, key for key, what the tables chose before the device model."""
    model = dataclasses.replace(H100, copy_gbps=copy_gbps)
    assert model.depth == 1
    digest = hashlib.sha256()
    for key in _keys(model.depth):
        digest.update(repr((key.is_rms, str(key.dtype), *key[2:7], _as_then(forward_config(key)),
                            _as_then(backward_config(key)))).encode())
    assert digest.hexdigest() == TODAYS_TABLES


def _as_then(config):
    """A configuration as 1b6d940 wrote it: the forward split's later fields (``stages``: a
    pipelined forward, ``tma``, ``lag``: none of which existed then) must be at their defaults,
    and are left out."""
    if isinstance(config, SplitFwdConfig):
        assert (config.stages, config.tma, config.lag) == (0, False, 1), config
        return _Written(repr(config).replace(", stages=0, tma=False, lag=1)", ")"))
    return config


class _Written(str):
    """Text that a tuple's repr writes as it is (no quotes)."""

    __repr__ = str.__str__


def test_depth_follows_bandwidth_per_multiprocessor():
    """Depth doubles past each DEPTH_STEP of the H100's bandwidth a multiprocessor: the H200 and
    a B200 need twice its loads in flight; an A100 or a consumer card no more than it."""
    assert H200.depth == 2
    assert dataclasses.replace(H100, sms=148, copy_gbps=7000.0).depth == 2  # B200
    assert dataclasses.replace(H100, sms=108, copy_gbps=1700.0).depth == 1  # A100
    assert dataclasses.replace(H100, sms=128, copy_gbps=900.0).depth == 1  # a consumer card
    assert dataclasses.replace(H100, copy_gbps=30000.0).depth == _device.MAX_DEPTH
    assert H200.in_flight_per_sm > H100.in_flight_per_sm > 0


def test_deeper_device_gets_deeper_launchable_configs():
    """At depth 2 every configuration stays launchable and differs from the H100's only in its
    bytes-in-flight knobs: pipelining stages, or split programs a multiprocessor (twice as many of
    half the slice); the wide rows' split and pipelined backward do get deeper. 2-byte RMSNorm
    rows without a residual take the H200's tuned forward instead: from 16385 columns on (32768
    included) split, pipelined, read through TMA; from 1024 to 8192 columns half the rows a
    program, 16 elements a thread. LayerNorm's 32768-column rows split as well."""
    changed = set()
    for key in _keys(H200.depth):
        for make in (forward_config, backward_config):
            deep, base = make(key), make(key._replace(depth=1))
            assert _launchable(deep, key.n), (key, deep)
            entry = tables.FORWARD.entry(key) if make is forward_config else None
            if entry is not None and tables.deep_device in entry.when:
                continue  # a deep device's own row: checked below
            if deep != base:
                changed.add(type(deep))
                if isinstance(deep, SplitFwdConfig):
                    assert deep.per_sm == 2 * base.per_sm and deep.block_n * 2 == base.block_n
                else:
                    assert dataclasses.replace(deep, **{f: getattr(base, f) for f in ("prefetch", "stages")
                                                        if hasattr(base, f)}) == base
                    assert getattr(deep, "prefetch", 0) + getattr(deep, "stages", 0) > (
                        getattr(base, "prefetch", 0) + getattr(base, "stages", 0))
    assert changed == {SplitFwdConfig, SplitBwdConfig, BwdConfig}
    wide = NormKey(True, torch.bfloat16, False, 131072, 1024, 132, True, H200.depth)
    assert forward_config(wide) == SplitFwdConfig(4096, 4, 4, stages=3, tma=True) and backward_config(wide).stages == 4
    assert forward_config(wide._replace(n=32768)) == forward_config(wide)  # split, not the H100's one pass
    assert forward_config(wide._replace(n=32768, is_rms=False)) == SplitFwdConfig(4096, 4, 4)  # LayerNorm: plainly
    for other in (wide._replace(residual=True), wide._replace(is_rms=False), wide._replace(dtype=torch.float32),
                  wide._replace(split=False), wide._replace(n=16384)):
        assert not getattr(forward_config(other), "tma", False), other
    # 2-byte RMSNorm rows of 1024-8192: half the rows a program, 16 elements a thread (the tune's best)
    rows = wide._replace(m=65536)
    assert [forward_config(rows._replace(n=n)) for n in (1024, 2304, 4096, 8192)] == [
        FwdConfig(4, 1024, 8), FwdConfig(1, 4096, 8), FwdConfig(1, 4096, 8), FwdConfig(1, 8192, 16)]
    assert forward_config(rows._replace(n=5120)).tail_n == 1024  # a ragged row keeps its tail
    assert forward_config(rows._replace(n=1024, residual=True)) == forward_config(rows._replace(n=1024, residual=True,
                                                                                                depth=1))


def test_rope_keeps_its_step_on_a_deep_device(monkeypatch):
    """RoPE's rule is the H100's on every device without a tuned entry (a larger step measured
    slower on the H200); the tune still tries the larger steps."""
    from llmkernels.ops.configs import rope
    from llmkernels.tune import spaces

    monkeypatch.setattr(_device, "model_of", lambda device: H200)
    monkeypatch.setattr(_device, "tuned_of", lambda device: _device.NONE)
    assert rope.rope_tiles(128, 32, 8, torch.device("cpu")) == rope.DEFAULT_TILES
    (task,) = spaces.rope_tasks()
    assert task.heuristic == rope.DEFAULT_TILES
    assert {rope.RopeTiles(2048, 4), rope.RopeTiles(4096, 4)} <= set(task.candidates)


def test_cross_entropy_keeps_a_one_slice_row_whole_on_a_deep_device():
    """A deep device's cross-entropy gets the deepened in-place split only where the H100's split
    already cuts the row (V above its slice): at V = 32000 the row stays in one program, as the
    H200's tune chose; the tune's task starts from the same heuristic."""
    from llmkernels.ops.configs import cross_entropy as ce
    from llmkernels.tune import spaces

    one_slice = ce.DEFAULT_CONFIG.split_inplace.block_v
    for v in (32000, one_slice):
        assert ce.derived_config(v, H200.depth) == ce.DEFAULT_CONFIG
    for v in (one_slice + 1, 128256, 262144):
        assert ce.derived_config(v, H200.depth) == ce.DEFAULT_CONFIG.deepened(H200.depth) != ce.DEFAULT_CONFIG
        assert ce.derived_config(v, 1) == ce.DEFAULT_CONFIG
    tasks = spaces.ce_tasks(H200, (32000, 128256), rows=8)
    assert [t.heuristic for t in tasks if t.part == "split_inplace"] == [
        ce.DEFAULT_CONFIG, ce.DEFAULT_CONFIG.deepened(H200.depth)]


def test_records_round_trip():
    """Every family's configuration survives the tuned cache's JSON."""
    from llmkernels.ops.configs import cross_entropy as ce

    for config, types in ((FwdConfig(2, 1024, 8, tail_n=256), (FwdConfig,)),
                          (SplitBwdConfig(8192, 8, 3, w_packed=True), (SplitBwdConfig,)),
                          (ce.DEFAULT_CONFIG.deepened(2), ce.RECORDS)):
        record = json.loads(json.dumps(_device.as_record(config)))
        assert _device.from_record(record, types) == config
    with pytest.raises(ValueError, match="none of"):
        _device.from_record({"type": "BwdConfig", "block_m": 1}, (FwdConfig,))
    with pytest.raises(ValueError, match="no field"):
        _device.from_record({"type": "FwdConfig", "warps": 1}, (FwdConfig,))


def _write(path, entries, copy_gbps=None, fmt=_device.FORMAT):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"format": fmt, "copy_gbps": copy_gbps, "entries": entries}, f)


def test_cache_paths_and_hiding(tmp_path, monkeypatch):
    """The user's cache (per device name, Triton and llmkernels version) comes first, then the
    shipped one; LLMKERNELS_TUNED=0 hides both; a file of another format is ignored."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(_device, "SHIPPED", str(tmp_path / "shipped"))
    name = "NVIDIA Test GPU"
    user, shipped = _device.user_cache_path(name), _device.shipped_cache_path(name)
    assert user.startswith(str(tmp_path / "cache" / "llmkernels")) and "nvidia-test-gpu-triton" in user
    assert _device.load(name) is _device.NONE and _device.NONE.source == "heuristic"
    _write(shipped, {"a": {}}, 4100.0)
    assert _device.load(name).path == shipped and _device.load(name).copy_gbps == 4100.0
    _write(user, {"b": {}})
    assert _device.load(name).path == user
    monkeypatch.setenv("LLMKERNELS_TUNED", "0")
    assert _device.load(name) is _device.NONE
    monkeypatch.delenv("LLMKERNELS_TUNED")
    _write(user, {"b": {}}, fmt=_device.FORMAT + 1)
    assert _device.load(name).path == shipped
    for text in ("[1, 2]", '{"format": %d, "entries": [1]}' % _device.FORMAT, "{not json"):
        with open(user, "w") as f:
            f.write(text)
        assert _device.load(name).path == shipped


@pytest.mark.parametrize("entry", [{"config": {"type": "NoSuchConfig"}}, {"config": {"type": "FwdConfig", "warps": 1}},
                                   {"config": {"type": "FwdConfig", "block_m": 1}}, {"no_config": 1}, {"config": 7}, 3])
def test_a_bad_tuned_entry_is_refused_for_the_heuristic(tmp_path, entry):
    """A cache file of the right format whose entry is no configuration record (another type, an
    unknown or missing field, no record at all) gives the tables' choice and a warning naming the
    file, as a missing entry would; the good entries of the same file are still used."""
    from llmkernels.ops.configs import cross_entropy as ce

    key = NormKey(True, torch.bfloat16, False, 8192, 16384, 132)
    path = str(tmp_path / "tuned.json")
    _write(path, {tuned_name(key, "fwd"): entry,
                  tuned_name(key, "bwd"): {"config": _device.as_record(SplitBwdConfig(4096, 8, 4))},
                  ce.tuned_name(9000): entry})
    tuned = _device.read_cache(path)
    with pytest.warns(RuntimeWarning, match="tuned.json"):
        assert forward_config(key, tuned) == forward_config(key)
    with pytest.warns(RuntimeWarning, match="ignoring the tuned entry"):
        assert tuned.config(ce.tuned_name(9000), ce.RECORDS) is None
    assert backward_config(key, tuned) == SplitBwdConfig(4096, 8, 4)


def test_tuned_norm_config_for_training_sizes_only():
    """A tuned entry replaces the tables' choice at training sizes of its key, not at decode sizes,
    not for another width or dtype, and a tuned split not where the row may not be split."""
    key = NormKey(True, torch.bfloat16, False, 8192, 16384, 132)
    tuned = _device.Tuned("test.json", {tuned_name(key, "fwd"): {"config": _device.as_record(FwdConfig(1, 8192, 16))},
                                        tuned_name(key, "bwd"): {"config": _device.as_record(SplitBwdConfig(4096, 8, 4))}})
    assert forward_config(key, tuned) == FwdConfig(1, 8192, 16)
    assert forward_config(key._replace(m=8), tuned) == forward_config(key._replace(m=8))
    assert forward_config(key._replace(n=8193), tuned) == forward_config(key._replace(n=8193))
    assert forward_config(key._replace(dtype=torch.float32), tuned) == forward_config(key._replace(dtype=torch.float32))
    assert backward_config(key, tuned) == SplitBwdConfig(4096, 8, 4)
    assert backward_config(key._replace(split=False), tuned) == backward_config(key._replace(split=False))


def test_launch_plan_takes_the_tuned_config(device, monkeypatch):
    """The norm's launch plan reads the device's tuned cache once, when it is made: a call at the
    tuned width runs the tuned configuration, and right."""
    n, m = 256, 300
    key = NormKey(True, torch.float32, False, n, m)
    chosen = FwdConfig(2, 256, 2)
    tuned = _device.Tuned("test.json", {tuned_name(key, "fwd"): {"config": _device.as_record(chosen)}})
    monkeypatch.setattr(_device, "tuned", lambda index: tuned)
    FWD_PLANS.clear()
    x, w = torch.randn(m, n, device=device), torch.randn(n, device=device)
    y = lk.rms_norm(x, w)
    assert_close(y, reference.rms_norm(x, w, compute_dtype=torch.float64), torch.float32, "y")
    (plan,) = FWD_PLANS.values()
    assert plan.launch.options["BLOCK_M"] == 2 and plan.launch.options["num_warps"] == 2
    FWD_PLANS.clear()
