"""One on-policy cycle's stages, as plain functions over explicit arguments: the one definition both executors run.

    Workspace       one run's resolved inputs and output folder (student/teacher folders, paths, prompts)
    setup_stage     once per run: off-policy data (imported + scored, then frozen), held-out samples + scores
                    (the steps of setup_steps, each on one engine: an executor may run each where its engine is)
    export_stage    the student weights of step c*spg as an HF folder (a peft adapter for a LoRA student)
    generate_stage  the cycle's prompts (one shard of them) -> one rollout shard, policy_version = c*spg
    score_stage     the cycle's rollouts (one shard of them) -> teacher rows in the shared cache
    train_stage     the cycle's view of the cache (on-policy) or the off-policy data -> spg optimizer steps
    eval_stage      export of the new weights, held-out KL
    record_stage    a finished stage into state.json (and the cycle's metrics line after eval)

Cycle c covers optimizer steps [c*spg, (c+1)*spg); it is on-policy iff `Random(seed + c*spg) < lmbda` (state.py).
An off-policy cycle runs only `cycle_stages(False)` = train and eval. The local executor (local.py) calls these in
one process with engines kept open; the Slurm executor (slurm.py) runs each in its own job (`--stage S --cycle C`,
generate and score as arrays of shards) and the same `record_stage` on the login node. Every stage is idempotent on
its own (complete shards kept, scored keys skipped, the trainer resumes from its checkpoint).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.assets import resolve_student
from pipeline.config import ConfigError
from pipeline.evaluate import heldout_kl
from pipeline.generate.importer import import_rows
from pipeline.generate.prompts import load_prompts
from pipeline.generate.sampler import sample_task
from pipeline.onpolicy.config import STAGES, OnPolicyConfig
from pipeline.onpolicy.engines import Engines
from pipeline.onpolicy.state import State, build_view, cycle_on_policy, policy_cycle, rollout_keys
from pipeline.score.scorer import score
from pipeline.score.teacher import resolve_teacher
from pipeline.store import TeacherCache
from pipeline.store.fingerprint import tokenizer_fingerprint
from pipeline.store.rollouts import assign_shard, shard_path, write_rollouts
from pipeline.store.shards import is_complete
from pipeline.train.export import export
from pipeline.train.loop import train
from pipeline.train.models.families import resolve_backend

METRICS = "metrics.jsonl"


class Stopped(Exception):
    """`stop_after` reached: the run exits cleanly with its state saved (tests simulate a kill with it)."""


def cycle_stages(on_policy: bool) -> tuple[str, ...]:
    """The stages a cycle runs: all of STAGES on-policy; train and eval alone off-policy."""
    return STAGES if on_policy else ("train", "eval")


def cycle_name(cycle: int) -> str:
    """The folder name of a cycle's rollouts and view."""
    return f"cycle-{cycle:04d}"


