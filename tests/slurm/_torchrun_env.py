"""Smoke entry for `gkd slurm train --script`: checks what torchrun under Slurm gives each worker, then writes it.

    torchrun --nproc-per-node 1 tests/slurm/_torchrun_env.py OUT_DIR
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

if __name__ == "__main__":
    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                          "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID",
                                          "SLURM_NNODES", "SLURM_NODEID")}
    dist.init_process_group("gloo")  # from torchrun's env:// variables: proves the rendezvous worked
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    env["allreduce"] = float(t.item())
    dist.destroy_process_group()
    Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
    (Path(sys.argv[1]) / f"rank{env['RANK']}.json").write_text(json.dumps(env))
