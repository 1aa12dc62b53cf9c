"""Import: dataset rows with reference responses -> off-policy rollouts (`source="dataset"`), no sampling. The
entry (`gkd import`, its arguments and the task) is pipeline/generate/import_run.py.

The prompt is the chat template with the assistant header (the ids a student sampler would be given); the
completion is the assistant turn as the template renders it in the full conversation (its suffix after the
prompt ids, up to and including EOS). Sharded like `gkd generate`: `--shard I --num-shards N` writes
OUT/dataset-IIIII-of-NNNNN.parquet, and a rerun of a finished task is a no-op.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from pipeline.generate.prompts import (
    Prompt,
    PromptError,
    image_name,
    image_prompt_ids,
    prompt_ids,
    response_ids,
)
from pipeline.store import images as image_store
from pipeline.store.rollouts import rollout_row


def import_rows(tokenizer: Any, prompts: list[Prompt], *, max_len: int | None = None, on_bad: str = "error",
                where: str = "", fields: str = "", processor: Any = None,
                image_root: Path | None = None) -> tuple[list[dict], Counter]:
    """Rollout rows for prompts with a reference response; bad rows are refused or skipped and counted. Prompts
    with images need the model's `processor` (their placeholders expanded as the student sees them) and
    `image_root`, where the caller stores their bytes (`store_images`) before the shard that names them."""
    rows, skipped = [], Counter()
    for p in prompts:
        reason = None
        if p.empty:
            reason = "empty_prompt"
        elif p.response is None or not str(p.response).strip():
            reason = "empty_response"
        elif p.teacher_messages == []:
            reason = "empty_teacher_prompt"
        else:
            ids = prompt_ids(tokenizer, p.messages)
            completion = response_ids(tokenizer, p.messages, str(p.response), ids)
            bad_image = None
            if p.images:
                try:
                    pixels = [image_store.decode(b, f"{where}: row {p.prompt_id!r}: image {i + 1}, "
                                                    f"{image_name(p, i)}") for i, b in enumerate(p.images)]
                except image_store.ImageError as e:
                    bad_image, reason = e, "unreadable_image"
                else:
                    ids = image_prompt_ids(processor, tokenizer, p.messages, pixels)
            if bad_image is None:
                teacher = None if p.teacher_messages is None else prompt_ids(tokenizer, p.teacher_messages)
                longest = max(len(ids), len(teacher or ())) + len(completion)
                if max_len is not None and longest > max_len:
                    reason = "too_long"
        if reason:
            if on_bad == "error" and reason == "unreadable_image":
                raise PromptError(f"{bad_image}, or pass --on-bad skip to skip and count the row") from None
            if on_bad == "error":
                field = {"empty_prompt": "prompt", "empty_response": "response",
                         "empty_teacher_prompt": "teacher prompt"}.get(reason, "prompt + response")
                fix = "raise --max-len" if reason == "too_long" else "fill it in"
                raise PromptError(f"{where}: row {p.prompt_id!r}: {reason.replace('_', ' ')} (the {field} field{fields});"
                                  f" {fix}, or pass --on-bad skip to skip and count it")
            skipped[reason] += 1
            continue
        hashes = [image_store.image_hash(b) for b in p.images]  # stored by the caller once every row is good
        rows.append(rollout_row(prompt_id=p.prompt_id, prompt_ids=ids, completion_ids=completion,
                                source="dataset", policy_version=None, finish_reason=None, tags=p.tags,
                                teacher_prompt_ids=teacher, images=hashes))
    return rows, skipped
