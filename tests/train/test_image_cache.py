"""A cache whose rows carry images, through `gkd train` (the real CLI) with every student, backend and packing
setting: a text-only student is refused before its model is built (it would train on the placeholder tokens
without the pixels), packed rows never drop their images silently, and `packing: auto` pads an image cache so a
vision-language student trains. Also `packing: auto` on text caches: packed on Megatron-Core, padded for Qwen3.5.

Run: ``python -m pytest tests/train/test_image_cache.py``. The image cache is made without vLLM: `gkd import
--image-field` with a tiny random Qwen2-VL's processor (the placeholder runs are the student's), then teacher rows
from a text-only tiny Llama forward (tests/score/test_images.py scores with a real vision-language teacher).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_cache import random_samples, score_into_cache
from tiny_models import build_llama, build_qwen2_vl, build_qwen35, draw_image

from pipeline.cli import main as cli
from pipeline.store import Descriptor, TeacherCache
from pipeline.store import images as image_store
from pipeline.store.fingerprint import content_key, teacher_fingerprint, tokenizer_fingerprint
from pipeline.store.rollouts import iter_rollouts, rollout_shards

K = 8
ROWS = [("What is three times four?", "The answer is twelve.", ["a.png"]),
        ("Seven plus five is twelve?", "Seven plus five is twelve.", ["a.png", "b.png"]),
        ("The quick brown fox?", "The quick brown fox jumps over the lazy dog.", ["b.png"]),
        ("Questions and answers?", "Prompts and completions, tokens and logits.", []),
        ("What is three times four?", "Twelve.", ["b.png", "a.png"]),
        ("Knowledge distillation?", "A small model learns to match a large one.", ["a.png"])]


def _score_with_images(teacher: Path, rollouts: Path, cache_dir: Path) -> Path:
    """The rollouts' rows scored by a text-only HF forward of `teacher` (row r = teacher of token P + r), their
    images copied into the cache as `gkd score` does (before the shard that names them)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    desc = Descriptor(teacher_fingerprint=teacher_fingerprint(teacher), tokenizer_fingerprint=tokenizer_fingerprint(
        teacher), k=K, logprob_mode="raw_logprobs", vocab_size=model.config.vocab_size)
    cache = TeacherCache.create_or_open(cache_dir, desc)
    rows = []
    for r in iter_rollouts(rollout_shards(rollouts)):
        ids = np.asarray(r["prompt_ids"] + r["completion_ids"], np.int32)
        p = len(r["prompt_ids"])
        for h in r["images"] or ():
            cache.add_image(image_store.read(rollouts, h))
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.as_tensor(ids[None], dtype=torch.long)).logits[0].float(), -1)
        dist = lp[p - 1 : len(ids) - 1]
        top = dist.topk(K, dim=-1)
        actual_lp = dist.gather(1, torch.as_tensor(ids[p:], dtype=torch.long)[:, None])[:, 0]
        rows.append({"key": content_key(desc.teacher_fingerprint, ids, p, K, desc.logprob_mode, images=r["images"]),
                     "sample_id": r["sample_id"], "source": "dataset", "policy_version": None, "input_ids": ids,
                     "first_scored": p, "topk_ids": top.indices.numpy().astype(np.int32),
                     "topk_logprobs": top.values.numpy().astype(np.float32),
                     "actual_ranks": ((dist > actual_lp[:, None]).sum(1) + 1).numpy().astype(np.int32),
                     "actual_logprobs": actual_lp.numpy().astype(np.float32), "images": r["images"]})
    cache.write_shard("scored-00000", rows)
    return cache_dir


