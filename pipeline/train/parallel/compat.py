"""Make megatron-core 0.16.1 run on a CPU-only machine (laptop / CI), and do nothing anywhere else.

Megatron-Core assumes a GPU in a handful of places that are otherwise device-agnostic: it calls
`torch.cuda.current_device()` to pick where to allocate, writes `device="cuda"` in tensor literals,
calls `torch.cuda.synchronize()`, and keeps its RNG tracker in CUDA generator states. On a CPU build of
torch each of these raises "Torch not compiled with CUDA enabled". There is no switch for it in 0.16.1.

The fix is scoped, not global: for each megatron module listed in `_CPU_MODULES` (with the reason it is
there) the module-level name `torch` is rebound to `_CpuTorch`, a thin view of torch whose `torch.cuda`
answers `current_device()` with "cpu", makes `synchronize()` a no-op and maps the CUDA RNG calls onto the
CPU generator, and whose tensor factories map `device="cuda"` to the CPU. Nothing outside those modules
(vLLM, transformers, our own code) sees any change; the real `torch` module is not modified (one exception,
scoped to a single call, is described below).
Every patched call would have raised on this machine, so no working behaviour changes either.

Five spots are not module-level `torch` lookups and get function-level patches instead: the RNG tracker's
state helpers, grad clipping's `param.grad.type() == 'torch.cuda.FloatTensor'` assert, the `.cuda()` in the
tied-embedding setup under pipeline parallelism, RoPE's pinned-memory `.cuda()` chunk index under context parallelism, and the `param.type()` sort of their parameters in the bf16 optimizer and the
distributed optimizer. One patch is for speed, not for CUDA: the frozen-weight linear's backward (LoRA students) as a 2-D GEMM,
see `_patch_frozen_linear`. Known limit: sequence parallelism needs Transformer Engine (docs/dependencies.md); the distributed
optimizer's checkpoint needs the format and state handling of pipeline/train/checkpoint.py (not a CUDA matter). On CPU the tracker's
"default" stream is the global CPU generator, so `model_parallel_cuda_manual_seed(seed)` reseeds torch itself.

Usage (pipeline/train/parallel/groups.py does this before building a model)::

    from pipeline.train.parallel.compat import apply_cpu_compat
    apply_cpu_compat()   # no-op when CUDA is available; safe to call twice
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable
from typing import Any

import torch

# Megatron modules whose functions we need on CPU, each with the CUDA assumption it makes (0.16.1 line numbers).
_CPU_MODULES: dict[str, str] = {
    # RNG tracker: torch.cuda.manual_seed / get_rng_state (L235-238, L422); fork() helpers patched below. Activation
    # recompute (CheckpointFunction, L496) snapshots and restores all RNG states through the same helpers.
    "megatron.core.tensor_parallel.random": "rng tracker",
    # torch.empty(..., device=torch.cuda.current_device()) in the TP all-gather / reduce-scatter (L91, L141).
    "megatron.core.tensor_parallel.mappings": "tp gathers",
    # Parameter allocation when use_cpu_initialization is off; vocab-parallel gathers (L261, L552...).
    "megatron.core.tensor_parallel.layers": "tp layers",
    # gather_split_1d_tensor buffers (L70, L91), used by activation checkpointing.
    "megatron.core.tensor_parallel.utils": "tp utils",
    # RoPE moves inv_freq to torch.cuda.current_device() on the first forward (L78, L162, L297).
    "megatron.core.models.common.embeddings.rotary_pos_embedding": "rope",
    # get_default_causal_mask: torch.ones(sq, sq, device="cuda") (L35, L40); used by fused_softmax.py L322/L327.
    "megatron.core.transformer.utils": "causal mask",
    # softmax_offset / static-batch inference buffers on torch.cuda.current_device() (dot_product_attention L123,
    # attention L430, gpt_model L415, module L249).
    "megatron.core.transformer.dot_product_attention": "attention buffers",
    "megatron.core.transformer.attention": "attention buffers",
    "megatron.core.transformer.module": "module buffers",
    "megatron.core.models.gpt.gpt_model": "gpt buffers",
    # total_num_tokens = torch.zeros([], device="cuda") in every schedule (L596, L983, L2138).
    "megatron.core.pipeline_parallel.schedules": "schedules",
    # PP send/recv shape buffers on torch.cuda.current_device() (L190-202, L313, L321).
    "megatron.core.pipeline_parallel.p2p_communication": "pp p2p",
    # found_inf / _scale_one / _dummy_overflow_buf literals on "cuda" (L473-485, L907, L1141).
    "megatron.core.optimizer.optimizer": "optimizer",
    # DistributedOptimizer: the dummy optimizer-state shards it allocates to load a checkpoint into, on
    # torch.cuda.current_device() (L791), and the gathers of its non-gloo parameter-state paths (L1077).
    "megatron.core.optimizer.distrib_optimizer": "distributed optimizer",
    # total_norm_cuda, grad_norm, dummy_overflow_buf on "cuda" (L90, L103, L115, L174, L207).
    "megatron.core.optimizer.clip_grads": "grad clipping",
    # local_multi_tensor_l2_norm (the no-apex path of clip_grads) returns a "cuda" tensor (L1207);
    # GlobalMemoryBuffer.get_tensor (L631).
    "megatron.core.utils": "l2 norm / global buffer",
    # DDP grad buffers on torch.cuda.current_device() (param_and_grad_buffer L768-806).
    "megatron.core.distributed.param_and_grad_buffer": "ddp buffers",
    # torch.cuda.synchronize() around checkpoint writes (tensor_aware_state_dict L304, filesystem_async L230,
    # fully_parallel L272/L281, async_utils L212), a "cuda" tensor in state_dict_saver L204/L252.
    "megatron.core.dist_checkpointing.tensor_aware_state_dict": "ckpt sync",
    "megatron.core.dist_checkpointing.strategies.filesystem_async": "ckpt sync",
    "megatron.core.dist_checkpointing.strategies.fully_parallel": "ckpt sync",
    "megatron.core.dist_checkpointing.strategies.async_utils": "ckpt sync",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": "ckpt verify",
    "megatron.core.dist_checkpointing.exchange_utils": "ckpt exchange buffers",
}

_APPLIED = False


def _cpu_device(device: Any) -> Any:
    """Map a CUDA device spec ("cuda", "cuda:0", torch.device("cuda")) to the CPU; leave others alone."""
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return "cpu"
    return device


def _on_cpu(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Wrap a tensor factory (torch.zeros, torch.tensor, ...) so a `device="cuda"` keyword lands on the CPU."""

    def wrapper(*args: Any, **kwargs: Any) -> torch.Tensor:
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return factory(*args, **kwargs)

    wrapper.__name__ = factory.__name__
    wrapper.__doc__ = f"CPU-compat wrapper of torch.{factory.__name__} (see pipeline/train/parallel/compat.py)."
    return wrapper


