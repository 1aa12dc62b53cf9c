"""On-policy GKD, Slurm executor: the plan of cycle.py run as Slurm jobs; the driver runs on the login node.

    gkd onpolicy executor=slurm slurm_partition=gpu slurm_gres=gpu:1 slurm_generate_shards=8 slurm_score_shards=8
    gkd onpolicy executor=slurm max_staleness=1        # cycle c+1 generated and scored while cycle c trains

The loop is cycle.run_cycles, the one every executor runs: it hands the driver each task when the plan's needs are
done (the driver is the dependency, so no `--dependency` chain is queued ahead), and the driver (SlurmRunner) turns a
task into jobs, one stage of one cycle each:

    export    1 task   student weights of step policy_cycle(c)*spg -> OUT/exports/step-N (only when missing: never
                       at step 0, and the eval before normally wrote them already)
    generate  N tasks  task i samples the cycle's prompts whose id hashes to i -> rollouts-i-of-N.parquet; the same
                       samples as one task, since per-request seeds derive from (seed, prompt id)
    score     M tasks  task i scores the rollouts whose content key hashes to i into the shared cache (incremental)
    train     1 task   the cycle's view of the cache (its rollout keys, in prompt order), spg steps of `train()`, then
                       the cycle's eval in the same job (export of the new weights, held-out KL: one trainer start-up
                       per cycle); the eval task then finds its result on disk and submits nothing
With max_staleness N the jobs of different cycles run at once (generate c+1 beside train c), within the plan's
bound. A run with held-out prompts or an off-policy dataset starts with one setup job (dataset import + score,
held-out samples + score).

Every job runs exactly one stage of one cycle (slurm_tasks.py) with the stage functions the local executor runs
(stages.py, the same engine settings): `python -m pipeline onpolicy --config OUT/slurm/onpolicy.yaml --stage S
--cycle C [--shard I --num-shards N]`. So both executors train the same weights.

The driver submits a task's jobs, polls squeue (not `sbatch --wait`, slow to notice), then checks the outputs on
disk, which are the truth: rollout shards complete, every score task done (`gkd score --status`), the checkpoint at
(c+1)*spg and the train and eval jobs' result files. It records every job id in state.json (which only it writes;
jobs read it and report through OUT/slurm/results/). Killed and rerun, run_cycles hands it the tasks not recorded
as done: it skips what is complete on disk, waits for jobs still queued or running (recorded, or found by their job
name if the kill came between sbatch and the state write), and submits only the missing array tasks (the `gkd slurm
resubmit` rule). A run that stops early (an error, stop_after, Ctrl-C) cancels the jobs of its tasks in flight;
their outputs are atomic and a rerun submits them again.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

import yaml

from pipeline.config import ConfigError
from pipeline.onpolicy.config import OnPolicyConfig
from pipeline.onpolicy.cycle import ROLE_OF, Task, run_cycles
from pipeline.onpolicy.engines import Engines
from pipeline.onpolicy.slurm_tasks import job_name, missing, num_tasks, result_path, results_dir, run_tag
from pipeline.onpolicy.stages import Workspace, cycle_name, read_metrics, setup_stage
from pipeline.onpolicy.state import State, policy_cycle
from pipeline.slurm.arrays import array_spec
from pipeline.slurm.queue import (
    ACTIVE,
    QueueUnreadable,
    SlurmError,
    active_jobs,
    cancel,
    check_script,
    submit,
    task_states,
)
from pipeline.slurm.sbatch import SbatchOptions, array_script, job_script, write_script
from pipeline.store.shards import atomic_write_bytes

WRITTEN_BY = "`gkd onpolicy executor=slurm`"


class JobFailed(RuntimeError):
    """A stage's jobs ended without its outputs; the message names the jobs, stage, cycle and logs."""


# -- the driver -----------------------------------------------------------------------------------------------------


