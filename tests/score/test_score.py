"""Score stage against real vLLM (tiny random teacher) and an independent transformers forward."""

import json
import os
import subprocess
import sys
from pathlib import Path

import killing
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.score.config import ScoreConfig
from pipeline.score.errors import ScoreInputError
from pipeline.score.scorer import score, status
from pipeline.slurm.arrays import array_spec
from pipeline.store import CacheMismatchError, TeacherCache, read_cache
from pipeline.store.rollouts import rollout_row, write_rollouts
from pipeline.store.shards import ShardError

MAX_LEN = 96
K = 8
TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    from tiny_models import build_tiny_teacher

    return build_tiny_teacher(tmp_path_factory.mktemp("teacher"), scale=30.0, max_pos=128)


@pytest.fixture(scope="module")
def llm(teacher):
    from pipeline.engine import EngineArgs, open_engine

    args = EngineArgs(model=str(teacher), dtype="float32", max_model_len=MAX_LEN + 1, kv_cache_gib=0.05, enforce_eager=True,
                      max_num_batched_tokens=1024)
    with open_engine(args, max_logprobs=K, logprobs_mode="raw_logprobs") as engine:
        yield engine


def _fp(teacher) -> str:
    from pipeline.store.fingerprint import tokenizer_fingerprint

    return tokenizer_fingerprint(teacher)


def _rollouts(path, specs, teacher, seed=0):
    """specs: list of (prompt_len, completion_len); random ids in [3, 384), tokenizer = the teacher's."""
    rng = np.random.default_rng(seed)
    rows = [
        rollout_row(prompt_id=f"q{seed}-{i}", prompt_ids=rng.integers(3, 384, p).tolist(),
                    completion_ids=rng.integers(3, 384, c).tolist(), source="dataset")
        for i, (p, c) in enumerate(specs)
    ]
    write_rollouts(path, rows, tokenizer_fingerprint=_fp(teacher))
    return rows


def _cfg(tmp, teacher, **kw):
    base = dict(rollouts=str(tmp / "rollouts"), cache=str(tmp / "cache"), teacher=str(teacher), topk=K,
                max_model_len=MAX_LEN, part_rows=4, batch_tokens=256)
    return ScoreConfig(**{**base, **kw})


def _hf_logprobs(teacher, ids, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=dtype).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].to(dtype), -1).double().numpy()


def test_matches_transformers_and_alignment(tmp_path, teacher, llm):
    # prompt/completion boundary, a length-1 completion, and a sequence that ends exactly at max_model_len
    rows = _rollouts(tmp_path / "rollouts" / "r-00000-of-00001.parquet", [(5, 7), (9, 1), (40, MAX_LEN - 40)], teacher)
    summary = score(_cfg(tmp_path, teacher), llm=llm)
    assert summary["scored"] == 3 and summary["teacher_forwards"] == 3
    cached = {s.sample_id: s for s in read_cache(tmp_path / "cache")}
    for r in rows:
        s = cached[r["sample_id"]]
        ids = r["prompt_ids"] + r["completion_ids"]
        P = len(r["prompt_ids"])
        assert s.first_scored == P and s.topk_ids.shape == (len(ids) - P, K)
        hf32 = _hf_logprobs(teacher, ids)
        hf64 = _hf_logprobs(teacher, ids, torch.float64)
        control = np.abs(hf32 - hf64).max()  # live-vs-live: fp32 forward vs fp64 forward of the same weights
        tol = max(50 * control, 1e-4) + 1 / 64  # + the codec's documented max abs error
        for i, j in enumerate(range(P, len(ids))):
            ref = hf32[j - 1]  # logits at j-1 predict token j: the alignment under test
            order = np.argsort(-ref, kind="stable")
            # same top-k set, except where the k-th and (k+1)-th are a near-tie
            if ref[order[K - 1]] - ref[order[K]] > 2 * tol:
                assert set(s.topk_ids[i]) == set(order[:K]), (r["sample_id"], j)
            np.testing.assert_allclose(s.topk_logprobs[i], ref[s.topk_ids[i]], atol=tol)
            assert abs(s.actual_logprobs[i] - ref[ids[j]]) <= tol
            engine_tol = max(50 * control, 1e-4)
            near_ties = int((np.abs(ref - ref[ids[j]]) <= 2 * engine_tol).sum())  # includes x_j itself
            assert abs(int(s.actual_ranks[i]) - (1 + int((ref > ref[ids[j]]).sum()))) < near_ties
            # the tail mass 1 - sum(top-k) is ill-conditioned in log space when small: compare masses, allowing
            # the codec's relative error plus k times the engine's per-entry error
            tail = 1.0 - np.exp(ref[order[:K]]).sum()
            assert abs(np.exp(s.tail_logprobs[i]) - tail) <= tail * (np.exp(1 / 64) - 1) + K * engine_tol
        # shifting by one would be visibly wrong: the stored actual logprobs are not those of x_{j+1}
        off = [hf32[j][ids[j + 1]] for j in range(P, len(ids) - 1)]
        if off:
            assert np.abs(np.array(off) - s.actual_logprobs[: len(off)]).max() > 0.1


