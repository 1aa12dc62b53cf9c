"""Helpers of the on-policy tests (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

import shutil
from pathlib import Path

RG = "reasoning-gym:basic_arithmetic?size={size}&seed={seed}"


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
