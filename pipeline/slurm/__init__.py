"""Slurm launch layer: `gkd slurm score|generate|resubmit|train` (the entry is pipeline/slurm/cli.py).

    arrays.py   the array rules every stage shares: this task's index, `--array` syntax
    sbatch.py   the scripts, rendered as text from arguments (array of shard tasks; torchrun per node)
    queue.py    sbatch/squeue/scontrol, and the stage's own `--status` to find missing shards
    local.py    a throw-away single-node Slurm for tests and laptops (its entry local_run.py: python -m
                pipeline.slurm.local_run start DIR)
"""
