"""DDP and FSDP2 training of a patched model, and a sequence-parallel DTensor RMSNorm, on 2 CPU
processes with gloo (benchmarks/distributed_train.py --check): same losses as one process."""
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
SCRIPT = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "distributed_train.py")


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU runs use torchrun on the multi-GPU machine")
@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
def test_ddp_fsdp2_and_sequence_parallel_norm_match_one_process():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, SCRIPT, "--check", "--steps", "3", "--seq", "16"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.count(" ok") == 3, proc.stdout
