"""On-policy GKD, Ray executor: the local executor's loop, with each engine in a long-lived Ray actor.

    gkd onpolicy executor=ray ray_address=auto ray_num_gpus=1          # a running cluster (or HOST:PORT, ray://...)
    gkd onpolicy executor=ray ray_num_cpus=2                            # ray_address=local: a cluster of our own

Three actors, started once per run and reused by every cycle, each `ray_num_cpus`/`ray_num_gpus`:

    sampler   the student vLLM engine (Engines.student: weights reloaded in place, LoRA adapters swapped): generate
    teacher   the teacher vLLM engine (Engines.scorer): score
    trainer   the trainer process (torch + Megatron-Core or transformers): export, train, eval

The cycle is the local executor's (local.py): the stages of stages.py in order from the stage state.json names,
`record_stage` after each, here in the driver, which alone writes state.json; a killed driver takes its actors with
it (they are not detached) and a rerun resumes at the first stage not recorded as done, with fresh actors. The run's
setup (held-out samples, an off-policy dataset), once per run, runs step by step (stages.setup_steps) on the actor
that holds each step's engine, so every engine opens once per run (the local executor's setup also opens the engines
its cycles reuse). Stages run one at a time, so on one machine each actor may reserve all its cores:
`ray_address=local` declares enough logical CPUs for the three. Each actor uses int(ray_num_cpus) torch threads.
Every actor records itself in OUT/ray/actors.jsonl (role, pid, node) when it starts, and the number of engines it
has opened into the cycle's record in state.json (`ray_actors`): one per engine per run.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.onpolicy.config import STAGES, OnPolicyConfig
from pipeline.onpolicy.engines import Engines
from pipeline.onpolicy.stages import (
    Workspace,
    cycle_info,
    cycle_stages,
    eval_stage,
    export_stage,
    generate_stage,
    read_metrics,
    record_stage,
    score_stage,
    setup_step,
    setup_steps,
    train_stage,
)
from pipeline.onpolicy.state import State
from pipeline.ray.cluster import RayError, check_resources, connect, enter_cwd, import_ray

ROLES = ("sampler", "teacher", "trainer")


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

    # -- sampler / teacher --------------------------------------------------------------------------------------
    def generate(self, cycle: int) -> dict:
        out = generate_stage(self.ws, self.engines, cycle)
        self._count(self.engines.sampler)
        return out

    def score(self, cycle: int) -> dict:
        llm = self.engines.scorer(self.cfg, self.ws.teacher)
        self._count(llm)
        return score_stage(self.ws, cycle, llm)[0]

    # -- trainer ------------------------------------------------------------------------------------------------
    def export(self, cycle: int) -> dict:
        return export_stage(self.ws, cycle)

    def train(self, cycle: int, state: State, info: dict) -> tuple[dict, int]:
        train_stage(self.ws, state, cycle, info)
        return info, state.offpolicy_position

    def eval(self, cycle: int) -> dict:
        return eval_stage(self.ws, cycle)

    # -- the run's setup, one step at a time on the actor whose engine it uses ------------------------------------
    def setup(self, step: str, state: State) -> None:
        setup_step(self.ws, self.engines, state, step)
        self._count(self.engines.sampler if self.role == "sampler" else self.engines.teacher)

    def close(self) -> None:
        self.engines.close()


class RayDriver:
    """The local executor's loop over the three actors; state.json written here only."""

    def __init__(self, cfg: OnPolicyConfig) -> None:
        self.cfg = cfg
        self.ray = import_ray()
        self.ws = Workspace.open(cfg)
        self.state = State.load(self.ws.out)
        self.actors: dict[str, Any] = {}

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

    def start(self) -> None:
        cfg = self.cfg
        host = self.ray.remote(StageHost)
        threads = max(1, int(cfg.ray_num_cpus))
        for role in ROLES:
            actor = host.options(num_cpus=cfg.ray_num_cpus, num_gpus=cfg.ray_num_gpus,
                                 name=f"gkd-onpolicy-{role}-{os.getpid()}")
            self.actors[role] = actor.remote(cfg, role, threads, os.getcwd())

    def setup(self) -> None:
        """setup_stage's steps, each on the actor that holds its engine (the engine the cycles reuse); the step
        that only freezes the off-policy shard list here, and state.json saved here only."""
        st = self.state
        if st.setup_done:
            return
        for step, where in setup_steps(self.cfg):
            if where is None:
                if setup_step(self.ws, Engines(), st, step):
                    st.save(self.ws.out)
            else:
                self.get(self.actors[where].setup.remote(step, st), f"the setup's {step}")
        st.setup_done = True
        st.save(self.ws.out)

    def run_stage(self, stage: str, cycle: int, info: dict) -> None:
        a = self.actors
        if stage == "export":
            info.update(self.get(a["trainer"].export.remote(cycle), f"cycle {cycle} export"))
        elif stage == "generate":
            info.update(self.get(a["sampler"].generate.remote(cycle), f"cycle {cycle} generate"))
        elif stage == "score":
            info.update(self.get(a["teacher"].score.remote(cycle), f"cycle {cycle} score"))
        elif stage == "train":
            got, position = self.get(a["trainer"].train.remote(cycle, self.state, info), f"cycle {cycle} train")
            info.update(got)
            self.state.offpolicy_position = position
        elif stage == "eval":
            info.update(self.get(a["trainer"].eval.remote(cycle), f"cycle {cycle} eval"))
        else:
            raise ValueError(f"unknown stage {stage!r}")

    def loop(self, phases: dict | None = None) -> list[dict]:
        """Actors started, setup on them, the cycles, actors stopped; the seconds of each into `phases` and
        OUT/ray/driver.jsonl (where a Ray run's time goes beyond the cycles' stage seconds)."""
        cfg = self.cfg
        phases = {} if phases is None else phases
        need = {"CPU": cfg.ray_num_cpus, "GPU": cfg.ray_num_gpus}
        check_resources(need, "an on-policy engine actor (ray_num_cpus/ray_num_gpus)", count=len(ROLES))
        t0 = time.perf_counter()
        self.start()
        try:
            self.setup()  # on the actors: their engines serve the cycles after it
            phases["setup_s"] = round(time.perf_counter() - t0, 2)  # with the actors' start-up (concurrent to it)
            t0 = time.perf_counter()
            self.cycles()
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

    def cycles(self) -> None:
        from tqdm import tqdm

        cfg, st = self.cfg, self.state
        bar = tqdm(total=cfg.num_cycles, initial=min(st.cycle, cfg.num_cycles), desc="onpolicy (ray)", unit="cycle",
                   disable=not cfg.progress, file=sys.stderr)
        try:
            while st.cycle < cfg.num_cycles:
                c = st.cycle
                info = cycle_info(cfg, st, c)
                for stage in STAGES[STAGES.index(st.stage):]:
                    t0 = time.perf_counter()
                    if stage in cycle_stages(info["on_policy"]):
                        self.run_stage(stage, c, info)
                    info["seconds"][stage] = round(info["seconds"].get(stage, 0.0) + time.perf_counter() - t0, 2)
                    if stage == "eval":
                        refs = {r: h.info.remote() for r, h in self.actors.items()}
                        info["ray_actors"] = {r: self.get(ref, f"the {r} actor") for r, ref in refs.items()}
                    record_stage(cfg, st, c, stage, info)
                bar.update(1)
                bar.set_postfix(loss=f"{info['loss']:.4f}", kl=f"{info.get('heldout_kl', float('nan')):.4f}",
                                mode="on" if info["on_policy"] else "off")
        finally:
            bar.close()

    def stop(self) -> None:
        """Close the engines (vLLM wants an explicit shutdown; the actors close theirs at once), then end the
        actors."""
        closing = [(handle, handle.close.remote()) for handle in self.actors.values()]
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
