"""Launch configurations of the norm kernels."""
from __future__ import annotations

import torch

from .._launch import cdiv, next_pow2


# Widest row (elements) that the one-pass kernels keep in registers; wider rows take the
# blocked loop. Chosen by measurement on H100 (benchmarks/results).
FWD_ONE_PASS_MAX = 32768
BWD_ONE_PASS_MAX = 16384
FWD_BLOCKED = (1, 16384, 32, False)  # (BLOCK_M, column chunk, num_warps, one_pass)
# Rows of 2-byte elements up to this wide loop over half that chunk: H100, bf16, 256 MiB
# (tune-norm-h100-2026-11-23/14-*): LayerNorm 87.9 / 85.4% of copy at 40960 / 49152 (16384-element
# chunks: 70.9 / 80.0), RMSNorm 95.8 / 92.9 (77.6 / 85.7); at 65536 and wider the full chunk is
# faster (LayerNorm 82.5 against 78.7), and fp32 (add + RMSNorm) keeps it (97.8 / 93.7 at 40960 /
# 49152 against 95.6 / 92.1).
FWD_BLOCKED_HALF_CHUNK_MAX = 49152
BWD_BLOCKED = (4, 1024, 4, False, 4)  # (BLOCK_M, column chunk, num_warps, one_pass, programs/SM)
# Backward programs at most when the rows are few (decode sizes, M <= 256): a program a row up
# to this many, then 2 or 4 rows a program; each also writes dW/dB of its share of the columns
# (no partials, no second launch). H100 sweep (N = 4096, 4 warps for 1-2 rows a program, CUDA
# graphs, benchmarks/results/decode-h100-2026-11-24/): RMSNorm 3.3 / 3.5 / 4.4 / 6.2 us at
# M = 8 / 32 / 128 / 256 (partials summed by a second launch: 4.2 / 4.6 / 5.7 / 6.8).
BWD_DECODE_PROGRAMS = 64
# Backward rows too wide for the one-pass kernel are split across programs that exchange their
# partial row dot products (``_norm_bwd_split_kernel``), one program per SM so that every
# program of the grid is resident at once, which the exchange needs:
# (RMSNorm?, dtype) -> (columns per program, num_warps, stages: 0 the exchange in step, >= 2 a
# row ahead with the loads pipelined by Triton, weight slice kept packed: converted to fp32 where
# used, not held so). LLMKERNELS_ROW_SPLIT=0 turns the split off
# (``_rowsplit.split_grid``; the blocked loops then take every wide row).
# H100, 256 MiB (benchmarks/results/tune-norm-h100-2026-11-23/16-*): bf16 RMSNorm 94.5 / 92.8 /
# 92.3% of copy at 32768 / 65536 / 131072 (the exchange a row ahead with the next row in
# registers, as before: 76 / 73 / 75), bf16 LayerNorm 90.1 / 89.6 / 87.2 / 86.7 at 16384 ...
# 131072 (81 / 82 / 76 / 75), fp32 LayerNorm 96.0 / 97.4 / 97.3 at 16384 / 32768 / 65536 (94 /
# 86 / 91); fp32 RMSNorm 97.7 / 98.1 at 32768 / 65536 pipelined at 8 warps (in step 100.0 / 99.6;
# the in-step 16-warp entry shipped before read 86 / 86), fp32 add + RMSNorm 101.8 / 101.7 (in
# step 97.2 / 99.6; tune-norm-h100-2026-11-24/7-*). fp16 RMSNorm (Llama's
# rounding of x_hat to fp16) with its weight kept packed (``keep_packed``: 248 registers, no
# spill at 8 warps; held as fp32 it spilled 56 B), 93.6 / 92.2 / 92.3 at 32768 / 65536 / 131072
# (held: 75 / 74 / 71 at 8 warps, 93 / 91 / 88 at 32), fp16 add + RMSNorm 98.6 / 98.0 / 98.1
# (held: 94 / 92 / 91 at 16 warps; tune-norm-h100-2026-11-24/6-*). Kept packed, bf16 RMSNorm
# measured the same and bf16 LayerNorm 66-67 against 87-90: not there.
# The forward of rows wider than FWD_ONE_PASS_MAX likewise (``_norm_fwd_split_kernel``: the
# exchange a row ahead, each slice read again from L2 for y, that read issued before the wait on
# the siblings' sums), where measured faster than the blocked loop: (RMSNorm?, bytes per element,
# residual?) -> (columns per program, num_warps, programs per SM, narrowest row split, 0: wider
# than FWD_ONE_PASS_MAX; a 2-byte row that fills its power of two stays in one pass). Two-byte
# rows run two programs an SM: the loads of two 16 KB slices in flight (one is too little to cover
# the latency). LayerNorm's two sums go through one reduction into one slot (``publish_pair``) and
# its weight and bias are kept packed (``keep_packed``: 121 registers at 8 warps, no spill).
# H100, 256 MiB, % of copy (benchmarks/results/tune-norm-h100-2026-11-24/13-*), N = 36864 / 45056 /
# 65536 / 131072: bf16 LayerNorm 95.7 / 95.8 / 96.1 / 95.5 (the read after the wait: 92.5 / 92.2 /
# 94.4 / 94.1), fp16 96.2-96.4, fp32 97.1-99.0; bf16 RMSNorm 96.2 (blocked) / 96.2 / 96.6 / 95.8,
# fp16 96.8-97.2, fp32 97.7-99.0; 2-byte add + RMSNorm 96.7-98.1, fp32 96.8-99.3. fp32 add +
# RMSNorm rows up to 45056 are faster in the blocked loop (99.1 / 97.5 at 36864 / 40960 against
# 95.3 / 95.1; 2-byte RMSNorm there: 96.4 / 96.1 blocked, 95.8 / 96.1 split). RMSNorm and LayerNorm
# split from 16385, narrower than FWD_ONE_PASS_MAX, where the one-pass row's 32 warps leave part
# of a 32768 tile masked or hold fp32 (tune-norm-h100-2026-11-24/15-*, 16-*): bf16 LayerNorm 95.5 /
# 95.8 / 95.7 at 20480 / 24576 / 28672 (one pass: 80.8 / 89.7 / 94.0), RMSNorm 96.1 / 96.2 / 96.1
# (83.7 / 93.2 / 95.8); fp32 LayerNorm 95.2 / 98.6 / 97.2 / 98.8 at 20480 ... 32768 (95.1 / 93.5 /
# 92.9 / 91.7); a 2-byte row that fills its power of two stays in one pass (bf16 LayerNorm 97.1
# against 96.1 at 32768, RMSNorm 98.4).
FWD_SPLIT = {
    (True, 2, False): (8192, 8, 2, 16385),
    (True, 2, True): (8192, 4, 2, 0),
    (True, 4, False): (8192, 8, 1, 0),
    (True, 4, True): (8192, 8, 1, 49152),
    (False, 2, False): (8192, 8, 2, 16385),
    (False, 4, False): (8192, 8, 1, 16385),
}
# Rows that do not fill whole slices of the entry's columns: 2-byte rows then split into
# 4096-column slices, 4 warps, 4 programs an SM. H100, bf16, 256 MiB, % of copy
# (benchmarks/results/tune-norm-h100-2026-11-24/9-*, 13-*): LayerNorm 95.7 / 92.4 / 93.4 at
# N = 36864 / 70000 / 100000 (8192 x 8, 2 an SM, before the read was moved ahead of the wait: 89.5
# at 36864; after it 91.9 / 91.2 at 70000 / 100000); RMSNorm 93.0 / 93.9 at 70000 / 100000 against
# 93.2 / 92.6.
FWD_SPLIT_RAGGED = {
    (True, 2, False): (4096, 4, 4),
    (False, 2, False): (4096, 4, 4),
}
BWD_SPLIT = {
    (True, torch.bfloat16): (8192, 8, 3, False),
    (True, torch.float16): (8192, 8, 4, True),
    (True, torch.float32): (8192, 8, 3, False),
    (False, torch.bfloat16): (8192, 8, 3, False),
    (False, torch.float16): (8192, 8, 3, False),
    (False, torch.float32): (8192, 8, 4, False),
}


