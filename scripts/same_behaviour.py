"""Check that a refactor changed nothing a user sees: the trainer of BASE (a git ref) and of this checkout, on the
same tiny cache, log the same metrics, and a checkpoint BASE wrote resumes here as BASE itself would resume it.

    python scripts/same_behaviour.py BASE [--backend megatron|hf ...]

For each backend: BASE trains 4 steps (the reference); BASE trains 2 of them and stops (`exit_after=2`, a checkpoint
at step 2); this checkout resumes that checkpoint to step 4; this checkout trains 4 steps from scratch. Every metrics
row (losses, grad norm, lr, counts; not the seconds) must be equal to the reference's, to the last digit. The cache
and models are tiny random ones built by the tests' helpers (tests/tiny_cache.py). Exit status 0: all equal.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARYING = {"tokens_per_s", "step_seconds"}  # wall-clock fields: differ between any two runs


def gkd_train(code: Path, args: dict) -> None:
    env = {**os.environ, "PYTHONPATH": f"{code}{os.pathsep}{code / 'tests'}"}
    cmd = [sys.executable, "-m", "pipeline.cli", "train", *[f"{k}={v}" for k, v in args.items()]]
    subprocess.run(cmd, cwd=code, env=env, check=True, stdout=subprocess.DEVNULL)


def rows(save: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in VARYING}
            for line in (save / "metrics.jsonl").read_text().splitlines()]


def build(out: Path) -> tuple[Path, Path]:
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    from tiny_cache import build_tiny, random_samples, score_into_cache

    model = build_tiny(out / "model")
    score_into_cache(model, out / "cache", random_samples(24, 300, seed=1))
    return model, out / "cache"


def check(base: Path, out: Path, model: Path, cache: Path, backend: str) -> list[str]:
    common = dict(student=model, cache=f"[{cache}]", micro_batch_size=2, global_batch_size=4, seq_length=64,
                  train_steps=4, save_interval=2, lr=1e-3, warmup_steps=1, sft_alpha=0.5, progress="false",
                  backend=backend)
    runs = {"base": out / f"{backend}-base", "resumed": out / f"{backend}-resumed", "here": out / f"{backend}-here"}
    gkd_train(base, {**common, "save_dir": runs["base"]})
    gkd_train(base, {**common, "save_dir": runs["resumed"], "exit_after": 2})
    gkd_train(REPO, {**common, "save_dir": runs["resumed"]})
    gkd_train(REPO, {**common, "save_dir": runs["here"]})
    want = rows(runs["base"])
    problems = []
    for name in ("resumed", "here"):
        got = rows(runs[name])
        if got != want:
            problems.append(f"{backend} {name}: {got} != base {want}")
    print(f"{backend}: base {[r.get('loss') for r in want]}; resumed and fresh here "
          + ("equal" if not problems else "DIFFER"))
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base", help="the git ref to compare with (e.g. main~3)")
    ap.add_argument("--backend", action="append", default=None, help="megatron and/or hf (default: both)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gkd-same-") as tmp:
        out, base = Path(tmp), Path(tmp) / "base-code"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base), args.base], cwd=REPO, check=True)
        try:
            model, cache = build(out)
            problems = [p for b in args.backend or ["megatron", "hf"] for p in check(base, out, model, cache, b)]
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=REPO, check=False)
            shutil.rmtree(base, ignore_errors=True)
    print("\n".join(problems) or "same behaviour")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
