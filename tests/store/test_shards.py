import os
import subprocess
import sys
import time
from pathlib import Path

import killing
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.store import SchemaError, TeacherCache
from pipeline.store.rollouts import assign_shard, iter_rollouts, rollout_row, write_rollouts
from pipeline.store.schema import META_KEY, load_schema
from pipeline.store.shards import ShardError, is_complete, open_shard, verify_shard

HERE = Path(__file__).parent


def _rows(n=3):
    return [
        rollout_row(prompt_id=f"p{i}", prompt_ids=[1, 2, 3], completion_ids=[4, 5 + i], source="student", policy_version=i, finish_reason="stop", tags={"task": "t"})
        for i in range(n)
    ]


def test_rollout_round_trip(tmp_path):
    rows = _rows()
    write_rollouts(tmp_path / "r.parquet", rows)
    back = list(iter_rollouts([tmp_path / "r.parquet"]))
    assert back == rows


def test_rollout_row_requires_policy_version_for_student_rows():
    with pytest.raises(ValueError, match="policy_version"):
        rollout_row(prompt_id="p", prompt_ids=[1], completion_ids=[2], source="student")


def test_shard_complete_only_after_marker_and_rewrite_refused(tmp_path):
    path = tmp_path / "r.parquet"
    assert not is_complete(path, "rollout")
    write_rollouts(path, _rows())
    assert is_complete(path, "rollout")
    with pytest.raises(ShardError, match="already complete"):
        write_rollouts(path, _rows())


def test_unknown_major_version_refused_naming_file_and_version(tmp_path):
    path = tmp_path / "r.parquet"
    write_rollouts(path, _rows())
    table = pq.read_table(path)
    table = table.replace_schema_metadata({META_KEY: b"rollout/9.1"})
    bad = tmp_path / "bad.parquet"
    pq.write_table(table, bad)
    with pytest.raises(SchemaError, match=r"bad\.parquet.*9\.1"):
        from pipeline.store.schema import check_arrow_schema

        check_arrow_schema(pq.read_schema(bad), "rollout", bad)


def test_wrong_kind_refused(tmp_path):
    path = tmp_path / "r.parquet"
    write_rollouts(path, _rows())
    problems = verify_shard(path, "scored")
    assert problems and "'rollout' file" in problems[0]


def test_rows_not_matching_schema_refused(tmp_path):
    from pipeline.store.shards import write_shard

    with pytest.raises(SchemaError, match="rollout.json"):
        write_shard(tmp_path / "x.parquet", pa.table({"sample_id": ["a"]}), "rollout")


def test_assign_shard_is_deterministic_and_spread():
    keys = [f"k{i}" for i in range(1000)]
    a = [assign_shard(k, 4) for k in keys]
    assert a == [assign_shard(k, 4) for k in keys]
    assert min(a.count(i) for i in range(4)) > 200


def test_schema_files_build_arrow_schemas():
    for kind in ("rollout", "scored", "descriptor"):
        s = load_schema(kind)
        assert s.arrow.metadata[META_KEY] == f"{kind}/{s.version}".encode()


def test_sigkill_leaves_no_partial_shard_and_rerun_completes(tmp_path):
    """Kill the writer inside write_shard (it announces each shard just before writing it): half the kills as soon
    as the shard's temporary file appears, half at random offsets after the announcement. At least one kill must
    have left a half-written temporary file behind (proof that it landed mid-write); readers only ever see complete
    shards; a rerun finishes the set and removes the leftovers."""
    import random

    root, n = tmp_path / "cache", 6
    shard_dir = root / "shards"
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    cmd = [sys.executable, str(HERE / "_kill_writer.py"), str(root), str(n)]
    rng, mid_write = random.Random(0), 0
    for attempt in range(10):
        # even attempts: the writer stops itself with its shard's data in the temporary, not yet renamed, and dies
        # there (exactly mid-write however loaded the machine); odd ones: a kill at a random moment
        proc = killing.start(cmd, "shard-temporary:1" if attempt % 2 == 0 else "", env=env, stdout=subprocess.PIPE,
                             text=True)
        line = proc.stdout.readline().split()
        if line[:1] != ["writing"]:  # nothing left to write
            proc.wait()
            break
        name = line[1]
        if attempt % 2 == 0:
            killing.wait_stopped(proc)
        else:
            time.sleep(rng.uniform(0.0, 0.2))
        killing.kill(proc)
        if list(shard_dir.glob(f".{name}.parquet.tmp-*")) and not is_complete(shard_dir / f"{name}.parquet", "scored"):
            mid_write += 1
        cache = TeacherCache.open(root)
        for p in cache.shard_paths():  # everything a reader can see verifies
            assert verify_shard(p, "scored") == [], p
            open_shard(p, "scored")
        visible = [p.name for p in shard_dir.iterdir() if not p.name.startswith(".")]
        assert all(name.endswith((".parquet", ".ok")) for name in visible)
    print(f"[sigkill] {mid_write} kills landed mid-write", file=sys.stderr)
    assert mid_write >= 5, "a kill at the shard-temporary point did not land mid-write: the test proved nothing"
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr
    cache = TeacherCache.open(root)
    assert len(cache.shard_paths()) == n
    assert cache.verify() == []
    assert not [p for p in shard_dir.iterdir() if p.name.startswith(".")]


def test_fields_of_a_later_minor_version_may_be_absent_from_older_files(tmp_path):
    """A rollout shard of schema 1.1 has no teacher_prompt_ids: it is accepted and read as null; a file lacking a
    field every version has is still refused."""
    from pipeline.store.schema import check_arrow_schema

    rows = [{**r, "teacher_prompt_ids": [9, 8]} for r in _rows(2)]
    write_rollouts(tmp_path / "r.parquet", rows)
    assert [r["teacher_prompt_ids"] for r in iter_rollouts([tmp_path / "r.parquet"])] == [[9, 8], [9, 8]]
    assert "teacher_prompt_ids" in load_schema("rollout").optional
    table = pq.read_table(tmp_path / "r.parquet").drop_columns(["teacher_prompt_ids"])
    old = tmp_path / "old.parquet"
    pq.write_table(table.replace_schema_metadata({META_KEY: b"rollout/1.1"}), old)
    check_arrow_schema(pq.read_schema(old), "rollout", old)
    broken = tmp_path / "broken.parquet"
    pq.write_table(table.drop_columns(["tags"]).replace_schema_metadata({META_KEY: b"rollout/1.1"}), broken)
    with pytest.raises(SchemaError, match="broken.parquet: missing field 'tags'"):
        check_arrow_schema(pq.read_schema(broken), "rollout", broken)
    # a writer given rows without the new field fills it with nulls
    write_rollouts(tmp_path / "plain.parquet", _rows(1))
    assert next(iter_rollouts([tmp_path / "plain.parquet"]))["teacher_prompt_ids"] is None