def test_engine_arrays_equal_vllms_lists(teacher, llm):
    """The score stage keeps vLLM's prompt logprobs as the engine core's arrays (pipeline/engine.py); vLLM's own
    Python lists of the same requests, through the same `extract`, must give the same arrays bit for bit."""
    from pipeline.engine import ArrayPromptLogprobs
    from pipeline.score.extract import extract
    from pipeline.score.teacher import InProcessTeacher

    rng = np.random.default_rng(5)
    rows = [{"engine_ids": rng.integers(3, 384, n)} for n in (9, 40, 77)]
    got, flats = {}, {}
    for arrays in (True, False):
        [(_, flats[arrays])] = list(InProcessTeacher(llm, K, arrays=arrays).score_batches([rows]))
        assert all(isinstance(f, ArrayPromptLogprobs) == arrays for f in flats[arrays])
        got[arrays] = [extract(f, r["engine_ids"], first, K)
                       for f, r in zip(flats[arrays], rows, strict=True) for first in (1, 5)]
    for a, b in zip(got[True], got[False], strict=True):
        for name in a:
            assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), name
    wrong = rows[1]["engine_ids"].copy()
    wrong[7] += 1
    for arrays in (True, False):  # a shifted or changed id is caught on both paths
        with pytest.raises(RuntimeError, match="alignment broken"):
            extract(flats[arrays][1], wrong, 1, K)


def test_array_logprobs_join_chunks_in_order():
    """Chunked prefill hands a prompt's logprobs over in pieces: the arrays are the pieces in order."""
    from pipeline.engine import ArrayPromptLogprobs

    rng = np.random.default_rng(0)
    ids, lps, ranks = rng.integers(0, 99, (10, K + 1)), rng.standard_normal((10, K + 1)).astype(np.float32), rng.integers(1, 9, 10)
    whole, pieces = ArrayPromptLogprobs(), ArrayPromptLogprobs()
    whole.add(torch.from_numpy(ids), torch.from_numpy(lps), torch.from_numpy(ranks))
    for a, b in ((0, 3), (3, 4), (4, 10)):
        pieces.add(torch.from_numpy(ids[a:b]), torch.from_numpy(lps[a:b]), torch.from_numpy(ranks[a:b]))
    assert len(whole) == len(pieces) == 11  # position 0 has no logprobs, as in vLLM's lists
    for x, y, z in zip(whole.arrays(), pieces.arrays(), (ids, lps, ranks), strict=True):
        assert np.array_equal(x, y) and np.array_equal(x, z)


def test_writer_thread_writes_the_serial_paths_shards_byte_for_byte(tmp_path, teacher, llm):
    """The overlapped loop (batch and part writer threads behind bounded queues) against the serial one
    (write_queue=0): the same parts, each byte-identical, so the same rows in the same order and the same markers'
    checksums."""
    rng = np.random.default_rng(3)
    _rollouts(tmp_path / "rollouts" / "r-00000-of-00001.parquet",
              [(int(rng.integers(2, 20)), int(rng.integers(1, 60))) for _ in range(23)], teacher)
    for depth in (0, 1, 2):
        s = score(_cfg(tmp_path, teacher, cache=str(tmp_path / f"cache-{depth}"), write_queue=depth), llm=llm)
        assert s["scored"] == 23 and len(s["parts"]) == 6  # 23 rows, 4 per part: parts written along the run
    def shards(depth):
        d = tmp_path / f"cache-{depth}" / "shards"
        return {p.name: p.read_bytes() for p in sorted(d.glob("*.parquet"))}
    assert shards(1) == shards(0) and shards(2) == shards(0) and len(shards(0)) == 6


def test_a_cache_of_the_old_fingerprint_scheme_keeps_its_keys(tmp_path, teacher, llm):
    """A cache made before descriptor 1.5 (one blake2b stream over the weights, no fingerprint_scheme) still takes
    rows: the run computes the fingerprint the old way, and its keys are those main wrote."""
    from pipeline.store.fingerprint import content_key, teacher_fingerprint

    rows = _rollouts(tmp_path / "rollouts" / "r-00000-of-00001.parquet", [(4, 6)] * 3, teacher)
    score(_cfg(tmp_path, teacher, cache=str(tmp_path / "new")), llm=llm)
    desc = json.loads((tmp_path / "new" / "cache.json").read_text())
    assert desc["fingerprint_scheme"] == 2 and desc["teacher_fingerprint"] == teacher_fingerprint(teacher)
    old_fp = teacher_fingerprint(teacher, 1)
    assert old_fp != desc["teacher_fingerprint"]
    (tmp_path / "old").mkdir()
    old = {**{k: v for k, v in desc.items() if k != "fingerprint_scheme"}, "teacher_fingerprint": old_fp,
           "descriptor_version": "1.3"}
    (tmp_path / "old" / "cache.json").write_text(json.dumps(old))
    assert score(_cfg(tmp_path, teacher, cache=str(tmp_path / "old")), llm=llm)["scored"] == 3
    keys = {s.key for s in read_cache(tmp_path / "old")}
    assert keys == {content_key(old_fp, np.array(r["prompt_ids"] + r["completion_ids"]), 4, K, "raw_logprobs")
                    for r in rows}


def test_incremental_second_run_scores_nothing_then_only_misses(tmp_path, teacher, llm, capsys):
    _rollouts(tmp_path / "rollouts" / "a-00000-of-00001.parquet", [(4, 6)] * 5, teacher)
    first = score(_cfg(tmp_path, teacher), llm=llm)
    assert first["scored"] == 5
    again = score(_cfg(tmp_path, teacher), llm=llm)
    assert again == {"done_before": True, "teacher_forwards": 0}
    assert "nothing to do" in capsys.readouterr().out
    # new rollouts beside the old ones: a new rollout set, only its misses are scored
    _rollouts(tmp_path / "rollouts" / "b-00000-of-00001.parquet", [(4, 6)] * 3, teacher, seed=1)
    third = score(_cfg(tmp_path, teacher), llm=llm)
    assert third["scored"] == 3 and third["skipped"]["cached"] == 5 and third["teacher_forwards"] == 3
    assert len(TeacherCache.open(tmp_path / "cache").keys()) == 8


