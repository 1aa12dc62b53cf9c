"""A score task's rows: which rollouts it scores (`select_rows`: routing by tag, content keys, this task's shard,
deduplication) and what it refuses before any teacher work (ids outside the vocabulary, overlong rows, images the
teacher cannot take), a cross-tokenizer row's fields (`cross_row`), and the engine's token batches
(`token_batches`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.score.config import ScoreConfig
from pipeline.score.errors import ScoreInputError
from pipeline.score.tokenizers import CrossTokenizer
from pipeline.store import align
from pipeline.store import images as image_store
from pipeline.store.rollouts import assign_shard, first_scored, iter_rollouts, rollout_key


def cross_row(r: dict, cross: CrossTokenizer) -> dict | str:
    """A rollout as a cross-tokenizer row's fields (teacher ids as input_ids, spans), or why it cannot be one."""
    got = align.retokenize(cross.student, cross.teacher, r["prompt_ids"], r["completion_ids"])
    if isinstance(got, str):
        return got
    student_ids = np.asarray(r["prompt_ids"] + r["completion_ids"], np.int32)
    return {"input_ids": got.teacher_ids.astype(np.int32), "first_scored": got.teacher_first,
            "engine_ids": got.teacher_ids, "engine_first": got.teacher_first,
            "student_ids": student_ids, "student_first": len(r["prompt_ids"]),
            "teacher_char_ends": got.teacher_ends, "student_char_ends": got.student_ends,
            "span_student": got.span_student, "span_teacher": got.span_teacher}


def select_rows(
    cfg: ScoreConfig, rollouts: list[Path], teacher_fp: str, shard: int, vocab_size: int, max_len: int, counts: dict,
    image_token: int | None = None, cross: CrossTokenizer | None = None,
) -> list[dict]:
    """This task's rows, deduplicated by content key; bad input refused (or skipped and counted) before any work.
    `max_len` is the longest sequence the engine can score.

    A row with `teacher_prompt_ids` (OPSD) is scored on teacher_prompt_ids + completion_ids (`engine_ids`, its
    completion from `engine_first` on) and stored as the student sees it: input_ids = prompt_ids + completion_ids,
    first_scored = len(prompt_ids), so stored row i is still the teacher's distribution of completion token i."""
    rows: dict[str, dict] = {}
    too_big, overlong, privileged, pictured = [], [], [], []
    wanted = set(cfg.tags)
    for r in iter_rollouts(rollouts):
        if wanted and r["tags"].get(cfg.tag_key) not in wanted:
            counts["other_tags"] = counts.get("other_tags", 0) + 1  # another teacher's (or no teacher's) rows
            continue
        ids = np.asarray(r["prompt_ids"] + r["completion_ids"], dtype=np.int64)
        first = first_scored(r, cfg.score_prompt)
        teacher_prompt = r.get("teacher_prompt_ids")
        if teacher_prompt is not None and (cfg.score_prompt or not teacher_prompt):
            privileged.append(r["sample_id"])
            continue
        # the store's rule (rollouts.rollout_key): which rows are scored, under which content key
        key = rollout_key(r, teacher_fp, cfg.stored_k, cfg.key_mode, score_prompt=cfg.score_prompt,
                          cross=None if cross is None else cross.key)
        if key is None:
            counts["empty"] = counts.get("empty", 0) + 1
            continue
        if r.get("images"):
            problem = image_row_problem(r, image_token, cfg)
            if problem:
                pictured.append(f"sample {r['sample_id']}: {problem}")
                continue
        if cross is not None and (teacher_prompt is not None or r.get("images")):
            raise ScoreInputError(f"sample {r['sample_id']}: cross_tokenizer=true scores text rollouts without a "
                                  "privileged teacher prompt or images; score those with a same-tokenizer teacher")
        if assign_shard(key, cfg.num_shards) != shard or key in rows:
            continue
        if cross is not None:  # the teacher's tokens of the rollout's text, its spans (store/align.py)
            extra = cross_row(r, cross)
            if isinstance(extra, str):
                cross.mismatched.append(f"sample {r['sample_id']}: {extra}")
                counts["no_round_trip"] = counts.get("no_round_trip", 0) + 1
                continue
            if len(extra["engine_ids"]) > max_len:
                if cfg.on_overlong == "skip":
                    counts["overlong"] = counts.get("overlong", 0) + 1
                    continue
                overlong.append(r["sample_id"])
            rows[key] = {**r, "key": key, **extra}
            continue
        engine_ids, engine_first = ids, first
        if teacher_prompt is not None:
            engine_ids = np.asarray(teacher_prompt + r["completion_ids"], dtype=np.int64)
            engine_first = len(teacher_prompt)
        if max(ids.max(), engine_ids.max()) >= vocab_size or min(ids.min(), engine_ids.min()) < 0:
            too_big.append(r["sample_id"])
        if len(engine_ids) > max_len:
            if cfg.on_overlong == "skip":
                counts["overlong"] = counts.get("overlong", 0) + 1
                continue
            overlong.append(r["sample_id"])
        rows[key] = {**r, "key": key, "input_ids": ids.astype(np.int32), "first_scored": first,
                     "engine_ids": engine_ids, "engine_first": engine_first}
    if cross is not None and cross.mismatched and cfg.on_mismatch == "error":
        raise ScoreInputError(
            f"{cfg.rollouts}: {len(cross.mismatched)} rollout(s) do not round-trip through the text (decode, then "
            "encode gives other ids, so no exact alignment exists): " + "; ".join(cross.mismatched[:5])
            + (" ..." if len(cross.mismatched) > 5 else "") + "; pass on_mismatch=skip to skip and report them")
    if privileged:
        raise ScoreInputError(
            f"{len(privileged)} rollout(s) carry a teacher_prompt_ids that "
            + ("score_prompt cannot score (the teacher's prompt positions are not the student's)"
               if cfg.score_prompt else "is empty (the first completion token would have no context)")
            + f": {', '.join(privileged[:10])}" + (" ..." if len(privileged) > 10 else "")
            + ("; score them without score_prompt" if cfg.score_prompt else "; rebuild them with a non-empty teacher prompt")
        )
    if pictured:
        raise ScoreInputError(f"{cfg.rollouts}: {len(pictured)} rollout(s) with images cannot be scored: "
                              + "; ".join(pictured[:5]) + (" ..." if len(pictured) > 5 else ""))
    if too_big:
        raise ScoreInputError(
            f"{cfg.rollouts}: {len(too_big)} rollout(s) hold token ids (prompt_ids/completion_ids) outside the "
            f"teacher's vocabulary [0, {vocab_size}) — were they tokenized with another tokenizer? Re-create them "
            f"with the teacher's tokenizer (gkd import --tokenizer / gkd generate); sample ids: {', '.join(too_big[:10])}"
            + (" ..." if len(too_big) > 10 else "")
        )
    if overlong:
        raise ScoreInputError(
            f"{cfg.rollouts}: {len(overlong)} rollout(s) are longer than {max_len} tokens (max_model_len; a privileged "
            f"teacher prompt counts instead of the prompt): {', '.join(overlong[:10])}"
            + (" ..." if len(overlong) > 10 else "")
            + "; raise max_model_len or pass on_overlong=skip to skip and count them"
        )
    return list(rows.values())


