"""teacher_rows=hidden: the teacher's final hidden states through vLLM's pooling runner, against an independent
transformers fp32 forward; the cache's kind, output layer, keys, rerun, verify, stats and the refusals."""

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from scored_rows import write_random_rollouts

from pipeline.config import ConfigError
from pipeline.score.config import ScoreConfig
from pipeline.score.scorer import score
from pipeline.store import CacheMismatchError, TeacherCache, read_cache
from pipeline.store import hidden as hidden_store

MAX_LEN = 96


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    from tiny_models import build_tiny_teacher

    return build_tiny_teacher(tmp_path_factory.mktemp("teacher"), scale=30.0, max_pos=128)


def _rollouts(path, teacher, specs=((5, 7), (9, 1), (40, MAX_LEN - 40)), seed=0):
    return write_random_rollouts(path, teacher, specs, seed)


def _cfg(tmp, teacher, **kw):
    base = dict(rollouts=str(tmp / "rollouts"), cache=str(tmp / "cache"), teacher=str(teacher), teacher_rows="hidden",
                max_model_len=MAX_LEN, part_rows=2, batch_tokens=256, enforce_eager=True, kv_cache_gib=0.05)
    return ScoreConfig(**{**base, **kw})


def _hf(teacher, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states[-1][0].double(), out.logits[0].double(), model.lm_head.weight.detach().double()


def _stored(cache: Path) -> dict:
    """sample_id -> (num_scored, hidden [n, H] float64) read straight from the shards."""
    d = TeacherCache.open(cache).descriptor
    out = {}
    for p in sorted((cache / "shards").glob("*.parquet")):
        t = pq.read_table(p, columns=["sample_id", "num_scored", hidden_store.COLUMN])
        for sid, n, b in zip(*(t.column(c).to_pylist() for c in t.column_names), strict=True):
            arr = hidden_store.decode(b, n, int(d.hidden["size"]), d.hidden["dtype"])
            out[sid] = hidden_store.as_torch(arr, d.hidden["dtype"]).double()
    return out


@pytest.fixture(scope="module")
def scored(teacher, tmp_path_factory):
    """Two caches of the same rollouts: hidden states in float32 and in bf16 (the default)."""
    tmp = tmp_path_factory.mktemp("hidden")
    rows = _rollouts(tmp / "rollouts" / "r-00000-of-00001.parquet", teacher)
    summaries = {dtype: score(_cfg(tmp, teacher, cache=str(tmp / dtype), hidden_dtype=dtype))
                 for dtype in ("float32", "bfloat16")}
    return tmp, rows, summaries


def test_hidden_rows_times_output_layer_are_the_teachers_logits(teacher, scored):
    tmp, rows, summaries = scored
    assert all(s["scored"] == 3 for s in summaries.values())
    f32, bf16 = _stored(tmp / "float32"), _stored(tmp / "bfloat16")
    k0 = {s.sample_id: s for s in read_cache(tmp / "float32")}
    worst = {"f32 logits": 0.0, "bf16 hidden": 0.0}
    for r in rows:
        ids = r["prompt_ids"] + r["completion_ids"]
        P = len(r["prompt_ids"])
        h_ref, logits_ref, w = _hf(teacher, ids)
        # row i is the state at position P - 1 + i: the one that predicts token P + i
        got = f32[r["sample_id"]] @ w.T
        gap = (got - logits_ref[P - 1: len(ids) - 1]).abs().max().item()
        assert gap <= 1e-4 * max(1.0, logits_ref.abs().max().item()), gap  # the engine's fp32 agreement
        worst["f32 logits"] = max(worst["f32 logits"], gap)
        hb = bf16[r["sample_id"]]
        ref = h_ref[P - 1: len(ids) - 1]
        assert torch.all((hb - ref).abs() <= ref.abs() * 2 ** -8 + 1e-5)  # bf16 rounding of the engine's states
        worst["bf16 hidden"] = max(worst["bf16 hidden"], ((hb - ref).abs() / ref.abs().clamp_min(1e-3)).max().item())
        # the k = 0 columns: the actual token's teacher logprob and rank, from the fp32 states
        lp = torch.log_softmax(logits_ref[P - 1: len(ids) - 1], -1)
        s = k0[r["sample_id"]]
        y = torch.tensor(ids[P:])
        np.testing.assert_allclose(s.actual_logprobs, lp.gather(1, y[:, None])[:, 0].numpy(), atol=1e-4 + 1 / 64)  # codec
        np.testing.assert_array_equal(s.actual_ranks, (1 + (lp > lp.gather(1, y[:, None])).sum(1)).numpy())
    print(f"\n[hidden] max gaps vs transformers fp32: {worst}")


def test_cache_kind_output_layer_stats_verify_and_rerun(teacher, scored):
    tmp, rows, _ = scored
    root = tmp / "bfloat16"
    desc = json.loads((root / "cache.json").read_text())
    assert desc["teacher_rows"] == "hidden" and desc["k"] == 0 and desc["hidden"]["dtype"] == "bfloat16"
    assert desc["schema_version"] == "1.4" and desc["descriptor_version"] == "1.7"
    cache = TeacherCache.open(root)
    w = hidden_store.load_output_layer(root, cache.descriptor)
    assert torch.equal(w, _hf(teacher, [3, 4])[2].float())
    stats = cache.stats()
    H = int(desc["hidden"]["size"])
    assert stats["teacher_rows"] == "hidden" and stats["raw_hidden_bytes_per_position"] == 2 * H
    assert stats["scored_tokens"] == sum(len(r["completion_ids"]) for r in rows)
    assert "reverse KL" in stats["trains"] and stats["bytes_per_position"] > 0
    assert cache.verify() == []
    assert score(_cfg(tmp, teacher, cache=str(root)))["done_before"]  # the task marker: a no-op
    # keys differ from a top-k cache's of the same rows (the kind is in the key)
    from pipeline.store.rollouts import rollout_key

    keys = {s.key for s in read_cache(root)}
    fp = cache.descriptor.teacher_fingerprint
    assert keys == {rollout_key(r, fp, 0, hidden_store.key_mode("raw_logprobs", "bfloat16")) for r in rows}
    assert not keys & {rollout_key(r, fp, 0, "raw_logprobs") for r in rows}
    # a top-k run into the hidden cache, and a float32 one into the bf16 cache, are refused before any work
    with pytest.raises(CacheMismatchError, match="teacher_rows"):
        score(_cfg(tmp, teacher, cache=str(root), teacher_rows="topk", topk=0))
    with pytest.raises(CacheMismatchError, match="hidden"):
        score(_cfg(tmp, teacher, cache=str(root), hidden_dtype="float32"))
    # a replaced output layer is found by verify
    layer = root / hidden_store.OUTPUT_LAYER
    saved = layer.read_bytes()
    try:
        layer.write_bytes(hidden_store.output_layer_bytes(w * 2))
        assert any("output_layer.safetensors" in p for p in cache.verify())
    finally:
        layer.write_bytes(saved)


def test_resume_scores_only_the_missing_rows(teacher, scored, tmp_path):
    """A task whose last part was lost (a kill between parts) scores only the rows of that part on its rerun."""
    tmp, rows, _ = scored
    import shutil

    root = tmp_path / "cache"
    shutil.copytree(tmp / "bfloat16", root)
    parts = sorted((root / "shards").glob("*.parquet"))
    assert len(parts) == 2  # part_rows=2, 3 rows
    for p in [parts[-1], parts[-1].with_name(parts[-1].name + ".ok")]:
        p.unlink()
    for done in (root / "tasks").glob("*.done"):
        done.unlink()
    TeacherCache.open(root).rebuild_index()
    summary = score(_cfg(tmp, teacher, cache=str(root)))
    assert summary["scored"] == 1 and summary["skipped"]["cached"] == 2
    a, b = _stored(root), _stored(tmp / "bfloat16")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=2 ** -7, atol=1e-6) for k in a)
    assert TeacherCache.open(root).verify() == []


