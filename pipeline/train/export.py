"""Export a trained student checkpoint as a Hugging Face folder (safetensors + config + tokenizer) for vLLM.

    gkd export --checkpoint runs/train --out runs/student-hf       # the latest checkpoint of a save_dir
    gkd export --checkpoint runs/train/step_0000100 --out DIR      # a given one

One process at TP=1: dist_checkpointing reshards a checkpoint saved at any TP degree on load. The architecture and
tokenizer come from the student folder recorded in the checkpoint's trainer.json (override with --student).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def export(checkpoint_path: str | Path, out_dir: str | Path, student: str | Path | None = None) -> Path:
    """Write the checkpoint's model as an HF folder at `out_dir`; returns it."""
    from pipeline.train import checkpoint
    from pipeline.train.model import build_model, export_hf
    from pipeline.train.parallel import destroy_distributed, init_distributed

    ckpt = checkpoint.latest(checkpoint_path)
    if ckpt is None:
        raise FileNotFoundError(f"{checkpoint_path}: no checkpoint (no trainer.json and no `latest` file)")
    hf_dir = Path(student or checkpoint.read_meta(ckpt)["student"])
    init_distributed(tp=1, pp=1, seed=0)
    try:
        model = build_model(hf_dir)
        checkpoint.load(ckpt, model)
        export_hf(model, hf_dir, out_dir)
    finally:
        destroy_distributed()
    return Path(out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gkd export", description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a save_dir (uses its latest) or one step_* directory")
    parser.add_argument("--out", required=True, help="output folder (replaced atomically)")
    parser.add_argument("--student", default=None, help="HF folder for config/tokenizer (default: from the checkpoint)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        out = export(args.checkpoint, args.out, args.student)
    except FileNotFoundError as e:
        print(f"gkd export: {e}", file=sys.stderr)
        return 2
    print(f"gkd export: wrote {out}")
    return 0


if __name__ == "__main__":  # dist_checkpointing may spawn helper processes that re-import this module
    raise SystemExit(main())
