"""On-policy GKD driver, the entry: cycles of export -> generate -> score -> train -> eval, resumable.

    gkd onpolicy [--config configs/onpolicy.yaml] [key=value ...]        # make onpolicy
    gkd onpolicy --config OUT/slurm/onpolicy.yaml --stage S --cycle C    # one stage of one cycle (a Slurm job)

Cycle c covers optimizer steps [c*spg, (c+1)*spg), spg = steps_per_generation. It is on-policy iff
`random.Random(seed + c*spg).random() < lmbda` (the reference trainers' draw). On-policy: the student weights of step
c*spg (the initial folder at step 0, else the HF export of the checkpoint) are synced into the sampler; it samples
this cycle's prompts (policy_version = c*spg, seed = seed + c) into OUT/rollouts/cycle-NNNN; the teacher scores
them into the shared cache (incremental); the cycle's rows are copied into OUT/views/cycle-NNNN; the trainer runs
spg steps on that view. Off-policy: spg steps on the off-policy cache, continuing the trainer's own position in it
(so lmbda=0 is exactly `gkd train` on that cache). Eval: export the new weights, held-out KL, one metrics line.

The stages are defined once (stages.py); this module picks the executor: local (local.py, one process, engines kept
open), slurm (slurm.py, each stage a job, a polling driver) or ray (ray.py, the engines in long-lived Ray actors).
Local and Ray run the one plan of cycle.py (tasks and their dependencies; max_staleness >= 1 overlaps the cycles).
The driver sits above the stages and calls their public functions; no stage imports it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipeline.errors import command
from pipeline.onpolicy.config import OnPolicyConfig, load
from pipeline.onpolicy.engines import Engines
from pipeline.onpolicy.local import RoleDied, run_local
from pipeline.onpolicy.slurm import JobFailed, run_slurm
from pipeline.onpolicy.slurm_tasks import task_main
from pipeline.onpolicy.stages import Stopped
from pipeline.ray.cluster import RayError
from pipeline.slurm.queue import SlurmError

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "onpolicy.yaml"

__all__ = ["DEFAULT_CONFIG", "Stopped", "main", "run"]


def run(cfg: OnPolicyConfig, engines: Engines | None = None) -> list[dict]:
    """Run (or resume) the on-policy loop with the configured executor; returns the metrics lines. Pass `engines`
    to reuse open engines (local executor)."""
    if cfg.executor == "slurm":  # the stages as Slurm jobs; this process only submits, polls and checks
        return run_slurm(cfg)
    if cfg.executor == "ray":  # the engines in long-lived Ray actors; Ray is imported only here
        from pipeline.onpolicy.ray import run_ray

        return run_ray(cfg)
    own = engines is None
    engines = engines or Engines()
    try:
        return run_local(cfg, engines)
    finally:
        if own:
            engines.close()


@command("gkd onpolicy")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gkd onpolicy", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=None, help=f"flat YAML config (default: {DEFAULT_CONFIG.name})")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    task = parser.add_argument_group("one stage of one cycle (what each job of executor=slurm runs)")
    task.add_argument("--stage", choices=("setup", "export", "generate", "score", "train"))
    task.add_argument("--cycle", type=int, default=-1)
    task.add_argument("--shard", type=int, help="array task (default $SLURM_ARRAY_TASK_ID)")
    task.add_argument("--num-shards", type=int, help="the array's task count (must match the config)")
    task.add_argument("--status", action="store_true", help="print the stage's missing tasks as --array=...; exit 1")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load(args.config or DEFAULT_CONFIG, args.overrides)
        if args.stage:
            return task_main(cfg, args.stage, args.cycle, args.shard, args.num_shards, status=args.status)
        lines = run(cfg)
    except Stopped as e:
        print(f"gkd onpolicy: stopped after {e} (state saved; rerun to continue)", file=sys.stderr)
        return 0
    except (JobFailed, SlurmError, RayError, RoleDied) as e:
        print(f"gkd onpolicy: {e}", file=sys.stderr)
        return 1
    done = [m for m in lines if m["cycle"] >= 0]
    print(f"gkd onpolicy: {len(done)} cycles done in {cfg.out}; last: {json.dumps(done[-1]) if done else '-'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
