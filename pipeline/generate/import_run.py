"""Import: dataset rows with reference responses -> off-policy rollouts (`source="dataset"`), no sampling.

The entry of `gkd import`: its arguments and the task (one rollout shard); the rows are built by
pipeline/generate/importer.py `import_rows`.

    gkd import --dataset data/sft.jsonl --prompt-field question --response-field answer \
               --tokenizer data/models/smollm2-student-6l --out runs/rollouts/sft
    gkd import --dataset data/chats.parquet --messages-field messages --tokenizer MODEL_DIR --out DIR   # last turn = response
    gkd import --dataset "reasoning-gym:basic_arithmetic?size=100&seed=0" --tokenizer MODEL_DIR --out DIR
    gkd import --dataset data/opsd.jsonl --prompt-field question --response-field answer \
               --teacher-prompt-field question_with_solution --tokenizer MODEL_DIR --out DIR   # OPSD teacher view
    gkd import --dataset data/vqa.parquet --prompt-field question --response-field answer --image-field images \
               --tokenizer VLM_DIR --out DIR   # images: paths or datasets.Image bytes, stored in DIR/images/

Sharded like `gkd generate`: `--shard I --num-shards N` writes OUT/dataset-IIIII-of-NNNNN.parquet, and a rerun of a
finished task is a no-op.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from pipeline.assets import resolve_student
from pipeline.config import ConfigError
from pipeline.errors import command
from pipeline.generate.importer import import_rows
from pipeline.generate.prompts import Prompt, PromptError, load_prompts, store_images, vision_processor
from pipeline.slurm.arrays import task_index
from pipeline.store.fingerprint import tokenizer_fingerprint
from pipeline.store.rollouts import assign_shard, shard_lock, shard_path, write_rollouts
from pipeline.store.shards import is_complete, read_marker


@command("gkd import")
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gkd import", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", required=True, help="JSONL/Parquet file, save_to_disk folder or reasoning-gym:...")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", help="model folder whose tokenizer/chat template to use (default: SmolLM2 student)")
    ap.add_argument("--prompt-field", default="prompt")
    ap.add_argument("--messages-field", help="chat messages field; a final assistant turn is the response")
    ap.add_argument("--response-field", help="reference response field (default 'response' with --prompt-field)")
    ap.add_argument("--id-field", help="stable row id field (default: row index)")
    ap.add_argument("--tag-field", action="append", default=[], help="a field copied into the rollout tags (for "
                    "gkd score --tags / the trainer's teachers routing); repeat for several")
    ap.add_argument("--teacher-prompt-field", help="privileged teacher prompt (OPSD): a text or chat field the teacher "
                    "sees instead of the prompt; gkd score scores it + the completion")
    ap.add_argument("--image-field", help="the prompt's images: a path relative to the dataset file, embedded bytes "
                    "(datasets.Image) or a list of them; needs a vision-language --tokenizer folder (its processor)")
    ap.add_argument("--max-len", type=int, help="refuse/skip rows longer than this many tokens in total")
    ap.add_argument("--on-bad", choices=("error", "skip"), default="error")
    ap.add_argument("--shard", type=int, default=None, help="default: $SLURM_ARRAY_TASK_ID, else 0")
    ap.add_argument("--num-shards", type=int, default=1)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)

    try:
        shard = task_index(args.shard, args.num_shards)
    except ConfigError as e:
        ap.error(str(e))
    path = shard_path(args.out, "dataset", shard, args.num_shards)
    with shard_lock(path, f"gkd import task {shard}/{args.num_shards} into {args.out}"):
        if is_complete(path, "rollout"):
            print(f"gkd import: {path} is complete; nothing to do")
            return 0
        rows, mine, skipped = _import(args, shard, path)
    tokens = sum(len(r["completion_ids"]) for r in rows)
    dropped = (f" ({sum(skipped.values())} skipped: {', '.join(f'{k} {n}' for k, n in sorted(skipped.items()))})"
               if skipped else "")
    print(f"gkd import: {path}: {len(rows)} rollouts of {len(mine)} rows{dropped}, {tokens} completion tokens")
    return 0


def _import(args: argparse.Namespace, shard: int, path: Path) -> tuple[list[dict], list[Prompt], Counter]:
    """The task of `main`: tokenizer, this shard's rows, the rollout shard."""
    response_field = args.response_field
    if response_field is None and not args.messages_field and not args.dataset.startswith("reasoning-gym:"):
        response_field = "response"
    from transformers import AutoTokenizer

    if args.tokenizer is None:
        args.tokenizer = str(resolve_student(None))
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    fp = tokenizer_fingerprint(tokenizer)
    for other in sorted(Path(args.out).glob("*.parquet")):
        declared = (read_marker(other) or {}).get("tokenizer_fingerprint")
        if declared and declared != fp:
            raise PromptError(f"tokenizer {fp} differs from {declared} declared by {other}.ok")
    prompts = load_prompts(args.dataset, prompt_field=args.prompt_field, messages_field=args.messages_field,
                           response_field=response_field, id_field=args.id_field,
                           teacher_prompt_field=args.teacher_prompt_field, tag_fields=args.tag_field,
                           image_field=args.image_field)
    mine = [p for p in prompts if assign_shard(p.prompt_id, args.num_shards) == shard]
    names = [f"--{k.replace('_', '-')} {v}" for k, v in (("messages_field", args.messages_field), ("prompt_field",
             None if args.messages_field else args.prompt_field), ("response_field", response_field)) if v]
    processor = None
    if any(p.images for p in mine):
        processor = vision_processor(args.tokenizer, PromptError(
            f"{args.tokenizer}: --image-field needs a vision-language model's folder as --tokenizer (its config.json "
            "has no vision_config / image_token_id); use the student's folder"))
    rows, skipped = import_rows(tokenizer, mine, max_len=args.max_len, on_bad=args.on_bad, where=args.dataset,
                                fields=f": {', '.join(names)}" if names else "", processor=processor,
                                image_root=Path(args.out))
    extra = {"tokenizer_fingerprint": fp, "dataset": args.dataset, "shard": shard, "num_shards": args.num_shards,
             "skipped": dict(skipped)}
    store_images(Path(args.out), mine, rows)
    write_rollouts(path, rows, tokenizer_fingerprint=fp, extra=extra)
    return rows, mine, skipped


if __name__ == "__main__":
    raise SystemExit(main())
