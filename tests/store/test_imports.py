"""`gkd cache import` (pipeline/store/imports.py, its readers in import_formats.py): our own export re-imported
equals its cache key for key; a DistillKit-format and a Megatron-LM-format file (written by tests/interop_files.py
from those tools' layouts) import to the same rows, which are the source's top-k."""

from __future__ import annotations

import json

import numpy as np
from interop_files import write_distillkit, write_megatron

from pipeline.cli import main as gkd
from pipeline.store import TeacherCache, read_cache
from pipeline.store.fingerprint import teacher_fingerprint
from pipeline.store.import_formats import dk_decode_logprobs

K = 8


def _samples(cache) -> dict:
    return {s.key: s for s in read_cache(cache)}


def _same(a, b, *, actual: bool = True) -> None:
    assert a.keys() == b.keys() and a
    for key, s in a.items():
        t = b[key]
        assert (s.sample_id, s.first_scored) == (t.sample_id, t.first_scored)
        np.testing.assert_array_equal(s.input_ids, t.input_ids)
        np.testing.assert_array_equal(s.topk_ids, t.topk_ids)
        np.testing.assert_array_equal(s.topk_logprobs, t.topk_logprobs)
        if actual:
            np.testing.assert_array_equal(s.actual_logprobs, t.actual_logprobs)
            np.testing.assert_array_equal(s.actual_ranks, t.actual_ranks)


def test_plain_import_of_an_export_equals_the_original_by_key(scored_rollouts, tmp_path, capsys):
    src = scored_rollouts["cache"]
    assert gkd(["cache", "export", str(src), "--out", str(tmp_path / "plain")]) == 0
    args = ["cache", "import", "--from", "plain", "--in", str(tmp_path / "plain"), "--rollouts",
            str(scored_rollouts["rollouts"]), "--cache", str(tmp_path / "copy")]
    assert gkd(args) == 0
    assert "6 rows" in capsys.readouterr().out
    _same(_samples(src), _samples(tmp_path / "copy"))
    copy = TeacherCache.open(tmp_path / "copy")
    assert copy.descriptor.teacher_fingerprint == TeacherCache.open(src).descriptor.teacher_fingerprint
    assert copy.verify() == []
    record = json.loads((tmp_path / "copy" / "cache.json").read_text())["imports"]
    assert [(r["format"], r["rows"], r["written"]) for r in record] == [("plain", "6", "6")]
    assert gkd(args) == 0  # again: every key is there, nothing written, the second import recorded
    assert "0 written, 6 already cached" in capsys.readouterr().out
    assert len(json.loads((tmp_path / "copy" / "cache.json").read_text())["imports"]) == 2
    assert len(copy.shard_paths()) == 1


def _grid(x: np.ndarray) -> np.ndarray:
    """Logprobs on a 1/64-nat grid: exact in float16, float32 and through delta + cumsum, so both formats carry
    the same values and the imports can be compared with ==."""
    return np.round(np.asarray(x, np.float64) * 64) / 64


def _tool_rows(scored_rollouts) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per rollout, in rollout order: (input_ids, ids [L-1, k], logprobs [L-1, k]) in the tools' alignment (row t =
    token t+1): the cache's top-k at the completion positions, a made-up top-k at the prompt positions."""
    by_sid = {s.sample_id: s for s in read_cache(scored_rollouts["cache"])}
    out = []
    for r in scored_rollouts["rows"]:
        s = by_sid[r["sample_id"]]
        ids = np.asarray(r["prompt_ids"] + r["completion_ids"], np.int64)
        p = len(r["prompt_ids"])
        top = np.tile(np.arange(10, 10 + K), (len(ids) - 1, 1))
        lps = np.tile(-np.arange(1, K + 1) / 4.0, (len(ids) - 1, 1))
        top[p - 1 :], lps[p - 1 :] = s.topk_ids, _grid(s.topk_logprobs)
        out.append((ids, top, lps))
    return out


