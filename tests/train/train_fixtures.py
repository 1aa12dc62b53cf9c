"""Shared pieces of the Megatron model tests (test_model.py, test_lora.py, the peak-memory tests); the fixtures are
in conftest.py."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from tiny_models import SMALL

REPO = Path(__file__).resolve().parents[2]
ARCHS = ["llama", "qwen2"]  # the SMALL GQA Llama (tied) and Qwen2 (qkv bias, untied) of tiny_models.build_random_hf


def random_ids(batch: int = 2, seq: int = 24) -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(7))


def peak_tensor_bytes(run: Callable[[], object]) -> int:
    """Peak bytes of CPU tensor storage live at once while `run()` runs, above what was live before it: every
    allocation and free of torch's CPU allocator, as the profiler records them (`profile_memory`), summed in time
    order. Tensor bytes, not the resident set: RSS also reads the heap's history (freed chunks reused without the RSS
    growing, blocks glibc keeps), which moved with whatever ran earlier in the process; CI once read 162 MiB where a
    quiet run read 73 for the same fused loss. Library scratch outside torch's allocator (BLAS workspaces) is not
    counted, and is not what these tests bound."""
    from torch._C._autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == DeviceType.CPU]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()  # negative for a free
        peak = max(peak, live)
    return peak


def run_tp2_worker(worker: str) -> None:
    """tests/train/WORKER under torchrun, 2 gloo processes (one thread each): both ranks must print `TP2 OK`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(Path(__file__).with_name(worker))]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("TP2 OK") == 2, proc.stdout[-3000:]