class _CpuCuda(types.SimpleNamespace):
    """`torch.cuda` as megatron sees it on a CPU machine; everything not overridden is the real torch.cuda."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _CpuTorch(types.SimpleNamespace):
    """`torch` as the modules in `_CPU_MODULES` see it on a CPU machine; everything else is the real torch."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _make_cpu_torch() -> _CpuTorch:
    cuda = _CpuCuda(
        current_device=lambda: "cpu",
        synchronize=lambda *a, **k: None,
        empty_cache=lambda: None,
        # The RNG tracker seeds and snapshots "the CUDA generator"; on CPU the only generator is the CPU one.
        manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed,
        get_rng_state=lambda *a, **k: torch.get_rng_state(),
        set_rng_state=lambda state, *a, **k: torch.set_rng_state(state),
    )
    factories = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like", "empty_like")
    return _CpuTorch(cuda=cuda, **{name: _on_cpu(getattr(torch, name)) for name in factories})


def _patch_rng_tracker(random_mod: types.ModuleType) -> None:
    """CudaRNGStatesTracker.fork() swaps generator states through these two helpers (random.py L41, L72), which
    reach into torch.cuda.default_generators / _C._cuda_setRNGState directly; point them at the CPU generator."""

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()  # already a copy

    def set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    random_mod._get_cuda_rng_state = get_state
    random_mod._set_cuda_rng_state = set_state


