"""The on-policy cycle as tasks with their dependencies, defined once, and the one loop that runs them.

Every executor (local.py: in this process, or one process per role; ray.py: one actor per role; slurm.py: jobs)
hands tasks to a runner and records what comes back; none has a loop of its own. A task is one stage of one cycle,
run by one role:

    export    trainer   the sampler's weights of cycle c: those of step policy_cycle(c) * spg
    generate  sampler   cycle c's rollouts, sampled with those weights          needs export c
    score     teacher   the rollouts' teacher rows into the shared cache        needs generate c
    train     trainer   spg steps on the cycle's view (or on off-policy data)   needs score c and eval c-1
    eval      trainer   export of the new weights, held-out KL                  needs train c

`export c` needs `eval policy_cycle(c) - 1` (the weights it ships are trained then). With max_staleness N the
sampler of cycle c uses the weights of cycle policy_cycle(c) = max(0, c - N): always exactly N cycles behind (fewer
at the start), never "whatever is newest". That choice makes the schedule's *results* deterministic however the
roles' timing falls: every task's inputs are fixed by the plan, so a run, a resumed run and another executor
train the same weights; only wall times differ. N = 0 is the strict order (export, generate, score, train, eval,
then the next cycle), one task at a time. N = 1 lets the sampler and the teacher work on cycle c + 1 while the
trainer trains cycle c; the sampler is never more than N cycles ahead of the trainer.

An off-policy cycle (the lmbda draw) runs train and eval only; its export, generate and score are recorded as done
when the strict order reaches them (role None), so state.json reads the same on every executor.

state.json (state.py) records each cycle's done tasks; `state.cycle` / `state.stage` point at the first task not
done in the strict order. A killed run reruns the tasks not recorded; each is idempotent on its own.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pipeline.onpolicy.config import STAGES, OnPolicyConfig
from pipeline.onpolicy.state import State, cycle_on_policy, policy_cycle

ROLES = ("sampler", "teacher", "trainer")
ROLE_OF = {"export": "trainer", "generate": "sampler", "score": "teacher", "train": "trainer", "eval": "trainer"}


@dataclass(frozen=True, order=True)
class Task:
    cycle: int
    stage: str

    def __str__(self) -> str:
        return f"cycle {self.cycle} {self.stage}"


class Plan:
    """The tasks of a run and what each needs (module doc)."""

    def __init__(self, cfg: OnPolicyConfig) -> None:
        self.cfg = cfg
        self.on_policy = [cycle_on_policy(cfg, c) for c in range(cfg.num_cycles)]

    def role(self, task: Task) -> str | None:
        """Who runs `task`; None for a stage an off-policy cycle skips."""
        if not self.on_policy[task.cycle] and task.stage in ("export", "generate", "score"):
            return None
        return ROLE_OF[task.stage]

    def needs(self, task: Task) -> list[Task]:
        c, stage = task.cycle, task.stage
        if stage == "export":
            if self.role(task) is None:  # skipped: recorded where the strict order reaches it
                return [Task(c - 1, "eval")] if c > 0 else []
            p = policy_cycle(self.cfg, c)
            return [Task(p - 1, "eval")] if p > 0 else []
        before = STAGES[STAGES.index(stage) - 1]
        if stage == "train":
            return [Task(c, "score")] + ([Task(c - 1, "eval")] if c > 0 else [])
        return [Task(c, before)]

    def tasks(self) -> list[Task]:
        return [Task(c, s) for c in range(self.cfg.num_cycles) for s in STAGES]

    def ready(self, done: set[Task], busy: set[str]) -> list[Task]:
        """Tasks not done whose needs are done, at most one per idle role (skips need no role), in dispatch order:
        exports first (they free the sampler), then the lowest cycle."""
        out: list[Task] = []
        taken = set(busy)
        candidates = [t for t in self.tasks() if t not in done and all(n in done for n in self.needs(t))]
        for t in sorted(candidates, key=lambda t: (t.stage != "export", t.cycle)):
            role = self.role(t)
            if role is None:
                out.append(t)
            elif role not in taken:
                taken.add(role)
                out.append(t)
        return out

    def done(self, state: State) -> set[Task]:
        return {Task(int(c), s) for c, info in state.cycles.items() for s in info.get("done", [])
                if int(c) < self.cfg.num_cycles}


class Runner(Protocol):
    """Where tasks run (an executor's one job): `start` hands a task to its role, `wait` returns the next one to
    finish with what it reported, `setup` runs one step of the run's setup where its engine lives."""

    def start(self, task: Task, role: str, state: State, info: dict) -> None: ...

    def wait(self) -> tuple[Task, dict]: ...

    def setup(self, step: str, where: str | None, state: State) -> bool: ...

    def close(self) -> None: ...


def run_setup(cfg: OnPolicyConfig, state: State, runner: Runner, save: Callable[[], None]) -> None:
    """The run's setup (stages.setup_steps), each step where its engine is; once per run."""
    from pipeline.onpolicy.stages import setup_steps

    if state.setup_done:
        return
    for step, where in setup_steps(cfg):
        if runner.setup(step, where, state):
            save()
    state.setup_done = True
    save()


def apply_result(state: State, info: dict, result: dict) -> None:
    """A task's report into the cycle's record (and the trainer's off-policy position into the state)."""
    result = dict(result)
    position = result.pop("offpolicy_position", None)
    if position is not None:
        state.offpolicy_position = int(position)
    timing = result.pop("task_times", None)
    if timing is not None:
        info.setdefault("tasks", {})[timing.pop("stage")] = timing
    info.update(result)


def run_cycles(cfg: OnPolicyConfig, state: State, runner: Runner, desc: str = "onpolicy") -> None:
    """Run every task of the plan not yet done, as many at once as the plan and the idle roles allow; record each
    as it finishes (stages.record_stage: state.json, the cycle's metrics line after eval). Stops the runner's
    tasks in flight on any error (their outputs are atomic; a rerun redoes them)."""
    from tqdm import tqdm

    from pipeline.onpolicy.stages import cycle_info, record_stage

    plan = Plan(cfg)
    done = plan.done(state)
    bar = tqdm(total=cfg.num_cycles, initial=min(state.cycle, cfg.num_cycles), desc=desc, unit="cycle",
               disable=not cfg.progress, file=sys.stderr)
    running: dict[str, Task] = {}

    def record(task: Task, result: dict) -> None:
        info = cycle_info(cfg, state, task.cycle)
        apply_result(state, info, result)
        times = info.get("tasks", {}).get(task.stage)
        if times is not None:
            times["received"] = round(time.time(), 3)
            info["seconds"][task.stage] = round(info["seconds"].get(task.stage, 0.0) + times["end"] - times["start"], 2)
        done.add(task)
        record_stage(cfg, state, task.cycle, task.stage, info)
        if task.stage == "eval":
            bar.update(1)
            bar.set_postfix(loss=f"{info['loss']:.4f}", kl=f"{info.get('heldout_kl', float('nan')):.4f}",
                            mode="on" if info["on_policy"] else "off",
                            **({"stale": info["staleness"]["max"]} if info.get("staleness") else {}))

    try:
        while len(done) < len(plan.tasks()):
            ready = plan.ready(done, set(running))
            skips = [t for t in ready if plan.role(t) is None]
            if skips:  # in strict order, before anything is dispatched past them
                record(skips[0], {})
                continue
            for task in ready:
                role = plan.role(task)
                info = cycle_info(cfg, state, task.cycle)
                info.setdefault("tasks", {})[task.stage] = {"dispatched": round(time.time(), 3)}
                runner.start(task, role, state, info)
                running[role] = task
            if not running:
                left = [str(t) for t in plan.tasks() if t not in done]
                raise RuntimeError(f"the on-policy plan is stuck with {left[:3]} left (a bug: please report it)")
            task, result = runner.wait()
            del running[plan.role(task)]
            dispatched = state.cycles[str(task.cycle)]["tasks"][task.stage]["dispatched"]
            record(task, {**result, "task_times": {**result.get("task_times", {}), "dispatched": dispatched,
                                                   "stage": task.stage}})
    finally:
        bar.close()
        runner.close()


# -- the role's side: one task, wherever the role lives ---------------------------------------------------------------


def run_task(ws: Any, engines: Any, state: State, task: Task, info: dict) -> dict:
    """Run `task` on this role's engines; what it reports for the cycle's record (apply_result), with its times."""
    from pipeline.onpolicy.stages import eval_stage, export_stage, generate_stage, score_stage, train_stage

    start = time.time()
    c = task.cycle
    if task.stage == "export":
        out = export_stage(ws, c)
    elif task.stage == "generate":
        out = generate_stage(ws, engines, c)
    elif task.stage == "score":
        out = score_stage(ws, c, engines.scorer(ws.cfg, ws.teacher))[0]
    elif task.stage == "train":
        mine = {k: v for k, v in info.items() if k not in ("done", "seconds", "tasks")}
        train_stage(ws, state, c, mine)
        out = {**mine, "offpolicy_position": state.offpolicy_position}
    elif task.stage == "eval":
        out = eval_stage(ws, c)
    else:
        raise ValueError(f"unknown stage {task.stage!r}")
    return {**out, "task_times": {"start": round(start, 3), "end": round(time.time(), 3), "role": ROLE_OF[task.stage]}}
