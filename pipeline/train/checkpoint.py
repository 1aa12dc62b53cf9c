"""Trainer checkpoints: model + optimizer through `megatron.core.dist_checkpointing`, a small JSON beside them.

    SAVE_DIR/step_0000020/            one checkpoint (dist_checkpointing files + trainer.json)
    SAVE_DIR/step_0000020/trainer.json  step, data position, LR scheduler state, RNG states, precision, config
    SAVE_DIR/latest                   name of the newest complete checkpoint, written last (atomically)

A LoRA run (trainer.json has "lora") saves only the adapter and its optimizer state; loading rebuilds the base
from the student folder and then the adapter, so the two must be the same run's.

dist_checkpointing stores tensors with their global shapes, so a checkpoint saved at TP=2 loads at TP=1 (export
does that). With `use_distributed_optimizer` each rank writes its own shard of the optimizer state (DIST_OPT_FORMAT
below): the run resumes at another data-parallel size, not at another TP size, and not with the plain optimizer
(both refused by `check_optimizer_layout`, trainer.json `optimizer_sharding` says which layout was saved). A checkpoint is written under a temporary name and renamed once complete, then `latest` is updated:
a job killed mid-save resumes from the previous checkpoint. A save that fails (a full disk) removes its temporary
folder and raises `WriteError` naming the checkpoint; the run resumes from `latest` once space is freed.

An hf-backend checkpoint (trainer.json `backend: hf`, pipeline/train/models/hf_state.py) holds the same trainer.json, and
instead of dist_checkpointing files rank 0's `student.safetensors` (all weights, or the LoRA adapter) and
`optimizer.pt` (torch's optimizer state): data-parallel replicas are identical, and there is no TP to reshard.

trainer.json records the student's architecture (`student_arch`, the config.json fields the Megatron mapping reads):
a resume or export with another student is refused before any tensor is loaded.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.tensor_parallel import random as mpu_random

from pipeline import pause
from pipeline.errors import MissingInputError, UserError
from pipeline.store.shards import WriteError, atomic_write_bytes, os_error_in
from pipeline.train.models import hf_state
from pipeline.train.models.lora import is_lora, load_lora_state, lora_sharded_state_dict

LATEST = "latest"


class CheckpointMismatchError(UserError, ValueError):
    """A checkpoint that this run cannot continue: another LoRA setting or another precision."""

META = "trainer.json"


def step_dir(save_dir: str | Path, step: int) -> Path:
    return Path(save_dir) / f"step_{step:07d}"


def latest(save_dir: str | Path) -> Path | None:
    """The newest complete checkpoint in `save_dir` (or `save_dir` itself if it is one), else None."""
    save_dir = Path(save_dir)
    if (save_dir / META).exists():
        return save_dir
    marker = save_dir / LATEST
    if not marker.exists():
        return None
    path = save_dir / marker.read_text().strip()
    if not (path / META).exists():
        raise MissingInputError(f"{marker} names {path.name}, which is not a complete checkpoint")
    return path


def read_meta(ckpt: str | Path) -> dict:
    return json.loads((Path(ckpt) / META).read_text())


def _encode(t: torch.Tensor) -> str:
    buf = io.BytesIO()
    torch.save(t, buf)
    return base64.b64encode(buf.getvalue()).decode()


def _decode(s: str) -> torch.Tensor:
    return torch.load(io.BytesIO(base64.b64decode(s)), weights_only=True)


def rng_state() -> dict[str, Any]:
    """This rank's RNG states: torch's default generator and Megatron's tracker streams (TP-rank specific)."""
    tracker = mpu_random.get_cuda_rng_tracker().get_states()
    return {"torch": _encode(torch.get_rng_state()), "tracker": {k: _encode(v) for k, v in tracker.items()}}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(_decode(state["torch"]))
    mpu_random.get_cuda_rng_tracker().set_states({k: _decode(v) for k, v in state["tracker"].items()})


# The distributed optimizer's checkpoint format. megatron-core 0.16.1's default, 'fully_sharded_model_space'
# (deprecated there), describes each rank's slice of a parameter's state as a ShardedTensor with `flattened_range`,
# which 0.16.1's own dist_checkpointing refuses ("ShardedTensor.flattened_range is not supported", mapping.py L134):
# that, not the CPU, is why its state did not save or load. 'dp_reshardable' (Megatron-LM's default) saves each
# rank's bucket shard as it is, with no gather, in buffer order minus the padding that depends on the DP size: it
# loads at another data-parallel size, not at another TP/PP split (distrib_optimizer.py L1539-L1572).
DIST_OPT_FORMAT = "dp_reshardable"