def _clip_grad_by_total_norm_fp32(
    parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
) -> None:
    """CPU stand-in for clip_grads.clip_grad_by_total_norm_fp32 (clip_grads.py L138): the original asserts
    `param.grad.type() == 'torch.cuda.FloatTensor'` (L167), a tensor method no module-level shim can answer.
    Same arithmetic: scale every fp32 grad in place by max_norm / (total_norm + 1e-6) when that is < 1."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else parameters
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr, None) for p in params]
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads if g is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        torch._foreach_mul_([g.detach() for g in grads], clip_coeff)


def _patch_tied_embedding_setup(language_module: types.ModuleType) -> None:
    """LanguageModule.setup_embeddings_and_output_layer (language_module.py L244) does `weight.data.cuda()` before
    all-reducing the tied embedding across the first and last pipeline stage (tied embeddings with pp > 1 only).
    A Tensor method cannot be shimmed per module, so make Tensor.cuda the identity for the length of that call."""
    cls = language_module.LanguageModule
    original = cls.setup_embeddings_and_output_layer

    def setup_embeddings_and_output_layer(self: Any) -> None:
        saved = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *a, **k: t
        try:
            original(self)
        finally:
            torch.Tensor.cuda = saved

    cls.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer


def _patch_frozen_linear(layers: types.ModuleType) -> None:
    """LinearWithFrozenWeight.backward (layers.py L348, used for every frozen weight: LoRA students) computes
    `grad_output.matmul(weight)` on a 3-D grad. The output layer's grad arrives non-contiguous, and on CPU torch
    then runs a batched matmul over an expanded weight: 2.1 s instead of 0.5 s for [256, 8, 49152] x [49152, 576]
    (measured here), which made a LoRA step slower than a full one. Same product as one 2-D GEMM."""

    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple:
        (weight,) = ctx.saved_tensors
        flat = grad_output.reshape(-1, grad_output.shape[-1]) @ weight
        grad_input = flat.view(*grad_output.shape[:-1], weight.shape[-1])
        if ctx.allreduce_dgrad:
            torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
        return grad_input, None, None, None, None

    layers.LinearWithFrozenWeight.backward = staticmethod(backward)


def _with_cuda_type_names(cls: type, why: str) -> None:
    """Run `cls.__init__` with `Tensor.type()` (no arguments) answering the CUDA name of the same dtype
    ('torch.FloatTensor' -> 'torch.cuda.FloatTensor'), for the length of that call only. `why`: where the class
    sorts its parameters by those names (and raises TypeError for any other)."""
    original = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        saved = torch.Tensor.type

        def cuda_named_type(t: torch.Tensor, *a: Any, **k: Any) -> Any:
            name = saved(t, *a, **k)
            if a or k or not isinstance(name, str) or t.is_cuda:
                return name
            return name.replace("torch.", "torch.cuda.", 1)

        torch.Tensor.type = cuda_named_type
        try:
            original(self, *args, **kwargs)
        finally:
            torch.Tensor.type = saved

    __init__.__doc__ = f"CPU-compat wrapper (pipeline/train/parallel/compat.py): {why}"
    cls.__init__ = __init__


def _pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group: Any) -> torch.Tensor:
    """rope_utils.get_pos_emb_on_this_cp_rank (L48) without its pinned-memory index and `.cuda()`: the same zig-zag
    selection (chunks r and 2N-1-r of 2N along `seq_dim`, context_parallel.py), on the embedding's device."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    size, rank = cp_group.size(), cp_group.rank()
    idx = torch.tensor([rank, 2 * size - rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * size, -1, *pos_emb.shape[(seq_dim + 1):])
    pos_emb = pos_emb.index_select(seq_dim, idx)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[(seq_dim + 2):])


def _patch_param_type_checks(optimizer_mod: types.ModuleType, distrib_mod: types.ModuleType) -> None:
    """Two optimizers sort their parameters by `param.type()` against CUDA type names only, so CPU parameters are
    refused: Float16OptimizerWithFloat16Params.__init__ (optimizer.py L671-L700, bf16 mixed precision) and
    DistributedOptimizer.__init__ with its _build_model_and_main_param_groups (distrib_optimizer.py L361, L420,
    L582: 'Wrapped parameters must be one of torch.cuda.FloatTensor, ...'). The fp32 main copies and optimizer
    shards they make are ordinary tensors; nothing after __init__ asks for the type names."""
    _with_cuda_type_names(optimizer_mod.Float16OptimizerWithFloat16Params, "param.type() sort, optimizer.py L671")
    _with_cuda_type_names(distrib_mod.DistributedOptimizer, "param.type() sort, distrib_optimizer.py L361-L582")


def apply_cpu_compat() -> bool:
    """Patch the megatron modules above when CUDA is absent. Returns True if the patches are (now) active.

    Inert on GPU machines (returns False and touches nothing) and idempotent. Call it before building a model
    or running a schedule; calling it after megatron is imported is fine because the patched functions look
    `torch` up in their module globals at call time.
    """
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    cpu_torch = _make_cpu_torch()
    for name in _CPU_MODULES:
        module = importlib.import_module(name)
        module.torch = cpu_torch
    _patch_rng_tracker(importlib.import_module("megatron.core.tensor_parallel.random"))
    _patch_tied_embedding_setup(importlib.import_module("megatron.core.models.common.language_module.language_module"))
    _patch_frozen_linear(importlib.import_module("megatron.core.tensor_parallel.layers"))
    _patch_param_type_checks(importlib.import_module("megatron.core.optimizer.optimizer"),
                             importlib.import_module("megatron.core.optimizer.distrib_optimizer"))
    # Context parallelism's RoPE chunk selection; rotary_pos_embedding imports it by name (L26), so rebind it there too.
    for name in ("megatron.core.models.common.embeddings.rope_utils",
                 "megatron.core.models.common.embeddings.rotary_pos_embedding"):
        importlib.import_module(name).get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank
    # optimizer.py imports the clip function by name (L50), so rebind it there as well as at its source.
    for name in ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer"):
        importlib.import_module(name).clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    _APPLIED = True
    return True