def image_row_problem(row: dict, image_token: int | None, cfg: ScoreConfig) -> str | None:
    """Why a rollout with images cannot be scored as it is (None: it can): a text-only teacher, more images than
    the engine's limit, placeholders that are not one run per image, an image token in the completion, score_prompt
    (image placeholder positions carry no teacher distribution to store)."""
    n = len(row["images"])
    if image_token is None:
        return (f"it has {n} image(s), and the teacher is a text-only model (its config.json has no vision_config); "
                "score it with a vision-language teacher, or re-import the rows without --image-field")
    if cfg.max_images_per_prompt is not None and n > cfg.max_images_per_prompt:
        return (f"{n} images, more than max_images_per_prompt={cfg.max_images_per_prompt} (vLLM's "
                "limit_mm_per_prompt); raise it")
    if cfg.score_prompt:
        return "score_prompt=true cannot score a prompt with images (its placeholder positions); score without it"
    if image_token in row["completion_ids"]:
        return f"its completion holds the image token {image_token}; only prompts carry images"
    found = len(image_store.runs(row["prompt_ids"], image_token))
    if found != n:
        return (f"its prompt_ids hold {found} run(s) of the image token {image_token} for {n} image(s); re-import it "
                "with the teacher's processor")
    return None


def check_image_alignment(rows: list[dict], teacher: Path, image_token: int, rollouts: Path) -> None:
    """Before any engine work: every image of these rows loads, and the teacher's processor expands it to exactly
    as many placeholder tokens as the rollout holds (the student's processor made them). A mismatch is refused
    naming the sample, both counts and the likely cause."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(teacher)
    placeholder = getattr(processor, "image_token", None) or processor.tokenizer.decode([image_token])
    counts: dict[str, int] = {}
    for r in rows:
        images = r["images"]
        need = [h for h in images if h not in counts]
        for h, img in zip(need, image_store.load(rollouts, need, sample=r["sample_id"]), strict=True):
            ids = processor(text=[placeholder], images=[img])["input_ids"][0]
            counts[h] = int(sum(1 for t in ids if int(t) == image_token))
        for i, ((_, length), h) in enumerate(zip(image_store.runs(r["prompt_ids"], image_token), images, strict=True)):
            if length != counts[h]:
                raise ScoreInputError(
                    f"{rollouts}: sample {r['sample_id']}: image {i + 1} ({h}) has {length} placeholder tokens in the "
                    f"rollout (the student's processor) but the teacher's processor ({teacher}) expands it to "
                    f"{counts[h]}: another processor version, other max_pixels/min_pixels, or another template. "
                    "Re-import the rollouts with a processor that expands images as the teacher's does; nothing "
                    "was scored")


def token_batches(rows: list[dict], budget: int) -> list[list[dict]]:
    """Consecutive batches whose total length (of what the engine scores: `engine_ids` where a row has them) stays
    within the token budget (a longer row goes alone)."""
    batches, cur, used = [], [], 0
    for r in rows:
        n = len(r.get("engine_ids", r["input_ids"]))
        if cur and used + n > budget:
            batches.append(cur)
            cur, used = [], 0
        cur.append(r)
        used += n
    if cur:
        batches.append(cur)
    return batches