def uses_distributed_optimizer(optimizer) -> bool:
    """True when `optimizer` (Megatron's, possibly chained) shards its state over data-parallel ranks."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(o, DistributedOptimizer) for o in getattr(optimizer, "chained_optimizers", [optimizer]))


def optimizer_sharding(optimizer) -> str | None:
    """How a checkpoint of `optimizer` lays out its state: DIST_OPT_FORMAT (sharded over data-parallel ranks) or
    None (the plain optimizer, or none)."""
    return DIST_OPT_FORMAT if optimizer is not None and uses_distributed_optimizer(optimizer) else None


def check_optimizer_layout(ckpt: Path, meta: dict, distributed: bool, tp: int) -> None:
    """Refuse a resume (use_distributed_optimizer=`distributed` at tensor_model_parallel_size=`tp`) whose optimizer
    state the checkpoint cannot give in that layout: saved sharded and loaded plain or the reverse (bucket shards
    vs per-parameter tensors), or sharded at another TP size (the dp_reshardable buckets follow the TP split;
    another DP size is fine). Config only: the trainer calls it before any process group or model exists."""
    saved, own = meta.get("optimizer_sharding"), DIST_OPT_FORMAT if distributed else None
    if saved != own:
        how = {None: "unsharded (use_distributed_optimizer=false)",
               DIST_OPT_FORMAT: f"sharded over data-parallel ranks (use_distributed_optimizer=true, {DIST_OPT_FORMAT})"}
        raise CheckpointMismatchError(
            f"{ckpt}: optimizer state saved {how.get(saved, saved)}, this run has "
            f"use_distributed_optimizer={str(distributed).lower()}; the two layouts do not load into each other. "
            f"Resume with use_distributed_optimizer={str(saved is not None).lower()}, or start a new save_dir")
    saved_tp = meta.get("config", {}).get("tensor_model_parallel_size", 1)
    if own is not None and saved_tp != tp:
        raise CheckpointMismatchError(
            f"{ckpt}: distributed-optimizer state saved at tensor_model_parallel_size={saved_tp}, this run has {tp}; "
            f"its {DIST_OPT_FORMAT} shards follow the TP split of the gradient buffers (they reshard over "
            f"data-parallel ranks only). Resume with tensor_model_parallel_size={saved_tp} (any number of "
            "data-parallel ranks), or start a new save_dir")


def _prime_distributed_state(optimizer) -> None:
    """Give every shard of a distributed optimizer its state before a save or load. Without apex or Transformer
    Engine (CPU, a plain GPU install) its torch Adam keeps the step per parameter, and DistributedOptimizer.state_dict
    (distrib_optimizer.py L640) asserts that one exists: it fails on a fresh optimizer, whose state dict loading a
    checkpoint builds first. Zeros and step 0 are what torch's Adam starts from; the load overwrites them."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, DistributedOptimizer):
            continue
        inner = opt.optimizer
        if any(not inner.state[p] for group in inner.param_groups for p in group["params"]):
            opt.init_state_fn(inner, opt.config)
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p].setdefault("step", torch.zeros((), dtype=torch.float32))