class SlurmDriver:
    """Submits a task's jobs, waits on squeue, checks outputs, records jobs in state.json; resumable."""

    def __init__(self, cfg: OnPolicyConfig) -> None:
        self.cfg = cfg
        self.ws = Workspace.open(cfg)  # the run's paths and models, as the jobs see them
        self.state = State.load(self.ws.out)
        self.tag = run_tag(cfg.out)
        self.config_file = (Path(cfg.out) / "slurm" / "onpolicy.yaml").resolve()
        self.log_dir = Path(cfg.slurm_log_dir or Path(cfg.out) / "slurm" / "logs").resolve()

    # -- scripts ------------------------------------------------------------------------------------------------
    def options(self, name: str) -> SbatchOptions:
        cfg = self.cfg
        # kill-on-invalid-dep: when a job fails, Slurm cancels the jobs waiting on it instead of keeping them
        # pending forever (a rerun then submits them again after the replacement)
        return SbatchOptions(job_name=name, log_dir=self.log_dir, chdir=Path.cwd(), partition=cfg.slurm_partition,
                             time=cfg.slurm_time, cpus_per_task=cfg.slurm_cpus_per_task, mem=cfg.slurm_mem,
                             gres=cfg.slurm_gres, extra=[*shlex.split(cfg.slurm_extra), "--kill-on-invalid-dep=yes"])

    def script(self, stage: str, cycle: int) -> Path:
        opts = self.options(job_name(self.tag, stage, cycle))
        args = ["--config", str(self.config_file), "--stage", stage] + (["--cycle", str(cycle)] if cycle >= 0 else [])
        n = num_tasks(self.cfg, stage)
        text = (array_script("onpolicy", args, n, opts, written_by=WRITTEN_BY) if n
                else job_script("onpolicy", args, opts, written_by=WRITTEN_BY))
        return write_script(text, opts.script_path())

    def preflight(self) -> None:
        """Write the config every job reads, and let sbatch validate the job options before anything is queued."""
        self.config_file.parent.mkdir(parents=True, exist_ok=True)
        text = yaml.safe_dump(asdict(self.cfg), sort_keys=False)
        if not self.config_file.exists() or self.config_file.read_text() != text:
            atomic_write_bytes(self.config_file, text.encode())
        opts = self.options(f"gkd-onpolicy-{self.tag}-check")
        path = write_script(job_script("onpolicy", ["--help"], opts, written_by=WRITTEN_BY), opts.script_path())
        try:
            check_script(path)
        except SlurmError as e:
            knobs = {k: v for k, v in asdict(self.cfg).items() if k in (
                "slurm_partition", "slurm_time", "slurm_cpus_per_task", "slurm_mem", "slurm_gres", "slurm_extra") and v}
            raise ConfigError(f"sbatch refuses the job options {knobs or '(cluster defaults)'} (checked with "
                              f"`sbatch --test-only {path}`): {e}") from None

    # -- submit --------------------------------------------------------------------------------------------------
    @staticmethod
    def key(stage: str, cycle: int) -> str:
        return "setup" if stage == "setup" else f"{cycle}:{stage}"

    def record(self, stage: str, cycle: int, job: dict) -> None:
        self.state.jobs.setdefault(self.key(stage, cycle), []).append(job)
        self.state.save(self.ws.out)

    def submit_missing(self, stage: str, cycle: int) -> None:
        """Submit the stage's tasks that are neither on disk nor queued (jobs of a killed driver are adopted)."""
        todo = missing(self.ws, self.state, stage, cycle)
        if not todo:
            return
        active = active_jobs(job_name(self.tag, stage, cycle))
        known = {j["id"] for j in self.state.jobs.get(self.key(stage, cycle), [])}
        for job in sorted(set(active) - known):  # submitted by a driver killed before it wrote the id down
            self.record(stage, cycle, {"id": job, "adopted": True})
        busy = {i for states in active.values() for i in states}
        todo = [i for i in todo if i not in busy]
        if todo:
            self.submit(stage, cycle, todo)

    def submit(self, stage: str, cycle: int, todo: list[int]) -> str:
        path = self.script(stage, cycle)
        array = array_spec(todo) if num_tasks(self.cfg, stage) else None
        try:
            job = submit(path, array=array)
        except SlurmError as e:
            raise SlurmError(f"{self.where(stage, cycle)}: could not submit {path}: {e}") from None
        self.record(stage, cycle, {"id": job, "array": array, "submitted": round(time.time())})
        print(f"[onpolicy] {self.where(stage, cycle)}: submitted job {job}{f' --array={array}' if array else ''}",
              file=sys.stderr)
        return job

    @staticmethod
    def where(stage: str, cycle: int) -> str:
        return "setup" if stage == "setup" else f"cycle {cycle}, stage {stage}"

    # -- wait and check ------------------------------------------------------------------------------------------
    def job_ids(self, stage: str, cycle: int) -> list[str]:
        return [j["id"] for j in self.state.jobs.get(self.key(stage, cycle), [])]

    def settled(self, stage: str, cycle: int) -> dict[str, dict[int, str]] | None:
        """The stage's job states once none of its jobs is queued or running; None while one is, or while squeue
        gives no answer (QueueUnreadable: a busy controller is not an ended job; `timed_out` bounds the wait)."""
        try:
            states = {j: task_states(j) for j in self.job_ids(stage, cycle)}
        except QueueUnreadable:
            return None
        return None if any(s in ACTIVE for tasks in states.values() for s in tasks.values()) else states

    def check(self, stage: str, cycle: int, states: dict[str, dict[int, str]]) -> None:
        """The stage's outputs are on disk, or JobFailed naming the job, its state and its log."""
        todo = missing(self.ws, self.state, stage, cycle)
        if todo:
            raise JobFailed(self.failure(stage, cycle, self.job_ids(stage, cycle), states, todo))

    def failure(self, stage: str, cycle: int, ids: list[str], states: dict[str, dict[int, str]],
                todo: list[int]) -> str:
        opts = self.options(job_name(self.tag, stage, cycle))
        tasks = f"tasks --array={array_spec(todo)}" if num_tasks(self.cfg, stage) else "its output"
        # the tasks still missing, as their last attempt ended (earlier attempts' failures since fixed are left out)
        last = {i: (j, s) for j in ids for i, s in sorted(states.get(j, {}).items()) if i in todo}
        failed = [(j, i, s) for i, (j, s) in sorted(last.items()) if s != "COMPLETED"]
        lines = []
        for j, i, s in failed:
            lines.append(f"job {j}{f'_{i}' if i >= 0 else ''} ended {s}; log: {opts.log_path(j, i)}")
        if failed:
            log = opts.log_path(failed[0][0], failed[0][1])
            tail = log.read_text(errors="replace").splitlines()[-12:] if log.exists() else ["(no log file)"]
            lines += [f"last lines of {log.name}:", *(f"    {x}" for x in tail)]
        else:
            lines.append(f"no job of it failed in the queue ({', '.join(ids) or 'none recorded'}: completed, or "
                         f"already forgotten by Slurm); logs under {self.log_dir}")
        head = f"{self.where(stage, cycle)}: " + (
            f"job {failed[0][0]}{f'_{failed[0][1]}' if failed[0][1] >= 0 else ''} {failed[0][2]}, " if failed else "")
        return (head + f"{tasks} missing\n  " + "\n  ".join(lines) + "\nFix the cause and rerun the same command: "
                "finished work is kept, only the missing tasks and the stages after them are submitted again.")

    # -- results: what the stage reports, as run_task reports it on the other executors ---------------------------
    def collect(self, stage: str, cycle: int) -> dict:
        """The stage's result files (its tasks' reports) as one task's result for cycle.run_cycles, with the task's
        times: its jobs' first start and last end (a stage that needed no job: now, for both)."""
        results = [json.loads(p.read_text()) for p in sorted(results_dir(self.cfg).glob(f"{cycle_name(cycle)}-{stage}*.json"))]
        spg = self.cfg.steps_per_generation
        out: dict = {}
        if stage == "export":
            step = policy_cycle(self.cfg, cycle) * spg
            out["weights"] = str(self.ws.student if step == 0 else self.ws.export_dir(step))
        elif stage == "generate":
            tokens = sum(x.get("generate_tokens", 0) for x in results)
            busy = sum(x["generate_tokens"] / x["generate_tok_s"] for x in results if x.get("generate_tok_s"))
            out.update(samples=sum(x.get("samples", 0) for x in results), generate_tokens=tokens,
                       generate_tok_s=round(tokens / busy, 1) if busy else None,
                       sync_s=max((x.get("sync_s", 0.0) for x in results), default=0.0))
        elif stage == "score":
            tokens = sum(x.get("score_tokens", 0) for x in results)
            busy = sum(x.get("score_seconds") or 0.0 for x in results)
            out.update(scored=sum(x.get("scored", 0) for x in results), score_tokens=tokens,
                       already_cached=sum(x.get("already_cached", 0) for x in results),
                       score_tok_s=round(tokens / busy, 1) if busy else None)
        elif stage in ("train", "eval"):
            (result,) = results
            step = self.ws.latest_step()
            if step < (cycle + 1) * spg:
                raise JobFailed(f"{self.where(stage, cycle)}: the latest checkpoint is step {step}, expected "
                                f"{(cycle + 1) * spg}")
            out.update({k: v for k, v in result.items() if k not in ("on_policy", "start", "end", "task_seconds")})
        now = time.time()
        starts = [x["start"] for x in results if "start" in x] or [now]
        ends = [x["end"] for x in results if "end" in x] or [now]
        return {**out, "task_times": {"start": round(min(starts), 3), "end": round(max(ends), 3),
                                      "role": ROLE_OF[stage]}}

    # -- the run's setup: one job ------------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg, st = self.cfg, self.state
        if st.setup_done:
            return
        if not (cfg.heldout_prompts or cfg.offpolicy_dataset):
            # only freezes the off-policy shard list: no engine, no job
            setup_stage(self.ws, Engines(), st, lambda: st.save(self.ws.out))
            return
        self.submit_missing("setup", -1)
        t0 = time.time()
        while (states := self.settled("setup", -1)) is None:
            self.timed_out("setup", -1, t0)
            time.sleep(cfg.slurm_poll_s)
        self.check("setup", -1, states)
        st.offpolicy_shards = json.loads(result_path(cfg, "setup", -1).read_text())["offpolicy_shards"]
        st.setup_done = True
        self.state.save(self.ws.out)

    def timed_out(self, stage: str, cycle: int, since: float) -> None:
        limit = self.cfg.slurm_stage_timeout_s
        if limit is not None and time.time() - since > limit:
            raise JobFailed(f"{self.where(stage, cycle)}: jobs {', '.join(self.job_ids(stage, cycle))} still queued "
                            f"or running after {limit:.0f} s; rerun to keep waiting")


