"""The device model every family's launch choice reads, and the tuned configurations.

``device_model(device)``: the multiprocessors, registers, shared memory and L2 of a GPU, and its
device-to-device copy bandwidth: measured by ``llmkernels tune`` (kept in the tuned cache), else
estimated from the memory clock and bus width. From it follows ``depth``: how many times the
loads in flight per multiprocessor of the device the tables were measured on (``REFERENCE``, an
H100) this device needs to reach its bandwidth (Little's law: bytes in flight = bandwidth x
latency, per multiprocessor). The families' rules scale their bytes-in-flight knobs (pipeline
stages, programs a multiprocessor) by it, so a device at the H100's bandwidth per multiprocessor
gets exactly the H100's configurations.

``tuned(device)``: the configurations ``llmkernels tune`` measured best on this device, read once
per device from the user's cache (``$LLMKERNELS_CACHE_DIR``, else ``$XDG_CACHE_HOME/llmkernels``
or ``~/.cache/llmkernels``; one file per device name, Triton and llmkernels version), else from
the caches shipped for the GPUs we measured (``llmkernels/ops/tuned/``). ``LLMKERNELS_TUNED=0`` hides both: the derived
heuristic alone, as on an unknown GPU. A family looks its key up when it makes a launch plan,
never on a call.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import warnings
from typing import Optional

import torch

from ._triton import triton

FORMAT = 1  # the tuned cache's layout; a file of another is ignored
CACHE_DIR_VARIABLE = "LLMKERNELS_CACHE_DIR"  # moves the user's tuned caches (a shared disk, a read-only home)
SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned")
# Loaded DRAM latency assumed for Little's law (ns): only the ratio of two devices' needs is
# used for choices, so its value scales the reported bytes in flight, not a configuration.
LATENCY_NS = 800
# Fraction of the clocks' peak that a device-to-device copy reaches (H100 SXM: 2950-3020 of
# 3352 GB/s; H200: about 4130 of 4800), for a device whose copy was not measured.
COPY_EFFICIENCY = 0.88
# A device needs more loads in flight than the reference only past this ratio of bandwidth per
# multiprocessor: the H100's own run-to-run spread of the copy stays well inside it.
DEPTH_STEP = 1.2
MAX_DEPTH = 4


@dataclasses.dataclass(frozen=True)
class DeviceModel:
    """What a launch choice needs to know of a device."""

    name: str
    sms: int
    registers_per_sm: int
    shared_memory_per_sm: int  # bytes a program may use (the opt-in maximum)
    l2_bytes: int
    copy_gbps: float  # device-to-device copy, bytes read + written
    copy_source: str = "measured"  # measured (llmkernels tune), clocks (estimated) or assumed

    @property
    def gbps_per_sm(self) -> float:
        return self.copy_gbps / self.sms

    @property
    def in_flight_per_sm(self) -> int:
        """Bytes a multiprocessor must keep loading at once to reach the copy bandwidth (GB/s
        are bytes a ns)."""
        return round(self.gbps_per_sm * LATENCY_NS)

    @property
    def depth(self) -> int:
        """The power of two (1 to MAX_DEPTH) of the reference's loads in flight per
        multiprocessor that this device needs: 1 up to DEPTH_STEP times its bandwidth per
        multiprocessor, 2 up to twice that, ..."""
        ratio = self.gbps_per_sm / REFERENCE.gbps_per_sm
        return min(MAX_DEPTH, 1 << max(0, math.ceil(math.log2(ratio / DEPTH_STEP))))


# The device the tables were measured on (benchmarks/results/): an H100 SXM at its measured copy.
REFERENCE = DeviceModel("NVIDIA H100 80GB HBM3", sms=132, registers_per_sm=65536, shared_memory_per_sm=232448,
                        l2_bytes=50 * 2**20, copy_gbps=3000.0)
# Triton's interpreter runs a handful of programs (``persistent_programs``) at the
# reference's bandwidth each, so CPU tests take the reference's choices.
INTERPRETER = dataclasses.replace(REFERENCE, name="cpu (Triton interpreter)", sms=4,
                                  copy_gbps=REFERENCE.gbps_per_sm * 4, copy_source="assumed")


def more_programs(config, depth: int, slice_field: str, min_slice: int, max_per_sm: int):
    """A split configuration (fields ``per_sm``, ``num_warps`` and its slice ``slice_field``) with
    ``depth`` times the programs a multiprocessor, each of half the slice and half the warps for
    each doubling (the same registers a multiprocessor), so that one program's loads overlap
    another's exchange and stores; within ``max_per_sm`` programs and slices of ``min_slice``."""
    while (depth > 1 and config.per_sm < max_per_sm and getattr(config, slice_field) > min_slice
           and config.num_warps > 1):
        config = dataclasses.replace(config, **{slice_field: getattr(config, slice_field) // 2},
                                     num_warps=config.num_warps // 2, per_sm=config.per_sm * 2)
        depth //= 2
    return config


def slug(name: str) -> str:
    """A device name as a file name: ``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


# --------------------------------------------------------------------------------------------
# the device of a tensor, and its properties: the one place they are read
# --------------------------------------------------------------------------------------------
def device_index(device: torch.device) -> int:
    """The CUDA index of ``device`` (its own, or the current device's); -1 for the CPU."""
    if device.type != "cuda":
        return -1
    return device.index if device.index is not None else torch.cuda.current_device()


def device_of(index: int) -> torch.device:
    """The device of ``Tensor.get_device()``'s ``index`` (-1: the CPU, under the interpreter), for
    plans keyed on the index."""
    return torch.device("cpu") if index < 0 else torch.device("cuda", index)


@functools.lru_cache(maxsize=None)
def properties(index: int):
    """``torch.cuda.get_device_properties(index)``, read once."""
    return torch.cuda.get_device_properties(index)


def has_tma(index: int) -> bool:
    """Whether device ``index`` copies through TMA: Hopper or newer (or Triton's interpreter, -1)."""
    return index < 0 or properties(index).major >= 9


def clock_gbps(index: int) -> Optional[float]:
    """Peak DRAM bandwidth of CUDA device ``index`` from its memory clock (kHz, double data rate)
    and bus width (bits); None where torch reports neither."""
    props = properties(index)
    clock, bus = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    return 2 * clock * 1e3 * bus / 8 / 1e9 if clock and bus else None


@functools.lru_cache(maxsize=None)
def device_model(index: int) -> DeviceModel:
    """The model of CUDA device ``index`` (-1: the interpreter's), made once: its properties,
    and its copy bandwidth from the tuned cache, else its clocks, else the reference's per
    multiprocessor."""
    if index < 0:
        return INTERPRETER
    props = properties(index)
    sms = props.multi_processor_count
    copy, source = tuned(index).copy_gbps, "measured"
    if copy is None:
        peak = clock_gbps(index)
        copy, source = (COPY_EFFICIENCY * peak, "clocks") if peak else (REFERENCE.gbps_per_sm * sms, "assumed")
    return DeviceModel(props.name, sms, getattr(props, "regs_per_multiprocessor", 0) or REFERENCE.registers_per_sm,
                       getattr(props, "shared_memory_per_block_optin", 0) or REFERENCE.shared_memory_per_sm,
                       getattr(props, "L2_cache_size", 0) or REFERENCE.l2_bytes, float(copy), source)


def model_of(device: torch.device) -> DeviceModel:
    return device_model(device_index(device))


def persistent_programs(device: torch.device, per_sm: int) -> int:
    """How many programs a persistent grid should launch: ``per_sm`` per multiprocessor on a
    GPU; a handful under the interpreter, where every program runs in turn on the CPU."""
    if device.type != "cuda":
        return 4
    return model_of(device).sms * per_sm


def fit_stages(stages: int, stage_bytes: int, device: torch.device) -> int:
    """``stages`` of Triton's software pipelining (< 2: none) for a loop that keeps ``stage_bytes``
    of loads in flight per stage, lowered until its ``stages - 1`` shared-memory buffers fit a
    program beside its reductions' scratch; 0 (no pipelining) when not even one fits."""
    if stages < 2 or device.type != "cuda":
        return stages
    fit = 1 + (model_of(device).shared_memory_per_sm - 8192) // stage_bytes
    return min(stages, fit) if fit >= 2 else 0


# --------------------------------------------------------------------------------------------
# configurations as JSON records
# --------------------------------------------------------------------------------------------
def as_record(config) -> dict:
    """A frozen configuration as JSON: its type's name and its fields (records within records
    too)."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return {"type": type(config).__name__,
            **{k: as_record(v) if dataclasses.is_dataclass(v) else list(v) if isinstance(v, tuple) else v
               for k, v in fields.items()}}


def from_record(record: dict, types):
    """The configuration of ``record`` (``as_record``'s), one of ``types`` (classes, or records
    within them); ValueError where it names another type or other fields."""
    by_name = {t.__name__: t for t in types}
    kind = by_name.get(record.get("type"))
    if kind is None:
        raise ValueError(f"a {record.get('type')!r} record is none of {sorted(by_name)}")
    fields = {f.name: f for f in dataclasses.fields(kind)}
    values = {}
    for name, value in record.items():
        if name == "type":
            continue
        if name not in fields:
            raise ValueError(f"{kind.__name__} has no field {name!r}")
        values[name] = (from_record(value, types) if isinstance(value, dict) else
                        tuple(value) if isinstance(value, list) else value)
    return kind(**values)


# --------------------------------------------------------------------------------------------
# the tuned cache
# --------------------------------------------------------------------------------------------
def cache_dir() -> str:
    """Where ``llmkernels tune`` writes and llmkernels reads: ``$LLMKERNELS_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/llmkernels``, else ``~/.cache/llmkernels``."""
    if os.environ.get(CACHE_DIR_VARIABLE):
        return os.environ[CACHE_DIR_VARIABLE]
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "llmkernels")


def versions() -> dict:
    from .. import __version__

    return {"triton": getattr(triton, "__version__", None), "llmkernels": __version__}


def user_cache_path(name: str) -> str:
    """The user's cache file of device ``name`` for this Triton and llmkernels."""
    v = versions()
    return os.path.join(cache_dir(), f"{slug(name)}-triton{v['triton']}-llmkernels{v['llmkernels']}.json")


def shipped_cache_path(name: str) -> str:
    return os.path.join(SHIPPED, f"{slug(name)}.json")


def tuned_caches_off() -> bool:
    """``LLMKERNELS_TUNED=0``: no tuned cache is read (the derived heuristic alone)."""
    return os.environ.get("LLMKERNELS_TUNED", "1") == "0"


@dataclasses.dataclass(frozen=True)
class Tuned:
    """The tuned configurations of one device: ``entries`` by key (``<family>/...``, each a
    record with the configuration under ``config``), from ``path`` (None: none was found)."""

    path: Optional[str] = None
    entries: dict = dataclasses.field(default_factory=dict)
    copy_gbps: Optional[float] = None

    @property
    def source(self) -> str:
        return self.path or "heuristic"

    def config(self, key: str, types):
        """The tuned configuration of ``key`` (one of ``types``), or None: also, with a warning
        naming the file, for an entry that is not such a record (a hand-edited or foreign cache
        must not stop a training run; the heuristic takes over)."""
        entry = self.entries.get(key)
        if entry is None:
            return None
        try:
            return from_record(entry["config"], types)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            warnings.warn(f"llmkernels: ignoring the tuned entry {key!r} of {self.path}: {type(e).__name__}: {e}",
                          RuntimeWarning, stacklevel=2)
            return None


NONE = Tuned()


def read_cache(path: str) -> Tuned:
    """The cache at ``path``; ``NONE`` where it is missing, not JSON, or of another format or shape."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return NONE
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries", {}), dict):
        return NONE
    return Tuned(path, dict(data.get("entries", {})), data.get("copy_gbps"))


def load(name: str) -> Tuned:
    """The tuned cache of device ``name``: the user's for this Triton and llmkernels, else the
    shipped one, else ``NONE`` (also when ``tuned_caches_off()``)."""
    if tuned_caches_off():
        return NONE
    for path in (user_cache_path(name), shipped_cache_path(name)):
        found = read_cache(path)
        if found.path is not None:
            return found
    return NONE


@functools.lru_cache(maxsize=None)
def tuned(index: int) -> Tuned:
    """The tuned cache of CUDA device ``index``, read once (-1, the interpreter: none)."""
    return NONE if index < 0 else load(properties(index).name)


def tuned_of(device: torch.device) -> Tuned:
    return tuned(device_index(device))


def forget() -> None:
    """Read the device models and caches again at their next use (after ``llmkernels tune``
    wrote one); launch plans made before keep what they chose."""
    device_model.cache_clear()
    tuned.cache_clear()


@contextlib.contextmanager
def heuristic_only():
    """Meanwhile no tuned cache is read and the device models take no measured copy (the
    derived heuristic alone, as on an unknown GPU); every launch plan is dropped on entry and on
    exit, so that none made under one source serves the other."""
    from . import _launch

    saved = os.environ.get("LLMKERNELS_TUNED")
    os.environ["LLMKERNELS_TUNED"] = "0"
    forget()
    _launch.clear_plans()
    try:
        yield
    finally:
        if saved is None:
            del os.environ["LLMKERNELS_TUNED"]
        else:
            os.environ["LLMKERNELS_TUNED"] = saved
        forget()
        _launch.clear_plans()
