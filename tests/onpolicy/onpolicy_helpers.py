"""Helpers of the on-policy tests (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import killing  # tests/killing.py (tests/conftest.py puts tests/ on sys.path)

from pipeline.lifetime import descendants, survivors

REPO = Path(__file__).resolve().parents[2]

RG = "reasoning-gym:basic_arithmetic?size={size}&seed={seed}"


def start_and_kill(cmd: list[str], cwd: Path, log: Path, pause_at: str) -> None:
    """Run `gkd onpolicy ...` (`cmd`) in a subprocess with $GKD_PAUSE_AT=`pause_at` (pipeline/pause.py), wait until
    the driver has stopped itself there (a state, not a clock: it cannot move on while the test looks), and SIGKILL
    it (the driver alone, as a user's kill -9 does). What the kill point left on disk is exactly that point's, however
    busy the machine. No process it started may survive it (pipeline/lifetime.py): its engine, loader and stage
    processes die with it. The driver's log is shown when it ends before its pause point."""
    with open(log, "w") as out:
        proc = killing.start(cmd, pause_at, cwd=cwd, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=out,
                             stderr=subprocess.STDOUT)
        try:
            try:
                # a hang bound only: setup and a cycle or two of engine starts before the point, on 2 busy cores
                stopped = killing.wait_stopped(proc, deadline_s=2 * killing.DEADLINE_S)
            except AssertionError as e:
                raise AssertionError(f"{e}\n{log.read_text()[-3000:]}") from None
            # the driver itself (its stage subprocesses reach no driver point), not one of its children
            assert stopped == proc.pid, (stopped, proc.pid)
            below = descendants(proc.pid)  # while it is stopped: orphans cannot be found by parent later
            killing.kill(proc)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    left = survivors(below, wait_s=600)  # a deadline for a hang only: on 2 busy cores an engine dies slowly
    assert not left, f"processes of the killed command survived it: {left} (of {sorted(below)})"


def build_models(root: Path) -> dict:
    from tiny_models import build_llama, build_tokenizer

    tok = build_tokenizer(root / "teacher")
    build_llama(root / "teacher", vocab_size=len(tok), seed=0, scale=4.0)
    (root / "student").mkdir()
    for f in (root / "teacher").iterdir():
        if "token" in f.name or f.name.endswith(".jinja"):
            shutil.copy2(f, root / "student" / f.name)
    build_llama(root / "student", vocab_size=len(tok), seed=1, tie=True, scale=4.0)
    return {"teacher": root / "teacher", "student": root / "student", "root": root}


def overrides(models: dict, out: Path, **kw) -> dict:
    """A 2-cycle, 2-steps-per-cycle on-policy run small enough for a loaded 2-core box. A keyword that is a stage
    setting (lr=..., lora_rank=..., loss=...; train_extra={...} for several) goes to its stage's section."""
    values = {
        "out": str(out), "student": str(models["student"]), "teacher": str(models["teacher"]),
        "cache": str(out / "cache"), "num_cycles": 2, "steps_per_generation": 2, "lmbda": 1.0, "seed": 7,
        "prompts": RG.format(size=4, seed=0), "prompts_per_cycle": 4, "generate_seed": 5,
        "heldout_prompts": RG.format(size=2, seed=2), "progress": False, "offpolicy_cache": None,
        "offpolicy_dataset": None,
        "generate.n": 2, "generate.max_tokens": 12, "generate.max_model_len": 320, "generate.kv_cache_gib": 0.05,
        "score.topk": 8, "score.max_model_len": 320, "score.kv_cache_gib": 0.05,
        "train.micro_batch_size": 2, "train.global_batch_size": 4, "train.seq_length": 320, "train.lr": 2e-3,
        "train.min_lr": 1e-4, "train.warmup_steps": 1,
    }
    for k, v in kw.items():
        values.update(_section_key(k, v))
    return values


def _section_key(key: str, value) -> dict:
    import dataclasses

    from pipeline.generate.sampler import GenerateConfig
    from pipeline.onpolicy.config import OnPolicyConfig
    from pipeline.score.config import ScoreConfig
    from pipeline.train.config import TrainConfig

    if key in {f.name for f in dataclasses.fields(OnPolicyConfig)}:
        return {key: value}
    if key == "train_extra":
        return {f"train.{k}": v for k, v in value.items()}
    for stage, cls in (("train", TrainConfig), ("score", ScoreConfig), ("generate", GenerateConfig)):
        if key in {f.name for f in dataclasses.fields(cls)}:
            return {f"{stage}.{key}": value}
    raise KeyError(f"{key} is neither an on-policy nor a stage setting")
