"""On-policy GKD on Slurm, the job side: one stage of one cycle inside a job (`gkd onpolicy --stage S --cycle C
[--shard I --num-shards N]`), and the names and output checks the driver (slurm.py) shares with the jobs.

A job runs the stage functions the local executor runs (stages.py); what is done is read from the outputs on disk
(`missing`), never from job states, so the driver, a job's input check and `--status` use the one rule.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict
from pathlib import Path

from pipeline.config import ConfigError
from pipeline.onpolicy.config import OnPolicyConfig
from pipeline.onpolicy.engines import Engines
from pipeline.onpolicy.stages import (
    Workspace,
    cycle_name,
    eval_stage,
    export_stage,
    generate_stage,
    score_stage,
    setup_stage,
    train_stage,
)
from pipeline.onpolicy.state import State, cycle_on_policy, policy_cycle
from pipeline.slurm.arrays import array_spec, task_index
from pipeline.store.rollouts import rollout_shards
from pipeline.store.shards import atomic_write_bytes
from pipeline.store.tasks import missing_rollout_shards, missing_score_tasks, rollouts_tag, write_result

# The stages a job runs (`--stage`); eval runs inside the train job, or alone when that job ended before it.
TASK_STAGES = ("setup", "export", "generate", "score", "train", "eval")


# -- names and paths shared by the driver and the tasks -------------------------------------------------------------


def run_tag(out: str | Path) -> str:
    """Short id of a run (its output folder), so job names of two runs never collide in `squeue --name`."""
    return hashlib.blake2b(str(Path(out).resolve()).encode(), digest_size=3).hexdigest()


def job_name(tag: str, stage: str, cycle: int) -> str:
    return f"gkd-onpolicy-{tag}-setup" if stage == "setup" else f"gkd-onpolicy-{tag}-c{cycle:04d}-{stage}"


def num_tasks(cfg: OnPolicyConfig, stage: str) -> int | None:
    """Array size of an array stage; None for a one-task job."""
    return {"generate": cfg.slurm_generate_shards, "score": cfg.slurm_score_shards}.get(stage)


def results_dir(cfg: OnPolicyConfig) -> Path:
    return Path(cfg.out) / "slurm" / "results"


def result_path(cfg: OnPolicyConfig, stage: str, cycle: int, shard: int | None = None) -> Path:
    name = "setup" if stage == "setup" else f"{cycle_name(cycle)}-{stage}"
    return results_dir(cfg) / f"{name}{'' if shard is None else f'-{shard:05d}'}.json"


def missing(ws: Workspace, state: State, stage: str, cycle: int) -> list[int]:
    """The tasks of `stage` in `cycle` whose outputs are not on disk: array indices, or [-1] for a one-task job;
    [] when the stage is done (or not part of this cycle). Outputs are the truth, not job states."""
    cfg, spg = ws.cfg, ws.cfg.steps_per_generation
    if stage == "setup":
        path = result_path(cfg, "setup", -1)
        return [] if state.setup_done or path.exists() else [-1]
    on_policy = cycle_on_policy(cfg, cycle)
    if stage == "export":  # needed only while the generate tasks still need the weights (eval removes old exports)
        needed = on_policy and missing(ws, state, "generate", cycle)
        return [-1] if needed and not ws.exported(policy_cycle(cfg, cycle) * spg) else []
    if stage == "generate":
        n = cfg.slurm_generate_shards
        folder = ws.rollouts(cycle_name(cycle))
        return missing_rollout_shards(folder, n) if on_policy else []
    if stage == "score":
        m = cfg.slurm_score_shards
        if not on_policy:
            return []
        if missing(ws, state, "generate", cycle):
            return list(range(m))
        tag = rollouts_tag(rollout_shards(ws.rollouts(cycle_name(cycle))))
        return missing_score_tasks(cfg.cache, tag, m)
    if stage == "train":
        done = result_path(cfg, "train", cycle).exists() and ws.latest_step() >= (cycle + 1) * spg
        return [] if done else [-1]
    if stage == "eval":
        return [] if result_path(cfg, "eval", cycle).exists() else [-1]
    raise ValueError(f"unknown stage {stage!r}")


# -- the tasks: one stage of one cycle inside a job ---------------------------------------------------------------
# A job reads state.json, never writes it (the driver owns it). The setup job keeps its state in its own file
# instead, so a rerun of that job continues where it stopped.


def _require(ws: Workspace, state: State, stage: str, cycle: int) -> None:
    """A job's input check: the stage before it is complete (a dependency mishap must not train on half a cycle)."""
    todo = missing(ws, state, stage, cycle)
    if todo:
        raise RuntimeError(f"cycle {cycle}: the {stage} stage is incomplete (tasks {array_spec(todo) or 'the job'} "
                           "missing); its outputs must exist before this job runs")
    if stage == "generate":  # exactly the expected shards: a stray one (another shard count) would join the score
        n = ws.cfg.slurm_generate_shards
        folder = ws.rollouts(cycle_name(cycle))
        stray = [p.name for p in rollout_shards(folder) if not p.name.endswith(f"-of-{n:05d}.parquet")]
        if stray:
            raise RuntimeError(f"{folder}: shards {stray} are not of this run's {n} generate tasks; remove them")