def _assert_same_rows(cache_a, cache_b, n):
    """Two caches hold the same n keys with the same top-k ids and logprobs."""
    a = {s.key: s for s in read_cache(cache_a)}
    b = {s.key: s for s in read_cache(cache_b)}
    assert a.keys() == b.keys() and len(b) == n
    for key, s in b.items():
        np.testing.assert_array_equal(s.topk_ids, a[key].topk_ids)
        np.testing.assert_array_equal(s.topk_logprobs, a[key].topk_logprobs)


def test_union_of_shard_tasks_equals_unsharded(tmp_path, teacher, llm):
    _rollouts(tmp_path / "rollouts" / "r-00000-of-00001.parquet", [(3, 5), (6, 2), (4, 9), (2, 3), (7, 7), (5, 5)], teacher)
    for i in range(3):
        score(_cfg(tmp_path, teacher, shard=i, num_shards=3), llm=llm)
    score(_cfg(tmp_path, teacher, cache=str(tmp_path / "single")), llm=llm)
    _assert_same_rows(tmp_path / "cache", tmp_path / "single", 6)
    assert TeacherCache.open(tmp_path / "cache").verify() == []


def test_status_lists_missing_tasks_as_array(tmp_path, teacher, llm, capsys):
    _rollouts(tmp_path / "rollouts" / "r-00000-of-00001.parquet", [(3, 5)] * 8, teacher)
    for i in (0, 2, 3):
        score(_cfg(tmp_path, teacher, shard=i, num_shards=6), llm=llm)
    assert status(_cfg(tmp_path, teacher, num_shards=6)) == 1
    assert "--array=1,4-5" in capsys.readouterr().out
    assert array_spec([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_bad_input(tmp_path, teacher, llm):
    rng = np.random.default_rng(0)
    bad_vocab = rollout_row(prompt_id="big", prompt_ids=[5, 6], completion_ids=[7, 10_000], source="dataset")
    empty = rollout_row(prompt_id="empty", prompt_ids=[5, 6], completion_ids=[], source="dataset")
    long = rollout_row(prompt_id="long", prompt_ids=rng.integers(3, 300, MAX_LEN).tolist(), completion_ids=[5], source="dataset")
    ok = rollout_row(prompt_id="ok", prompt_ids=[5, 6], completion_ids=[7, 8], source="dataset")
    write_rollouts(tmp_path / "v" / "r.parquet", [bad_vocab, ok], tokenizer_fingerprint=_fp(teacher))
    with pytest.raises(ScoreInputError, match=bad_vocab["sample_id"]):
        score(_cfg(tmp_path, teacher, rollouts=str(tmp_path / "v")), llm=llm)
    write_rollouts(tmp_path / "l" / "r.parquet", [long, empty, ok], tokenizer_fingerprint=_fp(teacher))
    with pytest.raises(ScoreInputError, match=long["sample_id"] + ".*on_overlong=skip"):
        score(_cfg(tmp_path, teacher, rollouts=str(tmp_path / "l")), llm=llm)
    s = score(_cfg(tmp_path, teacher, rollouts=str(tmp_path / "l"), on_overlong="skip"), llm=llm)
    assert s["scored"] == 1 and s["skipped"]["overlong"] == 1 and s["skipped"]["empty"] == 1
    # a cache of another k / teacher is refused before any work
    with pytest.raises(CacheMismatchError, match="k: cache has 8"):
        score(_cfg(tmp_path, teacher, rollouts=str(tmp_path / "l"), topk=4), llm=llm)
    # a rollout shard that fails verification is refused, naming it
    shard = tmp_path / "l" / "r.parquet"
    shard.write_bytes(shard.read_bytes()[:-20])
    with pytest.raises(ShardError, match="r.parquet"):
        score(_cfg(tmp_path, teacher, rollouts=str(tmp_path / "l"), cache=str(tmp_path / "c2")), llm=llm)


def _score_cmd(tmp_path, teacher, cache):
    return [sys.executable, "-m", "pipeline", "score", "--rollouts", str(tmp_path / "rollouts"), "--cache", str(cache),
            "--teacher", str(teacher), "--topk", str(K), f"max_model_len={MAX_LEN}", "part_rows=2", "batch_tokens=40",
            "enforce_eager=true", "kv_cache_gib=0.05"]


def test_sigkill_mid_run_then_rerun_equals_uninterrupted(tmp_path, teacher):
    """Through the real CLI: kill right after the second part lands, rerun, compare with an uninterrupted run."""
    n = 24  # 12 parts of 2 rows
    _rollouts(tmp_path / "rollouts" / "r-00000-of-00001.parquet", [(4, 20)] * n, teacher)
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent)}
    proc = killing.start(_score_cmd(tmp_path, teacher, tmp_path / "killed"), "cache-commit:2", env=env)
    shards = tmp_path / "killed" / "shards"
    stopped = killing.wait_stopped(proc)  # stopped itself right after its second commit: the kill lands there exactly
    killing.kill(proc)  # the command alone, as a user's kill -9 (its engine dies with it: pipeline/lifetime.py)
    done = sorted(p.name for p in shards.glob("*.ok"))
    done_before = len(done)
    assert stopped == proc.pid and done_before == 2, (stopped, proc.pid, done)  # the scorer itself commits and stops
    for cache in ("killed", "clean"):
        out = subprocess.run(_score_cmd(tmp_path, teacher, tmp_path / cache), env=env, capture_output=True, text=True, timeout=1800)
        assert out.returncode == 0, out.stderr[-2000:]
    assert "scored" in out.stdout
    _assert_same_rows(tmp_path / "killed", tmp_path / "clean", n)
    keys = [k for p in TeacherCache.open(tmp_path / "killed").shard_paths() for k in pq.read_table(p, columns=["key"])["key"].to_pylist()]
    assert len(keys) == len(set(keys)) == n  # no duplicate rows
    assert TeacherCache.open(tmp_path / "killed").verify() == []
    assert not [p for p in shards.iterdir() if p.name.startswith(".")]  # no partial files left
    marker = json.loads(next((tmp_path / "killed" / "tasks").glob("*.done")).read_text())
    assert marker["skipped"]["cached"] == 2 * done_before  # the rerun reused every part the killed run finished


