"""Generate stage, the entry: prompts -> student rollouts, sampled with vLLM, one rollout shard per task.

    gkd generate                                            # configs/generate.yaml: SmolLM2 student, reasoning-gym
    gkd generate --config configs/generate.yaml n=8 temperature=0.7
    gkd generate --prompts data.jsonl --student runs/export/step-200 --out runs/rollouts/v200 policy_version=200
    gkd generate --prompts data.jsonl --student BASE --adapter LORA_DIR --out DIR --shard 3 --num-shards 8
    gkd generate --prompts data.jsonl --out DIR --num-shards 8 --status    # which tasks are missing (exit 1 if any)

The stage itself (sampling, the task's rules, the shard) is pipeline/generate/sampler.py; this module parses the
arguments and prints.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.config import load_config, parse_overrides
from pipeline.errors import command
from pipeline.generate.sampler import (
    GenerateConfig,
    output_path,
    run_generate,
)
from pipeline.slurm.arrays import array_spec, task_index
from pipeline.store.tasks import missing_rollout_shards

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "generate.yaml"


def parse_args(argv: list[str]) -> tuple[GenerateConfig, bool]:
    """The config from `argv`, and whether `--status` was asked for."""
    ap = argparse.ArgumentParser(prog="gkd generate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", help=f"YAML config (default {DEFAULT_CONFIG.relative_to(DEFAULT_CONFIG.parents[1])})")
    for flag in ("prompts", "student", "adapter", "out", "teacher-prompt-field"):
        ap.add_argument(f"--{flag}")
    for flag in ("shard", "num-shards", "n", "max-tokens", "seed", "policy-version"):
        ap.add_argument(f"--{flag}", type=int)
    ap.add_argument("--temperature", type=float)
    ap.add_argument("--logprobs", action="store_true", default=None, help="store the student's token logprobs")
    ap.add_argument("--status", action="store_true", help="print which of the --num-shards tasks have no complete "
                    "shard in --out, as a ready --array= list (exit 1 if any; what `gkd slurm resubmit` reads)")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="any config key")
    args = ap.parse_args(argv)
    flags = {k: v for k, v in vars(args).items() if k not in ("config", "overrides", "status") and v is not None}
    cfg = load_config(GenerateConfig, args.config or DEFAULT_CONFIG, {**flags, **parse_overrides(args.overrides)},
                      section="generate")
    return cfg, args.status


def status(cfg: GenerateConfig) -> int:
    """Print which of the num_shards tasks have no complete shard (marker) in `out`, as a ready `--array=` list;
    exit 1 if any (the score stage's `--status` contract, read by `gkd slurm resubmit --stage generate`)."""
    missing = missing_rollout_shards(cfg.out, cfg.num_shards, checksum=False)
    if not missing:
        print(f"all {cfg.num_shards} generate tasks of prompts {cfg.prompts} into {cfg.out} are done")
        return 0
    print(f"{len(missing)} of {cfg.num_shards} generate tasks missing; resubmit with:\n--array={array_spec(missing)}")
    return 1


@command("gkd generate")
def main(argv: list[str] | None = None) -> int:
    cfg, want_status = parse_args(list(sys.argv[1:] if argv is None else argv))
    if want_status:
        return status(cfg)
    cfg.shard = task_index(cfg.shard, cfg.num_shards)
    path = output_path(cfg, cfg.shard)
    result = run_generate(cfg)  # holds the task's lock from before the engine starts to the shard's marker
    if result is None:
        print(f"gkd generate: {path} is complete; nothing to do")
        return 0
    s = result.stats
    print(f"gkd generate: {path}: {s['prompts']} prompts ({sum(s['skipped'].values())} skipped {s['skipped']}), "
          f"{s['samples']} samples, {s['tokens']} tokens in {s['seconds']} s = {s['tok_s']} tok/s, "
          f"finish {s['finish']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
