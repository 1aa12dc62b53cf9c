"""Helpers of the on-policy tests (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

RG = "reasoning-gym:basic_arithmetic?size={size}&seed={seed}"


def start_and_kill(cmd: list[str], cwd: Path, log: Path, ready: Callable[[], bool], timeout: float,
                   poll: float = 0.1) -> None:
    """Run `gkd onpolicy ...` (`cmd`) in a subprocess and SIGKILL it as soon as `ready()` holds; it must still be
    running then (its log is shown otherwise)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=out,
                                stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + timeout
            while proc.poll() is None and time.time() < deadline and not ready():
                time.sleep(poll)
            assert proc.poll() is None, log.read_text()[-3000:]
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()


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
    """A 2-cycle, 2-steps-per-cycle on-policy run small enough for a loaded 2-core box."""
    values = dict(
        out=str(out), student=str(models["student"]), teacher=str(models["teacher"]), cache=str(out / "cache"),
        num_cycles=2, steps_per_generation=2, lmbda=1.0, seed=7, prompts=RG.format(size=4, seed=0),
        prompts_per_cycle=4, n=2, max_tokens=12, generate_seed=5, topk=8, max_model_len=320, kv_cache_gib=0.05,
        micro_batch_size=2, global_batch_size=4, seq_length=320, lr=2e-3, min_lr=1e-4, warmup_steps=1,
        heldout_prompts=RG.format(size=2, seed=2), progress=False, offpolicy_cache=None, offpolicy_dataset=None,
    )
    values.update(kw)
    return values
