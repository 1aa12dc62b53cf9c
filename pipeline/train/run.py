"""Train stage, the entry: a student (Megatron-Core or transformers) distilled from a teacher cache of top-k logprobs.

    gkd train [--config configs/train.yaml] [key=value ...]                  # one process (CPU or one GPU)
    torchrun --nproc_per_node 2 -m pipeline.train.run tensor_model_parallel_size=2   # TP / DP

The trainer itself is pipeline/train/loop.py (the loop and resume), with config.py, setup.py (checks, building) and
step.py (one step, the loss); this module parses the arguments and reports errors.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pipeline.config import load_config
from pipeline.errors import command
from pipeline.train.config import TrainConfig
from pipeline.train.loop import train

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "train.yaml"


@command("gkd train")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gkd train", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=None, help=f"flat YAML config (default: {DEFAULT_CONFIG.name})")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    # torchrun's process count, known before any process group exists: the config checks the data-parallel split
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = load_config(TrainConfig, args.config or DEFAULT_CONFIG, args.overrides, section="train",
                      launch={"world_size": world_size})
    train(cfg)
    return 0


if __name__ == "__main__":  # dist_checkpointing / torchrun workers re-import this module: keep work under the guard
    raise SystemExit(main())
