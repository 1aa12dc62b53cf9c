"""On-policy GKD, Ray executor: the plan of cycle.py run on three long-lived Ray actors, one per role.

    gkd onpolicy executor=ray ray_address=auto ray_num_gpus=1          # a running cluster (or HOST:PORT, ray://...)
    gkd onpolicy executor=ray ray_num_cpus=2                            # ray_address=local: a cluster of our own
    gkd onpolicy executor=ray max_staleness=1                           # the next cycle sampled while this one trains

Three actors, started once per run and reused by every cycle, each `ray_num_cpus`/`ray_num_gpus`:

    sampler   the student vLLM engine (Engines.student: weights reloaded in place, LoRA adapters swapped): generate
    teacher   the teacher vLLM engine (Engines.scorer): score
    trainer   the trainer process (torch + Megatron-Core or transformers): export, train, eval

The loop is cycle.run_cycles, the same as the local executor's, here in the driver, which alone writes state.json;
with max_staleness >= 1 the actors run their tasks at the same time. A killed driver takes its actors with it (they
are not detached) and a rerun resumes at the tasks not recorded as done, with fresh actors. The run's setup
(held-out samples, an off-policy dataset), once per run, runs step by step (stages.setup_steps) on the actor that
holds each step's engine, so every engine opens once per run. `ray_address=local` declares enough logical CPUs for
the three actors. Each actor uses int(ray_num_cpus) torch threads. Every actor records itself in
OUT/ray/actors.jsonl (role, pid, node) when it starts, and the number of engines it has opened into the cycle's
record in state.json (`ray_actors`): one per engine per run.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from pipeline.onpolicy.config import OnPolicyConfig
from pipeline.onpolicy.cycle import ROLE_OF, ROLES, Task, run_cycles, run_setup, run_task
from pipeline.onpolicy.engines import Engines
from pipeline.onpolicy.stages import Workspace, read_metrics, setup_step
from pipeline.onpolicy.state import State
from pipeline.ray.cluster import RayError, check_resources, connect, enter_cwd, import_ray


class StageHost:
    """One actor: a Workspace and (sampler, teacher) the run's engine, for as long as the run lives."""

    def __init__(self, cfg: OnPolicyConfig, role: str, threads: int, cwd: str) -> None:
        import socket

        import torch

        enter_cwd(cwd)  # relative paths of the config mean what they mean to the driver
        torch.set_num_threads(threads)
        self.cfg, self.role = cfg, role
        self.ws = Workspace.open(cfg)
        self.engines = Engines()
        self.opened: list[int] = []  # ids of the engine objects this actor has held: its engine starts
        self.where = {"role": role, "pid": os.getpid(), "node": socket.gethostname(), "threads": threads}
        log = Path(cfg.out) / "ray" / "actors.jsonl"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as f:
            f.write(json.dumps({**self.where, "started": time.time()}) + "\n")

    def _count(self, engine: Any) -> None:
        if engine is not None and (not self.opened or self.opened[-1] != id(engine)):
            self.opened.append(id(engine))

    def info(self) -> dict:
        return {**self.where, "engine_starts": len(self.opened)}

    def run(self, task: Task, state: State, info: dict) -> dict:
        out = run_task(self.ws, self.engines, state, task, info)
        self._count(self.engines.sampler if self.role == "sampler" else self.engines.teacher)
        return out

    # -- the run's setup, one step at a time on the actor whose engine it uses ------------------------------------
    def setup(self, step: str, state: State) -> tuple[bool, State]:
        changed = setup_step(self.ws, self.engines, state, step)
        self._count(self.engines.sampler if self.role == "sampler" else self.engines.teacher)
        return changed, state

    def close(self) -> None:
        self.engines.close()


