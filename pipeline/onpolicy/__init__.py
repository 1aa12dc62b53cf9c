"""On-policy GKD: `gkd onpolicy [--config configs/onpolicy.yaml] [key=value ...]` (= make onpolicy).

    config.py   the flat config, and the generate/score/train stage configs derived from it
    state.py    state.json (resumable state machine), the lmbda draw, per-cycle views of the cache
    engines.py  sampler/teacher engines kept across cycles, weight sync, held-out KL
    run.py      the local executor: setup, then export -> generate -> score -> train -> eval per cycle
    slurm.py    the Slurm executor: the same stages as chained jobs (`--stage S --cycle C`), a polling driver

The driver sits above the stages and calls their public functions; no stage imports it.
"""

from pipeline.onpolicy.run import main, run

__all__ = ["main", "run"]
