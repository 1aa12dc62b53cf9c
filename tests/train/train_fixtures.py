"""Shared pieces of the Megatron model tests (test_model.py, test_lora.py, the peak-memory tests); the fixtures are
in conftest.py."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
from tiny_models import SMALL

ARCHS = ["llama", "qwen2"]  # the SMALL GQA Llama (tied) and Qwen2 (qkv bias, untied) of tiny_models.build_random_hf


def random_ids(batch: int = 2, seq: int = 24) -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(7))


needs_peak_rss = pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                                    reason="needs Linux /proc peak-RSS reset")


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def peak_rss_growth(run: Callable[[], object]) -> int:
    """Bytes the process's peak resident set grows by while `run()` runs (tests marked `needs_peak_rss`)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset this process's peak RSS (VmHWM) to the current RSS
    before = _status_bytes("VmRSS")
    run()
    return _status_bytes("VmHWM") - before
