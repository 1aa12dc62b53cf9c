"""On-policy GKD driver, local executor: cycles of export -> generate -> score -> train -> eval, resumable.

    gkd onpolicy [--config configs/onpolicy.yaml] [key=value ...]        # make onpolicy

Cycle c covers optimizer steps [c*spg, (c+1)*spg), spg = steps_per_generation. It is on-policy iff
`random.Random(seed + c*spg).random() < lmbda` (the reference trainers' draw). On-policy: the student weights of step
c*spg (the initial folder at step 0, else the HF export of the checkpoint) are synced into the sampler; it samples
this cycle's prompts (policy_version = c*spg, seed = seed + c) into OUT/rollouts/cycle-NNNN; the teacher scores
them into the shared cache (incremental); the cycle's rows are copied into OUT/views/cycle-NNNN; the trainer runs
spg steps on that view. Off-policy: spg steps on the off-policy cache, continuing the trainer's own position in it
(so lmbda=0 is exactly `gkd train` on that cache). Eval: export the new weights, held-out KL, one metrics line.

This module is the orchestration layer above the stages (like a Makefile): it calls their public functions and
is imported by none of them. executor=slurm (pipeline/onpolicy/slurm.py) runs these same `Run` stages, one per Slurm
job (`--stage S --cycle C`), from a driver that submits, polls and checks.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.config import ConfigError
from pipeline.evaluate import heldout_kl
from pipeline.onpolicy.config import STAGES, OnPolicyConfig
from pipeline.onpolicy.engines import Engines
from pipeline.onpolicy.state import State, build_view, is_on_policy, rollout_keys

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "onpolicy.yaml"


class Stopped(Exception):
    """`stop_after` reached: the run exits cleanly with its state saved (tests simulate a kill with it)."""


class Run:
    """One run's paths, models and state; `stage_*` methods are the state machine's stages."""

    def __init__(self, cfg: OnPolicyConfig, engines: Engines) -> None:
        from pipeline.score.scorer import resolve_teacher

        self.cfg, self.engines, self.out = cfg, engines, Path(cfg.out)
        self.save_dir = self.out / "train"
        if cfg.student == "default":
            from pipeline.assets import student_dir

            self.student = student_dir()
        else:
            self.student = Path(cfg.student)
        from pipeline.train.families import check_trainable, read_hf_arch

        # the student's family against the run's seq_length, before any cycle does work
        check_trainable(read_hf_arch(self.student), cfg.seq_length, self.student / "config.json")
        self.teacher = resolve_teacher(cfg.teacher)
        self.state = State.load(self.out)
        self._prompts: list | None = None
        self._tokenizer: Any = None

    # -- paths / helpers -------------------------------------------------------------------------------------------
    def rollouts(self, name: str) -> Path:
        return self.out / "rollouts" / name

    def export_dir(self, step: int) -> Path:
        return self.out / "exports" / f"step-{step:07d}"

    def exported(self, step: int) -> bool:
        """Whether the sampler's weights of `step` are on disk (step 0: the student folder itself). Export folders
        appear atomically, so the file that is always written is proof of a complete one."""
        done = "adapter_config.json" if self.cfg.lora_rank > 0 else "config.json"
        return step == 0 or (self.export_dir(step) / done).exists()

    def weights(self, step: int) -> Path:
        """The HF folder with the student weights of trainer step `step` (exported on demand); for a LoRA student
        the peft adapter folder of that step (step 0: the base itself)."""
        if step == 0:
            return self.student
        path = self.export_dir(step)
        if not self.exported(step):
            from pipeline.train.checkpoint import step_dir
            from pipeline.train.export import export

            # A LoRA student ships its adapter only (peft folder, MBs): the sampler keeps the base weights.
            export(step_dir(self.save_dir, step), path, self.student, adapter_only=self.cfg.lora_rank > 0)
        return path

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.student))
        return self._tokenizer

    def cycle_prompts(self, cycle: int) -> list:
        from pipeline.generate.prompts import load_prompts

        if self._prompts is None:
            self._prompts = load_prompts(self.cfg.prompts, teacher_prompt_field=self.cfg.teacher_prompt_field)
        ppc, n = self.cfg.prompts_per_cycle, len(self._prompts)
        if ppc > n:
            raise ConfigError(f"prompts_per_cycle={ppc} but {self.cfg.prompts} has only {n} prompts")
        return [self._prompts[(cycle * ppc + i) % n] for i in range(ppc)]

    def cycle_seed(self, cycle: int) -> int:
        return self.cfg.seed + cycle if self.cfg.generate_seed is None else self.cfg.generate_seed

    def sample(self, name: str, prompts: list, weights: Path, policy_version: int, seed: int, n: int,
               shard: int = 0, num_shards: int = 1) -> dict:
        """generate stage on an open sampler -> one rollout shard (a no-op when it is complete already); `prompts`
        are shard `shard` of `num_shards`' share (the Slurm executor's array tasks)."""
        from pipeline.engine import engine_version
        from pipeline.generate.run import check_tokenizer, generate, output_path
        from pipeline.store.rollouts import write_rollouts
        from pipeline.store.shards import is_complete

        gcfg = self.cfg.generate_config(self.rollouts(name), str(weights), policy_version, seed)
        gcfg.n, gcfg.shard, gcfg.num_shards = n, shard, num_shards
        path = output_path(gcfg, shard)
        if is_complete(path, "rollout"):
            return {}
        llm, sync_s, lora = self.engines.student(self.cfg, weights)
        fp = check_tokenizer(self.tokenizer(), gcfg)
        result = generate(llm, self.tokenizer(), prompts, gcfg, lora=lora)
        extra = {"tokenizer_fingerprint": fp, "student": str(weights), "policy_version": policy_version,
                 "prompts": [p.prompt_id for p in prompts], "seed": seed, "n": n, "temperature": gcfg.temperature,
                 "top_p": gcfg.top_p, "max_tokens": gcfg.max_tokens, "engine": engine_version(),
                 "skipped": result.stats["skipped"], "finish": result.stats["finish"]}
        write_rollouts(path, result.rows, tokenizer_fingerprint=fp, extra=extra)
        return {"generate_tok_s": result.stats["tok_s"], "generate_tokens": result.stats["tokens"],
                "samples": result.stats["samples"], "sync_s": round(sync_s, 3)}

    def score_into(self, rollouts: Path, cache: str) -> dict:
        from pipeline.score.scorer import score

        s = score(self.cfg.score_config(rollouts, cache), llm=self.engines.scorer(self.cfg, self.teacher))
        seconds = s.get("score_seconds")
        return {"score_tok_s": round(s["tokens"] / seconds, 1) if seconds else None,
                "scored": s.get("scored", 0), "score_tokens": s.get("tokens", 0),
                "already_cached": s.get("skipped", {}).get("cached", 0)}

    def heldout(self) -> dict:
        if not self.cfg.heldout_prompts:
            return {}
        from pipeline.store import TeacherCache

        keys = rollout_keys(self.rollouts("heldout"), TeacherCache.open(self.cfg.cache))
        return heldout_kl(self.weights(self.latest_step()), self.cfg.cache, keys)

    def latest_step(self) -> int:
        from pipeline.train.checkpoint import latest, read_meta

        ckpt = latest(self.save_dir) if self.save_dir.exists() else None
        return int(read_meta(ckpt)["step"]) if ckpt is not None else 0

    def log(self, line: dict) -> None:
        path = self.out / "metrics.jsonl"
        done = {json.loads(x)["cycle"] for x in path.read_text().splitlines()} if path.exists() else set()
        if line["cycle"] not in done:  # a rerun after a kill between the append and the state write
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")

    def log_cycle(self, c: int, info: dict) -> None:
        spg = self.cfg.steps_per_generation
        keys = ("on_policy", "weights", "samples", "generate_tok_s", "sync_s", "score_tok_s", "scored",
                "already_cached", "view_rows", "train_tok_s", "loss", "loss_last", "heldout_kl")
        self.log({"cycle": c, "step": (c + 1) * spg, "policy_version": c * spg if info["on_policy"] else None,
                  **{k: info[k] for k in keys if k in info}, "seconds": info["seconds"]})

    def save(self) -> None:
        self.state.save(self.out)

    # -- once per run ----------------------------------------------------------------------------------------------
    def setup(self) -> None:
        """Off-policy data (imported + scored if configured, then frozen) and the held-out student samples."""
        cfg, st = self.cfg, self.state
        if st.setup_done:
            return
        if cfg.offpolicy_dataset:
            from pipeline.generate.importer import import_rows
            from pipeline.generate.prompts import load_prompts
            from pipeline.store.fingerprint import tokenizer_fingerprint
            from pipeline.store.rollouts import write_rollouts
            from pipeline.store.shards import is_complete

            path = self.rollouts("dataset") / "dataset-00000-of-00001.parquet"
            if not is_complete(path, "rollout"):
                rows, _ = import_rows(self.tokenizer(), load_prompts(cfg.offpolicy_dataset),
                                      max_len=cfg.max_model_len, on_bad="skip", where=cfg.offpolicy_dataset)
                write_rollouts(path, rows, tokenizer_fingerprint=tokenizer_fingerprint(self.tokenizer()),
                               extra={"dataset": cfg.offpolicy_dataset})
            self.score_into(path.parent, cfg.offpolicy_cache)
        if cfg.offpolicy_cache and not st.offpolicy_shards:
            from pipeline.store import TeacherCache

            # Frozen now: rows scored later into the same directory (held-out, on-policy) never join the
            # off-policy data, and its order stays that of `gkd train cache=[offpolicy_cache]`.
            st.offpolicy_shards = [str(p) for p in TeacherCache.open(cfg.offpolicy_cache).shard_paths()]
            self.save()
        if cfg.heldout_prompts:
            from pipeline.generate.prompts import load_prompts

            prompts = load_prompts(cfg.heldout_prompts)
            self.sample("heldout", prompts, self.student, 0, cfg.seed + 1_000_003, cfg.heldout_n)
            self.score_into(self.rollouts("heldout"), cfg.cache)
            self.log({"cycle": -1, "step": 0, **self.heldout()})  # the initial student's held-out KL
        st.setup_done = True
        self.save()

    # -- the cycle's stages ----------------------------------------------------------------------------------------
    def stage_export(self, c: int, info: dict) -> None:
        info["weights"] = str(self.weights(c * self.cfg.steps_per_generation))

    def stage_generate(self, c: int, info: dict) -> None:
        cfg = self.cfg
        info.update(self.sample(f"cycle-{c:04d}", self.cycle_prompts(c), Path(info["weights"]),
                                c * cfg.steps_per_generation, self.cycle_seed(c), cfg.n))

    def stage_score(self, c: int, info: dict) -> None:
        from pipeline.store import TeacherCache

        rollouts = self.rollouts(f"cycle-{c:04d}")
        info.update(self.score_into(rollouts, self.cfg.cache))
        keys = rollout_keys(rollouts, TeacherCache.open(self.cfg.cache))
        shards, missing = build_view(TeacherCache.open(self.cfg.cache), keys, self.out / "views" / f"cycle-{c:04d}")
        info.update(view_shards=shards, view_rows=len(keys) - missing, view_missing=missing)

    def stage_train(self, c: int, info: dict) -> None:
        from pipeline.train.checkpoint import latest, read_meta
        from pipeline.train.run import train

        cfg, spg = self.cfg, self.cfg.steps_per_generation
        start, end = c * spg, (c + 1) * spg
        step = self.latest_step()
        if step < end:  # else: trained before a kill that came before the state write
            if step != start:
                raise RuntimeError(f"{self.save_dir}: latest checkpoint is step {step}, cycle {c} starts at {start}")
            sources = info["view_shards"] if info["on_policy"] else self.state.offpolicy_shards
            if not sources:
                raise RuntimeError(f"cycle {c}: no rows to train on (all samples empty or skipped as overlong?)")
            position = 0 if info["on_policy"] else self.state.offpolicy_position
            train(cfg.train_config(self.save_dir, sources, end - start, position))
        if not info["on_policy"]:
            self.state.offpolicy_position = int(read_meta(latest(self.save_dir))["data_position"])
        steps: dict[int, dict] = {}
        for line in (self.save_dir / "metrics.jsonl").read_text().splitlines():
            m = json.loads(line)
            if start < m["step"] <= end:
                steps[m["step"]] = m  # the last line of a step wins (a killed attempt may have logged it)
        ms = [steps[s] for s in sorted(steps)]
        info.update(loss=sum(m["loss"] for m in ms) / len(ms), loss_last=ms[-1]["loss"],
                    train_tok_s=round(sum(m["tokens_per_s"] for m in ms) / len(ms), 1))

    def stage_eval(self, c: int, info: dict) -> None:
        cfg, spg = self.cfg, self.cfg.steps_per_generation
        end = (c + 1) * spg
        last = c + 1 == cfg.num_cycles
        if cfg.heldout_prompts or last or is_on_policy(cfg.seed, end, cfg.lmbda):
            info["export"] = str(self.weights(end))
        info.update(self.heldout())
        old = self.export_dir(c * spg)
        if c > 0 and old.exists():  # the sampler has moved on; keep only the newest export
            import shutil

            shutil.rmtree(old)

    # -- the loop --------------------------------------------------------------------------------------------------
    def run(self) -> list[dict]:
        from tqdm import tqdm

        cfg, st = self.cfg, self.state
        self.setup()
        bar = tqdm(total=cfg.num_cycles, initial=min(st.cycle, cfg.num_cycles), desc="onpolicy", unit="cycle",
                   disable=not cfg.progress, file=sys.stderr)
        try:
            while st.cycle < cfg.num_cycles:
                c = st.cycle
                info = st.info(c)
                info.setdefault("on_policy", is_on_policy(cfg.seed, c * cfg.steps_per_generation, cfg.lmbda))
                for stage in STAGES[STAGES.index(st.stage):]:
                    t0 = time.perf_counter()
                    if info["on_policy"] or stage in ("train", "eval"):
                        getattr(self, f"stage_{stage}")(c, info)
                    info["seconds"][stage] = round(info["seconds"].get(stage, 0.0) + time.perf_counter() - t0, 2)
                    info["done"].append(stage)
                    if stage == "eval":
                        self.log_cycle(c, info)
                    nxt = STAGES.index(stage) + 1
                    st.cycle, st.stage = (c, STAGES[nxt]) if nxt < len(STAGES) else (c + 1, STAGES[0])
                    self.save()
                    if cfg.stop_after == f"{c}:{stage}":
                        raise Stopped(cfg.stop_after)
                bar.update(1)
                bar.set_postfix(loss=f"{info['loss']:.4f}", kl=f"{info.get('heldout_kl', float('nan')):.4f}",
                                mode="on" if info["on_policy"] else "off")
        finally:
            bar.close()
        path = self.out / "metrics.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def run(cfg: OnPolicyConfig, engines: Engines | None = None) -> list[dict]:
    """Run (or resume) the on-policy loop; returns the metrics lines. Pass `engines` to reuse open engines."""
    if cfg.executor == "slurm":  # the stages as Slurm jobs; this process only submits, polls and checks
        from pipeline.onpolicy.slurm import run_slurm

        return run_slurm(cfg)
    own = engines is None
    engines = engines or Engines()
    try:
        return Run(cfg, engines).run()
    finally:
        if own:
            engines.close()


def main(argv: list[str] | None = None) -> int:
    import argparse

    from pipeline.onpolicy.config import load

    parser = argparse.ArgumentParser(prog="gkd onpolicy", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=None, help=f"flat YAML config (default: {DEFAULT_CONFIG.name})")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    task = parser.add_argument_group("one stage of one cycle (what each job of executor=slurm runs)")
    task.add_argument("--stage", choices=("setup", "export", "generate", "score", "train"))
    task.add_argument("--cycle", type=int, default=-1)
    task.add_argument("--shard", type=int, help="array task (default $SLURM_ARRAY_TASK_ID)")
    task.add_argument("--num-shards", type=int, help="the array's task count (must match the config)")
    task.add_argument("--status", action="store_true", help="print the stage's missing tasks as --array=...; exit 1")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    from pipeline.onpolicy.slurm import JobFailed, task_main
    from pipeline.slurm.queue import SlurmError

    try:
        cfg = load(args.config or DEFAULT_CONFIG, args.overrides)
        if args.stage:
            return task_main(cfg, args.stage, args.cycle, args.shard, args.num_shards, status=args.status)
        lines = run(cfg)
    except Stopped as e:
        print(f"gkd onpolicy: stopped after {e} (state saved; rerun to continue)", file=sys.stderr)
        return 0
    except ConfigError as e:
        print(f"gkd onpolicy: {e}", file=sys.stderr)
        return 2
    except (JobFailed, SlurmError) as e:
        print(f"gkd onpolicy: {e}", file=sys.stderr)
        return 1
    done = [m for m in lines if m["cycle"] >= 0]
    print(f"gkd onpolicy: {len(done)} cycles done in {cfg.out}; last: {json.dumps(done[-1]) if done else '-'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
