"""What ``llmkernels tune`` searches: one ``Task`` per tuned-cache key (or per part of a key's
record), on a case of the benchmark's op (``llmkernels.bench``: its inputs, its float64
reference and its minimum bytes), with the derived configuration first among the candidates.

Candidates are the heuristic at the device's depth and at the other depths, and a few
neighbours of it along the knobs that decide bytes in flight (rows or columns a program, warps,
pipelining stages, programs a multiprocessor): few, because each compiles once.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import torch

import llmkernels

from ..bench.ops_norm import LN_EPS, RMS_EPS
from ..bench.ops_qk_norm_rope import EPS as QK_EPS
from ..bench.ops_rope import HK, HQ, D
from ..ops import _device
from ..ops.configs import cross_entropy as ce
from ..ops.configs import qk_norm_rope as qk
from ..ops.configs import rope
from ..ops.norm import BwdConfig, FwdConfig, NormConfig, NormKey, SplitBwdConfig, SplitFwdConfig
from ..ops.norm.tables import BWD_ONE_PASS_MAX, FWD_ONE_PASS_MAX, backward_config, forward_config, row_block, tuned_name
from ..ops.qk_norm_rope import QK_NORM_ROPE, QkNormRopeOptions
from ..ops.rope import RopeOptions, rope_launch

NORM_WIDTHS = (1024, 2304, 4096, 5120, 8192, 14336, 18432, 32768, 53248, 65536, 131072)
VOCABS = (32000, 128256, 262144)
ROPE_SEQ = 4096  # RoPE: Llama's heads (bench.ops_rope) at this sequence length
NORM_ELEMENTS = 2**26  # elements of a norm's x: 128 MiB in bf16, well past the L2 of any GPU
LOGITS = 2**28  # logits of a cross-entropy case: 512 MiB in bf16
ROPE_BATCH = 4  # q of 4 x 32 x 4096 x 128: 128 MiB in bf16
# QK-norm + RoPE: (Hq, Hk, D, S, B) of the scaling decoder at width 384 (q and k of 128 x 512
# tokens: 96 MiB in bf16), and of Llama's and Qwen3-8B's heads (the bench's)
QK_HEADS = ((6, 6, 64, 512, 128), (HQ, HK, D, ROPE_SEQ, ROPE_BATCH))
DEPTHS = (1, 2, 4)
NORM_OPS = {"rmsnorm": (True, False), "layernorm": (False, False), "add_rmsnorm": (True, True)}


@dataclasses.dataclass(frozen=True)
class Task:
    """One search: ``candidates`` (the heuristic first) of the configuration of ``key`` (its
    ``part``, a field of the key's record, where the record is searched a part at a time), each
    called as ``call(config)`` -> a provider's ``fwd(**inputs)`` of bench op ``op`` at ``size``
    (``rows`` rows), checked against its reference and timed in ``mode``."""

    key: str
    op: str
    size: int
    rows: Optional[int]
    mode: str
    heuristic: object
    candidates: tuple
    call: Callable
    part: Optional[str] = None
    mutates: bool = False
    shape: Optional[dict] = None  # the case's shape where it is not the op's at ``size`` (other heads)

    @property
    def name(self) -> str:
        return self.key if self.part is None else f"{self.key}#{self.part}"


def _unique(configs) -> tuple:
    return tuple(dict.fromkeys(configs))


def _fits(config, n: int) -> bool:
    """Launchable rows of ``n`` within the kernels' registers (at most 64 elements a thread of a
    held tile in the backward, 128 in the forward)."""
    try:
        config.check(n)
    except (TypeError, ValueError):
        return False
    threads = 32 * config.num_warps
    if isinstance(config, (SplitFwdConfig, SplitBwdConfig)):
        return config.block_n <= (128 if isinstance(config, SplitFwdConfig) else 64) * threads
    held = config.block_m * (config.block_n + config.tail_n) if config.one_pass else config.block_n
    return held <= (128 if isinstance(config, FwdConfig) else 64) * threads and config.block_m * config.block_n <= 65536


def _pipelined(config, tma: bool) -> list:
    """A split forward's pipelined twin reading x plainly (none for None) and, where ``tma``, the
    same reading x through TMA (next in line, so that a search cut short still tries them: they
    measured best at wide rows on an H200, benchmarks/results/wide-rows-h200-2026-11-28/). Where
    the heuristic itself reads through TMA (a deep device's table), the plain twin stays its rival."""
    if not isinstance(config, SplitFwdConfig):
        return []
    piped = dataclasses.replace(config, stages=config.stages or 3, tma=False)
    return [piped, dataclasses.replace(piped, tma=True)] if tma else [piped]


def _readable(config, tma: bool):
    """``config``, reading x plainly where this machine has no TMA read (a deep device's table asks for it)."""
    return config if tma or not getattr(config, "tma", False) else dataclasses.replace(config, tma=False)


def tma_here() -> bool:
    """Whether this machine's norm forward can read x through TMA: a Triton with tensor
    descriptors, and a Hopper or newer GPU (or Triton's interpreter)."""
    from ..ops._triton import TensorDescriptor

    if TensorDescriptor is None:
        return False
    return _device.has_tma(torch.cuda.current_device() if torch.cuda.is_available() else -1)


def _norm_neighbours(n: int, backward: bool, split: bool) -> list:
    """Configurations near the tables' for rows of ``n``: whole rows of other tiles and warps,
    pipelining stages and programs a multiprocessor; for wide rows, split slices and programs."""
    bn = row_block(n)
    if not backward:
        near = [FwdConfig(max(1, tile // bn), bn, warps) for tile in (4096, 8192, 16384) for warps in (4, 8, 16, 32)
                if n <= FWD_ONE_PASS_MAX and max(1, tile // bn) * bn // warps in (512, 1024)]
        if split and n > BWD_ONE_PASS_MAX:
            near += [SplitFwdConfig(4096, 4, 4), SplitFwdConfig(8192, 8, 2), SplitFwdConfig(8192, 4, 2),
                     SplitFwdConfig(16384, 16, 1), SplitFwdConfig(8192, 8, 2, stages=3), SplitFwdConfig(4096, 4, 4, 4)]
        return near
    near = [BwdConfig(max(1, tile // bn), bn, warps, per_sm=per_sm, prefetch=prefetch)
            for tile in (8192, 16384) for warps, per_sm, prefetch in ((8, 1, 3), (8, 1, 4), (16, 1, 3), (16, 2, 1))
            if n <= BWD_ONE_PASS_MAX]
    if split and n > BWD_ONE_PASS_MAX // 2:
        near += [SplitBwdConfig(block_n, warps, stages) for block_n, warps in ((4096, 8), (8192, 8), (8192, 16))
                 for stages in (3, 4)]
    return near


def wide_row_candidates(n: int, backward: bool) -> dict:
    """Named strategies for rows of ``n`` (32K columns and more), measured side by side by
    ``benchmarks/wide_rows.py`` before any becomes a table row or a tune candidate: None (the
    tables' choice, or the tuned cache's), today's paths (the blocked loop, one pass where the row
    fits 64 elements a thread, the split and the pipelined split), and the candidates: the
    pipelined split reading x through TMA (``tma``), and writing y two rows behind (``lag``)."""
    if backward:
        return {"table": None, "blocked": BwdConfig(4, 1024, 4, one_pass=False, per_sm=4),
                "split 8192x8 s3": SplitBwdConfig(8192, 8, 3), "split 8192x8 s4": SplitBwdConfig(8192, 8, 4),
                "split 8192x16 s3": SplitBwdConfig(8192, 16, 3), "split 4096x4 s3": SplitBwdConfig(4096, 4, 3)}
    found = {"table": None, "blocked": FwdConfig(1, 16384, 32, one_pass=False)}
    if row_block(n) <= 65536:
        found["one pass"] = FwdConfig(1, row_block(n), 32)
    return {**found, "split 8192x8": SplitFwdConfig(8192, 8, 2), "split 4096x4 s3": SplitFwdConfig(4096, 4, 4, 3),
            "split 4096x4 s3 lag2": SplitFwdConfig(4096, 4, 4, 3, lag=2),
            "split 4096x4 s3 tma": SplitFwdConfig(4096, 4, 4, 3, tma=True),
            "split 4096x4 s4 tma": SplitFwdConfig(4096, 4, 4, 4, tma=True),
            "split 4096x4 s3 tma lag2": SplitFwdConfig(4096, 4, 4, 3, tma=True, lag=2),
            "split 8192x8 s3 tma": SplitFwdConfig(8192, 8, 2, 3, tma=True),
            "split 16384x16 s3 tma": SplitFwdConfig(16384, 16, 1, 3, tma=True)}


def norm_tasks(model: _device.DeviceModel, widths=NORM_WIDTHS, ops=tuple(NORM_OPS), dtype=torch.bfloat16,
               rows: Optional[int] = None, limit: int = 0, tma: bool = False) -> list:
    """The norms' tasks: forward and backward of each op at each width (``rows``: None, the
    widths' default of NORM_ELEMENTS; ``limit``: at most that many candidates, 0 all; ``tma``:
    the split forward's TMA read among them)."""
    tasks = []
    for op, n, backward in ((op, n, backward) for n in widths for op in ops for backward in (True, False)):
        is_rms, residual = NORM_OPS[op]
        m = rows or max(1, NORM_ELEMENTS // n)
        key = NormKey(is_rms, dtype, residual, n, m, model.sms, True, model.depth)
        choose = backward_config if backward else forward_config
        heuristic = choose(key)
        near = _norm_neighbours(n, backward, key.split)
        # the pipelined and TMA twins of the first split: the heuristic's, or a neighbour's where the
        # heuristic reads the row in one pass (32K columns on an H100)
        split = next((c for c in (heuristic, *near) if isinstance(c, SplitFwdConfig)), None)
        candidates = _unique(_readable(c, tma) for c in (heuristic, *_pipelined(split, tma),
                                                         *(choose(key._replace(depth=d)) for d in DEPTHS), *near))
        heuristic = _readable(heuristic, tma)
        candidates = tuple(c for c in candidates if _fits(c, n))[:limit or None]
        public = functools.partial(llmkernels.rms_norm if is_rms else llmkernels.layer_norm,
                                   eps=RMS_EPS if is_rms else LN_EPS, **({"prenorm": True} if residual else {}))

        def call(config, public=public, backward=backward):
            return functools.partial(public, config=NormConfig(**{"backward" if backward else "forward": config}))
        tasks.append(Task(tuned_name(key, "bwd" if backward else "fwd"), op, n, m, "bwd" if backward else "fwd",
                          heuristic, candidates, call))
    return tasks


def ce_tasks(model: _device.DeviceModel, vocabs=VOCABS, rows: Optional[int] = None, limit: int = 0) -> list:
    """Cross-entropy's tasks at each vocabulary: the in-place forward + backward's split (its
    slice, warps and programs a multiprocessor), then the forward alone's chunk and warps."""
    deepened = [ce.DEFAULT_CONFIG.deepened(d).split_inplace for d in DEPTHS]
    tasks = []
    for v in vocabs:
        heuristic = ce.derived_config(v, model.depth)
        inplace = deepened + [dataclasses.replace(heuristic.split_inplace, block_v=block_v, num_warps=warps,
                                                  per_sm=per_sm)
                              for block_v, warps, per_sm in ((32768, 32, 1), (16384, 16, 1), (16384, 8, 2), (8192, 8, 2))]
        forward = [dataclasses.replace(heuristic.forward, block_v=block_v, num_warps=warps)
                   for block_v, warps in ((16384, 8), (8192, 8), (16384, 16), (32768, 16))]
        m = rows or 1 << ((LOGITS // v).bit_length() - 1)
        for part, mode, values, public in (
                ("split_inplace", "fwd+bwd", inplace,
                 functools.partial(llmkernels.cross_entropy, inplace_backward=True, check_targets=False)),
                ("forward", "fwd", forward, functools.partial(llmkernels.cross_entropy, check_targets=False))):
            candidates = _unique(dataclasses.replace(heuristic, **{part: value}) for value in values)
            candidates = _unique([heuristic, *candidates])[:limit or None]
            tasks.append(Task(ce.tuned_name(v), "cross_entropy", v, m, mode, heuristic, candidates,
                              lambda config, public=public: functools.partial(public, config=config), part,
                              mutates=mode == "fwd+bwd"))
    return tasks


def _rope_call(tiles: rope.RopeTiles):
    """A provider of bench op ``rope`` (``[B, H, S, D]``) rotating into new tensors by the rule
    ``tiles`` (the backward is the same kernel rotating the other way: the forward is timed)."""
    def fwd(q, k, cos, sin):
        b, hq, s, d = q.shape
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        options = RopeOptions(interleaved=False, rotary_dim=d, backward=False, q_dtype=q.dtype, k_dtype=k.dtype,
                              layout="bhsd")
        rope_launch(q, k, cos, sin, None, options, q_out, k_out,
                    config=rope.rope_config(b * s, hq, k.shape[1], d, tiles))
        return q_out, k_out
    return fwd


def rope_tasks(seq: int = ROPE_SEQ, rows: Optional[int] = None, limit: int = 0) -> list:
    """RoPE's task at the benchmark's (Llama's) heads: elements a step and warps (the heuristic is
    the same on every device: ``ops.configs.rope``)."""
    heuristic = rope.DEFAULT_TILES
    candidates = _unique([heuristic, *(rope.RopeTiles(tile, warps) for tile, warps in
                                       ((2048, 4), (4096, 4), (2048, 8), (4096, 8), (512, 4)))])
    return [Task(rope.tuned_name(D, HQ, HK), "rope", seq, rows or ROPE_BATCH, "fwd", heuristic,
                 candidates[:limit or None], _rope_call)]


def _qk_norm_rope_call(direction: str):
    """``call(tiles)``: a provider of bench op ``qk_norm_rope`` (``[B, S, H, D]``) launching
    ``direction``'s kernel by the rule ``tiles`` (the other direction by its default)."""
    def call(tiles: qk.QkNormRopeTiles):
        def fwd(q, k, q_weight, k_weight, cos, sin):
            config = tiles.resolve(q.shape[2], k.shape[2], q.shape[3])
            return QK_NORM_ROPE(q, k, q_weight, k_weight, cos, sin, QkNormRopeOptions(QK_EPS, "bshd"),
                                **{"config" if direction == "fwd" else "backward_config": config})
        return fwd
    return call


def qk_norm_rope_tasks(heads=QK_HEADS, limit: int = 0) -> list:
    """QK-norm + RoPE's tasks at each of ``heads`` (``(Hq, Hk, D, S, B)``): the forward's tiles
    and warps, and the backward's with its programs a multiprocessor (the bytes in flight of its
    persistent grid)."""
    # the bytes in flight first: tiles over fewer warps, and for the backward the programs that
    # fit a multiprocessor (configs/qk_norm_rope.py); then larger tiles, in case the GPU disagrees
    near = {"fwd": [qk.QkNormRopeTiles(tile, warps) for tile, warps in
                    ((512, 1), (512, 2), (1024, 2), (512, 4), (2048, 4), (2048, 8))],
            "bwd": [qk.QkNormRopeTiles(tile, warps, programs_per_sm=per_sm) for tile, warps, per_sm in
                    ((1024, 4, 5), (512, 1, 12), (512, 2, 10), (512, 4, 8), (512, 1, 16), (1024, 4, 8),
                     (1024, 4, 2), (2048, 8, 2))]}
    tasks = []
    for hq, hk, d, s, b in heads:
        shape = {"B": b, "Hq": hq, "Hk": hk, "S": s, "D": d}
        for direction in ("bwd", "fwd"):  # the backward first: it holds the fewer bytes in flight
            heuristic = qk.DEFAULT_TILES[direction]
            candidates = _unique([heuristic, *near[direction]])[:limit or None]
            tasks.append(Task(qk.tuned_name(direction, d, hq, hk), "qk_norm_rope", s, b, direction, heuristic,
                              candidates, _qk_norm_rope_call(direction), shape=shape))
    return tasks
