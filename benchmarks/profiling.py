"""Where a benchmark's training steps spend their time: ``torch.profiler`` tables of a few steps,
written beside the benchmark's results (``moe_train.py --profile``, ``moe_lora_bench.py --profile``)."""
from __future__ import annotations


def write_profile(run, device, path: str, rows: int = 40) -> None:
    """Runs ``run()`` (a few training steps) under ``torch.profiler`` and writes to ``path`` the
    device-time table, to see where a step's GPU time goes, then the host-time table (self CPU),
    to see where a host-bound step goes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()
    table = prof.key_averages().table
    with open(path, "w") as f:
        if cuda:
            f.write(table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=90) + "\n")
        f.write(table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=90))
