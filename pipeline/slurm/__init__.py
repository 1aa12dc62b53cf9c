"""Slurm launch layer: `gkd slurm score|generate|resubmit|train` (see pipeline/slurm/cli.py for the commands).

    sbatch.py   the scripts, rendered as text from arguments (array of shard tasks; torchrun per node)
    queue.py    sbatch/squeue/scontrol, and the stage's own `--status` to find missing shards
    local.py    a throw-away single-node Slurm for tests and laptops (python -m pipeline.slurm.local start DIR)
"""

from pipeline.slurm.cli import main

__all__ = ["main"]