@dataclass
class Workspace:
    """One run's resolved inputs and output folder. `open` checks the student against the run's seq_length and
    resolves the teacher, before any cycle does work."""

    cfg: OnPolicyConfig
    student: Path
    teacher: Path
    _prompts: list | None = field(default=None, repr=False)
    _tokenizer: Any = field(default=None, repr=False)

    @classmethod
    def open(cls, cfg: OnPolicyConfig) -> Workspace:
        student = resolve_student(cfg.student)
        # the trainer's own backend rule: a student neither backend trains is refused before any cycle
        resolve_backend(student, cfg.train_settings.backend, cfg.train_settings.seq_length)
        teacher = resolve_teacher(cfg.teacher)
        cfg.decide_cross_tokenizer(student, teacher)  # a teacher of another family: cross-tokenizer cycles
        return cls(cfg, student, teacher)

    # -- paths ---------------------------------------------------------------------------------------------------
    @property
    def out(self) -> Path:
        return Path(self.cfg.out)

    @property
    def save_dir(self) -> Path:
        return self.out / "train"

    def rollouts(self, name: str) -> Path:
        return self.out / "rollouts" / name

    def view_dir(self, cycle: int) -> Path:
        return self.out / "views" / cycle_name(cycle)

    def export_dir(self, step: int) -> Path:
        return self.out / "exports" / f"step-{step:07d}"

    # -- weights -------------------------------------------------------------------------------------------------
    def exported(self, step: int) -> bool:
        """Whether the sampler's weights of `step` are on disk (step 0: the student folder itself). Export folders
        appear atomically, so the file that is always written is proof of a complete one."""
        done = "adapter_config.json" if self.cfg.train_settings.lora_rank > 0 else "config.json"
        return step == 0 or (self.export_dir(step) / done).exists()

    def weights(self, step: int) -> Path:
        """The HF folder with the student weights of trainer step `step` (exported on demand); for a LoRA student
        the peft adapter folder of that step (step 0: the base itself)."""
        if step == 0:
            return self.student
        path = self.export_dir(step)
        if not self.exported(step):
            from pipeline.train.checkpoint import step_dir

            # A LoRA student ships its adapter only (peft folder, MBs): the sampler keeps the base weights.
            export(step_dir(self.save_dir, step), path, self.student, adapter_only=self.cfg.train_settings.lora_rank > 0)
        return path

    def latest_step(self) -> int:
        from pipeline.train.checkpoint import latest, read_meta

        ckpt = latest(self.save_dir) if self.save_dir.exists() else None
        return int(read_meta(ckpt)["step"]) if ckpt is not None else 0

    # -- inputs --------------------------------------------------------------------------------------------------
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.student))
        return self._tokenizer

    def cycle_prompts(self, cycle: int) -> list:
        """Prompts [c*ppc, (c+1)*ppc) of the source, wrapping around."""

        if self._prompts is None:
            self._prompts = load_prompts(self.cfg.prompts, teacher_prompt_field=self.cfg.teacher_prompt_field,
                                         image_field=self.cfg.generate_settings.image_field)
        ppc, n = self.cfg.prompts_per_cycle, len(self._prompts)
        if ppc > n:
            raise ConfigError(f"prompts_per_cycle={ppc} but {self.cfg.prompts} has only {n} prompts")
        return [self._prompts[(cycle * ppc + i) % n] for i in range(ppc)]

    def shard_prompts(self, cycle: int, shard: int, num_shards: int) -> list:
        """The cycle's prompts that generate task `shard` of `num_shards` samples (all of them for one task)."""
        return [p for p in self.cycle_prompts(cycle) if assign_shard(p.prompt_id, num_shards) == shard]

    def cycle_seed(self, cycle: int) -> int:
        return self.cfg.seed + cycle if self.cfg.generate_seed is None else self.cfg.generate_seed


# -- the stages' building blocks --------------------------------------------------------------------------------------


def sample(ws: Workspace, engines: Engines, name: str, prompts: list, weights: Path, policy_version: int, seed: int,
           n: int, shard: int = 0, num_shards: int = 1) -> dict:
    """The generate stage's task (`generate.sampler.sample_task`) on the sampler of `engines` -> one rollout shard
    of OUT/rollouts/NAME ({} when it is complete already); `prompts` are shard `shard` of `num_shards`' share."""
    gcfg = ws.cfg.generate_config(ws.rollouts(name), str(weights), policy_version, seed)
    gcfg.n, gcfg.shard, gcfg.num_shards = n, shard, num_shards
    sync: dict[str, float] = {}

    def engine() -> tuple[Any, Any]:
        llm, sync["s"], lora = engines.student(ws.cfg, weights)
        return llm, lora

    result = sample_task(gcfg, shard, ws.tokenizer, engine, prompts=prompts,
                         marker={"prompts": [p.prompt_id for p in prompts]})
    if result is None:
        return {}
    return {"generate_tok_s": result.stats["tok_s"], "generate_tokens": result.stats["tokens"],
            "samples": result.stats["samples"], "sync_s": round(sync["s"], 3)}


