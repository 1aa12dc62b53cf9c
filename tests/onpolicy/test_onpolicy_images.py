"""On-policy GKD with image prompts: the vision-language student (a tiny random Qwen2-VL) samples with the images,
the vision-language teacher scores them with the images, the hf backend trains on padded rows with the pixel
inputs, and the export is reloaded into the running sampler in place.

Run: ``python -m pytest tests/onpolicy/test_onpolicy_images.py`` (~3 min on 2 CPU cores).
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
from onpolicy_helpers import overrides
from tiny_models import build_qwen2_vl, draw_image

from pipeline.store import TeacherCache
from pipeline.store import images as image_store


def test_onpolicy_cycles_with_image_prompts(tmp_path):
    from pipeline.config import load_config
    from pipeline.onpolicy.config import OnPolicyConfig
    from pipeline.onpolicy.engines import Engines
    from pipeline.onpolicy.run import run

    models = {"teacher": build_qwen2_vl(tmp_path / "teacher"), "student": build_qwen2_vl(tmp_path / "student", seed=1)}
    for i in range(3):
        draw_image(tmp_path / f"img{i}.png", seed=i, size=(42 + 14 * i, 56))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": q, "images": [f"img{i % 3}.png"] * (1 + i % 2)}) + "\n"
                               for i, q in enumerate(["What is three times four?", "Numbers?", "The quick brown fox?",
                                                      "Seven plus five?"])))
    out = tmp_path / "op"
    values = overrides(models, out, steps_per_generation=1, heldout_prompts=None,
                       train_extra={"packing": False})  # a vision-language student computes its own positions
    values.update({"prompts": str(prompts), "generate.image_field": "images", "generate.max_images_per_prompt": 2,
                   "score.max_images_per_prompt": 2})
    cfg = load_config(OnPolicyConfig, None, values)
    engines = Engines()
    try:
        lines = run(cfg, engines)
    finally:
        engines.close()
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["cycle"] for m in metrics if m["cycle"] >= 0] == [0, 1] and all(m["loss"] > 0 for m in lines)
    cache = TeacherCache.open(out / "cache")
    images = [im for p in cache.shard_paths() for im in pq.read_table(p, columns=["images"])["images"].to_pylist()]
    assert images and all(images)  # every scored on-policy row carries its prompt's images
    assert {h for im in images for h in im} == {p.name for p in image_store.image_dir(out / "cache").iterdir()}
    assert json.loads(next((out / "train").rglob("trainer.json")).read_text())["backend"] == "hf"
    assert (out / "exports" / "step-0000002" / "processor_config.json").exists()
