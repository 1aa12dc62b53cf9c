import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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
    """Kill the writer at several points; readers only ever see complete shards; a rerun finishes the set."""
    root, n = tmp_path / "cache", 6
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    cmd = [sys.executable, str(HERE / "_kill_writer.py"), str(root), str(n)]
    for delay in (0.8, 1.2, 1.6, 2.0):
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if not (root / "shards").exists():
            continue
        cache = TeacherCache.open(root)
        for p in cache.shard_paths():  # everything a reader can see verifies
            assert verify_shard(p, "scored") == [], p
            open_shard(p, "scored")
        visible = [p.name for p in (root / "shards").iterdir() if not p.name.startswith(".")]
        assert all(name.endswith((".parquet", ".ok")) for name in visible)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    cache = TeacherCache.open(root)
    assert len(cache.shard_paths()) == n
    assert cache.verify() == []
    assert not [p for p in (root / "shards").iterdir() if p.name.startswith(".")]
