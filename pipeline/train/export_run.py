"""Export a trained student checkpoint for transformers / vLLM / peft.

    gkd export --checkpoint runs/train --out runs/student-hf       # the latest checkpoint of a save_dir
    gkd export --checkpoint runs/train/step_0000100 --out DIR      # a given one
    gkd export --checkpoint runs/lora --out DIR --adapter-only     # LoRA run: peft adapter (MBs) for LoRARequest
    gkd export --checkpoint runs/lora --out DIR --merged           # LoRA run: base + adapter as one HF folder
    gkd export --checkpoint runs/train --out DIR --dtype bfloat16  # weights dtype (default: the student's config)

The entry of `gkd export`: its arguments; the export itself is pipeline/train/export.py `export`.
"""

from __future__ import annotations

import argparse
import sys

from pipeline.errors import command
from pipeline.train.export import DTYPES, export


@command("gkd export")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gkd export", description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a save_dir (uses its latest) or one step_* directory")
    parser.add_argument("--out", required=True, help="output folder (replaced atomically)")
    parser.add_argument("--student", default=None, help="HF folder for config/tokenizer (default: from the checkpoint)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--adapter-only", action="store_true", help="LoRA run: write the peft adapter only")
    mode.add_argument("--merged", action="store_true", help="LoRA run: write base + adapter merged (the default)")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                        help="weights dtype of the HF folder (default: the student's config.json dtype)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)

    out = export(args.checkpoint, args.out, args.student, adapter_only=args.adapter_only, dtype=args.dtype)
    print(f"gkd export: wrote {out}")
    return 0


if __name__ == "__main__":  # dist_checkpointing may spawn helper processes that re-import this module
    raise SystemExit(main())
