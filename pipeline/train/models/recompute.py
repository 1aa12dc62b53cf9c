"""Activation recompute (`recompute: none|selective|full`) through Megatron-Core's own TransformerConfig options.

- `selective`: Megatron's `recompute_granularity="selective"` with its default `recompute_modules=["core_attn"]`:
  the core attention runs again in backward, so its internals are not kept. With `attention: local` that drops
  the `[b, heads, s, s]` scores and probabilities (the bulk of activation memory at long sequences); with
  `attention: sdpa` the flash kernels keep only their output and log-sum-exp anyway, so it saves little there.
- `full`: `recompute_granularity="full"`, `recompute_method="uniform"`, `recompute_num_layers=1`: every transformer
  layer keeps only its input and is recomputed in backward (about one more forward per step).

Both go through `tensor_parallel.checkpoint` (Megatron's reentrant checkpoint), which snapshots and restores the
RNG tracker states; on CPU compat.py maps those onto the CPU generator, and `distribute_saved_activations` stays off
(its gather needs a TP split of the saved input; compat.py covers `gather_split_1d_tensor` too).

A reentrant checkpoint only builds a graph when one of its tensor inputs requires grad. Under `full`, layer 0's input
is the embedding output, which does not when the embedding is frozen (LoRA students): the adapters inside the
checkpointed layers would get no gradient (measured: backward fails with "element 0 of tensors does not require
grad" once nothing after them is trainable either). `build_model` therefore calls `keep_inputs_differentiable`, which
marks that output as requiring grad (the same fix as transformers' `enable_input_require_grads`); the embedding
weights themselves stay frozen.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

MODES = ("none", "selective", "full")
# TransformerConfig warns on every selective config that Transformer Engine's fused attention would not need it;
# there is no Transformer Engine here, so the warning is noise (README: quiet by default).
warnings.filterwarnings("ignore", message="If you are using transformer_engine", category=UserWarning,
                        module="megatron.core.transformer.transformer_config")


def recompute_options(recompute: str) -> dict[str, Any]:
    """TransformerConfig keyword arguments for a recompute mode."""
    if recompute not in MODES:
        raise ValueError(f"recompute={recompute!r}: choose one of {', '.join(MODES)}")
    if recompute == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    if recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    return {}


def keep_inputs_differentiable(model: torch.nn.Module) -> None:
    """Under full recompute: make the embedding output require grad when the embedding is frozen (see above)."""
    embedding = getattr(model, "embedding", None)
    if embedding is None:  # not the first pipeline stage: its input arrives from p2p and requires grad already
        return

    def hook(module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        if module.training and torch.is_grad_enabled() and not output.requires_grad:
            output.requires_grad_(True)
        return output

    embedding.register_forward_hook(hook)
