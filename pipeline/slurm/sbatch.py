"""sbatch scripts for the stages, rendered as plain text the user can read, edit and `sbatch` by hand.

    gkd slurm score --num-shards 8 --log-dir runs/slurm -- --rollouts R --cache C     # writes runs/slurm/gkd-score.sbatch
    sbatch --array=3,5 runs/slurm/gkd-score.sbatch                                   # what `gkd slurm resubmit` does

Three shapes, all pure functions of their arguments (no Slurm needed to render or test them):
- `array_script`: a stage that shards its work (`score`, `generate`) as an array of N tasks; task i runs
  `python -m pipeline <stage> <args> --shard $SLURM_ARRAY_TASK_ID --num-shards N`. N is written into the script,
  not read from $SLURM_ARRAY_TASK_COUNT, because a resubmitted `--array=3` alone sees a count of 1.
- `job_script`: one task running `python -m pipeline <stage> <args>` once (the on-policy driver's export, setup
  and train jobs).
- `train_script`: one `torchrun` per allocated node (srun, one task per node), rendezvous on the first host of the
  allocation, so the same script runs on 1 node with 1 CPU process or on 16 nodes x 8 GPUs.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

SHARD_FLAGS = ("--shard", "--num-shards")


@dataclass
class SbatchOptions:
    """The sbatch options users set on the command line; anything else goes in `extra` verbatim."""

    job_name: str
    log_dir: Path
    chdir: Path  # tasks run here, so relative paths in the stage args mean what they meant at submission
    partition: str | None = None
    time: str | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    gres: str | None = None  # e.g. "gpu:1"
    requeue: bool = True  # a task killed by a node failure or preemption reruns; stages resume from their parts
    extra: list[str] = field(default_factory=list)  # e.g. ["--account=proj", "--qos=high"]

    def script_path(self) -> Path:
        """Deterministic: resubmitting the same job name rewrites (and reuses) the same file."""
        return self.log_dir / f"{self.job_name}.sbatch"

    def log_path(self, job_id: str, index: int | None = None) -> Path:
        """The log of one job (index None: `job_script`, `train_script`) or array task (`array_script`)."""
        return self.log_dir / (f"{self.job_name}-{job_id}.log" if index is None or index < 0
                               else f"{self.job_name}-{job_id}_{index}.log")

    def directives(self, log_pattern: str) -> list[str]:
        opts = [f"--job-name={self.job_name}", f"--output={self.log_dir / log_pattern}", f"--chdir={self.chdir}"]
        # a requeued task appends to its log, so the log shows every attempt
        opts += ["--requeue", "--open-mode=append"] if self.requeue else ["--no-requeue"]
        for flag, value in (("partition", self.partition), ("time", self.time),
                            ("cpus-per-task", self.cpus_per_task), ("mem", self.mem), ("gres", self.gres)):
            if value is not None:
                opts.append(f"--{flag}={value}")
        return [*opts, *self.extra]


def _header(what: str, opts: list[str]) -> list[str]:
    return ["#!/bin/bash", f"# {what}", *[f"#SBATCH {o}" for o in opts], "set -euo pipefail"]


def _threads(opts: SbatchOptions) -> list[str]:
    # no CPU binding is guaranteed (task/none clusters): keep OpenMP inside the allocation
    return [] if opts.cpus_per_task is None else ['export OMP_NUM_THREADS="${SLURM_CPUS_PER_TASK:-1}"']


def check_stage_args(stage_args: list[str]) -> None:
    """The launcher owns --shard/--num-shards; a second copy in the stage args would silently win or clash."""
    clash = [a for a in stage_args if a.split("=", 1)[0] in SHARD_FLAGS or a.split("=", 1)[0] in ("shard", "num_shards")]
    if clash:
        raise ValueError(f"stage args must not set {', '.join(clash)}: the launcher passes --shard/--num-shards itself")


def array_script(stage: str, stage_args: list[str], num_shards: int, opts: SbatchOptions,
                 python: str = sys.executable, written_by: str | None = None) -> str:
    """An array job of `num_shards` tasks, task i running shard i of the stage."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    check_stage_args(stage_args)
    cmd = [python, "-m", "pipeline", stage, *stage_args]
    lines = _header(
        f"gkd {stage} as a Slurm array: task i runs shard i of {num_shards}. Written by "
        f"{written_by or f'`gkd slurm {stage}`'}; edit freely, then `sbatch [--array=I,J] THIS_FILE`.",
        [f"--array=0-{num_shards - 1}", "--ntasks=1", *opts.directives(f"{opts.job_name}-%A_%a.log")],
    )
    lines += [
        *_threads(opts),
        "# explicit: a resubmitted single index sees SLURM_ARRAY_TASK_COUNT=1",
        f"NUM_SHARDS={num_shards}",
        'echo "[slurm] task ${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID} (job ${SLURM_JOB_ID}) on $(hostname),'
        ' restart ${SLURM_RESTART_COUNT:-0}, $(date -Is)"',
        # exec: scancel's SIGTERM reaches the stage itself, not a waiting shell
        f'exec {shlex.join(cmd)} --shard "$SLURM_ARRAY_TASK_ID" --num-shards "$NUM_SHARDS"',
        "",
    ]
    return "\n".join(lines)