def _restore_distributed_steps(optimizer) -> None:
    """Put the checkpoint's step back into every shard's state after a distributed-optimizer load. Megatron's
    load_state_dict sets it from the saved param groups, then the dp_reshardable parameter-state load copies over it
    the step the state had before loading (a `LocalNonpersistentObject`, distrib_optimizer.py L1660): 0 on a fresh
    optimizer, which would restart Adam's bias correction. The saved param groups keep the right one."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, DistributedOptimizer):
            continue
        for group in opt.optimizer.param_groups:
            if "step" in group:
                for p in group["params"]:
                    opt.optimizer.state[p]["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)


def _sharded(model, optimizer, *, is_loading: bool) -> dict:
    # A LoRA run saves the adapter only: the frozen base comes from the student folder (recorded in trainer.json).
    # Interleaved pipelining (a list of model chunks): one entry per chunk; dist_checkpointing keys each tensor by its
    # global name (layers by global index), so the checkpoint loads at another pipeline or virtual-pipeline size.
    if isinstance(model, list):
        model_sd = {f"chunk{i}": chunk.sharded_state_dict() for i, chunk in enumerate(model)}
    else:
        model_sd = lora_sharded_state_dict(model) if is_lora(model) else model.sharded_state_dict()
    out = {"model": model_sd}
    if optimizer is not None:
        metadata = None
        if uses_distributed_optimizer(optimizer):
            _prime_distributed_state(optimizer)
            metadata = {"distrib_optim_sharding_type": DIST_OPT_FORMAT}
        out["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
    return out


def arch_of(model) -> dict | None:
    """The student architecture a checkpoint records (families.HFArch as JSON; an hf-backend student's config
    fields), None for a model built otherwise."""
    if hasattr(model, "arch_json"):
        return model.arch_json()
    arch = getattr(model, "hf_arch", None)
    return json.loads(json.dumps(dataclasses.asdict(arch))) if arch is not None else None


def precision_of(model) -> str:
    """'bf16' when the model's parameters are bfloat16 (mixed precision), else 'fp32' (an hf-backend student keeps
    fp32 weights under autocast and says which)."""
    if hasattr(model, "precision") and isinstance(model.precision, str):
        return model.precision
    return "bf16" if next(model.parameters()).dtype == torch.bfloat16 else "fp32"


def save(save_dir: str | Path, step: int, model, optimizer, meta: dict) -> Path:
    """Collective: every rank calls it. `meta` (JSON-able) gets `rng` (all ranks' states) and `lora` added."""
    meta = {**meta, "lora": model.lora_spec.to_json() if is_lora(model) else None, "precision": precision_of(model),
            "student_arch": arch_of(model), "optimizer_sharding": optimizer_sharding(optimizer)}
    final = step_dir(save_dir, step)
    tmp = final.with_name(f".{final.name}.partial")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a save killed before (kill -9 mid-save) left this behind
        try:
            tmp.mkdir(parents=True)
        except OSError as e:
            raise WriteError(final, e, f"checkpoint save failed (resume continues from {LATEST})") from e
    states = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(states, rng_state())
        dist.barrier()
    else:
        states[0] = rng_state()
    try:
        if getattr(model, "gkd_backend", None) == "hf":
            hf_state.save_state(tmp, model, optimizer, rank)
        else:
            dist_checkpointing.save(_sharded(model, optimizer, is_loading=False), str(tmp))
        if rank == 0:
            (tmp / META).write_text(json.dumps({**meta, "step": step, "rng": states}, indent=1) + "\n")
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            atomic_write_bytes(Path(save_dir) / LATEST, final.name.encode())
    except BaseException as e:  # dist_checkpointing raises CheckpointException, a BaseException
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # `latest` still names the previous, complete checkpoint
        cause = os_error_in(e)
        if cause is None or isinstance(e, WriteError):
            raise
        raise WriteError(final, cause, f"checkpoint save failed (resume continues from {LATEST})") from e
    if dist.is_initialized():
        dist.barrier()
    pause.point("checkpoint")
    return final


def load(ckpt: str | Path, model, optimizer=None) -> dict:
    """Load model (and optimizer, if given) in place from `ckpt`; restore this rank's RNG; return the meta."""
    ckpt = Path(ckpt)
    meta = read_meta(ckpt)
    saved_lora, own_lora = meta.get("lora"), model.lora_spec.to_json() if is_lora(model) else None
    if saved_lora != own_lora:
        raise CheckpointMismatchError(f"{ckpt}: checkpoint LoRA settings {saved_lora} differ from this model's {own_lora} "
                         "(lora_rank / lora_alpha / lora_targets must match the run that saved it)")
    saved_arch, own_arch = meta.get("student_arch"), arch_of(model)
    if saved_arch is not None and own_arch is not None and saved_arch != own_arch:
        diff = ", ".join(f"{k}: checkpoint {saved_arch.get(k)!r}, this student {own_arch.get(k)!r}"
                         for k in sorted(set(saved_arch) | set(own_arch)) if saved_arch.get(k) != own_arch.get(k))
        raise CheckpointMismatchError(f"{ckpt}: saved from another student ({meta.get('student')}): {diff}; resume "
                                      f"with student={meta.get('student')}, or start a new save_dir for this one")
    saved_precision = meta.get("precision", "fp32")  # checkpoints from before bf16 support are fp32
    if optimizer is not None and saved_precision != precision_of(model):
        raise CheckpointMismatchError(f"{ckpt}: checkpoint trained in {saved_precision}, this run is {precision_of(model)}; "
                         f"resume with bf16={str(saved_precision == 'bf16').lower()} (the optimizer's main weights "
                         "and moments are kept per precision), or start a new save_dir")
    if getattr(model, "gkd_backend", None) == "hf" or meta.get("backend") == "hf":
        if getattr(model, "gkd_backend", None) != meta.get("backend", "megatron"):
            raise CheckpointMismatchError(f"{ckpt}: saved by the {meta.get('backend', 'megatron')} backend, this run "
                                          f"uses the {getattr(model, 'gkd_backend', 'megatron')} one; resume with "
                                          f"backend={meta.get('backend', 'megatron')}, or start a new save_dir")
        hf_state.load_state(ckpt, model, optimizer)
        _restore_rng(meta, optimizer)
        return meta
    state = dist_checkpointing.load(_sharded(model, optimizer, is_loading=True), str(ckpt))
    if own_lora is not None:
        load_lora_state(model, state["model"])
    elif isinstance(model, list):
        for i, chunk in enumerate(model):
            chunk.load_state_dict(state["model"][f"chunk{i}"], strict=True)
    else:
        model.load_state_dict(state["model"], strict=True)
    if optimizer is not None:
        # no_grad: the distributed optimizer's dp_reshardable load copies into its fp32 main-parameter shards, which
        # are views of the (grad-requiring) model parameters, outside a no_grad of its own (distrib_optimizer.py L940)
        with torch.no_grad():
            optimizer.load_state_dict(state["optimizer"])
        _restore_distributed_steps(optimizer)
    _restore_rng(meta, optimizer)
    return meta


def _restore_rng(meta: dict, optimizer) -> None:
    if optimizer is None:  # export / evaluation: no run to continue
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank < len(meta.get("rng", [])):  # same world size: continue each rank's streams exactly
        set_rng_state(meta["rng"][rank])
