"""Bad-input catalogue rows of the trainer (docs/bad-inputs.md): a checkpoint of another student or of another LoRA
setting, refused through the real CLI (gkd train resume, gkd export) before any tensor is loaded, with the
checkpoint folder byte-identical afterwards. One real 2-step run makes the checkpoint (module scope)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

from pipeline.cli import main as gkd


def _overrides(tiny: dict, save_dir: Path, **kw) -> list[str]:
    args = dict(student=str(tiny["student"]), cache=f"[{tiny['cache']}]", micro_batch_size=2, global_batch_size=2,
                seq_length=32, train_steps=2, save_interval=2, lr=1e-3, warmup_steps=1, save_dir=str(save_dir),
                progress=False, prefetch=1)
    return [f"{k}={v}" for k, v in {**args, **kw}.items()]


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def run(tiny, tmp_path_factory) -> Path:
    save_dir = tmp_path_factory.mktemp("refusals") / "run"
    assert gkd(["train", *_overrides(tiny, save_dir)]) == 0
    return save_dir


@pytest.fixture(scope="module")
def other_student(tmp_path_factory) -> Path:
    """Same tokenizer as the run's student (the tokenizer check passes), one layer instead of two."""
    from tiny_models import build_llama, build_tokenizer

    out = tmp_path_factory.mktemp("other") / "student"
    tok = build_tokenizer(out)
    return build_llama(out, vocab_size=len(tok), layers=1, hidden=64, heads=2, kv_heads=2)