@pytest.fixture(scope="module")
def vl(tmp_path_factory) -> dict:
    """{"vlm": a tiny Qwen2-VL, "llama": a text-only tiny Llama with the same tokenizer, "cache": image rows
    (`gkd import --image-field` with the VLM's processor) with teacher rows of the Llama}."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("image_cache")
    vlm = build_qwen2_vl(root / "vlm")
    tok = AutoTokenizer.from_pretrained(vlm)
    tok.save_pretrained(root / "llama")
    llama = build_llama(root / "llama", vocab_size=len(tok), layers=2, hidden=64, heads=2, kv_heads=2, scale=25.0)
    assert tokenizer_fingerprint(llama) == tokenizer_fingerprint(vlm)
    draw_image(root / "a.png", 1, (56, 84))
    draw_image(root / "b.png", 2, (42, 42))
    src = root / "vqa.jsonl"
    src.write_text("".join(json.dumps({"question": q, "answer": a, "images": im}) + "\n" for q, a, im in ROWS))
    assert cli(["import", "--dataset", str(src), "--prompt-field", "question", "--response-field", "answer",
                "--image-field", "images", "--tokenizer", str(vlm), "--out", str(root / "rollouts")]) == 0
    return {"vlm": vlm, "llama": llama, "cache": _score_with_images(llama, root / "rollouts", root / "cache"),
            "rollouts": root / "rollouts"}


def _train_args(student: Path, cache: Path, save: Path, **kw) -> list[str]:
    args = {**dict(student=student, cache=f"[{cache}]", micro_batch_size=2, global_batch_size=2, seq_length=128,
                   train_steps=1, warmup_steps=0, save_interval=1, save_dir=save, progress="false"), **kw}
    return ["train", *[f"{k}={v}" for k, v in args.items()]]


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if the trainer gets as far as building the student."""
    from pipeline.train import loop

    def built(*a, **kw):
        raise AssertionError("the student was built before the refusal")

    monkeypatch.setattr(loop, "setup_model_and_optimizer", built)


@pytest.mark.parametrize("backend", ["auto", "hf"])
@pytest.mark.parametrize("packing", [None, "true", "false", "auto"])
def test_text_only_student_on_an_image_cache_is_refused_before_its_model(vl, tmp_path, capsys, no_model, backend,
                                                                         packing):
    """Was: packed (the old default true) it trained on the placeholders without a word (rc 0) on both backends;
    padded, refused only at the first micro-batch, the Megatron backend telling a text-only student to use hf."""
    extra = {"backend": backend, **({"packing": packing} if packing else {})}
    rc = cli(_train_args(vl["llama"], vl["cache"], tmp_path / "s", **extra))
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"{vl['cache']}: its rows carry images" in err and f"the student {vl['llama']} is a text-only model (llama)" in err
    assert "Train a vision-language student on it" in err and "Traceback" not in err
    assert not (tmp_path / "s").exists() or not list((tmp_path / "s").glob("step_*"))


def test_text_only_student_with_a_live_teacher_on_image_rollouts_is_refused(vl, tmp_path, capsys, no_model):
    rc = cli(["train", f"student={vl['llama']}", "cache=[]", f"teacher_live={vl['llama']}",
              f"rollouts=[{vl['rollouts']}]", "micro_batch_size=2", "global_batch_size=2", "seq_length=128",
              "train_steps=1", "warmup_steps=0", f"save_dir={tmp_path / 's'}"])
    err = capsys.readouterr().err
    assert rc == 2 and "its rows carry images" in err and "text-only model (llama)" in err, err


def test_vlm_student_packing_true_on_an_image_cache_is_refused_before_its_model(vl, tmp_path, capsys, no_model):
    rc = cli(_train_args(vl["vlm"], vl["cache"], tmp_path / "s", packing="true"))
    err = capsys.readouterr().err
    assert rc == 2 and f"{vl['cache']}: packing=true, but its rows carry images" in err, err
    assert "vision-language model (qwen2_vl)" in err
    assert "set packing=false (or packing=auto, which pads them)" in err


def test_vlm_student_trains_on_an_image_cache_with_the_default_packing(vl, tmp_path, capsys):
    """packing: auto (the default) pads an image cache: the vision-language student trains, and says so."""
    save = tmp_path / "vlm"
    assert cli(_train_args(vl["vlm"], vl["cache"], save)) == 0
    err = capsys.readouterr().err
    assert "[train] packing=off: auto: padded rows" in err and "rows carry images" in err
    meta = json.loads((save / "step_0000001" / "trainer.json").read_text())
    assert meta["backend"] == "hf" and meta["packing"] is False and "rows carry images" in meta["packing_why"]
    assert np.isfinite(json.loads((save / "metrics.jsonl").read_text().splitlines()[0])["jsd"])