def test_teachers_whose_logits_are_not_hidden_times_w_are_refused(teacher, tmp_path):
    import shutil

    capped = tmp_path / "capped"
    shutil.copytree(teacher, capped)
    cfg = json.loads((capped / "config.json").read_text())
    (capped / "config.json").write_text(json.dumps({**cfg, "final_logit_softcapping": 30.0}))
    with pytest.raises(ConfigError, match=r"config.json: final_logit_softcapping=30.0.*teacher_rows=topk"):
        score(_cfg(tmp_path, capped))
    assert hidden_store.nonlinear_logits({"text_config": {"logit_scale": 0.0625}}) == ["text_config.logit_scale=0.0625"]
    assert hidden_store.nonlinear_logits({"logits_scaling": 1.0, "final_logit_softcapping": None}) == []
    for bad in ({"teacher_url": "http://127.0.0.1:1/v1"}, {"topp": 0.9}, {"hidden_dtype": "float16"}):
        with pytest.raises(ConfigError, match="teacher_url|topp|hidden_dtype"):
            score(_cfg(tmp_path, teacher, **bad))


@pytest.mark.slow  # CI: resume of hidden rows (above) and the kill of a top-k run (test_score.py)
def test_sigkill_after_the_first_part_then_rerun_equals_uninterrupted(teacher, scored, tmp_path):
    """Through the real CLI: killed right after its first part lands (pipeline/pause.py), the rerun scores the rest;
    the rows equal the uninterrupted cache's (the module's bf16 cache of the same rollouts)."""
    import os
    import subprocess
    import sys

    import killing

    tmp, rows, _ = scored
    cmd = [sys.executable, "-m", "pipeline", "score", "--rollouts", str(tmp / "rollouts"), "--cache",
           str(tmp_path / "killed"), "--teacher", str(teacher), "teacher_rows=hidden", f"max_model_len={MAX_LEN}",
           "part_rows=2", "batch_tokens=40", "enforce_eager=true", "kv_cache_gib=0.05"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = killing.start(cmd, "cache-commit:1", env=env)
    assert killing.wait_stopped(proc) == proc.pid
    killing.kill(proc)
    assert len(list((tmp_path / "killed" / "shards").glob("*.ok"))) == 1
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-2000:]
    a, b = _stored(tmp_path / "killed"), _stored(tmp / "bfloat16")
    # other batches than the module's run: vLLM is not batch-invariant, so one bf16 step at most
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=2 ** -7, atol=1e-6) for k in a)
    assert TeacherCache.open(tmp_path / "killed").verify() == []
    marker = json.loads(next((tmp_path / "killed" / "tasks").glob("*.done")).read_text())
    assert marker["skipped"]["cached"] == 2
