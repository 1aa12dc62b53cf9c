"""A served vision-language teacher: `gkd score --teacher-url` on image rollouts through a real vLLM OpenAI server
of a tiny Qwen2-VL (vLLM's token-in endpoint, pipeline/score/served/), against the in-process teacher scoring the
same rollouts (pipeline/score/teacher.py InProcessTeacher, itself checked against transformers with the same pixels in
tests/score/test_images.py).

Run: ``python -m pytest tests/score/test_served_images.py``. One module fixture imports the rollouts, scores them in
process and through one server (started once, ~25 s on 2 cores); the refusals (a server without the token-in
endpoint, a server whose processor expands the images differently) are in tests/test_bad_inputs.py.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from tiny_models import IMAGE_TOKEN, build_qwen2_vl, draw_image
from vllm_server import LocalServer

from pipeline.cli import main as cli
from pipeline.score.config import ScoreConfig
from pipeline.score.scorer import score
from pipeline.score.served.probe import PROBE_IMAGE, PROBE_LEN
from pipeline.store import CacheMismatchError, TeacherCache, read_cache
from pipeline.store import images as image_store
from pipeline.store.rollouts import iter_rollouts, rollout_shards

K = 8
MAX_LEN = 256
NAME = "tiny-vl"
# served vs in-process logprobs (exact-f32 codec: nothing rounded on the way): the same engine code and fp32
# weights, the same pixels; only the batch composition differs (the server batches the queued requests itself).
# The text-only served test measured 0.0; the bound is the one tests/score/test_served.py keeps.
TOLERANCE = 1e-4
ROWS = [  # (question, answer, images): rows 0 and 1 are the same ids with other pixels (a.png, d.png: same size)
    ("What is three times four?", "The answer is twelve.", ["a.png"]),
    ("What is three times four?", "The answer is twelve.", ["d.png"]),
    ("Seven plus five is twelve?", "Seven plus five is twelve.", ["a.png", "c.png"]),
    ("Questions and answers?", "Prompts and completions, tokens and logits.", []),
    ("What is three times four?", "Twelve.", ["b.png", "a.png"]),
]


def _server(model: Path, log: Path) -> LocalServer:
    return LocalServer(model, log, name=NAME, max_logprobs=K, max_model_len=MAX_LEN + 1, kv_cache_gib=0.05,
                       env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
                       extra=["--enable-scale-out", "--limit-mm-per-prompt", json.dumps({"image": 2})])


def _score_args(rollouts: Path, cache: Path, teacher: Path, *extra: str) -> list[str]:
    return ["score", "--rollouts", str(rollouts), "--cache", str(cache), "--teacher", str(teacher), "--topk", str(K),
            f"max_model_len={MAX_LEN}", "dtype=float32", "enforce_eager=true", "kv_cache_gib=0.05",
            "codec=exact-f32", *extra]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("served-vlm")
    teacher = build_qwen2_vl(root / "teacher")
    for name, seed, size in (("a", 1, (56, 84)), ("b", 2, (42, 42)), ("c", 3, (70, 56)), ("d", 4, (56, 84))):
        draw_image(root / f"{name}.png", seed, size)
    src = root / "vqa.jsonl"
    src.write_text("".join(json.dumps({"question": q, "answer": a, "images": im}) + "\n" for q, a, im in ROWS))
    assert cli(["import", "--dataset", str(src), "--prompt-field", "question", "--response-field", "answer",
                "--image-field", "images", "--tokenizer", str(teacher), "--out", str(root / "rollouts")]) == 0
    assert cli(_score_args(root / "rollouts", root / "local", teacher)) == 0
    with _server(teacher, root / "server.log") as server:
        assert cli(_score_args(root / "rollouts", root / "served", teacher, "--teacher-url", server.url,
                               "--teacher-model", NAME)) == 0
    return {"root": root, "teacher": teacher, "rollouts": root / "rollouts"}


def _by_sample(cache: Path) -> dict:
    return {s.sample_id: s for s in read_cache(cache)}


def test_served_scores_of_image_rollouts_equal_the_in_process_teachers(vlm):
    served, local = _by_sample(vlm["root"] / "served"), _by_sample(vlm["root"] / "local")
    assert served.keys() == local.keys() and len(served) == len(ROWS)
    pictured = 0
    worst = 0.0
    for sid, s in served.items():
        ref = local[sid]
        np.testing.assert_array_equal(s.input_ids, ref.input_ids)
        assert s.first_scored == ref.first_scored
        pictured += bool(image_store.runs(s.input_ids, IMAGE_TOKEN))
        np.testing.assert_array_equal(s.topk_ids, ref.topk_ids)
        np.testing.assert_array_equal(s.actual_ranks, ref.actual_ranks)
        for name in ("topk_logprobs", "actual_logprobs", "tail_logprobs"):
            worst = max(worst, float(np.abs(getattr(s, name) - getattr(ref, name)).max()))
    print(f"\n[served-vlm] max |served - in-process| logprob {worst:.3g} nat over {len(served)} rows")
    assert pictured == len(ROWS) - 1 and worst <= TOLERANCE
    cache = TeacherCache.open(vlm["root"] / "served")
    assert cache.verify() == [] and cache.stats()["images"] == 4  # the images went into the cache with the rows
    d = cache.descriptor
    assert d.teacher.startswith(f"served {NAME} at http://127.0.0.1:")
    # the fingerprint's probe holds the probe image's positions after the text probe's
    assert d.teacher_probe["image"] == PROBE_IMAGE and len(json.loads(d.teacher_probe["logprobs"])) > PROBE_LEN - 1


def test_the_pixels_reach_the_server_another_image_gives_other_scores(vlm):
    """Rows 0 and 1 send the same token ids (a.png and d.png have one size, so the same placeholder run) with other
    pixels: a server that saw placeholders without pixels (ms-swift #9011) would score them alike."""
    rows = list(iter_rollouts(rollout_shards(vlm["rollouts"])))
    assert rows[0]["prompt_ids"] == rows[1]["prompt_ids"] and rows[0]["images"] != rows[1]["images"]
    served, local = _by_sample(vlm["root"] / "served"), _by_sample(vlm["root"] / "local")
    a, d = served[rows[0]["sample_id"]], served[rows[1]["sample_id"]]
    np.testing.assert_array_equal(a.input_ids, d.input_ids)
    gap = float(np.abs(a.actual_logprobs - d.actual_logprobs).max())
    print(f"\n[served-vlm] same ids, another image: max |logprob difference| {gap:.3g} nat")
    assert gap > 1e-2
    for s in (a, d):  # and each is the in-process teacher's score of its own image
        assert float(np.abs(s.actual_logprobs - local[s.sample_id].actual_logprobs).max()) <= TOLERANCE


def test_another_vision_tower_behind_the_same_name_is_another_teacher(vlm, tmp_path):
    """The same language model and name with other vision weights: the text probe cannot tell them apart, the probe
    image can, so scoring into the first server's cache is refused before the cache is touched."""
    import torch
    from safetensors.torch import load_file, save_file

    other = tmp_path / "other"
    shutil.copytree(vlm["teacher"], other)
    weights = load_file(other / "model.safetensors")
    gen = torch.Generator().manual_seed(7)
    for name, w in weights.items():
        if name.startswith("visual.") and w.is_floating_point():
            weights[name] = w + 0.5 * w.std() * torch.randn(w.shape, generator=gen, dtype=w.dtype)
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    cache = vlm["root"] / "served"
    before = {p: p.read_bytes() for p in sorted(cache.rglob("*")) if p.is_file()}
    with _server(other, tmp_path / "server.log") as server:
        with pytest.raises(CacheMismatchError, match="the served teacher is not the one this cache was scored with") as e:
            score(ScoreConfig(rollouts=str(vlm["rollouts"]), cache=str(cache), teacher=str(vlm["teacher"]), topk=K,
                              max_model_len=MAX_LEN, codec="exact-f32", teacher_url=server.url, teacher_model=NAME))
    # the largest difference is past the text probe's PROBE_LEN - 1 values: in the probe image's part
    position = int(re.search(r"\(position (\d+):", str(e.value)).group(1))
    print(f"\n[served-vlm] another vision tower: {str(e.value).split('differ from the cache')[1][:60]}")
    assert position > PROBE_LEN - 1
    assert {p: p.read_bytes() for p in sorted(cache.rglob("*")) if p.is_file()} == before