def score_into(ws: Workspace, rollouts: Path, cache: str, llm: Any = None, shard: int = 0,
               num_shards: int = 1) -> tuple[dict, bool]:
    """The score stage: rollouts (score task `shard` of `num_shards`) -> teacher rows in `cache`; `llm`: an open
    teacher (None: the score stage opens one when the task has rows to score). Returns the summary and whether the
    task was done before."""

    scfg = ws.cfg.score_config(rollouts, cache)
    scfg.shard, scfg.num_shards = shard, num_shards
    s = score(scfg, llm=llm)
    seconds = s.get("score_seconds")
    return ({"score_tok_s": round(s["tokens"] / seconds, 1) if seconds else None, "scored": s.get("scored", 0),
             "score_tokens": s.get("tokens", 0), "score_seconds": seconds,
             "already_cached": s.get("skipped", {}).get("cached", 0)}, bool(s.get("done_before")))


def heldout(ws: Workspace) -> dict:
    """Held-out KL(teacher || student) of the latest weights on the held-out samples ({} without held-out prompts)."""
    if not ws.cfg.heldout_prompts:
        return {}
    keys = rollout_keys(ws.rollouts("heldout"), TeacherCache.open(ws.cfg.cache))
    return heldout_kl(ws.weights(ws.latest_step()), ws.cfg.cache, keys)


def build_cycle_view(ws: Workspace, cycle: int) -> dict:
    """The cycle's rows of the shared cache, copied into OUT/views/cycle-NNNN in prompt order (state.build_view):
    the same view whether one generate/score task or an array of them made the rows."""
    cache = TeacherCache.open(ws.cfg.cache)
    order = [p.prompt_id for p in ws.cycle_prompts(cycle)]
    keys = rollout_keys(ws.rollouts(cycle_name(cycle)), cache, order)
    shards, missing = build_view(cache, keys, ws.view_dir(cycle))
    return {"view_shards": shards, "view_rows": len(keys) - missing, "view_missing": missing}


def view_staleness(ws: Workspace, cycle: int) -> dict:
    """How many policy versions (cycles) behind the trained weights the cycle's rows were sampled: min / mean /
    max over the view's rows, read from the policy_version each row carries (not from the plan)."""
    import pyarrow.parquet as pq

    spg = ws.cfg.steps_per_generation
    shards = sorted((ws.view_dir(cycle) / "shards").glob("*.parquet"))
    versions = [v for p in shards for v in pq.read_table(p, columns=["policy_version"]).column(0).to_pylist()
                if v is not None]
    if not versions:
        return {}
    lag = [(cycle * spg - v) / spg for v in versions]
    return {"min": min(lag), "mean": round(sum(lag) / len(lag), 3), "max": max(lag)}


# -- metrics and state ----------------------------------------------------------------------------------------------


def append_metrics(out: Path, line: dict) -> None:
    """One line of OUT/metrics.jsonl per cycle (cycle -1: the initial student's held-out KL)."""
    path = out / METRICS
    done = {json.loads(x)["cycle"] for x in path.read_text().splitlines()} if path.exists() else set()
    if line["cycle"] not in done:  # a rerun after a kill between the append and the state write
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


def read_metrics(out: Path) -> list[dict]:
    path = out / METRICS
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def log_cycle(cfg: OnPolicyConfig, cycle: int, info: dict) -> None:
    spg = cfg.steps_per_generation
    keys = ("on_policy", "weights", "samples", "generate_tok_s", "sync_s", "score_tok_s", "scored",
            "already_cached", "view_rows", "staleness", "train_tok_s", "loss", "loss_last", "heldout_kl")
    append_metrics(Path(cfg.out), {"cycle": cycle, "step": (cycle + 1) * spg,
                                   "policy_version": policy_cycle(cfg, cycle) * spg if info["on_policy"] else None,
                                   **{k: info[k] for k in keys if k in info}, "seconds": info["seconds"]})


def record_stage(cfg: OnPolicyConfig, state: State, cycle: int, stage: str, info: dict) -> None:
    """`stage` of `cycle` is done (or skipped, off-policy): into the cycle's info, the cycle's metrics line after
    eval, state.json's pointer moved to the first task not done in the strict order (cycle.py; with overlapping
    cycles later tasks may be done already); raises Stopped at `stop_after`."""
    if stage not in info["done"]:
        info["done"].append(stage)
    if stage == "eval":
        log_cycle(cfg, cycle, info)
    c = state.cycle
    while c < cfg.num_cycles and set(STAGES) <= set(state.cycles.get(str(c), {}).get("done", [])):
        c += 1
    done = state.cycles.get(str(c), {}).get("done", [])
    state.cycle, state.stage = c, next((s for s in STAGES if s not in done), STAGES[0])
    state.save(Path(cfg.out))
    if cfg.stop_after == f"{cycle}:{stage}":
        raise Stopped(cfg.stop_after)


