"""Shared pieces of the Megatron model tests (test_model.py, test_lora.py, the peak-memory tests); the fixtures are
in conftest.py."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tiny_models import SMALL

REPO = Path(__file__).resolve().parents[2]
ARCHS = ["llama", "qwen2"]  # the SMALL GQA Llama (tied) and Qwen2 (qkv bias, untied) of tiny_models.build_random_hf


def random_ids(batch: int = 2, seq: int = 24) -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(7))


needs_peak_rss = pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                                    reason="needs Linux /proc peak-RSS reset")


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _return_free_heap_pages() -> None:
    """glibc's malloc_trim(0): give the free pages of every arena back to the OS. Without it, a process that ran
    earlier tests keeps freed-but-resident heap chunks (a whole suite's worth), allocations reuse them without the
    RSS growing, and a peak measured as RSS growth reads near 0 (CI, after the suite's earlier tests: the masked
    8k-token row measured 64-128 MiB and the per-document one 0, instead of 256 and 35 alone)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: no trim, the measurement is as good as that allocator allows
        pass


def peak_rss_growth(run: Callable[[], object]) -> int:
    """Bytes the process's peak resident set grows by while `run()` runs (tests marked `needs_peak_rss`)."""
    _return_free_heap_pages()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset this process's peak RSS (VmHWM) to the current RSS
    before = _status_bytes("VmRSS")
    run()
    return _status_bytes("VmHWM") - before


def run_tp2_worker(worker: str) -> None:
    """tests/train/WORKER under torchrun, 2 gloo processes (one thread each): both ranks must print `TP2 OK`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(Path(__file__).with_name(worker))]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("TP2 OK") == 2, proc.stdout[-3000:]