def test_the_packed_loader_refuses_image_rows_by_name(vl):
    """Was: the packed path laid image rows out without their images (mb.images None), silently."""
    from pipeline.store.shards import ShardError
    from pipeline.train.data.loader import ScoredLoader

    loader = ScoredLoader([vl["cache"]], micro_batch_size=2, seq_length=128, seed=0, packing=True)
    with pytest.raises(ShardError, match="rows with images cannot be packed.*packing=false"):
        for m in range(len(ROWS)):
            loader.micro_batch(m)
    padded = ScoredLoader([vl["cache"]], micro_batch_size=len(ROWS), seq_length=128, seed=0, packing=False)
    mb = padded.micro_batch(0)
    assert sum(len(x) for x in mb.images.rows) == sum(len(r[2]) for r in ROWS)



def test_the_images_part_on_the_padded_path_and_its_refusals(vl):
    """Padded (packing refuses image rows, above): the images part is present exactly where a row of the micro-batch
    has an image, each image as (cache root, content hash); `.to` keeps it (no tensors). The Megatron backend's
    forward and context parallelism refuse it by name."""
    from pipeline.config import ConfigError
    from pipeline.train.config import TrainConfig
    from pipeline.train.data.loader import ScoredLoader
    from pipeline.train.parallel.context_parallel import split
    from pipeline.train.step import model_inputs

    loader = ScoredLoader([vl["cache"]], micro_batch_size=1, seq_length=128, seed=0, packing=False)
    mbs = [loader.micro_batch(m) for m in range(len(ROWS))]
    assert sum(mb.images is None for mb in mbs) == sum(not r[2] for r in ROWS) == 1
    with_images = [mb for mb in mbs if mb.images is not None]
    assert all(mb.parts() == ("images",) and len(mb.images.rows) == 1 and mb.images.rows[0] for mb in with_images)
    found = {p for mb in with_images for p in mb.images.rows[0]}
    assert {Path(root).resolve() for root, _ in found} == {Path(vl["cache"]).resolve()} and len(found) == 2  # a, b
    assert all(image_store.load(root, [h])[0] is not None for root, h in found)  # in the cache's image store
    assert sorted(len(mb.images.rows[0]) for mb in with_images) == sorted(len(r[2]) for r in ROWS if r[2])
    mb = with_images[0]
    moved = mb.to("meta")
    assert moved.input_ids.is_meta and moved.images == mb.images
    with pytest.raises(ConfigError, match="carry images, but the Megatron backend's students are text-only"):
        model_inputs(mb, TrainConfig(cache=[]), torch.nn.Linear(1, 1))
    with pytest.raises(ConfigError, match=r"carries images \(image rows\), which context parallelism "
                                          r"\(context_parallel_size=2\) cannot use; .*hf backend"):
        split(mb, 2, 0)

def test_packing_auto_packs_a_megatron_student_and_says_so(vl, tmp_path, capsys):
    """A text cache and a text student (Megatron-Core): auto packs; the log and trainer.json say which and why."""
    from transformers import AutoConfig

    cache = tmp_path / "text_cache"
    score_into_cache(vl["llama"], cache, random_samples(8, AutoConfig.from_pretrained(vl["llama"]).vocab_size))
    save = tmp_path / "llama"
    assert cli(_train_args(vl["llama"], cache, save, seq_length=64)) == 0
    err = capsys.readouterr().err
    assert "[train] packing=on: auto: packed, Megatron-Core keeps packed samples apart" in err
    meta = json.loads((save / "step_0000001" / "trainer.json").read_text())
    assert meta["backend"] == "megatron" and meta["packing"] is True


def test_packing_auto_pads_a_qwen35_student(tmp_path, capsys):
    """Was: the default packing=true refused every Qwen3.5 student (DeltaNet layers); auto pads it and says why."""
    q = build_qwen35(tmp_path / "q")
    from transformers import AutoConfig

    cache = tmp_path / "cache"
    score_into_cache(q, cache, random_samples(8, AutoConfig.from_pretrained(q).vocab_size))
    save = tmp_path / "run"
    assert cli(_train_args(q, cache, save, seq_length=64)) == 0
    err = capsys.readouterr().err
    assert "[train] packing=off: auto: padded rows, layer_types has linear_attention (3 of 4 layers)" in err
    meta = json.loads((save / "step_0000001" / "trainer.json").read_text())
    assert meta["backend"] == "hf" and meta["packing"] is False and "linear_attention" in meta["packing_why"]


def test_packing_must_be_true_false_or_auto(vl, tmp_path, capsys):
    rc = cli(_train_args(vl["llama"], vl["cache"], tmp_path / "s", packing="sometimes"))
    assert rc == 2 and "packing must be true, false or auto, got 'sometimes'" in capsys.readouterr().err
