"""Score stage: rollouts -> the teacher's sparse top-k logprobs in the content-keyed cache.

    gkd score --rollouts runs/rollouts --cache runs/cache --teacher MODEL_DIR --topk 64
    gkd score --config configs/score.yaml [key=value ...]            # make score
    gkd score ... --shard 3 --num-shards 8                           # one task of a Slurm array
    gkd score ... --num-shards 8 --status                            # which tasks are missing, as --array=...
    gkd score ... --teacher BASE --teacher-adapter LORA_DIR          # base + LoRA adapter as the teacher
    gkd score ... --teacher MATH_T --cache c-math --tags math --tag-key task   # one teacher per tag (routing)
    gkd score ... --teacher-url http://HOST:PORT/v1 --teacher-model NAME --teacher TOKENIZER_DIR   # a served teacher

The stage itself lives in the library: score(), status() and the scoring loop in pipeline/score/scorer.py (its
docstring lists the stage's modules), ScoreConfig in pipeline/score/config.py; this file is its command line only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.config import load_config, parse_overrides
from pipeline.errors import command
from pipeline.score.config import ScoreConfig
from pipeline.score.scorer import score, status
from pipeline.slurm.arrays import task_index

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "score.yaml"


def parse_args(argv: list[str]) -> tuple[ScoreConfig, bool]:
    ap = argparse.ArgumentParser(prog="gkd score", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help=f"YAML config (default: {DEFAULT_CONFIG.relative_to(Path.cwd()) if DEFAULT_CONFIG.is_relative_to(Path.cwd()) else DEFAULT_CONFIG})")
    ap.add_argument("--rollouts")
    ap.add_argument("--cache")
    ap.add_argument("--teacher")
    ap.add_argument("--teacher-adapter", help="peft LoRA folder applied to --teacher (e.g. a LoRA student's own base "
                    "+ its adapter as a self-teacher)")
    ap.add_argument("--teacher-url", help="score through a running vLLM OpenAI-compatible server (http://HOST:PORT/v1) "
                    "instead of loading the teacher here; --teacher then names the folder of its tokenizer and config.json")
    ap.add_argument("--teacher-api-key-env", help="the environment variable holding the server's API key (sent as a "
                    "bearer token, never written anywhere); default OPENAI_API_KEY, then VLLM_API_KEY")
    ap.add_argument("--teacher-model", help="the model name the server serves (--served-model-name); default: its only one")
    ap.add_argument("--topk", type=int)
    ap.add_argument("--score-prompt", action="store_true", default=None)
    ap.add_argument("--shard", type=int)
    ap.add_argument("--num-shards", type=int)
    ap.add_argument("--on-overlong", choices=["error", "skip"])
    ap.add_argument("--tags", type=lambda v: [t for t in v.split(",") if t],
                    help="score only rollouts whose tags[tag_key] is one of these (comma-separated)")
    ap.add_argument("--tag-key", help="which rollout tag --tags matches (default data_source)")
    ap.add_argument("--status", action="store_true", help="print missing task indices as an --array= list")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides (any ScoreConfig field)")
    a = ap.parse_args(argv)
    flags = {k: v for k, v in vars(a).items() if k not in ("config", "status", "overrides") and v is not None}
    path = a.config or (DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None)
    cfg = load_config(ScoreConfig, path, {**flags, **parse_overrides(a.overrides)}, section="score")
    return cfg, a.status


@command("gkd score")
def main(argv: list[str] | None = None) -> int:
    cfg, want_status = parse_args(list(sys.argv[1:] if argv is None else argv))
    if want_status:
        return status(cfg)
    cfg.shard = task_index(cfg.shard, cfg.num_shards)  # the executor's state is read here, not in the library
    score(cfg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
