"""Global decoder-layer numbering under pipeline parallelism: each stage's GPTModel numbers its own layers from 0, so
what must be the same at any pipeline size (HF weight names, checkpoint keys, LoRA seeds) uses the global index.
Megatron is imported inside `layer_offset`: lora.py, which the hf backend and the engine actors read, imports this
module without it."""

from __future__ import annotations

import re

import torch


def layer_offset(model: torch.nn.Module) -> int:
    """The global index of `model`'s first layer (its pipeline stage and virtual stage)."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(model.config, getattr(model, "vp_stage", None))


def layer_key(key: str, shift: int) -> str:
    """Shift the layer index of a `decoder.layers.N.` key (local <-> global under pipeline parallelism)."""
    match = re.match(r"decoder\.layers\.(\d+)\.(.*)", key)
    return key if match is None else f"decoder.layers.{int(match[1]) + shift}.{match[2]}"
