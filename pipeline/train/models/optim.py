"""The optimizer and LR schedule of both backends, built from one set of hyper-parameters.

Megatron-Core's student gets Megatron's optimizer (`megatron_optimizer_config` for `get_megatron_optimizer`), the
transformers student a torch optimizer with the same update rule (`torch_optimizer`), and both Megatron's warmup +
cosine schedule (`lr_scheduler`): AdamW with betas 0.9/0.95 and eps 1e-8, or SGD with momentum 0.9.
"""

from __future__ import annotations

from typing import Protocol

import torch

ADAM_BETAS = (0.9, 0.95)
ADAM_EPS = 1e-8
SGD_MOMENTUM = 0.9


class OptimSettings(Protocol):
    """The hyper-parameters read here: TrainConfig has them (a protocol keeps the models below the config)."""

    optimizer: str
    lr: float
    min_lr: float
    weight_decay: float
    clip_grad: float
    use_distributed_optimizer: bool
    warmup_steps: int
    train_steps: int


def megatron_optimizer_config(cfg: OptimSettings, bf16: bool):
    """Megatron's OptimizerConfig of this run (fp32 main weights and grads under bf16)."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer=cfg.optimizer, lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
        adam_beta1=ADAM_BETAS[0], adam_beta2=ADAM_BETAS[1], adam_eps=ADAM_EPS, sgd_momentum=SGD_MOMENTUM,
        clip_grad=cfg.clip_grad, bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
    )


def torch_optimizer(groups: list[dict], cfg: OptimSettings) -> torch.optim.Optimizer:
    """The torch optimizer Megatron's `get_megatron_optimizer` builds on CPU, over `groups` (param groups)."""
    if cfg.optimizer == "adam":
        return torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=ADAM_BETAS, eps=ADAM_EPS)
    return torch.optim.SGD(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=SGD_MOMENTUM)


def lr_scheduler(optimizer, cfg: OptimSettings):
    """Megatron's schedule: linear warmup from 0 over warmup_steps, cosine to min_lr at train_steps; constant
    weight decay."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=cfg.lr, min_lr=cfg.min_lr, lr_warmup_steps=cfg.warmup_steps,
        lr_decay_steps=cfg.train_steps, lr_decay_style="cosine", start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay, wd_incr_steps=cfg.train_steps, wd_incr_style="constant",
    )
