"""Process-group setup for the student trainer: torch.distributed + Megatron model-parallel state + RNG tracker.

One call covers the three ways the trainer runs:

- under `torchrun --nproc_per_node N` (or Slurm + torchrun): RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT are set;
- as a plain single process (laptop, tests, the on-policy driver): no env vars, so a private in-memory store
  is used (no port to pick, nothing to race with other jobs on the machine);
- on CPU (gloo) or GPU (nccl, one device per local rank).

Megatron-Core keeps its parallel state in module globals; `destroy_distributed()` tears all of it down so a test
or a driver can build several models in one process.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import random as mpu_random

from pipeline.train.parallel.compat import apply_cpu_compat


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None or value == "" else int(value)


def init_distributed(tp: int = 1, pp: int = 1, seed: int = 0, cp: int = 1, vpp: int = 1) -> None:
    """Initialise torch.distributed and Megatron's TP/CP/PP/DP groups, then seed Megatron's RNG tracker.

    The data-parallel size is whatever is left: world_size / (tp * cp * pp); `cp` context-parallel ranks share one
    data-parallel replica's micro-batches, each holding its chunks of every sequence (context_parallel.py). Idempotent for the process group
    (an existing one is reused, e.g. one a test harness created), but the Megatron groups are rebuilt so
    tp/pp take effect; `vpp` > 1 makes get_forward_backward_func pick the interleaved schedule. Why the seed goes through Megatron: its tracker gives TP ranks different dropout / init
    streams and DP ranks identical ones, which is what makes TP=2 reproduce TP=1.
    On CPU (see compat.py) that seeding also reseeds torch's global generator with `seed`.
    """
    apply_cpu_compat()
    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    if not dist.is_initialized():
        rank = _env_int("RANK", 0)
        world_size = _env_int("WORLD_SIZE", 1)
        if use_cuda:
            torch.cuda.set_device(_env_int("LOCAL_RANK", 0) % torch.cuda.device_count())
        timeout = datetime.timedelta(minutes=30)
        if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
        elif world_size == 1:
            # Single process without torchrun: an in-memory store needs no free port.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            raise RuntimeError(f"WORLD_SIZE={world_size} but MASTER_ADDR/MASTER_PORT are not set: launch with torchrun")
    world_size = dist.get_world_size()
    if world_size % (tp * cp * pp) != 0:
        raise ValueError(f"world size {world_size} is not divisible by tp*cp*pp = {tp}*{cp}*{pp}")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             context_parallel_size=cp,
                                             virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
    mpu_random.model_parallel_cuda_manual_seed(seed)


def destroy_distributed() -> None:
    """Tear down Megatron's parallel state and the default process group (safe if neither exists)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