def _setup(ws: Workspace, engines: Engines, state: State, cycle: int, shard: int, n: int) -> dict:
    state_file = results_dir(ws.cfg) / "setup-state.json"
    if state_file.exists():
        vars(state).update(vars(State(**json.loads(state_file.read_text()))))

    def save() -> None:
        state_file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(state_file, json.dumps(asdict(state), indent=1).encode())

    setup_stage(ws, engines, state, save)
    return {"offpolicy_shards": state.offpolicy_shards}


def _export(ws: Workspace, engines: Engines, state: State, cycle: int, shard: int, n: int) -> dict:
    return export_stage(ws, cycle)


def _generate(ws: Workspace, engines: Engines, state: State, cycle: int, shard: int, n: int) -> dict | None:
    stats = generate_stage(ws, engines, cycle, shard, n)
    weights = ws.weights(policy_cycle(ws.cfg, cycle) * ws.cfg.steps_per_generation)
    prompts = ws.shard_prompts(cycle, shard, n)
    return {"weights": str(weights), "prompts": len(prompts), **stats} if stats else None  # {}: complete before


def _score(ws: Workspace, engines: Engines, state: State, cycle: int, shard: int, n: int) -> dict | None:
    _require(ws, state, "generate", cycle)
    # llm=None: the score stage opens the teacher only when the task has rows to score (Engines' settings)
    summary, done_before = score_stage(ws, cycle, None, shard, n)
    return None if done_before else summary


def _train(ws: Workspace, engines: Engines, state: State, cycle: int, shard: int, n: int) -> dict:
    """The cycle's training, then its eval (one trainer start-up per cycle): eval's result file is written here,
    before train's, so a job that ends between the two reruns as an eval job alone."""
    info = {"on_policy": cycle_on_policy(ws.cfg, cycle)}
    if info["on_policy"]:
        _require(ws, state, "score", cycle)
    t0 = time.time()
    train_stage(ws, state, cycle, info)
    info["offpolicy_position"] = state.offpolicy_position  # train_stage moved it (off-policy cycles)
    end = time.time()
    if missing(ws, state, "eval", cycle):
        eval_result = _eval(ws, engines, state, cycle, 0, 1)
        write_result(result_path(ws.cfg, "eval", cycle), {**eval_result, "start": round(end, 3),
                                                          "end": round(time.time(), 3)})
    return {**info, "start": round(t0, 3), "end": round(end, 3)}


def _eval(ws: Workspace, engines: Engines, state: State, cycle: int, shard: int, n: int) -> dict:
    spg = ws.cfg.steps_per_generation
    if ws.latest_step() < (cycle + 1) * spg:
        raise RuntimeError(f"cycle {cycle}: the train stage is incomplete (no checkpoint at step {(cycle + 1) * spg});"
                           " it must exist before this job runs")
    return eval_stage(ws, cycle)


TASKS = {"setup": _setup, "export": _export, "generate": _generate, "score": _score, "train": _train, "eval": _eval}


def task_main(cfg: OnPolicyConfig, stage: str, cycle: int, shard: int | None, num_shards: int | None,
              status: bool = False) -> int:
    """`gkd onpolicy --stage S --cycle C [--shard I --num-shards N] [--status]`: one stage of one cycle (a job's
    command), or with --status the stage's missing tasks as an `--array=` list (exit 1 when any)."""
    if stage not in TASK_STAGES:
        raise ConfigError(f"--stage must be one of {TASK_STAGES}, got {stage!r}")
    if stage != "setup" and not 0 <= cycle < cfg.num_cycles:
        raise ConfigError(f"--cycle {cycle} is outside [0, num_cycles={cfg.num_cycles})")
    n = num_tasks(cfg, stage)
    ws = Workspace.open(cfg)
    state = State.load(ws.out)
    if status:
        todo = missing(ws, state, stage, cycle)
        where = "setup" if stage == "setup" else f"cycle {cycle} {stage}"
        if not todo:
            print(f"{where}: done")
            return 0
        print(f"{where}: {len(todo)} of {n or 1} tasks missing" + (f"; resubmit with:\n--array={array_spec(todo)}" if n else ""))
        return 1
    if n is not None:
        if num_shards is not None and num_shards != n:
            raise ConfigError(f"--num-shards {num_shards} differs from the config's {n} {stage} tasks")
        shard = task_index(shard, n)
    t0 = time.time()
    engines = Engines()
    try:
        result = TASKS[stage](ws, engines, state, cycle, shard or 0, n or 1)
    finally:
        engines.close()
    path = result_path(cfg, stage, cycle, shard if n else None)
    if result is not None or not path.exists():  # a rerun of a finished task keeps the first run's numbers
        result = {"start": round(t0, 3), "end": round(time.time(), 3), **(result or {}),
                  "task_seconds": round(time.time() - t0, 2)}
        write_result(path, result)
    print(f"[onpolicy] {'setup' if stage == 'setup' else f'cycle {cycle} {stage}'}"
          f"{f' task {shard}/{n}' if n else ''} done in {time.time() - t0:.1f} s -> {path}")
    return 0
