"""The tables that choose the norm kernels' launch configurations (``configs.py``'s records).

``FORWARD`` and ``BACKWARD``: rows keyed alike by norm kind, bytes per element, residual add and a
range of row widths (``NormKey``), each naming the results under ``benchmarks/results/`` that
chose it (``benchmarks/RESULTS.md`` §1.2 has their figures). A row holds a configuration or a rule
that makes one from the key (``FwdRows``, ``FwdDecode``, ``FwdTail``, ``BwdRows``, ``BwdDecode``,
``BwdTail``); what is not a width range is a named predicate over the key (``when``). The first
row that matches the key is taken. Decode rows (``decode=``) are skipped at first; where the
configuration found without them would launch too few row tiles to fill the GPU (their
predicate), the first row that matches with them is taken. The rows hold what the H100 of the
results needs; a device that needs more loads in flight per multiprocessor (``NormKey.depth``,
``_device.DeviceModel.depth``) gets each configuration ``deepened``, and rows of its own
(``deep_device``) where the H200's tune measured better. Where ``llmkernels tune``
measured a key of training sizes on this device, its cache gives the configuration instead.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Optional

import torch

from .. import _device
from .._args import cdiv, next_pow2
from .configs import CONFIGS, BackwardConfig, BwdConfig, ForwardConfig, FwdConfig, SplitBwdConfig, SplitFwdConfig

WARP = 32  # threads a warp
FWD_ONE_PASS_MAX = 32768  # widest row the forward holds in registers; wider rows split or loop over chunks
BWD_ONE_PASS_MAX = 16384  # ... the backward
LN_BWD_ONE_PASS_MAX = BWD_ONE_PASS_MAX // 2  # LayerNorm's: its dB accumulator beside dW spills wider rows
DECODE_ROWS = 256  # at most this many rows on a GPU: decode sizes, where latency matters, not bandwidth
DECODE_PROGRAMS = 64  # backward programs at most at decode sizes
WHOLE_SLICE = 8192  # columns a program of the split kernels, where the row is a multiple of it
WIDEST = 1 << 40  # no row is wider


def row_block(n: int) -> int:
    """The power of two of a row of ``n`` (16 at least): the columns of a one-pass tile."""
    return max(16, next_pow2(n))


class NormKey(NamedTuple):
    """What the tables choose by: the norm, its input dtype (the backward's: of x, or of h =
    x + residual), the residual add, the rows (``m`` of ``n``), the multiprocessors (``sms``; 0:
    unknown, no decode rows), whether the row may be split (one weight row) and the device's
    ``depth`` (loads in flight a multiprocessor, in the H100's: ``DeviceModel.depth``)."""

    is_rms: bool
    dtype: torch.dtype
    residual: bool
    n: int
    m: int
    sms: int = 0
    split: bool = True
    depth: int = 1


# --------------------------------------------------------------------------------------------
# rules: configurations made from the key
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FwdRows:
    """Whole rows in registers: as many rows a program as fill ``tile`` elements (no more than
    there are), a warp per ``warp_elements`` (32 elements a thread), ``min_warps`` at least."""

    tile: int
    warp_elements: int = 1024
    min_warps: int = 4

    def resolve(self, key: NormKey, base=None) -> FwdConfig:
        block_n = row_block(key.n)
        block_m = min(max(1, self.tile // block_n), next_pow2(key.m))
        return FwdConfig(block_m, block_n, max(self.min_warps, block_m * block_n // self.warp_elements))


@dataclasses.dataclass(frozen=True)
class FwdDecode:
    """A row a program, its weight loaded with it: the latency of few rows."""

    num_warps: int

    def resolve(self, key: NormKey, base=None) -> FwdConfig:
        return FwdConfig(1, row_block(key.n), self.num_warps, early_w=True)


@dataclasses.dataclass(frozen=True)
class FwdTail:
    """A row a program as half its power of two whole and the rest as a power-of-two tail tile
    (5120 = 4096 + 1024, not 8192 with 3072 masked): a warp per ``warp_elements`` of the half,
    but no fewer than ``tail_thread_elements`` a thread in the tail."""

    warp_elements: int = 1024
    tail_thread_elements: int = 8

    def resolve(self, key: NormKey, base=None) -> FwdConfig:
        block_n = row_block(key.n) // 2
        tail_n = next_pow2(key.n - block_n)
        warps = min(block_n // self.warp_elements, tail_n // (WARP * self.tail_thread_elements))
        return FwdConfig(1, block_n, warps, tail_n=tail_n)


@dataclasses.dataclass(frozen=True)
class BwdRows:
    """Tiles of whole rows, as many rows as fill ``tile`` elements (no more than there are)."""

    tile: int
    num_warps: int
    per_sm: int = 1
    prefetch: int = 0

    def resolve(self, key: NormKey, base=None) -> BwdConfig:
        block_n = row_block(key.n)
        return BwdConfig(min(max(1, self.tile // block_n), next_pow2(key.m)), block_n, self.num_warps,
                         per_sm=self.per_sm, prefetch=self.prefetch)


@dataclasses.dataclass(frozen=True)
class BwdDecode:
    """At most ``programs`` programs, each taking its rows as one tile of at most ``max_tile``
    elements (``rows``: that many rows a tile), a warp per ``warp_elements`` (4 to 8 warps);
    programs a multiprocessor as the configuration found without decode rows (``base``)."""

    max_tile: int
    rows: int = 0
    programs: int = DECODE_PROGRAMS
    warp_elements: int = 2048

    def resolve(self, key: NormKey, base: BwdConfig) -> BwdConfig:
        block_n = row_block(key.n)
        fit = max(1, self.max_tile // block_n)
        block_m = min(self.rows, fit) if self.rows else min(fit, next_pow2(cdiv(key.m, self.programs)))
        return BwdConfig(block_m, block_n, max(4, min(8, block_m * block_n // self.warp_elements)),
                         per_sm=base.per_sm, max_programs=self.programs)


@dataclasses.dataclass(frozen=True)
class BwdTail:
    """A row a tile as ``block_n`` columns whole and the rest as a power-of-two tail tile."""

    block_n: int
    num_warps: int
    prefetch: int

    def resolve(self, key: NormKey, base=None) -> BwdConfig:
        return BwdConfig(1, self.block_n, self.num_warps, prefetch=self.prefetch,
                         tail_n=next_pow2(key.n - self.block_n))


# --------------------------------------------------------------------------------------------
# predicates over the key
# --------------------------------------------------------------------------------------------
def row_split(key: NormKey) -> bool:
    """The row may be split over programs (one weight row)."""
    return key.split


def deep_device(key: NormKey) -> bool:
    """The device needs more loads in flight a multiprocessor than the H100 (the H200)."""
    return key.depth >= 2


def partial_slices(key: NormKey) -> bool:
    """The row is not a multiple of ``WHOLE_SLICE``: its last slice would be partly masked."""
    return key.n % WHOLE_SLICE != 0


def eighth_tail(key: NormKey) -> bool:
    """Past half its power of two p, the row has more than p / 32 and at most p / 4 columns: a
    tail of at least an eighth of p."""
    p = row_block(key.n)
    return p // 32 < key.n - p // 2 <= p // 4


def five_eighths(key: NormKey) -> bool:
    """The row fills at most 5/8 of its power of two."""
    p = row_block(key.n)
    return key.n < p and 8 * key.n <= 5 * p


def below_power_of_two(key: NormKey) -> bool:
    return key.n < row_block(key.n)


def beyond_decode_rows(key: NormKey) -> bool:
    """More rows than decode sizes, or the multiprocessors unknown."""
    return not key.sms or key.m > DECODE_ROWS


def five_to_sixteen_rows(key: NormKey) -> bool:
    return 4 < key.m <= 16


def fp16(key: NormKey) -> bool:
    return key.dtype == torch.float16


def few_forward_tiles(key: NormKey, base: FwdConfig) -> bool:
    """Decode sizes, or fewer row tiles of ``base`` than multiprocessors."""
    return key.sms > 0 and (key.m <= DECODE_ROWS or cdiv(key.m, base.block_m) < key.sms)


def few_backward_tiles(key: NormKey, base: BwdConfig) -> bool:
    """Decode sizes, with no more row tiles of ``base`` than its programs resident at once."""
    return key.m <= DECODE_ROWS and cdiv(key.m, base.block_m) <= key.sms * base.per_sm


# --------------------------------------------------------------------------------------------
# the tables
# --------------------------------------------------------------------------------------------
RMS, LN, BOTH = (True,), (False,), (True, False)  # norm kinds (is_rms)
TWO, FOUR = (2,), (4,)  # bytes per element of the norm's input
NO_RES, RES = (False,), (True,)  # the residual add
ANY = None  # any bytes per element, with and without the residual add


@dataclasses.dataclass(frozen=True)
class Entry:
    """A row of a table: the configuration (or rule) of the keys it matches, and its evidence."""

    kinds: tuple
    elem_sizes: Optional[tuple]
    residual: Optional[tuple]
    widths: tuple  # (narrowest, widest) row
    config: object  # a configuration, or a rule: ``config.resolve(key, base)`` makes one
    source: tuple  # the results that chose it: files under benchmarks/results/
    when: tuple = ()  # predicates over the key that must all hold
    decode: Optional[Callable] = None  # a decode row: taken where decode(key, configuration without decode rows)

    def matches(self, key: NormKey, decode: bool) -> bool:
        return (key.is_rms in self.kinds and self.widths[0] <= key.n <= self.widths[1]
                and (self.elem_sizes is None or key.dtype.itemsize in self.elem_sizes)
                and (self.residual is None or key.residual in self.residual)
                and (decode or self.decode is None) and all(rule(key) for rule in self.when))

    def make(self, key: NormKey, base=None):
        """The configuration of ``key``: the entry's, or what its rule makes (``base``: the
        configuration found without decode rows)."""
        return self.config if isinstance(self.config, CONFIGS) else self.config.resolve(key, base)


class Table:
    """Rows in order: the first that matches a key gives its configuration (see the module notes)."""

    def __init__(self, *entries: Entry):
        self.entries = entries

    def entry(self, key: NormKey, decode: bool = False) -> Entry:
        """The first row matching ``key`` (with ``decode``: decode rows included)."""
        for entry in self.entries:
            if entry.matches(key, decode):
                return entry
        raise LookupError(f"no launch configuration for {key}")

    def resolve(self, key: NormKey):
        """The configuration of ``key``, deepened to its device's depth."""
        config = self.entry(key).make(key)
        found = self.entry(key, decode=True)
        if found.decode is not None and found.decode(key, config):
            config = found.make(key, config)
        return config.deepened(key.depth)


# The results that chose the entries, by folder under benchmarks/results/ and file.
_T22, _T23, _T24, _T25 = (f"tune-norm-h100-2026-11-{day}/" for day in (22, 23, 24, 25))
_D23, _D24 = "decode-h100-2026-11-23/", "decode-h100-2026-11-24/"
SPLIT_FWD_SWEEP = _T23 + "21-split-fwd-ahead-sweep.json"
SPLIT_FWD_LN_NARROW = _T24 + "15-split-fwd-ln-below-32768.txt"
SPLIT_FWD_RMS_NARROW = _T24 + "16-split-fwd-rms-below-32768.txt"
FWD_DECODE = (_D23 + "forward-early-weight.txt", _D24 + "9-decode-sweep-fwd.txt")
FWD_SMALL_N = _T22 + "9-fwd-small-n-stats.json"
FWD_BLOCKED_CHUNKS = _T23 + "14-fwd-blocked-chunks.json"
BWD_PIPELINED = _T23 + "14-bwd-pipelined-sweep.json"
BWD_SPLIT_SKEWED = _T23 + "16-split-bwd-pipelined-skewed.json"
BWD_RMS_WIDE = _T22 + "2-sweep-rms-wide.json"
BWD_DECODE_BY_COLUMNS = _D24 + "3-decode_sweep-dw-by-columns.json"
BWD_RAGGED = _T25 + "3-fwd-tail-rule-ab-and-bwd-ragged.txt"
NORM_TMA_H200 = ("norm-tma-h200-2026-11-28/tune.json", "norm-tma-h200-2026-11-28/tune_32768.json")
RMS_FWD_DEEP = "norm-deep-h200-2026-11-27/rms-fwd-searches.json"
LN_FWD_DEEP = "norm-deep-h200-2026-11-27/ln-fwd-32768-search.json"
BWD_RMS_FP32 = _T23 + "11-bwd-rms-fp32-sweep.json"
BWD_LN_FP32 = _T23 + "11-bwd-ln-fp32-sweep.json"

_RMS_ROWS = FwdRows(tile=8192)
_RMS_ROWS_DEEP = FwdRows(tile=4096, warp_elements=512)
_LN_ROWS = FwdRows(tile=4096)

FORWARD = Table(
    # on a device that needs more loads in flight (the H200), wide 2-byte RMSNorm rows are split
    # with their loads pipelined and read through TMA, 4096 x 4 warps, 4 an SM once deepened: the
    # H200's tune chose exactly that at every wide width it searched, 32768 included
    Entry(RMS, TWO, NO_RES, (16385, WIDEST), SplitFwdConfig(WHOLE_SLICE, 8, 2, stages=3, tma=True), NORM_TMA_H200,
          when=(row_split, deep_device)),
    # ... and LayerNorm's 32768-column rows split too, not read in one pass (81.2% against 74.6%
    # in the H200's tune), plainly: pipelining costs LayerNorm (split-fwd-h200-2026-11-27/)
    Entry(LN, TWO, NO_RES, (FWD_ONE_PASS_MAX, FWD_ONE_PASS_MAX), SplitFwdConfig(WHOLE_SLICE, 8, 2), (LN_FWD_DEEP,),
          when=(row_split, deep_device)),
    # a 2-byte row that fills the one-pass tile stays in one pass
    Entry(RMS, TWO, NO_RES, (FWD_ONE_PASS_MAX, FWD_ONE_PASS_MAX), _RMS_ROWS, (SPLIT_FWD_RMS_NARROW,)),
    Entry(LN, TWO, NO_RES, (FWD_ONE_PASS_MAX, FWD_ONE_PASS_MAX), _LN_ROWS, (SPLIT_FWD_LN_NARROW,)),
    # rows split over programs, where measured faster than one pass or the blocked loop; 2-byte
    # rows that leave the last whole slice partly masked take narrower ones
    Entry(BOTH, TWO, NO_RES, (16385, WIDEST), SplitFwdConfig(4096, 4, 4),
          (_T24 + "13-split-fwd-ln-ragged.txt", _T24 + "13-split-fwd-rms-ragged.txt", SPLIT_FWD_RMS_NARROW),
          when=(row_split, partial_slices)),
    Entry(BOTH, TWO, NO_RES, (16385, WIDEST), SplitFwdConfig(WHOLE_SLICE, 8, 2),
          (SPLIT_FWD_SWEEP, _T24 + "13-split-fwd-read-before-wait.txt",
           _T24 + "3-split-fwd-ln-one-reduction-keep-packed.json", SPLIT_FWD_LN_NARROW), when=(row_split,)),
    Entry(RMS, TWO, RES, (FWD_ONE_PASS_MAX + 1, WIDEST), SplitFwdConfig(WHOLE_SLICE, 4, 2),
          (SPLIT_FWD_SWEEP, _T24 + "13-defaults-fwd.txt"), when=(row_split,)),
    Entry(RMS, FOUR, NO_RES, (FWD_ONE_PASS_MAX + 1, WIDEST), SplitFwdConfig(WHOLE_SLICE, 8, 1), (SPLIT_FWD_SWEEP,),
          when=(row_split,)),
    # fp32 add + RMSNorm rows narrower than 49152: the blocked loop is faster
    Entry(RMS, FOUR, RES, (49152, WIDEST), SplitFwdConfig(WHOLE_SLICE, 8, 1), (SPLIT_FWD_SWEEP,), when=(row_split,)),
    Entry(LN, FOUR, NO_RES, (16385, WIDEST), SplitFwdConfig(WHOLE_SLICE, 8, 1), (SPLIT_FWD_SWEEP, SPLIT_FWD_LN_NARROW),
          when=(row_split,)),
    # decode sizes: a row a program, the weight loaded with it
    Entry(RMS, ANY, ANY, (513, 2048), FwdDecode(num_warps=4), FWD_DECODE, decode=few_forward_tiles),
    Entry(RMS, ANY, ANY, (2049, 8192), FwdDecode(num_warps=8), FWD_DECODE, decode=few_forward_tiles),
    Entry(LN, ANY, ANY, (513, 8192), FwdDecode(num_warps=4),
          (_D24 + "15-warps-launchers-stats.txt", _D24 + "6-decode-sweep-fwd.txt"), decode=few_forward_tiles),
    # rows an eighth or more past half their power of two: that half whole and a tail (with a
    # residual add no faster)
    Entry(BOTH, ANY, NO_RES, (4097, 16384), FwdTail(), (BWD_RAGGED, _T25 + "8-fwd-eighth-tail.txt"),
          when=(eighth_tail,)),
    # on a deep device, 2-byte RMSNorm rows of 1024-8192 without a residual: half the rows a
    # program and 16 elements a thread, more programs in flight (the H200's tune: best or within
    # 2 points at 1024, 2304, 4096 and 8192, up to 8 points over the H100's rows)
    Entry(RMS, TWO, NO_RES, (1024, 8192), _RMS_ROWS_DEEP, (RMS_FWD_DEEP,), when=(deep_device,)),
    # whole rows in registers, 32 elements a thread
    Entry(RMS, ANY, ANY, (1, FWD_ONE_PASS_MAX), _RMS_ROWS,
          (FWD_SMALL_N, _T24 + "15-fwd-warps-stats-and-bwd-ln-ragged.txt")),
    Entry(LN, ANY, ANY, (1, FWD_ONE_PASS_MAX), _LN_ROWS,
          (FWD_SMALL_N, _T24 + "15-sweep-fwd-ln-ragged.json", _T22 + "9-fwd-layernorm-wide.json")),
    # wider rows that do not split: the blocked loop (2-byte rows to 49152 in half chunks)
    Entry(BOTH, TWO, ANY, (FWD_ONE_PASS_MAX + 1, 49152), FwdConfig(1, 8192, 32, one_pass=False),
          (FWD_BLOCKED_CHUNKS, _T23 + "15-defaults-fwd-36864-65536.json")),
    Entry(BOTH, ANY, ANY, (FWD_ONE_PASS_MAX + 1, WIDEST), FwdConfig(1, 16384, 32, one_pass=False),
          (FWD_BLOCKED_CHUNKS,)),
)

_BWD_BLOCKED = BwdConfig(4, 1024, 4, one_pass=False, per_sm=4)

BACKWARD = Table(
    # 2-byte rows of 8193-12288 (beyond decode sizes): 8192 columns whole and a tail
    Entry(BOTH, TWO, ANY, (LN_BWD_ONE_PASS_MAX + 1, 12288), BwdTail(block_n=8192, num_warps=8, prefetch=3),
          (_T25 + "6-bwd-tail.txt",), when=(beyond_decode_rows,)),
    # rows too wide for one program (LayerNorm's from 8193: its dB accumulator beside dW spills),
    # split where the split can run, else the blocked loop; fp16 keeps its weight slice packed
    Entry(RMS, TWO, ANY, (BWD_ONE_PASS_MAX + 1, WIDEST), SplitBwdConfig(8192, 8, 4, w_packed=True),
          (_T24 + "6-split-bwd-rms-w-packed.json", _T24 + "6-split-bwd-add-w-packed.json"), when=(row_split, fp16)),
    Entry(RMS, TWO, ANY, (BWD_ONE_PASS_MAX + 1, WIDEST), SplitBwdConfig(8192, 8, 3), (BWD_SPLIT_SKEWED,),
          when=(row_split,)),
    Entry(RMS, ANY, ANY, (BWD_ONE_PASS_MAX + 1, WIDEST), SplitBwdConfig(8192, 8, 3),
          (_T24 + "7-split-bwd-fp32-rms.json", _T24 + "8-fp32-bwd-after-entry-fix.txt"), when=(row_split,)),
    Entry(LN, FOUR, ANY, (LN_BWD_ONE_PASS_MAX + 1, WIDEST), SplitBwdConfig(8192, 8, 4), (BWD_SPLIT_SKEWED,),
          when=(row_split,)),
    Entry(LN, ANY, ANY, (LN_BWD_ONE_PASS_MAX + 1, WIDEST), SplitBwdConfig(8192, 8, 3),
          (BWD_SPLIT_SKEWED, _T24 + "8-defaults-bwd-wide.txt"), when=(row_split,)),
    Entry(RMS, ANY, ANY, (BWD_ONE_PASS_MAX + 1, WIDEST), _BWD_BLOCKED, (BWD_RMS_WIDE,)),
    Entry(LN, ANY, ANY, (LN_BWD_ONE_PASS_MAX + 1, WIDEST), _BWD_BLOCKED,
          (BWD_RMS_WIDE, _T22 + "5-defaults-layernorm-16384-split.json")),
    # decode sizes: at most 64 programs, each also summing dW / dB of its columns (one launch)
    Entry(LN, ANY, ANY, (1, LN_BWD_ONE_PASS_MAX), BwdDecode(max_tile=8192, rows=2),
          (_D24 + "5-decode_sweep-ln-run1.json", _D24 + "5-decode_sweep-ln-run2.json"),
          when=(five_to_sixteen_rows,), decode=few_backward_tiles),
    Entry(LN, ANY, ANY, (1, LN_BWD_ONE_PASS_MAX), BwdDecode(max_tile=8192),
          (BWD_DECODE_BY_COLUMNS, _D23 + "after-3-bwd/results.md"), decode=few_backward_tiles),
    Entry(RMS, ANY, ANY, (1, BWD_ONE_PASS_MAX), BwdDecode(max_tile=16384), (BWD_DECODE_BY_COLUMNS,),
          decode=few_backward_tiles),
    # rows between two powers of two where their sweeps found better than the power's entry
    Entry(BOTH, TWO, ANY, (2049, 8192), BwdRows(tile=8192, num_warps=8, prefetch=4),
          (BWD_RAGGED, _T25 + "1-sweep-bwd-rms-ragged.txt", _T24 + "15-fwd-warps-stats-and-bwd-ln-ragged.txt"),
          when=(five_eighths,)),
    Entry(RMS, FOUR, ANY, (2049, 4096), BwdRows(tile=4096, num_warps=8, per_sm=2, prefetch=1), (BWD_RAGGED,),
          when=(below_power_of_two,)),
    Entry(LN, FOUR, ANY, (2049, 8192), BwdRows(tile=8192, num_warps=8, prefetch=3), (BWD_RAGGED,),
          when=(five_eighths,)),
    # fp32 rows where their own sweep found better than the 2-byte entry
    Entry(RMS, FOUR, ANY, (1025, 2048), BwdRows(tile=2048, num_warps=8, per_sm=2, prefetch=1), (BWD_RMS_FP32,)),
    Entry(RMS, FOUR, ANY, (2049, 8192), BwdRows(tile=8192, num_warps=16, prefetch=1),
          (BWD_RMS_FP32, _T23 + "15-defaults-bwd-pipelined.json")),
    Entry(RMS, FOUR, ANY, (8193, BWD_ONE_PASS_MAX), BwdRows(tile=16384, num_warps=8), (BWD_RMS_FP32,)),
    Entry(LN, FOUR, ANY, (1025, 2048), BwdRows(tile=4096, num_warps=16, prefetch=1), (BWD_LN_FP32,)),
    Entry(LN, FOUR, ANY, (2049, 8192), BwdRows(tile=8192, num_warps=8, prefetch=1), (BWD_LN_FP32,)),
    # rows up to a power of two (rows of 1024 and narrower: 1024's entry)
    Entry(RMS, ANY, ANY, (1, 1024), BwdRows(tile=4096, num_warps=8, prefetch=4), (BWD_PIPELINED,)),
    Entry(RMS, ANY, ANY, (1025, 2048), BwdRows(tile=4096, num_warps=4, prefetch=4), (BWD_PIPELINED,)),
    Entry(RMS, ANY, ANY, (2049, 4096), BwdRows(tile=4096, num_warps=16, per_sm=2, prefetch=1),
          (_T23 + "8-bwd-rms-prefetch.json", BWD_PIPELINED)),
    Entry(RMS, ANY, ANY, (4097, 8192), BwdRows(tile=8192, num_warps=8, prefetch=3),
          (_T23 + "19-bwd-8192-add-rmsnorm.json",)),
    Entry(RMS, ANY, ANY, (8193, BWD_ONE_PASS_MAX), BwdRows(tile=16384, num_warps=16),
          (_T23 + "8-sweep-bwd-rms-16384-w-per-tile.json", _T23 + "8-bwd-rms-prefetch.json")),
    Entry(LN, ANY, ANY, (1, 2048), BwdRows(tile=4096, num_warps=4, prefetch=4), (BWD_PIPELINED,)),
    Entry(LN, ANY, ANY, (2049, LN_BWD_ONE_PASS_MAX), BwdRows(tile=8192, num_warps=16, prefetch=3), (BWD_PIPELINED,)),
)


def tuned_name(key: NormKey, direction: str) -> str:
    """The key of ``llmkernels tune``'s cache: direction (fwd / bwd), norm, dtype, residual, width."""
    return (f"norm/{direction}/{'rms' if key.is_rms else 'ln'}/{str(key.dtype).removeprefix('torch.')}/"
            f"{'res' if key.residual else 'nores'}/{key.n}")


def _tuned(key: NormKey, direction: str, tuned: _device.Tuned):
    """The tuned configuration of ``key``, where one was measured at its sizes (training sizes,
    not decode) and can run it (a split only where the row may be split)."""
    if not tuned.entries or (key.sms and key.m <= DECODE_ROWS):
        return None
    config = tuned.config(tuned_name(key, direction), CONFIGS)
    return None if isinstance(config, (SplitFwdConfig, SplitBwdConfig)) and not key.split else config


def forward_config(key: NormKey, tuned: _device.Tuned = _device.NONE) -> ForwardConfig:
    """The forward's configuration for ``key``: ``tuned``'s, else ``FORWARD``'s."""
    return _tuned(key, "fwd", tuned) or FORWARD.resolve(key)


def backward_config(key: NormKey, tuned: _device.Tuned = _device.NONE) -> BackwardConfig:
    """The backward's configuration for ``key``: ``tuned``'s, else ``BACKWARD``'s."""
    return _tuned(key, "bwd", tuned) or BACKWARD.resolve(key)
