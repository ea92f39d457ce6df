"""Launch configurations of the norm kernels at decode sizes (M = 1..256 rows, N = 4096, bf16),
timed as calls replayed from a CUDA graph (the GPU time alone; ``llmkernels.bench``'s
``decode_graph`` timing). Forward with the statistics stored (as in training), backward with
the dW/dB partials summed. Used to choose the small-M rules of ``_fwd_config`` and
``_bwd_config`` in ``llmkernels/ops/norm.py`` (each sweep replaces them with a fixed configuration).

    python benchmarks/decode_sweep.py            # writes $OUT/decode_sweep.json (or ./)
"""
import itertools
import json
import os

import torch

from llmkernels.bench.runner import _graph_latency_ms
from llmkernels.ops import norm as N_

N = 4096


def time_us(fn) -> float:
    return 1e3 * _graph_latency_ms(lambda: fn)


def main():
    records = []
    default_fwd, default_bwd, default_programs = N_._fwd_config, N_._bwd_config, N_.persistent_programs
    sms = default_programs(torch.device("cuda"), 1)
    for is_rms, m in itertools.product([True, False], [1, 8, 32, 128, 256]):
        x = torch.randn(m, N, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        b = None if is_rms else torch.randn(N, device="cuda", dtype=torch.bfloat16)
        y, _, mean, rstd = N_._norm_fwd(x, w, b, None, 1, 1e-6, 0.0, is_rms, is_rms, x.dtype, None, True)
        dy = torch.randn_like(y)

        def fwd():
            return N_._norm_fwd(x, w, b, None, 1, 1e-6, 0.0, is_rms, is_rms, x.dtype, None, True)

        def bwd():
            return N_._norm_bwd(dy, None, x, w, None if b is None else b.dtype, mean, rstd, 1, 0.0, is_rms, is_rms,
                                x.dtype, None)

        base = {"op": "rms" if is_rms else "ln", "n": N, "m": m}
        records.append(dict(base, which="fwd", cfg="default", us=time_us(fwd)))
        records.append(dict(base, which="bwd", cfg="default", us=time_us(bwd)))
        # (BLOCK_M, BLOCK_N, warps, one_pass, programs per SM, weight loaded with the row)
        for block_m, warps, early in itertools.product([1, 2, 4], [2, 4, 8, 16], [False, True]):
            if block_m <= m:
                cfg = (block_m, N, warps, True, 0, early)
                N_._fwd_config = lambda *_, c=cfg: c
                try:
                    records.append(dict(base, which="fwd", cfg=list(cfg), us=time_us(fwd)))
                finally:
                    N_._fwd_config = default_fwd
        # (BLOCK_M, BLOCK_N, warps, one_pass, programs per SM, no program cap); programs per SM
        # below 1: fewer programs than SMs (fewer partials to sum)
        for block_m, warps, per_sm in itertools.product([1, 2, 4], [4, 8, 16], [0.25, 0.5, 1, 2]):
            if block_m <= m:
                cfg = (block_m, N, warps, True, per_sm, 0)
                N_._bwd_config = lambda *_, c=cfg: c
                N_.persistent_programs = lambda device, k: max(1, int(sms * k))
                try:
                    records.append(dict(base, which="bwd", cfg=list(cfg), us=time_us(bwd)))
                finally:
                    N_._bwd_config, N_.persistent_programs = default_bwd, default_programs
        for which in ("fwd", "bwd"):
            mine = [r for r in records if r["op"] == base["op"] and r["m"] == m and r["which"] == which]
            best = min(mine, key=lambda r: r["us"])
            print(f"{base['op']} {which} M={m}: default {mine[0]['us']:.2f} us, best {best['us']:.2f} {best['cfg']}",
                  flush=True)
    out = os.path.join(os.environ.get("OUT", "."), "decode_sweep.json")
    with open(out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "records": records}, f, indent=0)


if __name__ == "__main__":
    main()