def test_checkpoint_of_another_student(tiny, run, other_student, tmp_path, capsys):
    before = _snapshot(run)
    assert gkd(["train", *_overrides(tiny, run, student=str(other_student), train_steps=4)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err  # one message (pipeline.errors.command)
    assert "saved from another student" in err and "num_layers: checkpoint 2, this student 1" in err, err
    assert f"resume with student={tiny['student'].resolve()}" in err and "new save_dir" in err, err
    out = tmp_path / "hf"
    assert gkd(["export", "--checkpoint", str(run), "--student", str(other_student), "--out", str(out)]) == 2
    assert "num_layers: checkpoint 2, this student 1" in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob("*.partial"))
    assert _snapshot(run) == before


def test_checkpoint_of_another_lora_setting(tiny, run, capsys):
    before = _snapshot(run)
    assert gkd(["train", *_overrides(tiny, run, lora_rank=4, train_steps=4)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err  # one message (pipeline.errors.command)
    assert f"{run}/step_0000002: checkpoint LoRA settings None differ" in err, err
    assert "lora_rank / lora_alpha / lora_targets must match the run that saved it" in err
    assert _snapshot(run) == before


def test_cache_growing_under_a_run(tiny, tmp_path, capsys):
    """Readers during writes: a trainer started while a score job is still filling the cache sees only complete
    shards (a shard without its marker and a writer's temporary are not read), and records which in trainer.json;
    a resume that finds more shards is refused, naming how many were added, since the data order would change."""
    import json
    import shutil

    cache = tmp_path / "cache"
    shutil.copytree(tiny["cache"], cache)
    shards = sorted((cache / "shards").glob("*.parquet"))
    assert len(shards) == 3
    late = shards[-1]
    marker = late.with_name(late.name + ".ok")
    held = marker.read_bytes()
    marker.unlink()  # the third shard is still being written: data there, marker not yet
    (cache / "shards" / f".{late.name}.tmp-1-abcd").write_bytes(b"partial")
    run = tmp_path / "run"
    assert gkd(["train", *_overrides(tiny, run, cache=f"[{cache}]")]) == 0
    meta = json.loads((run / "step_0000002" / "trainer.json").read_text())
    assert sorted(Path(p).name for p in meta["data_shards"]) == [s.name for s in shards[:2]]
    marker.write_bytes(held)  # the score job finished that shard
    before = _snapshot(run)
    capsys.readouterr()
    assert gkd(["train", *_overrides(tiny, run, cache=f"[{cache}]", train_steps=4)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err  # one message (pipeline.errors.command)
    assert "(2 shards then, 3 now: 1 added" in err and late.name in err and "new save_dir" in err, err
    assert "data_position=N" in err and _snapshot(run) == before


def test_checkpoint_of_another_optimizer_layout(tiny, run, capsys, monkeypatch):
    """The optimizer-state layout of a resume (pipeline/train/checkpoint.py `check_optimizer_layout`), refused from
    trainer.json before any process group or model: the plain optimizer's checkpoint resumed with the distributed
    one; a distributed-optimizer checkpoint (its trainer.json, in a copy of the run) resumed at another TP size
    (torchrun's WORLD_SIZE 2 at tensor_model_parallel_size 2: the check is before the process group)."""
    import json
    import shutil

    before = _snapshot(run)
    assert gkd(["train", *_overrides(tiny, run, use_distributed_optimizer="true", train_steps=4)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err  # one message (pipeline.errors.command)
    assert f"{run}/step_0000002: optimizer state saved unsharded (use_distributed_optimizer=false)" in err, err
    assert "Resume with use_distributed_optimizer=false, or start a new save_dir" in err, err
    assert _snapshot(run) == before
    sharded = run.parent / "sharded"
    shutil.copytree(run, sharded)
    meta_path = sharded / "step_0000002" / "trainer.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "optimizer_sharding": "dp_reshardable"}))
    before = _snapshot(sharded)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert gkd(["train", *_overrides(tiny, sharded, use_distributed_optimizer="true", tensor_model_parallel_size=2,
                                     train_steps=4)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err  # one message (pipeline.errors.command)
    assert "distributed-optimizer state saved at tensor_model_parallel_size=1, this run has 2" in err, err
    assert "Resume with tensor_model_parallel_size=1 (any number of data-parallel ranks)" in err, err
    assert _snapshot(sharded) == before


def test_caches_that_cannot_share_a_micro_batch(tiny, tmp_path, capsys):
    """`gkd train "cache=[c8,c4]"` (and a top-k with a top-p cache): one message naming the caches, no traceback."""
    from tiny_cache import random_samples, score_into_cache

    samples = random_samples(4, tiny["vocab"], seed=3)
    score_into_cache(tiny["model"], tmp_path / "c4", samples, k=4)
    score_into_cache(tiny["model"], tmp_path / "c8p", samples, topp=0.9, min_k=2)
    for other, pattern in (("c4", r"caches with different k \(\[4, 8\]\) cannot share a micro-batch: .*c4: k=4"),
                           ("c8p", r"caches with different top-p settings .*cannot be read together \(.*c8p")):
        before = _snapshot(tmp_path)
        assert gkd(["train", *_overrides(tiny, tmp_path / "run", cache=f"[{tiny['cache']},{tmp_path / other}]")]) == 2
        err = capsys.readouterr().err
        assert re.search(pattern, err) and "Traceback" not in err, err
        assert re.search(r"train from (caches of one k|one of them)", err), err
        assert _snapshot(tmp_path) == before and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_cache_index_of_another_cache_before_the_model(tiny, tmp_path, capsys):
    """`gkd train` on a cache whose index.jsonl came from another cache: refused naming the index, before the
    student is built (no `[train] backend=` line, no metrics) and with the cache left as it was."""
    import shutil

    from tiny_cache import random_samples, score_into_cache

    ours = tmp_path / "ours"
    shutil.copytree(tiny["cache"], ours)
    score_into_cache(tiny["model"], tmp_path / "theirs", random_samples(2, tiny["vocab"], seed=5), k=4)  # k: identity
    shutil.copy2(tmp_path / "theirs" / "index.jsonl", ours / "index.jsonl")
    before = _snapshot(ours)
    assert gkd(["train", *_overrides(tiny, tmp_path / "run", cache=f"[{ours}]")]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"{ours}/index.jsonl: index of another cache", err) and "Traceback" not in err, err
    assert "[train] backend=" not in err and f"gkd cache index {ours}" in err, err
    assert _snapshot(ours) == before and not (tmp_path / "run" / "metrics.jsonl").exists()


# -- cross-tokenizer distillation (loss=uld|gold, docs/architecture.md "Cross-tokenizer distillation") ---------------


@pytest.fixture(scope="module")
def xtok(tiny, tmp_path_factory) -> dict:
    """A cross-tokenizer cache for the run's student (its rollouts scored by a SmolLM2-vocabulary teacher), and a
    same-tokenizer cache of that teacher (rows in its own tokens, no spans)."""
    from tiny_cache import random_samples, score_cross_into_cache, score_into_cache, xtok_rollouts
    from tiny_models import build_smollm2_tiny
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("xtok-refusals")
    teacher = build_smollm2_tiny(root / "teacher")
    rows = xtok_rollouts(AutoTokenizer.from_pretrained(tiny["student"]), n=4)
    score_cross_into_cache(teacher, tiny["student"], root / "cross", rows)
    score_into_cache(teacher, root / "plain", random_samples(4, 49152))
    return {"cross": root / "cross", "plain": root / "plain", "root": root, "teacher": teacher, "rows": rows}


def _rollouts(tiny, path: Path, rows: list[dict]) -> Path:
    from pipeline.store.fingerprint import tokenizer_fingerprint
    from pipeline.store.rollouts import write_rollouts

    write_rollouts(path / "r-00000-of-00001.parquet", rows, tokenizer_fingerprint=tokenizer_fingerprint(tiny["student"]))
    return path


def _refused(tiny, tmp_path, capsys, **kw) -> str:
    save = tmp_path / "run"
    assert gkd(["train", *_overrides(tiny, save, **kw)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert not (save / "metrics.jsonl").exists() and not list(save.glob("step_*"))  # before any step
    return err


def test_gold_on_a_same_tokenizer_cache(tiny, tmp_path, capsys):
    err = _refused(tiny, tmp_path, capsys, loss="gold")
    assert str(tiny["cache"]) in err and "same-tokenizer cache" in err and "plain GKD, train with loss=gkd" in err, err


def test_gold_on_a_cache_without_spans(tiny, xtok, tmp_path, capsys):
    before = _snapshot(xtok["plain"])
    err = _refused(tiny, tmp_path, capsys, loss="uld", cache=f"[{xtok['plain']}]")
    assert str(xtok["plain"]) in err and "has no spans" in err, err
    assert "gkd score --rollouts ROLLOUTS --cache NEW_CACHE" in err and "cross_tokenizer=true" in err, err
    assert _snapshot(xtok["plain"]) == before


def test_gkd_on_a_cross_tokenizer_cache(tiny, xtok, tmp_path, capsys):
    err = _refused(tiny, tmp_path, capsys, cache=f"[{xtok['cross']}]")
    assert str(xtok["cross"]) in err and "cross-tokenizer cache" in err and "loss=gold" in err, err


def test_tokenizer_whose_decode_is_not_deterministic(tiny, xtok, tmp_path, capsys):
    import json
    import shutil

    # the same vocabulary and merges (the same fingerprint, so the cache's check passes), a decoder that strips a
    # leading space: decoded pieces no longer concatenate to the decoded whole
    student = tmp_path / "student"
    shutil.copytree(tiny["student"], student)
    spec = json.loads((student / "tokenizer.json").read_text())
    spec["decoder"] = {"type": "Sequence", "decoders": [spec["decoder"],
                                                         {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    (student / "tokenizer.json").write_text(json.dumps(spec))
    err = _refused(tiny, tmp_path, capsys, loss="gold", cache=f"[{xtok['cross']}]", student=str(student))
    assert f"student tokenizer {student}" in err and "decode is not deterministic and concatenative" in err, err
    assert "byte-level" in err, err


def test_live_cross_tokenizer_rollouts_that_do_not_round_trip(tiny, xtok, tmp_path, capsys):
    """A sampled completion need not be its text's canonical tokenization ("T" + "he answer"): the live teacher
    with another tokenizer cannot align it, refused by sample before the model is built."""
    from transformers import AutoTokenizer

    from pipeline.store import align
    from pipeline.store.rollouts import rollout_row

    tok = AutoTokenizer.from_pretrained(tiny["student"])
    odd = tok("T", add_special_tokens=False).input_ids + tok("he answer", add_special_tokens=False).input_ids
    assert isinstance(align.retokenize(tok, tok, xtok["rows"][0]["prompt_ids"], odd), str)  # really non-canonical
    bad = rollout_row(prompt_id="odd", prompt_ids=xtok["rows"][0]["prompt_ids"], completion_ids=odd, source="dataset")
    rollouts = _rollouts(tiny, tmp_path / "rollouts", [*xtok["rows"], bad])
    err = _refused(tiny, tmp_path, capsys, loss="gold", cache="[]", teacher_live=str(xtok["teacher"]),
                   rollouts=f"[{rollouts}]", teacher_live_topk=8)
    assert "1 rollout(s) do not round-trip through the text" in err and f"sample {bad['sample_id']}" in err, err
    assert "on_mismatch=skip" in err and "[train] backend=" not in err, err


def test_live_gold_with_a_same_tokenizer_teacher(tiny, xtok, tmp_path, capsys):
    rollouts = _rollouts(tiny, tmp_path / "rollouts", xtok["rows"])
    err = _refused(tiny, tmp_path, capsys, loss="gold", cache="[]", teacher_live=str(tiny["model"]),
                   rollouts=f"[{rollouts}]", teacher_live_topk=8)
    assert f"teacher_live {tiny['model']}: its tokenizer is the student's" in err, err
    assert "plain GKD: train with loss=gkd" in err and "[train] backend=" not in err, err
