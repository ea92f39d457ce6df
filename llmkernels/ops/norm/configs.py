"""Launch configurations of the norm kernels: what each kernel is launched with, as frozen records.

``FwdConfig`` (whole rows a program, or a row in column chunks), ``SplitFwdConfig`` (a row shared
by programs), ``BwdConfig`` and ``SplitBwdConfig``; ``NormConfig`` pairs a forward and a backward
one: the ``config=`` of an eager ``rms_norm`` / ``layer_norm`` call (the launchers take each
alone). Without one, the tables of ``tables.py`` choose. ``check_config`` says why a record cannot
launch a row (TypeError / ValueError naming ``config``).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Union

from .._device import more_programs

MAX_STAGES = 4  # pipelining stages at most (the kernels' loops are written for 2 to 4)
MAX_SPLIT_PER_SM = 4  # split programs a multiprocessor at most (each keeps 128 registers a thread or more)
MIN_SLICE = 4096  # the narrowest slice a split program takes when a device asks for more programs


def _power_of_two(v: int) -> bool:
    return v >= 1 and v & (v - 1) == 0


def _require(ok: bool, name: str, config, why: str) -> None:
    if not ok:
        raise ValueError(f"{name} {config}: {why}")


def _check_fields(config, name: str) -> None:
    """What every configuration must satisfy: each field of its type (an int is no bool), a
    power-of-two ``block_n`` and 1 to 32 warps, a power of two each."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if type(value).__name__ != field.type:
            raise TypeError(f"{name} {config}: {field.name} must be {field.type}, got {type(value).__name__}")
    _require(_power_of_two(config.block_n), name, config, "block_n must be a power of two")
    _require(_power_of_two(config.num_warps) and config.num_warps <= 32, name, config,
             "num_warps must be 1, 2, 4, 8, 16 or 32")


def deeper_stages(stages: int, depth: int) -> int:
    """Pipelining ``stages`` (< 2: none) with ``depth`` times the loads ahead (stages - 1 of
    them), at most MAX_STAGES."""
    return stages if stages < 2 else min(MAX_STAGES, 1 + (stages - 1) * depth)


def _check_tiles(config, n: int, name: str) -> None:
    """The rows kernels' tiles: power-of-two rows a tile; in one pass the whole row (with the tail
    past ``block_n`` only where the row is wider than ``block_n``)."""
    _check_fields(config, name)
    _require(_power_of_two(config.block_m), name, config, "block_m must be a power of two")
    _require(config.tail_n == 0 or _power_of_two(config.tail_n), name, config, "tail_n must be 0 or a power of two")
    if config.one_pass:
        _require(config.block_n + config.tail_n >= n, name, config, f"one pass holds no row of {n} columns")
    _require(not config.tail_n or (config.one_pass and config.block_n < n), name, config,
             f"a tail is for one pass over rows wider than block_n, not of {n} columns")


@dataclasses.dataclass(frozen=True)
class FwdConfig:
    """``norm_fwd_kernel``: ``block_m`` rows a program of ``block_n`` columns, the whole row in
    registers (``one_pass``) or a row in ``block_n``-column chunks read twice."""

    block_m: int
    block_n: int
    num_warps: int
    one_pass: bool = True
    early_w: bool = False  # the weight and bias loaded with the row, so that their latency overlaps its
    tail_n: int = 0  # one pass, rows wider than block_n: the rest of the row as a masked tile of tail_n

    def check(self, n: int, name: str = "config") -> None:
        """Raise TypeError / ValueError (naming ``name``) where this cannot launch rows of ``n``."""
        _check_tiles(self, n, name)

    def deepened(self, depth: int) -> "FwdConfig":
        """As it is: its loads are all issued before the row's reduction, as many as its registers hold."""
        return self