def _fwd_config(n: int, m: int, is_rms: bool = True, sms: int = 0, elem_size: int = 2, residual: bool = False):
    """(BLOCK_M, BLOCK_N, num_warps, one_pass, early_w, tail_n) for the forward of M rows of N
    elements of ``elem_size`` bytes (``residual``: with the residual add) on ``sms``
    multiprocessors (0: unknown, no decode rule); early_w: the weight loaded with the row; tail_n:
    0, or the power-of-two tile of the columns past BLOCK_N (``_norm_fwd_kernel``'s TAIL_N).

    H100 sweep (bf16, 256 MiB, statistics stored as in training; benchmarks/results/tune-norm-*):
    up to 4096 columns, tiles of 8192 (RMSNorm) or 4096 (LayerNorm) elements with 32 elements a
    thread, 98-99% of copy (16 warps on the same tiles: 72-88%). One row per program up to
    32768, 32 elements a thread as well: RMSNorm 98.4-99.7% at 5120-32768 with or without the
    statistics (96.6 at 28672), LayerNorm 98-99% at 8192 / 16384, 95-97 at 5120 / 12288 before
    the tail below (64 or 128 elements a thread, as chosen before: RMSNorm 78-94% with the
    statistics stored at 12288-32768, LayerNorm 92-93% at 5120 / 12288;
    tune-norm-h100-2026-11-24/15-*). Wider rows loop
    over 16384-element chunks with 32 warps (a persistent grid measured no better), 8192-element
    ones for 2-byte rows up to FWD_BLOCKED_HALF_CHUNK_MAX.

    Too few rows of 1K-8K elements to fill the GPU, or M <= 256 (decode sizes): latency, not
    bandwidth. A row per program, 8 warps (LayerNorm 4), the weight loaded with the row (N = 4096,
    H100, CUDA graphs, M = 1-256: 0.2-0.5 us faster than the bandwidth configuration,
    benchmarks/results/decode-h100-2026-11-23/; LayerNorm at M = 256 3.0 vs 3.5 us,
    decode-h100-2026-11-24/6-*; LayerNorm's 4 warps, with its two sums in one reduction: 0.03-0.12
    us faster than 8 at M = 1-128, level at 256, decode-h100-2026-11-24/15-*).

    A row of 4353-6144 or 8705-12288 elements without a residual is half its power of two (A)
    whole and a power-of-two tail of at least A / 8, A // 1024 warps but no more than leave the
    tail 8 elements a thread (fewer: LayerNorm 78% of copy at 4608 with 4 warps, 64 at 9216 with
    8). H100, 256 MiB, statistics stored, % of copy (tune-norm-h100-2026-11-25/3-*, 8-*):
    LayerNorm bf16 96.8 / 97.8 / 97.7 / 98.2 / 98.0 at 4608 / 5120 / 9216 / 10240 / 12288 (the power
    of two, 32 elements a thread: 90.3 / 94.0 / 87.5 / 89.1 / 94.2), fp32 98.1 / 99.9 / 99.6 at
    9216 / 10240 / 12288 (88.5 / 92.3 / 98.1); RMSNorm bf16 98.2 / 98.7 / 98.1 at 4608 / 9216 /
    10240 (95.8 / 91.4 / 94.0); within 1% elsewhere. Not with a residual: 99-101% either way, up
    to 1% less with the tail (fp32 24576: 92 against 101).
    """
    if n > FWD_ONE_PASS_MAX:
        block_m, chunk, num_warps, one_pass = FWD_BLOCKED
        if n <= FWD_BLOCKED_HALF_CHUNK_MAX and elem_size == 2:
            chunk //= 2
        return block_m, chunk, num_warps, one_pass, False, 0
    block_n = max(16, next_pow2(n))
    if block_n <= 4096:
        tile = 8192 if is_rms else 4096
        block_m = min(max(1, tile // block_n), next_pow2(m))
        num_warps = max(4, block_m * block_n // 1024)
    else:
        block_m = 1
        num_warps = block_n // 1024
    if 1024 <= block_n <= 8192 and sms and (cdiv(m, block_m) < sms or m <= 256):
        return 1, block_n, max(4, min(8, block_n // 512)) if is_rms else 4, True, True, 0
    if 8192 <= block_n <= 16384 and not residual and block_n // 32 < n - block_n // 2 <= block_n // 4:
        block_n //= 2
        tail_n = next_pow2(n - block_n)
        return 1, block_n, min(block_n // 1024, tail_n // 256), True, False, tail_n
    return block_m, block_n, num_warps, True, False, 0


# block_n -> (tile elements, num_warps, programs per SM, prefetch) of the one-pass backward;
# prefetch as ``_norm_bwd_kernel``'s PREFETCH: 0 none, 1 the next tile into registers, k >= 2
# Triton's pipelining with k stages (tiles k - 1 ahead copied into shared memory). H100 sweeps
# (bf16, 256 MiB, benchmarks/results/tune-norm-h100-2026-11-23/8-*, 14-*): LayerNorm 94.5 / 94.5 /
# 94.4 / 93.9% of copy at 1024 ... 8192 pipelined (registers: 91.4 / 90.1 / 90.5 / 83.8, none: 83 /
# 86 / 85 / 82); RMSNorm 95.9 / 95.9 at 1024 / 2048 pipelined (registers 90.0 / 92.9), 95.7 / 95.4
# / 95.2 at 4096 ... 16384 (16384: any prefetch spills); at 8192 pipelined for add + RMSNorm's
# sake, 98.2% (registers: 88.4; 19-*).
_BWD_TABLE = {
    True: {1024: (4096, 8, 1, 4), 2048: (4096, 4, 1, 4), 4096: (4096, 16, 2, 1),
           8192: (8192, 8, 1, 3), 16384: (16384, 16, 1, 0)},
    False: {1024: (4096, 4, 1, 4), 2048: (4096, 4, 1, 4), 4096: (8192, 16, 1, 3),
            8192: (8192, 16, 1, 3)},
}
# fp32 inputs where their own sweep found better (11-*): RMSNorm 101 / 98.9 / 96.9% at 2048 / 4096
# / 16384 (the 2-byte entries: 95.7 / 90.2 / 89), LayerNorm 98.4 / 97.1 / 97.2 at 2048 / 4096 / 8192
# (83 / 86-88 / 92-96); RMSNorm 8192 keeps the configuration measured for fp32 (98.8%, 15-*).
_BWD_TABLE_FP32 = {
    True: {2048: (2048, 8, 2, 1), 4096: (8192, 16, 1, 1), 8192: (8192, 16, 1, 1), 16384: (16384, 8, 1, 0)},
    False: {2048: (4096, 16, 1, 1), 4096: (8192, 8, 1, 1), 8192: (8192, 8, 1, 1)},
}

# Rows between two powers of two (the next power's tile partly masked) where their sweeps found
# other configurations better: (RMSNorm?, bytes per element) -> {power of two: (configuration, the
# widest such row in eighths of that power)}. H100, 256 MiB, % of copy (tune-norm-h100-2026-11-24/15-*,
# tune-norm-h100-2026-11-25/3-*), against the power of two's entry: 2-byte rows filling at most 5/8
# of it, tiles of 8192, 8 warps, 4 stages: RMSNorm 96.6 / 95.4 / 96.2 / 94.6 at 2304 / 2560 / 4608 /
# 5120 (85.3 / 89.5 / 86.6 / 90.3), add + RMSNorm 95.2 / 95.3 / 96.6 / 96.7 (86.0 / 89.9 / 96.5 /
# 97.4), LayerNorm 94.7 / 94.5 / 86.8 / 94.5 (79.9 / 84.9 / 81.8 / 84.8); fuller rows lose 1-3% with
# it (RMSNorm 93.7 / 93.9 / 93.7 against 94.1 / 95.6 / 96.4 at 3072 / 3584 / 7168). fp32 RMSNorm
# every row between 2048 and 4096 in tiles of 4096, 8 warps, 2 programs an SM: 100.3 / 100.8 / 100.2
# / 98.0 at 2304 / 2560 / 3072 / 3584 (92.7 / 95.4 / 98.6 / 99.0), add + RMSNorm 102.7 / 103.0 /
# 100.4 / 100.5 (82.7 / 84.4 / 88.1 / 92.4); fp32 LayerNorm up to 5/8, 3 stages: 95.9 / 96.0 / 95.8
# / 96.0 at 2304 / 2560 / 4608 / 5120 (88.9 / 92.7 / 89.3 / 93.0).
_BWD_TABLE_RAGGED = {
    (True, 2): {4096: ((8192, 8, 1, 4), 5), 8192: ((8192, 8, 1, 4), 5)},
    (False, 2): {4096: ((8192, 8, 1, 4), 5), 8192: ((8192, 8, 1, 4), 5)},
    (True, 4): {4096: ((4096, 8, 2, 1), 8)},
    (False, 4): {4096: ((8192, 8, 1, 3), 5), 8192: ((8192, 8, 1, 3), 5)},
}


def _bwd_config(n: int, m: int, is_rms: bool = True, sms: int = 0, elem_size: int = 2):
    """(BLOCK_M, BLOCK_N, num_warps, one_pass, programs per SM, most programs or 0, prefetch, tail_n)
    for the backward of inputs of ``elem_size`` bytes on ``sms`` multiprocessors (0: unknown, no
    decode rule); tail_n: 0, or the power-of-two tile of the columns past BLOCK_N
    (``_norm_bwd_kernel``'s TAIL_N).

    LayerNorm keeps a dB accumulator beside dW; a 16384-wide row then spills registers (fp32:
    14% of copy on H100, bf16: 51%), so LayerNorm rows over 8192 leave the one-pass kernel
    (for the split one where it applies), but for the tail below.

    2-byte rows of 8193-12288 (not at decode sizes): 8192 columns whole and a power-of-two tail,
    8 warps, 3 stages. H100, bf16, 256 MiB, % of copy at 9216 / 10240 / 12288
    (tune-norm-h100-2026-11-25/6-*): RMSNorm 94.8 / 94.2 / 94.4 (a 16384 tile: 84.7 / 87.7 / 93.2),
    add + RMSNorm 97.7 / 97.3 / 98.0 (86.7 / 90.0 / 94.2), LayerNorm 91.2 / 92.2 / 91.7 (the split
    backward: 60.3 / 66.6 / 77.4). Narrower rows lose with a tail (2560 / 5120: 70-94 against
    94-97 for their ragged entries).

    Few rows (decode sizes: M <= 4 * BWD_DECODE_PROGRAMS, no more tiles than persistent
    programs): at most BWD_DECODE_PROGRAMS programs, each taking its rows as one tile (two for
    LayerNorm at M = 256: 8192-element tiles at most, for the same spills; two for LayerNorm at
    M = 5-16 too), 4 warps up to 2 rows of 4096 (8 for 4: 0.3-0.5 us faster than 8 and 16 at
    M = 8-128 on H100).
    """
    head = BWD_ONE_PASS_MAX // 2
    if elem_size == 2 and head < n <= head * 3 // 2 and not (sms and m <= 4 * BWD_DECODE_PROGRAMS):
        return 1, head, 8, True, 1, 0, 3, next_pow2(n - head)
    if n > BWD_ONE_PASS_MAX or (not is_rms and n > head):
        return BWD_BLOCKED + (0, 0, 0)
    block_n = max(16, next_pow2(n))
    width = max(1024, block_n)
    fp32_cfg = _BWD_TABLE_FP32[is_rms].get(width) if elem_size == 4 else None
    ragged_cfg, widest = _BWD_TABLE_RAGGED.get((is_rms, elem_size), {}).get(width, (None, 0))
    if n == block_n or n * 8 > widest * block_n:
        ragged_cfg = None
    tile, num_warps, per_sm, prefetch = ragged_cfg or fp32_cfg or _BWD_TABLE[is_rms][width]
    block_m = min(max(1, tile // block_n), next_pow2(m))
    if m <= 4 * BWD_DECODE_PROGRAMS and cdiv(m, block_m) <= sms * per_sm:
        max_tile = 16384 if is_rms else 8192
        block_m = min(max(1, max_tile // block_n), next_pow2(cdiv(m, BWD_DECODE_PROGRAMS)))
        if not is_rms and 4 < m <= 16:  # measured: LayerNorm 3.5 vs 4.3 us at M = 8, 4.9 vs 5.5 at 16
            block_m = min(2, max(1, max_tile // block_n))
        return block_m, block_n, max(4, min(8, block_m * block_n // 2048)), True, per_sm, BWD_DECODE_PROGRAMS, 0, 0
    return block_m, block_n, num_warps, True, per_sm, 0, prefetch, 0


def _fwd_split_config(is_rms: bool, elem_size: int, has_residual: bool, n: int):
    """(columns per program, num_warps, programs per SM) of the split forward of rows of ``n``
    (from the entry's narrowest row split; 0: wider than FWD_ONE_PASS_MAX), or None: the one-pass
    kernel (also for a 2-byte row that fills its power of two) or the blocked loop."""
    key = (is_rms, elem_size, has_residual)
    cfg = FWD_SPLIT.get(key)
    if cfg is None or n < (cfg[3] or FWD_ONE_PASS_MAX + 1):
        return None
    if elem_size == 2 and n <= FWD_ONE_PASS_MAX and n == next_pow2(n):
        return None
    return FWD_SPLIT_RAGGED[key] if n % cfg[0] and key in FWD_SPLIT_RAGGED else cfg[:3]


def _split_config(is_rms: bool, dtype: torch.dtype):
    """(columns per program, num_warps, stages, weight kept packed) of the split backward of
    ``dtype`` inputs."""
    return BWD_SPLIT[is_rms, dtype]