class RayDriver:
    """cycle.run_cycles over the three actors (this is its Runner); state.json written here only."""

    def __init__(self, cfg: OnPolicyConfig) -> None:
        self.cfg = cfg
        self.ray = import_ray()
        self.ws = Workspace.open(cfg)
        self.state = State.load(self.ws.out)
        self.actors: dict[str, Any] = {}
        self.refs: dict[Any, Task] = {}  # tasks in flight
        self.busy: set[str] = set()  # roles whose task was in flight when the cycles ended

    def get(self, ref: Any, what: str) -> Any:
        """A result; the stage's own exception as the local executor would raise it; a dead actor as a RayError."""
        ray = self.ray
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, Exception):
                raise e.cause from None
            raise
        except ray.exceptions.RayError as e:
            raise RayError(f"{what}: {type(e).__name__}: {str(e).strip().splitlines()[0]}; state is saved, rerun the "
                           "same command to continue") from None

    def start_actors(self) -> None:
        cfg = self.cfg
        host = self.ray.remote(StageHost)
        threads = max(1, int(cfg.ray_num_cpus))
        for role in ROLES:
            actor = host.options(num_cpus=cfg.ray_num_cpus, num_gpus=cfg.ray_num_gpus,
                                 name=f"gkd-onpolicy-{role}-{os.getpid()}")
            self.actors[role] = actor.remote(cfg, role, threads, os.getcwd())

    # -- the Runner of cycle.run_cycles --------------------------------------------------------------------------
    def setup(self, step: str, where: str | None, state: State) -> bool:
        if where is None:  # only freezes the off-policy shard list: here
            return setup_step(self.ws, Engines(), state, step)
        changed, got = self.get(self.actors[where].setup.remote(step, state), f"the setup's {step}")
        vars(state).update(vars(got))
        return changed

    def start(self, task: Task, role: str, state: State, info: dict) -> None:
        self.refs[self.actors[role].run.remote(task, state, info)] = task

    def wait(self) -> tuple[Task, dict]:
        ready, _ = self.ray.wait(list(self.refs), num_returns=1)
        task = self.refs.pop(ready[0])
        result = self.get(ready[0], str(task))
        if task.stage == "eval":  # the engines each actor has opened so far: one per engine per run
            refs = {r: h.info.remote() for r, h in self.actors.items()}
            result["ray_actors"] = {r: self.get(ref, f"the {r} actor") for r, ref in refs.items()}
        return task, result

    def close(self) -> None:
        """A stop or an error with tasks in flight: their actors are killed in stop() (outputs are atomic)."""
        self.busy = {ROLE_OF[t.stage] for t in self.refs.values()}
        self.refs.clear()

    def loop(self, phases: dict | None = None) -> list[dict]:
        """Actors started, setup on them, the cycles, actors stopped; the seconds of each into `phases` and
        OUT/ray/driver.jsonl (where a Ray run's time goes beyond the cycles' stage seconds)."""
        cfg = self.cfg
        phases = {} if phases is None else phases
        need = {"CPU": cfg.ray_num_cpus, "GPU": cfg.ray_num_gpus}
        check_resources(need, "an on-policy engine actor (ray_num_cpus/ray_num_gpus)", count=len(ROLES))
        t0 = time.perf_counter()
        self.start_actors()
        try:
            # on the actors: their engines serve the cycles after it
            run_setup(cfg, self.state, self, lambda: self.state.save(self.ws.out))
            phases["setup_s"] = round(time.perf_counter() - t0, 2)  # with the actors' start-up (concurrent to it)
            t0 = time.perf_counter()
            run_cycles(cfg, self.state, self, desc="onpolicy (ray)")
            phases["cycles_s"] = round(time.perf_counter() - t0, 2)
        finally:
            t0 = time.perf_counter()
            self.stop()
            phases["stop_s"] = round(time.perf_counter() - t0, 2)
            log = self.ws.out / "ray" / "driver.jsonl"
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "a") as f:
                f.write(json.dumps({"pid": os.getpid(), **phases}) + "\n")
        return read_metrics(self.ws.out)

    def stop(self) -> None:
        """Close the engines (vLLM wants an explicit shutdown; the actors close theirs at once), then end the
        actors."""
        busy = self.busy
        closing = [(handle, handle.close.remote()) for role, handle in self.actors.items() if role not in busy]
        for role in busy & set(self.actors):
            self.ray.kill(self.actors[role])
        for handle, ref in closing:
            try:
                self.ray.get(ref, timeout=120)
            except Exception:  # a dead actor has nothing left to close
                pass
            self.ray.kill(handle)
        self.actors = {}


def local_cpus(cfg: OnPolicyConfig) -> int:
    """Logical CPUs of a `ray_address=local` cluster: the machine's, or enough for the three actors (module doc)."""
    return max(os.cpu_count() or 1, math.ceil(len(ROLES) * cfg.ray_num_cpus))


def run_ray(cfg: OnPolicyConfig) -> list[dict]:
    """Run (or resume) the on-policy loop with its engines in Ray actors; returns the metrics lines."""
    t0 = time.perf_counter()
    with connect(cfg.ray_address, num_cpus=local_cpus(cfg)):  # GPUs: what Ray detects (never declared)
        # the cluster's start (local) or the connection: a fixed cost of every run, as the actors' start
        return RayDriver(cfg).loop({"connect_s": round(time.perf_counter() - t0, 2)})
