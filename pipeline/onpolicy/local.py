"""On-policy GKD, local executor: the plan of cycle.py run on this machine.

    max_staleness=0   every task in this process, one at a time, engines kept open across cycles (InlineRunner)
    max_staleness>=1  one process per role (sampler, teacher, trainer), each holding its own engine for the whole
                      run, so a cycle's generate and score really run beside the previous cycle's train
                      (RoleProcesses)

Both run cycle.run_cycles, which records every finished task in state.json, so a killed run reruns only the tasks
not recorded. A role process that dies (kill -9, out of memory) ends the run with a message naming the role; the
rerun starts fresh role processes. Role processes are multiprocessing spawn children: they import the package, so
they die with their command (pipeline/lifetime.py). Each role process builds its engines with `role_engines()`
(default `Engines`; a benchmark passes stand-ins, e.g. replayed engines): it must be picklable (a module-level class,
or a functools.partial of one), as it travels to the spawned processes.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
from collections.abc import Callable
from typing import Any

from pipeline.onpolicy.config import OnPolicyConfig
from pipeline.onpolicy.cycle import ROLES, Task, run_cycles, run_setup, run_task
from pipeline.onpolicy.engines import Engines
from pipeline.onpolicy.stages import Workspace, read_metrics, setup_step
from pipeline.onpolicy.state import State


class RoleDied(RuntimeError):
    """A role process ended without reporting its task; the message names the role and the task."""


class InlineRunner:
    """Each task in this process, when the loop waits for it (so one at a time: the strict order)."""

    def __init__(self, ws: Workspace, engines: Engines) -> None:
        self.ws, self.engines = ws, engines
        self.pending: list[tuple[Task, State, dict]] = []

    def start(self, task: Task, role: str, state: State, info: dict) -> None:
        self.pending.append((task, state, info))

    def wait(self) -> tuple[Task, dict]:
        task, state, info = self.pending.pop(0)
        return task, run_task(self.ws, self.engines, state, task, info)

    def setup(self, step: str, where: str | None, state: State) -> bool:
        return setup_step(self.ws, self.engines, state, step)

    def close(self) -> None:
        self.pending.clear()


# -- one process per role ------------------------------------------------------------------------------------------

_HOST: dict[str, Any] = {}  # inside a role process: its Workspace and Engines


def _role_init(cfg: OnPolicyConfig, role: str, threads: int, engines: Callable[[], Engines]) -> None:
    import torch

    torch.set_num_threads(threads)
    _HOST.update(role=role, ws=Workspace.open(cfg), engines=engines())


def _role_task(task: Task, state: State, info: dict) -> dict:
    return run_task(_HOST["ws"], _HOST["engines"], state, task, info)


def _role_setup(step: str, state: State) -> tuple[bool, State]:
    changed = setup_step(_HOST["ws"], _HOST["engines"], state, step)
    return changed, state


def _role_close() -> None:
    _HOST["engines"].close()


class RoleProcesses:
    """Sampler, teacher and trainer in a process each (a one-worker pool per role, spawned)."""

    def __init__(self, cfg: OnPolicyConfig, ws: Workspace, engines: Callable[[], Engines] = Engines) -> None:
        self.ws = ws
        ctx = multiprocessing.get_context("spawn")
        threads = max(1, (os.cpu_count() or 1) // len(ROLES))
        self.pools = {role: cf.ProcessPoolExecutor(1, mp_context=ctx, initializer=_role_init,
                                                   initargs=(cfg, role, threads, engines)) for role in ROLES}
        self.futures: dict[cf.Future, tuple[Task, str]] = {}

    def _result(self, fut: cf.Future, what: str, role: str) -> Any:
        try:
            return fut.result()
        except cf.process.BrokenProcessPool:
            raise RoleDied(f"the {role} process died during {what} (killed, or out of memory); state is saved, "
                           "rerun the same command to continue") from None

    def start(self, task: Task, role: str, state: State, info: dict) -> None:
        self.futures[self.pools[role].submit(_role_task, task, state, info)] = (task, role)

    def wait(self) -> tuple[Task, dict]:
        finished, _ = cf.wait(self.futures, return_when=cf.FIRST_COMPLETED)
        fut = min(finished, key=lambda f: self.futures[f][0])  # deterministic when two finish together
        task, role = self.futures.pop(fut)
        return task, self._result(fut, str(task), role)

    def setup(self, step: str, where: str | None, state: State) -> bool:
        if where is None:
            return setup_step(self.ws, Engines(), state, step)
        changed, got = self._result(self.pools[where].submit(_role_setup, step, state), f"the setup's {step}", where)
        vars(state).update(vars(got))
        return changed

    def close(self) -> None:
        """Close the engines (vLLM wants an explicit shutdown), then end the processes; a task still running (the
        run stopped on an error or at stop_after) is killed: its outputs are atomic, a rerun redoes it."""
        for fut in self.futures:
            fut.cancel()
        for role, pool in self.pools.items():
            procs = list(getattr(pool, "_processes", {}).values())
            if any(role == r for _, r in self.futures.values()):
                for p in procs:
                    p.kill()
            else:
                try:
                    pool.submit(_role_close).result(timeout=120)
                except Exception:  # a dead role has nothing left to close
                    pass
            pool.shutdown(wait=True, cancel_futures=True)
        self.futures.clear()


def run_local(cfg: OnPolicyConfig, engines: Engines, role_engines: Callable[[], Engines] = Engines) -> list[dict]:
    """Run (or resume) the on-policy loop on this machine; returns the metrics lines. `engines` serve the strict
    order (max_staleness=0); with overlap each role process opens its own, `role_engines()` (module doc)."""
    ws = Workspace.open(cfg)
    state = State.load(ws.out)
    runner = InlineRunner(ws, engines) if cfg.max_staleness == 0 else RoleProcesses(cfg, ws, role_engines)
    try:
        run_setup(cfg, state, runner, lambda: state.save(ws.out))
    except BaseException:
        runner.close()
        raise
    run_cycles(cfg, state, runner, desc="onpolicy")
    return read_metrics(ws.out)