def cycle_info(cfg: OnPolicyConfig, state: State, cycle: int) -> dict:
    """The cycle's record in state.json (created on first use), with its on/off-policy draw."""
    info = state.info(cycle)
    info.setdefault("on_policy", cycle_on_policy(cfg, cycle))
    return info


# -- the stages -----------------------------------------------------------------------------------------------------


# The setup's steps in order, each with the engine (or model) it runs on: the Ray executor runs each on the actor that
# holds that engine, so no engine is opened twice; the local executor and the Slurm setup job call setup_stage.
SETUP_STEPS = (("offpolicy_score", "teacher"), ("offpolicy_freeze", None), ("heldout_sample", "sampler"),
               ("heldout_score", "teacher"), ("heldout_kl", "trainer"))


def setup_steps(cfg: OnPolicyConfig) -> list[tuple[str, str | None]]:
    """The setup steps `cfg` needs (SETUP_STEPS, in order): the off-policy ones with an off-policy dataset/cache, the
    held-out ones with held-out prompts."""
    wanted = {"offpolicy_score": bool(cfg.offpolicy_dataset), "offpolicy_freeze": bool(cfg.offpolicy_cache)}
    return [(step, where) for step, where in SETUP_STEPS if wanted.get(step, bool(cfg.heldout_prompts))]


def setup_step(ws: Workspace, engines: Engines, state: State, step: str) -> bool:
    """One setup step (each idempotent: a rerun after a kill redoes only what is missing); True when it changed
    `state` (the off-policy shard list, frozen: save it before the next step)."""
    cfg = ws.cfg
    if step == "offpolicy_score":  # the off-policy dataset imported and scored into offpolicy_cache
        path = shard_path(ws.rollouts("dataset"), "dataset", 0, 1)
        if not is_complete(path, "rollout"):
            rows, _ = import_rows(ws.tokenizer(), load_prompts(cfg.offpolicy_dataset),
                                  max_len=cfg.score_settings.max_model_len, on_bad="skip", where=cfg.offpolicy_dataset)
            write_rollouts(path, rows, tokenizer_fingerprint=tokenizer_fingerprint(ws.tokenizer()),
                           extra={"dataset": cfg.offpolicy_dataset})
        score_into(ws, path.parent, cfg.offpolicy_cache, engines.scorer(cfg, ws.teacher))
    elif step == "offpolicy_freeze":
        if state.offpolicy_shards:
            return False
        # Frozen now: rows scored later into the same directory (held-out, on-policy) never join the
        # off-policy data, and its order stays that of `gkd train cache=[offpolicy_cache]`.
        state.offpolicy_shards = [str(p) for p in TeacherCache.open(cfg.offpolicy_cache).shard_paths()]
        return True
    elif step == "heldout_sample":
        sample(ws, engines, "heldout", load_prompts(cfg.heldout_prompts), ws.student, 0, cfg.seed + 1_000_003,
               cfg.heldout_n)
    elif step == "heldout_score":
        score_into(ws, ws.rollouts("heldout"), cfg.cache, engines.scorer(cfg, ws.teacher))
    elif step == "heldout_kl":
        append_metrics(ws.out, {"cycle": -1, "step": 0, **heldout(ws)})  # the initial student's held-out KL
    else:
        raise ValueError(f"unknown setup step {step!r}")
    return False


def setup_stage(ws: Workspace, engines: Engines, state: State, save: Callable[[], None]) -> None:
    """Once per run: off-policy data (imported + scored if configured, then frozen) and the held-out student samples
    (the initial student's held-out KL is the metrics line of cycle -1), the steps of `setup_steps` in this process.
    `save` writes `state` where it lives."""
    if state.setup_done:
        return
    for step, _ in setup_steps(ws.cfg):
        if setup_step(ws, engines, state, step):
            save()
    state.setup_done = True
    save()


