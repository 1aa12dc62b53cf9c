"""On-policy GKD: `gkd onpolicy [--config configs/onpolicy.yaml] [key=value ...]` (= make onpolicy).

    config.py   the driver's settings + generate:/score:/train: sections (each stage's own keys), the stage configs
    state.py    state.json (resumable state machine), the lmbda draw, per-cycle views of the cache
    engines.py  sampler/teacher engines kept across cycles, weight sync, held-out KL
    stages.py   one cycle's stages as plain functions (setup, export, generate, score, train, eval), state records
    cycle.py    the cycle as tasks with their needs, and the one loop (run_cycles) every executor runs
    local.py    the local executor: the tasks in this process, or a process per role (max_staleness >= 1)
    slurm.py    the Slurm executor: the same loop, each task as jobs, a polling driver
    slurm_tasks.py  a Slurm job's side (`--stage S --cycle C`): one stage of one cycle, what is missing on disk
    ray.py      the Ray executor: the local loop with sampler, teacher and trainer as long-lived Ray actors
    run.py      the entry (`gkd onpolicy`): argparse, the executor chosen by `executor`

The driver sits above the stages and calls their public functions; no stage imports it.
"""
