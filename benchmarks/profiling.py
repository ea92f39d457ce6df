"""Where a benchmark's training steps spend their time: ``torch.profiler`` tables of a few steps,
written beside the benchmark's results (``moe_train.py --profile``, ``moe_lora_bench.py --profile``)."""
from __future__ import annotations

import re
from collections import defaultdict

# Host calls after which the GPU's queue can run dry: a copy to or from pageable host memory and
# the waits. The third table names the Python lines that made them.
WAITS = ("cudaMemcpyAsync", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")
STACK_FRAMES = 4  # the innermost Python frames that name a wait's caller
FRAME = re.compile(r".+\(\d+\): \S+$")  # a traced Python call's event name: "file.py(123): function"


def python_frames(event, frames: int = STACK_FRAMES) -> tuple:
    """The innermost ``frames`` Python frames around a profiler ``event`` (``file(line): name``),
    from the nearest enclosing op's recorded stack or, where the profiler traced Python calls as
    events of their own, from the enclosing call events; ``()`` when its parents carry none."""
    found, owner = [], event
    while owner is not None and len(found) < frames:
        if owner.stack:
            return tuple(found + list(owner.stack))[:frames]
        if FRAME.match(owner.name):
            found.append(owner.name)
        owner = owner.cpu_parent
    return tuple(found)


def enclosing_calls(event, calls: list, frames: int = STACK_FRAMES) -> tuple:
    """The innermost ``frames`` traced Python ``calls`` whose time spans ``event``'s, on any thread:
    the CUDA runtime's own events (a copy, a wait) often come without a parent op on the host
    thread that made them, so their time is what places them."""
    start, end = event.time_range.start, event.time_range.end
    around = [c for c in calls if c.time_range.start <= start and c.time_range.end >= end]
    around.sort(key=lambda c: -c.time_range.start)
    return tuple(c.name for c in around[:frames])


def wait_sources(events, names=WAITS, frames: int = STACK_FRAMES) -> list:
    """``[(name, python frames, calls, self CPU us)]`` of the profiler's ``events`` (recorded
    ``with_stack``) whose name is in ``names``, grouped by ``python_frames`` (or, where an event
    has no parent with a frame, ``enclosing_calls``), most host time first."""
    calls = [e for e in events if FRAME.match(e.name)]
    groups = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.name in names:
            where = python_frames(e, frames) or enclosing_calls(e, calls, frames) or ("(no Python frame)",)
            group = groups[(e.name, where)]
            group[0] += 1
            group[1] += e.self_cpu_time_total
    return sorted(((name, where, n, us) for (name, where), (n, us) in groups.items()), key=lambda row: -row[3])


def write_profile(run, device, path: str, rows: int = 40) -> None:
    """Runs ``run()`` (a few training steps) under ``torch.profiler`` and writes to ``path`` the
    device-time table, to see where a step's GPU time goes, then the host-time table (self CPU),
    to see where a host-bound step goes, then where the host copied or waited (``wait_sources``)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    # (Python frames on a GPU only: traced through Triton's interpreter, a CPU step takes minutes)
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda, with_stack=cuda) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()
    table = prof.key_averages().table
    with open(path, "w") as f:
        if cuda:
            f.write(table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=90) + "\n")
        f.write(table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=90) + "\n\n")
        f.write("Host copies and waits by the Python lines that made them (calls, self CPU):\n")
        for name, where, calls, us in wait_sources(prof.events())[:rows]:
            f.write(f"{name}: {calls} calls, {us / 1e3:.3f} ms\n" + "".join(f"    {frame}\n" for frame in where))
