"""Shared pieces of the Megatron model tests (test_model.py, test_lora.py); the fixtures are in conftest.py."""

from __future__ import annotations

import torch
from tiny_models import SMALL

ARCHS = ["llama", "qwen2"]  # the SMALL GQA Llama (tied) and Qwen2 (qkv bias, untied) of tiny_models.build_random_hf


def random_ids(batch: int = 2, seq: int = 24) -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(7))
