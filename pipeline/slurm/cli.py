"""`gkd slurm`: submit the stages as Slurm jobs. Each sub-command renders one sbatch script and submits it.

    gkd slurm score --num-shards 8 [--partition P --time 4:00:00 --cpus-per-task 8 --mem 64G] -- --rollouts R --cache C
    gkd slurm generate --num-shards 8 -- --prompts data.jsonl --out runs/rollouts/v0
    gkd slurm score --num-shards 8 --array 3,5 -- ...        # only these indices
    gkd slurm resubmit --num-shards 8 -- --rollouts R --cache C --teacher T --topk 64   # only what --status lists
    gkd slurm resubmit --stage generate --num-shards 8 -- --prompts P --out DIR       # (gkd generate --status)
    gkd slurm train --nodes 2 --gpus-per-node 8 -- --config configs/train.yaml lr=1e-4
    gkd slurm train --nproc-per-node 1 -- ...               # CPU: one process on one node

Stage args follow `--` exactly as `gkd <stage>` takes them. The script lands in `<log-dir>/<job-name>.sbatch`
(deterministic: edit it and `sbatch` it by hand if you like), task logs in `<log-dir>/<job-name>-%A_%a.log`.
stdout gets only the job id (`JOB=$(gkd slurm score ...)`); everything else goes to stderr.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from pipeline.slurm.arrays import array_spec, parse_array
from pipeline.slurm.queue import SlurmError, active_indices, missing_shards, submit
from pipeline.slurm.sbatch import SbatchOptions, array_script, train_script, write_script

ARRAY_STAGES = ("score", "generate")


def _common(p: argparse.ArgumentParser, default_name: str) -> None:
    g = p.add_argument_group("sbatch")
    g.add_argument("--job-name", default=default_name)
    g.add_argument("--log-dir", default="runs/slurm", help="script and per-task logs (default runs/slurm)")
    g.add_argument("--partition")
    g.add_argument("--time", help="time limit, e.g. 4:00:00")
    g.add_argument("--cpus-per-task", type=int)
    g.add_argument("--mem", help="e.g. 64G")
    g.add_argument("--extra-sbatch", default="", help='more sbatch options, e.g. "--account=proj --qos=high"')
    g.add_argument("--no-requeue", action="store_true", help="do not rerun tasks killed by node failure/preemption")
    g.add_argument("--dry-run", action="store_true", help="write the script and print its path; submit nothing")


def _options(a: argparse.Namespace) -> SbatchOptions:
    return SbatchOptions(job_name=a.job_name, log_dir=Path(a.log_dir).resolve(), chdir=Path.cwd(),
                         partition=a.partition, time=a.time, cpus_per_task=a.cpus_per_task, mem=a.mem,
                         requeue=not a.no_requeue, extra=shlex.split(a.extra_sbatch))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="gkd slurm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    for stage in ARRAY_STAGES:
        p = sub.add_parser(stage, help=f"gkd {stage} as an array job of --num-shards tasks")
        p.add_argument("--num-shards", type=int, required=True)
        p.add_argument("--array", help="submit only these indices, e.g. 3,5-7 (default: all)")
        _common(p, f"gkd-{stage}")
    p = sub.add_parser("resubmit", help="submit only the shards the stage's --status reports missing")
    p.add_argument("--num-shards", type=int, required=True, help="the TOTAL shard count of the original array")
    p.add_argument("--stage", choices=ARRAY_STAGES, default="score")
    p.add_argument("--force", action="store_true", help="also submit indices already queued/running under --job-name")
    _common(p, "")
    p = sub.add_parser("train", help="gkd train under torchrun across the allocated nodes")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=0)
    p.add_argument("--nproc-per-node", type=int, help="processes per node (default: --gpus-per-node, else 1)")
    p.add_argument("--port", type=int, help="rendezvous port (default 29500 + job id %% 10000)")
    entry = p.add_mutually_exclusive_group()
    entry.add_argument("--module", default="pipeline.train.run", help="entry module (default pipeline.train.run)")
    entry.add_argument("--script", help="entry script instead of --module (e.g. a smoke test)")
    _common(p, "gkd-train")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, stage_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    # argparse reads `--extra-sbatch "--qos=high"` as two options: glue the value on
    for i in range(len(ours) - 2, -1, -1):
        if ours[i] == "--extra-sbatch":
            ours[i : i + 2] = [f"--extra-sbatch={ours[i + 1]}"]
    a = build_parser().parse_args(ours)
    try:
        return run(a, stage_args)
    except (SlurmError, ValueError) as e:
        print(f"gkd slurm {a.command}: {e}", file=sys.stderr)
        return 2


def run(a: argparse.Namespace, stage_args: list[str]) -> int:
    array = None
    if a.command == "train":
        opts = _options(a)
        text = train_script(stage_args, opts, nodes=a.nodes, gpus_per_node=a.gpus_per_node,
                            nproc_per_node=a.nproc_per_node, port=a.port, module=a.module,
                            script=str(Path(a.script).resolve()) if a.script else None)
    else:
        stage = a.stage if a.command == "resubmit" else a.command
        a.job_name = a.job_name or f"gkd-{stage}"
        opts = _options(a)
        text = array_script(stage, stage_args, a.num_shards, opts)
        if a.command == "resubmit":
            missing = missing_shards(stage, stage_args, a.num_shards)
            busy = set() if a.force or a.dry_run else active_indices(a.job_name)
            todo = [i for i in missing if i not in busy]
            if busy & set(missing):
                print(f"not resubmitting {sorted(busy & set(missing))}: still queued/running as {a.job_name} "
                      "(--force to submit anyway)", file=sys.stderr)
            if not todo:
                print(f"nothing to resubmit: {'all' if not missing else 'no idle'} {a.num_shards} {stage} tasks "
                      f"{'done' if not missing else 'missing'}", file=sys.stderr)
                return 0
            array = array_spec(todo)
        elif a.array:
            bad = [i for i in parse_array(a.array) if not 0 <= i < a.num_shards]
            if bad:
                raise ValueError(f"--array {a.array}: indices {bad} outside [0, {a.num_shards})")
            array = a.array
    path = write_script(text, opts.script_path())
    if a.dry_run:
        print(f"wrote {path}{f' (submit with --array={array})' if array else ''}", file=sys.stderr)
        return 0
    job = submit(path, array=array)
    print(f"submitted {path} as job {job}{f' --array={array}' if array else ''}; logs in {opts.log_dir}",
          file=sys.stderr)
    print(job)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