# -- what the score stage refuses before any teacher work -------------------------------------------------------


def _no_teacher_work(monkeypatch):
    """Fail the test if the engine is opened or the teacher's weights are hashed."""
    import pipeline.score.scorer as scorer
    import pipeline.score.teacher as in_process

    # where each name is looked up when called: open_teacher_engine (teacher.py), _open_task (scorer.py)
    monkeypatch.setattr(in_process, "open_engine", lambda *a, **k: pytest.fail("the engine was opened"))
    monkeypatch.setattr(scorer, "teacher_fingerprint", lambda *a: pytest.fail("the teacher's weights were hashed"))


def _swapped_tokenizer(teacher: Path, out: Path) -> Path:
    """The teacher's tokenizer with two ordinary tokens' ids swapped: same vocab size, another mapping."""
    out.mkdir()
    for f in teacher.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (out / f.name).write_bytes(f.read_bytes())
    spec = json.loads((out / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = (t for t, i in vocab.items() if i in (100, 101))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return out


def test_refuses_rollouts_of_another_tokenizer_before_any_teacher_work(tmp_path, teacher, monkeypatch):
    from transformers import AutoTokenizer

    from pipeline.store.fingerprint import tokenizer_fingerprint

    other = _swapped_tokenizer(teacher, tmp_path / "other")
    assert len(AutoTokenizer.from_pretrained(other)) == len(AutoTokenizer.from_pretrained(teacher))
    other_fp = tokenizer_fingerprint(other)
    assert other_fp != _fp(teacher)
    rows = [rollout_row(prompt_id="q", prompt_ids=[5, 6, 7], completion_ids=[100, 101, 8], source="dataset")]
    write_rollouts(tmp_path / "rollouts" / "r.parquet", rows, tokenizer_fingerprint=other_fp)  # ids in range
    _no_teacher_work(monkeypatch)
    with pytest.raises(ScoreInputError, match=f"another tokenizer than the teacher's .*r.parquet \\({other_fp}\\)"):
        score(_cfg(tmp_path, teacher))
    assert not (tmp_path / "cache").exists()


def test_refuses_rollouts_that_record_no_tokenizer(tmp_path, teacher, monkeypatch):
    rows = [rollout_row(prompt_id="q", prompt_ids=[5, 6], completion_ids=[7, 8], source="dataset")]
    write_rollouts(tmp_path / "rollouts" / "r.parquet", rows)
    _no_teacher_work(monkeypatch)
    with pytest.raises(ScoreInputError, match="record no tokenizer fingerprint: .*r.parquet.*tokenizer_fingerprint="):
        score(_cfg(tmp_path, teacher))


def test_rollouts_of_schema_1_0_are_checked_through_their_marker(tmp_path, teacher, llm):
    """Shards that gkd generate/import wrote before the footer entry carry the fingerprint in their marker."""
    from pipeline.store.rollouts import TOKENIZER_KEY, rollout_tokenizer

    rows = [rollout_row(prompt_id="q", prompt_ids=[5, 6], completion_ids=[7, 8], source="dataset")]
    path = tmp_path / "rollouts" / "r.parquet"
    write_rollouts(path, rows, extra={"tokenizer_fingerprint": _fp(teacher)})
    assert TOKENIZER_KEY not in (pq.read_schema(path).metadata or {}) and rollout_tokenizer(path) == _fp(teacher)
    assert score(_cfg(tmp_path, teacher), llm=llm)["scored"] == 1


def test_bf16_rows_into_an_fp32_cache_are_refused_before_any_teacher_work(tmp_path, teacher, llm, monkeypatch):
    from pipeline.config import ConfigError

    _rollouts(tmp_path / "rollouts" / "a-00000-of-00001.parquet", [(4, 6)] * 2, teacher)
    score(_cfg(tmp_path, teacher), llm=llm)  # an fp32 cache
    assert TeacherCache.open(tmp_path / "cache").descriptor.numerics == {
        "dtype": "float32", "quantization": "none", "kv_cache_dtype": "auto"}
    _rollouts(tmp_path / "rollouts" / "b-00000-of-00001.parquet", [(4, 6)] * 2, teacher, seed=1)
    with pytest.raises(ConfigError, match="dtype: engine has 'float32', the score config 'bfloat16'"):
        score(_cfg(tmp_path, teacher, dtype="bfloat16"), llm=llm)  # an engine handed in must score as configured
    _no_teacher_work(monkeypatch)
    monkeypatch.setattr("pipeline.score.scorer.teacher_fingerprint", lambda p, *scheme: TeacherCache.open(
        tmp_path / "cache").descriptor.teacher_fingerprint)  # the same teacher: only the numerics differ
    for kw, message in [
        ({"dtype": "bfloat16"}, "numerics.dtype: cache has 'float32', this run has 'bfloat16'"),
        ({"engine_extra": {"kv_cache_dtype": "fp8"}}, "numerics.kv_cache_dtype: cache has 'auto', this run has 'fp8'"),
        ({"engine_extra": {"hf_overrides": {"rope_theta": 5.0}}}, "numerics.engine_extra.hf_overrides: cache has"),
    ]:
        with pytest.raises(CacheMismatchError, match=message):
            score(_cfg(tmp_path, teacher, **kw))
    with pytest.raises(ConfigError, match="dtype must be one of .* got 'auto'"):
        score(_cfg(tmp_path, teacher, dtype="auto"))


# -- two writers on one cache -----------------------------------------------------------------------------------


def test_two_score_jobs_on_one_cache(tmp_path, teacher, llm):
    """Job A (the real CLI, a subprocess) scores rollout set A into a cache. While it runs: a second process of the
    same task is refused at once, naming A's pid and host; a job over rollout set B, half of it A's rows, scores
    into the same cache at the same time and succeeds. Afterwards each key is there once, verify is clean, and the
    rows equal a cache scored by one job."""
    import socket

    from pipeline.store.locks import LockHeldError

    n = 40  # 20 parts of 2 rows
    rows_a = _rollouts(tmp_path / "A" / "r-00000-of-00001.parquet", [(4, 20)] * n, teacher)
    write_rollouts(tmp_path / "B" / "r-00000-of-00001.parquet", rows_a[n // 2 :] + [
        rollout_row(prompt_id=f"b{i}", prompt_ids=[5, 6, 7], completion_ids=[8 + i] * 10, source="dataset")
        for i in range(6)], tokenizer_fingerprint=_fp(teacher))
    cache = tmp_path / "cache"
    cmd = _score_cmd(tmp_path, teacher, cache)
    cmd[cmd.index("--rollouts") + 1] = str(tmp_path / "A")
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent)}
    # A stops itself after its first commit (its task lock held, the commit lock free): B runs while A is mid-run
    proc = killing.start(cmd, "cache-commit:1", env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        killing.wait_stopped(proc)
        with pytest.raises(LockHeldError, match=f"held by pid {proc.pid} on host {socket.gethostname()}"):
            score(_cfg(tmp_path, teacher, rollouts=str(tmp_path / "A")), llm=llm)
        b = score(_cfg(tmp_path, teacher, rollouts=str(tmp_path / "B"), part_rows=2), llm=llm)
        assert proc.poll() is None, "job A ended before job B: the writers did not overlap"
        killing.resume(proc)
        out, err = proc.communicate(timeout=1800)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert b["scored"] == n // 2 + 6  # B scored the shared rows A had not reached yet ...
    done = [json.loads(p.read_text()) for p in (cache / "tasks").glob("*.done")]
    assert sum(d["skipped"].get("cached_meanwhile", 0) for d in done) > 0, done  # ... and A left them out when it got there
    keys = [k for p in TeacherCache.open(cache).shard_paths() for k in pq.read_table(p, columns=["key"])["key"].to_pylist()]
    assert len(keys) == len(set(keys)) == n + 6
    from pipeline.cli import main as gkd

    assert TeacherCache.open(cache).verify() == [] and gkd(["cache", "verify", str(cache)]) == 0
    assert not [p for p in (cache / "shards").iterdir() if p.name.startswith(".")]
    assert not list((cache / "tasks").glob("*.lock")) and not (cache / ".commit.lock").exists()
    score(_cfg(tmp_path, teacher, rollouts=str(tmp_path / "A"), cache=str(tmp_path / "one")), llm=llm)
    score(_cfg(tmp_path, teacher, rollouts=str(tmp_path / "B"), cache=str(tmp_path / "one")), llm=llm)
    _assert_same_rows(cache, tmp_path / "one", n + 6)


def test_full_disk_mid_run_then_rerun_equals_uninterrupted(tmp_path, teacher, llm):
    """ENOSPC part of the way through a score task (a small tmpfs, tests/full_disk.py): the error names the part
    and the cause, the parts a reader sees are complete and verify, the task is not marked done; once space is
    freed the same command completes and the cache equals an uninterrupted run's, key by key."""
    from full_disk import fill, leftovers, small_fs

    from pipeline.store.shards import WriteError

    n = 48
    _rollouts(tmp_path / "rollouts" / "r-00000-of-00001.parquet", [(4, 40)] * n, teacher)
    clean = score(_cfg(tmp_path, teacher, cache=str(tmp_path / "clean")), llm=llm)
    part_bytes = sum(p.stat().st_size for p in (tmp_path / "clean" / "shards").glob("*.parquet"))
    with small_fs(tmp_path / "disk", "4m") as disk:
        cache = disk / "cache"
        TeacherCache.create_or_open(cache, TeacherCache.open(tmp_path / "clean").descriptor)
        ballast = fill(disk, part_bytes // 2)
        with pytest.raises(WriteError, match=r"cache/shards/scored-.*-p00\d\d\.parquet: .*No space left on device"):
            score(_cfg(tmp_path, teacher, cache=str(cache)), llm=llm)
        landed = TeacherCache.open(cache).shard_paths()
        assert 0 < len(landed) < len(clean["parts"]), "the disk should fill part of the way through"
        assert TeacherCache.open(cache).verify() == [] and not list((cache / "tasks").glob("*.done"))
        assert leftovers(disk) == [] and not list(disk.rglob("*.lock"))
        ballast.unlink()
        again = score(_cfg(tmp_path, teacher, cache=str(cache)), llm=llm)
        assert again["skipped"]["cached"] == 4 * len(landed)  # the parts that landed were kept, not redone
        _assert_same_rows(cache, tmp_path / "clean", n)
        assert TeacherCache.open(cache).verify() == [] and leftovers(disk) == []


def test_top_p_and_k0_caches_match_transformers(tmp_path, teacher, llm):
    """topp=0.9 min_k=2 (cap K): each position keeps a rank-order prefix, the fewest entries whose reference mass
    reaches P (at least 2, at most K) except at near-ties of the running mass with P, and the tail bin holds the
    rest; --topk 0 stores the actual token only. Another top-p setting into the same cache is refused."""
    rows = _rollouts(tmp_path / "rollouts" / "r-00000-of-00001.parquet", [(5, 20), (9, 30)], teacher, seed=3)
    score(_cfg(tmp_path, teacher, topp=0.9, min_k=2), llm=llm)
    score(_cfg(tmp_path, teacher, cache=str(tmp_path / "k0"), topk=0), llm=llm)
    cached = {s.sample_id: s for s in read_cache(tmp_path / "cache")}
    k0 = {s.sample_id: s for s in read_cache(tmp_path / "k0")}
    kept_total = 0
    for r in rows:
        s, z = cached[r["sample_id"]], k0[r["sample_id"]]
        ids = r["prompt_ids"] + r["completion_ids"]
        P = len(r["prompt_ids"])
        hf32, hf64 = _hf_logprobs(teacher, ids), _hf_logprobs(teacher, ids, torch.float64)
        tol = max(50 * np.abs(hf32 - hf64).max(), 1e-4)  # the engine's error, as in the test above
        assert s.topk_ids.shape == (len(ids) - P, K) and z.topk_ids.shape == (len(ids) - P, 0)
        for i, j in enumerate(range(P, len(ids))):
            ref = hf32[j - 1]
            n = int(s.topk_counts[i])
            kept_total += n
            assert 2 <= n <= K and np.all(s.topk_ids[i, n:] == 0) and np.all(np.isneginf(s.topk_logprobs[i, n:]))
            mass = np.cumsum(np.exp(np.sort(ref)[::-1][:K]))
            if n < K:  # reached P at n (not before, unless the floor of 2 holds it), up to the engine's error
                assert mass[n - 1] >= 0.9 - K * tol
            if n > 2:
                assert mass[n - 2] < 0.9 + K * tol
            np.testing.assert_allclose(s.topk_logprobs[i, :n], ref[s.topk_ids[i, :n]], atol=tol + 1 / 64)
            rest = 1.0 - np.exp(ref[s.topk_ids[i, :n]]).sum()
            assert abs(np.exp(s.tail_logprobs[i]) - rest) <= rest * (np.exp(1 / 64) - 1) + K * tol
            assert abs(z.actual_logprobs[i] - ref[ids[j]]) <= tol + 1 / 64 and z.tail_logprobs[i] == 0.0
        np.testing.assert_array_equal(z.actual_ranks, s.actual_ranks)
    assert kept_total < K * sum(len(r["completion_ids"]) for r in rows)  # the cap is not all there is
    with pytest.raises(CacheMismatchError, match="topp: cache has 0.9"):
        score(_cfg(tmp_path, teacher, topp=0.95, min_k=2), llm=llm)
    with pytest.raises(ValueError, match="needs codec"):
        score(_cfg(tmp_path, teacher, cache=str(tmp_path / "x"), topp=0.9, codec="exact-f32"), llm=llm)


# -- privileged-context teacher (OPSD) ---------------------------------------------------------------------------


def test_privileged_teacher_prompt_rows_align_to_the_students_completion_tokens(tmp_path, teacher, llm):
    """Rollouts with a teacher_prompt: stored row i is the teacher's forward on teacher_prompt + completion at
    completion token i, stored under the student's prompt + completion; the loader pairs it with the student's
    position predicting that same token (and the plain view of the same sample is another key)."""
    from pipeline.train.data.loader import ScoredLoader
    from pipeline.train.losses.reference import gkd_loss

    rng = np.random.default_rng(7)
    specs = [(5, 12, 9), (9, 3, 6), (4, 30, 1)]  # (prompt, teacher prompt, completion): longer, shorter, length-1
    rows = []
    for i, (p, t, c) in enumerate(specs):
        rows.append(rollout_row(prompt_id=f"o{i}", prompt_ids=rng.integers(3, 384, p).tolist(),
                                completion_ids=rng.integers(3, 384, c).tolist(), source="student", policy_version=0,
                                teacher_prompt_ids=rng.integers(3, 384, t).tolist(), tags={"task": "math"}))
    plain = {**rows[0], "teacher_prompt_ids": None}  # the same sample, teacher without the privileged view
    write_rollouts(tmp_path / "rollouts" / "r.parquet", rows + [plain], tokenizer_fingerprint=_fp(teacher))
    summary = score(_cfg(tmp_path, teacher), llm=llm)
    assert summary["scored"] == 4 and summary["tokens"] == sum(c for *_, c in specs) + specs[0][2]
    cache = tmp_path / "cache"
    stored = {}
    for p in TeacherCache.open(cache).shard_paths():
        t = pq.read_table(p, columns=["key", "teacher_prompt_ids", "tags"]).to_pylist()
        stored.update({r["key"]: r for r in t})
    samples = list(read_cache(cache))
    assert len({s.key for s in samples}) == 4 and len({s.sample_id for s in samples}) == 3
    hf = {}
    for s in samples:
        r = next(r for r in rows if r["sample_id"] == s.sample_id)
        priv = stored[s.key]["teacher_prompt_ids"]
        assert stored[s.key]["tags"] == [("task", "math")]
        comp, P = r["completion_ids"], len(r["prompt_ids"])
        assert s.input_ids.tolist() == r["prompt_ids"] + comp and s.first_scored == P  # the student's view
        view = priv if priv is not None else r["prompt_ids"]
        assert priv is None or priv == r["teacher_prompt_ids"]
        ref = _hf_logprobs(teacher, view + comp)[len(view) - 1: len(view) + len(comp) - 1]  # row i -> comp[i]
        hf[s.key] = ref
        tol = 1e-3 + 1 / 64  # engine vs transformers in fp32 (measured ~1e-5 above) + the codec's max abs error
        np.testing.assert_allclose(s.actual_logprobs, ref[np.arange(len(comp)), comp], atol=tol)
        np.testing.assert_allclose(s.topk_logprobs, np.take_along_axis(ref, s.topk_ids.astype(np.int64), 1), atol=tol)
        if priv is not None:  # the student's view would give other rows: the test can see a wrong context
            other = _hf_logprobs(teacher, r["prompt_ids"] + comp)[P - 1: P + len(comp) - 1]
            assert np.abs(other[np.arange(len(comp)), comp] - s.actual_logprobs).max() > 0.1
    # the loader: the row of completion token c sits where the student's logits on prompt + completion[:c] predict it
    mb = ScoredLoader([cache], micro_batch_size=4, seq_length=64, seed=0).micro_batch(0)
    logits = torch.full((*mb.input_ids.shape, 384), -30.0, dtype=torch.float64)
    for b, key in enumerate(mb.keys):
        s = next(s for s in samples if s.key == key)
        P, n = s.first_scored, len(s.input_ids)
        assert mb.loss_mask[b].nonzero().flatten().tolist() == list(range(P - 1, n - 1))
        for c, t in enumerate(range(P - 1, n - 1)):
            assert mb.input_ids[b, : t + 1].tolist() == s.input_ids[: P + c].tolist()
            assert mb.labels[b, t] == s.input_ids[P + c]
            assert mb.teacher_ids[b, t].tolist() == s.topk_ids[c].tolist()
            logits[b, t, : hf[key].shape[1]] = torch.from_numpy(hf[key][c])
    # a student whose logits at t are the teacher's own (privileged) forward for that token: loss ~ the codec error
    # only; the same logits one position late (the classic off-by-one) are far off
    loss, count = gkd_loss(logits.float(), mb.teacher_ids, mb.teacher_logprobs, mb.loss_mask, beta=0.5, mode="tail")
    late, _ = gkd_loss(torch.roll(logits, 1, dims=1).float(), mb.teacher_ids, mb.teacher_logprobs, mb.loss_mask,
                       beta=0.5, mode="tail")
    assert count == summary["tokens"] and (loss / count).item() < 1e-3 and (late / count).item() > 0.05


def test_privileged_teacher_prompt_is_refused_with_score_prompt(tmp_path, teacher, llm):
    row = rollout_row(prompt_id="q", prompt_ids=[5, 6], completion_ids=[7, 8], source="dataset",
                      teacher_prompt_ids=[9, 10, 11])
    empty = rollout_row(prompt_id="e", prompt_ids=[5, 6], completion_ids=[7, 8], source="dataset", teacher_prompt_ids=[])
    write_rollouts(tmp_path / "rollouts" / "r.parquet", [row], tokenizer_fingerprint=_fp(teacher))
    with pytest.raises(ScoreInputError, match=f"score_prompt cannot score.*{row['sample_id']}"):
        score(_cfg(tmp_path, teacher, score_prompt=True), llm=llm)
    write_rollouts(tmp_path / "r2" / "r.parquet", [empty], tokenizer_fingerprint=_fp(teacher))
    with pytest.raises(ScoreInputError, match=f"is empty.*{empty['sample_id']}"):
        score(_cfg(tmp_path, teacher, rollouts=str(tmp_path / "r2")), llm=llm)


# -- self-teacher: base + LoRA adapter ----------------------------------------------------------------------------


def _random_adapter(base: Path, out: Path, rank: int = 4) -> Path:
    """A peft LoRA adapter with a non-zero B (peft's B = 0 would change nothing), on attention and MLP."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(5)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), LoraConfig(
        r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(out)
    return out


def test_base_plus_adapter_teacher_scores_like_peft_merged_model(tmp_path, teacher, llm):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from pipeline.config import ConfigError
    from pipeline.store.fingerprint import adapter_fingerprint, teacher_fingerprint

    adapter = _random_adapter(teacher, tmp_path / "adapter")
    rows = _rollouts(tmp_path / "rollouts" / "r.parquet", [(5, 9), (12, 20), (3, 1)], teacher, seed=4)
    score(_cfg(tmp_path, teacher, cache=str(tmp_path / "base")), llm=llm)  # the base alone: another teacher
    with pytest.raises(CacheMismatchError, match="teacher_fingerprint: cache has"):
        score(_cfg(tmp_path, teacher, cache=str(tmp_path / "base"), teacher_adapter=str(adapter)))  # before an engine
    with pytest.raises(ConfigError, match="cannot score through an engine passed to score"):
        score(_cfg(tmp_path, teacher, teacher_adapter=str(adapter)), llm=llm)
    with pytest.raises(ConfigError, match="not a peft LoRA folder"):
        score(_cfg(tmp_path, teacher, teacher_adapter=str(tmp_path)))
    # Through the CLI in its own process: the stage opens an engine on the merged folder, and a second engine in
    # this process would tear down vLLM's process groups under the module's `llm` when it shuts down.
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent)}
    base = _score_cmd(tmp_path, teacher, tmp_path / "cache")
    at = base.index(f"max_model_len={MAX_LEN}")  # flags before the key=value overrides
    cmd = [*base[:at], "--teacher-adapter", str(adapter), *base[at:], f"merge_dir={tmp_path / 'tmp'}"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "scored 3 samples" in out.stdout
    assert not list((tmp_path / "tmp").iterdir())  # the merged folder is gone
    desc = TeacherCache.open(tmp_path / "cache").descriptor
    assert desc.teacher_fingerprint == adapter_fingerprint(teacher_fingerprint(teacher), adapter)
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32),
                                       adapter).merge_and_unload().eval()
    base = {s.sample_id: s for s in read_cache(tmp_path / "base")}
    for s in read_cache(tmp_path / "cache"):
        r = next(r for r in rows if r["sample_id"] == s.sample_id)
        ids, P = r["prompt_ids"] + r["completion_ids"], len(r["prompt_ids"])
        with torch.no_grad():
            ref = torch.log_softmax(merged(torch.tensor([ids])).logits[0], -1).double().numpy()[P - 1: len(ids) - 1]
        tol = 1e-3 + 1 / 64  # vLLM vs transformers on the same merged fp32 weights (~1e-5) + the codec's error
        np.testing.assert_allclose(s.actual_logprobs, ref[np.arange(len(ids) - P), ids[P:]], atol=tol)
        np.testing.assert_allclose(s.topk_logprobs, np.take_along_axis(ref, s.topk_ids.astype(np.int64), 1), atol=tol)
        # the adapter matters: the base's rows are visibly different
        assert np.abs(base[s.sample_id].actual_logprobs - s.actual_logprobs).max() > 0.1


# -- routing: one teacher per tag ---------------------------------------------------------------------------------


def test_tags_score_only_the_rollouts_of_those_tags(tmp_path, teacher, llm, capsys):
    """--tags A scores the A rows only (the rest counted); --tags B into the same cache is another task that adds the
    B rows; rows without the tag key are scored by neither; the stored rows keep their tags."""
    rng = np.random.default_rng(3)
    rows = [rollout_row(prompt_id=f"t{i}", prompt_ids=rng.integers(3, 384, 4).tolist(),
                        completion_ids=rng.integers(3, 384, 5).tolist(), source="dataset",
                        tags={"task": tag} if tag else {"data_source": "x"})
            for i, tag in enumerate(["A", "A", "B", "C", None, "B", "A"])]
    write_rollouts(tmp_path / "rollouts" / "r.parquet", rows, tokenizer_fingerprint=_fp(teacher))
    a = score(_cfg(tmp_path, teacher, tags=["A"], tag_key="task"), llm=llm)
    assert a["scored"] == 3 and a["skipped"]["other_tags"] == 4
    b = score(_cfg(tmp_path, teacher, tags=["B", "C"], tag_key="task"), llm=llm)
    assert b["scored"] == 3 and b["skipped"]["other_tags"] == 4
    assert score(_cfg(tmp_path, teacher, tags=["C", "B"], tag_key="task"), llm=llm)["done_before"]  # same selection
    stored = [r for p in TeacherCache.open(tmp_path / "cache").shard_paths()
              for r in pq.read_table(p, columns=["sample_id", "tags"]).to_pylist()]
    by_id = {r["sample_id"]: r for r in rows}
    assert sorted(dict(r["tags"])["task"] for r in stored) == ["A", "A", "A", "B", "B", "C"]
    assert all(dict(r["tags"]) == by_id[r["sample_id"]]["tags"] for r in stored)
    assert status(_cfg(tmp_path, teacher, tags=["A"], tag_key="task")) == 0
    assert status(_cfg(tmp_path, teacher, tags=["Z"], tag_key="task")) == 1  # never scored: a task of its own
    capsys.readouterr()


def test_tags_flag_parses_a_comma_list():
    from pipeline.score.run import parse_args

    cfg, _ = parse_args(["--tags", "math,code", "--tag-key", "task"])
    assert (cfg.tags, cfg.tag_key) == (["math", "code"], "task")
    from pipeline.config import ConfigError

    with pytest.raises(ConfigError, match="tags must be non-empty strings"):
        parse_args(["tags=['']"])