def job_script(stage: str, stage_args: list[str], opts: SbatchOptions, python: str = sys.executable,
               written_by: str | None = None) -> str:
    """One task running `python -m pipeline <stage> <args>` once."""
    lines = _header(
        f"gkd {stage}: one task. Written by {written_by or f'`gkd slurm {stage}`'}; edit freely, then "
        "`sbatch THIS_FILE`.",
        ["--ntasks=1", *opts.directives(f"{opts.job_name}-%j.log")],
    )
    lines += [
        *_threads(opts),
        'echo "[slurm] job ${SLURM_JOB_ID} on $(hostname), restart ${SLURM_RESTART_COUNT:-0}, $(date -Is)"',
        f"exec {shlex.join([python, '-m', 'pipeline', stage, *stage_args])}",
        "",
    ]
    return "\n".join(lines)


def train_script(train_args: list[str], opts: SbatchOptions, *, nodes: int = 1, gpus_per_node: int = 0,
                 nproc_per_node: int | None = None, port: int | None = None, module: str = "pipeline.train.run",
                 script: str | None = None, python: str = sys.executable) -> str:
    """One torchrun per node over `nodes` nodes; `script` (a path) replaces `-m module` as the entry point.

    nproc-per-node: explicit, else the GPUs per node, else 1 (CPU). The rendezvous endpoint is the first host of
    $SLURM_JOB_NODELIST; the port is derived from the job id unless given, so two jobs sharing a head node differ.
    """
    if nodes < 1 or gpus_per_node < 0:
        raise ValueError(f"need nodes >= 1 and gpus_per_node >= 0, got {nodes}, {gpus_per_node}")
    nproc = nproc_per_node or gpus_per_node or 1
    directives = [f"--nodes={nodes}", "--ntasks-per-node=1", *opts.directives(f"{opts.job_name}-%j.log")]
    if gpus_per_node:
        directives.insert(2, f"--gpus-per-node={gpus_per_node}")
    entry = [script] if script else ["-m", module]
    # srun (22.05) does not inherit --cpus-per-task from the batch step: pass it on
    srun = ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    if opts.cpus_per_task is not None:
        srun.append(f"--cpus-per-task={opts.cpus_per_task}")
    lines = _header(
        f"gkd train: torchrun on {nodes} node(s) x {nproc} process(es). Written by `gkd slurm train`; "
        "edit freely, then `sbatch THIS_FILE`.",
        directives,
    )
    lines += [
        *_threads(opts),
        # sed reads to the end: `head -n 1` may exit before scontrol's last write, and pipefail turns that SIGPIPE into
        # a failed job
        'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
        f"PORT={port}" if port else "PORT=$((29500 + SLURM_JOB_ID % 10000))",
        'echo "[slurm] job ${SLURM_JOB_ID} on ${SLURM_JOB_NODELIST} (${SLURM_NNODES} node(s)),'
        ' rendezvous ${HEAD}:${PORT}, restart ${SLURM_RESTART_COUNT:-0}, $(date -Is)"',
        # the outer shell fills in what all nodes share; the inner single-quoted bash reads its own $SLURM_NODEID
        f"{shlex.join(srun)} bash -c 'exec \"$0\" -m torch.distributed.run --node-rank=\"$SLURM_NODEID\" \"$@\"' \\",
        f'  {shlex.quote(python)} --nnodes="$SLURM_NNODES" --nproc-per-node={nproc} \\',
        '  --rdzv-backend=c10d --rdzv-endpoint="$HEAD:$PORT" --rdzv-id="$SLURM_JOB_ID" \\',
        f"  {shlex.join([*entry, *train_args])}",
        "",
    ]
    return "\n".join(lines)


def write_script(text: str, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path