@dataclasses.dataclass(frozen=True)
class SplitFwdConfig:
    """``norm_fwd_split_kernel``: a row shared by programs of ``block_n`` columns each,
    ``per_sm`` programs a multiprocessor (their registers capped so that all are resident)."""

    block_n: int
    num_warps: int
    per_sm: int
    # 0: a row ahead in registers, its slice read again for y; k >= 2: the row loop's loads
    # pipelined by Triton in k stages, the previous row held for its y
    stages: int = 0
    # pipelined (stages >= 2): x's slices read through a tensor descriptor made on the host, so
    # that the pipeliner copies them with TMA (bulk copies into shared memory, no address
    # registers); x's rows must start on 16 bytes and a slice fill multiples of 128 bytes
    tma: bool = False
    # pipelined: y written for the row this many rows (1 or 2) behind the one loaded, so that the
    # siblings' sums have had that many rows' time to arrive (2: the slice read again, from L2)
    lag: int = 1

    def check(self, n: int, name: str = "config") -> None:
        _check_fields(self, name)
        _require(self.per_sm >= 1, name, self, "per_sm must be at least 1")
        _require(self.stages == 0 or 2 <= self.stages <= MAX_STAGES, name, self,
                 f"stages must be 0 or 2 to {MAX_STAGES}")
        _require(not self.tma or self.stages >= 2, name, self, "tma needs stages >= 2 (the pipelined loop)")
        _require(self.lag == 1 or (self.lag == 2 and self.stages >= 2), name, self,
                 "lag must be 1, or 2 with stages >= 2 (the pipelined loop)")

    def deepened(self, depth: int) -> "SplitFwdConfig":
        """``depth`` times the programs a multiprocessor (``more_programs``), within
        MAX_SPLIT_PER_SM and MIN_SLICE."""
        return more_programs(self, depth, "block_n", MIN_SLICE, MAX_SPLIT_PER_SM)


@dataclasses.dataclass(frozen=True)
class BwdConfig:
    """``norm_bwd_kernel`` on a persistent grid: tiles of ``block_m`` rows of ``block_n``
    columns (the whole row, or a column chunk after the row dot products' own pass)."""

    block_m: int
    block_n: int
    num_warps: int
    one_pass: bool = True
    per_sm: int = 1  # programs a multiprocessor
    # at most this many programs (0: no cap), each also summing dW / dB over every row for its
    # share of the columns (one program: its own rows), so that no second launch sums partials
    max_programs: int = 0
    prefetch: int = 0  # 0: none; 1: the next tile into registers; k >= 2: Triton's pipelining in k stages
    tail_n: int = 0  # as FwdConfig's

    def check(self, n: int, name: str = "config") -> None:
        _check_tiles(self, n, name)
        _require(self.per_sm >= 1 and self.max_programs >= 0 and self.prefetch >= 0, name, self,
                 "per_sm must be at least 1, max_programs and prefetch at least 0")

    def deepened(self, depth: int) -> "BwdConfig":
        """Its pipelined loads (prefetch >= 2) ``depth`` times as far ahead."""
        return dataclasses.replace(self, prefetch=deeper_stages(self.prefetch, depth))


@dataclasses.dataclass(frozen=True)
class SplitBwdConfig:
    """``norm_bwd_split_kernel``: a row shared by programs of ``block_n`` columns each, one a
    multiprocessor."""

    block_n: int
    num_warps: int
    stages: int  # 0: the exchange in step with the row; k >= 2: a row ahead, loads pipelined in k stages
    w_packed: bool = False  # the weight slice held in its dtype and converted where used

    def check(self, n: int, name: str = "config") -> None:
        _check_fields(self, name)
        _require(self.stages >= 0, name, self, "stages must be at least 0")

    def deepened(self, depth: int) -> "SplitBwdConfig":
        """Its pipelined rows ``depth`` times as far ahead."""
        return dataclasses.replace(self, stages=deeper_stages(self.stages, depth))


ForwardConfig = Union[FwdConfig, SplitFwdConfig]
BackwardConfig = Union[BwdConfig, SplitBwdConfig]
CONFIGS = (FwdConfig, SplitFwdConfig, BwdConfig, SplitBwdConfig)


def check_config(config, n: int, backward: bool, name: str = "config") -> None:
    """Raise TypeError / ValueError naming ``name`` (the caller's argument) unless ``config`` is a
    forward (``backward``: a backward) configuration that can launch rows of ``n`` columns."""
    kinds = (BwdConfig, SplitBwdConfig) if backward else (FwdConfig, SplitFwdConfig)
    if not isinstance(config, kinds):
        raise TypeError(f"{name} must be a {' or '.join(k.__name__ for k in kinds)}, got {type(config).__name__}")
    config.check(n, name)


@dataclasses.dataclass(frozen=True)
class NormConfig:
    """The launch configuration of one norm call (``config=``): None where the tables choose.
    A split configuration applies where the split can run (one weight row, a grid that can be
    resident); elsewhere the tables choose without it."""

    forward: Optional[ForwardConfig] = None
    backward: Optional[BackwardConfig] = None


# The helper passes of the backward, not tuned (a few percent of its time): the blocked loop's
# row dot products (a row a program, in chunks), the sum of the programs' dW / dB partials, and
# at decode sizes the rows x columns of each step of a program's dW / dB sum.
DOTS_BLOCK_N, DOTS_WARPS = 8192, 16
SUMS_BLOCK_P, SUMS_BLOCK_N, SUMS_WARPS = 32, 64, 4
DW_STEP_ELEMENTS = 4096
