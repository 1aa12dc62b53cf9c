"""`gkd ray`: the sharded stages as Ray tasks, one per shard index, on a Ray cluster.

    gkd ray score --num-shards 8 [--num-cpus 1 --num-gpus 1 --address auto --max-retries 3] -- --rollouts R --cache C
    gkd ray generate --num-shards 8 --address ray://head:10001 -- --prompts data.jsonl --out runs/rollouts/v0
    gkd ray score --num-shards 8 --address local -- ...     # a single-machine cluster of our own (127.0.0.1)

Stage args follow `--` exactly as `gkd <stage>` takes them. Task i runs `gkd <stage> <args> --shard i --num-shards N`
in a fresh worker process (`max_calls=1`: no vLLM engine left over from another task), with the stage's own task
markers: the stage's `--status` decides which tasks are missing (the rule `gkd slurm resubmit` uses), and only those
are launched, so rerunning the same command does only what is missing. A worker that dies (SIGKILL, OOM, a lost
node) is retried by Ray up to --max-retries times; the retry resumes after the task's last complete part. A task that
fails on its own (bad input: the stage's message) is not retried. Exit 0 when every task is done, 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import io
import os
import sys
import time
from typing import Any

from pipeline.ray.cluster import RayError, check_resources, connect, enter_cwd, import_ray, require_ray
from pipeline.slurm.arrays import array_spec
from pipeline.slurm.queue import SlurmError, missing_shards
from pipeline.slurm.sbatch import check_stage_args

STAGES = {"score": "pipeline.score.run", "generate": "pipeline.generate.run"}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="gkd ray", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="stage", required=True)
    for stage in STAGES:
        p = sub.add_parser(stage, help=f"gkd {stage} as --num-shards Ray tasks")
        p.add_argument("--num-shards", type=int, required=True)
        p.add_argument("--num-cpus", type=float, default=1.0, help="CPUs per task (default 1)")
        p.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per task (default 0)")
        p.add_argument("--address", default="auto", help="auto (a cluster on this machine), HOST:PORT, "
                       "ray://HOST:PORT (Ray Client), or local (start a single-machine cluster); default auto")
        p.add_argument("--max-retries", type=int, default=3, help="retries of a task whose worker died (default 3)")
    return ap


class _Tail(io.TextIOBase):
    """stderr passed through, its last lines kept: a failed task's own message goes back with its result (worker
    logs reach the driver asynchronously, possibly after it has exited)."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.lines = stream, collections.deque(maxlen=5)

    def write(self, text: str) -> int:
        self.lines.extend(x for x in text.splitlines() if x.strip())
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def run_shard(stage: str, stage_args: list[str], shard: int, num_shards: int, cwd: str) -> tuple[int, list[str]]:
    """Inside a Ray worker: the stage's own entry on one shard, as `gkd <stage> ... --shard I --num-shards N` run
    in the driver's directory `cwd`; returns its exit code and the last lines it wrote to stderr."""
    enter_cwd(cwd)
    module = importlib.import_module(STAGES[stage])
    tail = _Tail(sys.stderr)
    with contextlib.redirect_stderr(tail):
        code = int(module.main([*stage_args, "--shard", str(shard), "--num-shards", str(num_shards)]) or 0)
    return code, list(tail.lines)


def missing(stage: str, stage_args: list[str], num_shards: int) -> list[int]:
    """The stage's own `--status` (every rule in one place: pipeline/slurm/queue.missing_shards)."""
    try:
        return missing_shards(stage, stage_args, num_shards)
    except SlurmError as e:
        raise RayError(str(e).replace("`", "").strip()) from None


def run(a: argparse.Namespace, stage_args: list[str]) -> int:
    if a.num_shards < 1:
        raise ValueError(f"--num-shards must be >= 1, got {a.num_shards}")
    if a.max_retries < 0:
        raise ValueError(f"--max-retries must be >= 0, got {a.max_retries}")
    check_stage_args(stage_args)
    require_ray()  # before any work: "not installed" comes first
    todo = missing(a.stage, stage_args, a.num_shards)
    if not todo:
        print(f"gkd ray {a.stage}: all {a.num_shards} tasks are done; nothing to run", file=sys.stderr)
        return 0
    with connect(a.address) as where:
        ray = import_ray()
        check_resources({"CPU": a.num_cpus, "GPU": a.num_gpus}, f"a {a.stage} task (--num-cpus/--num-gpus)")
        task = ray.remote(max_calls=1)(run_shard)
        opts = {"num_cpus": a.num_cpus, "num_gpus": a.num_gpus, "max_retries": a.max_retries,
                "retry_exceptions": False}
        print(f"gkd ray {a.stage}: {len(todo)} of {a.num_shards} tasks (--array={array_spec(todo)}) on {where}",
              file=sys.stderr)
        t0 = time.time()
        pending = {task.options(**opts, name=f"gkd-{a.stage}-{i}-of-{a.num_shards}").remote(
            a.stage, stage_args, i, a.num_shards, os.getcwd()): i for i in todo}
        failed: dict[int, str] = {}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            i = pending.pop(ready[0])
            try:
                code, tail = ray.get(ready[0])
                if code:
                    failed[i] = f"exit {code}: {tail[-1] if tail else '(no message)'}"
            except ray.exceptions.RayTaskError as e:  # the stage raised: its own error, not retried
                failed[i] = str(e.cause if e.cause is not None else e).strip().splitlines()[-1]
            except ray.exceptions.RayError as e:  # worker died more often than --max-retries
                failed[i] = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
            print(f"gkd ray {a.stage}: task {i}/{a.num_shards} {'FAILED: ' + failed[i] if i in failed else 'done'} "
                  f"({time.time() - t0:.0f} s)", file=sys.stderr)
    left = missing(a.stage, stage_args, a.num_shards)  # the markers on disk are the truth, not the task results
    if left:
        lines = [f"  task {i}: {failed.get(i, 'no complete output')}" for i in left]
        print(f"gkd ray {a.stage}: {len(left)} of {a.num_shards} tasks missing (--array={array_spec(left)}):\n"
              + "\n".join(lines) + "\nFix the cause and rerun the same command: only the missing tasks run.",
              file=sys.stderr)
        return 1
    print(f"gkd ray {a.stage}: all {a.num_shards} tasks done in {time.time() - t0:.0f} s", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, stage_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    a = build_parser().parse_args(ours)
    try:
        return run(a, stage_args)
    except (RayError, ValueError) as e:
        print(f"gkd ray {a.stage}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