def export_stage(ws: Workspace, cycle: int) -> dict:
    """The weights that sample cycle `cycle` (those of its policy cycle, state.policy_cycle) as an HF folder."""
    return {"weights": str(ws.weights(policy_cycle(ws.cfg, cycle) * ws.cfg.steps_per_generation))}


def generate_stage(ws: Workspace, engines: Engines, cycle: int, shard: int = 0, num_shards: int = 1) -> dict:
    """Generate task `shard` of `num_shards` of the cycle; its stats ({} when its shard was complete before)."""
    step = policy_cycle(ws.cfg, cycle) * ws.cfg.steps_per_generation
    if not ws.exported(step):  # never export here: N tasks would write the same folder at once
        raise RuntimeError(f"{ws.export_dir(step)}: the student weights of step {step} are missing (the export stage "
                           "writes them)")
    return sample(ws, engines, cycle_name(cycle), ws.shard_prompts(cycle, shard, num_shards), ws.weights(step),
                  step, ws.cycle_seed(cycle), ws.cfg.generate_settings.n, shard, num_shards)


def score_stage(ws: Workspace, cycle: int, llm: Any = None, shard: int = 0, num_shards: int = 1) -> tuple[dict, bool]:
    """Score task `shard` of `num_shards` of the cycle's rollouts into the shared cache (`score_into`)."""
    return score_into(ws, ws.rollouts(cycle_name(cycle)), ws.cfg.cache, llm, shard, num_shards)


def train_stage(ws: Workspace, state: State, cycle: int, info: dict) -> None:
    """spg steps of the run's trainer: on-policy on the cycle's view, off-policy on the frozen off-policy data from
    the trainer's own position there (moved in `state`). Loss and throughput of the cycle's steps into `info`."""
    from pipeline.train.checkpoint import latest, read_meta

    cfg, spg = ws.cfg, ws.cfg.steps_per_generation
    if info["on_policy"]:
        info.update(build_cycle_view(ws, cycle))
        info["staleness"] = view_staleness(ws, cycle)
    start, end = cycle * spg, (cycle + 1) * spg
    step = ws.latest_step()
    if step < end:  # else: trained before a kill that came before the state write
        if step != start:
            raise RuntimeError(f"{ws.save_dir}: latest checkpoint is step {step}, cycle {cycle} starts at {start}")
        sources = info["view_shards"] if info["on_policy"] else state.offpolicy_shards
        if not sources:
            raise RuntimeError(f"cycle {cycle}: no rows to train on (all samples empty or skipped as overlong?)")
        position = 0 if info["on_policy"] else state.offpolicy_position
        train(cfg.train_config(ws.save_dir, sources, end - start, position))
    if not info["on_policy"]:
        state.offpolicy_position = int(read_meta(latest(ws.save_dir))["data_position"])
    steps: dict[int, dict] = {}
    for line in (ws.save_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if start < m["step"] <= end:
            steps[m["step"]] = m  # the last line of a step wins (a killed attempt may have logged it)
    ms = [steps[s] for s in sorted(steps)]
    info.update(loss=sum(m["loss"] for m in ms) / len(ms), loss_last=ms[-1]["loss"],
                train_tok_s=round(sum(m["tokens_per_s"] for m in ms) / len(ms), 1))


def eval_stage(ws: Workspace, cycle: int) -> dict:
    """Export the new weights (when a sampler, the held-out KL or the run's end needs them: the sampler of cycle
    c + 1 + max_staleness), held-out KL; the weights that sampled this cycle are removed (no later cycle samples
    with them; only the newest exports are kept)."""
    cfg, spg = ws.cfg, ws.cfg.steps_per_generation
    end = (cycle + 1) * spg
    out: dict = {}
    if cfg.heldout_prompts or cycle + 1 == cfg.num_cycles or cycle_on_policy(cfg, cycle + 1 + cfg.max_staleness):
        out["export"] = str(ws.weights(end))
    out.update(heldout(ws))
    used = policy_cycle(cfg, cycle)
    old = ws.export_dir(used * spg)
    if used > 0 and old.exists():
        shutil.rmtree(old)
    return out