def test_distillkit_and_megatron_files_import_to_the_same_rows(scored_rollouts, tmp_path, capsys):
    rows = _tool_rows(scored_rollouts)
    model, rollouts = scored_rollouts["model"], str(scored_rollouts["rollouts"])
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    write_distillkit(tmp_path / "dk", rows[::-1], vocab=vocab, k=K)  # DistillKit matches by content: any order
    write_megatron(tmp_path / "mg", [(ids, lps) for _, ids, lps in rows], k=K, seq_len=32, save_dtype="fp16")
    assert gkd(["cache", "import", "--from", "distillkit", "--in", str(tmp_path / "dk"), "--rollouts", rollouts,
                "--cache", str(tmp_path / "c-dk"), "--teacher", str(model), "--codec", "exact-f32"]) == 0
    assert gkd(["cache", "import", "--from", "megatron", "--in", str(tmp_path / "mg"), "--rollouts", rollouts,
                "--cache", str(tmp_path / "c-mg"), "--teacher-fingerprint", teacher_fingerprint(model),
                "--vocab-size", str(vocab), "--codec", "exact-f32"]) == 0
    dk, mg = _samples(tmp_path / "c-dk"), _samples(tmp_path / "c-mg")
    _same(dk, mg)
    src = _samples(scored_rollouts["cache"])
    assert dk.keys() == src.keys()  # the same content keys as scoring these rollouts with that teacher
    inside = outside = 0
    for key, s in dk.items():
        ref = src[key]
        np.testing.assert_array_equal(s.topk_ids, ref.topk_ids)
        np.testing.assert_array_equal(s.topk_logprobs, _grid(ref.topk_logprobs).astype(np.float32))
        hit = ref.actual_ranks <= K  # actual token in the top-k: its value and rank, read off the top-k
        np.testing.assert_array_equal(s.actual_ranks[hit], ref.actual_ranks[hit])
        np.testing.assert_allclose(s.actual_logprobs[hit], ref.actual_logprobs[hit], atol=1 / 128)
        assert np.all(s.actual_ranks[~hit] == K + 1) and np.all(s.actual_logprobs[~hit] <= s.topk_logprobs[~hit, -1])
        inside, outside = inside + int(hit.sum()), outside + int((~hit).sum())
    assert inside and outside  # both cases were exercised
    desc = TeacherCache.open(tmp_path / "c-mg").descriptor
    assert desc.numerics == {"imported_from": "megatron", "actual_outside_topk": "bound"}
    assert desc.imports[0]["layout"].startswith("Megatron-LM logits_saver")


def test_distillkit_residual_bins_decode_within_half_a_step():
    """DistillKit's quantised part (exact_k < k: one 8-bit residual bin of the deltas), against the values it
    was written from: each delta within half a quantisation step, so each logprob within the steps summed."""
    import tempfile
    from pathlib import Path

    import pyarrow.parquet as pq
    import yaml

    rng = np.random.default_rng(3)
    lps = -np.sort(rng.exponential(2.0, (5, K)).cumsum(1), axis=1)
    with tempfile.TemporaryDirectory() as d:
        cfg = write_distillkit(Path(d), [(np.arange(6), np.tile(np.arange(K), (5, 1)), lps)], vocab=300, k=K,
                               exact_k=2)
        assert yaml.safe_load((Path(d) / "compression_config.yaml").read_text()) == cfg
        blob = pq.read_table(Path(d) / "part-0.parquet").column("compressed_logprobs")[0].as_py()
    got = dk_decode_logprobs(np.asarray(blob, np.uint8), cfg)
    deltas = np.diff(lps, axis=1)[:, 1:]
    step = np.abs(deltas).max(1, keepdims=True) / 128
    np.testing.assert_allclose(got[:, :2], lps[:, :2], atol=1e-5)  # the exact part
    assert np.all(np.abs(got - lps) <= step * np.arange(K).clip(0, None) / 2 + 1e-5)