class SlurmRunner:
    """cycle.Runner over Slurm: `start` submits a task's missing jobs (none when its outputs are on disk), `wait`
    polls squeue over the tasks in flight and returns the first (lowest) one whose jobs have all ended, its outputs
    checked; `close` cancels the jobs of tasks still in flight (the run stops early)."""

    def __init__(self, driver: SlurmDriver) -> None:
        self.driver = driver
        self.flight: dict[Task, float] = {}

    def start(self, task: Task, role: str, state: State, info: dict) -> None:
        assert state is self.driver.state  # one state object: the driver's job records and run_cycles' both land in it
        self.driver.submit_missing(task.stage, task.cycle)
        self.flight[task] = time.time()

    def wait(self) -> tuple[Task, dict]:
        d = self.driver
        while True:
            for task in sorted(self.flight):
                states = d.settled(task.stage, task.cycle)
                if states is None:
                    d.timed_out(task.stage, task.cycle, self.flight[task])
                    continue
                del self.flight[task]
                d.check(task.stage, task.cycle, states)
                return task, d.collect(task.stage, task.cycle)
            time.sleep(d.cfg.slurm_poll_s)

    def setup(self, step: str, where: str | None, state: State) -> bool:
        raise NotImplementedError("the Slurm setup is one job (SlurmDriver.setup), not run step by step")

    def close(self) -> None:
        for task in self.flight:
            jobs = [j for j in self.driver.job_ids(task.stage, task.cycle) if _maybe_active(j)]
            if jobs:
                cancel(jobs)
        self.flight.clear()


def _maybe_active(job: str) -> bool:
    """Whether the job may still be queued or running (squeue unanswered: it may; scancel of an ended one is a no-op)."""
    try:
        return any(s in ACTIVE for s in task_states(job).values())
    except QueueUnreadable:
        return True


def run_slurm(cfg: OnPolicyConfig) -> list[dict]:
    """Run (or resume) the on-policy loop as Slurm jobs; returns the metrics lines."""
    driver = SlurmDriver(cfg)
    driver.preflight()
    driver.setup()
    run_cycles(cfg, driver.state, SlurmRunner(driver), desc="onpolicy (slurm)")
    return read_metrics(driver.ws.out)
